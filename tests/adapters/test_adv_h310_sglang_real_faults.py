"""SGLang's backend under real faults between its lookup and its prefetch (helper 310).

SGLang's cache controller asks ``batch_exists`` (v2: ``batch_exists_v2``) for the prefix, then
prefetches it with ``batch_get_v1``/``batch_get_v2`` on another thread. Between the two the page
files are damaged behind the backend's back: a byte flipped, cut after the header, removed by
another process (``rm`` of the files or of whole fan-out directories), replaced by another key's
intact file. Each page's bytes are a function of its key, and each key a hash of the whole token
prefix before it (a prefix oracle): whatever a later load reports True holds exactly its key's
bytes, no host page outside the load's targets changes, a damaged page is a counted miss, and the
backend stores and serves again afterwards. Two SGLang processes with different host layouts on
one ``disk_dir`` each read back their own bytes only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang_helpers import (
    attach,
    attach_hybrid,
    fill,
    fill_state,
    host_pool,
    indices,
    mamba_pool,
    page,
    state,
)

from aiokv.adapters.sglang import AiokvHiCacheStorage
from aiokv.storage import ErrorKind

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))  # the storage suite's file-system helpers
from gate_helpers import gated_ext4, kill_with_a_write_held

HEADER = 4096  # a page file's header; the payload follows


def prefix_keys(tokens: list[int], page_tokens: int = 4) -> list[str]:
    """SGLang-style page keys: each page's key hashes the previous key and the page's tokens, so a
    key names its whole prefix."""
    keys, last = [], b""
    for start in range(0, len(tokens), page_tokens):
        last = hashlib.sha256(last + bytes(str(tokens[start : start + page_tokens]), "ascii")).digest()
        keys.append(last.hex())
    return keys


def seed_of(key: str) -> int:
    return int(key[:8], 16)


def oracle(key: str, layout: str = "page_first") -> torch.Tensor:
    """The bytes of ``key``'s page: a function of the key (so of its whole prefix)."""
    ref = host_pool(1, layout)
    fill(ref, 0, seed_of(key))
    return page(ref, 0)


def file_of(backend: AiokvHiCacheStorage, key: str, pool: str = "kv") -> Path:
    store = backend._pools[pool].store
    assert store is not None
    name = store.key(key.encode("utf-8")).hex()
    (path,) = [p for p in store.directory.rglob(name) if p.is_file()]
    return path


def flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate(path: Path) -> None:
    os.truncate(path, HEADER + 100)


def removed_by_another_process(*paths: Path) -> None:
    subprocess.run(["rm", "-rf", "--", *map(str, paths)], check=True)


def replaced_by_another_writer(path: Path, other: Path) -> None:
    """Another writer puts an intact page file of another key at ``path`` (copy, then rename)."""
    temp = path.with_name(path.name + ".planted")
    shutil.copyfile(other, temp)
    os.replace(temp, path)


def pages(pool: Any, count: int) -> list[torch.Tensor]:
    return [page(pool, p) for p in range(count)]


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_pages_damaged_between_lookup_and_prefetch_miss_and_nothing_else_moves(
        tmp_path: Path, backends: list[Any], layout: str, zero_copy: bool) -> None:
    keys = prefix_keys(list(range(32)))  # 8 pages
    pool = host_pool(20, layout)
    for p, key in enumerate(keys):
        fill(pool, p, seed_of(key))
    backend = attach(backends, tmp_path, pool, True, page_first=layout == "page_first",
                     options={"zero_copy": zero_copy})
    assert backend.batch_set_v1(keys, indices(list(range(8)))) == [True] * 8
    assert backend.batch_exists(keys) == 8  # SGLang's lookup: the whole prefix
    files = [file_of(backend, k) for k in keys]
    first_file = files[0].read_bytes()
    flip(files[1])
    truncate(files[2])
    removed_by_another_process(files[3])
    replaced_by_another_writer(files[4], files[0])  # a valid file, of another key
    files[5].unlink()
    os.mkfifo(files[5], 0o600)  # a FIFO planted: never opened blocking
    files[6].unlink()
    files[6].symlink_to(files[0])  # a link to a valid file: never followed
    before = pages(pool, 20)
    targets = list(range(10, 18))
    got = backend.batch_get_v1(keys, indices(targets))
    after = pages(pool, 20)
    assert got == [True, False, False, False, False, False, False, True]
    for p, key, ok in zip(targets, keys, got, strict=True):
        if ok:
            assert torch.equal(after[p], oracle(key, layout)), f"page {p} holds other bytes than its key's"
    allowed = set(targets) if zero_copy else {p for p, ok in zip(targets, got, strict=True) if ok}
    changed = {p for p in range(20) if not torch.equal(before[p], after[p])}
    assert changed <= allowed, f"host pages outside the prefetch's own changed: {sorted(changed - allowed)}"
    stats = backend.statistics()
    assert stats["corrupt"] >= 3  # flipped, truncated, another key's header
    assert files[0].read_bytes() == first_file, "the file a planted link led to changed"
    # The damaged keys are misses now; the backend stores them again and serves them bit-exact.
    assert backend.batch_exists(keys) == 1
    assert backend.batch_set_v1(keys[1:7], indices([1, 2, 3, 4, 5, 6])) == [True] * 6
    assert backend.batch_exists(keys) == 8
    assert backend.batch_get_v1(keys, indices(targets)) == [True] * 8
    for p, key in zip(targets, keys, strict=True):
        assert torch.equal(page(pool, p), oracle(key, layout))


@pytest.mark.parametrize("what", ["files", "fan-out directories", "layout directory"])
def test_a_backup_removed_by_another_process_before_the_prefetch_misses_then_stores_again(
        tmp_path: Path, backends: list[Any], what: str) -> None:
    """``batch_set_v1`` (SGLang's backup) stored the pages; another process removes them (the files,
    their fan-out directories, or the whole layout directory with its lock file) before the
    prefetch. The prefetch misses every page, changes no host page outside its targets, and the
    backend backs the pages up again and serves them."""
    keys = prefix_keys(list(range(16)))  # 4 pages
    pool = host_pool(12)
    for p, key in enumerate(keys):
        fill(pool, p, seed_of(key))
    backend = attach(backends, tmp_path, pool, True)
    assert backend.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    assert backend.batch_exists(keys) == 4
    files = [file_of(backend, k) for k in keys]
    layout_dir = files[0].parent.parent
    if what == "files":
        removed_by_another_process(*files)
    elif what == "fan-out directories":
        removed_by_another_process(*{f.parent for f in files})
    else:
        removed_by_another_process(layout_dir)
    before = pages(pool, 12)
    assert backend.batch_get_v1(keys, indices([4, 5, 6, 7])) == [False] * 4
    changed = {p for p in range(12) if not torch.equal(before[p], page(pool, p))}
    assert changed <= {4, 5, 6, 7}
    assert backend.batch_exists(keys) == 0
    # Backed up again: stored where the tier can still write, served bit-exact where stored.
    stored = backend.batch_set_v1(keys, indices([0, 1, 2, 3]))
    if what != "layout directory":
        assert stored == [True] * 4, "the backend no longer stores after another process removed its files"
    elif stored != [True] * 4:  # its directory is gone (the tier works through its descriptor): counted
        assert sum(backend.statistics()["errors"].values()) >= stored.count(False)
    found = backend.batch_exists(keys)
    assert found == [*stored, False].index(False)
    got = backend.batch_get_v1(keys, indices([8, 9, 10, 11]))
    assert got == stored
    for p, key, ok in zip(range(8, 12), keys, got, strict=True):
        if ok:
            assert torch.equal(page(pool, p), oracle(key))


def test_v2_state_and_kv_damaged_between_lookup_and_prefetch(tmp_path: Path, backends: list[Any]) -> None:
    """A hybrid model's prefetch (``batch_get_v2``, KV and Mamba state in one call) after
    ``batch_exists_v2`` said the prefix is there, the state file cut and a KV file replaced by
    another key's in between: those keys miss, the others arrive bit-exact, no other slot moves."""
    keys = prefix_keys(list(range(12)))  # 3 pages
    kv, mamba = host_pool(8), mamba_pool(8)
    for p, key in enumerate(keys):
        fill(kv, p, seed_of(key))
        fill_state(mamba, p, seed_of(key) + 1)
    states = [state(mamba, p) for p in range(3)]
    backend = attach_hybrid(backends, tmp_path, kv, {PoolName.MAMBA: mamba})
    assert backend.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 1, 2]),
                                              keys=keys)]) == {"mamba": [True] * 3}
    found = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys)])
    assert found.kv_hit_pages == 3
    truncate(file_of(backend, keys[1], "mamba"))
    replaced_by_another_writer(file_of(backend, keys[2]), file_of(backend, keys[0]))
    kv_before, mamba_before = pages(kv, 8), [state(mamba, s) for s in range(8)]
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([4, 5, 6]), keys=keys),
                                PoolTransfer(name=PoolName.KV, host_indices=indices([4, 5, 6]), keys=keys)])
    assert got == {"mamba": [True, False, True], "kv": [True, True, False]}
    assert torch.equal(state(mamba, 4), states[0]) and torch.equal(state(mamba, 6), states[2])
    assert torch.equal(page(kv, 4), oracle(keys[0])) and torch.equal(page(kv, 5), oracle(keys[1]))
    kv_changed = {p for p in range(8) if not torch.equal(kv_before[p], page(kv, p))}
    mamba_changed = {s for s in range(8) if not torch.equal(mamba_before[s], state(mamba, s))}
    assert kv_changed <= {4, 5, 6} and mamba_changed <= {4, 5, 6}
    assert backend.statistics()["corrupt"] >= 1 and backend.statistics("mamba")["corrupt"] >= 1


_OTHER_PROCESS = """
import sys
sys.path.insert(0, {helpers!r})
from pathlib import Path
import test_adv_h310_sglang_real_faults as t
from sglang_helpers import attach, fill, host_pool, indices, page
import torch
made = []
pool = host_pool(8, "layer_first")
keys = t.prefix_keys(list(range(16)))
for p, key in enumerate(keys):
    fill(pool, p, t.seed_of(key) + 1000)
backend = attach(made, Path({root!r}), pool, True, page_first=False)
print("stored", backend.batch_set_v1(keys, indices([0, 1, 2, 3])), backend.statistics()["read_only"], flush=True)
sys.stdin.readline()
got = backend.batch_get_v1(keys, indices([4, 5, 6, 7]))
same = all(torch.equal(page(pool, 4 + p), page(pool, p)) for p in range(4))
print("read", got, same, flush=True)
backend.close()
"""


@pytest.mark.slow
def test_two_processes_with_other_layouts_on_one_directory_read_their_own_bytes(
        tmp_path: Path, backends: list[Any]) -> None:
    """Another SGLang process (``layer_first`` host pool) and this one (``page_first``) back the same
    keys up into one ``disk_dir``, with other bytes: each reads back its own, both write (neither
    runs read-only), and a later ``layer_first`` backend here reads the other process's bytes."""
    keys = prefix_keys(list(range(16)))
    script = _OTHER_PROCESS.format(helpers=str(Path(__file__).parent), root=str(tmp_path))
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line.strip() == "stored [True, True, True, True] None", line + (proc.stderr.read() if
                                                                                   proc.poll() is not None else "")
            pool = host_pool(8)
            for p, key in enumerate(keys):
                fill(pool, p, seed_of(key))
            backend = attach(backends, tmp_path, pool, True)
            assert backend.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
            assert backend.statistics()["read_only"] is None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "read [True, True, True, True] True"
            assert proc.wait(60) == 0
            assert backend.batch_get_v1(keys, indices([4, 5, 6, 7])) == [True] * 4
            for p, key in enumerate(keys):
                assert torch.equal(page(pool, 4 + p), oracle(key))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    other_pool = host_pool(8, "layer_first")
    other = attach(backends, tmp_path, other_pool, True, page_first=False)
    assert other.batch_get_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    for p, key in enumerate(keys):
        ref = host_pool(1, "layer_first")
        fill(ref, 0, seed_of(key) + 1000)
        assert torch.equal(page(other_pool, p), page(ref, 0))


@pytest.mark.root
@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
def test_prefetch_over_reads_failing_with_eio_then_healing(
        tmp_path: Path, backends: list[Any], zero_copy: bool) -> None:
    """The disk under the ext4 fails every read with EIO (the FUSE gate under its loop device)
    between SGLang's lookup and its prefetch: the prefetch misses every page, the EIO is counted, no
    host page outside its targets changes (staged: not even those). Healed, the same pages are
    still there (an EIO is no corruption) and load bit-exact."""
    keys = prefix_keys(list(range(12)))  # 3 pages
    with gated_ext4(tmp_path, 320) as (mount, gate):
        try:
            pool = host_pool(8)
            for p, key in enumerate(keys):
                fill(pool, p, seed_of(key))
            backend = attach(backends, mount / "kv", pool, True, options={"zero_copy": zero_copy})
            assert backend.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
            assert backend.batch_exists(keys) == 3
            gate.fail_reads()
            before = pages(pool, 8)
            assert backend.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3
            gate.heal()
            changed = {p for p in range(8) if not torch.equal(before[p], page(pool, p))}
            assert changed <= ({4, 5, 6} if zero_copy else set())
            stats = backend.statistics()
            assert stats["errors"][ErrorKind.EIO] >= 1 and stats["corrupt"] == 0
            assert backend.batch_exists(keys) == 3
            assert backend.batch_get_v1(keys, indices([4, 5, 6])) == [True] * 3
            for p, key in zip((4, 5, 6), keys, strict=True):
                assert torch.equal(page(pool, p), oracle(key))
        finally:
            gate.heal()
            for backend in backends:
                backend.close()
            backends.clear()


_KILLED_BACKUP = """
import sys
sys.path.insert(0, {helpers!r})
from pathlib import Path
import test_adv_h310_sglang_real_faults as t
from sglang_helpers import attach, fill, host_pool, indices
made = []
pool = host_pool(8)
backend = attach(made, Path({root!r}), pool, True)
request = 0
while True:  # backs requests up until killed
    keys = t.prefix_keys([request * 1000 + i for i in range(16)])
    for p, key in enumerate(keys):
        fill(pool, p, t.seed_of(key))
    print("storing", request, flush=True)  # the kill lands in (or right before) this backup
    assert backend.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    request += 1
"""


@pytest.mark.slow
def test_a_backend_killed_mid_backup_leaves_a_directory_a_fresh_backend_serves(
        tmp_path: Path, backends: list[Any]) -> None:
    """The SGLang process backing pages up is SIGKILLed mid-``batch_set_v1``. A fresh backend on the
    same directory writes (the lock went with the process), finds every page reported stored and
    loads it bit-exact, a page cut short misses (never other bytes), stores again, and leaves no
    temporary file of the dead process."""
    script = _KILLED_BACKUP.format(helpers=str(Path(__file__).parent), root=str(tmp_path))
    reported = 0
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None
            while reported < 5:  # requests before the one announced returned all True
                line = proc.stdout.readline()
                assert line.startswith("storing"), line + (proc.stderr.read() if proc.poll() is not None else "")
                reported = int(line.split()[1])
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    pool = host_pool(8)
    backend = attach(backends, tmp_path, pool, True)
    for request in range(reported + 3):  # it may have run ahead of the last line read
        keys = prefix_keys([request * 1000 + i for i in range(16)])
        found = backend.batch_exists(keys)
        if request < reported:
            assert found == 4, f"request {request}, reported stored, is gone"
        got = backend.batch_get_v1(keys, indices([4, 5, 6, 7]))
        assert got[:found] == [True] * found
        for p, key, ok in zip((4, 5, 6, 7), keys, got, strict=True):
            if ok:
                assert torch.equal(page(pool, p), oracle(key)), f"request {request}: other bytes than its key's"
    again = prefix_keys([-1 - i for i in range(16)])
    for p, key in enumerate(again):
        fill(pool, p, seed_of(key))
    assert backend.batch_set_v1(again, indices([0, 1, 2, 3])) == [True] * 4
    assert backend.statistics()["read_only"] is None
    leftovers = list(tmp_path.rglob(".tmp-*"))
    assert leftovers == [], f"temporary files of the killed process left: {leftovers}"


_KILLED_HELD_BACKUP = """
import sys
sys.path.insert(0, {helpers!r})
from pathlib import Path
import test_adv_h310_sglang_real_faults as t
from sglang_helpers import attach, fill, host_pool, indices
made = []
pool = host_pool(8)
backend = attach(made, Path({root!r}), pool, True)
for request in range(3):
    keys = t.prefix_keys([request * 1000 + i for i in range(16)])
    for p, key in enumerate(keys):
        fill(pool, p, t.seed_of(key))
    assert backend.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
keys = t.prefix_keys([3000 + i for i in range(16)])
for p, key in enumerate(keys):
    fill(pool, p, t.seed_of(key))
print("ready", flush=True)
sys.stdin.readline()
backend.batch_set_v1(keys, indices([0, 1, 2, 3]))  # its writes are held at the device: killed here
print("not killed", flush=True)
"""


@pytest.mark.root
@pytest.mark.slow
def test_a_backend_killed_with_its_writes_held_at_the_device(tmp_path: Path, backends: list[Any]) -> None:
    """The SGLang process is SIGKILLed while its backup's page writes are held in the kernel (the
    FUSE gate under the ext4's loop device holds them), then the writes are let through. A fresh
    backend on the directory writes, loads every page stored before bit-exact, and whatever it
    finds of the killed backup holds that key's bytes (the rest misses); no temporary file is left."""
    with gated_ext4(tmp_path, 320) as (mount, gate):
        try:
            script = _KILLED_HELD_BACKUP.format(helpers=str(Path(__file__).parent), root=str(mount / "kv"))
            kill_with_a_write_held(script, gate)
            pool = host_pool(8)
            backend = attach(backends, mount / "kv", pool, True)
            for request in range(4):
                keys = prefix_keys([request * 1000 + i for i in range(16)])
                found = backend.batch_exists(keys)
                if request < 3:
                    assert found == 4, f"request {request}, stored before the kill, is gone"
                got = backend.batch_get_v1(keys, indices([4, 5, 6, 7]))
                assert got[:found] == [True] * found
                for p, key, ok in zip((4, 5, 6, 7), keys, got, strict=True):
                    if ok:
                        assert torch.equal(page(pool, p), oracle(key)), f"request {request}: other bytes"
            again = prefix_keys([-1 - i for i in range(16)])
            for p, key in enumerate(again):
                fill(pool, p, seed_of(key))
            assert backend.batch_set_v1(again, indices([0, 1, 2, 3])) == [True] * 4
            stats = backend.statistics()
            assert stats["read_only"] is None
            assert stats["temp_files_removed"] >= 1  # the held writes' temporary files, left by the kill
            assert list((mount / "kv").rglob(".tmp-*")) == [], "temporary files of the killed process left"
        finally:
            gate.release()
            for backend in backends:
                backend.close()
            backends.clear()
