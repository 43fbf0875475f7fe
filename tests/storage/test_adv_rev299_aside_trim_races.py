"""Review 299: the trim of the names set aside (``.deletes.planted-*``, :func:`_trim_aside`) races
whoever planted them. A thread of the planter's swaps, as fast as it can, each entry within the old
directories set aside between a file, a symlink to a directory outside, a hard link to a file
outside and a directory (empty, or holding a file), and each old name set aside itself between a
directory and a symlink to the outside directory, while two trims (two threads: a start's and a
take-over's, as at a take-over) run over and over. Nothing outside the cache directory may change,
nothing but ``.deletes.planted-*`` names may go from it, and every fault must come back counted
(an ``OSError`` in the list), never raised."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path

from planted_helpers import snapshot

from aiokv.storage import deletelog
from aiokv.storage.deletelog import PLANTED_KEPT, PLANTED_PREFIX

ROUNDS = 60
OLD = 6  # old names set aside per round, beyond the PLANTED_KEPT newest


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "target").write_bytes(b"not ours")
    (outside / "sub" / "deep").write_bytes(b"not ours either")
    return outside


_LIBC = ctypes.CDLL(None, use_errno=True)


def _exchange(dir_fd: int, a: str, b: str) -> None:
    """``renameat2(RENAME_EXCHANGE)``: the two names swap atomically (never missing)."""
    if _LIBC.renameat2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), 2) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a)


def _entry(fd: int, outside: Path, kind: int, tmp: str) -> None:
    """Put an entry of ``kind`` at ``e`` in the directory ``fd`` (by names in it only: the planter
    itself never writes outside): a symlink to outside, a hard link to a file outside, an empty
    directory, a directory holding a file; exchanged with what is there, else renamed there."""
    if kind == 0:
        os.symlink(outside, tmp, dir_fd=fd)
    elif kind == 1:
        os.link(outside / "target", tmp, dst_dir_fd=fd)
    else:
        os.mkdir(tmp, dir_fd=fd)
        if kind == 3:
            sub = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                os.close(os.open("f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=sub))
            finally:
                os.close(sub)
    try:
        _exchange(fd, tmp, "e")
    except FileNotFoundError:
        os.rename(tmp, "e", src_dir_fd=fd, dst_dir_fd=fd)


def _flip(layout_dir: Path, outside: Path, names: list[str], stop: threading.Event) -> None:
    """The planter: each old name is swapped atomically with a symlink to the outside directory
    (and back), and the entry ``e`` within it changes kind, until ``stop``."""
    fd = os.open(layout_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:
            with contextlib.suppress(OSError):
                os.symlink(outside, f"link-{name}", dir_fd=fd)
        i = 0
        while not stop.is_set():
            i += 1
            for name in names:
                with contextlib.suppress(OSError):
                    _exchange(fd, name, f"link-{name}")  # the old name: a dir <-> a link to outside
                if i % 4:
                    continue
                with contextlib.suppress(OSError):
                    aside = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    try:
                        _entry(aside, outside, i // 4 % 4, f".t{i}")
                    finally:
                        os.close(aside)
    finally:
        os.close(fd)


def test_trims_racing_the_planter_touch_nothing_outside_and_raise_nothing(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    layout_dir = tmp_path / "cache"
    layout_dir.mkdir()
    ours = {".lock", ".deletes", "00", "ff"}
    (layout_dir / ".lock").write_bytes(b"")
    (layout_dir / ".deletes").write_bytes(b"record")
    for fan in ("00", "ff"):
        (layout_dir / fan).mkdir()
        (layout_dir / fan / "page").write_bytes(b"page")
    before = snapshot(outside)
    ours_before = {name: snapshot(layout_dir / name) for name in ("00", "ff")}
    dir_fd = os.open(layout_dir, os.O_RDONLY | os.O_DIRECTORY)
    raised: list[BaseException] = []
    faults = 0
    try:
        for round_ in range(ROUNDS):
            now = time.time_ns()
            old = [f"{PLANTED_PREFIX}{round_}{i:03d}" for i in range(OLD)]  # older than ``now``
            for name in old:
                (layout_dir / name).mkdir(exist_ok=True)
                with contextlib.suppress(OSError):
                    (layout_dir / name / "keep").write_bytes(b"x")
            for i in range(PLANTED_KEPT):
                (layout_dir / f"{PLANTED_PREFIX}{now + i}").mkdir(exist_ok=True)
            stop = threading.Event()
            planter = threading.Thread(target=_flip, args=(layout_dir, outside, old, stop))
            moved: list[list[OSError]] = [[], []]

            def trim(k: int, moved: list[list[OSError]] = moved) -> None:
                try:
                    for _ in range(3):
                        deletelog._trim_aside(dir_fd, moved[k])
                except BaseException as exc:  # reported below
                    raised.append(exc)

            trimmers = [threading.Thread(target=trim, args=(k,)) for k in range(2)]
            planter.start()
            for t in trimmers:
                t.start()
            for t in trimmers:
                t.join(30)
            stop.set()
            planter.join(30)
            assert not planter.is_alive() and not any(t.is_alive() for t in trimmers), "a trim hung"
            assert not raised, raised
            assert all(isinstance(f, OSError) for m in moved for f in m), moved
            faults += sum(len(m) for m in moved)
            assert snapshot(outside) == before, f"round {round_}: something outside the cache directory changed"
            names = set(os.listdir(layout_dir))
            assert ours <= names, names
            assert {name: snapshot(layout_dir / name) for name in ("00", "ff")} == ours_before
            for name in names - ours:  # the planter's leftovers: cleared for the next round
                path = layout_dir / name
                assert name.startswith((PLANTED_PREFIX, "parked-", "link-")), name
                if path.is_symlink() or not path.is_dir():
                    path.unlink()
                else:
                    for root, dirs, files in os.walk(path, topdown=False):
                        for f in files:
                            os.unlink(Path(root) / f)
                        for d in dirs:
                            p = Path(root) / d
                            p.unlink() if p.is_symlink() else p.rmdir()
                    path.rmdir()
    finally:
        os.close(dir_fd)
    assert (outside / "target").read_bytes() == b"not ours"
    assert (outside / "sub" / "deep").read_bytes() == b"not ours either"
    print(f"faults counted over {ROUNDS} rounds: {faults}")


def test_an_old_directory_set_aside_is_emptied_up_to_the_bound_and_left_past_it(tmp_path: Path) -> None:
    """ASIDE_EMPTIED_MAX entries: emptied and removed; one more: left as it is, counted once."""
    layout_dir = tmp_path / "cache"
    layout_dir.mkdir()
    now = time.time_ns()
    for i in range(PLANTED_KEPT):
        (layout_dir / f"{PLANTED_PREFIX}{now + i}").mkdir()
    sizes = {f"{PLANTED_PREFIX}1": deletelog.ASIDE_EMPTIED_MAX, f"{PLANTED_PREFIX}2": deletelog.ASIDE_EMPTIED_MAX + 1}
    for name, n in sizes.items():
        (layout_dir / name).mkdir()
        for j in range(n):
            (layout_dir / name / f"\udcff{j}").write_bytes(b"")  # names not UTF-8 too
    dir_fd = os.open(layout_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        moved: list[OSError] = []
        deletelog._trim_aside(dir_fd, moved)
    finally:
        os.close(dir_fd)
    names = {p.name for p in layout_dir.iterdir()}
    assert f"{PLANTED_PREFIX}1" not in names
    assert len(os.listdir(layout_dir / f"{PLANTED_PREFIX}2")) == deletelog.ASIDE_EMPTIED_MAX + 1
    assert len(names) == PLANTED_KEPT + 1, names
    assert len(moved) == 1 and moved[0].filename == f"{PLANTED_PREFIX}2", moved
