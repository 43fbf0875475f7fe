"""Adversarial review 189 of the rings' shared setup and finalizer (``uring.RingMaps``, 041e90f):
the engine's close paths and what outlives them.

- A closed engine kept its ring's descriptor number (``_fd``): a ``register_*`` call after the
  close reached whatever file took the number since, another engine's ring among them (its
  fixed-file table registered by the wrong engine; the right one's own call then failed EBUSY).
- ``aclose()`` that a signal handler's exception interrupted (a SIGINT as it waits for the
  requests in flight, or as it unmaps) was marked closed: the next ``aclose()`` returned at once,
  while the kernel could still write the callers' buffers, and the ring, its maps and the
  eventfd stayed open.
- An engine dropped unclosed (its loop closed under it) with a request in flight: its ring's
  finalizer released the ring, but the request's buffers were freed with it while the kernel
  may still write them (a read in progress is not stopped by the ring's release), and the eventfd
  leaked.
- ``os.fork()`` with a ring in flight: the child dropping its copies (finalizers, closes) leaves
  the parent's rings working (a check: it always did).

Faults are real: SIGINTs raised at named points (Python's default handler), pipes that hold reads
in flight until written, a child made with ``os.fork``."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import gc
import os
import signal
import sys
import types
import weakref
from collections.abc import Iterator

import pytest
from interrupt_helpers import SignalPoints, private_loop, run

from aiokv.storage import statxring, uring
from aiokv.storage.uring import UringEngine

URING_FILE = {uring.__file__} if uring.__file__ is not None else set()
"""Where the SIGINTs of the unmapping land."""
STREAM = (1 << 64) - 1
"""The offset of a read at a pipe's current position."""


class _Buffer:
    """The memory a read names, with a weak reference to tell whether it was freed."""

    def __init__(self, size: int) -> None:
        self.data = (ctypes.c_char * size)()
        self.address = ctypes.addressof(self.data)


def _fd_targets() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor
    return out


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def test_a_closed_engines_register_calls_never_reach_the_ring_that_took_its_number() -> None:
    """Before: the closed engine's ``register_files`` registered a table on the new ring (no
    error), and the new engine's own then failed with EBUSY."""
    with private_loop() as loop:
        old = UringEngine(loop, 8)
        number = old._fd
        run(loop, old.aclose())
        new = UringEngine(loop, 8)
        try:
            assert new._fd == number  # the lowest free number: the one the old ring had
            # fd -1: EBADF, or EINVAL where the kernel reads -1 as a "blind" registration (6.11+)
            with pytest.raises(OSError, match=r"Bad file descriptor|Invalid argument") as refused:
                old.register_files(4)
            assert refused.value.errno in (errno.EBADF, errno.EINVAL)
            new.register_files(4)  # its table is still its own to make
        finally:
            run(loop, new.aclose())


class _SigintAtCreateFuture:
    """A real SIGINT raised as ``aclose`` calls ``loop.create_future`` (for its wait on the
    requests in flight): Python's handler raises KeyboardInterrupt at that function's entry."""

    def __init__(self) -> None:
        self.fired = False

    def __enter__(self) -> _SigintAtCreateFuture:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _hook(self, frame: types.FrameType, what: str, arg: object) -> None:
        back = frame.f_back
        if (what == "call" and frame.f_code.co_name == "create_future" and back is not None
                and back.f_code.co_qualname == "UringEngine.aclose"):
            sys.setprofile(None)
            self.fired = True
            signal.raise_signal(signal.SIGINT)


def test_an_aclose_interrupted_before_its_wait_waits_when_called_again(pipe: tuple[int, int]) -> None:
    """A read of a pipe in flight; the first ``aclose`` ends with a SIGINT before it waits. The
    next must wait for the read (the kernel writes its buffer when the pipe is written), then
    close. Before: it returned at once with the read in flight and the ring open."""
    r, w = pipe
    with private_loop() as loop:
        engine = UringEngine(loop, 8)
        buffer = _Buffer(16)
        read = engine.read(r, buffer.address, 16, STREAM, buffer)
        run(loop, asyncio.sleep(0))  # submitted
        assert engine.in_flight == 1
        with _SigintAtCreateFuture() as points, pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.aclose())
        assert points.fired
        second = loop.create_task(engine.aclose())
        run(loop, asyncio.sleep(0.05))
        assert not second.done() and not engine._rings.closed
        os.write(w, b"0123456789abcdef")
        run(loop, second)
        assert read.result() == 16 and buffer.data.raw == b"0123456789abcdef"
        assert engine._rings.closed and engine._efd < 0


@pytest.mark.parametrize("point", ["UringEngine._unmap", "RingMaps.close"])
def test_an_aclose_interrupted_as_it_unmaps_is_finished_by_the_next(point: str) -> None:
    """A SIGINT at the entry of the unmapping: the next ``aclose`` closes the ring, its maps and
    the eventfd. Before: it returned at once and they stayed open."""
    with private_loop() as loop:
        before = _fd_targets()
        engine = UringEngine(loop, 8)
        assert run(loop, engine.nop()) == 0
        caller = "UringEngine.aclose" if point == "UringEngine._unmap" else "UringEngine._unmap"
        with SignalPoints(URING_FILE, 0, ("call", point, caller)) as points, pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.aclose())
        assert points.fired is not None
        run(loop, engine.aclose())
        assert engine._rings.closed and engine._efd < 0
        assert _fd_targets() == before


def test_an_engine_dropped_with_a_read_in_flight_keeps_its_buffer_and_closes_its_eventfd(
        pipe: tuple[int, int]) -> None:
    """An engine never closed, its loop closed under it, with a read of a pipe in flight. Its
    ring goes (the finalizer of its maps), its eventfd is closed, and the read's buffer is kept
    for good: the kernel may still be writing it. Before: the buffer was freed with the engine,
    and the eventfd leaked."""
    r, _w = pipe
    gc.collect()
    before = _fd_targets()
    loop = asyncio.new_event_loop()
    engine = UringEngine(loop, 8)
    buffer = _Buffer(16)
    kept = weakref.ref(buffer)
    read = engine.read(r, buffer.address, 16, STREAM, buffer)
    loop.run_until_complete(asyncio.sleep(0))  # submitted
    assert engine.in_flight == 1
    loop.close()  # its selector lets go of the engine's reader
    del engine, buffer, read
    gc.collect()
    assert _fd_targets() == before
    assert kept() is not None


_FORK_CHILD_DROPS = 0
"""The child's exit status when its copies were dropped and closed as planned."""


def test_a_forked_child_dropping_its_copies_leaves_the_parents_rings_working(
        pipe: tuple[int, int], tmp_path: os.PathLike[str]) -> None:
    """The parent has an engine with a read of a pipe in flight and a STATX ring; the child
    closes its copy of the STATX ring, drops both (their finalizers run in the child) and exits.
    The parent's read then completes into its buffer and its STATX ring still answers."""
    r, w = pipe
    try:
        statx = statxring.open_ring(8)
    except statxring.StatxRefused as exc:
        pytest.skip(f"io_uring STATX refused here: {exc}")
    with private_loop() as loop:
        engine = UringEngine(loop, 8)
        buffer = _Buffer(16)
        read = engine.read(r, buffer.address, 16, STREAM, buffer)
        run(loop, asyncio.sleep(0))
        assert engine.in_flight == 1
        pid = os.fork()
        if pid == 0:  # the child: nothing of pytest's may run here
            status = 1
            try:
                statx.close()
                ring = engine._rings
                del engine, statx, read, ring
                gc.collect()
                status = _FORK_CHILD_DROPS
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == _FORK_CHILD_DROPS
        os.write(w, b"fedcba9876543210")
        assert run(loop, read) == 16 and buffer.data.raw == b"fedcba9876543210"
        (result,) = statx.stat_fds([r])
        assert not isinstance(result, OSError) and result.st_ino == os.fstat(r).st_ino
        run(loop, engine.aclose())
        statx.close()
