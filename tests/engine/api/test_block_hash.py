"""The prefix cache's chained block hash (engine/api/block_hash.py): chained, keyed, and
unambiguous about token boundaries. No torch."""

from engine.api.block_hash import hash_block_tokens


def test_hash_is_chained_and_keyed():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(None, [1], ("a",)) != hash_block_tokens(None, [1], ("b",))
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    # Token boundaries are encoded: [1, 2] differs from [1] + [2] or from [12].
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [12])
