"""`LoadStream`: load a matched prefix while the engine computes it (compute-or-load split).

The engine prefills the matched prefix from the front; the stream copies its pages from the back
(disk pages are read into the pool ahead of their copy). Before computing a chunk the engine
*claims* it; the stream never launches a page whose tokens were claimed, and ``claim`` never grants
tokens a launched page covers. Where the two fronts meet the load stops: the engine computes
``[from_token, loaded_from)``, the cache loads ``[loaded_from, match.tokens)``. On a slow tier that is
never worse than recomputing; on any tier it approaches the harmonic combination of the two rates::

    stream = await cache.start_load(match, slots, from_token=start)
    pos = start
    while (end := stream.claim(pos + chunk)) > pos:   # never past what the load covers already
        prefill(tokens[pos:end]); pos = end           # report a chunk by claiming the next one
    result = await stream.finish()                    # KV of [result.loaded_from, match.tokens) is in
    prefill(tokens[pos:result.loaded_from])           # what the load gave up (a fault), if anything

On CUDA each launched copy orders the engine's current stream after it (no host sync): claim a
chunk before launching its kernels, and do not claim far ahead of what the GPU has computed.

``stream.planned`` is where the fronts should meet by the cost model's rates (``CostModel.estimate``
at the start; None while a rate is unknown). The rates survive restarts (saved in the disk tier's
directory), so the first hit after one has its plan too. An engine that claims small steps while
it cannot tell the paces apart may claim up to ``planned`` in whole chunks at once (a chunk
prefills faster than pages one by one), then go on a page at a time until the fronts meet.

Disk pages are read from the back a few at a time (``CacheConfig.stream_readahead_bytes``), so they land one by
one rather than in a burst (concurrent reads share the device: sixteen 32 MiB reads in flight landed
together after ~300 ms on the H200, as long as the whole 8K prefill). A read the engine will claim
into before it lands, by the measured rates, is not started; a read the engine claimed into while
it was in flight is not waited for (it lands in the pool in the background): the fronts meet
without waiting on the disk.

The copies the loader launched (one entry per copy), their per-layer readiness and how they settle
live in :mod:`aiokv.streamcopies`; this module holds the engine's side and the loader.
"""

from __future__ import annotations

import asyncio
import functools
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from aiokv.costs import LoadEstimate
from aiokv.loadpath import CommitWaits, LoadPath, NoPage, Promotion
from aiokv.pagetable import PageHandle, PageState
from aiokv.results import Match, Tier
from aiokv.streamcopies import StreamCopies
from aiokv.transfers import Copy


@dataclass(frozen=True)
class StreamResult:
    """Outcome of a :class:`LoadStream`: the KV of ``[loaded_from, tokens)`` is in the buffer."""

    tokens: int
    """``match.tokens``."""
    from_token: int
    """Where the stream started (earlier tokens were in the engine's buffer already)."""
    claimed: int
    """How far the engine claimed (computes itself); ``<= loaded_from``."""
    loaded_from: int
    """Start of the loaded suffix; ``tokens`` when nothing was loaded. The engine computes
    ``[claimed, loaded_from)`` besides what it already did."""
    pool_pages: int
    """Pages copied from the pool."""
    disk_pages: int
    """Pages read from disk and copied."""

    @property
    def loaded_tokens(self) -> int:
        """Tokens whose KV the load delivered."""
        return self.tokens - self.loaded_from


class LoadStream:
    """A running compute-or-load split over one match (see the module docstring).

    Created by ``KVCache.start_load`` (or ``TPCache.start_load``); consumes the match. Use
    :meth:`finish` (or leave ``async with``, which also works when the engine stops early).
    """

    def __init__(
        self, manager: LoadPath, match: Match, slots: torch.Tensor, from_token: int, layered: bool = False
    ) -> None:
        self._manager = manager
        self._layered = layered
        t = manager.layout.page_tokens
        first = from_token // t
        disk_pages = range(max(first, match.pool_pages), match.pages)
        # Before the match is taken: nothing to give back if the estimate raised.
        self.estimate: LoadEstimate = manager.costs.estimate(max(0, match.pool_pages - first), len(disk_pages), t,
                                                             manager.layout.page_bytes, first * t)
        """The cost model's view of this load (pages ``[from_token // page_tokens, match.pages)``) at its start."""
        # Before the match is taken too: either may raise (a close begun, a sticky CUDA error), and
        # after the take nothing would give the match's pages back (review 115).
        transfers = manager.running_transfers()
        # The engine's work queued before the stream: its copies are ordered after this, not after
        # the claimed chunks the engine queues meanwhile (those never touch the loaded slots): a
        # copy launched behind a queued chunk landed only once the chunk ran, and finish() waited
        # for it (~40 ms at the meeting point of an 8K split on the H200).
        after = transfers.mark()
        keys, handles = match.take(manager)
        self._t = t
        self.tokens = match.tokens
        self.from_token = from_token
        self._first = first
        self._keys = keys
        if first:
            manager.release(handles[:first])
        self._pool = {page: handles[page] for page in range(first, match.pool_pages)}
        self._disk_pages = disk_pages
        split = self.estimate.split_token
        self.planned: int | None = None if split is None else max(from_token, first * t + split)
        """Where the fronts are expected to meet (a token; None while a rate is unknown)."""
        self._slots = slots
        self._claimed = from_token
        self._front = match.tokens  # start of the lowest page launched so far
        self._front_moved: asyncio.Future[None] | None = None  # resolved when it moves (wait_front)
        self._promotions: dict[int, asyncio.Task[Promotion | NoPage]] = {}  # reads in flight, by page
        # commit_wait in all for the stream's waits on pages other calls write (review 217: each
        # promotion took a fresh bound, the stream up to one a page in all).
        self._waits = CommitWaits()
        # Disk reads in flight at most; worked out only for a match with disk pages (reading the
        # config's disk view looks up DiskConfig's defaults when there is no disk tier).
        self._ahead = 0 if not self._disk_pages else min(
            manager.config.disk_queue_depth,
            max(2, manager.config.stream_readahead_bytes // manager.layout.page_bytes))
        self._disk_started = time.perf_counter()
        self._measured: Callable[[], None] = lambda: None
        self._disk_landed = 0  # pages this stream read from disk so far (its own disk rate)
        self._returned = 0  # launches whose pages were given back early (_make_room), in launch order
        self._wake: asyncio.Future[None] | None = None  # the loader waits on a read; a claim wakes it
        self._stopping = False
        # A launched copy failed: the loaded suffix ends above it, and every later launch (a lower
        # page) would be copied, and read from disk, for nothing.
        self._copy_failed = False
        # The highest page whose read failed (a miss, counted), a read ahead included: the suffix
        # ends above it, so neither it (counted again) nor a page below it is read.
        self._read_failed: int | None = None
        self._failed_at: int | None = None  # a disk page that could not be promoted
        self._read_gone = False  # the read of _read_failed found its page evicted (NoPage.GONE)
        self._cut_at: int | None = None  # the highest page not launched because the cache's close began
        self._last_claim = time.perf_counter()
        self._last_claim_tokens = 0
        self._finished = False
        # Resolved once the finish() or aclose() that ended the stream is through (no copy touches
        # the slots, every page released): a later aclose() from another task waits for it.
        self._ended: asyncio.Future[None] | None = None
        self._closed_by_aclose = False
        self._loop = asyncio.get_running_loop()
        # Held for the stream's life: once the cache's close began, _running() raises, but a stream
        # given up or finished during the close must still wait for (or order after) its copies.
        self._transfers = transfers
        self._after = after
        # A copy that delivered gives its pages back as it ends, not at finish(). Its future holds
        # the stream weakly: a stream dropped with copies in flight is collected (and abandoned) now.
        this = weakref.ref(self)

        def gave_back() -> None:
            if (stream := this()) is not None:
                stream._gave_back()

        def failed() -> None:
            if (stream := this()) is not None:
                stream._copy_ended_badly()

        self._this = this
        self._copies = StreamCopies(self._transfers, match.pages - 1, manager.release, gave_back, failed)
        self._loader = asyncio.create_task(self._run())
        # While the loader runs or the stream holds pool pages, a load that finds the pool full
        # waits for room (its pages come back as its copies end) rather than stopping at once.
        manager.load_began()
        self._counted = True
        self._loader.add_done_callback(self._loader_ended)

    def _loader_ended(self, _: asyncio.Task[None]) -> None:
        """Nothing more is launched: the pages never launched (the engine claimed into them) and the
        reads ahead go back now, not at finish(); nothing will copy them."""
        self._release_rest()
        self._gave_back()

    def _gave_back(self) -> None:
        """Once the loader ended and every copy gave its pages back, the stream holds nothing."""
        if self._loader.done() and not self._copies.holding:
            self._loaded_out()

    def _copy_ended_badly(self) -> None:
        """A launched copy failed: the loader launches nothing more (nor waits on a read); the
        pages it would have launched and its reads ahead go back as it ends."""
        self._copy_failed = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _read_ended(self, page: int, read: asyncio.Future[Promotion | NoPage]) -> None:
        """A read of ``page`` ended (also one given up by :meth:`_make_room`): a miss ends the
        suffix above ``page``."""
        if (not read.cancelled() and read.exception() is None
                and (read.result() is NoPage.MISS or read.result() is NoPage.GONE)
                and (self._read_failed is None or page > self._read_failed)):
            self._read_failed = page
            self._read_gone = read.result() is NoPage.GONE

    def _loaded_out(self) -> None:
        """The stream holds no pool page any more (or it ended): it no longer counts as running."""
        if self._counted:
            self._counted = False
            self._manager.load_ended()

    # -- the engine's side ----------------------------------------------------------------------

    @property
    def front(self) -> int:
        """First token of the loaded (or loading) suffix; the engine may compute up to here."""
        return self._front

    async def wait_front(self, token: int) -> int:
        """Wait until :attr:`front` is at or below ``token`` (the load launched the copies of
        ``[token, match.tokens)`` at least), or until it will move no more: the loader launched
        everything it will (it met the claimed front, ran out of pages, hit a fault, or the stream
        or the cache is closing). Returns :attr:`front`, which is above ``token`` in the second case.

        Cancelling the call changes nothing else. Bound it with ``asyncio.timeout`` when a disk
        read may be slow. Raises ``TypeError`` for a non-int, ``ValueError`` for a token outside
        ``[from_token, match.tokens]``.
        """
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"token must be an int, got {type(token).__name__}")
        if not self.from_token <= token <= self.tokens:
            raise ValueError(f"token {token} outside [{self.from_token}, {self.tokens}]")
        while self._front > token and not self._loader.done():
            if self._front_moved is None:
                self._front_moved = asyncio.get_running_loop().create_future()
            # asyncio.wait: a cancelled caller cancels neither the loader nor the shared future.
            waits: set[asyncio.Future[Any]] = {self._front_moved, self._loader}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return self._front

    def _advance(self, front: int) -> None:
        """The loader launched the pages from ``front`` on: wake :meth:`wait_front`."""
        self._front = front
        moved, self._front_moved = self._front_moved, None
        if moved is not None and not moved.done():
            moved.set_result(None)

    def claim(self, end: int) -> int:
        """Claim tokens up to ``end`` for the engine to compute; returns how far it may compute.

        The answer never passes the first token of a page already launched, nor ``match.tokens``;
        it only grows. Claiming also reports that the previous claim was computed (for the cost
        model's prefill rate). Raises ``TypeError`` for a non-int, ``RuntimeError`` once
        :meth:`finish` or :meth:`aclose` was called, also while it runs (the engine claims nothing
        more then; nothing changes), as a second ``finish()`` does.
        """
        if isinstance(end, bool) or not isinstance(end, int):
            raise TypeError(f"end must be an int, got {type(end).__name__}")
        if self._finished:
            # It answered as if open (no more tokens; past the claimed front finish() reported where a
            # fault left the load's front above it) and fed the prefill rate a chunk timed across it.
            if self._closed_by_aclose:
                raise RuntimeError("LoadStream.claim() after aclose(): the stream was closed")
            raise RuntimeError("LoadStream.claim() after finish(): the stream is finished")
        now = time.perf_counter()
        if self._last_claim_tokens:
            # It computed [claimed - tokens, claimed) on top of the tokens before it.
            self._manager.costs.prefill.update(self._last_claim_tokens, now - self._last_claim,
                                               self._claimed - self._last_claim_tokens)
        granted = max(self._claimed, min(end, self._front, self.tokens))
        self._last_claim_tokens, self._last_claim = granted - self._claimed, now
        self._claimed = granted
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)  # the loader re-checks whether its read is still worth waiting for
        return granted

    async def launched(self) -> int:
        """Wait until the loader launched every copy it will (it met the claimed front, ran out of
        pages or hit a fault); returns where the loaded suffix starts if every copy succeeds.

        After this the engine may prefill the uncached tail, waiting on each layer's readiness
        (:meth:`wait_layer` / :meth:`order_layer`) before that layer reads the prefix.
        """
        # Not shield(): another task's aclose() cancels the loader, and its cancellation must not
        # reach this caller, whom nobody cancelled (the front stays where the loader left it).
        if not self._loader.done():
            await asyncio.wait({self._loader})
        if not self._loader.cancelled() and (error := self._loader.exception()) is not None:
            raise error
        return self._front

    async def wait_layer(self, layer: int) -> bool:
        """Wait until layer ``layer`` of every launched copy is in the buffer (after :meth:`launched`).

        CPU: awaits the copies (True when all landed). CUDA: awaits (never blocking the loop) until
        layer ``layer``'s copies are queued, then makes the current stream wait on the GPU; False
        when a load gave the layer up (a fault after launch: :meth:`finish` reports it shortened,
        the engine computes what it lacks). With a layer-wise stream (``layered=True``) layer l is ready before later
        layers; otherwise when the whole copy is.
        """
        self._check_layer(layer)  # first: a bad argument is a TypeError/ValueError whenever it comes
        if self._loader.done() is False:
            raise RuntimeError("wait_layer() before launched(): the set of copies is not fixed yet")
        return await self._copies.wait_layer(layer)

    def order_layer(self, layer: int) -> bool:
        """CUDA: make the engine's current stream wait (on the GPU) for layer ``layer`` of every
        launched copy. No-op where the copies are not CUDA events (CPU, or remote rank workers).

        A layer-wise load is queued a few layers ahead of the GPU (``PACE_BYTES``), so this may
        block the calling thread until layer ``layer``'s copies are queued: call it from the thread
        that launches the engine's kernels; on the event loop, ``await wait_layer(layer)``. Returns
        False when a load gave the layer up (a fault after launch; the stream is still ordered after
        everything that load queued): the layer is not in place, :meth:`finish` reports it.
        """
        self._check_layer(layer)
        copies = self._copies.fix() if self._loader.done() else self._copies.copies()
        return self._copies.order_layer(layer, copies)

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self._manager.layout.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self._manager.layout.num_layers})")

    def _unique_copies(self) -> list[tuple[int, Copy, PageHandle, Tier]]:
        """One entry per launched copy: its first page, the copy, a page reference and the tier."""
        return [(launch.low, launch.copy, launch.handles[0], launch.tier) for launch in self._copies.launches]

    async def finish(self) -> StreamResult:
        """Wait until the load reached the claimed front and its copies are in the buffer.

        The engine claims nothing more after this (:meth:`claim` raises ``RuntimeError`` from the
        call on, also while it waits). A fault shortens the loaded suffix (counted);
        a cancelled ``finish`` stops the load and returns only when no copy touches the slots.
        It returns with every pool reference of the stream given back: ``stats().pool_referenced``
        read right after it counts other holders only (the write-behind keeps a page it is writing
        to disk referenced until the write ended; a read ahead still in flight when the loader
        stopped lands in the background, ``background_jobs``, and gives its page back then);
        ``flush()`` waits for both.
        """
        if self._finished:
            if self._closed_by_aclose:
                # Another task's aclose() may still be quiescing: the caller learns of the close
                # only once no copy touches the slots (then it may reuse them).
                if self._ended is not None and (cancelled := await _wait_through(self._ended)) is not None:
                    raise cancelled
                raise RuntimeError("LoadStream.finish() after aclose(): the stream was closed")
            raise RuntimeError("LoadStream.finish() was already called")
        self._finished = True
        self._ended = self._loop.create_future()
        try:
            try:
                # Not shield(): a loader cut by a loop-wide cancel (a signal handler's, which this
                # caller, run after it, escaped) must not raise CancelledError into a caller nobody
                # cancelled; what it launched settles as a shortened load (as launched() answers).
                if not self._loader.done():
                    await asyncio.wait({self._loader})
                if not self._loader.cancelled() and (error := self._loader.exception()) is not None:
                    raise error
                outcomes = await self._copies.outcomes()
            except BaseException:
                await self._abandon()  # a cancel during it: this call raises its own error anyway
                raise
            return self._settle(outcomes)
        finally:
            _set_done(self._ended)

    async def aclose(self) -> None:
        """Stop the load where it is (nothing more is launched) and release everything. Idempotent.

        Cancelled (or timed out), it still returns only when no copy touches the slots and every
        page is released, then raises ``CancelledError``.
        """
        if self._finished:
            # Another task's finish() or aclose() is ending the stream: return only once it is
            # through (copies may still write the slots until then), waiting through cancellation.
            if self._ended is not None:
                if not self._ended.done():
                    # Stop the load where it is, as an aclose() of its own would: finish() then
                    # settles what was launched (shortened) instead of waiting on a read that may
                    # hang (a stuck file system), which this wait could not be bounded against.
                    self._stopping = True
                    if self._wake is not None and not self._wake.done():
                        self._wake.set_result(None)
                cancelled = await _wait_through(self._ended)
                if cancelled is not None:
                    raise cancelled
            return
        self._finished = True
        self._closed_by_aclose = True
        self._ended = self._loop.create_future()
        try:
            cancelled = await self._abandon()
        finally:
            _set_done(self._ended)
        if cancelled is not None:
            raise cancelled

    async def __aenter__(self) -> LoadStream:
        return self

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # A stream dropped without finish()/aclose() pinned its pool pages for good: warn, as for a
        # dropped Match, and abandon it on its loop (its copies waited for, then every page given
        # back), the close waiting for that. Only reached once the loader ended (it holds us).
        if getattr(self, "_finished", True) or getattr(self, "_loader", None) is None:
            return  # finished, closed, or its __init__ raised before it held anything
        self._finished = True
        _warn(f"unclosed {self!r}: call finish() or aclose() (or use `async with`)", ResourceWarning,
              source=self, stacklevel=2)
        if self._loop.is_closed():
            return  # its pool is gone with it
        try:
            self._loop.call_soon_threadsafe(self._abandon_dropped)
        except RuntimeError:
            pass  # the loop closed meanwhile

    def _abandon_dropped(self, ended: asyncio.Future[None] | None = None) -> None:
        """On the loop: :meth:`_abandon` a dropped stream, tracked (``ended``) so that flush and
        close wait for it."""
        if ended is None:
            ended = self._loop.create_future()
            self._manager.track(ended, lambda: None)
        abandon = asyncio.ensure_future(self._abandon())

        def retrieve(_: asyncio.Future[asyncio.CancelledError | None]) -> None:
            if abandon.cancelled() and not self._stopping:
                # A loop-wide cancel (a signal's handler cutting every task) ended the task before
                # its first step (_abandon itself waits through cancels): nothing was abandoned,
                # the stream's pages stayed pinned until the close. Once more, as quiesce is; the
                # same tracked future, so a flush waiting on it waits for this one too.
                self._abandon_dropped(ended)
                return
            if not abandon.cancelled():
                abandon.exception()  # a failure is counted by _abandon; read here, never left unread
            _set_done(ended)

        abandon.add_done_callback(retrieve)

    def __repr__(self) -> str:
        state = "finished" if self._finished else "open"
        return f"LoadStream(tokens={self.tokens}, from_token={self.from_token}, front={self._front}, {state})"

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- the loader -----------------------------------------------------------------------------

    def _start_of(self, page: int) -> int:
        return max(page * self._t, self.from_token)

    def _slots_of(self, low: int, high: int) -> tuple[torch.Tensor, int]:
        """Slots of pages ``[low, high]`` and the tokens skipped in page ``low``."""
        begin = self._start_of(low)
        end = (high + 1) * self._t
        return self._slots[begin - self.from_token : end - self.from_token], begin - low * self._t

    def _promote_ahead(self, page: int) -> None:
        """Start disk reads for ``page`` and the pages below it, back to front, while fewer than the
        read-ahead are in flight; none for a page claimed, or one the engine will claim first, nor
        at or below a page whose read failed (the suffix ends above it)."""
        for lower in range(page, self._disk_pages.start - 1, -1):
            if len(self._promotions) >= self._ahead:
                return
            if self._read_failed is not None and lower <= self._read_failed:
                return
            if lower in self._promotions:
                continue
            if self._start_of(lower) < self._claimed or not self._lands_in_time(lower):
                return
            read = self._manager.start_promotion(self._keys[lower], True, self._waits)
            read.add_done_callback(functools.partial(_read_ended, self._this, lower))
            self._promotions[lower] = read

    def _lands_in_time(self, page: int) -> bool:
        """Whether a read of ``page`` started now should land before the engine claims into the page
        (reaches its first token: from then on the loader may no longer launch it).

        By the rates: this stream's own disk pace once a page landed (else the cost model's), and
        the engine's prefill time for the tokens between its claim and the page, attention included
        (tokens deep in a long prompt cost more than the average call's: an average rate said the
        engine arrives sooner than it does, and reads that would have landed were not started).
        Always True until the engine claims (it may never: then the load must bring every page) and
        while a rate is unknown.
        """
        if self._claimed <= self.from_token:
            return True
        costs = self._manager.costs
        # One claim's fixed cost: the engine pays at least the one that reaches the page.
        reached = costs.prefill.compute_seconds(self._claimed, self._start_of(page), calls=1)
        page_bytes = self._manager.layout.page_bytes
        elapsed = time.perf_counter() - self._disk_started
        disk = self._disk_landed * page_bytes / elapsed if self._disk_landed and elapsed > 0 else costs.disk.rate
        if reached is None or disk is None:
            return True
        # Reads already in flight land first (or share the device with this one until they do).
        lands = (len(self._promotions) + 1) * page_bytes / disk
        return lands < reached

    async def _read(self, page: int) -> asyncio.Task[Promotion | NoPage] | None:
        """The landed read of ``page``, or None once the engine claimed into the page (or the stream
        stops): the read is then not waited for; ``_release_rest`` adopts it."""
        task = self._promotions[page]
        while not task.done():
            if self._stopping or self._copy_failed or self._start_of(page) < self._claimed:
                return None
            wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._wake = wake
            try:
                # Not cancelled by a cancelled loader: the read stays in _promotions for adoption.
                waits: set[asyncio.Future[Any]] = {task, wake}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._wake = None
        return task

    async def _run(self) -> None:
        manager = self._manager
        transfers = self._transfers
        # Layer by layer, all pool pages go in one launch: the worker then copies layer 0 of every
        # page before layer 1 (launch groups would each run all their layers before the next).
        everything = len(self._pool)
        sizer = None if self._layered else manager.load_launches
        table = manager.pool.table
        page = self.tokens // self._t - 1
        pool_started: float | None = None
        while page >= self._first and not self._stopping and self._start_of(page) >= self._claimed:
            await asyncio.sleep(0)  # bounded host work per loop turn; the engine claims meanwhile
            if self._stopping or self._copy_failed or self._start_of(page) < self._claimed:
                break
            if self._read_failed is not None and page <= self._read_failed:
                # Its read failed (counted) while read ahead, maybe given up since by _make_room:
                # the suffix ends above it; it is not read again (nor counted again). A page the
                # tier evicted since the match ends it too, as a miss, not a fault (review 202).
                if not (self._read_gone and page == self._read_failed):
                    self._failed_at = page
                break
            if manager.closing:
                self._cut_at = page  # the close began: nothing more is launched (withdrawn, not a fault)
                break
            if page in self._pool:
                # The pool pages not launched are [first, page] (launches run from the back): as
                # many as one launch takes, none the engine claimed into.
                turn = time.perf_counter()
                group = everything if sizer is None else sizer.pages()
                low = max(page - group + 1, self._first_unclaimed())
                handles = [self._pool.pop(p) for p in range(low, page + 1)]
                slots, skip = self._slots_of(low, page)
                launch = transfers.load_layers if self._layered else transfers.load
                copy = launch(table.pages_of(handles), slots, skip, self._after)
                if sizer is not None:
                    sizer.record(len(handles), time.perf_counter() - turn)
                pool_started = pool_started or time.perf_counter()
                self._copies.add(low, copy, handles, Tier.POOL)
                self._advance(self._start_of(low))
                page = low - 1
                continue
            self._promote_ahead(page)
            if page not in self._promotions:
                break  # its read would land after the engine got there: the planned meeting point
            read = await self._read(page)
            if read is None:
                break  # the engine claimed into the page while it was read: the fronts met
            del self._promotions[page]  # after the await: a cancelled loader leaves it to _release_rest
            promotion = read.result()
            if promotion is NoPage.FULL:
                # The pool is full: give back what this stream no longer needs, or wait for its
                # copies to end, then read the page again (a stream larger than the pool was cut
                # short here, its copies keeping their pages until the end).
                if await self._make_room(page):
                    continue
                manager.faults.record("pool_exhausted", "no free or evictable pool page for a disk promotion")
                self._failed_at = page
                break
            if promotion is NoPage.WITHDRAWN:
                self._cut_at = page  # the close ended the read's wait for room: nothing was read
                break
            if promotion is NoPage.GONE:
                break  # evicted from disk since the match: the suffix ends above it, not a fault
            if not isinstance(promotion, Promotion):
                self._failed_at = page
                break
            promoted = promotion.handle
            if manager.closing:
                manager.release([promoted])
                self._cut_at = page
                break
            # Only a page this stream read counts for the disk's pace: one already in the pool (or
            # read by another call) landed at once, and would inflate the rate saved across restarts.
            self._disk_landed += promotion.read
            if self._stopping or self._copy_failed or self._start_of(page) < self._claimed:
                manager.release([promoted])  # the engine got here first (or a copy failed): it stays cached
                break
            slots, skip = self._slots_of(page, page)
            launch = transfers.load_layers if self._layered else transfers.load
            copy = launch([table.check(promoted)], slots, skip, self._after)
            self._copies.add(page, copy, [promoted], Tier.DISK)
            self._advance(self._start_of(page))
            page -= 1
        if self._disk_landed:
            manager.costs.disk.update(self._disk_landed * manager.layout.page_bytes,
                                      time.perf_counter() - self._disk_started)
        if pool_started is not None:
            pool = [launch for launch in self._copies.launches if launch.tier is Tier.POOL]
            self._measured = manager.measure_pool_copies([launch.copy.future for launch in pool],
                                                         sum(len(launch.handles) for launch in pool), pool_started)

    async def _make_room(self, page: int) -> bool:
        """The read of ``page`` found the pool full: give back the pages of the reads ahead (landed
        ones at once; running ones when they land, adopted: the pages stay cached and are read again
        from the pool if still there), then those of its copies, oldest first, waiting for each to
        end, until the pool has room; with none left, wait for room as a load holding nothing does
        (bounded), save that the pool pages it has not launched yet make it the first to give up
        when every caller waits for room on the others' pages (review 159). True: there may be
        room, try again (only once room was seen, or the wait for it ended early: a page given back
        that another caller still holds frees nothing, and a retry on it alone would spin), or
        ``page`` is in the pool now (another caller brought it in since
        the read, maybe one ahead, found it full: it is taken as it is, no room needed; two streams
        of one hit cut the one behind short there, ``pool_exhausted``, the page in the pool)."""
        manager = self._manager
        table = manager.pool.table
        key = self._keys[page]
        if table.state_of(key) is not PageState.FREE:
            return True
        for lower, task in self._promotions.items():
            if not task.done():
                manager.adopt_promotion(task)  # should it fail, its callback still ends the suffix
                continue
            self._read_ended(lower, task)  # a miss ends the suffix (its callback may not have run yet)
            if not task.cancelled() and task.exception() is None and isinstance(promoted := task.result(), Promotion):
                manager.release([promoted.handle])
            # else: done without a page (FULL too), nothing to give back
        self._promotions.clear()
        launches = self._copies.launches
        while not table.has_room() and self._returned < len(launches):
            launch = launches[self._returned]
            if not launch.copy.future.done():
                # Not cancelled by a cancelled loader: _abandon quiesces the copies.
                await asyncio.wait({launch.copy.future})
            manager.release(launch.handles)  # copied: evictable now, unless another caller holds them
            # Failed too: it no longer holds them, and must not keep the stream counted as running
            # once the loader ends (review 163).
            self._copies.returned(launch)
            self._returned += 1
        # Its pool pages not launched yet (below this page) are all it holds now: when every caller
        # waits for room on the others', it is the one to give up (its pages go back as it ends).
        return (table.has_room() or table.state_of(key) is not PageState.FREE
                or await manager.wait_for_load_room(holding=bool(self._pool)))

    def _first_unclaimed(self) -> int:
        """The lowest page the engine has not claimed into (``_start_of(page) >= _claimed``)."""
        if self._claimed <= self.from_token:
            return self._first
        return max(self._first, -(-self._claimed // self._t))

    # -- settling -------------------------------------------------------------------------------

    def _settle(self, outcomes: list[BaseException | None]) -> StreamResult:
        manager = self._manager
        self._measured()  # every copy is done: the pool rate is in before finish() returns
        settled = self._copies.settle(outcomes)  # also orders the engine's stream after every copy
        if settled.first_error is not None:
            manager.faults.record("copy_failed", f"stream load copy failed: {settled.first_error!r}")
        # The loaded suffix must be contiguous up to match.tokens.
        loaded_from = self.tokens if settled.loaded_from is None else self._start_of(settled.loaded_from)
        if held := self._copies.handles():  # one call: 64 pages, not 64 calls
            manager.release(held)
        self._release_rest()
        manager.count_loaded(settled.pool_pages, settled.disk_pages)
        withdrawn = settled.withdrawn_pages
        if self._cut_at is not None:
            # Pages the engine had not claimed when the close stopped the loader: not copied.
            withdrawn += sum(1 for p in range(self._first, self._cut_at + 1) if self._start_of(p) >= self._claimed)
        manager.withdraw(withdrawn)
        if self._failed_at is not None or settled.first_error is not None:
            manager.faults.record("load_shortened", "a stream load stopped at a fault; the engine computes the rest")
        self._loaded_out()  # every page given back (a failed copy's too)
        return StreamResult(self.tokens, self.from_token, self._claimed, loaded_from,
                            settled.pool_pages, settled.disk_pages)

    def _release_rest(self) -> None:
        """Pages never launched go back; promotions still running are adopted (released when done)."""
        if self._pool:
            self._manager.release(list(self._pool.values()))
            self._pool.clear()
        for task in self._promotions.values():
            self._manager.adopt_promotion(task)
        self._promotions.clear()

    async def _abandon(self) -> asyncio.CancelledError | None:
        """Stop launching, wait until no copy touches the slots, release every page.

        Waits through cancellation (the engine reuses the slots once its call is over) and returns
        the ``CancelledError`` that arrived meanwhile (None: none), for the caller to raise.
        """
        self._stopping = True
        manager = self._manager
        cancelled: asyncio.CancelledError | None = None
        if not self._loader.done():
            self._loader.cancel()
        while not self._loader.done():
            try:
                await asyncio.wait({self._loader})
            except asyncio.CancelledError as exc:
                cancelled = exc
        if not self._loader.cancelled() and self._loader.exception() is not None:
            manager.faults.record("stream_failed", f"stream loader failed: {self._loader.exception()!r}")
        while True:
            try:
                during_quiesce = await self._copies.quiesce()
                break
            except asyncio.CancelledError as exc:
                # A loop-wide cancel (a signal's handler cutting every task) ended quiesce's own task
                # before its first step: nothing was withdrawn nor waited for. Once more: raising
                # here returned with copies still queued into the slots, their pages never released.
                cancelled = exc
        for launch in self._copies.launches:
            manager.release_after(launch.copy.future, launch.handles)
        self._release_rest()
        self._loaded_out()  # what is still held goes back with background work, which loads wait for
        return during_quiesce if during_quiesce is not None else cancelled


def _read_ended(stream: weakref.ref[LoadStream], page: int, read: asyncio.Future[Promotion | NoPage]) -> None:
    """A read ahead ended; held weakly: a dropped stream's adopted reads do not keep it."""
    if (alive := stream()) is not None:
        alive._read_ended(page, read)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _wait_through(future: asyncio.Future[None]) -> asyncio.CancelledError | None:
    """Wait until ``future`` is done, also through cancellation of the caller (asyncio.wait never
    cancels what it waits on); returns the cancellation that arrived meanwhile, if any."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError as exc:
            cancelled = exc
    return cancelled
