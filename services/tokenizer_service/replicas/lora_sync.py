"""LoRA adapters for a replica that joins the pool: before the tokenizer service routes to
an engine replica that has just become reachable (a new one behind `dns:///`, or one that
restarted), it loads onto it the adapters that every other available replica lists, with
their paths, so a request naming an adapter finds it wherever it is routed.

Only what is missing is loaded; nothing is unloaded (an adapter the newcomer alone has is
left alone, and `ListLoraAdapters` does not show it, as it is not on every replica). A load
that fails is logged with the replica and the reason; the replica serves all the same
(requests naming that adapter get its NOT_FOUND there). A replica with LoRA off answers the
listing with an error: it then takes no part, as a peer or as a newcomer.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pagedserve.v1 import common_pb2
from services.tokenizer_service.replicas.engine_client import EngineBackend

logger = logging.getLogger("services.tokenizer")

_LIST_TIMEOUT_S = 10.0
_LOAD_TIMEOUT_S = 120.0  # loading reads and checks the adapter's weights


async def sync_lora_adapters(replica: EngineBackend, peers: list[EngineBackend]) -> list[str]:
    """Loads onto `replica` the adapters every one of `peers` lists and it lacks; returns
    their names, in the first peer's order."""
    request = common_pb2.ListLoraAdaptersRequest()
    replies = await asyncio.gather(
        *(p.stub.ListLoraAdapters(request, timeout=_LIST_TIMEOUT_S) for p in peers),
        return_exceptions=True,
    )
    listings = [r for r in replies if isinstance(r, common_pb2.ListLoraAdaptersResponse)]
    if not listings:
        return []
    on_every = set.intersection(
        *({(a.lora_name, a.lora_path) for a in r.adapters} for r in listings)
    )
    wanted = [(a.lora_name, a.lora_path) for a in listings[0].adapters]
    wanted = [entry for entry in wanted if entry in on_every]
    if not wanted:
        return []
    try:
        have = await replica.stub.ListLoraAdapters(request, timeout=_LIST_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        logger.error(
            "cannot list the LoRA adapters of a joining replica",
            extra={"engine_address": replica.address, "reason": exc.details()},
        )
        return []
    present = {a.lora_name for a in have.adapters}
    loaded = []
    for name, path in wanted:
        if name in present:
            continue
        try:
            await replica.stub.LoadLoraAdapter(
                common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
                timeout=_LOAD_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            logger.error(
                "cannot load a LoRA adapter onto a joining replica",
                extra={
                    "engine_address": replica.address,
                    "lora_name": name,
                    "reason": exc.details(),
                },
            )
            continue
        loaded.append(name)
    if loaded:
        logger.info(
            "LoRA adapters loaded onto a joining replica",
            extra={"engine_address": replica.address, "lora_names": ",".join(loaded)},
        )
    return loaded
