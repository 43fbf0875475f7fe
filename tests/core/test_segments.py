"""Reclaiming segments of dead pool owners: real SIGKILLs, live owners, planted and foreign files."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from child_procs import fork_context

import aiokv.shm
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.segments import SegmentState, main, reclaim, reclaimable_bytes, scan
from aiokv.shm import SHM_DIR, SharedSegment, process_start_ticks

LAYOUT = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=8)
CHILDREN = fork_context()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A name prefix of this test only: concurrent test runs reclaim "aiokv" segments, never these."""
    p = f"aiokvtest{secrets.token_hex(4)}"
    yield p
    for name in os.listdir(SHM_DIR):
        if name.startswith(p):
            path = os.path.join(SHM_DIR, name)
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)


def dead_pid() -> int:
    """A pid no process can have: above the kernel's pid_max."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def plant(name: str, size: int = 8192) -> str:
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


def hex16() -> str:
    return secrets.token_hex(8)


def _create_pool_and_wait(
    prefix: str, names: multiprocessing.queues.Queue[str], stop: multiprocessing.synchronize.Event
) -> None:
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, name_prefix=prefix, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    names.put(pool.name)
    stop.wait(120)  # SIGKILLed before this returns, or told to finish
    pool.close()


def _spawn_owner(prefix: str) -> tuple[multiprocessing.process.BaseProcess, str, multiprocessing.synchronize.Event]:
    names: multiprocessing.queues.Queue[str] = CHILDREN.Queue()
    stop = CHILDREN.Event()
    child = CHILDREN.Process(target=_create_pool_and_wait, args=(prefix, names, stop))
    child.start()
    return child, names.get(timeout=120), stop


def test_segment_of_a_sigkilled_creator_is_reclaimed_by_the_next_pool(prefix: str) -> None:
    child, name, _ = _spawn_owner(prefix)
    attached = PagePool.attach(name, LAYOUT)  # a live worker of the pool
    try:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        path = SHM_DIR + name
        assert os.path.exists(path)  # the leak: nothing unlinked it
        # An attached process still holds it: not reclaimed while that worker lives.
        assert reclaim(prefix) == []
        (info,) = scan(prefix)
        assert info.state is SegmentState.LIVE and not info.creator_alive
    finally:
        attached.close()
    (info,) = scan(prefix)
    assert info.state is SegmentState.DEAD and info.size == 4 * LAYOUT.page_bytes
    assert reclaimable_bytes(prefix) == info.size
    with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes, name_prefix=prefix) as pool:
        # Shared memory had room for both: unlinked in a thread beside the new pool's preparation.
        assert [s.name for s in pool.reclaimed.result(timeout=60)] == [name]
        assert not os.path.exists(path)
        assert [s.name for s in scan(prefix)] == [pool.name]


def test_segment_of_a_live_owner_is_never_touched(prefix: str) -> None:
    child, name, stop = _spawn_owner(prefix)
    try:
        with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes, name_prefix=prefix) as mine:
            assert reclaim(prefix) == [] and reclaim(prefix, legacy=True) == []
            assert main(["clean", "--legacy", "--prefix", prefix]) == 0
            states = {s.name: (s.state, s.creator_alive) for s in scan(prefix)}
            assert states == {name: (SegmentState.LIVE, True), mine.name: (SegmentState.LIVE, True)}
            assert os.path.exists(SHM_DIR + name)
    finally:
        stop.set()
        child.join(60)
    assert child.exitcode == 0
    assert not os.path.exists(SHM_DIR + name)  # its owner unlinked it on close


def test_only_dead_segments_are_reclaimed_and_nothing_else_is_touched(prefix: str) -> None:
    dead = dead_pid()
    me = os.getpid()
    dead_seg = plant(f"{prefix}-{dead}-12345-{hex16()}")
    empty = plant(f"{prefix}-{dead}-12345-{hex16()}", size=0)  # its creator died before sizing it
    legacy_dead = plant(f"{prefix}-{dead}-{hex16()}")
    legacy_live = plant(f"{prefix}-{me}-{hex16()}")
    # Our own pid and start time, unlocked: a live owner is never reclaimed even without its lock.
    unlocked_live = plant(f"{prefix}-{me}-{process_start_ticks(me)}-{hex16()}")
    # Pid reuse: our pid with another start time is not us.
    reused_pid = plant(f"{prefix}-{me}-1-{hex16()}")
    untouched = [
        plant(f"{prefix}-notes"),
        plant(f"{prefix}-{dead}-1-{hex16()}.bak"),
        plant(f"{prefix}x-{dead}-1-{hex16()}"),
        plant(f"{prefix}-{dead}-1-{hex16()[:15]}"),
        plant(f"{prefix}-{dead}-1-{hex16().upper()}"),
    ]
    target = plant(f"{prefix}-target")
    link = os.path.join(SHM_DIR, f"{prefix}-{dead}-2-{hex16()}")
    os.symlink(target, link)
    fifo = os.path.join(SHM_DIR, f"{prefix}-{dead}-3-{hex16()}")
    os.mkfifo(fifo, 0o600)  # opening it without O_NONBLOCK would hang the reclaim
    directory = os.path.join(SHM_DIR, f"{prefix}-{dead}-4-{hex16()}")
    os.mkdir(directory, 0o700)
    untouched += [target, link, fifo, directory, legacy_live, unlocked_live]

    states = {SHM_DIR + s.name: s.state for s in scan(prefix)}
    assert states[dead_seg] is SegmentState.DEAD and states[reused_pid] is SegmentState.DEAD
    assert states[empty] is SegmentState.CREATING
    assert states[legacy_dead] is SegmentState.LEGACY and states[legacy_live] is SegmentState.LEGACY
    assert states[unlocked_live] is SegmentState.LIVE
    assert states[fifo] is SegmentState.FOREIGN and states[directory] is SegmentState.FOREIGN
    assert link not in states

    assert sorted(SHM_DIR + s.name for s in reclaim(prefix)) == sorted([dead_seg, reused_pid])
    assert os.path.exists(empty) and os.path.exists(legacy_dead)
    assert sorted(SHM_DIR + s.name for s in reclaim(prefix, legacy=True)) == sorted([empty, legacy_dead])
    for path in untouched:
        assert os.path.lexists(path), path
    assert os.path.islink(link) and os.path.isfile(target)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a file of another user")
def test_segments_of_other_users_are_never_touched(prefix: str) -> None:
    other = plant(f"{prefix}-{dead_pid()}-12345-{hex16()}")
    os.chown(other, 65534, 65534)
    assert [s.state for s in scan(prefix)] == [SegmentState.FOREIGN]
    assert reclaim(prefix, legacy=True) == []
    with PagePool.create(LAYOUT, LAYOUT.page_bytes, name_prefix=prefix):
        pass
    assert os.path.exists(other)


def test_operator_commands_list_and_clean(prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    seg = plant(f"{prefix}-{dead_pid()}-12345-{hex16()}", size=3 << 20)
    listed = subprocess.run(
        [sys.executable, "-m", "aiokv.segments", "list", "--prefix", prefix],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert os.path.basename(seg) in listed and "dead (creator gone)" in listed
    assert "1 reclaimable" in listed
    assert main(["clean", "--prefix", prefix]) == 0
    assert "1 segments removed" in capsys.readouterr().out
    assert not os.path.exists(seg)


@pytest.mark.asyncio
async def test_open_reclaims_too(prefix: str) -> None:
    seg = plant(f"{prefix}-{dead_pid()}-12345-{hex16()}")
    pool = await PagePool.open(LAYOUT, LAYOUT.page_bytes, name_prefix=prefix)
    try:
        assert [SHM_DIR + s.name for s in await asyncio.wrap_future(pool.reclaimed)] == [seg]
        assert [s.name for s in scan(prefix)] == [pool.name]
    finally:
        await pool.aclose()


def test_leftovers_are_reclaimed_first_when_the_pool_needs_their_memory(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = plant(f"{prefix}-{dead_pid()}-12345-{hex16()}")
    real = aiokv.shm.shm_free_bytes
    answers = iter([LAYOUT.page_bytes - 1])  # the first question: "is there room already?" no

    monkeypatch.setattr(aiokv.shm, "shm_free_bytes", lambda: next(answers, None) or real())
    leftover_at_create: list[bool] = []
    create = SharedSegment.create

    def watched_create(size: int, name_prefix: str) -> SharedSegment:
        leftover_at_create.append(os.path.exists(seg))
        return create(size, name_prefix)

    monkeypatch.setattr(SharedSegment, "create", watched_create)
    with PagePool.create(LAYOUT, LAYOUT.page_bytes, name_prefix=prefix) as pool:
        assert leftover_at_create == [False]  # unlinked before the new segment was made
        assert [SHM_DIR + s.name for s in pool.reclaimed.result()] == [seg]


def test_a_dead_creators_segment_still_held_for_a_moment_is_reclaimed_once_let_go(prefix: str) -> None:
    # Regression (H200 host): a SIGKILLed creator's CUDA-registered pool stayed locked for a moment
    # after the creator was reaped (its mappings outlived it while the driver let go); the restarted
    # cache's one scan found it held and reclaimed nothing. Here an attachment stands for that late
    # holder and lets go 0.5 s after the new pool started: the start's reclaim retries and gets it.
    child, name, _ = _spawn_owner(prefix)
    late_holder = PagePool.attach(name, LAYOUT)
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    timer = threading.Timer(0.5, late_holder.close)
    timer.start()
    try:
        with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes, name_prefix=prefix, register_cuda=False) as pool:
            assert [s.name for s in pool.reclaimed.result(timeout=60)] == [name]
            assert not os.path.exists(SHM_DIR + name)
    finally:
        timer.join()
        late_holder.close()


def test_a_segment_held_past_the_settle_time_is_left_for_the_next_start(
        prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker still attached to a dead creator's pool: the start's retries end, nothing is unlinked.
    import aiokv.pool

    monkeypatch.setattr(aiokv.pool, "RECLAIM_SETTLE_S", 0.6)
    child, name, _ = _spawn_owner(prefix)
    attached = PagePool.attach(name, LAYOUT)
    try:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(60)
        started = time.monotonic()
        with PagePool.create(LAYOUT, 2 * LAYOUT.page_bytes, name_prefix=prefix, register_cuda=False) as pool:
            assert pool.reclaimed.result(timeout=60) == []
            assert 0.5 < time.monotonic() - started < 30
            assert os.path.exists(SHM_DIR + name)
    finally:
        attached.close()
