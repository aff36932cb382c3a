"""The engine stand-in of `benchmarks/serving/tier_at_rate.py` (`paced_engine.py`: the real
engine server with a paced engine) relayed through the real `pagedserve tokenizer`: each
stream's text is what the tokenizer decodes from the ids the stand-in played for it, so the
benchmark measures the real relay doing its real work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serving import paced_engine, tier_at_rate

NUM_STREAMS, OUTPUT_LEN = 6, 40


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    ids = tier_at_rate.played_token_ids()
    path = tmp_path_factory.mktemp("played") / "ids.json"
    path.write_text(json.dumps(ids))
    return path, ids


def test_the_played_ids_are_english_text_of_the_default_tokenizer(played) -> None:
    from services.tokenizer_service.model_files import load_text_model_files

    _, ids = played
    tokenizer = load_text_model_files(None).tokenizer
    assert len(ids) > 10_000 and paced_engine.EOS_TOKEN_ID not in ids
    text = tokenizer.decode(ids[:200])
    assert text == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    assert sum(c.isalpha() for c in text) > len(text) / 2  # words, not noise
    # Different prompts start at different places; the same prompt always at the same one.
    starts = {paced_engine.start_offset([i, 7, 9], 0, len(ids)) for i in range(20)}
    assert len(starts) == 20
    assert paced_engine.start_offset([3, 7], 0, 1000) == paced_engine.start_offset([3, 7], 0, 1000)


def test_the_stand_in_relayed_by_the_tokenizer_service_gives_the_decoded_text(
    played, tmp_path: Path
) -> None:
    from services.tokenizer_service.model_files import load_text_model_files

    ids_file, ids = played
    prompts = tier_at_rate.make_prompts(NUM_STREAMS, 8, seed=3)
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    with tier_at_rate.start_tier(ids_file, step_s=0.004, batch_size=NUM_STREAMS) as tier:
        figures, texts = tier_at_rate.run_burst(
            tier, prompts_file, NUM_STREAMS, OUTPUT_LEN, client_procs=2, texts=True
        )
    tokenizer = load_text_model_files(None).tokenizer
    expected = [
        tokenizer.decode(paced_engine.played_ids(ids, prompt, 0, 0, OUTPUT_LEN))
        for prompt in prompts
    ]
    assert texts == expected  # (run_burst also checked every finish reason and usage)
    assert len(set(texts)) == NUM_STREAMS
    assert figures["target_tokens_per_s"] == pytest.approx(NUM_STREAMS / 0.004)
    assert figures["tokens_per_s"] > 0 and figures["tokenizer_cpu_us_per_token"] >= 0
    assert 0 < figures["client_msgs_per_token"] <= 1.0
    assert figures["engine_msgs_per_token"] > 0
