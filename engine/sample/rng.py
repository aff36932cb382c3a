"""Counter-based uniform random numbers: one draw per (seed, position), in torch integer ops.

A request samples its token at output position `p` with the number `uniform(seed, p)`. The
number is a pure function of the two integers, so a request draws the same numbers whatever
else shares its batch, in any order, after a preemption, on any device: no per-request
`torch.Generator` and no Python loop over rows.

Every word is a 32-bit value held in an int64 tensor. The mixer multiplies by odd constants
below 2**31 and masks back to 32 bits after each product, so no intermediate reaches 2**63
and int64 never overflows (signed overflow is not something to rely on across backends).

    seed (64 bits) ─┬─ lo32 ─┐
                    └─ hi32 ─┤  absorb word by word:  h = mix(h ^ word)
    position        ─┬─ lo32 ─┤
                    └─ hi32 ─┘
    lane A (own constants) → 32 bits → keep 27 ─┐
    lane B (own constants) → 32 bits → keep 26 ─┴→ 53-bit integer / 2**53 → float64 in [0, 1)
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFF_FFFF
_TWO_POW_26 = 1 << 26
_TWO_POW_MINUS_53 = 2.0**-53

# Two lanes, each a (start value, multiplier, multiplier) triple; the multipliers are odd
# and < 2**31, so products of a 32-bit word stay below 2**63.
_LANE_A = (0x243F_6A88, 0x7FEB_352D, 0x2C1B_3C6D)
_LANE_B = (0x85A3_08D3, 0x5BD1_E995, 0x68E3_1DA5)


def _mix32(x: torch.Tensor, mul1: torch.Tensor, mul2: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mixer on 32-bit words (xor-shift / multiply, lowbias32-style)."""
    x = x ^ (x >> 16)
    x = (x * mul1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * mul2) & _MASK32
    x = x ^ (x >> 16)
    return x


# The lanes' constants as [3, 2, 1] int64 per device, made once: uploading them per call
# would be a host-to-device copy that waits for the device, every step.
_LANE_CONSTANTS: dict[torch.device, torch.Tensor] = {}


def _lane_constants(device: torch.device) -> torch.Tensor:
    constants = _LANE_CONSTANTS.get(device)
    if constants is None:
        with torch.inference_mode(False):  # usable in and out of inference mode
            values = torch.tensor(list(zip(_LANE_A, _LANE_B)), dtype=torch.int64)
            constants = _LANE_CONSTANTS[device] = values.unsqueeze(-1).to(device)
    return constants


def _hash_lanes(words: list[torch.Tensor]) -> torch.Tensor:
    """Both lanes at once: [2, B] hashes of the words (each [B]), one row per lane."""
    start, mul1, mul2 = _lane_constants(words[0].device)  # each [2, 1]
    h = start.expand(2, words[0].shape[0])  # [2, B]
    for word in words:
        h = _mix32(h ^ word, mul1, mul2)
    # One more round so the last word is as well mixed as the first.
    return _mix32(h ^ start, mul1, mul2)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One number in [0, 1) per row, a pure function of (seed, position).

    seeds, positions: [B] int64 (any values; negative ones are taken as their two's
    complement). Returns [B] float64 on the same device, 53 random bits each.
    """
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64
    assert seeds.shape == positions.shape and seeds.dim() == 1
    # `>>` on int64 is arithmetic; the mask keeps the 32 bits we want either way.
    words = [
        seeds & _MASK32,
        (seeds >> 32) & _MASK32,
        positions & _MASK32,
        (positions >> 32) & _MASK32,
    ]
    lanes = _hash_lanes(words)  # [2, B]
    high = lanes[0] >> 5  # 27 bits
    low = lanes[1] >> 6  # 26 bits
    bits53 = high * _TWO_POW_26 + low  # < 2**53: exact in float64
    return bits53.to(torch.float64) * _TWO_POW_MINUS_53
