"""The Shepherd Model Gateway (`smg`, from PyPI) in front of two pagedserve engine
processes, over vLLM's engine protocol: OpenAI completions and chat completions, streamed
and not, give the same greedy text as our own tokenizer service; with one engine
SIGKILLed, new requests still succeed through the other."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.v1 import common_pb2, generation_pb2
from tests.services.helpers import gather, request
from tests.services.processes import ROOT, EngineProcess, free_port

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))


@pytest.fixture(scope="module", autouse=True)
def smg_installed() -> None:
    """smg is pinned in the dev extra: missing, it fails these tests (no skip)."""
    assert Path(SMG).exists(), f"smg is not installed ({SMG}): pip install -e '.[dev]'"


class Gateway:
    def __init__(self, model_dir: Path, engines: list[EngineProcess]) -> None:
        self.model = str(model_dir)
        self.port = free_port()
        argv = [SMG, "launch", "--backend", "vllm", "--policy", "cache_aware"]
        argv += ["--worker-urls", *[f"grpc://{e.address}" for e in engines]]
        argv += ["--model-path", self.model, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.log = open(Path(engines[0].model_dir).parent / "smg.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def post(self, path: str, body: dict, timeout: float = 60.0) -> bytes:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps({"model": self.model, **body}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            assert reply.status == 200
            return reply.read()

    def text(self, path: str, body: dict) -> str:
        """The first choice's text; streamed replies are put back together from SSE."""
        raw = self.post(path, body)
        key = "message" if path.endswith("chat/completions") else None
        if not body.get("stream"):
            choice = json.loads(raw)["choices"][0]
            return choice["message"]["content"] if key else choice["text"]
        text = ""
        for line in raw.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += (choice["delta"].get("content") or "") if key else choice["text"]
        return text

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "smg exited; see smg.log beside the model"
            try:
                self.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, timeout=10)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(20)
        self.log.close()


@pytest.fixture(scope="module")
def gateway(tiny_model_dir) -> Iterator[tuple[Gateway, list[EngineProcess]]]:
    engines = [EngineProcess(tiny_model_dir).start() for _ in range(2)]
    gw = None
    try:
        for engine in engines:
            engine.wait_serving()
        gw = Gateway(tiny_model_dir, engines)
        gw.wait_ready()
        yield gw, engines
    finally:
        if gw is not None:
            gw.close()
        for engine in engines:
            engine.stop()


def ours(stack, max_tokens: int, *, text: str | None = None, chat: str | None = None) -> str:
    """The greedy answer of our own tokenizer service (same model files)."""
    if chat is not None:
        msg = generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatInput(
                messages=[generation_pb2.ChatMessage(role="user", content=chat)]
            ),
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        )
    else:
        msg = request(text=text, temperature=0, max_tokens=max_tokens)
    return gather(stack.public.Generate(msg, timeout=60))[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_chat_match_our_tokenizer_service(stack, gateway, stream):
    gw, _ = gateway
    for prompt in ("The capital of France is", "Once upon a time"):
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": stream}
        expected = ours(stack, 10, text=prompt)
        assert expected and gw.text("/v1/completions", body) == expected
    question = "Name three colours."
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 10}
    got = gw.text("/v1/chat/completions", {**body, "temperature": 0, "stream": stream})
    assert got == ours(stack, 10, chat=question)


def test_response_format_and_stop_through_the_gateway(stack, gateway):
    """What smg sends for `response_format` (a json_schema constraint) and `stop` is
    enforced by our engines: the JSON validates, the stop string ends the answer there."""
    import jsonschema

    gw, _ = gateway
    # A JSON string, not an object: an object's grammar allows any whitespace between its
    # tokens, and a random model sampling at 0.8 can spend every token on it (a CI run did).
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    for seed in range(3):
        body = {
            "messages": [{"role": "user", "content": "Pick a colour."}],
            "max_tokens": 40,
            "temperature": 0.8,
            "seed": seed,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": schema},
            },
        }
        jsonschema.validate(json.loads(gw.text("/v1/chat/completions", body)), schema)

    prompt = "Once upon a time"
    full = ours(stack, 12, text=prompt)
    stop = full.split()[2]  # a word in the middle of the greedy answer
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    expected = gather(
        stack.public.Generate(request(text=prompt, temperature=0, max_tokens=12, stop=[stop]))
    )[0].text
    assert gw.text("/v1/completions", body) == expected == full[: full.index(stop)]


def test_requests_succeed_with_one_engine_killed(stack, gateway):
    """Runs last in this module: it leaves one engine dead."""
    gw, engines = gateway
    engines[0].kill()
    for i in range(6):  # spread over both workers by the policy; the dead one is skipped
        prompt = f"Question number {i} is about"
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
        assert gw.text("/v1/completions", body) == ours(stack, 6, text=prompt)
