"""A load stream gives its copies' pool pages back as each copy ends, not at ``finish()``.

The engine prefills its tail between a stream's ``launched()`` and its ``finish()`` (tens of ms on
a GPU). The stream kept every copied page referenced until ``finish()``, and stopped counting as a
running load when its loader ended: a later load (or stream) whose disk hit needed room in the pool,
holding no page itself, found the pool full of pages nobody would read again, saw no other load
running and stopped at once (``pool_exhausted``, nothing loaded). Now a copy that delivered gives
its pages back when it ends (they stay cached, evictable), the pages the loader never launched go
back when it ends, and the stream counts as running while it still holds any: a load finding the
pool full waits (``offload_wait`` at most) for them rather than stopping. A copy that failed keeps
its pages until ``finish()``/``aclose()``, as before (or until the stream gives them back to make
room: it then holds nothing once its loader ended); ``finish()`` reports exactly what landed.

Real page files on disk, bit-exact checks, a small pool; the engine's KV buffer on the CPU (the
poison checks read it directly), the copy thread held on a gate or slowed where a test needs copies
in flight.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import (
    DEVICE,
    LAYOUT,
    CopyThreadGate,
    assert_quiescent,
    config,
    errors_of,
    make_kv,
    prompt,
    slow_host_copies,
)

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostScatter
from aiokv.stream import LoadStream
from aiokv.transfers import failed_copy

T = LAYOUT.page_tokens
POOL = 4
A_PAGES, B_PAGES = 4, 3
"""The stream's hit fills the pool; the second caller's disk hit needs three of its pages."""
POISON = 100.0
BOUND_S = 30.0
TA = torch.arange(40, 40 + A_PAGES * T)
TB = torch.arange(120, 120 + B_PAGES * T)

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


async def _setup(root: Path, **extra: object) -> tuple[KVCache, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Two prompts stored on disk (A's KV at source slots 0.., B's after it) and a cache of a
    ``POOL``-page pool over them: (cache, its KV buffer, the source, A, B)."""
    source = make_kv(151)
    a, b = prompt(151, A_PAGES * T), prompt(152, B_PAGES * T)
    async with KVCache(config(root, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(a, torch.arange(A_PAGES * T))
        await writer.offload(b, torch.arange(A_PAGES * T, (A_PAGES + B_PAGES) * T))
        await writer.flush()
    kv = make_kv(152)
    extra.setdefault("launch_pages", 1)
    cache = KVCache(config(root, pool_pages=POOL, disk_pages=96, **extra), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    return cache, kv, source, a, b


async def _match_a(cache: KVCache, a: list[int], tier: str) -> Any:
    """A's match with its pages in the pool (``tier`` "pool": prefetched) or on disk only."""
    cache.pool.table.evict(cache.pool.num_pages)
    if tier == "pool":
        assert (await cache.prefetch(a)).promoted == A_PAGES
    match = await cache.match(a)
    assert (match.pool_pages, match.disk_pages) == ((A_PAGES, 0) if tier == "pool" else (0, A_PAGES)), match
    return match


async def _second(cache: KVCache, how: str, tokens: list[int]) -> int:
    """B loaded into ``TB`` by a plain load or a stream the engine never claims from: tokens loaded."""
    match = await cache.match(tokens)
    assert (match.pool_pages, match.disk_pages) == (0, B_PAGES), match
    if how == "load":
        return (await cache.load(match, TB)).tokens
    async with await cache.start_load(match, TB) as stream:
        return (await stream.finish()).loaded_tokens


async def _copies_over(stream: LoadStream) -> None:
    """Until every copy the stream launched is over (the engine does not wait for that)."""
    await asyncio.wait({launch.copy.future for launch in stream._copies.launches})


def _watch_room_waits(cache: KVCache) -> asyncio.Event:
    """Set once a caller holding no pool page begins to wait for room (none free)."""
    manager = cache._manager
    real = manager._wait_for_load_room
    waiting = asyncio.Event()

    async def wait() -> bool:
        if not manager.pool.table.has_room():
            waiting.set()
        return await real()

    manager._wait_for_load_room = wait  # type: ignore[method-assign]
    return waiting


@pytest.mark.asyncio
@pytest.mark.parametrize("second", ["load", "stream"])
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.parametrize("tier", ["pool", "disk"])
async def test_a_load_after_a_streams_copies_ended_gets_their_pages(
    tmp_path: Path, tier: str, layered: bool, second: str,
) -> None:
    """The reproduction: a stream over a hit that fills the pool, its copies over (every layer
    waited for), not finished (the engine prefills its tail); then a load of another disk hit. It
    stopped at once, ``pool_exhausted``, nothing loaded; now it takes the stream's ended copies'
    pages and loads whole, and the stream still reports (bit-exact) everything it copied."""
    cache, kv, source, a, b = await _setup(tmp_path)
    try:
        for _ in range(2):
            match = await _match_a(cache, a, tier)
            kv[:, TA] = POISON
            kv[:, TB] = POISON
            async with asyncio.timeout(BOUND_S):
                stream = await cache.start_load(match, TA, layered=layered)
                try:
                    assert await stream.launched() == 0
                    for layer in range(LAYOUT.num_layers):
                        assert await stream.wait_layer(layer)
                    loaded_b = await _second(cache, second, b)
                finally:
                    result = await stream.finish()
            assert loaded_b == B_PAGES * T, (loaded_b, errors_of(cache))
            assert torch.equal(kv[:, TB], source[:, A_PAGES * T : (A_PAGES + B_PAGES) * T])
            pool_pages, disk_pages = (A_PAGES, 0) if tier == "pool" else (0, A_PAGES)
            assert (result.loaded_from, result.pool_pages, result.disk_pages) == (0, pool_pages, disk_pages), result
            assert torch.equal(kv[:, TA], source[:, : A_PAGES * T])
            assert not errors_of(cache), errors_of(cache)
            await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("second", ["load", "stream"])
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.parametrize("tier", ["pool", "disk"])
async def test_a_load_waits_for_a_streams_copies_still_running(
    tmp_path: Path, tier: str, layered: bool, second: str,
) -> None:
    """The stream's loader ended, its copies are still queued (the copy thread held): a load that
    finds the pool full and holds nothing waits for them to end (the stream still holds pages it
    will give back) instead of stopping at once, and loads whole once they did, before ``finish``."""
    cache, kv, source, a, b = await _setup(tmp_path, offload_wait=BOUND_S)
    try:
        match = await _match_a(cache, a, tier)
        kv[:, TA] = POISON
        kv[:, TB] = POISON
        waiting = _watch_room_waits(cache)
        gate = CopyThreadGate(cache)
        stream = await cache.start_load(match, TA, layered=layered)
        try:
            async with asyncio.timeout(BOUND_S):
                assert await stream.launched() == 0
                task = asyncio.ensure_future(_second(cache, second, b))
                await waiting.wait()
            assert not task.done(), "the load stopped instead of waiting for the stream's copies"
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            try:
                loaded_b = await task
            finally:
                result = await stream.finish()
        assert loaded_b == B_PAGES * T, (loaded_b, errors_of(cache))
        assert torch.equal(kv[:, TB], source[:, A_PAGES * T : (A_PAGES + B_PAGES) * T])
        assert (result.loaded_from, result.loaded_tokens) == (0, A_PAGES * T), result
        assert torch.equal(kv[:, TA], source[:, : A_PAGES * T])
        assert not errors_of(cache), errors_of(cache)
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
async def test_the_pages_the_engine_claimed_go_back_when_the_loader_ends(tmp_path: Path, layered: bool) -> None:
    """The engine claimed the first half of a pool hit: the loader copies the other half and ends.
    The claimed pages (never launched) go back then, the copied ones as their copies end, so a load
    of another hit gets room before ``finish``; the stream reports the half it copied, bit-exact."""
    cache, kv, source, a, b = await _setup(tmp_path, launch_turn_s=0)  # one page a copy: the claim wins
    try:
        match = await _match_a(cache, a, "pool")
        kv[:, TA] = POISON
        kv[:, TB] = POISON
        async with asyncio.timeout(BOUND_S):
            stream = await cache.start_load(match, TA, layered=layered)
            try:
                assert stream.claim(2 * T) == 2 * T
                assert await stream.launched() == 2 * T
                for layer in range(LAYOUT.num_layers):
                    assert await stream.wait_layer(layer)
                await _copies_over(stream)  # a layer-wise copy ends just after its last layer landed
                assert cache.stats().pool_referenced == 0  # nothing held while the engine prefills
                loaded_b = await _second(cache, "load", b)
            finally:
                result = await stream.finish()
        assert loaded_b == B_PAGES * T, (loaded_b, errors_of(cache))
        assert torch.equal(kv[:, TB], source[:, A_PAGES * T : (A_PAGES + B_PAGES) * T])
        assert (result.claimed, result.loaded_from, result.pool_pages) == (2 * T, 2 * T, 2), result
        assert torch.equal(kv[:, TA[2 * T :]], source[:, 2 * T : A_PAGES * T])
        assert bool((kv[:, TA[: 2 * T]] == POISON).all()), "the stream wrote slots the engine claimed"
        assert not errors_of(cache), errors_of(cache)
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
async def test_a_failed_copy_keeps_its_pages_until_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         layered: bool) -> None:
    """The copy of page 1 fails at launch (as a CUDA launch fault settles: scatters queued before it
    may still read its pool page): that page stays referenced until ``finish``, as before, and the
    stream counts as running until then, so a load that needs it waits (bounded) instead of stopping;
    the delivered copies' pages go back as they end. ``finish`` reports the suffix above the fault."""
    cache, kv, source, a, b = await _setup(tmp_path, launch_turn_s=0, offload_wait=BOUND_S)
    try:
        transfers = cache._transfers
        assert transfers is not None
        failed: list[int] = []
        for name in ("load", "load_layers"):
            real = getattr(transfers, name)

            def launch(page_ids: list[int], slots: torch.Tensor, skip: int, after: Any = None,
                       real: Any = real) -> Any:
                if int(slots[0]) == int(TA[T]):
                    failed.append(1)
                    return failed_copy(RuntimeError("copy launch fault (injected)"))
                return real(page_ids, slots, skip, after)

            monkeypatch.setattr(transfers, name, launch)
        match = await _match_a(cache, a, "disk")  # one copy a page, also layer by layer
        kv[:, TA] = POISON
        kv[:, TB] = POISON
        waiting = _watch_room_waits(cache)
        held_b: Any = None
        async with asyncio.timeout(BOUND_S):
            stream = await cache.start_load(match, TA, layered=layered)
            try:
                # Nothing is launched below the failed copy (the suffix ends above it): page 0's
                # read ahead, if started, lands in the pool and goes back (evictable).
                assert await stream.launched() == T
                await cache.flush()
                answers = [await stream.wait_layer(layer) for layer in range(LAYOUT.num_layers)]
                assert not any(answers), answers
                assert failed == [1]
                await _copies_over(stream)
                assert cache.stats().pool_referenced == 1  # the failed copy's page alone
                # B needs 3 pages: 3 are evictable, so it loads at once; the engine then pins them.
                assert await _second(cache, "load", b) == B_PAGES * T, errors_of(cache)
                held_b = await cache.match(b)
                assert held_b.pool_pages == B_PAGES
                # A's first page again: it needs the page the failed copy holds.
                more = await cache.match(a[:T])
                assert (more.pool_pages, more.disk_pages) == (0, 1), more
                task = asyncio.ensure_future(cache.load(more, torch.arange(200, 200 + T)))
                await waiting.wait()
                assert not task.done(), "the load stopped instead of waiting for the stream's end"
            finally:
                result = await stream.finish()
            assert (await task).tokens == T, errors_of(cache)
        held_b.release()
        assert torch.equal(kv[:, torch.arange(200, 200 + T)], source[:, :T])
        assert torch.equal(kv[:, TB], source[:, A_PAGES * T : (A_PAGES + B_PAGES) * T])
        assert (result.loaded_from, result.disk_pages) == (2 * T, 2), result
        assert torch.equal(kv[:, TA[2 * T :]], source[:, 2 * T : A_PAGES * T])
        errors = errors_of(cache)
        assert errors.get("copy_failed") == 1 and errors.get("load_shortened") == 1, errors
        assert "pool_exhausted" not in errors, errors
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
async def test_a_failed_copy_given_back_for_room_ends_the_streams_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layered: bool,
) -> None:
    """Review 163: B's pages held leave one pool page free; the stream reads A's page 3 into it and
    launches its copy (held on the copy thread), page 2's read finds the pool full, and
    ``_make_room`` waits for that copy, which fails on the copy thread, and gives its page back. The
    loader then ends holding nothing: the stream no longer counts in ``loads_running`` (it did until
    ``finish``, the failed launch still counted as holding, and a load needing room waited for it)."""
    cache, kv, source, a, b = await _setup(tmp_path, offload_wait=BOUND_S)
    first_slot = int(TA[3 * T])
    failed: list[int] = []
    real_scatter = HostScatter.load

    def scatter(self: HostScatter, page_ids: list[int], slots: torch.Tensor, skip_first: int = 0,
                layers: range | None = None) -> None:
        if int(slots[0]) == first_slot:
            failed.append(3)
            raise RuntimeError("copy engine fault (injected)")
        real_scatter(self, page_ids, slots, skip_first, layers)

    monkeypatch.setattr(HostScatter, "load", scatter)
    real_make_room = LoadStream._make_room
    making_room = asyncio.Event()

    async def make_room(self: LoadStream, page: int) -> bool:
        making_room.set()
        return await real_make_room(self, page)

    monkeypatch.setattr(LoadStream, "_make_room", make_room)
    manager = cache._manager
    held_b: Any = None
    try:
        cache.pool.table.evict(cache.pool.num_pages)
        kv[:, TA] = POISON
        kv[:, TB] = POISON
        async with asyncio.timeout(BOUND_S):
            assert await _second(cache, "load", b) == B_PAGES * T, errors_of(cache)
            held_b = await cache.match(b)  # B's pages referenced: one pool page left free
            assert held_b.pool_pages == B_PAGES
            match = await cache.match(a)
            assert (match.pool_pages, match.disk_pages) == (0, A_PAGES), match
        gate = CopyThreadGate(cache)
        stream = await cache.start_load(match, TA, layered=layered)
        try:
            async with asyncio.timeout(BOUND_S):
                await making_room.wait()
            (launch,) = stream._copies.launches  # page 3's copy, held on the copy thread
            assert (launch.low, launch.high) == (3, 3)
            assert not launch.copy.future.done() and not cache.pool.table.has_room()
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            try:
                assert await stream.launched() == 3 * T
                assert failed == [3]
                assert manager.loads_running == 0, "the stream still counts as running, holding nothing"
                assert stream._copies.holding == 0
                assert cache.stats().pool_referenced == B_PAGES
            finally:
                result = await stream.finish()
        assert stream._copies.holding == 0
        held_b.release()
        held_b = None
        assert (result.loaded_from, result.loaded_tokens) == (A_PAGES * T, 0), result  # nothing above the fault
        assert bool((kv[:, TA[: 3 * T]] == POISON).all()), "a page below the failed copy was copied"
        assert torch.equal(kv[:, TB], source[:, A_PAGES * T : (A_PAGES + B_PAGES) * T])
        errors = errors_of(cache)
        assert errors.get("copy_failed") == 1 and errors.get("load_shortened") == 1, errors
        assert "pool_exhausted" not in errors, errors
        assert manager.loads_running == 0
        await assert_quiescent(cache)
    finally:
        if held_b is not None:
            held_b.release()
        await cache.aclose()


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_stream_and_a_load_cancelled_at_random_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
) -> None:
    """A stream (pool or disk hit, whole or layered, the engine claiming a random part) and a load
    of another hit at once through the small pool, each cancelled at a random loop turn (or not).
    What was not cancelled loads whole (the stream: its unclaimed suffix), bit-exact; a cancelled
    one writes nothing after its ``CancelledError``; no reference, reservation or job is left."""
    cache, kv, source, a, b = await _setup(tmp_path, offload_wait=BOUND_S)
    slow_host_copies(monkeypatch, seed)
    rng = random.Random(seed)
    checked = cancelled = 0
    try:
        for _ in range(16):
            tier, layered = rng.choice(["pool", "disk"]), rng.random() < 0.5
            match = await _match_a(cache, a, tier)
            kv[:, TA] = POISON
            kv[:, TB] = POISON
            claim = rng.choice([0, 0, T, 2 * T, 3 * T + 1])
            hold = rng.randrange(0, 40)

            async def streamed(match: Any, layered: bool, claim: int, hold: int) -> Any:
                async with await cache.start_load(match, TA, layered=layered) as stream:
                    stream.claim(claim)
                    front = await stream.launched()
                    for layer in range(LAYOUT.num_layers):
                        assert await stream.wait_layer(layer)
                    await _turns(hold)  # the engine prefills its tail
                    result = await stream.finish()
                assert result.loaded_from == front, result
                return result

            tasks = [asyncio.ensure_future(streamed(match, layered, claim, hold)),
                     asyncio.ensure_future(_turns(rng.randrange(0, 30)))]
            await tasks[1]
            tasks[1] = asyncio.ensure_future(_second(cache, "load", b))
            victim = rng.choice([None, 0, 1])
            if victim is not None:
                await _turns(rng.randrange(0, 60))
                tasks[victim].cancel()
            async with asyncio.timeout(BOUND_S):
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for task, outcome, target in zip(tasks, outcomes, (TA, TB), strict=True):
                if task.cancelled():
                    cancelled += 1
                    kv[:, target] = POISON
                elif isinstance(outcome, BaseException):
                    raise outcome
            await assert_quiescent(cache)
            if tasks[0].cancelled():
                assert bool((kv[:, TA] == POISON).all()), "a stream copy wrote the slots after its cancel"
            else:
                result = outcomes[0]
                assert result.loaded_from <= max(result.claimed, T * -(-claim // T)), result
                assert result.loaded_from >= result.claimed, result
                assert torch.equal(kv[:, TA[result.loaded_from :]], source[:, result.loaded_from : A_PAGES * T])
                checked += 1
            if tasks[1].cancelled():
                assert bool((kv[:, TB] == POISON).all()), "a load copy wrote the slots after its cancel"
            else:
                assert outcomes[1] == B_PAGES * T, (outcomes[1], errors_of(cache))
                assert torch.equal(kv[:, TB], source[:, A_PAGES * T : (A_PAGES + B_PAGES) * T])
                checked += 1
            assert not errors_of(cache), errors_of(cache)
        assert checked and cancelled, (checked, cancelled)
    finally:
        await cache.aclose()
