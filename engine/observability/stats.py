"""Engine statistics for `LLMEngine.do_log_stats()` (a periodic log line, as vLLM's)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("engine.observability.stats")


@dataclass
class StepStats:
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0


@dataclass
class StatLogger:
    """Accumulates token counts between two log lines."""

    last_log_time: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Totals since start (never reset), for tests and metrics.
    total_prompt_tokens: int = 0
    total_generation_tokens: int = 0
    was_idle: bool = False  # nothing happened during the previous interval

    def record_step(self, stats: StepStats) -> None:
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        self.total_prompt_tokens += stats.num_prompt_tokens
        self.total_generation_tokens += stats.num_generation_tokens

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        self.prefix_queries += queries
        self.prefix_hits += hits

    def log(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> str:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        hit_rate = 100.0 * self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        line = (
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {num_running} reqs, Waiting: {num_waiting} reqs, "
            f"KV cache usage: {100.0 * kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        # A server logs every few seconds: once idle, repeats of the idle line go to DEBUG.
        idle = not (self.num_prompt_tokens or self.num_generation_tokens)
        idle = idle and num_running == num_waiting == 0
        logger.log(logging.DEBUG if idle and self.was_idle else logging.INFO, line)
        self.was_idle = idle
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.prefix_queries = self.prefix_hits = 0
        return line
