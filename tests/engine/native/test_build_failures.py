"""When the native kernels fall back to pure torch, and when they fail: only a machine
without a C compiler falls back (and the kernels' tests skip); a compiler that rejects the
sources raises `NativeKernelError` naming the compile error, from `load_library` and from
`native_kernels_available` alike, so a broken kernel fails the run (and its tests) instead
of being skipped. Real compiler runs on a broken copy of a source, in a temporary folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.native import build
from engine.native.build import NativeKernelError, NoCompilerError

COMPILER = shutil.which("cc") or shutil.which("gcc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no remembered result; both are cleared again after, so
    the rest of the session loads the real library again."""
    monkeypatch.setenv(build.KERNEL_CACHE_DIR_ENV, str(tmp_path / "kernels"))
    monkeypatch.delenv(build.NATIVE_KERNELS_ENV, raising=False)
    build.load_library.cache_clear()
    build.native_kernels_available.cache_clear()
    yield tmp_path
    build.load_library.cache_clear()
    build.native_kernels_available.cache_clear()


def _broken_copy(folder: Path) -> Path:
    """cpu_kernels.c with a syntax error at its end, beside copies of the headers."""
    for header in build._HEADERS:
        shutil.copy(header, folder / header.name)
    source = folder / "cpu_kernels.c"
    source.write_text(build._SOURCE.read_text() + "\nint broken( { return 0; }\n")
    return source


@needs_compiler
def test_a_compile_error_raises_naming_it(tmp_path) -> None:
    broken = _broken_copy(tmp_path)
    with pytest.raises(NativeKernelError, match="broken") as raised:
        build._build(COMPILER, tmp_path / "lib.so", build.compile_flags(), sources=(broken,))
    assert not isinstance(raised.value, NoCompilerError)
    assert not (tmp_path / "lib.so").exists()


@needs_compiler
def test_a_failed_build_is_not_reported_as_unavailable(fresh_build, monkeypatch) -> None:
    """What the tests' skip conditions ask: a build failure raises instead of answering
    False (which would skip the kernels' ~15 test modules and run the engine on torch)."""
    monkeypatch.setattr(build, "_SOURCE", _broken_copy(fresh_build))
    monkeypatch.setattr(build, "_EXTRA_SOURCES", ())
    with pytest.raises(NativeKernelError, match=build.NATIVE_KERNELS_ENV) as raised:
        build.native_kernels_available()
    assert "broken" in str(raised.value) and not isinstance(raised.value, NoCompilerError)


@pytest.mark.parametrize("cc", [None, "/nonexistent/bin/cc"], ids=["none-on-path", "cc-missing"])
def test_no_compiler_falls_back_to_torch(fresh_build, monkeypatch, cc) -> None:
    empty = fresh_build / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    if cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", cc)
    with pytest.raises(NoCompilerError):
        build.load_library()
    assert build.native_kernels_available() is False
