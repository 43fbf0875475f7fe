"""Adversarial (review 204): the offload that takes over pages another call gave up, cancelled at
every point.

Since review 202 (31e7235) the second of two offloads of one prefix waits for the pages the first
is writing and, when the first gives them up (cancelled, its copy failed), reserves them again
and copies them from its own slots: it holds the caller's slots longer, and copies from gathered
(not sliced) slots. This sweep cancels that second call at every point (its own copies, the wait,
the take-over's copy) while the first gives its pages up, on even attempts by a cancel, on odd
ones by a failed copy (torn: garbage written into its pool pages, then the fault).

Oracles: a token's KV is a hash of its whole prefix (``test_adv_rev195_cancel_sweep.oracle``), so
a page's bytes tie it to its key; both calls' slots hold GARBAGE as soon as each call ended, so a
copy still reading them afterwards stores garbage, which the final whole-prompt load shows (a
page copied from the wrong slots shows as another prefix's bytes). After each attempt: nothing
reserved or referenced (no reference leaked by the take-over), and a completed call's result
adds up to its pages, with every page it reports stored or skipped found by the final match.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of
from cancel_points import most_attempts, pause
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostGather

T = LAYOUT.page_tokens
PAGES = 7
SHARED = 4
"""Pages the first call writes (the shared prefix), in two groups of a gathered second round."""
N = PAGES * T + 1
DENSE = 40
BOUND_S = 30.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


class TornCopy(RuntimeError):
    """The first call's copy wrote garbage into its pool pages, then failed (the test's fault)."""


def _pace(monkeypatch: pytest.MonkeyPatch, seed: int, first: torch.Tensor, tear: list[bool]) -> None:
    """Offload copies wait a random 0-2 ms first; while ``tear[0]``, copies out of ``first``'s
    slots write garbage into their pool pages and fail."""
    pace = random.Random(seed)
    real = HostGather.offload
    low, high = int(first[0]), int(first[-1])

    def offload(this: HostGather, slots: torch.Tensor, page_ids: list[int]) -> None:
        time.sleep(pace.choice([0, 0, 0.0005, 0.002]))
        if tear[0] and low <= int(slots.min()) and int(slots.max()) <= high:
            this._pages[page_ids] = GARBAGE
            raise TornCopy("first offload's copy torn")
        real(this, slots, page_ids)

    monkeypatch.setattr(HostGather, "offload", offload)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 3) for _ in range(N)]  # a tiny alphabet: equal pages under other prefixes


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [0, 1])
async def test_an_offload_taking_over_given_up_pages_cancelled_at_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    kv = torch.full((LAYOUT.num_layers, 4 * N, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    first_slots = torch.arange(0, SHARED * T)
    # The second call's slots run backwards: a gathered round must take each page's own slots.
    second_slots = torch.arange(3 * N - 1, 2 * N - 1, -1)
    check = torch.arange(3 * N, 4 * N)
    tear = [False]
    _pace(monkeypatch, seed, first_slots, tear)
    tokens = _prompt(seed)
    cfg = config(tmp_path / "disk", pool_pages=64, disk_pages=256, commit_wait=5.0)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        attempt = cancelled = 0
        while True:
            assert attempt < most_attempts(DENSE), f"seed {seed}: the second offload never completed"
            salt = f"a{attempt}"
            truth = oracle(tokens, salt)
            tear[0] = attempt % 2 == 1
            kv[:, first_slots] = truth[:, : SHARED * T]
            kv[:, second_slots] = truth
            stored_before = cache.stats().pages_stored
            first = asyncio.ensure_future(cache.offload(tokens[: SHARED * T], first_slots, salt=salt))
            await asyncio.sleep(0)  # it reserved the shared pages
            second = asyncio.ensure_future(cache.offload(tokens, second_slots, salt=salt))
            if not tear[0]:
                await asyncio.sleep(0)
                first.cancel()
            wait = await pause(attempt, DENSE)
            second.cancel()
            how = "torn" if tear[0] else "cancelled"
            where = f"seed {seed} attempt {attempt} (second cancelled after {wait}, first {how})"
            outcomes: list[Any] = []
            for task in (second, first):
                try:
                    async with asyncio.timeout(BOUND_S):
                        outcomes.append(await asyncio.shield(task))
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise
                    outcomes.append(None)
                # The engine reuses the call's slots at once: nothing may read them any more.
                kv[:, second_slots if task is second else first_slots] = GARBAGE
            result = outcomes[0]
            await assert_quiescent(cache)  # nothing reserved or referenced: no reference leaked
            match = await cache.match(tokens, salt)
            kv[:, check] = POISON
            loaded = await cache.load(match, check[: match.tokens])
            got = kv[:, check[: loaded.tokens]]
            bad = (got != truth[:, : loaded.tokens]).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            assert not bad, f"{where}: wrong KV at tokens {bad[:8]} ({loaded} of {match})"
            assert bool((kv[:, check[loaded.tokens :]] == POISON).all()), where
            if result is not None:
                assert result.stored + result.skipped + result.dropped == PAGES, (where, result)
                if result.dropped == 0:
                    assert loaded.tokens == PAGES * T, (where, result, loaded, errors_of(cache))
                # The first stored nothing (cancelled early or torn): every page the second did not
                # drop it stored itself, counted once.
                if outcomes[1] is None or outcomes[1].stored == 0:
                    assert result.stored == PAGES - result.dropped, (where, result, outcomes[1])
                    assert cache.stats().pages_stored - stored_before == result.stored, (where, result)
            assert set(errors_of(cache)) <= {"copy_failed"}, (where, errors_of(cache))
            await assert_quiescent(cache)
            if result is None:
                cancelled += 1
                attempt += 1
                continue
            break
        assert cancelled > 0, f"seed {seed}: never cancelled"
