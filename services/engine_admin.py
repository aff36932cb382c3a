"""The engine service's operator RPCs: profiling (and, with them, the engine's other
lifecycle calls). Each is a thin proto → `AsyncLLMEngine` call → proto translation; the
engine-level API (`start_profile()` ...) is the one thing every servicer calls.

Mixed into `EngineServicer`, which provides `_ready_engine()`.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from engine import AsyncLLMEngine
from pagedserve.v1 import engine_pb2
from services.errors import ServiceError, rpc_method

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
