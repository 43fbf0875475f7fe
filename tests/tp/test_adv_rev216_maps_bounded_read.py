"""Review 216: ``clean --legacy``'s mapping check read each ``/proc/<pid>/maps`` whole.

``aiokv.reclaim._mapped_anywhere`` (a LEGACY segment is removed only when no process maps it) did
``needle in f.read()`` on every process's maps file: a process with tens of thousands of mappings
has a maps file of megabytes, all held at once. It now reads in bounded chunks (a needle cut by a
chunk's end still found). Tests: a real process with 15,000 mappings of a long-named file (a
maps file of megabytes): the check's peak allocation stays well under that file's size, and it
still finds the segment that process maps after them; and a planted file with the needle across
chunk ends and at the very end.
"""

from __future__ import annotations

import secrets
import select
import subprocess
import sys
import tracemalloc
from pathlib import Path

from aiokv import reclaim
from aiokv.shm import SHM_DIR

_CHILD = r"""
import mmap, os, sys
filler, segment, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(filler, os.O_RDONLY)
keep = [mmap.mmap(fd, 4096, prot=mmap.PROT_READ, offset=0) for _ in range(count)]
sfd = os.open(segment, os.O_RDONLY)
seg = mmap.mmap(sfd, 4096, prot=mmap.PROT_READ)
os.close(fd); os.close(sfd)
print(os.getpid(), flush=True)
sys.stdin.read()  # hold the mappings until the test closes our stdin
"""


def test_the_mapping_check_reads_a_huge_maps_file_in_bounded_memory(tmp_path: Path) -> None:
    filler = tmp_path / ("f" * 200)  # a long name: ~280 bytes a maps line
    filler.write_bytes(b"\0" * 4096)
    name = f"aiokvt216{secrets.token_hex(4)}-1-{secrets.token_hex(8)}"
    segment = Path(SHM_DIR) / name
    segment.write_bytes(b"\0" * 4096)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(filler), str(segment), "15000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        ready, _, _ = select.select([child.stdout], [], [], 60.0)
        assert ready, "the child did not map its files within 60 s"
        pid = int(child.stdout.readline())
        with open(f"/proc/{pid}/maps", "rb") as f:
            size = len(f.read())  # the test's own whole read, before tracing
        assert size > 3 * 2**20, f"the child's maps file is only {size} bytes: no power"
        segment_name = segment.name
        tracemalloc.start()
        try:
            found = reclaim._mapped_anywhere(segment_name)
            tracemalloc.reset_peak()
            absent = reclaim._mapped_anywhere(f"aiokvt216-none-{secrets.token_hex(8)}")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert found, "the segment the child maps (after 15,000 other mappings) was not found"
        assert not absent, "a name no process maps was found mapped"
        assert peak < size // 4, (
            f"the check allocated {peak} bytes at its peak for a {size}-byte maps file: "
            "it read the file whole"
        )
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
        segment.unlink(missing_ok=True)


def test_a_needle_across_chunk_ends_or_at_the_end_is_found(tmp_path: Path) -> None:
    needle = b"/dev/shm/aiokv-1234-5678-0123456789abcdef"
    chunk = reclaim._MAPS_CHUNK
    for at in (0, chunk - 1, chunk - len(needle) // 2, chunk, 3 * chunk - len(needle)):
        planted = tmp_path / f"maps{at}"
        body = bytearray(b"x" * (3 * chunk))
        body[at:at + len(needle)] = needle
        planted.write_bytes(bytes(body))
        assert reclaim._file_contains(str(planted), needle), f"needle at {at} not found"
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * (3 * chunk) + needle[:-1])  # all but the last byte: not there
    assert not reclaim._file_contains(str(plain), needle)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert not reclaim._file_contains(str(empty), needle)
