"""vLLM's tier under real faults while its jobs run, and after its process is killed (helper 310).

Driven through vLLM's real ``TieringOffloadingManager`` as its scheduler drives it (vllm_helpers).
Each chunk's bytes are a function of its key, and each key hashes the whole token prefix before it
(a prefix oracle): whatever a later load hands vLLM is checked against its key. Faults, all real:
another program fills a small loop-mounted ext4 while store jobs run; the file system is remounted
read-only under a running tier; the process running stores through the tier is SIGKILLed mid-job
and a fresh tier starts over the same directory. Every job is reported once, nothing hangs, and
every HIT loads its own key's bytes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import (
    CHUNK_BYTES,
    CPU_CHUNKS,
    load,
    lookup_all,
    make_manager,
    on_disk,
    page_files,
    payload,
    step,
    store,
    tier_of,
)

from aiokv.adapters.vllm import AiokvTier
from aiokv.storage import ErrorKind

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))  # the storage suite's file-system helpers
from fs_helpers import fill_up, loop_ext4, remount
from gate_helpers import gated_ext4, kill_with_a_write_held
from store_helpers import wait_for


def prefix_keys(request: int, blocks: int) -> list[bytes]:
    """vLLM-style block keys of one request: each hashes the previous one and the block's tokens
    (requests differ from their first token on)."""
    keys, last = [], b""
    for block in range(blocks):
        tokens = [request * 1000 + block * 16 + t for t in range(16)]
        last = hashlib.sha256(last + str(tokens).encode()).digest()
        keys.append(make_offload_key(last, 0))
    return keys


def seed_of(key: bytes) -> int:
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def oracle(key: bytes) -> bytes:
    return payload(seed_of(key))


def store_request(manager: TieringOffloadingManager, req: str, keys: list[bytes]) -> None:
    store(manager, req, keys, [seed_of(k) for k in keys])


def record_results(tier: AiokvTier) -> list[JobResult]:
    seen: list[JobResult] = []
    original = tier.get_finished_jobs

    def recording() -> list[JobResult]:
        results = list(original())
        seen.extend(results)
        return results

    tier.get_finished_jobs = recording  # type: ignore[method-assign]
    return seen


def evict_from_cpu(manager: TieringOffloadingManager, req: str) -> None:
    store_request(manager, req, prefix_keys(900_000 + hash(req) % 1000, CPU_CHUNKS))


def check_hits_bit_exact(manager: TieringOffloadingManager, keys: list[bytes], req: str) -> list[bool]:
    """Look ``keys`` up as the scheduler does and load every HIT: each holds its key's bytes, and a
    HIT is exactly a key with a page file. Which keys hit."""
    ctx = ReqContext(req_id=req)
    with manager.lock:
        manager.on_new_request(ctx)
    there = on_disk(manager, keys)
    found = lookup_all(manager, keys, ctx)
    assert found == [LookupResult.HIT if t else LookupResult.MISS for t in there]
    hits = [k for k, t in zip(keys, there, strict=True) if t]
    got = load(manager, hits, ctx)
    for key, data in zip(hits, got, strict=True):
        assert data == oracle(key), "a HIT loaded other bytes than its key's"
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)
    return there


@pytest.mark.root
def test_the_disk_filling_up_while_stores_run_serves_only_right_bytes(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """Another program fills the ext4 while store jobs run (its writes and the tier's race); later
    stores meet a full disk. Every job is reported once; whatever the tier holds loads bit-exact,
    the rest misses; once room comes back the tier stores and serves again."""
    with loop_ext4(tmp_path, 320, reserved_percent=0) as mount:
        manager = make_manager(mount)
        try:
            tier = tier_of(manager)
            results = record_results(tier)
            store_ids: set[int] = set()
            submit_store = tier.submit_store

            def recording_submit_store(job: TransferJob) -> None:
                store_ids.add(job.job_id)
                submit_store(job)

            tier.submit_store = recording_submit_store  # type: ignore[method-assign]
            before = prefix_keys(0, 4)
            store_request(manager, "r0", before)
            assert on_disk(manager, before) == [True] * 4
            filler = threading.Thread(target=fill_up, args=(mount / "filler", 0))
            filler.start()
            stored: list[bytes] = []
            for request in range(1, 12):
                if request == 9:  # the disk is full from here on
                    filler.join(30)
                    assert not filler.is_alive()
                keys = prefix_keys(request, 3)
                seen = len(results)
                store_request(manager, f"r{request}", keys)
                stored += keys
                # What the job told vLLM is what reached the disk: success only with every page
                # there, transfer_bytes the pages written (nothing evicted them yet: newest pages).
                (job,) = [r for r in results[seen:] if r.job_id in store_ids]
                there = on_disk(manager, keys)
                assert job.success is all(there), (request, job, there)
                assert job.transfer_bytes == CHUNK_BYTES * sum(there), (request, job, there)
            store_jobs = [r for r in results if r.job_id in store_ids]
            assert len({r.job_id for r in store_jobs}) == len(store_jobs) == 12, "a store job reported twice or never"
            stats = tier.statistics()
            assert stats["errors"] or stats["dropped"], f"the tier never met the full disk: {stats}"
            evict_from_cpu(manager, "e1")
            there = [t for group in range(0, len(stored), 3)
                     for t in check_hits_bit_exact(manager, stored[group : group + 3], f"q{group}")]
            there = check_hits_bit_exact(manager, before, "q-before") + there
            assert any(there), "nothing the tier stored survived"
            # Room comes back: the tier stores and serves again.
            (mount / "filler").unlink()
            again = prefix_keys(20, 3)
            store_request(manager, "r20", again)
            assert on_disk(manager, again) == [True] * 3, "the tier no longer stores once room came back"
            evict_from_cpu(manager, "e2")
            assert check_hits_bit_exact(manager, again, "q2") == [True] * 3
        finally:
            manager.shutdown()


@pytest.mark.root
def test_a_remount_read_only_under_a_running_tier_keeps_serving_what_it_has(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """The file system goes read-only (``mount -o remount,ro``) under a running tier: stores fail
    and are reported failed, what was stored before still loads bit-exact, nothing hangs; remounted
    read-write, the tier stores again."""
    with loop_ext4(tmp_path, 320) as mount:
        manager = make_manager(mount)
        try:
            tier = tier_of(manager)
            results = record_results(tier)
            kept = prefix_keys(0, 4)
            store_request(manager, "r0", kept)
            done = subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                pytest.skip(f"remount read-only refused under the running tier: {done.stderr.strip()}")
            try:
                refused = prefix_keys(1, 3)
                store_request(manager, "r1", refused)
                (result,) = [r for r in results if r.transfer_bytes is not None and r.job_id != results[0].job_id]
                assert (result.success, result.transfer_bytes) == (False, 0)
                assert on_disk(manager, refused) == [False] * 3
                evict_from_cpu(manager, "e1")
                assert check_hits_bit_exact(manager, kept + refused, "q1") == [True] * 4 + [False] * 3
            finally:
                remount(mount, "rw")
            # Read-only from an EROFS answer is not for good: once the file system is writable
            # again the tier takes writes (it looks every free_space_recheck_s, 1 s).
            attempt = iter(range(100, 1000))

            def stores_again() -> bool:
                request = next(attempt)
                keys = prefix_keys(request, 3)
                store_request(manager, f"r{request}", keys)
                return all(on_disk(manager, keys))

            wait_for(stores_again, "the tier stores again once the file system is writable", 10.0)
            assert tier.statistics()["read_only"] is None
            evict_from_cpu(manager, "e2")
            assert check_hits_bit_exact(manager, kept, "q2") == [True] * 4
        finally:
            manager.shutdown()


KILLED_CPU_CHUNKS = 16

_KILLED_CHILD = """
import sys
sys.path.insert(0, {helpers!r})
from pathlib import Path
import test_adv_h310_vllm_real_faults as t
from vllm.v1.kv_offload.base import ReqContext
from vllm_helpers import STEP, make_manager, payload, write_chunk
manager = make_manager(Path({root!r}), cpu_chunks=t.KILLED_CPU_CHUNKS)
t.store_request(manager, "r0", t.prefix_keys(0, 4))
print("stored", flush=True)
request = 1
while True:  # stores until killed; no drain: the jobs run while the next ones are submitted
    keys, ctx = t.prefix_keys(request, 3), ReqContext(req_id=f"r{{request}}")
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        if out is not None:  # else the CPU tier's chunks are all held by jobs still running
            for chunk, key in zip(out.store_spec.chunk_ids, keys):
                write_chunk(manager, int(chunk), payload(t.seed_of(key)))
            manager.complete_store(keys, ctx)
        manager.on_schedule_end(STEP)
        manager.on_request_finished(ctx)
    if out is not None:
        print("submitted", request, flush=True)
        request += 1
"""


@pytest.mark.slow
def test_a_tier_killed_mid_store_leaves_a_directory_a_fresh_tier_serves(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """The process storing through the tier is SIGKILLed with store jobs in flight. A fresh tier on
    the same directory (the lock went with the process) serves every completed page bit-exact, a
    page cut short by the kill misses, never other bytes; it stores again, and leaves no temporary
    file of the dead process behind."""
    script = _KILLED_CHILD.format(helpers=str(Path(__file__).parent), root=str(tmp_path))
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "stored", line + (proc.stderr.read() if proc.poll() is not None else "")
            submitted = 0
            while submitted < 6:  # several jobs submitted, the last ones in flight
                line = proc.stdout.readline()
                assert line.startswith("submitted"), line
                submitted = int(line.split()[1])
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    managers.append(manager := make_manager(tmp_path, cpu_chunks=KILLED_CPU_CHUNKS))
    tier = tier_of(manager)
    first = prefix_keys(0, 4)
    # Requests the child may have begun (it can run ahead of our last read line).
    later = [k for request in range(1, submitted + 4) for k in prefix_keys(request, 3)]
    assert check_hits_bit_exact(manager, first, "q0") == [True] * 4
    there = check_hits_bit_exact(manager, later, "q1")
    assert any(there), "no page of the jobs the child submitted survived"
    again = prefix_keys(50, 3)
    store_request(manager, "r50", again)
    assert on_disk(manager, again) == [True] * 3
    assert tier.statistics()["read_only"] is None
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith(".") and p.name != ".lock"]
    assert leftovers == [], f"temporary files of the killed process left: {leftovers}"
    assert page_files(tmp_path)


@pytest.mark.root
@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
def test_reads_failing_with_eio_at_the_device_then_healing(
        tmp_path: Path, managers: list[TieringOffloadingManager], zero_copy: bool) -> None:
    """The disk under the ext4 fails every read with EIO (the FUSE gate under its loop device) while
    vLLM promotes pages it was told were there: the promotion fails, its keys become MISS, the EIO
    is counted, and no chunk outside the job changes (through staging not even the job's). Once the
    disk reads again, the same pages load their own bytes (kept: an EIO is no corruption) and the
    tier stores again."""
    with gated_ext4(tmp_path, 320) as (mount, gate):
        manager = make_manager(mount, options={"zero_copy": zero_copy})
        try:
            tier = tier_of(manager)
            results = record_results(tier)
            loads: list[TransferJob] = []
            submit_load = tier.submit_load

            def recording_submit_load(job: TransferJob) -> None:
                loads.append(job)
                submit_load(job)

            tier.submit_load = recording_submit_load  # type: ignore[method-assign]
            keys = prefix_keys(0, 3)
            store_request(manager, "r0", keys)
            evict_from_cpu(manager, "e0")
            ctx = ReqContext(req_id="q0")
            with manager.lock:
                manager.on_new_request(ctx)
                assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
            step(manager)
            with manager.lock:  # vLLM reserves CPU chunks for the promotion
                assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
            gate.fail_reads()
            before = region(manager)
            seen = len(results)
            step(manager)  # submit_load, drained: the reads fail at the device
            gate.heal()
            with manager.lock:
                assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
                manager.on_request_finished(ctx)
            (job,) = loads
            (result,) = [r for r in results[seen:] if r.job_id == job.job_id]
            assert result.success is False
            targets = {int(c) for c in job.chunk_ids}
            changed = {i for i, (a, b) in enumerate(zip(before, region(manager), strict=True)) if a != b}
            assert changed <= (targets if zero_copy else set()), "a chunk outside the job changed"
            assert tier.statistics()["errors"][ErrorKind.EIO] >= 1
            step(manager)
            # An EIO is no corruption: the files are kept and serve their bytes once the disk reads.
            assert check_hits_bit_exact(manager, keys, "q1") == [True] * 3
            assert tier.statistics()["corrupt"] == 0
            again = prefix_keys(1, 3)
            store_request(manager, "r1", again)
            assert on_disk(manager, again) == [True] * 3
            evict_from_cpu(manager, "e1")
            assert check_hits_bit_exact(manager, again, "q2") == [True] * 3
        finally:
            gate.heal()
            manager.shutdown()


def region(manager: TieringOffloadingManager) -> list[bytes]:
    with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
        data = bytes(flat)
    return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


_KILLED_HELD_CHILD = """
import sys
sys.path.insert(0, {helpers!r})
from pathlib import Path
import test_adv_h310_vllm_real_faults as t
from vllm_helpers import STEP, complete_stores, make_manager
manager = make_manager(Path({root!r}))
t.store_request(manager, "r0", t.prefix_keys(0, 4))
keys = t.prefix_keys(1, 3)
print("ready", flush=True)
sys.stdin.readline()
complete_stores(manager, "r1", keys, [t.seed_of(k) for k in keys])
with manager.lock:
    manager.on_schedule_end(STEP)  # the store job reaches the tier; its writes are held at the device
sys.stdin.readline()
"""


@pytest.mark.root
@pytest.mark.slow
def test_a_tier_killed_with_its_writes_held_at_the_device(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """The process storing through vLLM's tier is SIGKILLed while the store job's page writes are
    held in the kernel (the FUSE gate under the ext4's loop device), then the writes are let
    through. A fresh tier on the directory writes, serves the pages stored before bit-exact, finds
    nothing of the cut job (or only its keys' own bytes), and removes the temporary files left."""
    with gated_ext4(tmp_path, 320) as (mount, gate):
        try:
            script = _KILLED_HELD_CHILD.format(helpers=str(Path(__file__).parent), root=str(mount))
            kill_with_a_write_held(script, gate)
            managers.append(manager := make_manager(mount))
            tier = tier_of(manager)
            assert check_hits_bit_exact(manager, prefix_keys(0, 4), "q0") == [True] * 4
            check_hits_bit_exact(manager, prefix_keys(1, 3), "q1")
            again = prefix_keys(2, 3)
            store_request(manager, "r2", again)
            assert on_disk(manager, again) == [True] * 3
            stats = tier.statistics()
            assert stats["read_only"] is None
            assert stats["temp_files_removed"] >= 1  # the held writes' temporary files, left by the kill
            assert list(mount.rglob(".tmp-*")) == [], "temporary files of the killed process left"
        finally:
            gate.release()
            for manager in managers:
                manager.shutdown()
            managers.clear()
