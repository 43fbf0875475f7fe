"""Adversarial (helper-217): a later window of a load waits for its own read, not the call's deadline.

A load larger than the pool's room is promoted in windows; the promotions past a window's end
are adopted (they land and are given back), and the next window promotes those pages again: one
an adopted promotion is still reading is PENDING, and the window waits for its commit. Review 214
(bc94f34) made one ``commit_wait`` deadline hold for all the waits of a call, set at its first;
a window that met its own read after that deadline expired at once: the load stopped there
(``commit_wait_expired``, ``load_shortened``) although only its own disk read was under way.
Waiting for one's own read now takes a fresh ``commit_wait`` (as every wait did before review
214) and spends none of the call's; waits for other calls' pages share the call's
``commit_wait``, now the time they spent (review 217's budget: see test_adv_rev217_wait_budget).
Here the first wait spends all but ``SPARE_S`` of it, and the own read is held longer than that.

Everything real but the first writer of page 4, a page-table reservation (as a TP rank's copy
holds one) given up while the load waits for it: the load's promotion then reads page 4 itself,
that read held in front of the tier's backend (``LoadGate``) until the next window waits for it.
The pool is 8 pages, 5 held by another prompt's match: window 1 reads pages 0-1, its copy held
on the copy thread until the deadline has passed.

CPU only: the copy thread is held (on CUDA the mover runs on the loop).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, make_kv, mover_of, on_disk_only, prompt
from held_call import Hold
from load_gate import LoadGate
from loop_probes import until, until_thread, waiting_in

from aiokv import KVCache
from aiokv.pagetable import PageState

T = LAYOUT.page_tokens
PAGES = 6
POOL = 8
FILLER = POOL - 3
"""Pages held by another prompt: 3 free, for pages 0-1 and page 4's first writer."""
WAIT_S = 1.0
"""commit_wait."""
SPARE_S = 0.1
"""The call's commit_wait left when page 4's first writer gives it up."""
HELD_S = 0.3
"""How long the load's own read of page 4 is held once window 2 waits for it (more than SPARE_S)."""
BOUND_S = 20.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


@pytest.mark.asyncio
async def test_a_later_window_waits_for_its_own_read_past_the_calls_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(2171, PAGES * T)
    filler = prompt(2172, FILLER * T)
    kv = make_kv(2173)
    cfg = config(tmp_path / "disk", pool_pages=POOL, commit_wait=WAIT_S, read_group_bytes=2 * LAYOUT.page_bytes)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        keys = await on_disk_only(cache, tokens, torch.arange(PAGES * T))
        assert (await cache.offload(filler, torch.arange(100, 100 + FILLER * T))).stored == FILLER
        await cache.flush()
        held = await cache.match(filler)  # referenced: not evictable
        assert held.pool_pages == FILLER, held
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        (first,) = cache.pool.reserve([keys[4]])  # page 4's first writer
        assert first.handle is not None, first
        hold = Hold()
        mover = mover_of(cache)
        monkeypatch.setattr(mover, "load", hold.wrap(mover.load))
        loop = asyncio.get_running_loop()
        target = torch.arange(140, 140 + PAGES * T)
        load = asyncio.create_task(cache.load(match, target))
        gate: LoadGate | None = None
        try:
            # Window 1: pages 0-1 read and in a copy (held), 2-3 found no room, page 4 waited for.
            await hold.wait_entered()
            await until(lambda: any(waiting_in(t, "wait_committed") for t in asyncio.all_tasks()))
            deadline = loop.time() + WAIT_S  # the call's first wait ends no later
            # The writer gives page 4 up late, most of the call's commit_wait spent: the load's
            # adopted promotion reads it (held).
            gate = LoadGate(disk, monkeypatch, limit=1)
            given_up = asyncio.Event()
            loop.call_at(deadline - SPARE_S, lambda: (table.abort(first.handle), given_up.set()))
            await given_up.wait()
            await until_thread(lambda: bool(gate is not None and gate.held), "page 4's read")
            assert table.state_of(keys[4]) is PageState.RESERVED
            # The bound is what this is about: past the first wait's deadline, window 1's copy ends.
            await asyncio.sleep(max(0.0, deadline - loop.time()) + 0.05)
            hold.release()
            # Window 2 meets page 4, its own read's: it waits (before: expired at once, or once the
            # call's commit_wait left, SPARE_S, was spent; the load over).
            await until_thread(lambda: load.done() or any(
                waiting_in(t, "wait_committed") for t in asyncio.all_tasks()), "window 2's wait")
            loop.call_later(HELD_S, gate.open)  # a read slower than the call's commit_wait left
            async with asyncio.timeout(BOUND_S):
                result = await load
        finally:
            hold.release()
            if gate is not None:
                gate.open()
            if not load.done():
                load.cancel()
            held.release()
        assert result.tokens == PAGES * T, (result, errors_of(cache))
        assert errors_of(cache) == {}, errors_of(cache)
        assert torch.equal(kv[:, target], kv[:, : PAGES * T])
        await assert_quiescent(cache)
