"""The engine replicas behind one tokenizer service, and the choice among them.

`--engine-addr` / `PAGEDSERVE_ENGINE_ADDR` is a comma-separated list of `host:port` and
`dns:///name:port` entries. A `dns:///` entry stands for every address the name resolves
to, re-resolved every `dns_refresh_s` (a `docker compose --scale engine=N` service name, a
Kubernetes headless Service): replicas appear and disappear with the answer. A single
`host:port` behaves exactly as one engine always did.

    EnginePool ── replicas: {address: EngineBackend}   (each polls its health and load)
       │  choose(prompt ids)  prefix affinity bounded by load
       (services/tokenizer_service/replicas/routing.py)
       │  least_loaded()      Encode and other calls without a prompt to route by
       └─ available           True while any replica serves (the service's own health)

All replicas must serve the same model: the first one reached sets it, and a replica
reporting another model (name, architecture, vocabulary, hidden size) is logged and left out
of routing. Their configurations may differ (a rolling upgrade: KV blocks, max_model_len,
max_logprobs): `model_info` reports the model with the most restrictive limits of the live
replicas, so the front never admits what one of them would refuse, and follows them as they
leave, return or restart (the Health details list each replica's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence

import grpc

from pagedserve.v1 import common_pb2
from services.common.errors import ServiceError
from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from services.tokenizer_service.replicas import routing
from services.tokenizer_service.replicas.engine_client import (
    ChannelOption,
    EngineBackend,
    OnHealthChange,
)
from services.tokenizer_service.replicas.lora_sync import sync_lora_adapters

logger = logging.getLogger("services.tokenizer_service.replicas.pool")

DNS_SCHEME = "dns:///"
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"
POLICIES = ("affinity", "round_robin")
Resolver = Callable[[str, int], Awaitable[list[str]]]
_MODEL_FIELDS = ("model", "architecture", "vocab_size", "hidden_size")
_LIMIT_FIELDS = ("max_model_len", "effective_max_model_len", "num_kv_blocks", "max_logprobs")


def _model_key(info: common_pb2.ModelInfo) -> tuple:
    return tuple(getattr(info, f) for f in _MODEL_FIELDS)


def parse_engine_addresses(spec: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(fixed `host:port` addresses, `dns:///` (name, port) pairs) of an address list."""
    fixed: list[str] = []
    names: list[tuple[str, int]] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry.startswith(DNS_SCHEME):
            host, sep, port = entry[len(DNS_SCHEME) :].rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"engine address {entry!r}: expected dns:///name:port")
            names.append((host.strip("[]"), int(port)))
        else:
            fixed.append(entry)
    if not fixed and not names:
        raise ValueError(f"engine address {spec!r}: no address given")
    return fixed, names


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as `ip:port` / `[ipv6]:port`, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(info[4][0], port) for info in infos})


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


class EnginePool:
    def __init__(
        self,
        spec: str,
        on_health_change: OnHealthChange,
        *,
        poll_interval_s: float = 1.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        dns_refresh_s: float = 5.0,
        prefix_blocks: int = 4,
        max_queue_imbalance: int = 4,
        policy: str = "affinity",
        resolver: Resolver = resolve_all,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[ChannelOption] = (),
        stall_timeout_s: float = 10.0,
        multiplex: bool = True,
    ) -> None:
        self.address = spec
        self.fixed, self.names = parse_engine_addresses(spec)
        self.replicas: dict[str, EngineBackend] = {}
        self.available = False
        self.model_info: common_pb2.ModelInfo | None = None  # the model every replica serves
        if policy not in POLICIES:
            raise ValueError(f"route policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._round_robin = itertools.count()
        self.prefix_blocks = prefix_blocks
        self.max_queue_imbalance = max_queue_imbalance
        self._on_health_change = on_health_change
        self._poll_interval_s = poll_interval_s
        self._max_message_bytes = max_message_bytes
        self._dns_refresh_s = dns_refresh_s
        self._resolver = resolver
        self._credentials = credentials
        self._channel_options = channel_options
        self._stall_timeout_s = stall_timeout_s
        self._multiplex = multiplex
        self._winner: tuple | None = None  # the model key the replicas agree on
        self._mismatch_logged: dict[str, common_pb2.ModelInfo] = {}
        self._dns_task: asyncio.Task[None] | None = None
        self._started = False

    # ---- membership -------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        for address in self.fixed:
            self._add(address)
        if self.names:
            self._dns_task = asyncio.create_task(self._resolve_loop())

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
        for replica in list(self.replicas.values()):
            await replica.close()
        self.replicas.clear()

    def replace_credentials(self, credentials: grpc.ChannelCredentials | None) -> None:
        """A reloaded client certificate: every replica's new calls use it (and replicas
        added later); calls already open finish on the old channels."""
        self._credentials = credentials
        for replica in self.replicas.values():
            replica.replace_credentials(credentials)

    def _options_for(self, dns_name: str | None) -> list[ChannelOption]:
        """A replica found through `dns:///name` is dialled by IP, but its certificate names
        the service (`engine` in compose, the Service in Kubernetes), not a pod's address:
        over TLS, check that name, as a connection to `name:port` would, unless
        `--engine-tls-server-name` gave one."""
        options = list(self._channel_options)
        named = any(key == TARGET_NAME_OVERRIDE for key, _ in options)
        if dns_name is not None and self._credentials is not None and not named:
            options.append((TARGET_NAME_OVERRIDE, dns_name))
        return options

    def _add(self, address: str, dns_name: str | None = None) -> None:
        replica = EngineBackend(
            address,
            self._replica_health_changed,
            poll_interval_s=self._poll_interval_s,
            max_message_bytes=self._max_message_bytes,
            credentials=self._credentials,
            channel_options=self._options_for(dns_name),
            stall_timeout_s=self._stall_timeout_s,
            multiplex=self._multiplex,
        )
        replica.accepts_model = self._accepts_model
        replica.before_available = self._before_available
        replica.others_up = lambda r: bool(self.up(exclude=[r]))
        self.replicas[address] = replica
        replica.start()
        logger.info("engine replica added", extra={"engine_address": address})

    async def refresh_dns(self) -> None:
        """Resolves the `dns:///` names now; replicas follow the answer. A failed lookup
        keeps the replicas it had (a DNS hiccup must not empty the pool)."""
        wanted: dict[str, str | None] = dict.fromkeys(self.fixed)  # address -> its DNS name
        for host, port in self.names:
            try:
                for address in await self._resolver(host, port):
                    wanted.setdefault(address, host)
            except OSError as exc:
                logger.warning("cannot resolve %s: %s", host, exc)
                wanted.update((a, host) for a in self.replicas if a not in self.fixed)
        for address in sorted(set(wanted) - set(self.replicas)):
            self._add(address, wanted[address])
        for address in sorted(set(self.replicas) - set(wanted)):
            replica = self.replicas.pop(address)
            await replica.close()
            logger.info("engine replica removed", extra={"engine_address": address})
        await self._replica_health_changed(False, "membership changed")

    async def _resolve_loop(self) -> None:
        while True:
            await self.refresh_dns()
            await asyncio.sleep(self._dns_refresh_s)

    # ---- health -----------------------------------------------------------------------

    def _accepts_model(self, replica: EngineBackend) -> bool:
        """Whether `replica` serves the pool's model: the model most of the reachable
        replicas serve (this one included), ties going to the replica listed first (a
        `dns:///` name's addresses in sorted order). Re-checked at every poll, so a replica
        that was accepted before the others answered is excluded at its next poll."""
        info = replica.model_info
        assert info is not None
        votes: dict[tuple, list[common_pb2.ModelInfo]] = {}
        for r in self.replicas.values():  # in the order they were listed
            if r.model_info is not None and (r.available or r is replica):
                votes.setdefault(_model_key(r.model_info), []).append(r.model_info)
        winner = max(votes, key=lambda key: len(votes[key]))  # the first listed wins a tie
        if _model_key(info) == winner:
            replica.serves_another_model = False
            self._winner = winner
            self._refresh_model_info(joining=replica)
            return True
        replica.serves_another_model = True
        if self._mismatch_logged.get(replica.address) is not info:
            self._mismatch_logged[replica.address] = info
            logger.warning(
                "engine replica excluded: it serves another model",
                extra={
                    "engine_address": replica.address,
                    "model": info.model,
                    "expected_model": votes[winner][0].model,
                },
            )
        return False

    def _refresh_model_info(self, joining: EngineBackend | None = None) -> None:
        """`model_info`: the agreed model with the smallest limits among the live replicas
        (and `joining`, about to be); kept as it was while none is live. A new object only
        when something changed (the servicer rebuilds its checks on a new one)."""
        infos = [
            r.model_info
            for r in self.replicas.values()
            if r.model_info is not None
            and _model_key(r.model_info) == self._winner
            and (r is joining or (r.available and not r.serves_another_model))
        ]
        if not infos:
            return
        merged = common_pb2.ModelInfo()
        merged.CopyFrom(infos[0])
        for name in _LIMIT_FIELDS:
            values = [getattr(i, name) for i in infos if getattr(i, name)]
            if values:
                setattr(merged, name, min(values))
        if merged != self.model_info:
            self.model_info = merged

    async def _before_available(self, replica: EngineBackend) -> None:
        """A replica about to join: the LoRA adapters its peers serve, loaded first."""
        peers = [
            r
            for r in self.replicas.values()
            if r.available and r is not replica and not r.serves_another_model
        ]
        if peers:
            await sync_lora_adapters(replica, peers)

    async def _replica_health_changed(self, available: bool, reason: str) -> None:
        """The service is available while any replica is."""
        del available  # recomputed over every replica
        self._refresh_model_info()
        now = any(r.available for r in self.replicas.values())
        if now != self.available:
            self.available = now
            await self._on_health_change(now, reason)

    async def wait_until_available(self, timeout: float) -> bool:
        """Polls until a replica serves (used at start-up); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.available and loop.time() < deadline:
            for replica in list(self.replicas.values()):
                replica.poke()
            await asyncio.sleep(0.05)
        return self.available

    # ---- routing ----------------------------------------------------------------------

    def up(self, exclude: Sequence[EngineBackend] = ()) -> list[EngineBackend]:
        return [r for r in self.replicas.values() if r.available and r not in exclude]

    def _candidates(self, exclude: Sequence[EngineBackend]) -> list[EngineBackend]:
        """The available replicas; when none is, every replica once reached that serves the
        model (the poll may lag a restart: trying beats refusing, as with one engine)."""
        up = self.up(exclude)
        if up:
            return up
        return [
            r
            for r in self.replicas.values()
            if r.model_info is not None and not r.serves_another_model and r not in exclude
        ]

    def _none_up(self) -> ServiceError:
        known = ", ".join(self.replicas) or "none resolved yet"
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            f"no engine replica is reachable ({self.address}: {known})",
        )

    def choose(
        self, prompt_token_ids: Sequence[int], exclude: Sequence[EngineBackend] = ()
    ) -> EngineBackend:
        """The replica for a generation: prefix affinity bounded by load (or, as a baseline,
        round robin)."""
        candidates = self._candidates(exclude)
        if not candidates:
            raise self._none_up()
        if self.policy == "round_robin":
            candidates.sort(key=lambda r: r.address)
            return candidates[next(self._round_robin) % len(candidates)]
        block_size = self.model_info.block_size if self.model_info is not None else 16
        key = routing.affinity_key(prompt_token_ids, block_size or 16, self.prefix_blocks)
        return routing.choose(key, candidates, self.max_queue_imbalance)

    def least_loaded(self, exclude: Sequence[EngineBackend] = ()) -> EngineBackend:
        candidates = self._candidates(exclude)
        if not candidates:
            raise self._none_up()
        return routing.least_loaded(candidates)

    def any_replica(self) -> EngineBackend | None:
        """A replica to ask about the engine (Health details): an available one if any."""
        up = self.up()
        if up:
            return up[0]
        return next(iter(self.replicas.values()), None)

    def describe(self) -> dict[str, str]:
        """Health details: one entry per replica."""
        details: dict[str, str] = {}
        for address, r in sorted(self.replicas.items()):
            state = "up" if r.available else "down"
            info = r.model_info
            config = (
                f" max_model_len={info.max_model_len} num_kv_blocks={info.num_kv_blocks}"
                if info is not None
                else ""
            )
            details[f"replica.{address}"] = (
                f"{state} waiting={r.load.num_waiting} running={r.load.num_running} "
                f"kv_cache_usage={r.load.kv_cache_usage:.4f} inflight={r.num_inflight}"
                f"{config}"
            )
        return details


@contextlib.contextmanager
def tracked(replica: EngineBackend) -> Iterator[TrackedCall]:
    """Counts a call as in flight (and pending until `started()`) on `replica`."""
    call = TrackedCall(replica)
    try:
        yield call
    finally:
        call.started()
        replica.num_inflight -= 1


class TrackedCall:
    """One call's share of its replica's load counters."""

    def __init__(self, replica: EngineBackend) -> None:
        self.replica = replica
        replica.num_inflight += 1
        replica.num_pending += 1
        self.pending = True  # no message back yet

    def started(self) -> None:
        if self.pending:
            self.pending = False
            self.replica.num_pending -= 1
