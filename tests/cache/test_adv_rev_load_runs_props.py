"""Property test of whole-page loads by run copies (``KVCache.load`` over the STAGING mover, whose run
copies run with memmove on the CPU under Triton's interpreter; other slot maps take the staged
kernels) as an engine drives them: random layouts, a prompt whose pages are in the pool (a prefix,
on fragmented pool pages) and on disk (the rest, read into fresh pool pages), ``from_token`` inside
a page, launch groups that cut runs, and slot maps of every shape: one run, page runs with gaps or
in reverse page order, a run descending, a permutation, a run broken by one swap, a run across a
gap inside a page.

Oracle: each token's KV is a hash of its whole prefix (``test_split_oracle_props.oracle``), so a
page copied from the wrong pool page, into the wrong slots, with a wrong layer step or a partial
run's wrong length shows up. Checked bit for bit: every loaded token's KV; the slots after the load
keep their poison; no other slot and no pool page changes; every page is counted; slot maps made of
runs were copied by runs (the mover's ``runs_loaded``), the others were not.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, assert_quiescent, config, mover_of
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_split_oracle_props import POISON, oracle

from aiokv import KVCache, KVLayout
from aiokv.kernels import TransferPath
from aiokv.kernels.paths import interpreting
from aiokv.loadpath import read_group_pages
from aiokv.pagetable import PageHandle

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or not interpreting(),
                                reason="CPU run copies (memmove) under Triton's interpreter")

MAPS = ("run", "page_runs_gaps", "page_runs_reversed", "descending", "permutation", "swap", "gap_in_page")
RUN_MAPS = ("run", "page_runs_gaps", "page_runs_reversed")
"""Slot maps whose every page's loaded slots are one ascending run: copied by runs."""


@dataclass(frozen=True)
class Case:
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    page_tokens: int
    pages: int
    pool_pages: int
    """The prompt's first pages in the pool; the rest only on disk."""
    from_token: int
    tail: int
    launch_pages: int
    slot_map: str
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    t = draw(st.integers(1, 5))
    pages = draw(st.integers(1, 7))
    return Case(
        layers=draw(st.integers(1, 3)),
        heads=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([4, 8])),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
        page_tokens=t,
        pages=pages,
        pool_pages=draw(st.integers(0, pages)),
        from_token=draw(st.integers(0, pages * t)),
        tail=draw(st.integers(0, t - 1)) if t > 1 else 0,
        launch_pages=draw(st.integers(1, 4)),
        slot_map=draw(st.sampled_from(MAPS)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _slot_map(case: Case, rng: random.Random, total: int) -> list[int]:
    """Slots for tokens ``[from_token, pages * T)`` of ``case``, inside ``[0, total)``, all distinct."""
    t, first = case.page_tokens, case.from_token
    count = case.pages * t - first
    if count == 0:
        return []
    if case.slot_map in ("run", "descending", "swap"):
        start = rng.randrange(total - count + 1)
        slots = list(range(start, start + count))
        if case.slot_map == "descending":
            slots.reverse()
        elif case.slot_map == "swap" and count >= 2:
            a, b = rng.sample(range(count), 2)
            slots[a], slots[b] = slots[b], slots[a]
        return slots
    if case.slot_map == "permutation":
        return rng.sample(range(total), count)
    # Per page a run of its loaded tokens (page 0 from its first loaded token), the pages' runs in
    # free places with gaps, in page order or reversed.
    lengths = [min((p + 1) * t, case.pages * t) - max(p * t, first) for p in range(first // t, case.pages)]
    lengths = [n for n in lengths if n > 0]
    cursor = rng.randrange(4)
    places = []
    for n in lengths:
        places.append(cursor)
        cursor += n + rng.randrange(1, 4)  # a gap: the next page's run does not follow
    if case.slot_map == "page_runs_reversed":
        places = [cursor - p - n for p, n in zip(places, lengths, strict=True)]
    slots = [s for p, n in zip(places, lengths, strict=True) for s in range(p, p + n)]
    if case.slot_map == "gap_in_page":
        # One page's run broken in its middle: its later slots one further on (not a run).
        long = [i for i, n in enumerate(lengths) if n >= 2]
        if long:
            i = rng.choice(long)
            at = sum(lengths[:i]) + rng.randrange(1, lengths[i])
            end = sum(lengths[: i + 1])
            slots[at:end] = [s + 1 for s in slots[at:end]]
            slots[end:] = [s + 2 for s in slots[end:]]
    return slots


def _expected_runs(case: Case, slots: list[int]) -> int:
    """Pages the mover must copy by runs: each ``load`` call (a launch group of pool pages, or of
    disk pages within one read group) goes by runs when every page's loaded slots are one ascending
    run (the stacked buffer's geometry allows it and one copy per page stays within the budget)."""
    t, first = case.page_tokens, case.from_token
    runs = []
    for p in range(first // t, case.pages):
        lo, hi = max(p * t, first) - first, (p + 1) * t - first
        if hi > lo:
            page = slots[lo:hi]
            runs.append(all(b == a + 1 for a, b in itertools.pairwise(page)))
    pooled = max(0, case.pool_pages - first // t)
    calls = [runs[i : min(i + case.launch_pages, pooled)] for i in range(0, pooled, case.launch_pages)]
    layout = KVLayout.mha(case.layers, case.heads, case.head_dim, case.dtype, page_tokens=t)
    read_group = read_group_pages(layout.page_bytes)
    disk = runs[pooled:]
    for group in (disk[g : g + read_group] for g in range(0, len(disk), read_group)):
        calls += [group[i : i + case.launch_pages] for i in range(0, len(group), case.launch_pages)]
    return sum(len(call) for call in calls if all(call))


def _fragment(cache: KVCache, rng: random.Random, count: int) -> list[PageHandle]:
    """Reserve ``count`` decoy pages and abort a random half in random order: the prompt's pages then
    take scattered pool page ids, not one ascending run."""
    pool = cache.pool
    keys = [b"decoy" + i.to_bytes(11, "little") for i in range(count)]
    handles = []
    for key in keys:
        (res,) = pool.reserve([key])
        assert res.handle is not None
        handles.append(res.handle)
    order = list(range(count))
    rng.shuffle(order)
    kept: list[PageHandle] = []
    for n, i in enumerate(order):
        if n % 2:
            kept.append(handles[i])
        else:
            pool.table.abort(handles[i])
    return kept


async def _example(case: Case, root: Path) -> None:
    layout = KVLayout.mha(case.layers, case.heads, case.head_dim, case.dtype, page_tokens=case.page_tokens)
    t = case.page_tokens
    rng = random.Random(case.seed)
    prompt = [rng.randrange(3) for _ in range(case.pages * t + case.tail)]  # a tiny alphabet
    truth = oracle(prompt, layout)
    n = case.pages * t
    total = 3 * n + 24
    kv = torch.zeros(case.layers, total, layout.rows, layout.head_dim, dtype=case.dtype)
    # A first cache writes every page to disk.
    async with KVCache(config(root, pool_pages=case.pages + 4, disk_pages=case.pages + 8, layout=layout),
                       layout, kv) as writer:
        await writer.pool.wait_ready()
        kv[:, :n] = truth[:, :n]
        assert (await writer.offload(prompt[:n], torch.arange(n))).stored == case.pages
        await writer.flush()
    decoys = 2 * case.pages + 4
    cfg = config(root, pool_pages=case.pages + decoys + 4, disk_pages=case.pages + 8, layout=layout,
                 transfer_path=TransferPath.STAGING, launch_pages=case.launch_pages, launch_turn_s=0)
    async with KVCache(cfg, layout, kv) as cache:
        await cache.pool.wait_ready()
        kept = _fragment(cache, rng, decoys)
        p = case.pool_pages * t
        if p:
            kv[:, :p] = truth[:, :p]
            assert (await cache.offload(prompt[:p], torch.arange(p))).stored == case.pool_pages
        await cache.flush()
        match = await cache.match(prompt)
        assert (match.pool_pages, match.disk_pages) == (case.pool_pages, case.pages - case.pool_pages)
        slots = _slot_map(case, rng, total)
        gen = torch.Generator().manual_seed(case.seed)
        kv.copy_(torch.randint(-64, 64, kv.shape, generator=gen).to(case.dtype) / 8)
        target = torch.tensor(slots, dtype=torch.long)
        kv[:, target] = POISON
        before = kv.clone()
        mover = mover_of(cache)
        runs_before = mover.runs_loaded
        result = await cache.load(match, target, from_token=case.from_token)
        assert result.tokens == n and not result.shortened
        loaded = case.pages - case.from_token // t
        assert result.pool_pages + result.disk_pages == loaded
        for i, slot in enumerate(slots):
            assert torch.equal(kv[:, slot], truth[:, case.from_token + i]), (
                f"token {case.from_token + i} (slot {slot}) is not its prefix's KV")
        others = torch.ones(total, dtype=torch.bool)
        others[target] = False
        assert torch.equal(kv[:, others], before[:, others]), "a slot outside the load changed"
        copied_by_runs = mover.runs_loaded - runs_before
        event(f"{case.slot_map} by runs" if copied_by_runs else f"{case.slot_map} staged")
        assert copied_by_runs == _expected_runs(case, slots)
        if case.slot_map in RUN_MAPS:
            assert copied_by_runs == loaded
        for handle in kept:
            cache.pool.table.abort(handle)
        await assert_quiescent(cache)


_examples = itertools.count()
EXAMPLES = int(os.environ.get("AIOKV_LOAD_RUNS_EXAMPLES", "60"))
"""Examples per run (more to hunt)."""


@pytest.mark.asyncio
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
async def test_whole_loads_by_runs_serve_each_tokens_prefix(case: Case, tmp_path: Path) -> None:
    root = tmp_path / f"example-{next(_examples)}"
    try:
        await _example(case, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
