"""Waiting queues: first-come-first-served, or by priority (higher value first)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from engine.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Puts back a preempted request: it goes ahead of requests that arrived later."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """A heap ordered by (-priority, arrival time): priority 10 goes before priority 0.

    Removal is lazy: a removed request stays in the heap, marked, until it reaches the top.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, Request] = {}
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (-request.priority, request.arrival_time, next(self._counter), request)
        )
        self._live[request.request_id] = request

    def add_preempted(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) already places it correctly

    def _drop_removed(self) -> None:
        while self._heap and self._live.get(self._heap[0][3].request_id) is not self._heap[0][3]:
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[3]
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        if self._live.get(request.request_id) is request:
            del self._live[request.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._live.values(), key=lambda r: (-r.priority, r.arrival_time)))


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}.")
