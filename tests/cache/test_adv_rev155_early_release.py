"""Adversarial (helper-155): a stream gives each delivered copy's pool pages back as it ends (1d87ac9).

The danger of giving pages back before ``finish()``: a pool page evicted and reused (a promotion
reads another disk page into it, an offload gathers into it) while a copy still reads it, or a
reference given back twice. Each seeded round runs several callers at once over a pool much
smaller than their hits, so pages are evicted and reused all the time: streams (whole and layer by
layer, from a random token, claims, ``wait_front``, the engine's tail prefill between ``launched()``
and ``finish()``, ``aclose()``, dropped without either), plain loads, prefetches and offloads of
other prompts; any caller may be cancelled after a random number of loop turns; the copy thread's
copies take a random short while and a few fail before writing (a fault: the copy keeps its pages
until the stream ends).

Oracles: every token's KV is a function of its prompt's prefix (:func:`oracle`), so a page read
after another caller reused it shows in what a call reports loaded; slots are poisoned once their
call ended (cancelled included) and must still be poisoned after the round's flush; every copy
checks, as it ends on the copy thread, that each pool page it read is still READY, referenced and of
the generation it had when the copy began (a page given back early and reused would fail this even
where the bytes happened to agree); reference counts and ``loads_running`` are never negative (a
watcher samples them every loop turn); every round ends quiescent with ``loads_running`` back at 0.

``AIOKV_REV155_SEEDS=a:b`` runs seeds ``[a, b)`` (default ``0:3``), ``AIOKV_REV155_ROUNDS`` the rounds
per seed. Helper-155 ran seeds 0-39 at 30 rounds under both loops: all held (a mutant giving the
pages back at launch failed every seed it ran, 0-3).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostGather, HostScatter

T = LAYOUT.page_tokens
SLOTS = 768
POOL = 6
"""Pool pages: every hit of 4-10 pages, several at once, evicts and reuses what the others gave back."""
STORED = 6
"""Prompts written to disk before the rounds; the rest are offloaded during them (pool churn)."""
POISON = 100.0
MARK = -100.0
BOUND_S = 30.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def oracle(tokens: list[int]) -> torch.Tensor:
    """``[L, len, rows, D]``: token i's KV is a hash of ``tokens[: i + 1]``, layer, row and column;
    values k/8 for k in [-32, 32), exact in fp16, never POISON or MARK."""
    state = xxhash.xxh64(b"rev155")
    prefix = np.empty(len(tokens), dtype=np.uint64)
    for i, token in enumerate(tokens):
        state.update(int(token).to_bytes(8, "little"))
        prefix[i] = state.intdigest()
    shape = (LAYOUT.num_layers, 1, LAYOUT.rows, LAYOUT.head_dim)
    where = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    x = prefix.reshape(1, -1, 1, 1) ^ (where * np.uint64(0x9E3779B97F4A7C15))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(31))
    values = ((x >> np.uint64(58)).astype(np.int64) - 32).astype(np.float32) / 8
    return torch.from_numpy(values).to(LAYOUT.dtype)


class CopyProbe:
    """Slows the copy thread's copies and checks, as each load copy ends, that the pool pages it
    read were held all along; a few copies fail before writing anything."""

    def __init__(self, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.table: Any = None
        self.violations: list[str] = []
        self.copies = 0
        self.failed = 0
        self.fail_rate = 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        real_load, real_offload = HostScatter.load, HostGather.offload
        probe = self

        def load(this: HostScatter, page_ids: list[int], *args: Any, **kwargs: Any) -> None:
            table = probe.table
            before = [table._generation[p] for p in page_ids] if table is not None else []
            with probe._lock:
                pause = probe._rng.choice([0, 0, 0.0003, 0.001, 0.003])
                fail = probe._rng.random() < probe.fail_rate
            time.sleep(pause)
            if fail:
                with probe._lock:
                    probe.failed += 1
                raise RuntimeError("rev155: injected copy fault (nothing written)")
            real_load(this, page_ids, *args, **kwargs)
            time.sleep(pause)  # the copy still "reads" the pages: a reuse meanwhile shows below
            if table is None:
                return
            with probe._lock:
                probe.copies += 1
                for p, gen in zip(page_ids, before, strict=True):
                    state, refs, now = table._state[p], table._refs[p], table._generation[p]
                    if state != 2 or refs <= 0 or now != gen:
                        probe.violations.append(f"page {p}: state {state} refs {refs} gen {gen}->{now}")

        def offload(*args: Any, **kwargs: Any) -> None:
            time.sleep(probe._rng.choice([0, 0, 0.0005, 0.002]))
            real_offload(*args, **kwargs)

        monkeypatch.setattr(HostScatter, "load", load)
        monkeypatch.setattr(HostGather, "offload", offload)


class Round:
    """One round's callers over one cache: slots, poison, counters."""

    def __init__(self, seed: int, rng: random.Random, cache: KVCache, kv: torch.Tensor,
                 prompts: list[list[int]], truths: list[torch.Tensor], counts: dict[str, int]) -> None:
        self.seed, self.rng, self.cache, self.kv = seed, rng, cache, kv
        self.prompts, self.truths, self.counts = prompts, truths, counts
        self.free = list(range(SLOTS))
        self.poisoned: list[tuple[str, torch.Tensor]] = []
        self.dropped: list[asyncio.Task[None]] = []
        """Loaders of streams dropped without finish()/aclose(): a loader holds its stream until it ends."""

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def take(self, n: int) -> torch.Tensor:
        self.rng.shuffle(self.free)
        slots, self.free = self.free[:n], self.free[n:]
        assert len(slots) == n, "the test ran out of slots"
        return torch.tensor(slots, dtype=torch.long)

    def ended(self, what: str, slots: torch.Tensor) -> None:
        self.kv[:, slots] = POISON
        self.poisoned.append((what, slots))

    async def turns(self, n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    def check(self, what: str, slots: torch.Tensor, truth: torch.Tensor, low: int, high: int) -> None:
        if high > low:
            got = self.kv[:, slots[low:high]]
            if not torch.equal(got, truth[:, low:high]):
                bad = (got != truth[:, low:high]).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
                raise AssertionError(f"seed {self.seed} {what}: wrong KV at tokens {[low + b for b in bad][:8]} "
                                     f"of [{low}, {high})")

    def untouched_or_true(self, what: str, slots: torch.Tensor, truth: torch.Tensor, low: int, high: int) -> None:
        """Slots a call did not report loaded: poison, or what its copies past a failed one (or a
        failed copy's layers that did land) wrote: true bytes."""
        if high > low:
            got = self.kv[:, slots[low:high]]
            ok = (got == POISON) | (got == truth[:, low:high])
            assert bool(ok.all()), f"seed {self.seed} {what}: a copy wrote wrong bytes below the loaded suffix"

    async def cancellable(self, what: str, op: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.ensure_future(op())
        if self.rng.random() < 0.3:
            await self.turns(self.rng.choice([0, 1, 2, 5, self.rng.randrange(0, 60)]))
            task.cancel()
        try:
            async with asyncio.timeout(BOUND_S):
                await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            self.note(f"{what} cancelled")

    # -- callers --------------------------------------------------------------------------------

    async def stream(self) -> None:
        rng, cache = self.rng, self.cache
        which = rng.randrange(len(self.prompts))
        tokens, truth = self.prompts[which], self.truths[which]
        layered = rng.random() < 0.5

        async def op() -> None:
            m = await cache.match(tokens)
            start = rng.choice([0, 0, 0, rng.randrange(0, m.tokens + 1)])
            slots = self.take(m.tokens)
            self.kv[:, slots] = POISON
            dropped = False
            try:
                stream = await cache.start_load(m, slots[start:], from_token=start, layered=layered)
                ending = rng.random()
                if ending < 0.07:
                    # Dropped without finish()/aclose(): abandoned once collected; its slots may be
                    # written until then (not poison-checked), and nothing may be left held.
                    dropped = True
                    self.dropped.append(stream._loader)
                    del stream
                    await self.turns(rng.randrange(0, 8))
                    gc.collect()
                    self.note("stream dropped")
                    return
                async with stream:
                    pos = start
                    for _ in range(rng.randrange(0, 4)):
                        step = rng.random()
                        if step < 0.5:
                            end = stream.claim(pos + rng.choice([1, T, 2 * T, 5 * T]))
                            self.kv[:, slots[pos:end]] = MARK
                            pos = end
                        elif step < 0.8:
                            await self.turns(rng.randrange(0, 6))
                        else:
                            await stream.wait_front(rng.randrange(start, m.tokens + 1))
                    if ending < 0.2:
                        await self.turns(rng.randrange(0, 10))
                        await stream.aclose()
                        self.note("stream aclosed")
                        return
                    front = await stream.launched()
                    # The engine prefills its tail: the copies end meanwhile and give their pages
                    # back, which the other callers evict and reuse.
                    await self.turns(rng.randrange(0, 30))
                    if layered or rng.random() < 0.3:
                        for layer in rng.sample(range(LAYOUT.num_layers), LAYOUT.num_layers):
                            if await stream.wait_layer(layer):
                                got = self.kv[layer, slots[front:]]
                                assert torch.equal(got, truth[layer, front:m.tokens]), \
                                    f"seed {self.seed}: layer {layer} ready but wrong (front {front})"
                    result = await stream.finish()
                    assert result.claimed == pos <= result.loaded_from <= m.tokens, (result, pos)
                    self.check("stream", slots, truth, result.loaded_from, m.tokens)
                    assert bool((self.kv[:, slots[start:pos]] == MARK).all()), "a load overwrote computed tokens"
                    self.untouched_or_true("stream", slots, truth, pos, result.loaded_from)
                    self.note("stream layered" if layered else "stream whole")
                    if result.loaded_from < m.tokens:
                        self.note("stream loaded")
            finally:
                if not dropped:
                    self.ended("stream", slots)

        await self.cancellable("stream", op)

    async def load(self) -> None:
        rng, cache = self.rng, self.cache
        which = rng.randrange(len(self.prompts))
        tokens, truth = self.prompts[which], self.truths[which]

        async def op() -> None:
            m = await cache.match(tokens)
            start = rng.choice([0, 0, rng.randrange(0, m.tokens + 1)])
            slots = self.take(m.tokens)
            self.kv[:, slots] = POISON
            try:
                result = await cache.load(m, slots[start:], from_token=start)
                self.check("load", slots, truth, start, result.tokens)
                # Past a failed copy, later groups' copies may have landed: true bytes, never others.
                self.untouched_or_true("load", slots, truth, result.tokens, m.tokens)
                self.note("load")
            finally:
                self.ended("load", slots)

        await self.cancellable("load", op)

    async def offload(self) -> None:
        rng, cache = self.rng, self.cache
        which = rng.randrange(len(self.prompts))
        tokens, truth = self.prompts[which], self.truths[which]
        n = rng.choice([len(tokens), rng.randrange(T, len(tokens) + 1)])
        slots = self.take(n)
        self.kv[:, slots] = truth[:, :n]

        async def op() -> None:
            await cache.offload(tokens[:n], slots)
            self.note("offload")

        try:
            await self.cancellable("offload", op)
        finally:
            self.free.extend(slots.tolist())  # the engine may reuse them: an offload only read them

    async def prefetch(self) -> None:
        which = self.rng.randrange(len(self.prompts))

        async def op() -> None:
            await self.cache.prefetch(self.prompts[which])
            self.note("prefetch")

        await self.cancellable("prefetch", op)

    async def run(self, callers: int) -> None:
        ops = [self.stream] * 5 + [self.load] * 2 + [self.offload] * 2 + [self.prefetch]
        started = []
        for _ in range(callers):
            started.append(asyncio.ensure_future(self.rng.choice(ops)()))
            await self.turns(self.rng.randrange(0, 4))
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*started)
            if self.dropped:
                await asyncio.wait(self.dropped)
        gc.collect()  # dropped streams are abandoned now, tracked: the flush waits for them
        await asyncio.sleep(0)
        async with asyncio.timeout(BOUND_S):
            await assert_quiescent(self.cache)
        assert self.cache._manager.loads_running == 0, self.cache._manager.loads_running
        for what, slots in self.poisoned:
            assert bool((self.kv[:, slots] == POISON).all()), \
                f"seed {self.seed}: slots of a {what} written after it ended"


async def _watch(cache: KVCache, seen: list[str]) -> None:
    """Every loop turn: no negative reference count, no negative ``loads_running``."""
    table = cache.pool.table
    refs = np.frombuffer(table._refs, dtype=np.int64)
    while True:
        if cache._manager.loads_running < 0:
            seen.append(f"loads_running {cache._manager.loads_running}")
        if (refs < 0).any():
            seen.append(f"negative refs at {np.flatnonzero(refs < 0).tolist()}")
        await asyncio.sleep(0)


async def run_seed(seed: int, root: Path, rounds: int, probe: CopyProbe) -> dict[str, int]:
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    prompts = [gen.integers(0, 50_000, rng.randrange(4, 11) * T + rng.randrange(0, T)).tolist() for _ in range(12)]
    truths = [oracle(tokens) for tokens in prompts]
    kv = torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    async with KVCache(config(root, pool_pages=64, disk_pages=256), LAYOUT, kv) as writer:
        await writer.pool.wait_ready()
        for tokens, truth in zip(prompts[:STORED], truths[:STORED], strict=True):
            kv[:, : len(tokens)] = truth
            await writer.offload(tokens, torch.arange(len(tokens)))
        await writer.flush()
    kv.fill_(POISON)
    counts: dict[str, int] = {}
    seen: list[str] = []
    cache = KVCache(config(root, pool_pages=POOL, disk_pages=256, launch_pages=rng.choice([1, 2]),
                           offload_wait=0.5, stream_readahead_bytes=2 * LAYOUT.page_bytes), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    probe.table = cache.pool.table
    probe.fail_rate = 0.03 if seed % 3 == 2 else 0.0
    watcher = asyncio.ensure_future(_watch(cache, seen))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # the dropped streams' warning
            for _ in range(rounds):
                await Round(seed, rng, cache, kv, prompts, truths, counts).run(rng.randrange(3, 9))
                assert not seen, f"seed {seed}: {seen[:4]}"
                assert not probe.violations, \
                    f"seed {seed}: a copy's pool page was reused under it: {probe.violations[:4]}"
    finally:
        watcher.cancel()
        probe.table = None
        await cache.aclose()
    counts["copies probed"] = probe.copies
    counts["copies failed"] = probe.failed
    if os.environ.get("AIOKV_REV155_TRACE"):
        print(f"seed {seed}: {sorted(counts.items())} errors {dict(cache.stats().errors)}", flush=True)
    return counts


def _seeds() -> range:
    low, high = (int(x) for x in os.environ.get("AIOKV_REV155_SEEDS", "0:3").split(":"))
    return range(low, high)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", _seeds())
async def test_early_given_back_pages_are_never_reused_under_a_copy(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = CopyProbe(seed, monkeypatch)
    counts = await run_seed(seed, tmp_path / "disk", int(os.environ.get("AIOKV_REV155_ROUNDS", "12")), probe)
    # Not vacuous: copies ran under the probe. (A seed may draw no stream that loads anything, all
    # cancelled, dropped or cut short: seed 57, whose copies are loads' and prefetches'.)
    assert counts["copies probed"] > 0, counts
