"""Adversarial: malformed input to every public entry of a running KVCache (tokens, salt, slots,
from_token, layered, match objects, note_prefill, a stream's claim/wait_front/wait_layer) must raise
TypeError/ValueError and change nothing: the statistics, the page table and the match's ownership
are compared before and after every call.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import LAYOUT, SLOTS, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache, Match

T = LAYOUT.page_tokens
N = 4 * T

BAD_TOKENS: list[Any] = [
    None, 3, "abc", b"abcdefgh", [1.0] * 8, [True] * 8, [-1] * 8, [2**63] * 8, [2**64] * 8, [[1] * 8],
    np.zeros((2, 8), np.int64), np.zeros(8, np.float32), torch.zeros(8), torch.zeros(2, 8, dtype=torch.long),
    torch.zeros(8, dtype=torch.long, device="meta"), torch.zeros(8, dtype=torch.bool), [1, 2, None, 4],
    {1, 2, 3}, np.array([-1] * 8), np.array([2**63] * 8, dtype=np.uint64), [np.float64(1)] * 8,
    torch.tensor([-5] * 8), torch.zeros(8, dtype=torch.complex64), "12345678", bytearray(8), [1, 2, 3, "4"],
    [object()] * 4, np.array([1, 2], dtype=object),
]
BAD_SALTS: list[Any] = [3, 1.5, [1], {"a": 1}, object(), "\ud800", True, torch.tensor(1), ()]
BAD_SLOTS: list[Any] = [
    None, list(range(N)), np.arange(N), torch.arange(N).float(), torch.arange(N).view(2, -1), torch.arange(N + 1),
    torch.arange(N - 1), torch.arange(N) - 1, torch.arange(N) + 10**6, torch.zeros(N, dtype=torch.long),
    torch.arange(N).bool(), torch.arange(N, device="meta"), torch.full((N,), 2**40), torch.tensor([]),
    torch.arange(N).to(torch.float64), torch.arange(N, dtype=torch.int32) - SLOTS,
]
BAD_FROM: list[Any] = [-1, N + 1, 1.0, True, None, "0", 2**70, np.int64(4)]
BAD_LAYERED: list[Any] = [1, 0, None, "yes", np.bool_(True)]


def _state(cache: KVCache) -> tuple[object, ...]:
    cache.pool.table.check_invariants()
    s = cache.stats()
    return (s.lookups, dict(s.hit_tokens), s.miss_tokens, dict(s.loaded_tokens), dict(s.bytes_moved), s.pages_stored,
            s.pages_skipped, s.pages_dropped, s.pages_promoted, s.pool_free, s.pool_reserved, s.pool_ready,
            s.pool_referenced, s.write_behind_queue, dict(s.errors), cache.pool.table.statistics(),
            None if s.disk is None else s.disk.pages)


async def _invoke(call: Callable[[], Any]) -> None:
    outcome = call()
    if isinstance(outcome, Awaitable):
        await outcome


@pytest.mark.asyncio
async def test_malformed_input_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    kv = make_kv(3)
    tokens = prompt(3, N)
    async with KVCache(config(tmp_path, pool_pages=16), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(N))
        await cache.flush()
        original = kv.clone()
        expected = [original]  # the KV buffer as it must stay
        refused = 0

        async def refuses(what: str, call: Callable[[], Any], match: Match | None = None) -> None:
            nonlocal refused
            await cache.flush()
            before = _state(cache)
            with pytest.raises((TypeError, ValueError)):
                await _invoke(call)
            assert _state(cache) == before, f"{what}: refused, but the cache changed"
            assert torch.equal(kv, expected[0]), f"{what}: refused, but the KV buffer changed"
            if match is not None:
                assert not match.released, f"{what}: refused, but the match was consumed"
            refused += 1

        for i, bad in enumerate(BAD_TOKENS):
            await refuses(f"match(tokens[{i}])", lambda bad=bad: cache.match(bad))
            await refuses(f"prefetch(tokens[{i}])", lambda bad=bad: cache.prefetch(bad))
            await refuses(f"keys(tokens[{i}])", lambda bad=bad: cache.keys(bad))
            await refuses(f"offload(tokens[{i}])", lambda bad=bad: cache.offload(bad, torch.arange(8)))
        for i, bad in enumerate(BAD_SALTS):
            await refuses(f"match(salt[{i}])", lambda bad=bad: cache.match(tokens, salt=bad))
            await refuses(f"prefetch(salt[{i}])", lambda bad=bad: cache.prefetch(tokens, salt=bad))
            await refuses(f"offload(salt[{i}])", lambda bad=bad: cache.offload(tokens, torch.arange(N), salt=bad))

        async def with_match(what: str, call: Callable[[Match], Any]) -> None:
            match = await cache.match(tokens)
            try:
                await refuses(what, lambda: call(match), match)
            finally:
                match.release()

        async def stream_with(match: Match, slots: Any, **kw: Any) -> None:
            stream = await cache.start_load(match, slots, **kw)
            await stream.aclose()

        for i, bad in enumerate(BAD_SLOTS):
            await refuses(f"offload(slots[{i}])", lambda bad=bad: cache.offload(tokens, bad))
            await with_match(f"load(slots[{i}])", lambda m, bad=bad: cache.load(m, bad))
            await with_match(f"start_load(slots[{i}])", lambda m, bad=bad: stream_with(m, bad))
        for bad in BAD_FROM:
            count = N - bad if isinstance(bad, int) and 0 <= bad <= N else N
            slots = torch.arange(100, 100 + count)
            await with_match(f"load(from_token={bad!r})", lambda m, bad=bad, s=slots: cache.load(m, s, from_token=bad))
            await with_match(f"start_load(from_token={bad!r})",
                             lambda m, bad=bad, s=slots: stream_with(m, s, from_token=bad))
        for bad in BAD_LAYERED:
            await with_match(f"start_load(layered={bad!r})",
                             lambda m, bad=bad: stream_with(m, torch.arange(100, 100 + N), layered=bad))
        for bad in (None, object(), "m", 3):
            await refuses(f"load(match={bad!r})", lambda bad=bad: cache.load(bad, torch.arange(4)))
            await refuses(f"start_load(match={bad!r})", lambda bad=bad: cache.start_load(bad, torch.arange(4)))
        for args in [(0, 1.0), (-1, 1.0), (10, 0), (10, -1.0), (10, math.nan), (10, math.inf), (1.5, 1.0),
                     (True, 1.0), (10, "1"), (10**20, 1e-9), (10, 1.0, -1), (10, 1.0, 2**53 + 1), (10, 1.0, 1.5),
                     (10, 1.0, True), (10, 1.0, "0")]:
            await refuses(f"note_prefill{args}", lambda args=args: cache.note_prefill(*args))

        # A running stream's own entries.
        match = await cache.match(tokens)
        stream = await cache.start_load(match, torch.arange(100, 100 + N))
        for bad in (None, 1.5, True, "4"):
            await refuses(f"stream.claim({bad!r})", lambda bad=bad: stream.claim(bad))
        for bad in (None, 1.5, True, -1, N + 1):
            await refuses(f"stream.wait_front({bad!r})", lambda bad=bad: stream.wait_front(bad))
        await stream.launched()
        for layer in range(LAYOUT.num_layers):
            assert await stream.wait_layer(layer)
        expected[0] = kv.clone()  # the stream's own copies landed
        for bad in (None, 1.5, True, -1, LAYOUT.num_layers):
            await refuses(f"stream.wait_layer({bad!r})", lambda bad=bad: stream.wait_layer(bad))
        result = await stream.finish()
        assert result.loaded_tokens == N and torch.equal(kv[:, 100 : 100 + N], original[:, :N])
        assert refused >= 240
        await assert_quiescent(cache)
