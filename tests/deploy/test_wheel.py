"""The `pagedserve` package is whole: a wheel built from the images' build context, installed
outside the checkout, serves the default model with its native kernels built.

Every other test runs from the editable checkout, where any file the code opens by path is
simply there; a non-editable install (the images, `pip install .`, a wheel) has only what
pyproject.toml ships. So the wheel is built here the way a user or the image builds it
(sdist first, the wheel from the sdist), installed into a fresh virtual environment in a
temporary folder with no repository on `sys.path` and the working directory outside it, and
`pagedserve serve --demo` must answer from it, having compiled the C kernels from the sources
the wheel carries.

The dependencies are not downloaded again: the fresh environment sees this environment's
installed packages through a folder of links (all but pagedserve's own), and pip resolves the
wheel's requirements against them with `--no-index`, so a requirement nothing satisfies
still fails the install.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

from tests.deploy.build_context import ROOT, copy_build_context
from tests.services.processes import free_port

# The import packages of the distribution; in the wheel, `pagedserve` comes from proto/.
PACKAGES = {
    "engine": "engine",
    "kernels": "kernels",
    "services": "services",
    "clients": "clients",
    "proto/pagedserve": "pagedserve",
}
# Not part of the distribution: the separate client wheel's packaging files.
NOT_SHIPPED = ("clients/packaging/",)


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel built from it (no build isolation: setuptools comes from this
    environment, so nothing is downloaded)."""
    work = tmp_path_factory.mktemp("wheel")
    context = copy_build_context(work / "context")
    command = [sys.executable, "-m", "build", "--no-isolation"]
    done = subprocess.run(
        [*command, "--outdir", str(work / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=work,
        env=_clean_env(),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (wheel,) = (work / "dist").glob("pagedserve-*.whl")
    (sdist,) = (work / "dist").glob("pagedserve-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _package_files() -> dict[str, str]:
    """Every file of the import packages in the checkout (the repository path -> its path
    inside the wheel), Python or not, caches and compiled files aside."""
    files = {}
    for source, package in PACKAGES.items():
        for path in (ROOT / source).rglob("*"):
            relative = path.relative_to(ROOT).as_posix()
            if not path.is_file() or "__pycache__" in relative or path.suffix in (".pyc", ".so"):
                continue
            if relative.startswith(NOT_SHIPPED):
                continue
            files[relative] = package + relative[len(source) :]
    return files


def test_the_wheel_and_the_sdist_carry_every_file_of_the_packages(dist) -> None:
    expected = _package_files()
    # The files this test exists for are among them (the kernels' C sources and headers).
    native = [path for path in expected if path.startswith("engine/native/")]
    assert any(p.endswith(".c") for p in native) and any(p.endswith(".h") for p in native)
    assert "proto/pagedserve/v1/generation.proto" in expected

    in_wheel = set(zipfile.ZipFile(dist["wheel"]).namelist())
    assert sorted(set(expected.values()) - in_wheel) == []
    with tarfile.open(dist["sdist"]) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        in_sdist = {name.removeprefix(top + "/") for name in sdist.getnames()}
    assert sorted(set(expected) - in_sdist) == []


def _site_packages(python: Path) -> Path:
    done = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(done.stdout.strip())


def _link_installed_dependencies(target: Path) -> Path:
    """Links to every entry of this environment's site-packages except pagedserve's own
    (its editable-install hook and metadata) and anything the wheel itself provides. `.pth`
    files are left out too: a folder on `sys.path` through a `.pth` line does not have its own
    `.pth` files run, so the editable install's path hook could not come back that way."""
    target.mkdir()
    provided = {package.split("/")[0] for package in PACKAGES.values()}
    for folder in site.getsitepackages():
        for entry in Path(folder).iterdir():
            name = entry.name
            if (
                name.startswith(("__editable__", "pagedserve", "__pycache__"))
                or name.endswith((".pth", ".egg-link"))
                or name in provided
                or (target / name).exists()
            ):
                continue
            (target / name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment, outside the checkout, with the wheel installed: its root."""
    work = tmp_path_factory.mktemp("installed")
    env_dir = work / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    deps = _link_installed_dependencies(work / "deps")
    (_site_packages(python) / "installed-dependencies.pth").write_text(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    install = subprocess.run(
        [*pip, "--no-cache-dir", "--no-compile", "-q", str(dist["wheel"])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=work,
        env=_clean_env(),
    )
    assert install.returncode == 0, (install.stdout + install.stderr)[-3000:]
    return env_dir


WHERE = """
import importlib.util, json, sys
names = ["engine", "engine.native", "services", "clients", "kernels", "pagedserve.v1"]
print(json.dumps({n: importlib.util.find_spec(n).origin for n in names}))
"""


def test_the_installed_packages_come_from_the_fresh_environment(installed, tmp_path) -> None:
    done = subprocess.run(
        [str(installed / "bin" / "python"), "-c", WHERE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    origins = json.loads(done.stdout)
    for name, origin in origins.items():
        assert Path(origin).is_relative_to(installed), (name, origin)
        assert not Path(origin).is_relative_to(ROOT), (name, origin)
    native = Path(origins["engine.native"]).parent
    assert (native / "cpu_kernels.c").is_file() and (native / "quant_types.h").is_file()


@pytest.mark.slow
def test_serve_demo_answers_from_the_installed_wheel_with_the_native_kernels(
    installed, tmp_path
) -> None:
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the native kernels cannot be built here")
    kernels = tmp_path / "kernels"  # empty: the kernels must be compiled from the wheel
    port, engine_port = free_port(), free_port()
    argv = [str(installed / "bin" / "pagedserve"), "serve", "--demo", "--port", str(port)]
    argv += ["--engine-addr", f"127.0.0.1:{engine_port}", "--max-tokens", "32"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=_clean_env(PAGEDSERVE_KERNEL_CACHE_DIR=str(kernels)),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "> What is the capital of France?" in done.stdout
    assert "Paris" in done.stdout, done.stdout
    assert "through the public API" in done.stderr
    assert "unavailable" not in done.stderr, done.stderr[-2000:]
    assert list(kernels.glob("cpu_kernels-*.so")), "the native kernels were not built"
