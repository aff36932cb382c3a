"""Row-count buckets: the step sizes the linear-method and quantized-route trials time apart.

Which GEMM implementation (engine/layers/linear_select.py) or quantized route
(engine/layers/quant_select.py) is fastest depends most of all on how many activation rows a
step has, so both trials decide per bucket of row counts, and the layers look their step's
bucket up on every call (`BUCKET_OF`: a list index on the hot path). Apart from both trials
because both, the cache key (method_cache.py) and the quantized layers
(engine/layers/quantization.py) share these boundaries.
"""

from __future__ import annotations

# Inclusive row-count ranges; the last is open. Each is timed at its `BUCKET_ROWS` size.
# 33..64 and 65..128 are apart because a batch of 64 decode rows is common and its winner
# can differ from 128's (our GEMM vs oneDNN on a 2-core Zen 4).
ROW_BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 32), (33, 64), (65, 128), (129, None))
BUCKET_ROWS = (1, 4, 8, 32, 64, 128, 256)
# Per-row-count bucket index for rows 0..128; above that the last bucket.
BUCKET_OF = [0] + [
    next(i for i, (lo, hi) in enumerate(ROW_BUCKETS) if lo <= r and (hi is None or r <= hi))
    for r in range(1, 130)
]


def bucket_of(rows: int) -> int:
    """The `ROW_BUCKETS` index of a step with `rows` activation rows (rows >= 1)."""
    return BUCKET_OF[min(rows, 129)]
