"""`TierEdge`: the disk tier's edge towards its callers (a base of :class:`~.tierbase.TierBase`).

Plain synchronous code on the owning loop, run before any state changes: a caller's handle or
buffer checked (``TypeError``/``ValueError``), the job's own page reference taken and released, and
where a write's bytes are (a caller's buffer or its pool page). Of the tier's state it changes only
two counters (refused calls, buffered fallbacks).
"""

from __future__ import annotations

import asyncio
import logging

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, PageState, StaleHandleError
from aiokv.pool import PagePool

from .backends import PageIO
from .checks import check_buffer, check_ready, check_reserved
from .jobs import WriteJob
from .memory import PageBuffer, buffer_address

log = logging.getLogger("aiokv.storage.disk")  # one logger for the tier, whichever file logs


class TierEdge:
    """Caller checks and page references of a :class:`~.disk.DiskTier`; the state they read is
    :class:`~.tierbase.TierBase`'s (set in its ``__init__``)."""

    layout: KVLayout
    pool: PagePool
    _io: PageIO | None
    _close_task: asyncio.Task[None] | None
    _payload_bytes: int
    _buffered_fallbacks: int
    _dropped: int

    # -- caller checks and page references ------------------------------------------------------

    def _check_started(self) -> None:
        if self._io is None and self._close_task is None:
            raise RuntimeError("disk tier not started: call start() or use async with")

    def _check_ready(self, handle: PageHandle) -> int:
        self._check_started()
        return check_ready(self.pool, handle)

    def _check_reserved(self, handle: PageHandle) -> int:
        if self._io is None or type(handle) is not PageHandle:
            self._check_started()
            return check_reserved(self.pool, handle)
        table = self.pool.table
        try:
            page = table.check(handle)
        except StaleHandleError:
            return check_reserved(self.pool, handle)  # raises the caller's ValueError
        if table.state_of(handle.key) is not PageState.RESERVED:
            return check_reserved(self.pool, handle)
        return page

    def _retain(self, handle: PageHandle) -> PageHandle:
        """The job's own reference on the READY page of ``handle`` (the caller keeps its own).

        One call on the common path (``retain`` checks the handle and the page's state itself);
        a refusal goes through :meth:`_check_ready` for the caller's ``TypeError``/``ValueError``."""
        if self._io is None or type(handle) is not PageHandle:
            self._check_ready(handle)  # raises what a bad handle or a tier not started deserves
        try:
            return self.pool.table.retain(handle)
        except StaleHandleError:
            self._check_ready(handle)  # raises the caller's ValueError
            raise

    def _release(self, handle: PageHandle) -> None:
        try:
            self.pool.table.release(handle)
        except StaleHandleError:
            log.exception("disk tier: page reference already released")

    def _refuse(self) -> bool:
        self._dropped += 1
        return False

    # -- page memory --------------------------------------------------------------------------

    def _external(self, buffer: memoryview, writable: bool) -> PageBuffer:
        """A caller's page buffer, checked (``TypeError``/``ValueError`` before any state change)."""
        if not isinstance(buffer, memoryview):
            raise TypeError(f"buffer must be a memoryview, got {type(buffer).__name__}")
        check_buffer(buffer, self.layout.page_bytes, writable)
        view = buffer.cast("B")
        page = PageBuffer(buffer_address(view), view, self._payload_bytes)
        if not page.aligned and self._io is not None and self._io.direct:
            self._buffered_fallbacks += 1  # O_DIRECT needs aligned memory: this one goes buffered
        return page

    def _source(self, job: WriteJob) -> PageBuffer:
        """Where ``job``'s bytes are: the caller's buffer, or its pool page (checked: still live)."""
        if job.buffer is not None:
            return job.buffer
        assert job.ref is not None
        # The job's own reference (retained at the edge, released only by the job): live.
        page = job.ref.page
        memory = self.pool.memory
        return PageBuffer(memory.page_address(page), memory.page_view(page), self._payload_bytes)
