"""The public API's LoRA admin RPCs: `LoadLoraAdapter`, `UnloadLoraAdapter` and
`ListLoraAdapters`, forwarded to every engine replica of the pool.

A request naming an adapter (`lora_name`) may be routed to any replica, so an adapter is
usable only once every replica has it:

    Load    every available replica loads it; if one refuses (or cannot be reached), the
            replicas that did load it unload it again, and the error names the refusing
            replica's address with its own status (INVALID_ARGUMENT for a bad adapter,
            ALREADY_EXISTS, ...). A replica that is down, or joins later, gets it when it
            becomes available, before anything is routed to it
            (services/tokenizer_service/replicas/lora_sync.py).
    Unload  every replica unloads it, down ones too (one that came back still holding it
            would serve it alone); the first error names its replica
    List    the adapters every available replica lists, in the first replica's order

Replicas number their adapters independently: `lora_int_id` in the answers is the first
replica's (replicas sorted by address). Admin-only with API keys (`services.security.tenancy`).
Mixed into `TextGenerationServicer`, which provides `backend` (the `EnginePool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from pagedserve.v1 import common_pb2
from services.common.errors import ServiceError, rpc_method
from services.tokenizer_service.replicas.engine_client import EngineBackend
from services.tokenizer_service.replicas.pool import EnginePool
from services.tokenizer_service.replicas.relay import outgoing_metadata

logger = logging.getLogger("services.tokenizer")

_LORA_RPC_TIMEOUT_S = 120.0  # loading reads and checks the adapter's weights
Reply = TypeVar("Reply")


class PublicLoraRpcs:
    backend: EnginePool  # provided by TextGenerationServicer

    def _lora_replicas(self, available_only: bool) -> list[EngineBackend]:
        """The replicas of the pool (only the available ones, or down ones too), but those
        serving another model, which get no requests (`EnginePool._accepts_model`)."""
        replicas = [
            self.backend.replicas[a]
            for a in sorted(self.backend.replicas)
            if not self.backend.replicas[a].serves_another_model
            and (self.backend.replicas[a].available or not available_only)
        ]
        if not replicas:
            known = "reachable" if available_only else "known"
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"no engine replica is {known} yet ({self.backend.address})",
            )
        return replicas

    async def _on_every_replica(
        self,
        replicas: list[EngineBackend],
        call: Callable[[EngineBackend], Awaitable[Reply]],
    ) -> list[Reply | ServiceError]:
        """`call` on each replica at once; an error becomes a ServiceError naming it."""

        async def one(replica: EngineBackend) -> Reply | ServiceError:
            try:
                return await call(replica)
            except grpc.aio.AioRpcError as exc:
                error = await replica.translate(exc)  # an unreachable one names itself
                if replica.address in error.message:
                    return error
                return ServiceError(
                    error.code, f"engine replica {replica.address}: {error.message}"
                )

        return list(await asyncio.gather(*(one(r) for r in replicas)))

    @rpc_method
    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: Any
    ) -> common_pb2.LoadLoraAdapterResponse:
        replicas = self._lora_replicas(available_only=True)
        metadata = outgoing_metadata(context)
        timeout = _timeout(context)
        replies = await self._on_every_replica(
            replicas,
            lambda r: r.stub.LoadLoraAdapter(request, timeout=timeout, metadata=metadata),
        )
        if errors := _errors(replies):
            # Keep the replicas consistent: an adapter only some of them have would make
            # requests naming it fail or not depending on the replica they are routed to.
            undo = common_pb2.UnloadLoraAdapterRequest(lora_name=request.lora_name)
            for replica, reply in zip(replicas, replies, strict=True):
                if not isinstance(reply, ServiceError):
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await replica.stub.UnloadLoraAdapter(
                            undo, timeout=timeout, metadata=metadata
                        )
            raise errors[0]
        logger.info(
            "LoRA adapter loaded on every engine replica",
            extra={"lora_name": request.lora_name, "replicas": len(replicas)},
        )
        first = replies[0]
        assert isinstance(first, common_pb2.LoadLoraAdapterResponse)
        return common_pb2.LoadLoraAdapterResponse(lora_int_id=first.lora_int_id)

    @rpc_method
    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: Any
    ) -> common_pb2.UnloadLoraAdapterResponse:
        metadata = outgoing_metadata(context)
        timeout = _timeout(context)
        replies = await self._on_every_replica(
            self._lora_replicas(available_only=False),
            lambda r: r.stub.UnloadLoraAdapter(request, timeout=timeout, metadata=metadata),
        )
        if errors := _errors(replies):
            raise errors[0]
        logger.info("LoRA adapter unloaded", extra={"lora_name": request.lora_name})
        return common_pb2.UnloadLoraAdapterResponse()

    @rpc_method
    async def ListLoraAdapters(
        self, request: common_pb2.ListLoraAdaptersRequest, context: Any
    ) -> common_pb2.ListLoraAdaptersResponse:
        replicas = self._lora_replicas(available_only=True)
        metadata = outgoing_metadata(context)
        timeout = _timeout(context)
        replies = await self._on_every_replica(
            replicas,
            lambda r: r.stub.ListLoraAdapters(request, timeout=timeout, metadata=metadata),
        )
        lists: list[common_pb2.ListLoraAdaptersResponse] = []
        for reply in replies:
            if isinstance(reply, ServiceError):
                raise reply
            lists.append(reply)
        on_every = set.intersection(*({a.lora_name for a in r.adapters} for r in lists))
        return common_pb2.ListLoraAdaptersResponse(
            adapters=[a for a in lists[0].adapters if a.lora_name in on_every]
        )


def _timeout(context: Any) -> float:
    remaining = context.time_remaining()
    return _LORA_RPC_TIMEOUT_S if remaining is None else min(remaining, _LORA_RPC_TIMEOUT_S)


def _errors(replies: list[Any]) -> list[ServiceError]:
    """The replicas' failures among `_on_every_replica`'s replies (each names its replica)."""
    return [reply for reply in replies if isinstance(reply, ServiceError)]
