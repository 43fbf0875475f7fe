"""Safe access to a :class:`~aiokv.adapters.store.PageFileStore`'s directory, through descriptors only.

A store's directory, ``<root>/<engine>-<fingerprint hex>``, has a predictable name, in a root others
may be able to write (``/tmp/aiokv``). So it is checked once (never a symlink, ours, 0700) and then
reached only through checked descriptors, each level opened ``O_NOFOLLOW`` from its parent's: a name
swapped afterwards (renamed away, a symlink put in its place) redirects nothing.

- :func:`open_dirs` / :func:`close_dirs`: the store's checked directory descriptor and, for a
  reader, its layout directory's and a shared lock on the tier's lock file held through it.
- :func:`dir_identity`: what the directory's name holds now (``(st_dev, st_ino)``).
- :func:`clear_tree`: deletes our regular files under the directory the tier started over.
- :class:`ReaderCheck`: a reader's staleness checks (has a page file appeared?) on a worker thread.

The functions block (system calls), so the store calls them off its loop, in a thread;
:class:`ReaderCheck` runs its checks on a worker of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import queue
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from aiokv.storage.layoutdir import LOCK_NAME, open_private_subdir
from aiokv.storage.safefiles import (
    OPEN_FLAGS,
    UnsafeDirectoryError,
    UnsafeFileError,
    check_page_fd,
    classify_open_error,
)

# The store's logger: these records were always its own, and operators filter on its name.
log = logging.getLogger("aiokv.adapters.store")


def _open_own_dir(directory: Path) -> int:
    """A checked descriptor of a store's directory ``<root>/<engine>-<fingerprint hex>`` (created
    0700, with the root). The root is the operator's choice (it may be a symlink); the directory in
    it must be a real directory of ours that nobody else can write, checked by the tier's own check
    (:func:`~aiokv.storage.layoutdir.open_private_subdir`: ``O_NOFOLLOW``, owner, group/other bits
    removed or refused; one policy for both). Its name is predictable: in a root others can write
    (``/tmp/aiokv``) another user could plant it as a symlink (the tier, which follows a symlinked
    root, would then create directories wherever it points) or as a directory of theirs; so the
    tier is handed this descriptor and never looks the name up itself. Blocking. Raises
    ``UnsafeDirectoryError`` (logged) for what is not safely ours; ``OSError`` when it cannot be
    created or opened."""
    try:
        directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: the open says so (NotADirectoryError)
    root_fd = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_private_subdir(root_fd, directory.name, directory, create=True)
    except UnsafeDirectoryError as exc:
        log.error("%s", exc.strerror)
        raise
    finally:
        os.close(root_fd)


def open_dirs(directory: Path, layout_dir: Path, guard: bool) -> tuple[int, int | None, int | None]:
    """The store's checked directory descriptor (:func:`_open_own_dir`) and, when ``guard`` (a
    reader's), a descriptor of the tier's ``layout_dir`` in it (created 0700 as the tier would,
    ``O_NOFOLLOW``, checked by the tier's own check) and a shared lock held through that
    (:func:`_hold_shared`); else None twice. Blocking; the caller owns all three. Raises
    ``UnsafeDirectoryError`` (logged) for a directory that is not safely ours."""
    own_fd = _open_own_dir(directory)
    if not guard:
        return own_fd, None, None
    try:
        layout_fd = open_private_subdir(own_fd, layout_dir.name, layout_dir, create=True)
    except BaseException as exc:
        os.close(own_fd)
        if isinstance(exc, UnsafeDirectoryError):
            log.error("%s", exc.strerror)
        raise
    try:
        return own_fd, layout_fd, _hold_shared(layout_fd, layout_dir)
    except BaseException:
        os.close(layout_fd)
        os.close(own_fd)
        raise


def close_dirs(opened: tuple[int, int | None, int | None]) -> None:
    """Close what :func:`open_dirs` returned to a caller that is gone."""
    for fd in opened:
        if fd is not None:
            os.close(fd)


def dir_identity(directory: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``directory``'s name holds now (a symlink at the name is not
    followed), or None when it holds nothing. Blocking."""
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TREE_DEPTH = 2
"""Directory levels under a store's directory: layout directories, then their fan-out ones."""


def _open_same_dir(directory: Path, identity: tuple[int, int] | None) -> int | None:
    """A descriptor of the store's directory, opened without following a symlink at its name
    (``O_NOFOLLOW``), when it is still the directory the tier was started over (``identity``,
    ``(st_dev, st_ino)``); None when the name is gone or leads elsewhere. Blocking; the caller
    closes it."""
    if identity is None:
        return None
    try:
        root_fd = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd = os.open(directory.name, _DIR_OPEN, dir_fd=root_fd)
    except OSError:
        return None
    finally:
        os.close(root_fd)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        return None
    return fd


def _open_below(dir_fd: int, name: str) -> int | None:
    """``name`` under ``dir_fd`` as a directory of ours (``O_NOFOLLOW``), or None (a symlink, a file,
    gone, another owner's). Blocking; the caller closes it."""
    try:
        fd = os.open(name, _DIR_OPEN, dir_fd=dir_fd)
    except OSError:
        return None
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def _any_page_file(layout_fd: int, names: Sequence[tuple[str, str]]) -> bool:
    """Whether a regular file sits at one of ``names`` (``(fan-out directory, file name)``) under the
    layout directory ``layout_fd``: each fan-out directory is opened once from that descriptor, as
    a directory of ours without following a symlink (:func:`_open_below`), and the file's name is
    stat'ed without following one. Blocking; looks only, and stops at the first file found."""
    fans: dict[str, int | None] = {}
    try:
        for fan, name in names:
            if fan not in fans:
                fans[fan] = _open_below(layout_fd, fan)
            fan_fd = fans[fan]
            if fan_fd is None:
                continue
            try:
                st = os.stat(name, dir_fd=fan_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                return True
        return False
    finally:
        for fan_fd in fans.values():
            if fan_fd is not None:
                os.close(fan_fd)


class ReaderCheck:
    """A reader's staleness checks (:func:`_any_page_file`), run in order on one worker thread of
    their own that lives as long as the store, over a descriptor of the layout directory its tier
    indexes (:meth:`adopt`). Nothing is looked up by name above that descriptor, so the store's
    directory renamed and a symlink put in its place after the tier started redirects nothing.

    The descriptor is the worker's alone: one replaced is closed by the worker after the checks
    queued before (never while one of them uses it, nor once its number could be reused). Create,
    and :meth:`join`, on a thread other than the loop's (``Thread.start`` and ``join`` wait)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a job is never queued behind the stop
        self._stopped = False
        self._fd: int | None = None  # the worker's: touched only by its jobs
        self._unanswered: set[asyncio.Future[bool]] = set()  # checks' futures not settled yet (loop only)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def adopt(self, layout_fd: int) -> None:
        """Check in the layout directory ``layout_fd`` from now on; the descriptor is the worker's."""
        if not self._put(functools.partial(self._replace, layout_fd)):
            os.close(layout_fd)

    def check(self, names: Sequence[tuple[str, str]]) -> asyncio.Future[bool]:
        """A future of the running loop: whether a page file sits at one of ``names`` in the layout
        directory last adopted (False when none was, or once stopped). A cancelled caller's result
        is dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()

        def run() -> None:
            try:
                found = self._fd is not None and _any_page_file(self._fd, names)
            except BaseException as exc:  # handed to the awaiting caller
                _deliver(loop, future, False, exc)
            else:
                _deliver(loop, future, found, None)

        if not self._put(run):
            future.set_result(False)
        else:
            self._unanswered.add(future)
            future.add_done_callback(self._unanswered.discard)
        return future

    def abandon(self) -> None:
        """Answer every check not answered yet False, at once (loop only; the store's close): a look
        stuck in the kernel (a hung file system) must not hold its caller (an engine's lookup) past
        the close, which then cancelled it under the engine's thread. The look ends by itself; its
        late answer is dropped."""
        for future in list(self._unanswered):
            if not future.done():
                future.set_result(False)

    def stop(self) -> None:
        """Let the worker end once the jobs queued are done, closing its descriptor. Idempotent;
        any thread."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """:meth:`stop`, then wait for the worker to end (its jobs are a few system calls each), up to
        ``timeout`` seconds (None: no bound); True once it ended. A worker stuck in the kernel (a
        hung file system) ends by itself when its look returns, closing its descriptor then."""
        self.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _put(self, job: Callable[[], None]) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self._jobs.put(job)
            return True

    def _replace(self, layout_fd: int | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = layout_fd

    def _work(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                job()
        finally:
            self._replace(None)


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[bool], found: bool,
             error: BaseException | None) -> None:
    """Hand a check's outcome to its loop (a closed loop has nobody waiting: dropped)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, found, error)


def _settle(future: asyncio.Future[bool], found: bool, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller, or answered by abandon()
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(found)


def clear_tree(directory: Path, identity: tuple[int, int] | None) -> bool:
    """Delete the regular files of ours under the store's directory (page files, temporary ones),
    through descriptors only: a symlink is never followed nor a directory entered that is not
    ours, and a name swapped meanwhile redirects nothing (each directory is opened ``O_NOFOLLOW``
    from its parent's descriptor). The lock files stay (a reader may hold one), as does anything
    that is not a regular file of ours (logged). Emptied subdirectories are removed. True when the
    directory is gone or cleared; False (logged) when it is no longer the directory the tier used.
    Blocking; raises ``OSError`` when a removal fails."""
    fd = _open_same_dir(directory, identity)
    if fd is None:
        if dir_identity(directory) is None:
            return True  # nothing there: nothing to clear
        log.error("aiokv store: not clearing %s: it is no longer the directory this store used (renamed, or "
                  "something put in its place)", directory)
        return False
    try:
        _clear_below(fd, directory, _TREE_DEPTH)
    finally:
        os.close(fd)
    return True


def _clear_below(dir_fd: int, shown: Path, depth: int) -> None:
    euid = os.geteuid()
    for name in os.listdir(dir_fd):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and depth > 0 and st.st_uid == euid:
            sub = _open_below(dir_fd, name)
            if sub is None:
                log.warning("aiokv store: clear left %s (no longer a directory of ours)", shown / name)
                continue
            try:
                _clear_below(sub, shown / name, depth - 1)
            finally:
                os.close(sub)
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise
        elif stat.S_ISREG(st.st_mode) and st.st_uid == euid:
            if name != LOCK_NAME:
                # unlinkat removes this name in this directory: whatever stands there now, nothing
                # is followed (a file swapped for a link since the stat loses the link only).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
        else:
            log.warning("aiokv store: clear left %s (not a regular file or directory of ours)", shown / name)


def _hold_shared(layout_fd: int, layout_dir: Path) -> int | None:
    """A descriptor holding a shared ``flock`` on the lock file of the tier's ``layout_dir``, reached
    through its checked descriptor ``layout_fd`` (:func:`open_dirs`), created as the tier would
    (``.lock`` 0600). None when the writer holds the lock (its exclusive lock excludes ours) or the
    lock file cannot be had (the tier's start says why). Blocking, but never on what a name holds:
    the lock file opens with the tier's flags (``O_NOFOLLOW | O_NONBLOCK``), and only a regular file
    of ours is locked. Raises ``UnsafeDirectoryError`` (logged) for a lock file that is not safely
    ours: a symlink, FIFO, socket, device or directory at the lock's name, a file of another owner."""
    lock = layout_dir / LOCK_NAME
    try:
        fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_CREAT | OPEN_FLAGS, 0o600, dir_fd=layout_fd)
    except OSError as exc:
        error = classify_open_error(exc, str(lock))
        if isinstance(error, UnsafeFileError):
            _refuse(lock, error)
        return None
    try:
        check_page_fd(fd, str(lock), write=False)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except UnsafeFileError as exc:
        os.close(fd)
        _refuse(lock, exc)
    except OSError:
        os.close(fd)
        return None
    return fd


def _refuse(lock: Path, exc: OSError) -> NoReturn:
    message = f"{exc.strerror}: refusing to use {lock.parent}"
    log.error("aiokv store: %s", message)
    raise UnsafeDirectoryError(exc.errno, f"aiokv store: {message}") from None
