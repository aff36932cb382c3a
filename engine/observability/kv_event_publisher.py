"""Hands the block pool's prefix-cache events (engine/core/kv_events.py) to asyncio
subscribers, one batch per engine step.

    engine thread: step() ─▶ publish()  ── call_soon_threadsafe ──▶  subscriber queues

A new subscriber first gets a snapshot (a `BlockStored` for every block cached at that
moment, parents first), taken on the engine thread in the same command that turns recording
on, so no event falls between the snapshot and the stream. A subscriber that stops reading
is dropped once `max_queued_batches` pile up (it must resubscribe and start from a fresh
snapshot) rather than growing without bound.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.kv_events import BlockStored, KVCacheEvent, KVEventRecorder

logger = logging.getLogger(__name__)

_MAX_QUEUED_BATCHES = 1024


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    sequence_number: int  # per subscriber: 0 is the snapshot, then one per published step
    timestamp: float  # time.time() when the batch was made
    events: Sequence[KVCacheEvent]


class KVEventSubscription:
    """One subscriber's queue of batches; `None` in the queue means it was dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_queued_batches: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[KVEventBatch | None] = asyncio.Queue()
        self.max_queued_batches = max_queued_batches
        self.sequence = itertools.count()
        self.closed = False

    def put(self, events: Sequence[KVCacheEvent]) -> None:
        """Engine thread: queue a batch (wakes the subscriber's event loop)."""
        batch = KVEventBatch(next(self.sequence), time.time(), events)
        try:
            self.loop.call_soon_threadsafe(self._put, batch)
        except RuntimeError:  # its loop is closed
            self.closed = True

    def _put(self, batch: KVEventBatch) -> None:
        if self.closed:
            return
        if self.queue.qsize() >= self.max_queued_batches:
            logger.warning("KV-event subscriber too slow: dropped")
            self.closed = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(batch)


class KVEventPublisher:
    """Owned by the engine thread; `subscribe` / `unsubscribe` come from event loops."""

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.recorder = KVEventRecorder()
        block_pool.kv_event_recorder = self.recorder
        self._lock = threading.Lock()
        self._subscribers: list[KVEventSubscription] = []

    def add_subscriber(self, subscription: KVEventSubscription) -> None:
        """Engine thread: snapshot the cached blocks and start recording, in one go."""
        subscription.put(cached_blocks_snapshot(self.block_pool))
        with self._lock:
            self._subscribers.append(subscription)
            self.recorder.set_active(True)

    def remove_subscriber(self, subscription: KVEventSubscription) -> None:
        """Any thread."""
        subscription.closed = True
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)
            if not self._subscribers:
                self.recorder.set_active(False)

    def publish(self) -> None:
        """Engine thread, after each step: the step's events to every subscriber."""
        events = self.recorder.take()
        if not events:
            return
        with self._lock:
            subscribers = [s for s in self._subscribers if not s.closed]
        for subscription in subscribers:
            subscription.put(events)


def cached_blocks_snapshot(pool: BlockPool) -> list[KVCacheEvent]:
    """A `BlockStored` per cached block, in caching order (a parent is always cached before
    its children, so a router can rebuild the chains in one pass)."""
    blocks = [b for bucket in pool.cached_blocks.values() for b in bucket.values()]
    blocks.sort(key=lambda b: b.cache_id or 0)
    by_cache_id = {b.cache_id: b for b in blocks}
    events: list[KVCacheEvent] = []
    for block in blocks:
        assert block.block_hash is not None and block.token_ids is not None
        parent = by_cache_id.get(block.parent_cache_id)
        parent_hash = None if parent is None else parent.block_hash
        events.append(BlockStored(block.block_hash, parent_hash, block.token_ids))
    return events
