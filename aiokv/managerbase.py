"""`ManagerBase`: what every path of the :class:`aiokv.manager.CacheManager` shares.

The manager's state (configuration, pool, disk tier, counters), its keys, page references, room in
the pool and the one owner of in-flight work (:meth:`ManagerBase.track`). The paths pages take are
built on it, each in its own module: :mod:`aiokv.loadpath` (match, load, disk promotions, prefetch)
and :mod:`aiokv.offloadpath` (offload rounds, write-behind); :mod:`aiokv.manager` adds the lifetime,
the learned rates saved across restarts and the statistics. All of it is synchronous bookkeeping
between awaits, on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from aiokv.config import Admission, CacheConfig
from aiokv.costs import CostModel
from aiokv.faults import FaultLog
from aiokv.keys import PageKey, Salt, Tokens, check_salt, namespace_seed, page_keys
from aiokv.launches import LaunchSizer
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, PageState
from aiokv.pool import PagePool
from aiokv.results import Tier
from aiokv.storage import DiskTier
from aiokv.transfers import CopyWithdrawn, Transfers

log = logging.getLogger("aiokv.cache")


class ManagerBase:
    """State, keys, page references and in-flight work of one manager (see the module docstring).

    ``part`` is mixed into every key; ``writer`` False makes offloads store nothing (see
    :class:`aiokv.manager.CacheManager`).
    """

    def __init__(self, config: CacheConfig, layout: KVLayout, *, part: bytes = b"", writer: bool = True) -> None:
        self.config = config
        self.layout = layout
        self._part = part
        self._writer = writer
        self._seeds: dict[Salt, bytes] = {}
        self._pool: PagePool | None = None
        self._disk: DiskTier | None = None
        self._transfers: Transfers | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._seen: OrderedDict[PageKey, None] = OrderedDict()
        self._closed = False
        self._close_began = asyncio.Event()  # set with _closed: ends every wait for room (_begin_close)
        # Loads and streams waiting for room now (LoadPath._wait_for_load_room), and the tasks of
        # those among them that hold pool pages they give back if they give up (a stream's pages
        # not launched yet); resolved when fewer callers may give a page back (_wake_room_waiters).
        self._room_waiters = 0
        self._room_holders: set[asyncio.Task[Any] | None] = set()
        self._room_changed: asyncio.Future[None] | None = None
        self.faults = FaultLog(log)
        self.costs = CostModel(config.prefill_tokens_per_s)
        self._lookups = 0
        self._hit_tokens: Counter[Tier] = Counter()
        self._loaded_tokens: Counter[Tier] = Counter()
        self._miss_tokens = 0
        self._bytes: Counter[str] = Counter()
        self._stored = self._skipped = self._dropped = self._promoted = 0
        self._withdrawn = 0  # pages a call did not copy because the close began first (not a fault)
        # Launch groups, sized by the loop time each kind's groups took (aiokv/launches.py).
        self.load_launches = LaunchSizer(config.launch_pages, config.launch_bytes, config.launch_turn_s,
                                         layout.page_bytes)
        self.offload_launches = LaunchSizer(config.launch_pages, config.launch_bytes, config.launch_turn_s,
                                            layout.page_bytes)

    # -- state ----------------------------------------------------------------------------------

    @property
    def pool(self) -> PagePool:
        """The CPU page pool (after start)."""
        if self._pool is None:
            raise RuntimeError("the cache is not started: use `async with KVCache(...)` or await start()")
        return self._pool

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, or None when there is none (not configured, or it could not start)."""
        return self._disk

    def _begin_close(self) -> None:
        """The close's first step: calls in flight launch nothing more and stop waiting for room."""
        self._closed = True
        self._close_began.set()

    @property
    def closing(self) -> bool:
        """True from the close's first step on (:meth:`aiokv.manager.CacheManager.aclose`): a call in
        flight launches nothing more and counts what it did not copy with :meth:`withdraw`."""
        return self._closed

    def withdraw(self, pages: int) -> None:
        """Count ``pages`` a call did not copy because the close began first: ``pages_withdrawn``
        in :meth:`aiokv.manager.CacheManager.stats`, never a fault."""
        self._withdrawn += pages

    def count_loaded(self, pool_pages: int, disk_pages: int) -> None:
        """Count a load's pages copied into the engine's buffer: ``pool_pages`` that were in the pool,
        ``disk_pages`` read from disk first (``loaded_tokens`` and ``bytes_moved["pool_to_gpu"]``)."""
        t = self.layout.page_tokens
        self._loaded_tokens[Tier.POOL] += pool_pages * t
        self._loaded_tokens[Tier.DISK] += disk_pages * t
        self._bytes["pool_to_gpu"] += (pool_pages + disk_pages) * self.layout.payload_bytes

    def _running(self) -> tuple[PagePool, Transfers]:
        if self._closed:
            raise RuntimeError("the cache is closed")
        if self._pool is None or self._transfers is None:
            raise RuntimeError("the cache is not started: use `async with KVCache(...)` or await start()")
        return self._pool, self._transfers

    def check_running(self) -> None:
        """Raise ``RuntimeError`` unless started and not closed."""
        self._running()

    def running_transfers(self) -> Transfers:
        """The transfers bytes move through; ``RuntimeError`` unless started and not closing.

        A call that outlives the close's first step takes them at its start and holds them (a load
        stream given up during the close must still wait for, or order after, its copies).
        """
        return self._running()[1]

    # -- keys -----------------------------------------------------------------------------------

    def keys(self, tokens: Tokens, salt: Salt = None) -> list[PageKey]:
        """Page keys of the full pages of ``tokens`` under this cache's namespace and ``salt``.
        Raises ``TypeError`` for a salt not str/bytes/None (before the seed cache: an unhashable one
        raised "unhashable type" there, naming no argument)."""
        check_salt(salt)
        seed = self._seeds.get(salt)
        if seed is None:
            seed = namespace_seed(self.layout, self.config.namespace, salt, self._part)
            if len(self._seeds) < 4096:
                self._seeds[salt] = seed
        return page_keys(tokens, self.layout.page_tokens, seed)

    def _note_seen(self, keys: Sequence[PageKey]) -> None:
        if self.config.admission is not Admission.SEEN_TWICE:
            return
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.config.seen_window:
            self._seen.popitem(last=False)

    # -- page references ------------------------------------------------------------------------

    def release(self, handles: Sequence[PageHandle]) -> None:
        """Drop a caller's references ``handles`` (pool pages it no longer copies); one already
        released is skipped. Nothing happens before the pool exists."""
        self._release_handles(handles)

    def _release_handles(self, handles: Sequence[PageHandle]) -> None:
        if self._pool is None:
            return
        self._pool.table.release_all(handles, skip_released=True)

    # -- in-flight work -------------------------------------------------------------------------

    def track(self, future: asyncio.Future[Any], finish: Callable[[], None]) -> None:
        """Run ``finish`` when ``future`` (abandoned by its caller) completes; flush/aclose wait for it.

        The one owner of work nobody awaits any more: copies and disk reads of cancelled calls,
        promotions past a shortened load, read-backs of slot indices.
        """
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._background.add(done)

        def settle(_: asyncio.Future[Any]) -> None:
            try:
                finish()
            finally:
                self._background.discard(done)
                if not done.done():
                    done.set_result(None)
                if not self._background:
                    self._wake_room_waiters()  # nothing in the background frees a page any more

        future.add_done_callback(settle)

    def release_after(self, future: asyncio.Future[None], handles: list[PageHandle]) -> None:
        """Release the references ``handles`` once ``future`` (a load copy its caller abandoned,
        possibly still running) completes; a failure of it is counted (``copy_failed``), never raised.
        ``flush``/``aclose`` wait for it (:meth:`track`)."""
        self._after(future, handles, commit=None)

    def _after(self, future: asyncio.Future[None], handles: list[PageHandle], commit: bool | None) -> None:
        """When a copy abandoned by a failing caller completes, release (None) or abort its pages."""
        pool = self.pool

        def finish() -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None and not isinstance(error, CopyWithdrawn):
                # A fault as for a caller that waits (the close withdrawing a copy is not one):
                # nothing else looks at how an abandoned copy ended.
                self.faults.record("copy_failed", f"a copy its caller abandoned failed: {error!r}")
            if commit is None:
                pool.table.release_all(handles, skip_released=True)
                return
            for handle in handles:
                if handle.released:
                    continue
                if commit:
                    pool.table.commit(handle)
                else:
                    pool.table.abort(handle)

        self.track(future, finish)

    # -- pages other calls are writing ---------------------------------------------------------

    def _commit_deadline(self) -> float:
        """The loop time until which a call waits for other calls' commits (``commit_wait``)."""
        return asyncio.get_running_loop().time() + self.config.commit_wait

    async def _wait_committed(self, key: PageKey, deadline: float, who: str,
                              expired: list[bool] | None = None) -> bool:
        """Whether the page another call is writing under ``key`` was committed by ``deadline``
        (False: aborted, or still being written then; counted ``commit_wait_expired`` unless the
        bound is 0, which never waits, or ``expired`` says another wait of the same call counted
        it). A cancel leaves the page and its other waiters alone."""
        try:
            async with asyncio.timeout_at(deadline):
                return await self.pool.table.wait_committed(key)
        except TimeoutError:
            # Committed or given up as the timeout fell due (its wake-up ran first, the timeout's
            # cancel then reached the task): no expiry, the page is there or free (review 219: it
            # was counted, and a prefetch read nothing past it).
            state = self.pool.table.state_of(key)
            if state is not PageState.RESERVED:
                return state is PageState.READY
            self._count_expiry(who, expired)
            return False

    def _count_expiry(self, who: str, expired: list[bool] | None) -> None:
        """Count ``commit_wait_expired`` for a wait of ``who`` that stopped at its deadline: not
        when the bound is 0 (it never waits) nor when ``expired`` says another wait of the same
        call counted it (then marked)."""
        if expired is not None:
            if expired:
                return
            expired.append(True)
        if self.config.commit_wait > 0:
            self.faults.record("commit_wait_expired", f"{who} stopped at a page another call was still "
                               "writing into the pool after commit_wait")

    async def _wait_written(self, key: PageKey, deadline: float, who: str,
                            expired: list[bool] | None = None) -> bool:
        """Wait (until ``deadline``) while other calls write the pool page of ``key``; True once it
        is READY, False once nobody writes it (its writer gave it up: FREE) or after the deadline
        (counted as :meth:`_wait_committed` says). A page given up and reserved again by a third
        call before this one looked (another offload's copy, a read) is waited for in turn: taken
        for a miss, it stopped a load (counted ``load_shortened``) or a match there although the
        page was on its way (review 202). A wait that ends at the deadline behind such a third
        writer without its ``TimeoutError`` (the abort's wake-up ran before the timeout's callback)
        is an expiry too, counted here once (review 214: it went uncounted). A cancel leaves the
        page and its writers alone."""
        state_of = self.pool.table.state_of
        loop = asyncio.get_running_loop()
        # This wait's own mark when the caller shares none: one count however it ends.
        expired = [] if expired is None else expired
        while True:
            if await self._wait_committed(key, deadline, who, expired):
                return True
            state = state_of(key)
            if state is not PageState.RESERVED:
                return state is PageState.READY
            if loop.time() >= deadline:
                self._count_expiry(who, expired)  # not counted when _wait_committed's timeout was
                return False

    # -- room in the pool -----------------------------------------------------------------------

    async def _wait_for_room(self, *, disk_io: bool = True) -> bool:
        """Wait (``offload_wait`` at most) until a pool page may be free: a chunk still being
        prepared becomes usable, or (``disk_io``) the write-behind or a read releases one. False
        when nothing in flight can free a page, or none came in time. True as well, at once, when
        the close began (before or during the wait): the caller then looks at :attr:`closing` and
        stops, counting what it did not copy as withdrawn (it once waited on, through the close)."""
        pool, disk = self.pool, self._disk
        waits: list[asyncio.Future[Any]] = []
        if not pool.ready:
            waits.append(asyncio.ensure_future(pool.wait_ready()))
        if disk is not None and disk_io:
            busy = disk.statistics()
            if busy.write_behind_queued or busy.write_behind_writing or busy.in_flight:
                waits.append(pool.table.wait_reclaimable())
            if busy.write_behind_queued:
                # The flush replaces write-behind workers a loop-wide cancel ended: else the pages
                # they left queued held the pool and offloads gave up for room (review 263).
                waits.append(asyncio.ensure_future(disk.flush()))
        if not waits:
            return False
        return await self._first_of(waits)

    async def _first_of(self, waits: list[asyncio.Future[Any]], bound: float | None = None) -> bool:
        """Wait (``bound`` seconds, ``offload_wait`` when None) for the first of ``waits`` or the
        close's start; True when one came. Every wait is cancelled and reaped before the return."""
        waits.append(asyncio.ensure_future(self._close_began.wait()))
        try:
            done, _ = await asyncio.wait(waits, timeout=self.config.offload_wait if bound is None else bound,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return bool(done)

    def _wait_room_changed(self) -> asyncio.Future[None]:
        """A future resolved once fewer callers may give a pool page back (a load or stream stopped
        running or began to wait for room, the background work ended): waiters for room look
        again. In place when this returns (as ``PageTable.wait_reclaimable``); cancelling it never
        disturbs other waiters."""
        if self._room_changed is None or self._room_changed.done():
            self._room_changed = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._room_changed)

    def _wake_room_waiters(self) -> None:
        waiter, self._room_changed = self._room_changed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
