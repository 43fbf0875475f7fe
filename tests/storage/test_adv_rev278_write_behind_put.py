"""Review 278 of 20a237d: ``WriteBehind.put`` waits on a room future of its own (woken FIFO by a
worker's take or a close's drop) together with the live workers. Attacked here at each of its
waits with real cancels (one put's, and loop-wide ones: every task of the loop but the test's and
those it spares, as an application's SIGTERM handler does):

- a put cancelled after a take woke it, before it ran: the room goes to the next put waiting;
- a put woken whose room a ``put_nowait`` took first: it waits again and is woken by a later take;
- a loop-wide cancel at each point (puts waiting; a put woken, not run yet; a put woken and run
  over by a ``put_nowait``): the spared puts complete, with no other call, and the queue never
  holds more than its depth;
- the close while puts wait (drained, or dropped).

After each: every page written once at most, every reference released exactly once, nothing left
queued. Pages are real pool pages (their references counted by the page table); the writes are
the test's, each gated by an event (not a sleep).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from disk_helpers import assert_clean, fill, key_of
from loop_probes import cancel_every_task_but, until, waiting_in

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage.writebehind import WriteBehind

pytestmark = pytest.mark.asyncio
BOUND_S = 10.0


class _Writes:
    """The queue's write and release: each write waits for its key's gate (open: at once, with no
    suspension); ``hook``, when set, runs at a write's entry, in the step of the worker's take."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.gates: dict[PageKey, asyncio.Event] = {}
        self.started: list[PageKey] = []
        self.written: list[PageKey] = []
        self.released: list[PageHandle] = []
        self.hook: Callable[[PageKey], None] | None = None

    def gate(self, key: PageKey) -> asyncio.Event:
        return self.gates.setdefault(key, asyncio.Event())

    async def write(self, key: PageKey, handle: PageHandle) -> None:
        self.started.append(key)
        if self.hook is not None:
            self.hook(key)
        gate = self.gates.get(key)
        if gate is not None and not gate.is_set():
            await gate.wait()
        self.written.append(key)

    def release(self, handle: PageHandle) -> None:
        self.released.append(handle)
        self.pool.table.release(handle)

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()


def _queue(writes: _Writes, depth: int = 1, workers: int = 1) -> WriteBehind:
    def on_error() -> None:
        raise AssertionError("a write failed")
    return WriteBehind(depth, workers, writes.write, writes.release, on_error)


def _page(pool: PagePool, i: int) -> tuple[PageKey, PageHandle]:
    return key_of(i), fill(pool, key_of(i), i)


async def _full(writes: _Writes, wb: WriteBehind, pool: PagePool) -> list[PageHandle]:
    """Page 0 taken by the worker (its write held), page 1 queued: the queue (depth 1) full.
    Returns both handles (the queue's now)."""
    k0, h0 = _page(pool, 0)
    writes.gate(k0)
    assert wb.put_nowait(k0, h0)
    await until(lambda: writes.started == [k0])
    k1, h1 = _page(pool, 1)
    writes.gate(k1)
    assert wb.put_nowait(k1, h1)
    assert wb.qsize() == 1
    return [h0, h1]


Puts = list[tuple["asyncio.Task[None]", PageHandle]]


def _putting(wb: WriteBehind, pool: PagePool, first: int, count: int) -> Puts:
    out: Puts = []
    for i in range(first, first + count):
        key, handle = _page(pool, i)
        out.append((asyncio.ensure_future(wb.put(key, handle)), handle))
    return out


def _returned(task: asyncio.Task[None]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def _settle(pool: PagePool, writes: _Writes, wb: WriteBehind, puts: Puts, nowait: list[PageHandle],
                  close: Callable[[], object] | None = None) -> None:
    """Every put done; then closed, drained: the pages a put or put_nowait handed over are each
    released once by the queue, those of puts that raised by the test."""
    writes.open_all()
    async with asyncio.timeout(BOUND_S):
        await asyncio.wait([task for task, _ in puts])
        await wb.aclose(drain=True)
    handed = [h for task, h in puts if _returned(task)]
    for task, h in puts:
        if not _returned(task):
            pool.table.release(h)  # ownership never taken
    assert wb.qsize() == 0, "a page left queued after the close"
    owned = handed + nowait
    assert sorted(map(id, writes.released)) == sorted(map(id, owned)), "a page released twice, or never"
    assert len(writes.written) == len(set(writes.written)) <= len(owned)
    assert_clean(pool)


async def test_a_put_cancelled_once_woken_passes_its_room_on(pool: PagePool) -> None:
    writes = _Writes(pool)
    wb = _queue(writes)
    nowait = await _full(writes, wb, pool)
    puts = _putting(wb, pool, 2, 2)
    await until(lambda: len(wb._putters) == 2)
    first, second = puts[0][0], puts[1][0]

    def cancel_the_woken(key: PageKey) -> None:
        if key == key_of(1):  # the take of page 1 woke the first put, which has not run yet
            first.cancel()
    writes.hook = cancel_the_woken
    writes.gate(key_of(0)).set()
    async with asyncio.timeout(BOUND_S):
        await asyncio.wait([first])
    assert first.cancelled()
    # The second put gets the room the first was woken for, with no other call (lost, it waited
    # until another take: here behind page 1's write, held).
    await until(second.done)
    assert _returned(second) and wb.qsize() == 1
    await _settle(pool, writes, wb, puts, nowait)


async def test_a_woken_put_run_over_by_a_put_nowait_waits_again(pool: PagePool) -> None:
    writes = _Writes(pool)
    wb = _queue(writes)
    nowait = await _full(writes, wb, pool)
    puts = _putting(wb, pool, 2, 2)
    await until(lambda: len(wb._putters) == 2)
    k9, h9 = _page(pool, 9)

    def barge(key: PageKey) -> None:
        if key == key_of(1):  # the first put woken, not run: the room taken before it runs
            writes.hook = None
            assert wb.put_nowait(k9, h9)
            nowait.append(h9)
    writes.hook = barge
    writes.gate(key_of(9))
    writes.gate(key_of(0)).set()
    await until(lambda: nowait[-1] is h9)
    await until(lambda: len(wb._putters) == 2)  # the woken one waits again, never over the depth
    assert wb.qsize() == 1 and not any(task.done() for task, _ in puts)
    writes.gate(key_of(1)).set()  # page 9 taken: one put gets its room
    await until(lambda: sum(task.done() for task, _ in puts) == 1)
    assert wb.qsize() == 1
    writes.gate(key_of(9)).set()
    await until(lambda: all(task.done() for task, _ in puts))
    assert all(_returned(task) for task, _ in puts)
    await _settle(pool, writes, wb, puts, nowait)


def _cancel_all_but(*spared: asyncio.Task[None] | None) -> None:
    """A loop-wide cancel from inside a step (a write's entry): every task but ``spared``."""
    for task in asyncio.all_tasks():
        if task not in spared and not task.done():
            task.cancel()


@pytest.mark.parametrize("spare", ["first", "second", "both"])
@pytest.mark.parametrize("point", ["waiting", "woken", "run_over"])
async def test_a_loop_wide_cancel_at_each_wait_of_put(pool: PagePool, point: str, spare: str) -> None:
    writes = _Writes(pool)
    wb = _queue(writes, depth=1, workers=2)
    # Both workers busy (pages 0, 10 held), page 1 queued: full.
    nowait: list[PageHandle] = []
    for i in (0, 10, 1):
        key, handle = _page(pool, i)
        writes.gate(key)
        assert wb.put_nowait(key, handle)
        nowait.append(handle)
        if i != 1:
            await until(lambda key=key: key in writes.started)  # type: ignore[misc]
    assert wb.qsize() == 1
    puts = _putting(wb, pool, 2, 2)
    await until(lambda: len(wb._putters) == 2)
    me = asyncio.current_task()
    spared = [task for (task, _), name in zip(puts, ["first", "second"], strict=True) if spare in (name, "both")]
    if point == "waiting":
        await cancel_every_task_but(me, *spared)
    else:
        def cut(key: PageKey) -> None:
            if key == key_of(1):  # the first put woken by this take, not run yet
                writes.hook = None
                if point == "run_over":
                    k9, h9 = _page(pool, 9)
                    assert wb.put_nowait(k9, h9)
                    nowait.append(h9)
                _cancel_all_but(me, *spared)
        writes.hook = cut
        writes.gate(key_of(0)).set()
    # With no other call, the spared puts complete: woken for room, or by the workers' end (the
    # workers replaced). The queue never over its depth.
    async with asyncio.timeout(BOUND_S):
        await asyncio.wait([task for task, _ in puts])
    for task in spared:
        assert _returned(task), task
    assert wb.qsize() <= 1
    await _settle(pool, writes, wb, puts, nowait)


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "drop"])
async def test_a_close_while_puts_wait(pool: PagePool, drain: bool) -> None:
    writes = _Writes(pool)
    wb = _queue(writes)
    nowait = await _full(writes, wb, pool)
    puts = _putting(wb, pool, 2, 3)
    await until(lambda: len(wb._putters) == 3)
    closing = asyncio.ensure_future(wb.aclose(drain=drain))
    writes.open_all()
    async with asyncio.timeout(BOUND_S):
        dropped = await closing
        await asyncio.wait([task for task, _ in puts])
    assert wb.qsize() == 0, "a page left queued after the close"
    handed = [h for task, h in puts if _returned(task)]
    for task, h in puts:
        if not _returned(task):
            assert isinstance(task.exception(), RuntimeError)
            pool.table.release(h)
    owned = handed + nowait
    assert sorted(map(id, writes.released)) == sorted(map(id, owned)), "a page released twice, or never"
    assert len(writes.written) + dropped == len(owned)
    assert_clean(pool)


async def test_a_put_woken_by_an_instant_write_before_a_drained_close_returns(pool: PagePool) -> None:
    """The close's join ends when the last page taken is done; a put that take woke (its write
    ended with no suspension) queues its page after the join's wake-up, a worker takes it, and
    the close went on: it stopped the workers with that page's write held, cut (before: 2 of the
    3 pages handed over written, none dropped)."""
    writes = _Writes(pool)
    wb = _queue(writes)
    nowait = await _full(writes, wb, pool)
    del writes.gates[key_of(1)]  # page 1's write returns with no suspension (a page stored already)
    puts = _putting(wb, pool, 2, 1)
    await until(lambda: len(wb._putters) == 1)
    closing = asyncio.ensure_future(wb.aclose(drain=True))
    await until(lambda: waiting_in(closing, "join"))
    writes.gates[key_of(2)] = asyncio.Event()  # the woken put's page: its write held
    writes.gate(key_of(0)).set()
    async with asyncio.timeout(BOUND_S):
        await asyncio.wait([puts[0][0]])
        writes.open_all()
        dropped = await closing
    assert wb.qsize() == 0, "a page left queued after the close"
    handed = [h for task, h in puts if _returned(task)]
    for task, h in puts:
        if not _returned(task):
            pool.table.release(h)
    owned = handed + nowait
    assert sorted(map(id, writes.released)) == sorted(map(id, owned)), "a page released twice, or never"
    assert len(writes.written) + dropped == len(owned)
    assert_clean(pool)
