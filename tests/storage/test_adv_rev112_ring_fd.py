"""Adversarial review 112: ``DiskTier.aclose()`` while ``start()`` is still running.

Before the fix the close found no backend yet, ended at once (``io_ended`` resolved), and the start
went on afterwards: the tier was left running after its close, its io_uring open (four
``anon_inode:[io_uring]`` descriptors: the ring and the duplicates its three mmaps hold), its
checksum threads, write-behind workers and the directory's lock with it, for as long as the
process lives. A second ``start()`` while the first ran was let through too (a second ring, the
first one's lost). Now the close waits for the start in flight and closes what it made; the start
raises ``RuntimeError``. Counted in ``/proc/self/fd``, on every backend.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cancel_points import most_attempts, pause
from disk_helpers import assert_clean, config

import aiokv.storage.disk as disk_module
import aiokv.storage.memory as memory_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

GATE_S = 30.0
"""Longest a gated thread waits for the test to let it go (it never should)."""
JOIN_S = 10.0
"""Longest a stopping tier thread may take to end."""
TIER_THREADS = ("aiokv-checksum-", "aiokv-disk_")


def _rings() -> int:
    """io_uring descriptors open in this process."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                count += 1
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
    return count


def _fds_into(directory: Path) -> list[str]:
    """This process's open descriptors that lead into ``directory`` (the lock file included)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target == str(directory) or target.startswith(f"{directory}/"):
            found.append(target)
    return found


def _tier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(TIER_THREADS)}


def _join_new(before: set[threading.Thread]) -> list[str]:
    """The tier threads started since ``before`` that do not end within ``JOIN_S`` (a tier that
    failed its start tells its checksum threads to stop and does not wait for them)."""
    for thread in _tier_threads() - before:
        thread.join(JOIN_S)
    return sorted(t.name for t in _tier_threads() - before)


async def _threads_left(before: set[threading.Thread]) -> list[str]:
    return await asyncio.to_thread(_join_new, before)


@contextmanager
def _gated(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
           loop: asyncio.AbstractEventLoop) -> Iterator[tuple[asyncio.Event, threading.Event]]:
    """``module.name`` (run on a thread by the start) signals ``entered`` and waits for ``gate``."""
    entered = asyncio.Event()
    gate = threading.Event()
    real = getattr(module, name)

    def gated(*args: Any) -> Any:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(GATE_S)
        return real(*args)

    monkeypatch.setattr(module, name, gated)
    try:
        yield entered, gate
    finally:
        gate.set()


async def _close_during_start_then_check(tier: DiskTier, directory: Path, entered: asyncio.Event,
                                         gate: threading.Event, rings: int, threads: set[threading.Thread]) -> None:
    start = asyncio.create_task(tier.start())
    await entered.wait()
    closing = asyncio.create_task(tier.aclose())
    for _ in range(5):
        await asyncio.sleep(0)
    closed_first = closing.done()
    gate.set()
    outcome = (await asyncio.gather(start, return_exceptions=True))[0]
    await closing
    assert tier.io_ended.done()
    assert _rings() == rings, f"{_rings() - rings} io_uring descriptors left open by a tier closed during its start"
    assert _fds_into(directory) == [], "directory descriptors (the lock) left open"
    assert await _threads_left(threads) == []
    assert not closed_first, "the close ended while the start was still opening the tier"
    assert isinstance(outcome, RuntimeError), outcome


@pytest.mark.asyncio
async def test_a_close_while_the_directory_is_prepared_closes_what_the_start_then_makes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: DiskBackend, layout: KVLayout,
        pool: PagePool) -> None:
    """Close requested while the start's thread prepares the directory (before any ring exists)."""
    directory = tmp_path / "cache"
    rings, threads = _rings(), _tier_threads()
    tier = DiskTier(config(directory, backend), layout, pool)
    with _gated(monkeypatch, disk_module, "prepare", asyncio.get_running_loop()) as (entered, gate):
        await _close_during_start_then_check(tier, directory, entered, gate, rings, threads)
    monkeypatch.undo()
    async with DiskTier(config(directory, backend), layout, pool) as again:  # the lock is free
        assert again.read_only is None
    assert _rings() == rings
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_close_while_the_pool_registers_closes_the_ring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool) -> None:
    """A forced URING_FIXED start registers the pool on a thread with its ring already open: the
    close is requested then."""
    directory = tmp_path / "cache"
    rings, threads = _rings(), _tier_threads()
    tier = DiskTier(config(directory, DiskBackend.URING_FIXED), layout, pool)
    with _gated(monkeypatch, memory_module, "populate_then_register", asyncio.get_running_loop()) as (entered, gate):
        await _close_during_start_then_check(tier, directory, entered, gate, rings, threads)
    monkeypatch.undo()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_second_start_while_the_first_runs_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: DiskBackend, layout: KVLayout,
        pool: PagePool) -> None:
    """Before, it went on and opened a second backend over the first (whose ring nobody closed)."""
    directory = tmp_path / "cache"
    rings = _rings()
    tier = DiskTier(config(directory, backend), layout, pool)
    with _gated(monkeypatch, disk_module, "prepare", asyncio.get_running_loop()) as (entered, gate):
        start = asyncio.create_task(tier.start())
        await entered.wait()
        second = asyncio.create_task(tier.start())
        for _ in range(5):
            await asyncio.sleep(0)
        refused_at_once = second.done()
        gate.set()
        outcomes = await asyncio.gather(start, second, return_exceptions=True)
    await tier.aclose()
    assert _rings() == rings, f"{_rings() - rings} io_uring descriptors left open"
    assert refused_at_once, "a second start() ran while the first was in flight"
    assert outcomes[0] is None and isinstance(outcomes[1], RuntimeError), outcomes
    assert _fds_into(directory) == []
    assert_clean(pool)


DENSE = 16
"""Closes requested after 0..15 loop turns, then after ever longer sleeps (cancel_points.pause)."""


@pytest.mark.asyncio
async def test_a_close_at_any_turn_of_the_start_leaves_nothing_open(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The close requested after every number of loop turns into the start up to DENSE, then after
    ever longer sleeps, until the start ends before it: each time, once both ended, nothing of the
    tier is open."""
    directory = tmp_path / "cache"
    rings, threads = _rings(), _tier_threads()
    during = 0
    for attempt in range(most_attempts(DENSE)):
        tier = DiskTier(config(directory, backend), layout, pool)
        start = asyncio.create_task(tier.start())
        await pause(attempt, DENSE)
        started = start.done()
        await tier.aclose()
        outcome = (await asyncio.gather(start, return_exceptions=True))[0]
        assert _rings() == rings, f"attempt {attempt}: {_rings() - rings} io_uring descriptors left open"
        assert _fds_into(directory) == [], f"attempt {attempt}: directory descriptors left open"
        assert await _threads_left(threads) == []
        if started:
            assert outcome is None
            break
        assert outcome is None or isinstance(outcome, RuntimeError), outcome
        during += outcome is not None
    else:
        pytest.fail("the start never ended before the close")
    assert during >= 1  # a close landed during the start at least once
    assert_clean(pool)


def test_a_ring_that_cannot_watch_its_loop_closes_itself() -> None:
    # Review 112 by reading: UringEngine registered its eventfd with the loop outside the guard of
    # the set-up, so a refusal there (a loop already closed) left the ring, its maps and the eventfd
    # open. Forced with a real closed loop.
    from aiokv.storage.uring import UringEngine

    loop = asyncio.new_event_loop()
    loop.close()
    before = _rings()
    with pytest.raises(RuntimeError, match="closed"):
        UringEngine(loop, 8)
    assert _rings() == before
