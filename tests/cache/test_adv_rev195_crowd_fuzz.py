"""Adversarial (helper-195): a crowd of engines on one small pool, seeded, with random cancels.

Each round starts several callers at once (3 to 5) on a tree of prompts that share prefixes,
under salts that differ only in type (``"x"`` and ``b"x"``: two tenants whose keys must never
meet) and the shared namespace: loads (from a random token), compute-or-load streams (random
claims, layer waits, some ended by another task's ``aclose``), offloads of the same prefixes from
the callers' own slots, prefetches and matches released unused. The pool holds fewer pages than
one match, so loads go through it in windows, streams give pages back to make room and wait for
each other, promotions evict what the others just brought in, and the write-behind holds pages
while all that happens. Each caller is cancelled, with some chance, after a random number of loop
turns or a random sleep (the copies run on the copy thread, slowed a random 0-2 ms each, so a
cancel lands while one runs).

Oracle (:func:`oracle`): token i's KV is a hash of the salt (its type included) and
``tokens[: i + 1]``. A completed call's loaded tokens hold the oracle's bytes, the engine's claimed
tokens its own (MARK), the rest POISON; a cancelled one's tokens hold one of those, never other
bytes. Once a caller ended (any way), its slots are overwritten at once (POISON; an offload's with
GARBAGE, which a late read would store and a later load show) and, after ``flush``, must be
unchanged. Every round ends quiescent and with every await bounded (a hang fails the seed).

``AIOKV_REV195_CROWD_SEEDS=a:b`` runs seeds ``[a, b)`` (default ``0:3``, a few seconds);
``AIOKV_REV195_CROWD_ROUNDS`` the rounds per seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
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
from aiokv.stream import StreamResult

T = LAYOUT.page_tokens
POISON = 100.0
GARBAGE = -50.0
MARK = -100.0
BOUND_S = float(os.environ.get("AIOKV_REV195_CROWD_BOUND", "30"))
LONGEST = 20
"""Pages of the longest prompt: past TURN_PAGES (16), a match and a load give the loop a turn."""
REGION = (LONGEST + 1) * T
"""Slots each caller of a round owns (a prompt has at most LONGEST pages and a partial one)."""
CALLERS = 5
SALTS: list[str | bytes | None] = [None, "x", b"x"]
ALLOWED = {"pool_exhausted", "load_shortened", "commit_wait_expired", "write_behind_full"}

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def oracle(tokens: list[int], salt: str | bytes | None) -> torch.Tensor:
    """``[L, len, rows, D]`` of values k/8, k in [-32, 32): a hash of the salt's type and bytes,
    ``tokens[: i + 1]``, the layer, row and column. Never POISON, GARBAGE or MARK."""
    tag = b"n" if salt is None else (b"s" + salt.encode() if isinstance(salt, str) else b"b" + salt)
    state = xxhash.xxh64(b"rev195-crowd" + len(tag).to_bytes(2, "little") + tag)
    prefix = np.empty(len(tokens), dtype=np.uint64)
    for i, token in enumerate(tokens):
        state.update(int(token).to_bytes(8, "little"))
        prefix[i] = state.intdigest()
    shape = (LAYOUT.num_layers, 1, LAYOUT.rows, LAYOUT.head_dim)
    where = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    x = prefix.reshape(1, -1, 1, 1) ^ (where * np.uint64(0x9E3779B97F4A7C15))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    values = ((x >> np.uint64(58)).astype(np.int64) - 32).astype(np.float32) / 8
    return torch.from_numpy(values).to(LAYOUT.dtype)


def _prompts(rng: random.Random, pages: int) -> list[list[int]]:
    """A tree over a tiny alphabet: shared prefixes, equal pages under other prefixes; at most
    ``pages`` full pages and a partial one each."""
    prompts: list[list[int]] = []
    for _ in range(6):
        base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
        keep = rng.randrange(0, len(base) + 1)
        grown = base[:keep] + [rng.randrange(0, 3) for _ in range(rng.randrange(1, pages * T))]
        prompts.append(grown[: pages * T + rng.randrange(0, T)])
    return prompts


class InjectedCopyFault(RuntimeError):
    """A copy that failed on the copy thread (the test's fault)."""


def _slow(monkeypatch: pytest.MonkeyPatch, seed: int, faults: float) -> list[int]:
    """Copies on the copy thread wait a random 0-2 ms first; with chance ``faults`` a load's copy
    fails before it writes, an offload's after writing garbage into its pool pages (a torn copy:
    those pages must never be served). Returns the count of faults injected (one element)."""
    pace = random.Random(seed)
    fired = [0]

    def slowed_load(this: HostScatter, *args: Any, **kwargs: Any) -> None:
        time.sleep(pace.choice([0, 0, 0.0005, 0.002]))
        if pace.random() < faults:
            fired[0] += 1
            raise InjectedCopyFault("load copy failed")
        real_load(this, *args, **kwargs)

    def slowed_offload(this: HostGather, slots: torch.Tensor, page_ids: list[int]) -> None:
        time.sleep(pace.choice([0, 0, 0.0005, 0.002]))
        real_offload(this, slots, page_ids)
        if pace.random() < faults:
            this._pages[page_ids] = GARBAGE
            fired[0] += 1
            raise InjectedCopyFault("offload copy torn")

    real_load, real_offload = HostScatter.load, HostGather.offload
    monkeypatch.setattr(HostScatter, "load", slowed_load)
    monkeypatch.setattr(HostGather, "offload", slowed_offload)
    return fired


class Crowd:
    def __init__(self, seed: int, cache: KVCache, kv: torch.Tensor, rng: random.Random, faults: bool) -> None:
        self.seed = seed
        self.faults = faults
        self.cache = cache
        self.kv = kv
        self.rng = rng
        self.prompts = _prompts(rng, LONGEST if seed % 3 == 0 else 11)
        self.log: list[str] = []
        self.counts: dict[str, int] = {}

    def fail(self, what: str) -> str:
        return f"seed {self.seed}: {what}; log tail {self.log[-10:]}"

    def only(self, what: str, slots: torch.Tensor, allowed: list[torch.Tensor | float]) -> None:
        """Every token of ``slots`` holds, in each layer, one of ``allowed`` (a tensor per token
        ``[L, n, rows, D]`` or a fill value): a layer-wise copy that failed or was cancelled
        between two layers leaves a token's first layers written and its last ones not."""
        got = self.kv[:, slots]
        fine = torch.zeros(got.shape[:2], dtype=torch.bool)
        for choice in allowed:
            fine |= (got == choice).all(dim=3).all(dim=2)
        bad = (~fine).any(dim=0).nonzero().flatten().tolist()
        assert not bad, self.fail(f"{what}: tokens {bad[:8]} of {len(slots)} hold other bytes "
                                  f"(values {got[:, bad].unique().tolist()[:6]})")

    def exact(self, what: str, slots: torch.Tensor, truth: torch.Tensor | float) -> None:
        got = self.kv[:, slots]
        ok = bool((got == truth).all()) if not isinstance(truth, torch.Tensor) else torch.equal(got, truth)
        if not ok:
            self.only(what, slots, [truth])
            raise AssertionError(self.fail(f"{what}: differs"))

    async def turns_or_sleep(self) -> None:
        if self.rng.random() < 0.6:
            for _ in range(self.rng.choice([0, 1, 2, 5, self.rng.randrange(0, 200)])):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(self.rng.choice([0.0002, 0.001, 0.003, 0.01]))

    # -- the callers ----------------------------------------------------------------------------

    async def load(self, slots: torch.Tensor, tokens: list[int], salt: Any, state: dict[str, Any]) -> None:
        truth = oracle(tokens, salt)
        m = await self.cache.match(tokens, salt)
        start = self.rng.choice([0, 0, self.rng.randrange(0, m.tokens + 1)])
        state["check"] = lambda: self.only("cancelled load", slots[: m.tokens - start],
                                           [POISON, truth[:, start : m.tokens]])
        result = await self.cache.load(m, slots[: m.tokens - start], from_token=start)
        assert result.from_token == start and start <= result.tokens <= m.tokens, self.fail(f"{result} of {m}")
        self.exact("load", slots[: result.tokens - start], truth[:, start : result.tokens])
        if self.faults:  # a copy above a failed one may have landed past the valid prefix
            self.only("load past its result", slots[result.tokens - start : m.tokens - start],
                      [POISON, truth[:, result.tokens : m.tokens]])
            self.exact("load past its match", slots[m.tokens - start : REGION], POISON)
        else:
            self.exact("load past its result", slots[result.tokens - start : REGION], POISON)

    async def stream(self, slots: torch.Tensor, tokens: list[int], salt: Any, state: dict[str, Any]) -> None:
        truth = oracle(tokens, salt)
        rng = self.rng
        m = await self.cache.match(tokens, salt)
        start = rng.choice([0, 0, rng.randrange(0, m.tokens + 1)])
        mine = slots[: m.tokens - start]
        state["check"] = lambda: self.only("cancelled stream", mine, [POISON, MARK, truth[:, start : m.tokens]])
        stream = await self.cache.start_load(m, mine, from_token=start, layered=rng.random() < 0.5)
        if rng.random() < 0.25:
            # Another task ends it (the engine gave up the request) while the engine still claims.
            async def abort() -> None:
                await self.turns_or_sleep()
                await stream.aclose()

            state["abort"] = asyncio.ensure_future(abort())
        async with stream:
            pos = start
            stop = rng.choice([start, m.tokens, rng.randrange(start, m.tokens + 1)])
            chunk = rng.choice([1, T, 3 * T])
            try:
                # The claims too: an abort task may close the stream between two (claim() says so).
                while (end := stream.claim(min(pos + chunk, stop))) > pos:
                    self.kv[:, mine[pos - start : end - start]] = MARK
                    pos = end
                    await asyncio.sleep(0)
                await stream.launched()
                for layer in range(LAYOUT.num_layers):
                    await stream.wait_layer(layer)
                result: StreamResult = await stream.finish()
            except RuntimeError as exc:
                if "aclose" not in str(exc):  # another task closed it: claim() or finish() says so
                    raise
                return
        assert result.claimed == pos and pos <= result.loaded_from <= m.tokens, self.fail(f"{result} claimed {pos}")
        self.exact("stream", mine[result.loaded_from - start :], truth[:, result.loaded_from : m.tokens])
        self.exact("stream claimed", mine[: pos - start], MARK)
        # Not reported (the engine computes them): a copy below a failed one may have landed there.
        self.only("stream between", mine[pos - start : result.loaded_from - start],
                  [POISON, truth[:, pos : result.loaded_from]])

    async def offload(self, slots: torch.Tensor, tokens: list[int], salt: Any, state: dict[str, Any]) -> None:
        n = self.rng.choice([len(tokens), self.rng.randrange(0, len(tokens) + 1)])
        self.kv[:, slots[:n]] = oracle(tokens[:n], salt)
        state["garbage"] = True
        result = await self.cache.offload(tokens[:n], slots[:n], salt=salt)
        assert result.stored + result.skipped + result.dropped == n // T, self.fail(f"{result} of {n}")

    async def prefetch(self, slots: torch.Tensor, tokens: list[int], salt: Any, state: dict[str, Any]) -> None:
        await self.cache.prefetch(tokens, salt=salt)

    async def match(self, slots: torch.Tensor, tokens: list[int], salt: Any, state: dict[str, Any]) -> None:
        async with await self.cache.match(tokens, salt):  # released on the way out, cancelled too
            await self.turns_or_sleep()

    # -- a round --------------------------------------------------------------------------------

    async def caller(self, index: int, op: str, tokens: list[int], salt: Any) -> None:
        slots = torch.arange(index * REGION, (index + 1) * REGION)
        self.kv[:, slots] = POISON
        state: dict[str, Any] = {}
        run: Callable[..., Awaitable[None]] = getattr(self, op)
        task = asyncio.ensure_future(run(slots, tokens, salt, state))
        if self.rng.random() < 0.35:
            await self.turns_or_sleep()
            task.cancel()
        try:
            async with asyncio.timeout(BOUND_S):
                await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            if "check" in state:
                state["check"]()
            self.counts["cancelled"] = self.counts.get("cancelled", 0) + 1
        abort = state.get("abort")
        if abort is not None:
            async with asyncio.timeout(BOUND_S):
                await abort
            if "check" in state:
                state["check"]()
        # The engine reuses the slots at once: nothing may write them any more.
        self.kv[:, slots] = GARBAGE if state.get("garbage") else POISON
        self.counts[op] = self.counts.get(op, 0) + 1

    async def round(self, number: int) -> None:
        rng = self.rng
        callers = []
        for index in range(rng.randrange(3, CALLERS + 1)):
            op = rng.choice(["load", "load", "stream", "stream", "offload", "offload", "prefetch", "match"])
            which, salt = rng.randrange(len(self.prompts)), rng.choice(SALTS)
            self.log.append(f"r{number} c{index} {op} p{which} {salt!r}")
            callers.append(self.caller(index, op, self.prompts[which], salt))
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*callers)
            await self.cache.flush()
        for index in range(CALLERS):
            slots = torch.arange(index * REGION, (index + 1) * REGION)
            self.only(f"round {number} caller {index} after the flush", slots, [POISON, GARBAGE])
            poisoned = self.kv[:, slots]
            assert bool(((poisoned == POISON) | (poisoned == GARBAGE)).all()), self.fail("written after its end")
        await assert_quiescent(self.cache)

    async def verify(self) -> None:
        """Each prompt under each salt: a load alone serves only the oracle's bytes."""
        slots = torch.arange(0, REGION)
        for tokens in self.prompts:
            for salt in SALTS:
                self.kv[:, slots] = POISON
                m = await self.cache.match(tokens, salt)
                result = await self.cache.load(m, slots[: m.tokens])
                self.exact(f"verify {salt!r}", slots[: result.tokens], oracle(tokens, salt)[:, : result.tokens])
        self.kv[:, slots] = POISON
        await assert_quiescent(self.cache)


async def run_seed(seed: int, root: Path, rounds: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    rng = random.Random(seed)
    faults = 0.05 if seed % 4 == 1 else 0.0
    fired = _slow(monkeypatch, seed, faults)
    kv = torch.full((LAYOUT.num_layers, CALLERS * REGION, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    pool_pages = rng.choice([4, 6, 8, 12])
    # Long waits (AIOKV_REV195_CROWD_WAIT seconds) make a wait that only a bound ends (callers
    # waiting on each other for room or a commit) a timeout of the round rather than a slow one.
    wait = float(os.environ.get("AIOKV_REV195_CROWD_WAIT", "0"))
    cfg = config(root, pool_pages=pool_pages, disk_pages=rng.choice([24, 96]), offload_wait=wait or 0.05,
                 commit_wait=wait or rng.choice([0.0, 0.2]))
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        crowd = Crowd(seed, cache, kv, rng, faults > 0)
        crowd.log.append(f"pool {pool_pages} pages")
        for number in range(rounds):
            await crowd.round(number)
            if number % 8 == 7:
                await crowd.verify()
        await crowd.verify()
        stats = cache.stats()
        errors = {kind for kind, n in stats.errors.items() if n} - ALLOWED - ({"copy_failed"} if faults else set())
        assert stats.disk is not None
        if stats.errors.get("disk_read_failed", 0) <= stats.disk.misses and not stats.disk.corrupt:
            # Pages the disk tier evicted (its budget is small) between a match and the read: misses.
            errors.discard("disk_read_failed")
        assert not errors, crowd.fail(f"faults counted: {stats}")
        # Every failed copy is counted (by its caller, or once over when the caller gave it up).
        assert (stats.errors.get("copy_failed", 0) > 0) == (fired[0] > 0), crowd.fail(f"{fired[0]} faults")
        return crowd.counts


def _seeds() -> range:
    low, high = (int(x) for x in os.environ.get("AIOKV_REV195_CROWD_SEEDS", "0:3").split(":"))
    return range(low, high)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", _seeds())
async def test_a_crowd_of_callers_with_random_cancels_gets_only_the_oracles_bytes(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = await run_seed(seed, tmp_path / "disk", int(os.environ.get("AIOKV_REV195_CROWD_ROUNDS", "16")),
                            monkeypatch)
    assert counts.get("load", 0) + counts.get("stream", 0) > 0, counts
