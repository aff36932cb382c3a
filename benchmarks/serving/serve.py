"""Serving benchmark against a running public API: the same as `pagedserve bench serve`.

    pagedserve serve --prompt "" &          # or any running tokenizer service
    python benchmarks/serving/serve.py --num-prompts 32 --random-input-len 64 \
        --random-output-len 64 \
        --request-rate inf --max-concurrency 16 --save-result

See clients/bench.py for the options and docs/benchmarks.md for recorded runs.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]  # runs from a checkout without installing

from clients.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
