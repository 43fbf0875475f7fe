"""Review 183 of the looks' STATX batches (:mod:`aiokv.storage.statxring`): an exception raised in
the middle of a batch (a signal handler's, on the main thread) left its requests in flight: the
kernel still wrote their buffers after the call returned, and their completions landed in the
next batch (``IndexError``, or results of the old batch taken for the new one's). Also: signals
delivered to a batching thread at random moments, descriptors closed and replaced under the
batches, and rings made and closed in a loop leave the results equal to ``os.fstat``'s and no
descriptor or mapping behind."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiokv.storage import follow, statxring
from aiokv.storage.layoutdir import FANOUT, FollowSeed

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")


class _Boom(Exception):
    """What the signal handler raises in the middle of a batch."""


def _key(result: os.stat_result | OSError) -> object:
    if isinstance(result, OSError):
        return (type(result), result.errno)
    return (tuple(result), result.st_atime_ns, result.st_mtime_ns, result.st_ctime_ns)


def _fstat(fd: int) -> os.stat_result | OSError:
    try:
        return os.fstat(fd)
    except OSError as exc:
        return exc


def _process_counts() -> tuple[int, int]:
    """Open descriptors and io_uring mappings of this process (threads' stacks and malloc arenas
    come and go: not counted)."""
    with open("/proc/self/maps") as maps:
        return len(os.listdir("/proc/self/fd")), sum("io_uring" in line for line in maps)


@pytest.fixture
def fanout(tmp_path: Path) -> Iterator[list[int]]:
    fds = []
    for index in range(FANOUT):
        (tmp_path / f"{index:02x}").mkdir()
        fds.append(os.open(tmp_path / f"{index:02x}", os.O_RDONLY | os.O_DIRECTORY))
    yield fds
    for fd in fds:
        os.close(fd)


@pytest.fixture
def ring() -> Iterator[statxring.StatxRing]:
    try:
        made = statxring.open_ring(FANOUT)
    except statxring.StatxRefused as exc:
        pytest.skip(f"io_uring STATX refused here: {exc}")
    yield made
    made.close()


def _raising_alarm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise _Boom

    signal.signal(signal.SIGALRM, handler)


def test_an_exception_in_the_middle_of_a_batch(fanout: list[int], ring: statxring.StatxRing) -> None:
    """A SIGALRM handler raises at a seeded moment of each batch (some before the submission,
    most while the kernel works): the batch raises, and the next one's results are its own. Before:
    ``IndexError`` in the next batch (a completion of the interrupted one), or its results."""
    previous = signal.getsignal(signal.SIGALRM)
    _raising_alarm()
    abandoned = len(statxring._ABANDONED)
    rng = random.Random(183)
    interrupted = 0
    try:
        for _ in range(400):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(20e-6, 400e-6))
                ring.stat_fds(fanout)
            except _Boom:
                interrupted += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert not ring.closed
            wanted = fanout[: rng.randrange(1, FANOUT + 1)]
            got = ring.stat_fds(wanted)  # no signal now
            assert [_key(result) for result in got] == [_key(_fstat(fd)) for fd in wanted]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted > 0
    assert len(statxring._ABANDONED) == abandoned  # every interrupted batch was waited for


def test_a_failed_wait_abandons_the_buffers_and_the_next_look_makes_a_ring(
        fanout: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the wait after the exception fail as well, the ring is closed with its buffers kept
    alive, and the next look makes another ring (not ``fstat`` for good, which is for refusals)."""
    state = follow.FollowState(FollowSeed())
    assert follow._stat_batch(state, fanout) is not None
    first = state.ring
    if first is None:
        pytest.skip("io_uring STATX refused here")
    enter = statxring._enter
    def failing(fd: int, to_submit: int, min_complete: int) -> int:
        raise _Boom

    monkeypatch.setattr(statxring, "_enter", failing)
    abandoned = len(statxring._ABANDONED)
    with pytest.raises(_Boom):
        follow._stat_batch(state, fanout)
    assert first.closed and len(statxring._ABANDONED) == abandoned + 1
    monkeypatch.setattr(statxring, "_enter", enter)
    stats = follow._stat_batch(state, fanout)
    assert stats is not None and state.statx_refused is None
    assert state.ring is not None and state.ring is not first and not state.ring.closed
    assert {fd: _key(result) for fd, result in stats.items()} == {fd: _key(_fstat(fd)) for fd in fanout}
    state.close_ring()
    state.close_ring()  # idempotent
    assert state.ring is None


def test_signals_and_replaced_descriptors_under_batches(fanout: list[int], tmp_path: Path) -> None:
    """A batching thread (as a look's) takes signals at random moments (EINTR in io_uring_enter),
    one descriptor is replaced under it (``dup2``), and it makes a new ring every 20 batches: each
    result is what ``fstat`` gives (the replaced descriptor's: one of the files it named), and
    afterwards no descriptor or mapping is left."""
    previous = signal.getsignal(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    (tmp_path / "file").write_bytes(b"x" * 3)
    victim, spare, other = fanout[100], os.dup(fanout[100]), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    file_fd = os.open(tmp_path / "file", os.O_RDONLY)
    allowed = {_key(os.fstat(fd)) for fd in (spare, other, file_fd)}
    stop = threading.Event()
    batches = 0
    wrong: list[object] = []
    failed: list[BaseException] = []

    def batching() -> None:
        nonlocal batches
        try:
            ring = statxring.open_ring(FANOUT)
        except statxring.StatxRefused as exc:
            failed.append(exc)
            return
        try:
            while not stop.is_set():
                got = ring.stat_fds(fanout)
                for index, (fd, result) in enumerate(zip(fanout, got, strict=True)):
                    if fd == victim:
                        if _key(result) not in allowed:
                            wrong.append(result)
                    elif index % 15 == 0 and _key(result) != _key(os.fstat(fd)):
                        wrong.append((fd, result))
                batches += 1
                if batches % 20 == 0:
                    ring.close()
                    ring = statxring.open_ring(FANOUT)
        except BaseException as exc:
            failed.append(exc)
        finally:
            ring.close()

    before = _process_counts()
    thread = threading.Thread(target=batching, name="rev183-look")
    thread.start()
    rng = random.Random(1831)
    step = 0
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end and thread.is_alive():
            step += 1
            assert thread.ident is not None
            signal.pthread_kill(thread.ident, signal.SIGUSR1)
            os.dup2((spare, other, file_fd)[step % 3], victim)  # never closed: a ring could take the number
            time.sleep(rng.uniform(0, 300e-6))
    finally:
        stop.set()
        thread.join()
        after = _process_counts()
        os.dup2(spare, victim)
        for fd in (spare, other, file_fd):
            os.close(fd)
        signal.signal(signal.SIGUSR1, previous)
    if failed and isinstance(failed[0], statxring.StatxRefused):
        pytest.skip(f"io_uring STATX refused here: {failed[0]}")
    assert not failed and not wrong
    assert batches > 20
    assert after == before
