"""Review 202: a page a take-over found under a key its own write was still writing
(``_found_under_write``, review 199) was remembered across a second lock loss. The other writer
that held the directory then removed that page; when the write ended unstored (ENOSPC) — while
following, or after the second take-over, whose look no longer found the page — the key was
indexed with no file under its name: served as present, a miss at every read (before review 200's
retire fix such a stale finding served a deleted page). What the first take-over found is now
forgotten when the lock is lost again: the looks, and the next take-over, ask the name afresh.

Real: the write held for real across two lock losses and two take-overs. The tier's one I/O slot
is held by another write whose fan-out directory is a bind mount of a second ext4, frozen
(``fsfreeze``); the key's own directory stays writable, so the second writers start, store and
delete for real. The first file system is then filled for real (ENOSPC) and the second thawed.
Root only."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks
from fs_helpers import bind_mount, fill_up, freeze, loop_ext4, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev199_take_over_failed_write import _fill_rest
from test_lock_replaced import LockChecks

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG, HELD_TAG = 0x6C, 0x6D
THAW_S = 30.0


async def _lose_lock(a: DiskTier, checks: LockChecks, cfg: object, layout: KVLayout, pool: PagePool) -> DiskTier:
    """``.lock`` removed, a second writer started on a new one, A's check finds it held: A follows."""
    os.unlink(a.files.layout_dir / ".lock")
    other = DiskTier(cfg, layout, pool)  # type: ignore[arg-type]
    await other.start()
    assert other.read_only is None
    await checks.next()
    assert a.read_only is ReadOnly.LOCKED
    return other


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("ends", ["following", "after_take_over"])
@pytest.mark.parametrize("removed", [True, False], ids=["removed", "kept"])
async def test_a_page_found_at_the_first_take_over_is_forgotten_at_the_second_lock_loss(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, ends: str, removed: bool) -> None:
    """``removed``: the second writer removes the page the first take-over found (fails before:
    the key indexed with no file); kept: it stays, and is indexed and served (the looks find it
    afresh: guards the fix against losing the page)."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    victim, held_key = key_of(0, TAG), key_of(0, HELD_TAG)

    def page(key: PageKey) -> memoryview:
        return memoryview(_bytes_of(key, size))

    (tmp_path / "main").mkdir()
    (tmp_path / "held").mkdir()
    with loop_ext4(tmp_path / "main", 24) as mount, loop_ext4(tmp_path / "held", 8) as held:
        cfg = config(mount / "disk", backend, capacity=64 * size, follow_interval_s=3600.0, min_free_bytes=0,
                     enospc_retries=0, free_space_recheck_s=3600.0, queue_depth=1)
        a = DiskTier(cfg, layout, pool)
        held_fan = a.files.layout_dir / f"{HELD_TAG:02x}"
        held_fan.mkdir(mode=0o700, parents=True)
        os.chmod(held, 0o700)
        with bind_mount(held, held_fan):
            await a.start()
            others: list[DiskTier] = []
            watchdog = threading.Timer(THAW_S, thaw, args=(held,))
            try:
                checks, looks = LockChecks(a), Looks(a)
                os.unlink(a.files.layout_dir / ".lock")
                b = DiskTier(cfg, layout, pool)
                others.append(b)
                await b.start()
                assert await b.write_from(victim, page(victim))  # the page A's first take-over finds
                freeze(held)
                watchdog.start()
                # The one I/O slot held by a write into the frozen directory; A's write of the
                # victim waits for it (in flight, nothing of it on disk).
                hold = asyncio.ensure_future(a.write_from(held_key, page(held_key)))
                await until_thread(lambda: a.statistics().writes_in_flight > 0, "the held write in its slot")
                store = asyncio.ensure_future(a.write_from(victim, page(victim)))
                await until_thread(lambda: a._io_slots.waiting > 0, "the victim's write waiting for the slot")
                await checks.next()
                assert a.read_only is ReadOnly.LOCKED  # first loss
                await b.aclose()
                await looks.next()  # the first take-over
                assert a.read_only is None and a.statistics().took_over == 1
                assert victim in a._found_under_write, "the first take-over did not find the other writer's page"
                c = await _lose_lock(a, checks, cfg, layout, pool)  # second loss, the write still in flight
                others.append(c)
                name = a.files.layout_dir / f"{TAG:02x}" / victim.hex()
                if removed:
                    await c.delete(victim)  # the page the first take-over found is gone
                    assert not name.exists()
                if ends == "after_take_over":
                    await c.aclose()
                    await looks.next()  # the second take-over
                    assert a.read_only is None and a.statistics().took_over == 2
                assert victim in a._writing, "the write ended before the thaw"
                fill_up(mount / "filler", 0)
                _fill_rest(mount / "filler-rest")
                thaw(held)
                assert await asyncio.wait_for(hold, 10.0)
                assert not await asyncio.wait_for(store, 10.0), "the write was to fail (ENOSPC)"
                await _settled(a)
                if removed:
                    assert not a.contains(victim), "a key indexed with no file under its name (found before the loss)"
                    assert not await _served(a, victim, size)
                else:
                    if ends == "following":
                        await looks.next()
                        await c.aclose()
                        await looks.next()  # the second take-over
                        assert a.read_only is None and a.statistics().took_over == 2
                        await _settled(a)
                    assert a.contains(victim) and name.exists(), "the other writer's page was lost"
                    assert await _served(a, victim, size)
            finally:
                thaw(held)
                watchdog.cancel()
                for other in others:
                    await other.aclose()
                await a.aclose()
    assert_clean(pool)
