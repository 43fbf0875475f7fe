"""Helpers shared by the page-file store's stuck-I/O tests (frozen or gated file systems)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import mmap
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest


def wait_for(condition: Callable[[], bool], what: str, bound_s: float) -> None:
    """Until ``condition()`` holds, at most ``bound_s``: state in the kernel or on the store's loop
    thread that gives no event to wait on (I/O stuck in a frozen file system, a task's progress)."""
    deadline = time.monotonic() + bound_s
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        pause.wait(0.01)


def hold_region_pinning(monkeypatch: Any, bound_s: float) -> tuple[threading.Event, threading.Event]:
    """Hold the pinning of an engine's region (the ``aiokv-register-memory`` thread, in
    ``update_in_batches``) until the test sets the returned gate; a staging pool's own registration
    runs freely. Returns ``(entered, gate)``: ``entered`` is set once the pin is held."""
    from aiokv.storage import backends

    entered, gate = threading.Event(), threading.Event()
    real = backends.update_in_batches

    def held(engine: Any, regions: Sequence[Any], stop: threading.Event, prepare: Any) -> Iterator[list[Any]]:
        if threading.current_thread().name != "aiokv-register-memory":
            yield from real(engine, regions, stop, prepare)  # a staging pool's own registration
            return
        entered.set()
        assert gate.wait(bound_s)  # pinning the region until the test lets it go on
        yield from real(engine, regions, stop, prepare)

    monkeypatch.setattr(backends, "update_in_batches", held)
    return entered, gate


# -- an interrupt of the engine's thread (a signal's handler raising) and what it must leave --------


class Interrupted(BaseException):
    """What :func:`raise_interrupted` raises (a ``KeyboardInterrupt`` of the tests' own)."""


def raise_interrupted(_signum: int, _frame: object) -> None:
    """A signal handler raising :class:`Interrupted` in the thread the signal was sent to."""
    raise Interrupted


def unmaps(region: mmap.mmap) -> bool:
    """Whether the engine could unmap its region now (nothing exports it any more)."""
    try:
        region.close()
    except BufferError:
        return False
    return True


def exporters(region: mmap.mmap, depth: int = 4) -> str:
    """What still holds an export of ``region`` (for a failure's message): chains of referrers from
    it (buffers, views, then their holders), up to ``depth`` steps; frames named by function."""
    gc.collect()
    own: set[int] = set()  # this helper's own frames and containers are no holders
    frame = sys._getframe()
    while frame is not None:
        own.add(id(frame))
        frame = frame.f_back
    chains: list[str] = []
    own.add(id(chains))

    def name(obj: object) -> str:
        if isinstance(obj, types.FrameType):
            code = obj.f_code
            return f"frame {code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{obj.f_lineno})"
        return type(obj).__name__

    def walk(obj: object, path: tuple[str, ...], left: int) -> None:
        holders = [h for h in gc.get_referrers(obj) if id(h) not in own]
        own.add(id(holders))
        if left == 0 or not holders:
            chains.append(" <- ".join(path))
            return
        for holder in holders[:6]:
            own.add(id(holder))
            walk(holder, (*path, name(holder)), left - 1)

    walk(region, ("region",), depth)
    return "; ".join(chains[:12]) or "nothing the collector sees"


def released(view: memoryview) -> bool:
    """Whether ``view`` was released."""
    try:
        return view.nbytes < 0  # raises once released
    except ValueError:
        return True


def tier_closed(disk: Any) -> bool:
    """Whether the disk tier's close ended (``io_ended`` raises before the close began)."""
    ended = disk._io_ended
    return ended is not None and ended.done()


# -- the kernel refusing new threads (a pids limit reached) ----------------------------------------

PIDS = Path("/sys/fs/cgroup/pids")
"""The cgroup v1 pids controller: writing a thread's id to a group's ``tasks`` moves it there."""


@contextlib.contextmanager
def pids_limited(tag: str, bound_s: float) -> Iterator[Path]:
    """A pids cgroup that admits no new task: a thread moved into it (``tasks``) can start no
    thread (``RuntimeError: can't start new thread``). Skips without root or the v1 controller, or
    where no group can be made (a read-only or delegated hierarchy: a container). On exit, threads
    left there go back to the root group before the group is removed."""
    if os.geteuid() != 0 or not (PIDS / "tasks").exists():
        pytest.skip("needs root and the cgroup v1 pids controller at /sys/fs/cgroup/pids")
    group = PIDS / f"aiokv-test-{tag}-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a pids cgroup: {exc}")
    try:
        (group / "pids.max").write_text("1")  # the moved thread alone
        yield group
    finally:
        for tid in (group / "tasks").read_text().split():  # a failure left a thread there
            (PIDS / "tasks").write_text(tid)
        wait_for(lambda: not (group / "tasks").read_text().split(), "the test's cgroup empty", bound_s)
        group.rmdir()


def frozen_write_then_interrupt(held: dict[str, Any], freeze_fs: Callable[[], None], main: int,
                                interrupted: Callable[[], bool], bound_s: float,
                                first_only: bool = False) -> Callable[..., Any]:
    """A ``PageFileStore._start_disk`` for ``monkeypatch``: once the tier started, a write of its own held
    in the kernel (``freeze_fs`` freezes its file system and starts the thaw's watchdog), then ``SIGUSR1``
    sent to thread ``main`` (the open's caller interrupted, its handler raising) and awaited
    (``interrupted``). The open goes on: it closes what it opened (its caller is gone). ``held`` gets the
    page (alive until the write ended), the store, the tier and the write's future; ``first_only``:
    stores started after the first start plainly."""
    from loop_probes import until_thread

    from aiokv.adapters.store import PageFileStore

    real_start = PageFileStore._start_disk

    async def start_disk(self: PageFileStore, pool: Any) -> Any:
        disk = await real_start(self, pool)
        if first_only and held:
            return disk
        page = held["page"] = mmap.mmap(-1, self.layout.page_bytes)
        held.update(store=self, disk=disk)
        freeze_fs()
        held["write"] = asyncio.ensure_future(disk.write_from(self.key(b"held"), memoryview(page)))
        await until_thread(lambda: disk.statistics().in_flight > 0, "a write held by the freeze", bound_s)
        signal.pthread_kill(main, signal.SIGUSR1)
        await until_thread(interrupted, "the interrupt handled", bound_s)
        return disk

    return start_disk


def refuse_thread(fn: Callable[..., object], args: tuple[Any, ...]) -> int:
    """A ``_thread.start_new_thread`` refusing as the kernel does at a pids limit: for a module's
    ``_thread`` (``types.SimpleNamespace(start_new_thread=refuse_thread)``), whose hand-over to a thread
    of its own then makes the work on the calling thread."""
    raise RuntimeError("can't start new thread")


# -- one interrupt at the first point after a mark where a signal's handler runs --------------------


@contextlib.contextmanager
def interrupt_at_first_call_after(code: types.CodeType, marked: Callable[[types.FrameType], bool]
                                  ) -> Iterator[list[str]]:
    """Trace this (the main) thread (``sys.settrace``: call and line events, no opcode events) and send it
    ``SIGUSR1`` (its handler raising :class:`Interrupted`) once, at the entry of the first Python function
    called after a frame running ``code`` showed ``marked(frame)`` (checked at its call and line events):
    a function's entry is a point where a signal's handler runs, the first one after the mark where a
    Ctrl-C could land. Yields the names of the functions so entered (one, once sent)."""
    main = threading.get_ident()
    sent: list[str] = []
    armed = False

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        nonlocal armed
        if event == "line" and not sent and marked(frame):
            armed = True
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Any:
        nonlocal armed
        if armed:
            armed = False
            sent.append(frame.f_code.co_qualname)
            signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here, at this function's entry
            return None
        if frame.f_code is code:
            if not sent and marked(frame):
                armed = True
            return local
        return None

    previous, tracing = signal.signal(signal.SIGUSR1, raise_interrupted), sys.gettrace()
    sys.settrace(calls)
    try:
        yield sent
    finally:
        sys.settrace(tracing)
        signal.signal(signal.SIGUSR1, previous)


@contextlib.contextmanager
def interrupt_as_open_thread_returns() -> Iterator[tuple[list[Any], list[int]]]:
    """Within: the first ``open_thread`` that made a ``LoopThread`` gets a real SIGUSR1 (its handler
    raises :class:`Interrupted`) as it returns, before its caller kept the thread. Yields the threads
    made (``LoopThread``s, in order) and ``[signals sent]``. Main thread only."""
    from aiokv.adapters import store as store_module
    from aiokv.adapters.loopthread import LoopThread

    main = threading.get_ident()
    made: list[Any] = []
    signals = [0]

    def handler(signum: int, frame: object) -> None:
        signals[0] += 1
        raise_interrupted(signum, frame)

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "return":
            return local
        if frame.f_code is LoopThread.__init__.__code__:
            made.append(frame.f_locals["self"])
        elif frame.f_code is store_module.open_thread.__code__ and made and not signals[0]:
            signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here, as open_thread returns
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code in (LoopThread.__init__.__code__, store_module.open_thread.__code__) else None

    previous, tracing = signal.signal(signal.SIGUSR1, handler), sys.gettrace()
    try:
        sys.settrace(calls)
        try:
            yield made, signals
        finally:
            sys.settrace(tracing)
    finally:
        signal.signal(signal.SIGUSR1, previous)
