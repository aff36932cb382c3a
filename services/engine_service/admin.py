"""The engine service's operator RPCs: profiling and sleep mode. Each is a thin
proto → `AsyncLLMEngine` call → proto translation; the engine-level API
(`start_profile()`, `sleep()` ...) is the one thing every servicer calls.

Mixed into `EngineServicer`, which provides `_ready_engine()`.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from engine import AsyncLLMEngine
from engine.worker.sleep import SLEEP_TAGS
from pagedserve.v1 import engine_pb2
from services.common.errors import ServiceError, invalid_argument, rpc_method

logger = logging.getLogger("services.engine")


def _precondition(exc: Exception) -> ServiceError:
    """An operator call the engine's state refuses (profiling not configured, a session
    already running / none running): FAILED_PRECONDITION with the engine's reason."""
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


class EngineAdminRpcs:
    def _ready_engine(self) -> AsyncLLMEngine:  # provided by EngineServicer
        raise NotImplementedError

    @rpc_method
    async def StartProfile(
        self, request: engine_pb2.StartProfileRequest, context: Any
    ) -> engine_pb2.StartProfileResponse:
        try:
            await self._ready_engine().start_profile()
        except (ValueError, RuntimeError) as exc:
            raise _precondition(exc) from exc
        logger.info("profiling started")
        return engine_pb2.StartProfileResponse()

    @rpc_method
    async def StopProfile(
        self, request: engine_pb2.StopProfileRequest, context: Any
    ) -> engine_pb2.StopProfileResponse:
        try:
            path = await self._ready_engine().stop_profile()
        except RuntimeError as exc:
            raise _precondition(exc) from exc
        logger.info("profiling stopped", extra={"trace_path": str(path)})
        return engine_pb2.StopProfileResponse(trace_paths=[str(path)])

    @rpc_method
    async def Sleep(
        self, request: engine_pb2.SleepRequest, context: Any
    ) -> engine_pb2.SleepResponse:
        level = request.level or 1
        if level not in (1, 2):
            raise invalid_argument(f"level must be 1 or 2, got {level}")
        try:
            await self._ready_engine().sleep(level)
        except RuntimeError as exc:
            raise _precondition(exc) from exc
        logger.info("engine asleep", extra={"level": level})
        return engine_pb2.SleepResponse()

    @rpc_method
    async def WakeUp(
        self, request: engine_pb2.WakeUpRequest, context: Any
    ) -> engine_pb2.WakeUpResponse:
        tags = list(request.tags) or None
        for i, tag in enumerate(tags or []):
            if tag not in SLEEP_TAGS:
                raise invalid_argument(f"tags[{i}] = {tag!r} is not one of {list(SLEEP_TAGS)}")
        await self._ready_engine().wake_up(tags)
        logger.info("engine woken up", extra={"tags": ",".join(tags or SLEEP_TAGS)})
        return engine_pb2.WakeUpResponse()

    @rpc_method
    async def IsSleeping(
        self, request: engine_pb2.IsSleepingRequest, context: Any
    ) -> engine_pb2.IsSleepingResponse:
        return engine_pb2.IsSleepingResponse(is_sleeping=await self._ready_engine().is_sleeping())
