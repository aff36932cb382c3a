"""The engine service's LoRA adapter RPCs (vLLM's load/unload_lora_adapter): adapters are
registered by name, and a Generate / Encode request names one in `lora_name`.

The registry (name -> `LoRARequest`) lives here, beside the engine: the engine keeps the
adapter weights loaded within `max_cpu_loras` (LRU) and reloads an evicted one from its
path when a request names it, so a registered name always works. Mixed into
`EngineServicer`, which provides `_ready_engine()`.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import grpc

from engine import AsyncLLMEngine, LoRARequest
from pagedserve.v1 import common_pb2
from services.common.errors import ServiceError, invalid_argument, rpc_method

logger = logging.getLogger("services.engine")


class LoraRegistry:
    def __init__(self) -> None:
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)


class EngineLoraRpcs:
    _lora_registry: LoraRegistry | None = None

    def _ready_engine(self) -> AsyncLLMEngine:  # provided by EngineServicer
        raise NotImplementedError

    @property
    def loras(self) -> LoraRegistry:
        if self._lora_registry is None:
            self._lora_registry = LoraRegistry()
        return self._lora_registry

    def lora_request_for(self, lora_name: str) -> LoRARequest | None:
        """The registered adapter a request names (None for the base model)."""
        if not lora_name:
            return None
        lora = self.loras.adapters.get(lora_name)
        if lora is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"lora_name {lora_name!r} is not a loaded adapter (LoadLoraAdapter first)",
            )
        return lora

    async def _lora_engine(self) -> AsyncLLMEngine:
        engine = self._ready_engine()
        if await engine.get_lora_config() is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "LoRA adapters are off: start the engine with --enable-lora",
            )
        return engine

    @rpc_method
    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: Any
    ) -> common_pb2.LoadLoraAdapterResponse:
        engine = await self._lora_engine()
        if not request.lora_name:
            raise invalid_argument("lora_name must not be empty")
        if not request.lora_path:
            raise invalid_argument("lora_path must not be empty")
        if request.lora_name in self.loras.adapters:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"lora_name {request.lora_name!r} is already loaded",
            )
        lora = LoRARequest(request.lora_name, self.loras.next_id(), request.lora_path)
        try:
            await engine.add_lora(lora)  # loads and checks it now
        except (ValueError, TypeError) as exc:
            raise invalid_argument(f"lora_path: {exc}") from exc
        self.loras.adapters[lora.lora_name] = lora
        logger.info("LoRA adapter loaded", extra={"lora_name": lora.lora_name})
        return common_pb2.LoadLoraAdapterResponse(lora_int_id=lora.lora_int_id)

    @rpc_method
    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: Any
    ) -> common_pb2.UnloadLoraAdapterResponse:
        engine = await self._lora_engine()
        lora = self.lora_request_for(request.lora_name)
        if lora is None:
            raise invalid_argument("lora_name must not be empty")
        del self.loras.adapters[lora.lora_name]
        await engine.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter unloaded", extra={"lora_name": lora.lora_name})
        return common_pb2.UnloadLoraAdapterResponse()

    @rpc_method
    async def ListLoraAdapters(
        self, request: common_pb2.ListLoraAdaptersRequest, context: Any
    ) -> common_pb2.ListLoraAdaptersResponse:
        adapters = [
            common_pb2.LoraAdapter(
                lora_name=lora.lora_name, lora_int_id=lora.lora_int_id, lora_path=lora.lora_path
            )
            for lora in self.loras.adapters.values()
        ]
        return common_pb2.ListLoraAdaptersResponse(adapters=adapters)
