"""Review 202: a follower's deletes (it unlinks nothing: the names wait for its take-over,
``_unlink_when_writable``) grew that set by one key a delete for the life of the follower, also
after the writer had removed the files: unbounded memory in a long-lived follower. A key is now
forgotten once a look finds its name empty or holding a newer page (its directory retired
included): the set holds only deleted pages still on disk. A page deleted whose directory comes
back is named again by the delete remembered (never served), and the take-over still unlinks every
deleted page left.

Real: a second writer in the same directory storing and deleting for real, real renames of a
fan-out directory away and back, a real take-over once the writer closed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import Looks, follow_config, started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev194_deleted_while_following import _past_file_clock

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG, AWAY_TAG = 0x6A, 0x6B
ROUNDS, PER_ROUND = 6, 40


@pytest.mark.asyncio
async def test_a_follower_s_deletes_are_kept_only_while_their_pages_are_on_disk(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    cfg = follow_config(tmp_path / "disk", backend)
    kept = [key_of(10_000 + i, TAG) for i in range(2)]  # deleted by A, kept on disk by B
    again = key_of(20_000, TAG)  # deleted by A, removed and stored anew by B
    back = key_of(30_000, AWAY_TAG)  # deleted by A, its directory moved away and back

    async def store(tier: DiskTier, keys: list[PageKey]) -> None:
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))

    async with started(DiskTier(cfg, layout, pool)) as b:
        await store(b, [*kept, again, back])
        async with started(DiskTier(cfg, layout, pool)) as a:
            assert a.read_only is ReadOnly.LOCKED
            looks = Looks(a)
            await looks.until(lambda: all(a.contains(key) for key in [*kept, again, back]))
            for key in [*kept, again, back]:
                await a.delete(key)
            left = {*kept, again, back}
            assert a._unlink_when_writable == left
            for round_ in range(ROUNDS):
                keys = [key_of(round_ * PER_ROUND + i, TAG) for i in range(PER_ROUND)]
                await store(b, keys)
                await looks.until(lambda keys=keys: all(a.contains(key) for key in keys))
                for key in keys:
                    await a.delete(key)  # A's callers drop them: remembered until A may unlink
                assert a._unlink_when_writable == left | set(keys)
                for key in keys:
                    await b.delete(key)  # the writer removes them: nothing of them left to unlink
                await looks.next()
                # The bound: only deleted pages still on disk (before: 40 more keys every round).
                assert a._unlink_when_writable == left, f"round {round_}: {len(a._unlink_when_writable)} keys kept"
            # B removes ``again`` and stores it anew after A's delete: a newer page, indexed by A.
            await b.delete(again)
            await looks.next()
            assert again not in a._unlink_when_writable
            _past_file_clock(tmp_path / "probe")
            await store(b, [again])
            await looks.until(lambda: a.contains(again))
            left.discard(again)
            # ``back``'s directory moved away (A's look retires it: forgotten) and put back.
            fan = a.files.layout_dir / f"{AWAY_TAG:02x}"
            os.rename(fan, tmp_path / "away")
            await looks.next()
            assert back not in a._unlink_when_writable
            os.rename(tmp_path / "away", fan)
            await looks.next()
            await looks.next()  # the name opened again and listed
            assert back in a._unlink_when_writable, "the page deleted, back with its directory, was not named again"
            assert not a.contains(back) and not await _served(a, back, size), "a deleted page was served"
            for key in kept:
                assert not a.contains(key) and not await _served(a, key, size), "a deleted page was served"
            await b.aclose()
            await looks.next()  # A takes over
            assert a.read_only is None and a.statistics().took_over == 1
            await _settled(a)
            assert not a._unlink_when_writable
            for key in [*kept, back]:
                assert not a.contains(key) and not await _served(a, key, size), "a deleted page was served"
                assert not (a.files.layout_dir / f"{key[0]:02x}" / key.hex()).exists(), \
                    "a page deleted by the follower stayed on disk after its take-over"
            assert await _served(a, again, size), "the writer's page stored after the delete was lost"
            assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)
