"""Property test of the compute-or-load split (``start_load``) as an engine drives it, on the CPU.

Each example draws a layout, a tree of prompts sharing prefixes (tokens from a tiny alphabet, so
pages with equal tokens under different prefixes abound), what a first cache wrote to disk and what
a restarted one holds in its pool, faults applied for real between ``match`` and ``start_load``
(a page file corrupted, truncated or unlinked, a page deleted through the tier, an I/O error on the
next read, a concurrent prefetch), a copy that fails, and an engine: where its own prefix ends
(``from_token``), its claims (chunk sizes, loop turns, ``wait_front``), whether it waits on each
layer after ``launched()``, how it ends (``finish``, ``aclose``, a claim after the end: refused since
review 295), whether its task is cancelled after some loop turns and whether another task aborts its
stream (``aclose``) after some. One or two engines run at once (their prompts may share pages).
Copies into the KV buffer run one at a time, each only once the test lets it (:class:`Throttle`), so
layers land while the engine and the consumer watch. An abort never overlaps the engine's
``launched``/``finish``/``aclose`` (a lock): those overlaps are the deterministic cases of
``test_split_concurrent_close.py`` (two defects this test found, fixed in ``LoadStream``).

Oracle: each token's KV is a hash of its whole prefix, layer, row and column (:func:`oracle`), so a
page served for the wrong prefix, a half-copied page or a late copy shows up. Checked: every claim
stays below the load's front and grows; what the engine computed is never overwritten; a layer
reported ready holds the oracle's bytes of every loaded token at that moment; the reported suffix
holds them after ``finish``; tokens not reported hold the poison or the oracle's bytes, never other
bytes; no slot outside the loads changes; once the engine's task ended (cancelled included) or an
abort's ``aclose`` returned, the slots poisoned again then stay poisoned through a drain; no
reference, reservation or background job is left; the statistics agree with the results; the cache
still serves the oracle's bytes afterwards.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import random
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from cache_helpers import DEVICE, assert_quiescent, config
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_cache_faults import _flip_payload_byte

from aiokv import KVCache, KVLayout
from aiokv.kernels.hostcopy import HostScatter
from aiokv.keys import PageKey
from aiokv.results import Tier
from aiokv.storage.backends import IOOp
from aiokv.stream import LoadStream, StreamResult

POISON = 100.0
"""What the target slots hold before the load: outside the oracle's range, exact in every dtype."""
MARK = -100.0
"""What the engine writes into the tokens it computes (claims)."""
BOUND_S = 30.0
"""A hang fails the example instead of the suite's timeout."""
FAULTS = ("flip", "truncate_header", "truncate_half", "unlink", "evict", "eio", "prefetch", "churn")

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="throttles the CPU copy thread")


def oracle(tokens: list[int], layout: KVLayout) -> torch.Tensor:
    """``[L, len, rows, D]``: token i's KV is a hash of ``tokens[: i + 1]``, the layer, row and column.

    Values are k/8 for k in [-64, 64): exact in fp16, bf16 and fp32, never POISON or MARK.
    (``test_adv_crash_restart.prefix_oracle`` is the same idea for its one layout, one generator per
    token; this one takes any layout and is vectorized.)
    """
    state = xxhash.xxh64(b"split-oracle")
    prefix = np.empty(len(tokens), dtype=np.uint64)
    for i, token in enumerate(tokens):
        state.update(token.to_bytes(8, "little"))
        prefix[i] = state.intdigest()
    shape = (layout.num_layers, 1, layout.rows, layout.head_dim)
    where = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    x = prefix.reshape(1, -1, 1, 1) ^ (where * np.uint64(0x9E3779B97F4A7C15))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    values = ((x >> np.uint64(57)).astype(np.int64) - 64).astype(np.float32) / 8
    return torch.from_numpy(values).to(layout.dtype)


class Throttle:
    """Copies into the KV buffer (``HostScatter.load``, on the copy thread) wait for a permit each;
    :meth:`pump` hands out one permit at a time while a task runs, so at most one copy (one layer of
    a layer-wise load) lands between two looks of the loop. Optionally the ``fail_at``-th copy
    raises (a copy fault): before copying anything, or after copying (``fail_late``)."""

    def __init__(self, real: Callable[..., None], fail_at: int | None, fail_late: bool) -> None:
        self._real = real
        self._fail_at = fail_at
        self._fail_late = fail_late
        self._cond = threading.Condition()
        self._permits = 0
        self._open = False
        self.calls = 0
        self.failed = False
        self._loop = asyncio.get_running_loop()
        self._landed: asyncio.Future[None] | None = None

    def scatter(self, *args: Any, **kwargs: Any) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._open or self._permits > 0, BOUND_S):
                raise TimeoutError("the test never let this copy run")
            if not self._open:
                self._permits -= 1
            index = self.calls
            self.calls += 1
        try:
            fail = index == self._fail_at
            if fail and not self._fail_late:
                self.failed = True
                raise RuntimeError("injected copy fault (before copying)")
            self._real(*args, **kwargs)
            if fail:
                self.failed = True
                raise RuntimeError("injected copy fault (after copying)")
        finally:
            self._loop.call_soon_threadsafe(self._wake)

    def as_method(self) -> Callable[..., None]:
        """:meth:`scatter` as a plain function, to stand in for a method (its instance is the first argument)."""

        def scatter(*args: Any, **kwargs: Any) -> None:
            self.scatter(*args, **kwargs)

        return scatter

    def _wake(self) -> None:
        if self._landed is not None and not self._landed.done():
            self._landed.set_result(None)

    def open(self) -> None:
        """Every copy runs at once from now on."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    async def pump(self, task: asyncio.Future[Any]) -> None:
        """Until ``task`` is done: one permit at a time, the next once the last one was used."""
        while not task.done():
            with self._cond:
                if self._permits == 0:
                    self._permits = 1
                    self._cond.notify_all()
            self._landed = self._loop.create_future()
            waits: set[asyncio.Future[Any]] = {task, self._landed}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)


@dataclass(frozen=True)
class Engine:
    """One request the engine serves by a split load, and how it drives the stream."""

    target: int
    """The prompt it serves."""
    tail: tuple[int, ...]
    """Tokens after the prompt (its uncached tail, a partial page)."""
    start: int
    """The engine's own prefix: ``start % (match.tokens + 1)`` when odd, else 0."""
    layered: bool
    steps: tuple[tuple[str, int], ...]
    """("claim", tokens ahead of the engine's position, may be <= 0 or past the end),
    ("turns", loop turns), ("front", a token to wait_front for, modulo the range)."""
    meet: bool
    """After the steps, claim a page at a time until the fronts meet."""
    layer_order: tuple[int, ...] | None
    """After launched(), wait_layer in this order (None: straight to finish)."""
    ending: str
    """finish | aclose | claim_after (finish, then claim past the end: RuntimeError, nothing moves)."""
    cancel_after: int | None
    """Cancel the engine's task after this many loop turns (None: never)."""
    abort_after: int | None
    """Another task closes the engine's stream after this many loop turns (None: never)."""
    slot_form: str
    """How the slots are passed: int64, int32, or a strided int64 view."""


@dataclass(frozen=True)
class Case:
    page_tokens: int
    layers: int
    heads: int
    dtype: torch.dtype
    prompts: tuple[tuple[int, ...], ...]
    """A tree of prefixes: each prompt extends a prefix of an earlier one."""
    on_disk: tuple[int, ...]
    """Per prompt, full pages the first cache stored (on disk only after the restart)."""
    in_pool: tuple[int, ...]
    """Per prompt, full pages offloaded again after the restart (in the pool)."""
    pool_pages: int
    disk_slack: int | None
    """Disk pages beyond what the first cache stored (None: plenty); tight, write-behind evicts."""
    launch_pages: int
    faults: tuple[tuple[int, str], ...]
    """(a disk page of engine 0's match, modulo its disk pages; what happens to it), after its match."""
    copy_fault: int | None
    """The n-th copy into the KV buffer raises."""
    fail_late: bool
    """It raises after copying (else before)."""
    engines: tuple[Engine, ...]
    throttled: bool
    slot_seed: int


@st.composite
def engines(draw: st.DrawFn, prompts: int, t: int, layers: int) -> Engine:
    steps = draw(st.lists(st.tuples(st.just("claim"), st.integers(1, t) | st.integers(-2, 4 * t))
                          | st.tuples(st.just("turns"), st.integers(0, 4))
                          | st.tuples(st.just("front"), st.integers(0, 8 * t)), max_size=8))
    order = draw(st.none() | st.permutations(range(layers)) | st.lists(st.integers(0, layers - 1), max_size=3))
    return Engine(
        target=draw(st.integers(0, prompts - 1)),
        tail=tuple(draw(st.lists(st.integers(0, 2), max_size=t))),
        start=draw(st.integers(0, 10**6)),
        layered=draw(st.booleans()),
        steps=tuple(steps),
        meet=draw(st.booleans()),
        layer_order=None if order is None else tuple(order),
        ending=draw(st.sampled_from(["finish", "finish", "aclose", "claim_after"])),
        cancel_after=draw(st.none() | st.none() | st.integers(0, 8) | st.integers(0, 60)),
        abort_after=draw(st.none() | st.none() | st.integers(0, 40)),
        slot_form=draw(st.sampled_from(["int64", "int64", "int32", "strided"])),
    )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    t = draw(st.sampled_from([1, 2, 3, 4, 8]))
    layers = draw(st.integers(1, 4))
    alphabet = st.integers(0, 2)  # tiny: equal pages under different prefixes abound
    prompts: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, 4))):
        base: tuple[int, ...] = draw(st.sampled_from(prompts)) if prompts else ()
        keep = draw(st.integers(0, len(base)))
        grown = tuple(draw(st.lists(alphabet, min_size=0 if keep else t, max_size=5 * t)))
        prompts.append(base[:keep] + grown)
    pages = [len(p) // t for p in prompts]
    return Case(
        page_tokens=t,
        layers=layers,
        heads=draw(st.integers(1, 2)),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
        prompts=tuple(prompts),
        on_disk=tuple(draw(st.just(n) | st.integers(0, n)) for n in pages),
        in_pool=tuple(draw(st.just(0) | st.integers(0, n)) for n in pages),
        pool_pages=draw(st.sampled_from([4, 8, 16, 24])),
        disk_slack=draw(st.none() | st.integers(0, 4)),
        launch_pages=draw(st.integers(1, 3)),
        faults=tuple(draw(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(FAULTS)), max_size=2))),
        copy_fault=draw(st.none() | st.none() | st.integers(0, 3)),
        fail_late=draw(st.booleans()),
        engines=tuple(draw(st.lists(engines(len(prompts), t, layers), min_size=1, max_size=2))),
        throttled=draw(st.booleans()),
        slot_seed=draw(st.integers(0, 2**16)),
    )


@dataclass
class Run:
    """What one engine saw and did (read by the checks once its task ended)."""

    spec: Engine
    request: list[int]
    slots: torch.Tensor
    """Where its request's tokens go (int64; what start_load gets is ``spec.slot_form`` of these)."""
    truth: torch.Tensor
    match: tuple[int, int, int] | None = None
    """tokens, pool pages, disk pages."""
    start: int = 0
    pos: int = 0
    """How far the engine computed (its last granted claim)."""
    front: int | None = None
    layers: dict[int, bool] = field(default_factory=dict)
    result: StreamResult | None = None
    outcome: str = ""
    faulted: bool = False
    """A fault was applied to its pages (or to the next disk read)."""
    stream: LoadStream | None = None
    closing: asyncio.Lock = field(default_factory=asyncio.Lock)
    aborted: bool = False
    closed: bool = False
    """The engine's own closing aclose returned."""
    poisoned_from: int | None = None
    """The abort poisoned the slots of ``[poisoned_from, match.tokens)`` once its aclose returned."""
    seen: torch.Tensor | None = None
    """Its slots' KV when its task ended (the slots not computed are poisoned again then)."""


def _page_file(root: Path, key: PageKey) -> Path | None:
    return next((p for p in root.rglob(key.hex()) if p.is_file()), None)


async def _apply_faults(case: Case, cache: KVCache, root: Path, keys: list[PageKey], pool: int, run: Run,
                        side: list[asyncio.Future[Any]]) -> None:
    """Faults on the match's disk pages ``[pool, len(keys))``, between match and start_load."""
    disk = cache.disk
    assert disk is not None
    touched: set[int] = set()  # one file fault per page
    for where, kind in case.faults:
        if kind == "eio":
            disk.backend.faults.inject(IOOp.READ, errno.EIO, times=1 + where % 3)
            run.faulted = True  # whichever reads come next
        elif kind == "prefetch":  # another call promotes the same pages meanwhile
            side.append(asyncio.ensure_future(cache.prefetch(run.request)))
        elif kind == "churn":  # other prompts' pages push the least recently used ones off the disk
            run.faulted = True
            for i in range(1 + where % 3):
                filler = [1000 + where, i, *range(2 * case.page_tokens - 2)]
                await cache.offload(filler, torch.arange(len(filler)))
            await cache.flush()
        elif len(keys) > pool:
            page = pool + where % (len(keys) - pool)
            path = _page_file(root, keys[page])
            if page in touched or path is None:
                continue
            touched.add(page)
            run.faulted = True
            if kind == "evict":
                await disk.delete(keys[page])
            elif kind == "flip":
                _flip_payload_byte(root, keys[page])
            elif kind == "unlink":
                path.unlink()
            else:
                os.truncate(path, 4096 if kind == "truncate_header" else path.stat().st_size // 2)


def _slot_form(slots: torch.Tensor, form: str) -> torch.Tensor:
    if form == "int32":
        return slots.to(torch.int32)
    if form == "strided":
        wide = torch.full((2 * len(slots),), -7, dtype=torch.long)  # out of range: read only if misread
        wide[::2] = slots
        return wide[::2]
    return slots


async def _engine(case: Case, cache: KVCache, root: Path, kv: torch.Tensor, run: Run, faults: bool,
                  side: list[asyncio.Future[Any]]) -> None:
    """The engine: match, faults, start_load, claims and "compute" (MARK), layers, the end.

    ``launched``, ``finish`` and the closing ``aclose`` run under ``run.closing`` (a lock another
    task's abort takes too): a second ``aclose`` or one during ``finish``/``launched`` in another
    task is the subject of ``test_split_concurrent_close.py``, not of this property."""
    spec, slots, truth = run.spec, run.slots, run.truth
    t = case.page_tokens
    match = await cache.match(run.request)
    async with match:  # releases the match when no stream took it
        run.match = (match.tokens, match.pool_pages, match.disk_pages)
        if faults:
            keys = list(cache.keys(run.request)[: match.pages])
            await _apply_faults(case, cache, root, keys, match.pool_pages, run, side)
        n = match.tokens
        start = spec.start % (n + 1) if spec.start % 2 else 0
        run.start = run.pos = start
        stream = await cache.start_load(match, _slot_form(slots[start:n], spec.slot_form), from_token=start,
                                        layered=spec.layered)
    run.stream = stream
    try:
        for kind, value in spec.steps:
            if kind == "turns":
                for _ in range(max(0, value)):
                    await asyncio.sleep(0)
            elif kind == "front":
                front = await stream.wait_front(start + value % (n - start + 1))
                assert front == stream.front
            else:
                _claim(stream, kv, run, run.pos + value)
        if spec.meet:  # a page at a time (a loop turn each) until the fronts meet
            for _ in range(n // t + 1):
                if not _claim(stream, kv, run, run.pos + t):
                    break
                await asyncio.sleep(0)
        if spec.ending == "aclose":
            return  # the finally closes it
        if spec.layer_order is not None:
            async with run.closing:
                if run.aborted:
                    return
                front = run.front = await stream.launched()
            assert run.pos <= front <= n, (run.pos, front, n)
            for layer in spec.layer_order:
                ready = await stream.wait_layer(layer)
                run.layers[layer] = run.layers.get(layer, True) and ready
                if ready and not run.aborted:  # layer's bytes are in place now (later ones may still be coming)
                    got = kv[layer, slots[front:n]]
                    assert torch.equal(got, truth[layer, front:n]), f"layer {layer} reported ready before it landed"
        async with run.closing:
            if run.aborted:
                with pytest.raises(RuntimeError, match="after aclose"):
                    await stream.finish()
                return
            run.result = await stream.finish()
        if spec.ending == "claim_after":
            before = kv[:, slots[:n]].clone()
            front = stream.front
            with pytest.raises(RuntimeError, match=r"claim\(\) after finish\(\): the stream is finished"):
                stream.claim(n + 1)
            assert stream.front == front and run.result.claimed == run.pos
            for _ in range(3):
                await asyncio.sleep(0)
            assert torch.equal(kv[:, slots[:n]], before), "a claim after finish() changed the slots"
    finally:
        async with run.closing:
            await stream.aclose()  # a no-op after finish() or an abort
            run.closed = True


async def _abort_after(kv: torch.Tensor, run: Run, turns: int) -> None:
    """Another task aborts the request: ``aclose`` on the engine's stream, then the slots it did not
    compute are poisoned again (nothing may write them once that aclose returned)."""
    for _ in range(turns):
        await asyncio.sleep(0)
    stream = run.stream
    if stream is None or run.match is None:
        return
    async with run.closing:
        if run.result is not None or run.closed:
            return  # finished or closed by the engine: nothing to abort
        run.aborted = True
        await stream.aclose()
    front = stream.front  # claims never pass it; copies are over
    kv[:, run.slots[front : run.match[0]]] = POISON
    run.poisoned_from = front


def _claim(stream: LoadStream, kv: torch.Tensor, run: Run, end: int) -> bool:
    """Claim up to ``end`` and compute what was granted; whether the engine moved (not once another
    task's abort closed the stream: the claim is refused then, review 295)."""
    front, before = stream.front, run.pos
    if run.aborted:  # its aclose() began (synchronously, in the abort's turn): the stream is ended
        with pytest.raises(RuntimeError, match=r"claim\(\) after aclose\(\): the stream was closed"):
            stream.claim(end)
        assert stream.front == front
        return False
    granted = stream.claim(end)
    assert before <= granted <= min(front, stream.tokens), (before, granted, front, stream.tokens)
    if end > before and front > before:
        assert granted > before, "a claim below the front was refused"
    kv[:, run.slots[before:granted]] = MARK  # the engine computes [before, granted)
    run.pos = granted
    return granted > before


async def _cancel_after(task: asyncio.Task[None], turns: int) -> None:
    for _ in range(turns):
        if task.done():
            return
        await asyncio.sleep(0)
    task.cancel()


async def _drain(cache: KVCache) -> None:
    """Everything queued on the copy thread before this call has run, and write-behind is done."""
    await cache.flush()
    await cache._bridge.run_cpu(lambda: None)
    for _ in range(3):
        await asyncio.sleep(0)


async def _setup(case: Case, layout: KVLayout, root: Path, kv: torch.Tensor, truths: list[torch.Tensor]) -> None:
    """A first cache stores ``on_disk`` pages of each prompt (on disk only after the restart)."""
    total = sum(case.on_disk)
    if not total:
        return
    async with KVCache(config(root, pool_pages=max(8, total + 4), disk_pages=total + 8, layout=layout),
                       layout, kv) as writer:
        await writer.pool.wait_ready()
        for prompt, pages, truth in zip(case.prompts, case.on_disk, truths, strict=True):
            if pages:
                n = pages * case.page_tokens
                kv[:, :n] = truth[:, :n]
                await writer.offload(list(prompt[:n]), torch.arange(n))
        await writer.flush()


def _check_slots(case: Case, run: Run) -> None:
    """What the slots of one engine held when its task ended (``run.seen``, by token position)."""
    seen = run.seen
    assert seen is not None
    if run.match is None:
        assert bool((seen == POISON).all()), "slots changed before any match"
        return
    n = run.match[0]
    start, pos, truth = run.start, run.pos, run.truth
    assert bool((seen[:, :start] == POISON).all()), "a copy reached the engine's own prefix"
    assert bool((seen[:, start:pos] == MARK).all()), "a copy overwrote tokens the engine computed"
    rest = seen[:, pos:n]
    assert bool(((rest == truth[:, pos:n]) | (rest == POISON)).all()), "bytes neither the oracle's nor the poison"
    assert bool((seen[:, n:] == POISON).all()), "a copy reached the slots past the match"
    if run.poisoned_from is not None:
        assert bool((seen[:, run.poisoned_from : n] == POISON).all()), "a copy landed after the abort's aclose"
    r = run.result
    if r is None:
        return
    t = case.page_tokens
    assert (r.tokens, r.from_token, r.claimed) == (n, start, pos), (r, n, start, pos)
    assert r.claimed <= r.loaded_from <= r.tokens, r
    assert torch.equal(seen[:, r.loaded_from:n], truth[:, r.loaded_from:n]), "the loaded suffix is wrong"
    pool_pages = run.match[1]
    suffix = range(r.loaded_from // t, n // t) if r.loaded_from < n else range(0)
    assert r.pool_pages == sum(1 for p in suffix if p < pool_pages), (r, pool_pages)
    assert r.disk_pages == sum(1 for p in suffix if p >= pool_pages), (r, pool_pages)
    if run.front is not None and r.loaded_from > run.front:
        assert not all(run.layers.get(layer, False) for layer in range(case.layers)), "a failed layer was ready"


def _ended(kv: torch.Tensor, run: Run) -> Callable[[asyncio.Future[None]], None]:
    """When the engine's task ends: keep what its slots hold, then poison the ones it did not compute
    (nothing may write them any more: its calls are over)."""

    def ended(_: asyncio.Future[None]) -> None:
        run.seen = kv[:, run.slots].clone()
        kv[:, run.slots[run.pos :]] = POISON

    return ended


def _check_counts(case: Case, cache: KVCache, runs: list[Run], errors_before: dict[str, int],
                  loaded_before: dict[Tier, int], copy_failed: bool) -> None:
    """Statistics against what the streams reported, and what no fault may cause."""
    t = case.page_tokens
    stats = cache.stats()
    errors = {k: v - errors_before.get(k, 0) for k, v in stats.errors.items() if v > errors_before.get(k, 0)}
    for kind in errors:
        event(f"counted {kind}")
    assert "stream_failed" not in errors, errors
    assert copy_failed or "copy_failed" not in errors, errors
    loaded = {tier: stats.loaded_tokens[tier] - loaded_before.get(tier, 0) for tier in (Tier.POOL, Tier.DISK)}
    results = [r.result for r in runs if r.result is not None]
    assert loaded == {Tier.POOL: t * sum(r.pool_pages for r in results),
                      Tier.DISK: t * sum(r.disk_pages for r in results)}, (loaded, results)
    for run in runs:
        r = run.result
        if r is None:
            continue
        if run.front is not None and not copy_failed:
            # Every launched copy landed: the suffix is the launched one, and every layer was ready.
            assert r.loaded_from == run.front, (r, run.front)
            assert all(run.layers.values()), run.layers
        if not errors and run.pos == run.start and not any(x.faulted for x in runs) and len(runs) == 1:
            assert r.loaded_from == run.start, ("nothing claimed and no fault, yet not all was loaded", r)
        if r.loaded_from - r.claimed >= t and not errors:
            event("the loader left whole pages to the engine without a fault")


def _note(case: Case, run: Run) -> None:
    """Hypothesis events: which paths the examples reached."""
    stage = "before start_load" if run.stream is None else "streaming" if run.result is None else "after finish"
    event(f"{run.outcome} {stage}" + (" (layered)" if run.spec.layered else "") + (" aborted" if run.aborted else ""))
    if run.match is not None:
        n, pool, disk = run.match
        event(f"match: {'pool' if pool else ''}{'+' if pool and disk else ''}{'disk' if disk else ''}"
              f"{'nothing' if not n else ''}")
    r = run.result
    if r is not None and r.tokens:
        where = ("all loaded" if r.loaded_from == r.from_token else "none loaded" if r.loaded_from == r.tokens
                 else "met mid-page" if r.loaded_from % case.page_tokens else "met")
        event(f"result: {where}{', claimed' if r.claimed > r.from_token else ''}"
              f"{', from mid-page' if r.from_token % case.page_tokens else ''}")
    if run.front is not None and run.result is not None and run.result.loaded_from > run.front:
        event("a copy failed after launch")


async def _example(case: Case, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    layout = KVLayout.mha(case.layers, case.heads, 8, case.dtype, page_tokens=case.page_tokens)
    requests = [list(case.prompts[e.target] + e.tail) for e in case.engines]
    longest = max(len(p) for p in case.prompts + tuple(tuple(r) for r in requests))
    scratch = 2 * longest + 16  # slots [0, scratch) stage offloads; the engines' slots are drawn from all
    slots_total = scratch + sum(len(r) for r in requests) + 8
    kv = torch.zeros(case.layers, slots_total, layout.rows, layout.head_dim, dtype=case.dtype)
    truths = [oracle(list(p), layout) for p in case.prompts]
    await _setup(case, layout, root, kv, truths)
    on_disk = sum(case.on_disk) + 2 * sum(case.in_pool)
    cfg = config(root, pool_pages=case.pool_pages, layout=layout, launch_pages=case.launch_pages,
                 launch_turn_s=0, offload_wait=0.1,
                 disk_pages=on_disk + 32 * longest if case.disk_slack is None else on_disk + case.disk_slack + 1)
    async with KVCache(cfg, layout, kv) as cache:
        await cache.pool.wait_ready()
        for prompt, pages, p_truth in zip(case.prompts, case.in_pool, truths, strict=True):
            if pages:
                n = pages * case.page_tokens
                kv[:, :n] = p_truth[:, :n]
                await cache.offload(list(prompt[:n]), torch.arange(n))
        await cache.flush()
        drawn = random.Random(case.slot_seed).sample(range(slots_total), sum(len(r) for r in requests))
        runs: list[Run] = []
        for request in requests:
            slots, drawn = torch.tensor(drawn[: len(request)], dtype=torch.long), drawn[len(request):]
            runs.append(Run(case.engines[len(runs)], request, slots, oracle(request, layout)))
        gen = torch.Generator().manual_seed(case.slot_seed)
        kv.copy_(torch.randint(-64, 64, kv.shape, generator=gen).to(case.dtype) / 8)
        for run in runs:
            kv[:, run.slots] = POISON
        guard = kv.clone()
        stats = cache.stats()
        errors_before, loaded_before = dict(stats.errors), dict(stats.loaded_tokens)
        side: list[asyncio.Future[Any]] = []
        with monkeypatch.context() as patch:
            throttle = Throttle(HostScatter.load, case.copy_fault, case.fail_late)
            patch.setattr(HostScatter, "load", throttle.as_method())
            if not case.throttled:
                throttle.open()
            tasks = [asyncio.ensure_future(_engine(case, cache, root, kv, run, i == 0, side))
                     for i, run in enumerate(runs)]
            for task, run in zip(tasks, runs, strict=True):
                task.add_done_callback(_ended(kv, run))
            cancellers = [asyncio.ensure_future(_cancel_after(task, run.spec.cancel_after))
                          for task, run in zip(tasks, runs, strict=True) if run.spec.cancel_after is not None]
            cancellers += [asyncio.ensure_future(_abort_after(kv, run, run.spec.abort_after))
                           for run in runs if run.spec.abort_after is not None]
            everything = asyncio.gather(*tasks, *cancellers, return_exceptions=True)
            try:
                async with asyncio.timeout(BOUND_S):
                    await throttle.pump(everything)
            finally:
                throttle.open()
                for task in tasks + cancellers:
                    task.cancel()  # only after a failure: each is done otherwise
                await asyncio.wait({everything})
            for task in cancellers:
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error
            for task, run in zip(tasks, runs, strict=True):
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error
                run.outcome = "cancelled" if task.cancelled() else "done"
                _note(case, run)
            for future in side:
                await future
            others = torch.ones(slots_total, dtype=torch.bool)
            for run in runs:
                others[run.slots] = False
                _check_slots(case, run)
            others[:scratch] = False  # staging of the churn's offloads (never written by a load)
            assert torch.equal(kv[:, others], guard[:, others]), "a slot outside the loads changed"
            _check_counts(case, cache, runs, errors_before, loaded_before, throttle.failed)
            # Once the calls are over nothing writes the slots (poisoned again as each task ended).
            await _drain(cache)
            for run in runs:
                assert bool((kv[:, run.slots[: run.start]] == POISON).all()), "a late copy: engine's prefix"
                assert bool((kv[:, run.slots[run.start : run.pos]] == MARK).all()), "a late copy: computed tokens"
                assert bool((kv[:, run.slots[run.pos :]] == POISON).all()), "a copy landed after the task ended"
        await assert_quiescent(cache)
        # The cache still serves the oracle's bytes for whatever it reports loaded.
        async with asyncio.timeout(BOUND_S):
            for run in runs:
                again = await cache.match(run.request)
                got = await cache.load(again, run.slots[: again.tokens])
                assert torch.equal(kv[:, run.slots[: got.tokens]], run.truth[:, : got.tokens]), "a later load is wrong"
        await assert_quiescent(cache)


_examples = itertools.count()
EXAMPLES = int(os.environ.get("AIOKV_SPLIT_EXAMPLES", "40"))
"""Examples per loop (with ``AIOKV_HYPOTHESIS_RANDOM=1``, more to hunt)."""


@pytest.mark.asyncio
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
async def test_split_load_serves_only_the_oracles_bytes(
    case: Case, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / f"example-{next(_examples)}"  # a fresh disk directory per example
    try:
        await _example(case, monkeypatch, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 256 fan-out directories each: not left for later
