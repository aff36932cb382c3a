"""`pagedserve engine --tensor-parallel-size 2` end to end: the tokenizer service in front of
an engine service whose model runs in two rank processes (gloo on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import psutil
import pytest

from engine import LLM, SamplingParams
from pagedserve.v1 import common_pb2, engine_pb2_grpc, generation_pb2_grpc
from services.tokenizer_service.model_files import load_text_model_files
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig
from tests.services.conftest import LoopThread
from tests.services.helpers import gather, request, wait_for
from tests.services.processes import EngineProcess, rank_processes

PROMPT = [1, 504, 3458, 282, 4649, 314, 7, 99]


class TpStack:
    def __init__(self, model_dir) -> None:
        self.engine = EngineProcess(model_dir, None, "--tensor-parallel-size", "2").start()
        self.engine.wait_serving(timeout=240)
        self.loop = LoopThread()

        async def start() -> TokenizerServer:
            config = TokenizerServerConfig(
                address="127.0.0.1:0",
                engine_address=self.engine.address,
                engine_poll_interval_s=0.2,
            )
            server = TokenizerServer(config, load_text_model_files(str(model_dir)))
            await server.start()
            assert await server.backend.wait_until_available(60.0)
            return server

        self.server = self.loop.run(start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.public = generation_pb2_grpc.TextGenerationServiceStub(self.channel)

    def ranks(self) -> list[psutil.Process]:
        assert self.engine.proc is not None
        return rank_processes(self.engine.proc.pid)

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.server.stop(0))
        self.loop.close()
        self.engine.stop()


@pytest.fixture(scope="module")
def tp_stack(tiny_model_dir) -> Iterator[TpStack]:
    stack = TpStack(tiny_model_dir)
    yield stack
    stack.close()


def test_tensor_parallel_engine_streams_the_single_process_tokens(tp_stack, tiny_model_dir):
    assert len(tp_stack.ranks()) == 2
    channel = grpc.insecure_channel(tp_stack.engine.address)
    health = engine_pb2_grpc.EngineServiceStub(channel).Health(
        common_pb2.HealthRequest(), timeout=10
    )
    channel.close()
    assert health.healthy
    assert health.details["tensor_parallel_size"] == "2"
    assert health.details["pipeline_parallel_size"] == "1"
    expected = LLM(str(tiny_model_dir), max_model_len=512).generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    responses = list(
        tp_stack.public.Generate(
            request(token_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True),
            timeout=120,
        )
    )
    assert len(responses) > 1  # streamed
    out = gather(responses)[0]
    assert out.token_ids == list(expected.outputs[0].token_ids)
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_killed_rank_ends_streams_unavailable_and_leaves_no_process(tp_stack):
    ranks = tp_stack.ranks()
    stream = tp_stack.public.Generate(
        request(token_ids=PROMPT, max_tokens=3000, temperature=0.0, ignore_eos=True),
        timeout=120,
    )
    next(stream)  # running
    ranks[1].kill()
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:  # 3000 tokens: it ends long before, unless the failure went unseen
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "rank 1" in info.value.details(), info.value.details()
    # The dead engine takes its service down; nothing it started is left.
    assert tp_stack.engine.proc is not None
    tp_stack.engine.proc.wait(120)
    wait_for(lambda: not any(r.is_running() and r.status() != "zombie" for r in ranks), 60)
    health = tp_stack.public.Health(common_pb2.HealthRequest(), timeout=10)
    assert not health.healthy


def test_ranks_exit_when_the_engine_service_is_killed(tiny_model_dir):
    """SIGKILL gives the engine service no chance to stop its ranks: they notice their
    driver's end of a pipe closed and exit by themselves."""
    engine = EngineProcess(tiny_model_dir, None, "--pipeline-parallel-size", "2").start()
    try:
        engine.wait_serving(timeout=240)
        assert engine.proc is not None
        ranks = rank_processes(engine.proc.pid)
        assert len(ranks) == 2
    finally:
        engine.kill()
    wait_for(lambda: not any(r.is_running() and r.status() != "zombie" for r in ranks), 60)
