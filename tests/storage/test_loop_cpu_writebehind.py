"""The write-behind without worker tasks: writes start as they are queued (no task step per page),
at most ``workers`` at once, ``depth`` more waiting; every handle released once; faults counted."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import cast

import pytest

from aiokv.pagetable import PageHandle
from aiokv.storage.writebehind import WriteBehind


class Disk:
    """Writes that end when the test says; records starts, releases and errors."""

    def __init__(self) -> None:
        self.started: list[bytes] = []
        self.ends: dict[bytes, asyncio.Future[bool]] = {}
        self.released: Counter[int] = Counter()
        self.errors = 0

    def write(self, key: bytes, handle: PageHandle) -> asyncio.Future[bool]:
        self.started.append(key)
        end = self.ends[key] = asyncio.get_running_loop().create_future()
        return end

    def release(self, handle: PageHandle) -> None:
        self.released[id(handle)] += 1

    def error(self) -> None:
        self.errors += 1

    def queue(self, depth: int, workers: int) -> WriteBehind:
        return WriteBehind(depth, workers, self.write, self.release, self.error)


def handle() -> PageHandle:
    return cast(PageHandle, object())


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.asyncio
async def test_writes_start_as_queued_bounded_by_workers_then_depth() -> None:
    disk = Disk()
    q = disk.queue(depth=3, workers=2)
    handles = [handle() for _ in range(6)]
    taken = [q.put_nowait(key(i), h) for i, h in enumerate(handles)]
    assert taken == [True] * 5 + [False]  # 2 written at once, 3 waiting, then full
    assert disk.started == [key(0), key(1)]  # started in the caller's own call: no task, no turn
    assert q.qsize() == 5  # 3 waiting, 2 being written: all hold their pages
    disk.ends[key(0)].set_result(True)
    await asyncio.sleep(0)
    assert disk.started == [key(0), key(1), key(2)] and q.qsize() == 4
    assert disk.released[id(handles[0])] == 1
    joined = asyncio.ensure_future(q.join())
    for i in range(1, 5):
        await asyncio.sleep(0)
        disk.ends[key(i)].set_result(True)
    await asyncio.wait_for(joined, 5)
    assert [disk.released[id(h)] for h in handles] == [1] * 5 + [0]  # the refused one stays the caller's
    assert disk.errors == 0


@pytest.mark.asyncio
async def test_failed_writes_are_counted_released_and_the_queue_goes_on() -> None:
    disk = Disk()
    refuse = {key(1)}
    write = disk.write

    def flaky(k: bytes, h: PageHandle) -> asyncio.Future[bool]:
        if k in refuse:
            raise OSError("refused at start")
        return write(k, h)

    q = WriteBehind(8, 1, flaky, disk.release, disk.error)
    handles = [handle() for _ in range(3)]
    assert all(q.put_nowait(key(i), h) for i, h in enumerate(handles))
    disk.ends[key(0)].set_exception(OSError("EIO"))
    await asyncio.sleep(0)  # 0 failed; 1 refused to start; 2 started
    assert disk.started == [key(0), key(2)]
    disk.ends[key(2)].set_result(True)
    await asyncio.wait_for(q.join(), 5)
    assert disk.errors == 2
    assert [disk.released[id(h)] for h in handles] == [1, 1, 1]


@pytest.mark.asyncio
async def test_a_long_run_of_writes_refusing_to_start_does_not_recurse() -> None:
    released: list[PageHandle] = []
    errors: list[int] = []
    gate: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def write(k: bytes, h: PageHandle) -> asyncio.Future[bool]:
        if k == key(0):
            return gate
        raise OSError("refused")

    q = WriteBehind(5000, 1, write, released.append, lambda: errors.append(1))
    for i in range(5000):
        assert q.put_nowait(key(i), handle())
    gate.set_result(True)  # the 4,999 waiting ones then fail to start, one after the other
    await asyncio.wait_for(q.join(), 5)
    assert len(released) == 5000 and len(errors) == 4999


@pytest.mark.asyncio
async def test_a_coroutine_write_runs_in_a_task() -> None:
    done: list[bytes] = []

    async def write(k: bytes, h: PageHandle) -> bool:
        await asyncio.sleep(0)
        done.append(k)
        return True

    released: list[PageHandle] = []
    q = WriteBehind(4, 2, write, released.append, lambda: None)
    for i in range(4):
        assert q.put_nowait(key(i), handle())
    await asyncio.wait_for(q.join(), 5)
    assert done == [key(i) for i in range(4)] and len(released) == 4


@pytest.mark.asyncio
async def test_put_waits_for_room_in_turn_and_a_cancelled_put_passes_it_on() -> None:
    disk = Disk()
    q = disk.queue(depth=1, workers=1)
    assert q.put_nowait(key(0), handle()) and q.put_nowait(key(1), handle())
    first = asyncio.ensure_future(q.put(key(2), handle()))
    second = asyncio.ensure_future(q.put(key(3), handle()))
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    disk.ends[key(0)].set_result(True)  # key 1 starts: room for one waiting entry
    await asyncio.sleep(0)
    first.cancel()  # handed the room, cancelled before it ran: the room goes to the next one
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert first.cancelled()
    await asyncio.wait_for(second, 5)
    assert q.qsize() == 2  # key 1 being written, key 3 waiting
    disk.ends[key(1)].set_result(True)
    await asyncio.sleep(0)
    disk.ends[key(3)].set_result(True)
    await asyncio.wait_for(q.join(), 5)
    assert key(2) not in disk.started


@pytest.mark.asyncio
async def test_close_without_drain_drops_the_waiting_waits_for_the_writing_and_refuses_more() -> None:
    disk = Disk()
    q = disk.queue(depth=4, workers=1)
    handles = [handle() for _ in range(3)]
    assert all(q.put_nowait(key(i), h) for i, h in enumerate(handles))
    late = handle()
    assert q.put_nowait(key(9), late)  # room: depth 4
    waiting_put = asyncio.ensure_future(q.put(key(10), handle()))
    assert q.put_nowait(key(11), handle())  # fills the queue
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(q.aclose(drain=False))
    await asyncio.sleep(0)
    assert not closing.done()  # key 0 is still being written
    with pytest.raises(RuntimeError, match="closed"):
        await waiting_put
    disk.ends[key(0)].set_result(True)
    assert await asyncio.wait_for(closing, 5) == 4  # keys 1, 2, 9, 11 dropped
    assert disk.started == [key(0)]
    assert [disk.released[id(h)] for h in (*handles, late)] == [1, 1, 1, 1]
    assert not q.put_nowait(key(12), handle())
    with pytest.raises(RuntimeError, match="closed"):
        await q.put(key(13), handle())
