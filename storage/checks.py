"""Checks of caller arguments: they raise ``TypeError``/``ValueError`` before any state changes."""

from __future__ import annotations

from aiokv.keys import KEY_BYTES, PageKey
from aiokv.pagetable import PageHandle, PageState, StaleHandleError
from aiokv.pool import PagePool


def check_key(key: PageKey) -> None:
    """A page key is 16 bytes."""
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")


def exact_key(key: PageKey) -> PageKey:
    """``key`` checked and as exact ``bytes``: a subclass's own methods (``hex``, ``__eq__``,
    ``__ne__``, ``__hash__``) then never run on the tier's paths, where they could name a file
    outside the cache or pass another key's header off as this key's."""
    if type(key) is bytes and len(key) == KEY_BYTES:
        return key
    check_key(key)
    return bytes.fromhex(bytes.hex(key))  # bytes' own methods: nothing of the subclass runs


def check_handle(pool: PagePool, handle: PageHandle) -> int:
    """The page id of a live handle of ``pool``."""
    if not isinstance(handle, PageHandle):
        raise TypeError(f"handle must be a PageHandle, got {type(handle).__name__}")
    try:
        return pool.table.check(handle)
    except StaleHandleError as exc:
        raise ValueError(str(exc)) from exc


def check_ready(pool: PagePool, handle: PageHandle) -> int:
    """The page id of a live handle on a READY page (a page with data to write)."""
    page = check_handle(pool, handle)
    if pool.table.state_of(handle.key) is not PageState.READY:
        raise ValueError(f"{handle!r} is a reservation: commit it before writing it to disk")
    return page


def check_reserved(pool: PagePool, handle: PageHandle) -> int:
    """The page id of a live reservation (a page to read into)."""
    page = check_handle(pool, handle)
    if pool.table.state_of(handle.key) is not PageState.RESERVED:
        raise ValueError(f"{handle!r} is not a reservation: read into a reserved page")
    return page


def check_buffer(buffer: memoryview, nbytes: int | None, writable: bool) -> None:
    """A C-contiguous memoryview of ``nbytes`` bytes (None: any, but not empty), writable when asked."""
    if not buffer.c_contiguous:  # a released view raises ValueError here too
        raise ValueError("buffer must be C-contiguous")
    if writable and buffer.readonly:
        raise TypeError("buffer must be writable (a read fills it)")
    if nbytes is None and buffer.nbytes == 0:
        raise ValueError("buffer is empty")
    if nbytes is not None and buffer.nbytes != nbytes:
        raise ValueError(f"buffer must be {nbytes} bytes (layout.page_bytes), got {buffer.nbytes}")
