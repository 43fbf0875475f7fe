"""Helpers of the tests that raise a real SIGINT inside the ring's, the checksums' and the disk
tier's page-job code: a loop of the test's own with Python's default SIGINT handler, bounded runs,
idle turns, page views; the points where Python raises a signal's exception
(:class:`SignalPoints`) and a tier whose read and write batches run with a SIGINT at one of them
(:class:`JobsScenario`)."""

from __future__ import annotations

import _weakrefset
import asyncio
import concurrent.futures
import contextlib
import dis
import inspect
import mmap
import os
import random
import signal
import sys
import types
import weakref
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
from disk_helpers import config

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, ReserveOutcome
from aiokv.pool import PagePool
from aiokv.storage import (
    DiskBackend,
    DiskTier,
    backends,
    disk,
    index,
    jobs,
    readpath,
    safefiles,
    tierbase,
    tieredge,
    writepath,
)
from aiokv.storage.pagefile import file_bytes
from aiokv.storage.uring import UringEngine

T = TypeVar("T")


def interrupt() -> None:
    """A real SIGINT to this process: Python's handler raises KeyboardInterrupt here, in this thread."""
    signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def private_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A new loop, with Python's default SIGINT handler installed while it lives (and any profile
    hook a test left removed at its end)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        sys.setprofile(None)
        loop.close()
        signal.signal(signal.SIGINT, previous)


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` on ``loop``, bounded: a hang (the bug) fails instead of waiting for pytest's timeout."""
    return loop.run_until_complete(asyncio.wait_for(coro, 5))


async def idle_turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def open_engine() -> UringEngine:
    return UringEngine.open(8)


async def wait(future: asyncio.Future[T]) -> T:
    return await future


@contextlib.contextmanager
def page_views(count: int, page: int, fill: bool = True) -> Iterator[list[memoryview]]:
    """``count`` views of ``page`` bytes each over one anonymous mapping (filled with a byte ramp
    unless ``fill`` is False), released at the end."""
    data = mmap.mmap(-1, count * page)
    if fill:
        data.write(bytes(range(256)) * (count * page // 256))
    whole = memoryview(data)
    views = [whole[i * page : (i + 1) * page] for i in range(count)]
    try:
        yield views
    finally:
        for view in views:
            view.release()
        whole.release()
        data.close()


_RESUME = dis.opmap.get("RESUME", -1)
_ENTRIES: dict[types.CodeType, int] = {}


def _entry(code: types.CodeType) -> int:
    """The offset of ``code``'s ``RESUME`` (after ``MAKE_CELL``, ``RETURN_GENERATOR`` & co.)."""
    offset = _ENTRIES.get(code)
    if offset is None:
        offset = _ENTRIES[code] = code.co_code[::2].find(bytes([_RESUME])) * 2
    return offset


_HANDLE_RUN = asyncio.Handle._run.__code__
_ASYNCIO = os.path.dirname(asyncio.__file__) + os.sep
_WEAKREF = {weakref.__file__, _weakrefset.__file__}  # callbacks the collector runs: an exception there is ignored


class SignalPoints:
    """A profile hook over the points where Python raises a pending signal's exception in the code
    of ``files``: the entry of a function (its own, or one it calls) and the return of a C function
    it calls (the result is dropped, as the check after a call drops it). It raises a real SIGINT
    at the ``fire_at``-th such point (0-based; None: counts them only), counting only the points
    ``where`` names, if given: ``(event, name, caller)`` with event ``"call"`` (name: the function's
    qualified name, or ``"*.x"`` for any ``x`` method) or ``"return"`` (name: the C function's),
    and caller the qualified name of the function it is called from (``"a|b"``: either; None: any).

    Left out, as asyncio's own: the entry of a function called by one of asyncio's handles (the
    handle is dropped then, whatever the function) unless it is a coroutine starting (its task ends
    with the KeyboardInterrupt, its done callbacks run), and the entry of asyncio's own functions (a
    future's ``set_result`` schedules its callbacks through ``call_soon``: a signal at its entry
    drops them and the awaiting task never wakes). Also a coroutine's resumption (no check there)
    and the collector's weakref callbacks. Loop back-edges (checks too) are not points here: the
    calls in a loop's body are."""

    def __init__(self, files: set[str], fire_at: int | None = None,
                 where: tuple[str, str, str | None] | None = None) -> None:
        self.files = files
        self.fire_at = fire_at
        self.where = where
        self.seen = 0
        self.fired: str | None = None

    def __enter__(self) -> SignalPoints:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _hook(self, frame: types.FrameType, what: str, arg: object) -> None:
        code = frame.f_code
        files = self.files
        if what == "call":
            back = frame.f_back
            if code.co_filename in files:
                if back is not None and back.f_code is _HANDLE_RUN and not code.co_flags & inspect.CO_COROUTINE:
                    return
            elif (back is None or back.f_code.co_filename not in files or code.co_filename.startswith(_ASYNCIO)
                  or code.co_filename in _WEAKREF):
                return
            if frame.f_lasti > _entry(code):
                return  # a coroutine resumed
            point = ("call", code.co_qualname, back.f_code.co_qualname if back is not None else "")
        elif what == "c_return" and code.co_filename in files:
            point = ("return", getattr(arg, "__name__", type(arg).__name__), code.co_qualname)
        else:
            return
        if self.where is not None and not _matches(self.where, point):
            return
        if self.seen == self.fire_at:
            sys.setprofile(None)
            self.fired = f"{'entry' if point[0] == 'call' else 'return'} of {point[1]} in {point[2]}"
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
        self.seen += 1


class SignalAfterCall:
    """A real SIGINT raised as the call of ``self.<attr>(...)`` (or of a local or free variable
    named ``attr``: a ``done`` callback) in ``code`` returns, the first time (its result dropped,
    as Python's check for signals after a call drops it): for a callable the profile hook does not
    report (a ctypes function, a ``functools.partial``); only where ``when(frame)`` holds, if
    given (the frame of ``code`` as the call returned). Traces ``code``'s opcodes (``sys.settrace``)."""

    def __init__(self, code: types.CodeType, attr: str,
                 when: Callable[[types.FrameType], bool] | None = None) -> None:
        self.code = code
        self.when = when
        instructions = list(dis.get_instructions(code))
        loads = ("LOAD_ATTR", "LOAD_METHOD", "LOAD_FAST", "LOAD_DEREF")
        self.after = next(after for i, ins in enumerate(instructions)
                          if ins.argval == attr and ins.opname in loads
                          and (after := _after_call(instructions, i)) is not None)
        self.fired: str | None = None
        self._tool: int | None = None

    def __enter__(self) -> SignalAfterCall:
        if _MONITORING is None:
            sys.settrace(self._global)
            return self
        # Python 3.12+: opcode tracing that ``sys.settrace`` turns on in a frame's call event is not
        # in force for the first call of the code (the trace saw no opcode of it: a point on the
        # first call was never reached); ``sys.monitoring``'s instruction events of the code are.
        monitoring = _MONITORING
        self._tool = next(i for i in range(6) if monitoring.get_tool(i) is None)
        monitoring.use_tool_id(self._tool, "aiokv tests: SignalAfterCall")
        monitoring.register_callback(self._tool, monitoring.events.INSTRUCTION, self._instruction)
        monitoring.set_local_events(self._tool, self.code, monitoring.events.INSTRUCTION)
        return self

    def __exit__(self, *exc: object) -> None:
        if _MONITORING is None:
            sys.settrace(None)
            return
        self._stop()

    def _stop(self) -> None:
        monitoring = _MONITORING
        if monitoring is not None and self._tool is not None:
            monitoring.set_local_events(self._tool, self.code, 0)
            monitoring.register_callback(self._tool, monitoring.events.INSTRUCTION, None)
            monitoring.free_tool_id(self._tool)
            self._tool = None

    def _instruction(self, code: types.CodeType, offset: int) -> object:
        if offset != self.after or self.fired is not None:
            return None
        frame = sys._getframe(1)  # the frame of ``code`` (the callback runs on its behalf)
        if self.when is not None and not self.when(frame):
            return None
        self.fired = f"return of the call at offset {self.after} in {self.code.co_qualname}"
        self._stop()
        signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
        return None

    def _global(self, frame: types.FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if frame.f_code is not self.code or self.fired is not None:
            return None
        frame.f_trace_opcodes = True
        return self._local

    def _local(self, frame: types.FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if (event == "opcode" and frame.f_lasti == self.after and self.fired is None
                and (self.when is None or self.when(frame))):
            self.fired = f"return of the call at offset {self.after} in {self.code.co_qualname}"
            sys.settrace(None)
            frame.f_trace_opcodes = False
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
        return self._local


_MONITORING: Any = getattr(sys, "monitoring", None)
"""``sys.monitoring`` where Python has it (3.12+), else None (``SignalAfterCall`` traces instead)."""


def _after_call(instructions: list[dis.Instruction], load: int) -> int | None:
    """The offset of the instruction after the call of what ``instructions[load]`` loads (not a
    call nested in its arguments: the first CALL that leaves the stack below the loaded callable),
    or None when something else consumes it (a test of it, a store)."""
    depth = 0
    for at in range(load, len(instructions)):
        ins = instructions[at]
        depth += dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        if depth <= 0:
            return instructions[at + 1].offset if ins.opname == "CALL" else None
    return None


def _matches(where: tuple[str, str, str | None], point: tuple[str, str, str]) -> bool:
    event, name, caller = where
    if event != point[0] or (caller is not None and point[2] not in caller.split("|")):
        return False
    return point[1].endswith(name[1:]) if name.startswith("*.") else point[1] == name


PAGE_JOB_FILES = {module.__file__ for module in (jobs, readpath, writepath, tierbase, tieredge, backends, safefiles,
                                                 index, disk) if module.__file__ is not None}
"""The page-job code: the tier's jobs and I/O slots, its shell, its index, the byte movers and what
they call to open and check files (not the ring's or the checksums' own code, nor asyncio's)."""

Variant = Literal["plain", "spares", "thread-hashes", "ring-opens"]
"""``spares``: writes take spare files first; ``thread-hashes``: every page is hashed on the
checksum thread; ``ring-opens``: every open goes through the ring (cold reads are one chain)."""

QUEUE_DEPTH = 4
"""I/O slots of the scenario's tier: fewer than a round's pages (some wait for a slot)."""
SETTLE_S = 5.0
"""How long the loop may run after an interrupt until every caller ended: longer is a hang."""


def key_of(tag: int, i: int) -> PageKey:
    return bytes([tag]) + i.to_bytes(15, "little")


def page_bytes_of(key: PageKey, size: int) -> bytes:
    """The oracle: ``key``'s page, ``size`` bytes that follow from the key alone."""
    return random.Random(key).randbytes(size)


def open_fds() -> set[int]:
    """The descriptors open in this process, less the listing's own (closed once listed: it no
    longer reads as a link). Counted, it sat in every baseline at the lowest free number, where a
    descriptor a round leaked then hid, the check naming the next listing's number instead."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:
            continue  # closed since it was listed (the listing's own descriptor)
        fds.add(int(name))
    return fds


RECLAIM_WAIT_S = 60.0
"""Bound on the wait for a pool's start-up reclaim (:func:`settled_fds`): it retries for up to
``aiokv.pool.RECLAIM_SETTLE_S`` (5 s), a pass taking milliseconds."""


def settled_fds(pool: PagePool) -> set[int]:
    """The descriptors open once ``pool``'s start-up reclaim is over: the baseline of the checks
    that no descriptor is left open.

    ``PagePool.create`` reclaims the segments of dead processes in a thread of its own
    (``aiokv-reclaim``) when ``/dev/shm`` holds one, and retries for up to ``RECLAIM_SETTLE_S`` (5 s)
    while a dead creator's segment is still held. Each pass opens every segment named like a pool's
    (this pool's own among them) and its creator's ``/proc/<pid>/stat`` for a moment: two
    descriptors, counted as the tier's leak when a check or a baseline fell inside a pass.
    ``/dev/shm`` is the machine's: a concurrent test run that SIGKILLs a pool's creator starts such
    a reclaim in this process's next pool (a sweep failed so under load: ``{290, 291}`` left open).
    Nothing else of a prepared pool opens descriptors, so from then on any descriptor a round
    leaves open is the tier's, and the checks stay exact (test_sigint_fd_accounting)."""
    done, _ = concurrent.futures.wait([pool.reclaimed], timeout=RECLAIM_WAIT_S)
    assert done, f"the pool's start-up reclaim still runs after {RECLAIM_WAIT_S} s"
    return open_fds()


class JobsScenario:
    """A tier (``backend``, :data:`QUEUE_DEPTH` slots, room for ``capacity`` files: its first
    ``stored`` pages written at :meth:`start`) and ``pool`` on ``loop``. Each :meth:`round` runs
    read and write batches with a real SIGINT at one point of the page-job code, runs the loop again
    as an application's cleanup would (the loop's next run, or ``aclose``), then checks: every
    caller ended (a miss or a fault is fine, a hang is not), the I/O slots, counts, room and pool
    references came back, no descriptor is left open, and every page a read reported is the key's
    own bytes (never a wrong byte served)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, directory: Path, backend: DiskBackend, layout: KVLayout,
                 pool: PagePool, variant: Variant = "plain", capacity: int = 24, stored: int = 16) -> None:
        self.loop = loop
        self.layout = layout
        self.pool = pool
        self.payload = layout.payload_bytes
        self.variant = variant
        self.stored = stored
        size = file_bytes(layout)
        self.tier = DiskTier(config(directory, backend, capacity=capacity * size, queue_depth=QUEUE_DEPTH),
                             layout, pool, spare_files=4 if variant == "spares" else 0)
        self.rounds = 0
        self.interrupted = 0
        self.hits = 0
        self.fds: set[int] = set()
        self._held: list[PageHandle] = []
        self._reserved: list[PageHandle] = []

    def start(self) -> None:
        run(self.loop, self.tier.start())
        if self.variant == "ring-opens":  # every open through the ring (a cold read: one chain)
            io = self.tier.backend
            assert isinstance(io, backends.UringPageIO)
            io._cached.available = False
        elif self.variant == "thread-hashes":  # every page hashed on the checksum thread
            checksums = self.tier._checksums
            assert checksums is not None
            checksums._inline = checksums._inline_write = 0
        run(self.loop, self._settled([self.loop.create_task(self._write(key_of(1, i))) for i in range(self.stored)]))
        self._release_pages()
        assert all(key_of(1, i) in self.tier._index for i in range(self.stored))
        self.fds = settled_fds(self.pool)

    def close(self) -> None:
        run(self.loop, self.tier.aclose())

    # -- callers ---------------------------------------------------------------------------------

    def _reserve(self, key: PageKey) -> PageHandle:
        (res,) = self.pool.reserve([key])
        assert res.outcome is ReserveOutcome.RESERVED and res.handle is not None
        self._reserved.append(res.handle)
        return res.handle

    def _check_page(self, key: PageKey, handle: PageHandle) -> None:
        view = self.pool.memory.page_view(self.pool.table.check(handle))
        assert bytes(view[: self.payload]) == page_bytes_of(key, self.payload), f"wrong bytes served for {key.hex()}"
        self.hits += 1

    async def _write(self, key: PageKey) -> bool:
        (res,) = self.pool.reserve([key])
        assert res.outcome is ReserveOutcome.RESERVED and res.handle is not None
        self.pool.memory.page_view(self.pool.table.check(res.handle))[: self.payload] = page_bytes_of(key, self.payload)
        held = self.pool.table.commit(res.handle, keep=True)
        assert held is not None
        self._held.append(held)
        return await self.tier.write(key, held)

    async def _write_from(self, key: PageKey, buffer: memoryview) -> bool:
        buffer[: self.payload] = page_bytes_of(key, self.payload)
        return await self.tier.write_from(key, buffer)

    async def _read_many(self, keys: list[PageKey], into: list[PageKey]) -> None:
        handles = [self._reserve(k) for k in into]
        oks = await self.tier.read_many(keys, handles)
        for key, handle, ok in zip(keys, handles, oks, strict=True):
            if ok:
                self._check_page(key, handle)

    async def _read(self, key: PageKey, into: PageKey) -> None:
        handle = self._reserve(into)
        if await self.tier.read(key, handle):
            self._check_page(key, handle)

    def _release_pages(self) -> None:
        """The callers' pool pages, once nothing of the tier touches them any more."""
        for handle in self._reserved:
            self.pool.table.abort(handle)
        for handle in self._held:
            self.pool.table.release(handle)
        self._reserved, self._held = [], []
        self.pool.table.evict(self.pool.num_pages)

    # -- a round ---------------------------------------------------------------------------------

    def round(self, points: SignalPoints | SignalAfterCall | None = None) -> SignalPoints | SignalAfterCall:
        """One batch: a read_many of 6 pages (5 stored, 1 never), two single reads of stored
        pages, three writes of new pages from the pool and one from a buffer (new files while there
        is room, then recycled ones), with a SIGINT at the point ``points`` picks (None: counts
        them); then the loop runs again until every caller ended and the tier is idle, and it is
        checked."""
        r = self.rounds
        self.rounds += 1
        rng = random.Random(r)
        reads = [*rng.sample(list(self.tier._index), 7), key_of(3, r)]
        buffer = memoryview(bytearray(self.layout.page_bytes))
        callers = [
            self._read_many([*reads[:5], reads[7]], [key_of(9, 100 * r + i) for i in range(6)]),
            self._read(reads[5], key_of(9, 100 * r + 50)),
            self._read(reads[6], key_of(9, 100 * r + 51)),
            self._write(key_of(2, 4 * r)),
            self._write(key_of(2, 4 * r + 1)),
            self._write_from(key_of(2, 4 * r + 2), buffer),
            self._write(key_of(2, 4 * r + 3)),
        ]
        if points is None:
            points = SignalPoints(PAGE_JOB_FILES)
        tasks: list[asyncio.Task[object]] = []
        try:
            with points:
                tasks = [self.loop.create_task(caller) for caller in callers]  # type: ignore[arg-type]
                self.loop.run_until_complete(asyncio.wait(tasks))
        except KeyboardInterrupt:
            self.interrupted += 1
        what = f"round {r} (SIGINT at {points.fired})"
        try:
            self.loop.run_until_complete(asyncio.wait_for(self._settled(tasks), SETTLE_S))
        except TimeoutError:
            stuck = [task.get_coro().__qualname__ for task in tasks if not task.done()]  # type: ignore[union-attr]
            raise AssertionError(f"{what}: hung: callers {stuck} never ended; {self.state()}") from None
        for task in tasks:
            if task.exception() is not None and not isinstance(task.exception(), KeyboardInterrupt):
                raise AssertionError(what) from task.exception()
        self.check_idle(what)
        self._release_pages()
        stats = self.pool.table.statistics()
        assert not stats.reserved and not stats.referenced, f"{what}: pool references left: {stats}"
        buffer.release()
        return points

    async def _settled(self, tasks: list[asyncio.Task[object]]) -> None:
        """Until every caller ended and the tier is idle (the application's cleanup: the loop runs
        again); bounded by the caller."""
        if tasks:
            await asyncio.wait(tasks)
        tier = self.tier
        # Jobs of a caller the interrupt ended may still run: waited for as the tier's close does.
        while tier._active or tier._jobs or tier._refill is not None:
            await tier._until_idle()
            if tier._refill is not None:  # a batch of spare files being made (its descriptors open)
                await asyncio.wait({tier._refill})

    def state(self) -> str:
        tier = self.tier
        slots = tier._io_slots
        return (f"jobs={tier._active} tasks={len(tier._jobs)} slots in use={slots.in_use} waiting={slots.waiting} "
                f"writing={len(tier._writing)} readers={len(tier._index.readers)}")

    def check_idle(self, what: str) -> None:
        """Slots, counts, room and descriptors as before the round (the tier is idle)."""
        tier = self.tier
        slots = tier._io_slots
        assert slots.in_use == 0 and slots.writes_in_use == 0 and not slots.waiting, f"{what}: {self.state()}"
        assert sorted(slots._free) == list(range(QUEUE_DEPTH)), f"{what}: slots {slots._free}"
        assert not tier._index.readers and not tier._writing and not tier._moving, f"{what}: {self.state()}"
        assert not tier._spare_of, what
        index = tier._index
        assert index.used == (len(index) + index.spares) * index.file_bytes, f"{what}: room counted wrong"
        leaked = open_fds() - self.fds
        assert not leaked, f"{what}: descriptors left open: {leaked}"

    def check_all(self) -> None:
        """Every page of every round read once more, with no signal: its own bytes, or a miss."""
        keys = [key_of(1, i) for i in range(self.stored)] + [key_of(2, i) for i in range(4 * self.rounds)]
        for start in range(0, len(keys), 8):
            chunk = keys[start : start + 8]
            run(self.loop, self._read_many(chunk, [key_of(8, start + i) for i in range(len(chunk))]))
            self._release_pages()


def random_sigint_sweep(tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                        variant: Variant, files: set[str], seed: str, rounds: int) -> None:
    """``rounds`` rounds of a :class:`JobsScenario`, each with a real SIGINT at a point of ``files``
    drawn (seeded by ``seed``) from those a first, uninterrupted round reaches; then every caller
    ended, every page checked against its oracle and read back, and no descriptor left open."""
    if variant == "ring-opens" and backend is DiskBackend.THREADS:
        pytest.skip("the threads backend opens in its workers")
    rng = random.Random(seed)
    before = settled_fds(pool)
    with private_loop() as loop:
        scenario = JobsScenario(loop, tmp_path / "disk", backend, layout, pool, variant)
        scenario.start()
        reached = scenario.round(SignalPoints(files)).seen  # the points a round reaches (later ones vary a little)
        for _ in range(rounds):
            scenario.round(SignalPoints(files, rng.randrange(reached)))
        assert scenario.interrupted >= rounds // 2, "most rounds should reach their point"
        scenario.check_all()
        assert scenario.hits, "no page was ever read back: the oracle checked nothing"
        scenario.close()
    assert open_fds() <= before, "descriptors left open after the close"
