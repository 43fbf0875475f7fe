"""Adversarial (helper-202): a page given up by its writer and taken over by a third call.

A load (or a match) waits for a page another call is writing into the pool. That writer is
cancelled (its page aborted) and, before the waiter looks again, a third call (another engine
offloading the same prompt) reserves the page anew. The waiter took the page for one still held
by the first writer past its bound: a load stopped there (0 of 6 pages, counted
``load_shortened`` for no fault), a match stopped there and took no disk page either. Found by
``test_adv_rev202_shared_prefix_fuzz`` (seeds 1 and 3). Now the waiter waits for the new writer
in turn (``commit_wait`` still bounds the whole wait).

The interleaving is forced: the page table's ``abort`` is wrapped so that the third offload
starts as soon as the first writer's pages are aborted; the manager's offload reserves in its
first step, which runs before the waiter's task resumes (two loop hops behind the abort).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of
from loop_probes import until, waiting_in
from test_adv_rev195_cancel_sweep import GARBAGE, oracle, prompt
from test_adv_rev195_scenarios import BOUND_S, PAGES, N, T, _kv, _region

from aiokv import KVCache

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


def _someone_waits_for_a_commit() -> bool:
    """A task (the match's, or a load's promotion group) waits in ``PageTable.wait_committed``."""
    return any(waiting_in(task, "wait_committed") for task in asyncio.all_tasks())


@pytest.mark.asyncio
@pytest.mark.parametrize("waiter", ["load", "match"])
async def test_a_waiter_waits_for_the_call_that_took_over_a_given_up_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waiter: str
) -> None:
    """load: the prompt is on disk only and matched; an offload of it reserves its pages (copy
    held), the load's promotions wait for them. match: the prompt is new; an offload reserves its
    pages (copy held), a match waits for them. The offload is cancelled; a third offload of the
    same prompt reserves the pages right after the abort. The waiter must end with all 6 pages
    (bit-exact for the load), no fault counted."""
    kv = _kv()
    tokens = prompt(51)[:N]
    truth = oracle(tokens, None)
    async with KVCache(config(tmp_path / "disk", pool_pages=32, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        match = None
        if waiter == "load":
            slots = _region(7)
            kv[:, slots] = truth
            await cache.offload(tokens, slots)
            kv[:, slots] = GARBAGE
            await cache.flush()
            for key in cache.keys(tokens):
                assert cache.pool.table.discard(key)
            match = await cache.match(tokens)
            assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        first_slots, third_slots, target = _region(1), _region(3), _region(2)
        kv[:, first_slots] = truth
        kv[:, third_slots] = truth
        table = cache.pool.table
        real_abort = table.abort
        third: list[asyncio.Future[Any]] = []

        def abort(handle: Any) -> None:
            real_abort(handle)
            if not third:  # the first writer's abort: the third call reserves before the waiter looks
                third.append(asyncio.ensure_future(cache._manager.offload(tokens, third_slots)))

        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.offload(tokens, first_slots))
            await until(lambda: cache.stats().pool_reserved == PAGES)
            if match is not None:
                done = asyncio.ensure_future(cache.load(match, target[: match.tokens]))
            else:
                done = asyncio.ensure_future(cache.match(tokens))
            await until(_someone_waits_for_a_commit)
            monkeypatch.setattr(table, "abort", abort)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            kv[:, first_slots] = GARBAGE
            await until(lambda: bool(third))
            monkeypatch.setattr(table, "abort", real_abort)
            await until(lambda: _someone_waits_for_a_commit() or done.done())
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            outcome = await done
            stored = await third[0]
        kv[:, third_slots] = GARBAGE
        assert stored.stored == PAGES, stored
        if match is not None:
            assert outcome.tokens == PAGES * T, (outcome, errors_of(cache))
            assert torch.equal(kv[:, target[: outcome.tokens]], truth[:, : outcome.tokens])
        else:
            assert (outcome.pool_pages, outcome.disk_pages) == (PAGES, 0), (outcome, errors_of(cache))
            outcome.release()
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)
