"""One engine's start-up measured alone, in a fresh interpreter (benchmarks/offline/throughput.py):

    python benchmarks/offline/ready_probe.py pagedserve '{"quantization": "auto"}'
    python benchmarks/offline/ready_probe.py llama.cpp '{"path": "model.gguf", ...}'

prints one JSON line: `ready_s` (seconds until the engine is ready to generate; torch is
imported before the clock starts for pagedserve, never for llama.cpp), `peak_rss_mib` (the
process's own high-water mark, VmHWM: imports, weights, warm-up) and `import_s`.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def process_peak_rss_mib() -> float:
    """VmHWM: this process's peak RSS (ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ready_in_fresh_process(kind: str, kwargs: dict) -> tuple[float, float]:
    """Start-up alone (benchmarks/offline/ready_probe.py), where nothing else has been imported or
    allocated yet: (seconds to ready, peak RSS MiB)."""
    probe = Path(__file__).with_name("ready_probe.py")
    args = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items()})
    done = subprocess.run(
        [sys.executable, str(probe), kind, args], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ready_s, rss_mib = result["ready_s"], result["peak_rss_mib"]
    print(
        f"{kind:>22}: ready in {ready_s:.2f} s (imports before: {result['import_s']:.2f} s), "
        f"peak RSS {rss_mib:.0f} MiB (fresh process)"
    )
    return ready_s, rss_mib


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", help="pagedserve or llama.cpp")
    parser.add_argument("kwargs", help="the engine's keyword arguments, as JSON")
    args = parser.parse_args()
    kind, kwargs = args.kind, json.loads(args.kwargs)
    start = time.perf_counter()
    if kind == "llama.cpp":
        from llamacpp_baseline import load_llamacpp

        imported = time.perf_counter()
        load_llamacpp(**kwargs)
    else:
        from engine import LLM

        imported = time.perf_counter()
        LLM(**kwargs)
    ready = time.perf_counter()
    result = {
        "ready_s": ready - imported,
        "import_s": imported - start,
        "peak_rss_mib": process_peak_rss_mib(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
