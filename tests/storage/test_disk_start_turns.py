"""Page I/O started at once by a caller is spread over turns of the loop by a time budget (#14).

32 reads asked for in one turn all started in that turn (open, fstat, fcntl, SQEs: ~35 us each),
holding the loop ~1.1-1.4 ms. With :data:`~aiokv.storage.jobs.START_TURN_S` = 0 each turn starts
one page; every page is still read or written, in order, and nothing leaks.
"""

from __future__ import annotations

import asyncio
import collections
import selectors
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_helpers import BACKENDS, assert_clean, config, fill, key_of, payload, ready_pool, reserve, small_layout

from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import jobs as jobs_module
from aiokv.storage.jobs import Job

PAGES = 8


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type,unused-ignore]
    """Counts the loop's turns: every turn of an asyncio selector loop polls its selector once."""

    turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.turns += 1
        result: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        return result


def spy_starts(tier: DiskTier, name: str, selector: CountingSelector,
               per_turn: collections.Counter[int]) -> None:
    """Count, per turn, the pages whose I/O ``tier.<name>`` starts with a slot."""
    real: Callable[[Job, int], None] = getattr(tier, name)

    def spy(job: Job, slot: int) -> None:
        per_turn[selector.turns] += 1
        real(job, slot)

    setattr(tier, name, spy)


@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_pages_asked_for_at_once_start_within_the_turns_budget(tmp_path: Path, backend: DiskBackend,
                                                              budget: float,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_module, "START_TURN_S", budget, raising=False)
    layout = small_layout()
    reads: collections.Counter[int] = collections.Counter()
    writes: collections.Counter[int] = collections.Counter()
    selector = CountingSelector()

    async def scenario() -> None:
        with ready_pool(layout, 2 * PAGES) as pool:
            async with DiskTier(config(tmp_path / "d", backend, queue_depth=PAGES), layout, pool) as tier:
                spy_starts(tier, "_write_slot", selector, writes)
                spy_starts(tier, "_read_slot", selector, reads)
                held = [fill(pool, key_of(i), i) for i in range(PAGES)]
                want = [payload(pool, h) for h in held]
                assert await asyncio.gather(*(tier.write(key_of(i), h) for i, h in enumerate(held))) == [True] * PAGES
                for h in held:
                    pool.table.release(h)
                pool.table.evict(pool.num_pages)
                into = [reserve(pool, key_of(i)) for i in range(PAGES)]
                assert await asyncio.gather(*(tier.read(key_of(i), h) for i, h in enumerate(into))) == [True] * PAGES
                for i, h in enumerate(into):
                    assert torch.equal(payload(pool, h), want[i])
                    pool.table.abort(h)
                assert_clean(pool)

    loop = asyncio.SelectorEventLoop(selector)
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert sum(reads.values()) == PAGES and sum(writes.values()) == PAGES
    if budget == 0.0:
        # Before the budget: the 8 reads started in one turn (the writes reach their slots after
        # their hashes, which one callback per turn runs for all of them: also one turn).
        assert max(reads.values()) == 1, dict(reads)
        assert max(writes.values()) == 1, dict(writes)
    else:
        assert max(reads.values()) == PAGES, dict(reads)  # a whole second: all in their first turn
