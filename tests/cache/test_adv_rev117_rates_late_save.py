"""Review 117: a rates save held in the kernel past its cache's close must not replace a later
cache's rates file.

A cache (process A) over an ext4 on a loop device learns a disk rate; the file system is frozen
(``fsfreeze``: its writes hang in the kernel) and A closes: its save of the rates is held, the
close keeps its bound (``rates_not_saved``) and the directory's lock is let go. A is stopped
(SIGSTOP) and the file system thawed, so A's save stays where the kernel let it go, like a writer
held by a slow device; a second cache (B) takes the directory, learns another rate and saves it.
Then A goes on. Its rename replaced B's file with A's older rates (a restart then planned with
the dead cache's figures, and B's own were lost until its next save). Now A's save is dropped
(the file in place holds a later measurement) and B's file stays; no temporary file is left.
The rules are also checked directly (which file is later, leftovers of dead writers). Root only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_helpers import DEVICE, LAYOUT, make_kv
from held_call import Hold

from aiokv import CacheConfig, KVCache, rates_file
from aiokv.costs import CostModel
from aiokv.rates_file import RATES_FILE, RATES_TEMP, decode_rates, encode_rates, write_rates_file
from aiokv.storage import DiskConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

CHILD = "--child"
CLOSE_S = 1.0
BOUND_S = 30.0
PAGE = LAYOUT.page_bytes
A_SECONDS, B_SECONDS = 0.010, 0.002
"""Seconds per page read each cache learns: the two files are told apart by their disk rate."""


def _config(root: Path) -> CacheConfig:
    disk = DiskConfig(directory=root, capacity_bytes=16 * (PAGE + 4096), min_free_bytes=0)
    return CacheConfig(cpu_bytes=8 * PAGE, disk=disk, namespace="test-model", pool_chunk_bytes=4 * PAGE,
                       close_timeout=CLOSE_S)


def _disk_rate(path: Path) -> float:
    return decode_rates(path.read_bytes(), LAYOUT.fingerprint.hex(), DEVICE.type).rates["disk"][0]


def _threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (state T): the kernel let A's held save go, and A stopped."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            states.append(Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    return bool(states) and all(s in ("T", "t") for s in states)


async def _wait_unlocked(lock: Path) -> None:
    """Until nobody holds the layout directory's lock (another process lets it go: nothing to wait on)."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # (closing the descriptor lets it go again)
            except BlockingIOError:
                assert time.monotonic() < deadline, "A's disk tier kept the directory"
                await asyncio.sleep(0.01)
    finally:
        os.close(fd)


class _Child:
    """Cache A in a process of its own, driven a line at a time."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, CHILD, str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def finish(self) -> int:
        """Let it exit; it does only once its held save ended (the save's thread is not a daemon)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        return self.proc.wait(timeout=BOUND_S)


@pytest.mark.slow(seconds=10)
@pytest.mark.asyncio
async def test_a_save_held_past_its_close_never_replaces_the_next_caches_rates(tmp_path: Path) -> None:
    with loop_ext4(tmp_path, 16) as mount:
        root = mount / "kv"
        layout_dir = root / LAYOUT.fingerprint.hex()
        rates = layout_dir / RATES_FILE
        a = _Child(root)
        try:
            assert a.ask("start") == "started"
            freeze(mount)
            try:
                reply = json.loads(a.ask("close"))  # its save is held in the kernel, the close is not
                assert reply["close_s"] < CLOSE_S + 3.0 and reply["errors"].get("rates_not_saved", 0) >= 1, reply
                await _wait_unlocked(layout_dir / ".lock")  # A's disk tier let the directory go
                os.kill(a.proc.pid, signal.SIGSTOP)
            finally:
                thaw(mount)
            deadline = time.monotonic() + BOUND_S
            while not _threads_stopped(a.proc.pid):  # kernel-side state: nothing to wait on
                assert time.monotonic() < deadline, "A did not stop"
                await asyncio.sleep(0.01)
            assert not rates.exists()  # A's save has not landed

            async with KVCache(_config(root), LAYOUT, make_kv(2)) as b:
                assert b.disk is not None and b.disk.read_only is None  # B holds the directory
                for _ in range(8):
                    b.manager.costs.disk.update(PAGE, B_SECONDS)
                await b.flush()  # saves B's rates
                assert _disk_rate(rates) > 0.9 * PAGE / B_SECONDS

                assert a.finish() == 0  # A's held save went on, and ended
                # Before the fix: A's rename replaced B's file (A's rate, ~PAGE / A_SECONDS).
                assert _disk_rate(rates) > 0.9 * PAGE / B_SECONDS, "a late save replaced a later cache's rates"
                assert b.stats().errors.get("rates_not_saved", 0) == 0
            assert not [p.name for p in layout_dir.iterdir() if p.name.startswith(RATES_TEMP)]
            async with KVCache(_config(root), LAYOUT, make_kv(3)) as c:  # the next start reads B's
                rate = c.manager.costs.disk.rate
                assert rate is not None and rate > 0.9 * PAGE / B_SECONDS
                assert c.stats().errors.get("rates_ignored", 0) == 0
        finally:
            thaw(mount)
            if a.proc.poll() is None:
                os.kill(a.proc.pid, signal.SIGCONT)
                a.proc.kill()
                a.proc.wait()
            for stream in (a.proc.stdin, a.proc.stdout):
                if stream is not None:
                    stream.close()


def _learned(seconds: float) -> bytes:
    costs = CostModel()
    costs.disk.update(PAGE, seconds)
    return encode_rates(costs, LAYOUT.fingerprint.hex(), DEVICE.type)


def test_the_later_measurement_stays_whatever_order_the_saves_land_in(tmp_path: Path) -> None:
    older, newer = _learned(A_SECONDS), _learned(B_SECONDS)
    assert write_rates_file(tmp_path, newer)
    assert not write_rates_file(tmp_path, older)  # landed late: dropped
    assert (tmp_path / RATES_FILE).read_bytes() == newer
    again = _learned(B_SECONDS)
    assert write_rates_file(tmp_path, again)  # a later one replaces it
    assert (tmp_path / RATES_FILE).read_bytes() == again
    assert sorted(p.name for p in tmp_path.iterdir()) == [RATES_FILE]


def test_a_file_with_no_measurement_time_is_replaced(tmp_path: Path) -> None:
    # An older version's file, or rates only restored: no time to compare, replaced as before.
    doc = json.loads(_learned(A_SECONDS))
    del doc["measured"]
    (tmp_path / RATES_FILE).write_text(json.dumps(doc))
    newer = _learned(B_SECONDS)
    assert write_rates_file(tmp_path, newer)
    assert (tmp_path / RATES_FILE).read_bytes() == newer


def test_leftovers_of_dead_writers_go_and_a_live_writers_stays(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    me = f"{RATES_TEMP}.{os.getpid()}-{ticks}-{'ab' * 8}"
    gone = [f"{RATES_TEMP}.{pid}-1-{'cd' * 8}", RATES_TEMP]
    for name in (me, *gone):
        (tmp_path / name).write_bytes(b"torn")
    (tmp_path / f"{RATES_TEMP}-not-ours").write_bytes(b"x")
    assert write_rates_file(tmp_path, _learned(B_SECONDS))
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {RATES_FILE, me, f"{RATES_TEMP}-not-ours"}, left


def test_a_save_whose_rename_is_held_keeps_the_next_save_out_until_it_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A's check passed (nothing later in place), then its rename is held. Were B's save to land
    # meanwhile, A's rename would replace it: B waits for the directory's lock, gives up (counted
    # by the cache: rates_not_saved, kept dirty) and saves once A landed.
    older, newer = _learned(A_SECONDS), _learned(B_SECONDS)
    hold = Hold()
    monkeypatch.setattr(os, "rename", hold.wrap(os.rename))  # only the first call (A's) is held
    monkeypatch.setattr(rates_file, "RATES_LOCK_WAIT_S", 0.2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = pool.submit(write_rates_file, tmp_path, older)
        assert hold.entered.wait(BOUND_S)
        try:
            try:
                saved = write_rates_file(tmp_path, newer)
            except BlockingIOError:
                saved = False
        finally:
            hold.release()
        assert late.result(timeout=BOUND_S)
    if saved:  # without the lock: B landed, then A's rename replaced it
        assert (tmp_path / RATES_FILE).read_bytes() == newer, "a late rename replaced a later save"
    assert not saved and (tmp_path / RATES_FILE).read_bytes() == older
    assert write_rates_file(tmp_path, newer)
    assert (tmp_path / RATES_FILE).read_bytes() == newer
    assert sorted(p.name for p in tmp_path.iterdir()) == [RATES_FILE]


# -- cache A, in its own process ------------------------------------------------------------------


def _child(root: Path) -> None:
    async def main() -> None:
        cache = KVCache(_config(root), LAYOUT, make_kv(1))
        # Lines are read off the loop: the close goes on in the background after aclose() returns.
        while line := await asyncio.to_thread(sys.stdin.readline):
            if line.strip() == "start":
                await cache.start()
                print("started", flush=True)
            elif line.strip() == "close":  # learns (a save starts at once, held), then closes
                for _ in range(8):
                    cache.manager.costs.disk.update(PAGE, A_SECONDS)
                started = time.monotonic()
                await cache.aclose()
                print(json.dumps({"close_s": time.monotonic() - started, "errors": dict(cache.stats().errors)}),
                      flush=True)

    asyncio.run(main())


if __name__ == "__main__" and sys.argv[1:2] == [CHILD]:
    _child(Path(sys.argv[2]))
