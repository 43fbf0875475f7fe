"""Review 198: a follower's delete that lands while a look's result is being applied (between two of
its bounded steps, :data:`~aiokv.storage.followpath.APPLY_PER_TURN` keys each) is asked by the rest
of that apply.

Review 194's apply decided once, before its first step, whether any delete was remembered
(``deletes``) and skipped :meth:`_looked_deleted` for every key when none was: the caller's first
delete of a key the look had found but the apply had not reached yet was remembered, and the next
step indexed the page anyway: the follower served a page its caller had just deleted (stale KV).

A real writer B, a follower A; B's page of the victim and 4,100 other page names (empty files of
ours, older) put in one fan-out directory, so that A's look finds them all and its apply takes two
steps, the victim (the newest) in the second; A's caller deletes the victim after the first step."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from loop_probes import THREAD_POLL_S, until_spin
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.followpath import APPLY_PER_TURN

TAG = 0x5C
OLD_NS = 1_000_000_000 * 1_000_000_000  # 2001: older than any page written now


@pytest.mark.asyncio
async def test_a_delete_between_two_steps_of_an_apply_is_asked_by_the_next_step(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim = key_of(0, TAG)
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as b, started(DiskTier(cfg, layout, pool)) as a:
        assert a.read_only is ReadOnly.LOCKED
        looks = Looks(a)
        fan = a.files.layout_dir / f"{TAG:02x}"
        others = [key_of(i, TAG) for i in range(1, APPLY_PER_TURN + 5)]
        for key in others:
            name = fan / key.hex()
            name.touch()
            os.utime(name, ns=(OLD_NS, OLD_NS))  # older than the victim: applied in the first step
        assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))
        first_step = a.statistics().followed_in

        async def delete_after_the_first_step() -> None:
            # The look's thread stats 4,100 files before the first step: each turn lets go of the
            # GIL for it (a plain spin left it a microsecond a turn: over 30 s on a loaded host).
            await until_spin(lambda: a.statistics().followed_in > first_step, "the apply's first step",
                             release_s=THREAD_POLL_S)
            assert not a.contains(victim), "the victim was applied in the first step (test set-up)"
            await a.delete(victim)

        deleting = asyncio.ensure_future(delete_after_the_first_step())
        await looks.next()
        await asyncio.wait_for(deleting, 30.0)
        assert a.contains(others[-1]), "the look did not apply its second step"
        assert not a.contains(victim), "a follower indexed a page its caller deleted during the apply"
        assert not await _served(a, victim, size), "a follower served a page its caller deleted"
        assert await _served(b, victim, size)  # the writer's own page is untouched
    assert_clean(pool)
