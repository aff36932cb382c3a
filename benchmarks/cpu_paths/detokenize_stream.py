"""CPU time per output token of the tokenizer service's text path: incremental detokenization,
the stop-string check and the text delta, as `TextStream` runs them for each token.

    python benchmarks/cpu_paths/detokenize_stream.py [--model DIR] [--tokens 2000] [--runs 3]

Before: `IncrementalDetokenizer` (two Python `decode` calls per token through transformers'
tokenizer). After: what the service builds now, `make_detokenizer` over the light tokenizer
(`DecodeStream.step` in Rust, engine/api/stream_detokenizer.py). Both run in this process,
interleaved, `--runs` times over the same token ids (a multilingual text of `--tokens` tokens,
fed one token at a time), with and without stop strings. Prints CPU-us per token (process
time), the median and spread of the runs, and after/before; the texts are checked equal.

--model: a directory with tokenizer.json (default: the default model's converted files).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

TEXT = (
    "The quick brown fox jumps over the lazy dog. Grüße aus München, Straße und Käse! "
    "日本語のテキストと中文文本，还有한국어 문장. Emoji 🙂🚀👍🏽 and symbols ∑ ≤ ≥ → «quotes». "
    "def add(a, b):\n    return a + b\n\nNumbers 1234567890, 3.14159; the end of a paragraph.\n"
)
STOPS = ["\n\nUser:", "<|im_end|>", "THE END"]  # never in TEXT: every token is checked


def _model_dir(model: str | None) -> Path:
    if model:
        return Path(model)
    from tests.model_utils import _copy_tokenizer  # the default model's converted files

    directory = Path(tempfile.mkdtemp(prefix="detok-bench-"))
    _copy_tokenizer(None, directory)
    return directory


def _run(make, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[float, str]:
    """CPU-us per token of feeding `ids` one at a time, as TextStream does."""
    detok = make(prompt, stop)
    sent = 0
    start = time.process_time()
    for token_id in ids:
        detok.update([token_id])
        delta = detok.get_text(False)[sent:]
        sent += len(delta)
    text = detok.get_text(True)
    return (time.process_time() - start) / len(ids) * 1e6, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a directory with tokenizer.json")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.api.detokenizer import IncrementalDetokenizer
    from engine.api.stream_detokenizer import make_detokenizer
    from services.tokenizer_service.light_tokenizer import load_light_tokenizer

    directory = _model_dir(args.model)
    hf = AutoTokenizer.from_pretrained(directory)
    light = load_light_tokenizer(directory)
    ids: list[int] = []
    while len(ids) < args.tokens:
        ids += hf(TEXT, add_special_tokens=False).input_ids
    ids = ids[: args.tokens]
    prompt = hf("Write a long multilingual story.", add_special_tokens=False).input_ids

    def before(prompt: list[int], stop: list[str]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(hf, prompt, stop=stop)

    def after(prompt: list[int], stop: list[str]) -> IncrementalDetokenizer:
        return make_detokenizer(light, prompt, stop=stop)

    for label, stop in (("stop strings", STOPS), ("no stop strings", [])):
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.runs):
            us_before, text_before = _run(before, prompt, ids, stop)
            us_after, text_after = _run(after, prompt, ids, stop)
            assert text_before == text_after, "the two paths disagree"
            times["before"].append(us_before)
            times["after"].append(us_after)
        print(f"{label} ({args.tokens} tokens, {args.runs} runs):")
        for name, values in times.items():
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(
                f"  {name:6s} {statistics.median(values):7.2f} CPU-us/token "
                f"(runs {runs}; spread {max(values) - min(values):.2f})"
            )
        ratio = statistics.median(times["after"]) / statistics.median(times["before"])
        print(f"  after/before {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
