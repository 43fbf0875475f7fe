"""Review 295: ``LoadStream.claim`` on a stream whose ``finish()`` or ``aclose()`` was called raises
``RuntimeError`` (as a second ``finish()`` does) and changes nothing: the stream's claimed front and
result, its load front, the cost model's prefill meter.

Before the fix it answered as if the stream were open: after ``finish()`` it granted no more
tokens (up to the load's front, past the ``claimed`` finish reported, where a fault had left that
front above it) and folded the previous claim into the prefill meter, timed across the finish
(``samples`` 0 -> 1 here); during a ``finish()`` still waiting on a read, it moved the claimed front
under it (the loader then stopped there).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, on_disk_only, prompt
from load_gate import LoadGate
from loop_probes import until, until_thread, waiting_in

from aiokv import KVCache
from aiokv.stream import LoadStream

T = LAYOUT.page_tokens
PAGES = 4
N = PAGES * T
TARGET = torch.arange(100, 100 + N)
BOUND_S = 30


def _state(cache: KVCache, stream: LoadStream) -> tuple[Any, ...]:
    return (stream._claimed, stream.front, repr(stream), dict(vars(cache.manager.costs.prefill)),
            cache.stats())


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["finish", "aclose"])
async def test_a_claim_after_the_stream_ended_raises_and_changes_nothing(end: str) -> None:
    tokens = prompt(2955, N)
    async with KVCache(config(None), LAYOUT, make_kv(2955)) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(N))).stored == PAGES
        stream = await cache.start_load(await cache.match(tokens), TARGET)
        assert stream.claim(T) == T  # a claim whose chunk the next claim would report computed
        if end == "finish":
            result = await stream.finish()
            assert (result.claimed, result.loaded_from) == (T, T), result
            words = r"^LoadStream\.claim\(\) after finish\(\): the stream is finished$"
        else:
            await stream.aclose()
            words = r"^LoadStream\.claim\(\) after aclose\(\): the stream was closed$"
        before = _state(cache, stream)
        for claim in (T, 2 * T, N, N + T):
            with pytest.raises(RuntimeError, match=words):
                stream.claim(claim)
        with pytest.raises(TypeError, match="end must be an int"):  # a bad argument stays a TypeError
            stream.claim("x")  # type: ignore[arg-type]
        assert _state(cache, stream) == before
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_claim_while_finish_waits_on_a_held_read_raises_and_moves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(2956, N)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, make_kv(2956)) as cache:
        await cache.pool.wait_ready()
        await on_disk_only(cache, tokens, torch.arange(N))
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES, match
        disk = cache.disk
        assert disk is not None
        gate = LoadGate(disk, monkeypatch)
        try:
            stream = await cache.start_load(match, TARGET)
            await until_thread(lambda: len(gate.held) >= 1, "the stream's first read")
            finishing = asyncio.ensure_future(stream.finish())
            await until(lambda: waiting_in(finishing, "wait"))  # finish() waits for the loader
            before = _state(cache, stream)
            with pytest.raises(RuntimeError, match=r"after finish\(\): the stream is finished"):
                stream.claim(N)  # before: claimed the whole match, the loader then stopped
            assert _state(cache, stream) == before
        finally:
            gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await finishing
        assert (result.claimed, result.loaded_from, result.disk_pages) == (0, 0, PAGES), result
        await assert_quiescent(cache)
