"""How many tokens a window of a given size holds (weft sizes its window by tokens per call)."""

from __future__ import annotations

from .. import _weft

# What a size hint assumes when the caller does not say: top-8 routing over 256 experts
# (the window grows with both only through small per-row metadata).
_HINT_TOP_K = 8
_HINT_NUM_EXPERTS = 256
# Largest tokens per rank a Buffer is sized for from a byte budget.
_MAX_TOKENS = 1 << 20


def window_bytes_for(num_tokens: int, hidden: int, num_ranks: int, top_k: int = _HINT_TOP_K,
                     num_experts: int = 0, expand_factor: int = 0) -> int:
    num_experts = num_experts or max(_HINT_NUM_EXPERTS // num_ranks, 1) * num_ranks
    return int(_weft.ep.window_bytes(num_tokens, hidden, num_experts, top_k, expand_factor,
                                     num_ranks))


def max_tokens_for(num_bytes: int, hidden: int, num_ranks: int, top_k: int, num_experts: int,
                   expand_factor: int = 0) -> int:
    """The most tokens per rank whose window fits num_bytes (0 if not even one token fits)."""
    lo, hi = 0, _MAX_TOKENS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if window_bytes_for(mid, hidden, num_ranks, top_k, num_experts, expand_factor) <= num_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
