"""The copies a :class:`aiokv.stream.LoadStream` launched: layer readiness, settling, giving up.

A stream launches from the back of its match to the front: a group of pool pages in one copy (layer
by layer, all of them at once) or one promoted disk page. Each launch is recorded once, with its
page range, its references and its tier, so the engine's per-layer calls, the settling and the
giving up walk one entry per copy: a 64-page layer-wise load is one entry, not 64 (the engine calls
``wait_layer``/``order_layer`` once per layer, on the loop or its launching thread).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiokv.pagetable import PageHandle
from aiokv.results import Tier
from aiokv.transfers import Copy, CopyWithdrawn, Transfers


@dataclass(frozen=True, slots=True)
class Launch:
    """One copy of pages ``[low, high]`` of the match."""

    low: int
    high: int
    copy: Copy
    handles: list[PageHandle]
    """References on the copied pool pages: given back as soon as the copy delivered (a failed or
    withdrawn one's at ``finish``/``aclose``, or once over when the stream needs room)."""
    tier: Tier
    """Where the pages were: the pool, or the disk (read into the pool first)."""


@dataclass(frozen=True, slots=True)
class Settled:
    """What the launched copies delivered (:meth:`StreamCopies.settle`)."""

    loaded_from: int | None
    """First page of the loaded suffix (contiguous up to the match's last page); None: none."""
    pool_pages: int
    """Pages of that suffix copied from the pool."""
    disk_pages: int
    """Pages of that suffix read from disk."""
    withdrawn_pages: int
    """Pages whose copy the cache's close withdrew before it ran (not a fault)."""
    first_error: BaseException | None
    """What the first failed copy raised (a fault); None when none failed."""


class StreamCopies:
    """The launches of one stream, latest (lowest pages) last; ``last_page`` is the match's.

    ``give_back`` (the manager's ``release``): a copy that delivered gives its pages back as it
    ends, then ``gave_back`` is called (None: pages are only given back by the stream's end).
    ``failed`` is called when a copy fails (not one the close withdrew): the loaded suffix ends
    above it, so the stream launches nothing more.
    """

    def __init__(self, transfers: Transfers, last_page: int,
                 give_back: Callable[[Sequence[PageHandle]], None] | None = None,
                 gave_back: Callable[[], None] | None = None,
                 failed: Callable[[], None] | None = None) -> None:
        self._transfers = transfers
        self._last_page = last_page
        self.launches: list[Launch] = []
        self._give_back = give_back
        self._gave_back = gave_back
        self._failed = failed
        self.holding = 0
        """Launches whose pages this stream still holds: copies not over yet, or that failed."""
        self._given_back: set[int] = set()  # ids of the launches whose pages went back (see returned)
        self._fixed: list[Copy] | None = None
        self._cuda = False
        # (engine stream, event) pairs the engine's streams were ordered after: an engine waits on
        # every layer in turn, and a whole-page copy's one event was waited on again for each (32
        # cudaStreamWaitEvent a copy; 32 wait_layer calls held the H200's loop 1.6-1.9 ms).
        self._seen: set[tuple[int, int]] = set()

    def add(self, low: int, copy: Copy, handles: list[PageHandle], tier: Tier) -> None:
        """Record a copy of pages ``[low, low + len(handles))``, launched below every earlier one."""
        launch = Launch(low, low + len(handles) - 1, copy, handles, tier)
        self.launches.append(launch)
        if self._give_back is not None:
            self.holding += 1
        if self._give_back is not None or self._failed is not None:
            copy.future.add_done_callback(functools.partial(self._ended, launch))

    def _ended(self, launch: Launch, future: asyncio.Future[None]) -> None:
        """``launch``'s copy is over. Delivered, nothing reads its pool pages any more (CPU: the copy
        thread is done with it; CUDA: its end event completed, seen by the bridge's waiter, a paced
        load's feed after its ``end``; TP: every rank reported it, a CUDA rank once its event
        completed): its pages go back now, cached and evictable, not at ``finish`` (the engine
        prefills its tail meanwhile, and a load finding the pool full stopped). Its outcome is kept
        in ``future`` for ``settle``. A failed or withdrawn copy keeps them until the stream's end
        (or until it needs room: :meth:`returned`), as before (a launch fault may leave queued
        scatters reading them); a failure (not a withdrawal: the close stops the loader itself) is
        reported to ``failed``. A launch the stream already gave back is not given back again."""
        if future.cancelled() or (error := future.exception()) is not None:
            if (self._failed is not None and not future.cancelled()
                    and not isinstance(error, CopyWithdrawn)):
                self._failed()
            return
        if self._give_back is None or id(launch) in self._given_back:
            return  # the stream gave its pages back already (:meth:`returned`)
        self._give_back(launch.handles)
        self.returned(launch)
        if self._gave_back is not None:
            self._gave_back()

    def returned(self, launch: Launch) -> None:
        """``launch``'s copy is over and its pages went back (the stream gave them back itself to
        make room, a failed copy's included): it no longer counts in ``holding``, and ``handles``
        leaves it out. Idempotent: a launch is uncounted once (review 163: a failed launch given back
        by ``_make_room`` still counted, and the stream ran on in ``loads_running`` after its loader
        ended, holding nothing, until ``finish``)."""
        if id(launch) in self._given_back:
            return
        self._given_back.add(id(launch))
        if self._give_back is not None:
            self.holding -= 1

    def copies(self) -> list[Copy]:
        """The copies launched so far (one per launch), in launch order."""
        return self._fixed if self._fixed is not None else [launch.copy for launch in self.launches]

    def fix(self) -> list[Copy]:
        """The copies once the loader is done (no more launches), worked out once."""
        if self._fixed is None:
            fixed = [launch.copy for launch in self.launches]
            # _cuda before _fixed: order_layer may run this on the engine's launching thread while
            # the loop's wait_layer reads both (seeing _fixed set, it must see _cuda right).
            self._cuda = any(c.event is not None for c in fixed)
            self._fixed = fixed
        return self._fixed

    # -- layer readiness -----------------------------------------------------------------------

    async def wait_layer(self, layer: int) -> bool:
        """:meth:`LoadStream.wait_layer` once the loader is done (``layer`` already checked)."""
        copies = self.fix()
        for c in copies:
            # A layer reported already resolves now; one not yet is handed over when it is (the
            # copy thread wakes the loop only for layers waited on).
            c.want_layer(layer)
        if self._cuda:
            # Only layers not queued yet are awaited: an engine waits on every layer in turn.
            queued = [c.layer_futures[layer] for c in copies
                      if c.paced is not None and not c.layer_futures[layer].done()]
            if queued:
                await asyncio.shield(asyncio.gather(*queued))
            return self.order_layer(layer, copies)
        waits = [c.layer_futures[layer] if c.layer_futures else c.future for c in copies]
        if not all(w.done() for w in waits):  # landed ones cost no loop turn
            await asyncio.shield(asyncio.gather(*waits, return_exceptions=True))
        return all(_landed(w) for w in waits)

    def order_layer(self, layer: int, copies: list[Copy]) -> bool:
        """:meth:`LoadStream.order_layer` over ``copies`` (``layer`` already checked)."""
        landing = True
        events = []
        for c in copies:
            if c.paced is not None:
                c.paced.wait_issued(layer)
                landing = landing and c.paced.queued[layer]
            elif c.event is None and c.future.done() and (c.future.cancelled() or c.future.exception()):
                landing = False  # failed at launch: nothing of it lands
            event = c.layer_events[layer] if c.layer_events else c.event
            if event is not None:
                events.append(event)
        if events:
            self._transfers.order_after(events, self._seen)
        return landing

    # -- settling ------------------------------------------------------------------------------

    async def outcomes(self) -> list[BaseException | None]:
        """Wait (shielded) until every copy is over; what each one raised, None when it delivered."""
        futures = [launch.copy.future for launch in self.launches]
        if not futures:
            return []
        return await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))

    def settle(self, outcomes: list[BaseException | None]) -> Settled:
        """Every copy is over (``outcomes``, one per launch): order the engine's stream after them
        all, work out the loaded suffix and give back every copied page's reference."""
        # Layer-wise copies did not order the engine's stream at launch: whatever it does next
        # (reusing the slots included) comes after every copy.
        unordered = [c.event if c.paced is None else c.paced.end
                     for c in self.copies() if c.event is not None and not c.ordered]
        if unordered:
            self._transfers.order_after(unordered)
        loaded_from: int | None = None
        counted = {Tier.POOL: 0, Tier.DISK: 0}
        withdrawn = 0
        first_error: BaseException | None = None
        expected = self._last_page
        contiguous = True
        # Launches run from the back: the loaded suffix is their prefix up to a gap or a failure.
        for launch, outcome in zip(self.launches, outcomes, strict=True):
            if outcome is not None:
                contiguous = False
                if isinstance(outcome, CopyWithdrawn):
                    withdrawn += launch.high - launch.low + 1
                elif first_error is None:
                    first_error = outcome
            elif contiguous and launch.high == expected:
                loaded_from = launch.low
                counted[launch.tier] += launch.high - launch.low + 1
                expected = launch.low - 1
            else:
                contiguous = False
        return Settled(loaded_from, counted[Tier.POOL], counted[Tier.DISK], withdrawn, first_error)

    def handles(self) -> list[PageHandle]:
        """References the launched copies still hold (not those given back as their copy ended, nor
        those the stream gave back to make room)."""
        given = self._given_back
        return [handle for launch in self.launches if id(launch) not in given for handle in launch.handles]

    async def quiesce(self) -> asyncio.CancelledError | None:
        """Return only when no copy still touches the engine's slots, also when cancelled meanwhile.

        Returns the ``CancelledError`` that arrived during the wait (None: none), for the caller to
        raise once it released everything: ``Transfers.quiesce`` waits through a cancel and leaves
        the raising to its caller's own error, and ``aclose`` has none (review: it was lost).
        """
        # Its own task: the cancel reaches this wait, where it is kept, not the worker's (swallowed).
        waiting = asyncio.ensure_future(self._transfers.quiesce(self.copies(), offload=False))
        cancelled: asyncio.CancelledError | None = None
        while not waiting.done():
            try:
                await asyncio.wait({waiting})
            except asyncio.CancelledError as exc:
                cancelled = exc
        waiting.result()
        return cancelled


def _landed(done: asyncio.Future[bool] | asyncio.Future[None]) -> bool:
    """A layer future resolved True (landed; False: given up), or a whole copy's None (delivered)."""
    if done.cancelled() or done.exception() is not None:
        return False
    result = done.result()
    return result is True or result is None
