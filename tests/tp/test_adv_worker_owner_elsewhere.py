"""A rank worker whose manager's directory is claimed by a manager on another host (a TP directory
on a shared file system, ``aiokv.tp.owner``) says so, once per claim.

A Unix-domain socket answers only where it was bound: from another host (or through another mount)
every connect to a live manager's socket is refused, as to a dead one's. The worker retried for
ever, counting ``connect_failures`` and logging nothing, so the user could not tell why the rank
never attached. Now a refused connect looks at the directory's ``manager.owner`` record: where it
names a manager this process cannot reach, the worker logs one warning per claim (the host, the
record file), counts ``connects_refused_elsewhere`` and shows that manager in ``owner_elsewhere``.

The other host is real on disk, as in ``test_adv_shared_dir_hosts.py``: a record naming another
host beside a socket bound and not listening; and a live manager listening through one of two FUSE
mounts of one tree (``fuse_lockfs.py``), the worker connecting through the other.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import pytest
from loop_probes import until_thread
from test_adv_shared_dir_hosts import LAYOUT, _group, _record, _two_mounts, _unanswered_socket
from tp_helpers import CONFIG, full_kv, rank_kv

from aiokv.tp import RankWorker
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.owner import OWNER_NAME, this_host

RETRIES = 4
"""Refused connects to see before looking: the warning must not come once per retry."""


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "refuses every connect from here" in r.getMessage()]


async def _refused(worker: RankWorker, at_least: int) -> None:
    await until_thread(lambda: worker.statistics().connect_failures >= at_least,
                       f"{at_least} refused connects", timeout_s=30.0)


@pytest.mark.asyncio
async def test_a_rank_refused_by_another_hosts_manager_logs_it_once_per_claim(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv.tp.worker")
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    _record(directory, "other-host", "f" * 32, str(uuid.uuid4()), time.time())
    kv = rank_kv(full_kv(LAYOUT, 1), LAYOUT, 0, 2)
    with _unanswered_socket(directory / SOCKET_NAME):  # that host's live manager, as this host sees it
        async with RankWorker(directory / SOCKET_NAME, 0, 2, LAYOUT, kv, CONFIG) as worker:
            await _refused(worker, RETRIES)
            stats = worker.statistics()
            assert not stats.attached
            # Every refused connect counted, as before, and each one refused for that claim.
            assert stats.connects_refused_elsewhere == stats.connect_failures >= RETRIES, stats
            assert stats.owner_elsewhere is not None and "other-host" in stats.owner_elsewhere, stats
            (warning,) = _warnings(caplog)  # once, not per retry (before: never)
            assert "other-host" in warning and os.fspath(directory / OWNER_NAME) in warning, warning
            assert "another host" in warning, warning
            # Another host's claim (that manager restarted there): said once more.
            _record(directory, "third-host", "e" * 32, str(uuid.uuid4()), time.time())
            seen = worker.statistics().connect_failures
            await _refused(worker, seen + RETRIES)
            assert [w for w in _warnings(caplog) if "third-host" in w] != [], _warnings(caplog)
            assert len(_warnings(caplog)) == 2, _warnings(caplog)
            assert "third-host" in (worker.statistics().owner_elsewhere or "")
            # Claim gone (its manager stopped): a refused connect no longer names anyone.
            (directory / OWNER_NAME).unlink()
            before = worker.statistics()
            await _refused(worker, before.connect_failures + 2)
            after = worker.statistics()
            assert after.owner_elsewhere is None, after
            assert after.connects_refused_elsewhere == before.connects_refused_elsewhere, (before, after)
            assert len(_warnings(caplog)) == 2


@pytest.mark.asyncio
async def test_a_rank_through_another_mount_than_its_live_manager_logs_it_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv.tp.worker")
    kv = rank_kv(full_kv(LAYOUT, 2), LAYOUT, 0, 2)
    with _two_mounts(tmp_path) as (a, b):
        group = _group(a / "mgr")
        await group.start()  # live, listening through mount a: the host the rank does not run on
        try:
            async with RankWorker(b / "mgr" / SOCKET_NAME, 0, 2, LAYOUT, kv, CONFIG) as worker:
                await _refused(worker, RETRIES)
                stats = worker.statistics()
                assert not stats.attached and group.statistics().connections == 0
                assert stats.connects_refused_elsewhere == stats.connect_failures >= RETRIES, stats
                assert this_host().host in (stats.owner_elsewhere or ""), stats
                (warning,) = _warnings(caplog)
                assert "another mount" in warning and os.fspath(b / "mgr" / OWNER_NAME) in warning, warning
                assert f"pid {os.getpid()}" in warning, warning
        finally:
            await group.aclose()
