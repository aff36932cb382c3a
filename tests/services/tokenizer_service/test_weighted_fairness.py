"""Weighted fair sharing through real processes: an engine service (batch of 4) and a
tokenizer service with an API-key file of two tenants, `gold` of weight 2 and `bronze` of
weight 1, both flooding the engine at once.

Gold queues twice as many requests as bronze, all alike (the same prompt length and
`max_tokens`, ignore_eos), so served 2:1 the two floods end together. The measure: from the
moment both tenants have been served, each time another 4 of bronze's requests have
finished, the output tokens gold has received over bronze's, which must be 2 within 20 %
every time. It counts tokens, not seconds, so a loaded machine changes nothing but the run
time. Before admission reserved a request's expected output (engine/core/fairness.py) the
five measured 1.32, 1.56, 1.68, 1.75, 2.00; after, 2.00 each (two runs).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from clients.async_client import AsyncClient
from services.cli.supervisor import wait_until_serving
from tests.services.processes import ROOT, EngineProcess, child_env, free_port

GOLD = "gold-key-0123456789abcdef000000"
BRONZE = "bronze-key-0123456789abcdef0000"
KEY_FILE = f"""\
{GOLD}  gold  weight=2
{BRONZE}  bronze  weight=1
"""
MAX_NUM_SEQS = 4
NUM_BRONZE = 20  # gold queues twice as many
PROMPT_LEN = 16
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def address(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tokenizer service's address, in front of one engine; both real processes."""
    key_file = tmp_path_factory.mktemp("weighted-keys") / "api-keys"
    key_file.write_text(KEY_FILE)
    engine = EngineProcess(tiny_model_dir, None, "--max-num-seqs", str(MAX_NUM_SEQS)).start()
    port = free_port()
    argv = [sys.executable, "-m", "services", "tokenizer", "--model", str(tiny_model_dir)]
    argv += ["--engine-addr", engine.address, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--api-key-file", str(key_file), "--log-level", "WARNING"]
    tokenizer = subprocess.Popen(argv, env=child_env(), cwd=ROOT)
    try:
        engine.wait_serving()
        assert wait_until_serving(f"127.0.0.1:{port}", [tokenizer], 120), "tokenizer down"
        yield f"127.0.0.1:{port}"
    finally:
        tokenizer.terminate()
        tokenizer.wait(30)
        engine.stop()


class Flood:
    """Both tenants' requests at once; the output tokens received per tenant, counted from
    the moment both have been served a token (before that, whichever tenant's requests
    reached the engine first filled the batch), at every 4th of bronze's requests done."""

    def __init__(self) -> None:
        self.received = {"gold": 0, "bronze": 0}
        self.left = {"gold": 2 * NUM_BRONZE, "bronze": NUM_BRONZE}
        self.start: dict[str, int] | None = None
        self.cuts: list[dict[str, int]] = []

    async def one(self, client: AsyncClient, tenant: str, number: int) -> None:
        prompt = [3 + (number * 7 + i) % 200 for i in range(PROMPT_LEN)]
        stream = client.generate(
            token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0
        )
        async for delta in stream:
            self.received[tenant] += len(delta.token_ids)
            if self.start is None and all(self.received.values()):
                self.start = dict(self.received)
        self.left[tenant] -= 1
        if tenant == "bronze" and self.left[tenant] % 4 == 0 and self.start is not None:
            self.cuts.append({t: n - self.start[t] for t, n in self.received.items()})

    async def run(self, address: str) -> list[dict[str, int]]:
        gold = AsyncClient(address, api_key=GOLD, timeout=600)
        bronze = AsyncClient(address, api_key=BRONZE, timeout=600)
        for client in (gold, bronze):  # both connected before the flood
            await client.generate_text(token_ids=[5, 6], max_tokens=1)
        calls = []
        for number in range(NUM_BRONZE):  # interleaved: neither tenant queues first
            calls += [self.one(gold, "gold", 2 * number), self.one(gold, "gold", 2 * number + 1)]
            calls.append(self.one(bronze, "bronze", 1000 + number))
        await asyncio.gather(*calls)
        await gold.close()
        await bronze.close()
        expected = {"gold": 2 * NUM_BRONZE * MAX_TOKENS, "bronze": NUM_BRONZE * MAX_TOKENS}
        assert self.received == expected
        return self.cuts


def test_weights_two_to_one_are_served_two_to_one(address: str) -> None:
    cuts = asyncio.run(Flood().run(address))
    ratios = [round(cut["gold"] / cut["bronze"], 2) for cut in cuts]
    print("gold:bronze output tokens at every 4th of bronze's requests done:", ratios)
    assert len(ratios) >= 3, cuts
    assert all(2 * 0.8 <= ratio <= 2 * 1.2 for ratio in ratios), cuts
