"""`python -m engine "question"`: streams a chat answer from the default model, offline.

Shows the engine loop a server runs: add a request, call `step()` until it finishes, print
each delta as it arrives.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model))
    print(f"[engine ready in {time.perf_counter() - start:.1f}s]", file=sys.stderr)

    tokenizer = engine.get_tokenizer()
    messages = [{"role": "user", "content": args.prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    params = SamplingParams(
        temperature=args.temperature,
        seed=args.seed,
        max_tokens=args.max_tokens,
        output_kind=RequestOutputKind.DELTA,
    )
    engine.add_request("demo", {"prompt_token_ids": list(ids)}, params)

    print(f"> {args.prompt}\n")
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            delta = output.outputs[0]
            num_tokens += len(delta.token_ids)
            print(delta.text, end="", flush=True)
            if output.finished:
                elapsed = time.perf_counter() - start
                print(
                    f"\n\n[{num_tokens} tokens in {elapsed:.2f}s, "
                    f"finish_reason={delta.finish_reason}]",
                    file=sys.stderr,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
