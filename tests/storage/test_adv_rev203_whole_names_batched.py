"""Review 203: a491382 examines the names of keys a follower deleted (pages still on disk) whole at
every look that lists their directory again: one ``os.stat`` each, on the look's thread. Each
system call releases the GIL, and beside a thread running Python (the engine's busy loop) taking it
back waits up to the switch interval (5 ms): the very cost :mod:`aiokv.storage.statxring` was made
to avoid for the 256 fan-out ``fstat``s. 1,000 such pages made a look take about five seconds
(100,000: minutes, where ``follow_interval_s`` is 2 s): new pages followed late, the take-over
late. The names are now examined after the listings in ``statx`` batches on the looks' ring (one
GIL wait per 256 names), and still by ``os.stat`` where io_uring or STATX is refused; what the look
finds is the same (the reused-inode page of review 202 indexed, the pages deleted never).

Real: a second writer storing for real (also a page under a freed inode number, checked), a
thread running Python beside the looks, the looks' own thread and ring."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import FrameType

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev194_deleted_while_following import _past_file_clock

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly, follow

TAG = 0x6F
DELETED = 2000


class StatCalls:
    """Counts the ``os.stat`` calls of :func:`follow._examine` (a profile hook's ``c_call`` events:
    each such call is a system call releasing the GIL)."""

    def __init__(self) -> None:
        self.count = 0

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "c_call" and arg is os.stat and frame.f_code is follow._examine.__code__:
            self.count += 1


class Spinning:
    """A thread running Python until stopped (what a busy event loop does to the GIL)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, name="spin", daemon=True)

    def _spin(self) -> None:
        count = 0
        while not self.stop.is_set():
            count += 1

    def __enter__(self) -> Spinning:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(10.0)


@pytest.mark.parametrize("batched", [True, False], ids=["statx", "refused"])
@pytest.mark.asyncio
async def test_a_follower_s_deleted_names_are_examined_in_batches(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, batched: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not batched:
        monkeypatch.setattr(follow, "BATCHED_STATX", False)  # as where io_uring is refused
    size = layout.page_bytes
    # Small pages on disk are enough: what costs is the names, not the bytes.
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    deleted = [key_of(i, TAG) for i in range(DELETED)]
    again = key_of(DELETED, TAG)
    async with started(DiskTier(cfg, layout, pool)) as b:
        for key in [*deleted, again]:
            assert await b.write_from(key, memoryview(_bytes_of(key, size)))
        async with started(DiskTier(cfg, layout, pool)) as a:
            assert a.read_only is ReadOnly.LOCKED
            looks = Looks(a)
            await looks.until(lambda: all(a.contains(key) for key in [*deleted, again]))
            for key in [*deleted, again]:
                await a.delete(key)
            assert len(a._unlink_when_writable) == DELETED + 1
            await b.delete(again)
            _past_file_clock(tmp_path / "probe")
            # Stored again: under the freed inode number where the file system hands it out again
            # (a491382's case: examined whole, told apart by its change time), else under another.
            assert await b.write_from(again, memoryview(_bytes_of(again, size)))
            stats = StatCalls()
            threading.setprofile(stats.hook)  # the look's thread starts after this
            try:
                if batched:
                    with Spinning():
                        began = time.perf_counter()
                        await looks.next()  # the directory changed: listed again, its deleted names examined
                        spin_s = time.perf_counter() - began
                else:
                    await looks.next()
            finally:
                threading.setprofile(None)  # type: ignore[arg-type]
            assert a.contains(again), "the page stored again under the freed inode number was not indexed"
            assert await _served(a, again, size)
            assert a._unlink_when_writable == set(deleted)
            assert not any(a.contains(key) for key in deleted), "a deleted page was indexed"
            if batched:
                # One stat a name: each a GIL wait beside the busy thread (the time varies with the
                # scheduling: 0.05-1.9 s for 2,000 names on a loaded 2-vCPU VM, up to 5 ms a name).
                assert stats.count < 10, (
                    f"{stats.count} names examined one stat each on the look's thread ({DELETED} deleted "
                    f"pages on disk; look {spin_s:.3f} s beside a busy thread): not batched")
            else:
                assert stats.count >= DELETED, "io_uring refused: each name is examined by os.stat"
            await b.aclose()
            await looks.next()  # A takes over: every deleted page unlinked, the newer one kept
            assert a.read_only is None
            await _settled(a)
            names = set(os.listdir(a.files.layout_dir / f"{TAG:02x}"))
            assert again.hex() in names and not names & {key.hex() for key in deleted}
    assert_clean(pool)
