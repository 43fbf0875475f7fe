"""Review 289: page files are opened for reading with ``O_NOATIME`` (``safefiles.READ_FLAGS``),
which needs the file's owner or CAP_FOWNER. A tier that runs unprivileged meets a page file of
another owner at the open itself (EPERM), not at its ``fstat`` check as a privileged tier does: a
path the suite, running as root, never took. Here a child process runs the tier as ``nobody``
(no capabilities) over a cache directory it owns; while it runs, one of its indexed page files is
given to another uid (its content still the page's, readable by anyone, its access time older
than its modification time so that any read would move it). Each read of that page must be a
miss, never a crash, and nothing may read the file by another way (no fallback open without
``O_NOATIME``): the caller's buffer stays as it was and the file's access time does not move. The
other page is served. The open's EPERM is counted as what the privileged tier's ``fstat`` check
says, UNSAFE, and the key leaves the index (its name unlinked, as any planted name): before, it
was counted EPERM and stayed indexed, each read of it a fault again. Every backend.

Review 296: the ring's checked open (``UringPageIO._open_then_read``: an OPENAT through the ring,
then the ``fstat`` check), which a cold read takes where it cannot be one chain from its open —
into a caller's buffer that is not aligned, or a tier without ``O_DIRECT`` — had the same handling
but no test: driven here too, and the test checks that path was taken."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import BACKENDS, config, fill, key_of, payload, reserve, small_layout

from aiokv.storage import DiskBackend
from aiokv.storage.backends import UringPageIO

NOBODY = 65534
OTHER_UID = 12345
TAG = 0x8A
OURS, FOREIGN = key_of(0, TAG), key_of(1, TAG)
CHILD_S = 120.0
READS = 2


def _cap_eff() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapEff in /proc/self/status")


HOW = ("pool", "unaligned", "buffered")
"""How the child reads: into a pool page (aligned), into a caller's buffer one byte off alignment
(``read_into``), or into a pool page with ``direct_io`` off. Both of the latter, cold, go the ring's
checked way (no chain: it needs ``O_DIRECT`` and an aligned buffer)."""


async def _child_main(directory: str, backend: str, cold: bool, how: str = "pool") -> dict[str, object]:
    import torch

    from aiokv.pool import PagePool
    from aiokv.storage import DiskTier

    layout = small_layout()
    pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()

    async def read(tier: DiskTier, key: bytes) -> tuple[bool, torch.Tensor]:
        """Into a pool page (aligned: a cold read may be one chain), or a buffer one byte off
        alignment (``how``), first filled with 0x5a."""
        if how == "unaligned":
            buf = bytearray(b"\x5a" * (layout.page_bytes + 1))
            ok = await tier.read_into(key, memoryview(buf)[1:])
            return ok, torch.frombuffer(buf[1:1 + layout.payload_bytes], dtype=torch.uint8)
        into = reserve(pool, key)
        try:
            pool.memory.page_view(pool.table.check(into))[:] = b"\x5a" * layout.page_bytes
            ok = await tier.read(key, into)
            return ok, payload(pool, into)
        finally:
            pool.table.abort(into)

    try:
        overrides = {"direct_io": False} if how == "buffered" else {}
        tier = DiskTier(config(Path(directory), DiskBackend(backend), **overrides), layout, pool)
        await tier.start()
        checked_opens: list[str] = []  # the names the ring's checked way opened
        try:
            await tier.wait_registered()
            if cold:  # every read through the ring: a chain from its open (O_DIRECT, aligned pages)
                io = tier.backend
                assert isinstance(io, UringPageIO) and io.direct == (how != "buffered") and io.chain_reads
                io._cached.available = False
                checked = io._open_then_read

                def counted(dir_fd: int, name: str, *rest: Any) -> None:  # noted, then run as it is
                    checked_opens.append(name)
                    checked(dir_fd, name, *rest)

                io._open_then_read = counted  # type: ignore[method-assign]
            written = {}
            for i, key in enumerate((OURS, FOREIGN)):
                held = fill(pool, key, i)
                written[key] = payload(pool, held)
                try:
                    assert await tier.write(key, held)
                finally:
                    pool.table.release(held)
                pool.table.evict(pool.num_pages)
            print(json.dumps({"foreign": tier.files.path(FOREIGN)}), flush=True)
            assert sys.stdin.readline().strip() == "go"
            before = tier.statistics()
            foreign_reads = []
            for _ in range(READS):
                ok, got = await read(tier, FOREIGN)
                foreign_reads.append([ok, bool((got == 0x5A).all())])
            ok, got = await read(tier, OURS)
            ours = ok and torch.equal(got, written[OURS])
            after = tier.statistics()
            return {"foreign_reads": foreign_reads, "ours": ours, "misses": after.misses - before.misses,
                    "errors": {kind.value: after.errors[kind] - before.errors.get(kind, 0) for kind in after.errors},
                    "contains": tier.contains(FOREIGN), "backend": after.backend.value,
                    "checked_opens": checked_opens, "names": [FOREIGN.hex(), OURS.hex()]}
        finally:
            await tier.aclose()
    finally:
        pool.close()


def child(directory: str, backend: str, cold: bool, how: str = "pool") -> None:
    """The tier as ``nobody``: imports first (as root), then every privilege dropped."""
    import aiokv.storage.backends
    import aiokv.storage.uring  # noqa: F401  (loaded before the privileges go)

    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    assert os.geteuid() == NOBODY and _cap_eff() == 0, "privileges not dropped"
    print(json.dumps({"result": asyncio.run(_child_main(directory, backend, cold, how))}), flush=True)


CASES = ([(backend, False, "pool") for backend in BACKENDS] + [(DiskBackend.URING, True, "pool")]
         + [(backend, True, how) for backend in (DiskBackend.URING, DiskBackend.URING_FIXED)
            for how in HOW[1:]])


@pytest.mark.root
@pytest.mark.parametrize(("backend", "cold", "how"), CASES,
                         ids=[b.value + ("-cold" if c else "") + ("" if h == "pool" else f"-{h}") for b, c, h in CASES])
def test_an_unprivileged_tier_misses_a_page_file_of_another_owner_and_reads_nothing(backend: DiskBackend,
                                                                                    cold: bool, how: str) -> None:
    """``cold``: the name's open on the loop (``openat2`` where the kernel has it cached) turned
    off: the read opens it through the ring, in a chain from its open (``how`` "pool"), or the
    checked way (an OPENAT, then the ``fstat`` check: "unaligned", "buffered"; review 296)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the child drops to nobody, and the test gives a file to another uid")
    top = Path(tempfile.mkdtemp(prefix="aiokv-unprivileged-"))  # /tmp's: reachable by nobody
    try:
        os.chown(top, NOBODY, NOBODY)
        here = Path(__file__).parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent),
                                                            os.environ.get("PYTHONPATH", "")]))
        code = (f"import {Path(__file__).stem} as t; "
                f"t.child({str(top / 'cache')!r}, {backend.value!r}, {cold!r}, {how!r})")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=top)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            if not line:
                _, err = proc.communicate(timeout=CHILD_S)
                raise AssertionError(f"the child ended before writing its pages: {err[-3000:]}")
            foreign = Path(json.loads(line)["foreign"])
            content = foreign.read_bytes()
            os.chown(foreign, OTHER_UID, OTHER_UID)  # another owner's file, readable by anyone
            os.chmod(foreign, 0o644)
            st = foreign.stat()
            os.utime(foreign, ns=(st.st_mtime_ns - 10**9, st.st_mtime_ns))  # any read moves it (relatime)
            kept = top / "kept"  # the file itself, whatever the tier does with its name
            os.link(foreign, kept)
            before = kept.stat()
            out, err = proc.communicate("go\n", timeout=CHILD_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        assert proc.returncode == 0, f"the child failed (rc {proc.returncode}): {err[-3000:]}"
        result = json.loads(out.strip().splitlines()[-1])["result"]
        assert result["ours"], f"the tier's own page was not served: {result}"
        assert result["foreign_reads"] == [[False, True]] * READS, \
            f"a page file of another owner was served, or its bytes read into the buffer: {result}"
        assert result["misses"] == READS, result
        # Not ours, as the fstat check says where the open works: counted UNSAFE and out of the
        # index (before: counted EPERM, left indexed, each read of it a fault again).
        assert result["errors"]["unsafe"] == 1 and result["errors"]["eperm"] == 0, result
        assert not result["contains"], result
        if how != "pool":  # the ring's checked open met the file (once: then out of the index), and ours
            assert sorted(result["checked_opens"]) == sorted(result["names"]), result
        after = kept.stat()
        assert (after.st_uid, after.st_atime_ns) == (OTHER_UID, before.st_atime_ns), \
            "the file of another owner was read (its access time moved) or changed hands"
        assert kept.read_bytes() == content  # (after the access time was checked)
    finally:
        shutil.rmtree(top, ignore_errors=True)
