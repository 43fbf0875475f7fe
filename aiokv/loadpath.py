"""`LoadPath`: how the manager serves a hit: match, load, disk promotions and prefetch.

A match takes references on the pool's prefix and counts the disk's; a load copies pool pages at
once and reads disk pages into freshly reserved pool pages (promotions, in read groups of one
``DiskTier.read_many`` batch each), copying each group's pages as the group lands, in windows when
they do not all fit (its copies' pages given back before the next window); prefetch promotes (in
the same groups) without copying. :class:`aiokv.stream.LoadStream` (the compute-or-load split) uses
the same promotions through the public members it needs (:meth:`LoadPath.promote`,
:meth:`LoadPath.adopt_promotion`, :meth:`LoadPath.wait_for_load_room`, :meth:`LoadPath.load_began`,
:meth:`LoadPath.load_ended`, :meth:`LoadPath.measure_pool_copies`, and the base's
``running_transfers``, ``release``, ``release_after``, ``closing``, ``withdraw``, ``count_loaded``).
Mixed into :class:`aiokv.manager.CacheManager`; the state is :class:`aiokv.managerbase.ManagerBase`'s.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aiokv.config import DEFAULT_READ_GROUP_BYTES
from aiokv.costs import LoadEstimate, RateMeter
from aiokv.keys import PageKey, Salt, Tokens
from aiokv.managerbase import ManagerBase
from aiokv.pagetable import PageHandle, PageState, ReserveOutcome, StaleHandleError
from aiokv.results import LoadResult, Match, PrefetchResult, Tier
from aiokv.transfers import Copy, CopyWithdrawn

if TYPE_CHECKING:
    from aiokv.storage import DiskTier
    from aiokv.storage.disk import ReadMarks
    from aiokv.stream import LoadStream

TURN_PAGES = 16
"""A match of more full pages gives the loop a turn between hashing the prompt and taking its pages'
references. Each is a few hundred microseconds of loop time for a 16K-token prompt (64 pages of
256), in an engine step that often also settles the last stream and starts the next load: in one
turn they added up to the longest loop callbacks while streaming (issue #10). TODO(lead): a
``CacheConfig`` field."""


READ_GROUP_PAGES = 32
"""At most this many pages in one read group (``CacheConfig.read_group_bytes``; 16 MiB of small pages)."""


def read_group_pages(page_bytes: int, group_bytes: int = DEFAULT_READ_GROUP_BYTES) -> int:
    """Pages in one read group of about ``group_bytes`` (``CacheConfig.read_group_bytes``) for pages
    of ``page_bytes`` bytes: at least one, at most :data:`READ_GROUP_PAGES`."""
    return max(1, min(READ_GROUP_PAGES, group_bytes // page_bytes))


@dataclass(frozen=True, slots=True)
class Promotion:
    """A disk page in the pool for one call (:meth:`LoadPath._promote`): a reference on it."""

    handle: PageHandle
    read: bool
    """Whether this call read the page from disk. False: it was in the pool already, or another
    call's read brought it in; such a page cost this call no disk time and must not be counted as
    a disk read (it would inflate the learned disk rate, which is saved across restarts)."""


@dataclass(slots=True)
class CommitWaits:
    """The waits of one call (a load, a prefetch, a stream) for pages other calls are writing into
    the pool: ``commit_wait`` in all, and one ``commit_wait_expired`` between them
    (:meth:`LoadPath._wait_call`). Each wait took a fresh ``commit_wait`` (a promotion's, a later
    read group's, a later window's): a prefetch whose wait for a page of the pool's prefix ended
    late then waited a whole ``commit_wait`` again for a page past it whose writer was stopped,
    about twice the bound in all (review 214). The bound is the time spent waiting (while any wait
    of the call runs), not a deadline from the first wait: that cut at once a wait that began
    after it, in a call that lives long and waited little (a stream through a long prefill, a load
    in many windows: review 217)."""

    spent: float = 0.0
    """Loop seconds during which a wait of the call ran, up to the start of the current stretch."""
    since: float = 0.0
    """Loop time the current stretch of waits began (while ``running``)."""
    running: int = 0
    """Waits of the call running now (they wait together: the stretch counts once)."""
    expired: list[bool] = field(default_factory=list)
    """Non-empty once one of its waits expired and counted it (``ManagerBase._wait_committed``)."""
    reading: set[PageKey] = field(default_factory=set)
    """Pages the call's own promotions reserved and are reading now. A wait for one of them (a
    later window meets a page its promotions adopted past the last window still read) is not a
    wait for another call: it takes a fresh ``commit_wait`` and spends none of the call's (the
    window expired at once and the load stopped there for no fault: review 217)."""


_CALL_WAITS: contextvars.ContextVar[CommitWaits | None] = contextvars.ContextVar("aiokv_call_waits", default=None)
"""The :class:`CommitWaits` of the call whose read groups :meth:`LoadPath._promote_groups` starts,
or whose promotions :meth:`LoadPath.start_promotion` starts (a stream's): set only while the task
is created, so only that task's context copy holds it (``_promote_group`` and ``promote`` keep
their signatures: tests wrap them). Read only there: a task they spawn inherits it unread."""


@dataclass(slots=True)
class GroupStop:
    """The read groups one :meth:`LoadPath._promote_groups` call started at once: the first of the
    call's pages (its index in the call's keys) whose read failed, where that ends the work (as a
    group's own ``failed``), and how to cut each later group still running. Before (review of
    d058b19), a group stopped only its own reads past its failed page: a later group went on
    reading pages no load could serve (its batch's pages still waiting for an I/O slot, its
    pages that found no room, another call's page given up), holding pool pages and I/O slots."""

    at: int | None = None
    """The call's first page whose failed read ends the work, once a group found one."""
    cuts: dict[int, Callable[[], None]] = field(default_factory=dict)
    """The running groups' cuts by their first page's index (in the call's keys)."""

    def failed(self, page: int) -> None:
        """A group's read of the call's page ``page`` failed (the work ends there): every group
        that begins past it and still runs is cut (no read starts there any more)."""
        if self.at is not None and self.at <= page:
            return
        self.at = page
        for offset, cut in list(self.cuts.items()):
            if offset > page:
                cut()


_GROUP: contextvars.ContextVar[tuple[GroupStop, int] | None] = contextvars.ContextVar("aiokv_read_group", default=None)
"""The :class:`GroupStop` of a read group's call and the index of the group's first page in the
call's keys: set while :meth:`LoadPath._promote_groups` creates the group's task, as
:data:`_CALL_WAITS` (``_promote_group`` keeps its signature: tests wrap it). None: a group alone."""


class NoPage(enum.Enum):
    """Why a promotion (:meth:`LoadPath._promote`) brought no page into the pool."""

    MISS = "miss"
    """Not there: a failed read or a full pool (counted where it happened), or the page another
    call was bringing in did not arrive."""
    WITHDRAWN = "withdrawn"
    """The cache's close began while the promotion waited for room: nothing was read. Not a fault;
    a load or stream counts its pages ``pages_withdrawn``."""
    GONE = "gone"
    """The disk tier no longer held the page when its read was to start: evicted for room since the
    match counted it (or dropped for a fault counted where it was found); or it was evicted while
    its read was under way, before the file was opened (:func:`_evicted_since`, review 214). A
    plain miss, not a fault (review 202: it was counted ``disk_read_failed``, the shortened load
    ``load_shortened``); the tier counts the eviction (``DiskStatistics.evictions``) and the absent
    read (``misses``)."""
    FULL = "full"
    """No room in the pool now, for a caller that frees room itself (``windowed``: a load whose
    own copies hold pool pages): not counted, nothing waited for; the caller waits for its copies,
    gives their pages back and promotes the page again."""


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """Read the end of a future nobody awaits any more (no "exception was never retrieved")."""
    if not future.cancelled():
        future.exception()


def _tier_marks(disk: DiskTier) -> ReadMarks:
    """The tier's counts of reads that met their page evicted under them, and of faults (refused
    files, I/O faults by kind, reads refused while following): taken before a read, for
    :func:`_evicted_since` (``DiskTier.read_marks``: a few counters, ~1 us, not a whole
    ``statistics()`` snapshot, ~10 us, per read group and streamed page)."""
    return disk.read_marks()


def _evicted_since(disk: DiskTier, marks: ReadMarks) -> bool:
    """Whether a read of the tier met its page evicted under it, and the tier counted no fault,
    since ``marks`` (:func:`_tier_marks`).

    A read that started while its page was indexed and lost it to an eviction before it opened the
    file misses (the file is gone: ENOENT, the page out of the index already); the tier counts it
    ``reads_evicted``, no fault. Counted ``disk_read_failed`` (a fault) until review 214, although
    only the budget had spoken. A file gone while its page is still indexed (unlinked by someone
    else) is no such read: it stays ``disk_read_failed`` (review 222: it read as an eviction
    whenever the tier had evicted any page meanwhile, ``evictions`` being the mark then). Any fault
    counted meanwhile keeps a failed read counted, as before: the tier's read says only False, so
    reads running together are told apart by these counts. The counts are tier-wide (review 228):
    any read that found its file gone from outside (``reads_unlinked``) over the window keeps a
    failed read counted too, or one beside another page's eviction, a second read of the same
    unlinked key, or a read of a fan-out directory removed and made again read as GONE."""
    now = disk.read_marks()
    return (now.reads_evicted > marks.reads_evicted and now.faults == marks.faults
            and now.reads_unlinked == marks.reads_unlinked)


class LoadPath(ManagerBase):
    """Match, load, disk promotions and prefetch of the manager (see the module docstring)."""

    loads_running: int = 0
    """Loads, streams and prefetches of this manager in flight (:meth:`load_began`,
    :meth:`load_ended`): a load that holds no pool page and finds none free waits for room only
    while another one runs that is not waiting for room itself (its pages come back when its
    copies end, a prefetch's once its reads ended)."""

    def load_began(self) -> None:
        """A load, stream or prefetch began: it counts in :attr:`loads_running` until :meth:`load_ended`."""
        self.loads_running += 1

    def load_ended(self) -> None:
        """A load, stream or prefetch stopped counting in :attr:`loads_running` (it holds no page
        any more): the callers waiting for room look again (they may all be waiting on each other
        now)."""
        self.loads_running -= 1
        self._wake_room_waiters()

    # -- match ----------------------------------------------------------------------------------

    async def match(self, tokens: Tokens, salt: Salt = None) -> Match:
        """The longest prefix of full pages cached in the pool, then on disk (see ``KVCache.match``)."""
        pool, _ = self._running()
        keys = self.keys(tokens, salt)
        if len(keys) > TURN_PAGES:
            # Bounded host work per loop turn. Nothing is taken yet: a cancel here changes nothing.
            await asyncio.sleep(0)
            pool, _ = self._running()  # the close may have begun meanwhile
        self._lookups += 1
        handles: list[PageHandle] = []
        # A page another call is writing is waited for (its commit is a copy away), but for at most
        # commit_wait in all: a writer that is stopped (a TP rank under SIGSTOP, a stuck driver
        # call) held every lookup of a prompt sharing its pages for as long (review 114). A match
        # touches no caller memory: stopping at the page costs only a shorter hit.
        deadline: float | None = None
        expired = False
        try:
            for key in keys:
                handle = pool.table.acquire(key)
                reserved = handle is None and pool.table.state_of(key) is PageState.RESERVED
                if reserved:
                    deadline = self._commit_deadline() if deadline is None else deadline
                    committed = await self._wait_written(key, deadline, "a match")
                    expired = not committed and pool.table.state_of(key) is PageState.RESERVED
                    if committed:
                        handle = pool.table.acquire(key)
                if handle is None:
                    break
                handles.append(handle)
        except BaseException:
            self._release_handles(handles)
            raise
        disk_pages = 0
        # Not past a page still being written either, though it may be on disk (evicted, offloaded
        # again by the writer that is stuck): its load would promote it, find the writer's
        # reservation and wait for that commit without bound (review 115).
        if self._disk is not None and len(handles) < len(keys) and not expired:
            disk_pages = self._disk.keys_present_prefix(keys[len(handles) :])
        self._note_seen(keys)
        t = self.layout.page_tokens
        self._hit_tokens[Tier.POOL] += len(handles) * t
        self._hit_tokens[Tier.DISK] += disk_pages * t
        self._miss_tokens += (len(keys) - len(handles) - disk_pages) * t
        return Match(self, tuple(keys), handles, disk_pages, t, self._release_handles)

    # -- load -----------------------------------------------------------------------------------

    def check_load(self, match: object, from_token: object) -> int:
        """Validate ``load``'s arguments (nothing changes); returns how many slots it needs."""
        self._running()
        if not isinstance(match, Match):
            raise TypeError(f"match must be a Match, got {type(match).__name__}")
        if not match.belongs_to(self):
            # Checked here, before any await of the call: a cancelled call releases its match.
            raise ValueError("this Match belongs to another KVCache")
        if isinstance(from_token, bool) or not isinstance(from_token, int):
            raise TypeError(f"from_token must be an int, got {type(from_token).__name__}")
        if not 0 <= from_token <= match.tokens:
            raise ValueError(f"from_token {from_token} outside [0, {match.tokens}]")
        if match.released:
            raise StaleHandleError("this Match was already loaded or released")
        return match.tokens - from_token

    async def load(self, match: Match, slots: torch.Tensor, from_token: int) -> LoadResult:
        """Copy tokens ``[from_token, match.tokens)`` of ``match`` into ``slots`` (checked host int64).

        Arguments were checked by :meth:`check_load` and the slots against the engine's buffer.
        """
        pool, transfers = self._running()
        keys, handles = match.take(self)  # raises if the match was released meanwhile
        t = self.layout.page_tokens
        first, skip = divmod(from_token, t)
        self._release_handles(handles[:first])
        pool_part = handles[first:]
        copies: list[tuple[Copy, list[PageHandle], Tier]] = []
        promotions: list[asyncio.Task[list[Promotion | NoPage]]] = []  # one per read group, in order
        landed: list[PageHandle] = []  # promoted pages of the group being launched, not yet in a copy
        consumed = 0
        cut = False  # the close began: nothing more was launched (the rest is withdrawn, not a fault)
        gone_at: int | None = None  # the match's page the disk tier evicted before its read, if the load stopped there
        waits = CommitWaits()  # commit_wait in all, across read groups and windows
        started = time.perf_counter()
        sizer = self.load_launches

        def launch(part: list[PageHandle], page: int, tier: Tier, turn: float) -> None:
            """One launch group: ``part``, pages ``page..`` of the match, into their slots."""
            page_skip = skip if page == first else 0
            lo, hi = page * t + page_skip - from_token, (page + len(part)) * t - from_token
            copies.append((transfers.load(pool.table.pages_of(part), slots[lo:hi], page_skip), part, tier))
            sizer.record(len(part), time.perf_counter() - turn)

        self.load_began()
        try:
            launched = 0
            while pool_part:
                await asyncio.sleep(0)  # bounded host work per loop turn (validation, then launches)
                if self._closed:
                    # No copy may start once the close began: it frees the pool after the copies
                    # launched so far (a CUDA copy launched after its bridge closed had no waiter).
                    cut = True
                    break
                turn = time.perf_counter()
                group = sizer.pages()
                part, pool_part = pool_part[:group], pool_part[group:]
                launch(part, first + launched, Tier.POOL, turn)
                launched += len(part)
            measured = self.measure_pool_copies([c.future for c, _, _ in copies], launched, started)
            page = max(first, match.pool_pages)
            freed = 0  # copies[:freed] are over and gave their pages back (a window ended)
            # The disk part in windows: promote what fits (all of it, when it fits), copy it; where
            # the pool is full, wait for this load's copies, give their pages back and promote the
            # rest. A load larger than the pool was cut short there (its promotions all reserved
            # at once and kept their pages until its copies ended).
            while page < match.pages:
                if self._closed:
                    cut = True  # no disk reads either
                    break
                promotions = self._promote_groups(keys[page : match.pages], windowed=True, waits=waits)
                consumed = 0
                self._measure_promotions(promotions)
                stop = full = False
                for task in promotions:
                    # Shielded: a cancelled load still lets the pages land in the pool (released later).
                    promoted_group = await asyncio.shield(task)
                    consumed += 1
                    landed = [p.handle for p in promoted_group if isinstance(p, Promotion)]
                    run: list[PageHandle] = []  # the group's pages up to its first miss, in order
                    for promoted in promoted_group:
                        if not isinstance(promoted, Promotion):
                            if promoted is NoPage.GONE:
                                gone_at = page + len(run)  # evicted since the match: not a fault
                            full = promoted is NoPage.FULL
                            cut = cut or promoted is NoPage.WITHDRAWN  # the close ended its wait: not a fault
                            stop = True
                            break
                        run.append(promoted.handle)
                    # The run in launch groups, as the pool part (one copy a page was a copy-thread
                    # round trip, or a GPU launch's fixed cost, a page: each a GIL hand-over beside an
                    # engine thread that runs Python).
                    while run:
                        if self._closed:
                            cut = stop = True
                            full = False
                            break
                        turn = time.perf_counter()
                        group = sizer.pages()
                        part, run = run[:group], run[group:]
                        launch(part, page, Tier.DISK, turn)
                        landed = landed[len(part):]  # the run is landed's head: these are in a copy now
                        page += len(part)
                        if run:
                            await asyncio.sleep(0)  # bounded host work per loop turn, as above
                    self._release_handles(landed)  # past a miss or the close's start: not copied
                    landed = []
                    if stop:
                        break
                for task in promotions[consumed:]:
                    self._adopt(task)  # past the window's end: they land and are given back
                promotions, consumed = [], 0
                if not full:
                    break  # all of it, or a miss (counted where it happened), or the close
                # Room for the next window: this load's copies hold pool pages until they end.
                window = copies[freed:]
                if window:
                    ended = await asyncio.shield(
                        asyncio.gather(*(c.future for c, _, _ in window), return_exceptions=True))
                    for _, held, _ in window:
                        self._release_handles(held)  # evictable now, unless another caller holds them
                    freed = len(copies)
                    if any(outcome is not None for outcome in ended):
                        break  # the prefix ends at that copy (settled below): nothing more is worth reading
                elif not await self._wait_for_load_room():
                    # This load holds nothing, and nothing came free in time: others hold the pool.
                    self.faults.record("pool_exhausted", "no free or evictable pool page for a disk promotion")
                    break
            outcomes = await asyncio.shield(
                asyncio.gather(*(c.future for c, _, _ in copies), return_exceptions=True)
            )
        except BaseException:
            # Nothing may still write the caller's slots once we raise (the engine reuses them).
            await transfers.quiesce([c for c, _, _ in copies], offload=False)
            self._release_handles(pool_part)
            self._release_handles(landed)
            for copy, held, _ in copies:
                self._after(copy.future, held, commit=None)
            for task in promotions[consumed:]:
                self._adopt(task)
            raise
        finally:
            self.load_ended()
        measured()
        # The valid prefix ends at the first copy that failed (a copy error is a fault, not a raise).
        loaded = {Tier.POOL: 0, Tier.DISK: 0}
        gave_up = False  # a copy the close withdrew before any rank ran it (TP: held for room)
        for (_, held, tier), outcome in zip(copies, outcomes, strict=True):
            if isinstance(outcome, CopyWithdrawn):
                gave_up = True
                break
            if outcome is not None:
                self.faults.record("copy_failed", f"load copy failed: {outcome!r}")
                break
            loaded[tier] += len(held)
        self._release_handles(pool_part)  # not launched: the close began (else empty)
        for _, held, _ in copies:
            self._release_handles(held)
        for task in promotions[consumed:]:
            self._adopt(task)
        pool_loaded, disk_loaded = loaded[Tier.POOL], loaded[Tier.DISK]
        end = max((first + pool_loaded + disk_loaded) * t, from_token)
        self.count_loaded(pool_loaded, disk_loaded)
        launched_pages = sum(len(held) for _, held, _ in copies)
        if gave_up:  # the valid prefix ends at the withdrawn copy: the rest is withdrawn
            withdrawn = match.pages - first - pool_loaded - disk_loaded
        else:
            withdrawn = match.pages - first - launched_pages if cut else 0
        self.withdraw(withdrawn)
        if (end < match.tokens and not gave_up and not (withdrawn and pool_loaded + disk_loaded == launched_pages)
                and not (gone_at is not None and end >= gone_at * t)):
            # Cut only by the close (every launched copy landed): withdrawn, not a fault; stopped
            # only at a page evicted from disk since the match: a miss for room, not a fault.
            self.faults.record("load_shortened", f"load stopped at token {end} of {match.tokens}")
        return LoadResult(end, match.tokens, from_token, pool_loaded, disk_loaded)

    def measure_pool_copies(self, futures: list[asyncio.Future[Any]], pages: int, started: float
                            ) -> Callable[[], None]:
        """Fold ``pages`` pool pages copied by ``futures`` (launched from ``started``, a
        ``time.perf_counter()``) into the pool's rate (:attr:`costs`), as :meth:`_measure` says:
        once they all succeeded, at the last one's completion or when the returned function is
        called after awaiting them (then the rate is in before the caller returns)."""
        return self._measure(futures, pages, started, self.costs.pool, self.layout.payload_bytes)

    @staticmethod
    def _measure(futures: list[asyncio.Future[Any]], pages: int | Callable[[], int], started: float,
                 meter: RateMeter, page_bytes: int, delivered: Callable[[asyncio.Future[Any]], bool] | None = None,
                 ) -> Callable[[], None]:
        """Fold what ``futures`` delivered (``pages`` pages) over their wall time into ``meter``.

        ``pages`` may be a function, asked once they all succeeded (promotions: how many of them
        read their page; none read, nothing is folded). Folded when the last future completes, or
        earlier by calling the returned function once they are all done: a call that settles its
        result after awaiting the futures calls it, so the rate is in before the call returns (a
        done-callback may still be queued then). Nothing is folded when any future was cancelled
        or failed, or ``delivered`` says it moved nothing: a withdrawn or failed copy moved fewer
        bytes than its pages (and fails fast), so counting it would inflate the rate, which is
        saved across restarts.
        """
        folded = not futures or not pages

        def fold() -> None:
            nonlocal folded
            if not folded and all(f.done() for f in futures):
                folded = True
                if all(not f.cancelled() and f.exception() is None and (delivered is None or delivered(f))
                       for f in futures):
                    moved = pages() if callable(pages) else pages
                    if moved:
                        meter.update(moved * page_bytes, time.perf_counter() - started)

        for future in futures:
            future.add_done_callback(lambda _: fold())
        return fold

    def start_load(self, match: Match, slots: torch.Tensor, from_token: int, layered: bool = False) -> LoadStream:
        """A compute-or-load split over ``match`` (see :class:`aiokv.stream.LoadStream`).

        Arguments were checked by :meth:`check_load` and the slots against the engine's buffer.
        ``layered``: copy layer by layer, with readiness per layer.
        """
        self._running()
        from aiokv.stream import LoadStream  # here: the stream module imports this one

        return LoadStream(self, match, slots, from_token, layered)

    def estimate(self, match: Match) -> LoadEstimate:
        """What loading ``match`` would cost by the rates measured so far, and where a split meets.
        ``TypeError`` for anything but a Match, ``ValueError`` for another cache's match or one
        already loaded or released (``StaleHandleError``), as ``load`` raises for them."""
        if not isinstance(match, Match):
            raise TypeError(f"match must be a Match, got {type(match).__name__}")
        if not match.belongs_to(self):
            raise ValueError("this Match belongs to another KVCache")
        if match.released:
            raise StaleHandleError("this Match was already loaded or released")
        return self.costs.estimate(match.pool_pages, match.disk_pages, self.layout.page_tokens,
                                   self.layout.page_bytes)

    def adopt_promotion(self, task: asyncio.Future[Promotion | NoPage]) -> None:
        """Take over a promotion (:meth:`promote`) its caller no longer waits for: it finishes in
        the background and the reference it brings is dropped (the page stays cached);
        ``flush``/``aclose`` wait for it."""
        self._adopt(task)

    def _adopt(self, task: asyncio.Future[Promotion | NoPage] | asyncio.Future[list[Promotion | NoPage]]) -> None:
        """Let a promotion (or a read group's, :meth:`_promote_group`) nobody waits for finish in
        the background, then drop every reference it brought."""

        def finish() -> None:
            if not task.cancelled() and task.exception() is None:
                result = task.result()
                promoted = result if isinstance(result, list) else [result]
                self._release_handles([p.handle for p in promoted if isinstance(p, Promotion)])

        self.track(task, finish)

    def _measure_promotions(self, tasks: list[asyncio.Task[list[Promotion | NoPage]]]) -> None:
        """Fold the disk pages these read groups read into the disk rate (:meth:`_measure`): only
        pages they read count (one already in the pool took no disk time); a miss folds nothing
        (a failed read fails fast)."""

        def read() -> int:
            return sum(1 for task in tasks for p in task.result() if isinstance(p, Promotion) and p.read)

        def delivered(task: asyncio.Future[Any]) -> bool:
            return all(isinstance(p, Promotion) for p in task.result())

        self._measure(list(tasks), read, time.perf_counter(), self.costs.disk, self.layout.page_bytes, delivered)

    # -- disk promotions ------------------------------------------------------------------------

    def _promote_groups(self, keys: Sequence[PageKey], windowed: bool = False, waits: CommitWaits | None = None,
                        ) -> list[asyncio.Task[list[Promotion | NoPage]]]:
        """One task per read group of ``keys`` (:func:`read_group_pages`), in order, all started
        (``windowed``: as :meth:`_promote`; ``waits``: the call's, shared by every group, else one
        for each group). A group whose read fails where that ends the work cuts the later groups
        (:class:`GroupStop`): they start no read any more."""
        n = read_group_pages(self.layout.page_bytes, self.config.read_group_bytes)
        stop = GroupStop()
        tasks: list[asyncio.Task[list[Promotion | NoPage]]] = []
        token = _CALL_WAITS.set(waits)  # each task copies the context as it is created
        try:
            for i in range(0, len(keys), n):
                group = _GROUP.set((stop, i))
                try:
                    tasks.append(asyncio.ensure_future(self._promote_group(list(keys[i : i + n]), windowed)))
                finally:
                    _GROUP.reset(group)
        finally:
            _CALL_WAITS.reset(token)
        return tasks

    async def _promote_group(self, keys: list[PageKey], windowed: bool = False) -> list[Promotion | NoPage]:
        """:meth:`_promote` of each of ``keys`` (distinct), in order: the pages reserved at once are
        read in one ``DiskTier.read_many`` batch, a page in the pool is held at once, one another
        call brings in as soon as it lands; one that found no room then goes :meth:`_promote`'s
        way (``windowed``: as :meth:`_promote`). Past a page whose read failed (the batch's, or one
        read on its own: one that found no room, one another call gave up) nothing more is read
        or waited for (those pages are :attr:`NoPage.MISS`, not counted again; a wait for a page
        another call brings in is cut, lest it read the page if that call gives it up), for a load
        (``windowed``) always, for a prefetch once the tier dropped that page; nor in the later
        groups of the call (:class:`GroupStop`): a group cut so cancels its batch's read (its pages
        still waiting for an I/O slot are never read; those being read finish, and the batch's
        pages are aborted, not counted), cuts its waits and its page read on its own, and reads
        nothing more; its pages are :attr:`NoPage.MISS` but those it held already (in its result:
        the caller releases them). If cancelled, the batch's pages are settled when its read ends
        (:meth:`_read_batch`) and the references taken (or still to come) are dropped."""
        stop, offset = _GROUP.get() or (GroupStop(), 0)
        if stop.at is not None and stop.at < offset:
            return [NoPage.MISS] * len(keys)  # cut before it began: nothing reserved, nothing read
        pool, disk = self.pool, self._disk
        outcomes = pool.reserve(keys)
        batch = [(i, r.handle) for i, r in enumerate(outcomes)
                 if r.outcome is ReserveOutcome.RESERVED and r.handle is not None]
        if disk is None:  # not reached by callers (they promote only pages on disk): nothing to read
            for _, handle in batch:
                pool.table.abort(handle)
            return [NoPage.MISS] * len(keys)
        got: list[Promotion | NoPage | None] = [None] * len(keys)
        # Pages in the pool are held now, those another call brings in as soon as they land, as a
        # single promotion holds them: left alone until the batch ended, the pool's pressure could
        # evict them meanwhile and the load would stop there (pool_exhausted; review 111).
        landing: dict[int, asyncio.Future[Promotion | NoPage]] = {}
        singles: set[int] = set()  # pages of landing read on their own (_promote), not waits for another call
        waits = _CALL_WAITS.get() or CommitWaits()  # the call's (see _promote_groups)
        reading = [keys[i] for i, _ in batch]
        waits.reading.update(reading)
        tier = disk  # (narrowed: the closures below see a DiskTier)
        failed = len(keys)  # the first page whose read failed, when the pages past it are not worth reading
        cut = False  # an earlier group of the call cut this one (GroupStop): failed is -1
        read: asyncio.Future[list[bool]] | None = None  # the batch's read while the group awaits it
        awaited: int | None = None  # the page of landing the group awaits now

        def stop_past(at: int) -> None:
            # A load's read failed at page ``at``: no read starts past it. A page another call was
            # bringing in is no longer waited for: its wait is cut, so that it does not read the
            # page itself (``again``) when that call gives it up (a read under way finishes). The
            # one the group awaits is cancelled only: the group sees it cut (or its page, when it
            # landed first) and lets it go.
            for j in [j for j in landing if j > at and j != awaited]:
                wait = landing.pop(j)
                wait.cancel()
                self._adopt(wait)
            if awaited is not None and awaited > at:
                landing[awaited].cancel()

        def cut_here() -> None:
            # An earlier group's read failed (GroupStop.failed): this one is past the work's end.
            nonlocal failed, cut
            failed, cut = -1, True
            if read is not None:
                read.cancel()  # its jobs still waiting for an I/O slot leave, those reading finish
            stop_past(-1)

        def note(j: int, promoted: Promotion | NoPage) -> None:
            # Page ``j``'s promotion missed: the work ends there (as a failed read of the batch).
            nonlocal failed
            if ((promoted is NoPage.MISS or promoted is NoPage.GONE) and j < failed
                    and (windowed or not tier.contains(keys[j]))):
                failed = j
                stop_past(j)
                stop.failed(offset + j)

        async def noted(j: int, promotion: Callable[[], Awaitable[Promotion | NoPage]]) -> Promotion | NoPage:
            # A page of landing, in a task of its own: its miss ends the work in the step it is
            # known, not once the group gets to the page (in order): a later page's wait could
            # read its page meanwhile. (A factory: a task cut before its first step never runs it.)
            promoted = await promotion()
            note(j, promoted)
            return promoted

        for i, r in enumerate(outcomes):
            if r.outcome is ReserveOutcome.PRESENT:
                held = pool.table.acquire(keys[i])
                if held is not None:
                    got[i] = Promotion(held, read=False)
            elif r.outcome is ReserveOutcome.PENDING:
                # The call's waits stop together: one commit_wait_expired (reviews 117, 214).
                landing[i] = asyncio.ensure_future(
                    noted(i, functools.partial(self._already_in, keys[i], r.outcome, waits, windowed)))
        stop.cuts[offset] = cut_here
        try:
            if batch:
                handles = [handle for _, handle in batch]
                # Evicted since the caller saw them: read anyway (the tier counts the misses).
                gone = [not disk.contains(keys[i]) for i, _ in batch]
                marks = _tier_marks(disk)
                read = asyncio.ensure_future(disk.read_many(reading, handles))
                try:
                    oks = await self._read_batch(read, handles)
                finally:
                    read = None
                    waits.reading.difference_update(reading)  # landed, aborted or left to settle
                if oks is None:
                    # Cut while it read (its read cancelled, nothing writes into the pages now):
                    # no page of it is served, none is a fault.
                    for i, handle in batch:
                        pool.table.abort(handle)
                        got[i] = NoPage.MISS
                else:
                    if not all(oks) and _evicted_since(disk, marks):
                        # Evicted while the batch was read (see _evicted_since): misses, not faults.
                        gone = [absent or (not ok and not disk.contains(keys[i]))
                                for (i, _), ok, absent in zip(batch, oks, gone, strict=True)]
                    for (i, handle), ok, absent in zip(batch, oks, gone, strict=True):
                        got[i] = self._landed_or_gone(handle, ok, absent)
                        if not ok and i < failed and (windowed or not disk.contains(keys[i])):
                            failed = i
                    if 0 <= failed < len(keys):
                        stop_past(failed)
                        stop.failed(offset + failed)  # the later groups read nothing more
            missed: NoPage | None = None
            for i, key in enumerate(keys):
                if i > failed:
                    # Past a failed read (the batch's other pages were read beside it): a load's
                    # prefix ends there, so its later pages are neither read (one that found no
                    # room when the failed page's abort freed one was) nor waited for. A prefetch
                    # goes on while the failed page stays on disk (an EIO): a load reads it again
                    # and finds the rest in the pool; past a page the tier dropped, no match
                    # reaches them. Not counted: the failed page was (or an earlier group's).
                    if got[i] is None:
                        got[i] = NoPage.MISS
                    continue
                if got[i] is None and i not in landing:
                    if missed is not None:
                        # The prefix ends at a page that found no room (or failed): the group's
                        # later pages without room are misses at once, not one wait for room each
                        # (those waits ran one after another; single promotions waited together:
                        # review 111). After a FULL they are FULL too: the caller promotes them again.
                        got[i] = missed
                    else:
                        # In a task of its own, as a wait: a cut ends it (a read under way settles).
                        landing[i] = asyncio.ensure_future(
                            noted(i, functools.partial(self._promote, key, windowed, waits=waits)))
                        singles.add(i)
                if i in landing:
                    wait = landing[i]
                    awaited = i
                    try:
                        got[i] = await asyncio.shield(wait)  # a cancel here leaves it to _adopt
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if not (cut and wait.cancelled()) or (task is not None and task.cancelling()):
                            raise
                        got[i] = NoPage.MISS  # cut (GroupStop): not counted
                    finally:
                        awaited = None
                    del landing[i]
                    promoted = got[i]
                    if i in singles and promoted in (NoPage.MISS, NoPage.FULL, NoPage.GONE):
                        missed = NoPage.MISS if promoted is NoPage.GONE else promoted
                if ((got[i] is NoPage.MISS or got[i] is NoPage.GONE) and i < failed
                        and (windowed or not disk.contains(key))):
                    # A page brought in on its own (one another call gave up, read again here; one
                    # that found no room) that missed ends the work as a failed read of the batch:
                    # the later pages that found no room were read one by one into the room its
                    # abort freed, and a page another call brings in was read again (review 263).
                    failed = i
                    stop_past(i)
                    stop.failed(offset + i)
        except BaseException:
            for i, wait in landing.items():
                if i in singles:
                    wait.cancel()  # its read settles when it ends (as when it was awaited here)
                self._adopt(wait)  # its reference, once it has one, is dropped
            # Adopted once: a wait still running whose miss is noted later (note, stop_past) must
            # not adopt the others again (one owner each; a second release is skipped, not relied on).
            landing.clear()
            self._release_handles([p.handle for p in got if isinstance(p, Promotion)])
            raise
        finally:
            del stop.cuts[offset]
        return [p if p is not None else NoPage.MISS for p in got]

    async def _read_batch(self, read: asyncio.Future[list[bool]], handles: list[PageHandle]) -> list[bool] | None:
        """``read`` (``disk.read_many`` of ``handles``' pages), shielded; an unexpected failure reads
        as misses. None: ``read`` itself was cancelled (a cut group's, :class:`GroupStop`), not this
        task: the tier returned once nothing wrote into the pages any more, the caller aborts them.
        If this task is cancelled, the batch's pages are settled once its read ends: the kernel may
        still be writing into them, so they are freed only then."""
        try:
            return await asyncio.shield(read)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if read.cancelled() and not (task is not None and task.cancelling()):
                return None
            self.track(read, lambda: self._settle_reads(read, handles))
            raise
        except Exception:
            return [False] * len(handles)

    async def promote(self, key: PageKey, windowed: bool = False,
                      waits: CommitWaits | None = None) -> Promotion | NoPage:
        """Bring the disk page ``key`` into the pool: a :class:`Promotion` holding a reference the
        caller releases (:meth:`release`), or why not (:class:`NoPage`: a miss, counted; or
        withdrawn by the close while it waited for room, which the caller counts with
        :meth:`withdraw`; ``windowed``: :attr:`NoPage.FULL` when there is no room now, for a
        caller that frees room itself, then :meth:`wait_for_load_room` when it holds nothing).
        A caller that stops waiting hands the task to :meth:`adopt_promotion`. ``waits``: the
        caller's (:class:`CommitWaits`), when its promotions share one ``commit_wait``; None: the
        one :meth:`start_promotion` gave its task, else this promotion's own."""
        return await self._promote(key, windowed, waits=_CALL_WAITS.get() if waits is None else waits)

    def start_promotion(self, key: PageKey, windowed: bool, waits: CommitWaits) -> asyncio.Task[Promotion | NoPage]:
        """:meth:`promote` of ``key`` in a task of its own, sharing ``waits`` (the caller's: a
        stream's, one ``commit_wait`` for all its promotions' waits; review 217). Passed through
        the task's context, not an argument: :meth:`promote` is called as ``promote(key,
        windowed)``, which tests wrap."""
        token = _CALL_WAITS.set(waits)  # the task copies the context as it is created
        try:
            return asyncio.ensure_future(self.promote(key, windowed))
        finally:
            _CALL_WAITS.reset(token)

    async def wait_for_load_room(self, holding: bool = False) -> bool:
        """:meth:`_wait_for_load_room`, for a stream that found no page free and gave back every
        page it could. ``holding``: it still holds pool pages it gives back if it gives up (its
        pages not launched yet, below the page it reads); when every load and stream waits for room
        and nothing in flight frees a page, such a caller gives up first (False at once)."""
        if not holding:
            return await self._wait_for_load_room()
        task = asyncio.current_task()
        self._room_holders.add(task)
        try:
            return await self._wait_for_load_room()
        finally:
            self._room_holders.discard(task)

    async def _promote(self, key: PageKey, windowed: bool = False, again: bool = True,
                       waits: CommitWaits | None = None) -> Promotion | NoPage:
        """Bring ``key`` from disk into the pool and return a reference on it, saying whether this
        call read it (not when it was in the pool or another call's read brought it); else why not
        (:class:`NoPage`: a miss, counted here, or withdrawn by the close while it waited).
        ``windowed``: no room is :attr:`NoPage.FULL` at once (the caller frees room itself).
        ``again``: a page another call was bringing in and gave up is read by this one (once)."""
        pool = self.pool
        disk = self._disk
        (res,) = pool.reserve([key])
        if res.outcome in (ReserveOutcome.PRESENT, ReserveOutcome.PENDING):
            return await self._already_in(key, res.outcome, waits, windowed=windowed, again=again)
        if windowed and res.outcome is ReserveOutcome.EXHAUSTED:
            return NoPage.FULL
        # Right after start the pool may still be preparing chunks: wait for them (not for disk I/O:
        # a load's own promotions hold their pages until its copies end, so that could not help).
        while res.outcome is ReserveOutcome.EXHAUSTED and disk is not None and await self._wait_for_room(disk_io=False):
            if self._closed:
                # The close began during the wait: no read (the tier is closing, and its refusal
                # was once counted disk_read_failed); the caller counts the page withdrawn.
                return NoPage.WITHDRAWN
            (res,) = pool.reserve([key])  # a chunk became usable or a page was freed: try again
        if res.outcome in (ReserveOutcome.PRESENT, ReserveOutcome.PENDING):
            return await self._already_in(key, res.outcome, waits, windowed=windowed, again=again)
        if res.outcome is ReserveOutcome.EXHAUSTED or disk is None:
            self.faults.record("pool_exhausted", "no free or evictable pool page for a disk promotion")
            return NoPage.MISS
        handle = res.handle
        assert handle is not None
        gone = not disk.contains(key)  # evicted since the caller saw it: read anyway (the tier counts the miss)
        marks = None if gone else _tier_marks(disk)
        read = asyncio.ensure_future(disk.read(key, handle))
        if waits is not None:
            waits.reading.add(key)  # the call's own read (see CommitWaits.reading)
        try:
            ok = await asyncio.shield(read)
        except asyncio.CancelledError:
            # The kernel may still be writing into the page: free it only once the read is over.
            self.track(read, lambda: self._settle_read(read, handle))
            raise
        except Exception:
            ok = False
        finally:
            if waits is not None:
                waits.reading.discard(key)
        if not ok and marks is not None:
            gone = _evicted_since(disk, marks) and not disk.contains(key)
        return self._landed_or_gone(handle, ok, gone)

    async def _wait_for_load_room(self) -> bool:
        """A load or stream that gave back every page it could found none free: True once there is
        room (at once if there is now), or once the close began (the caller looks at
        :attr:`closing`); False after ``offload_wait``, or at once when nothing can free a page.

        A page may come free while a chunk is being prepared, disk I/O runs (a read, the
        write-behind), background work is pending (promotions adopted past a window, abandoned
        copies), or another load, stream or prefetch runs that is not waiting for room itself: its
        pages come back when its copies (a prefetch's reads) end (two loads that each filled half
        the pool make progress one after the other). When none of that holds, every page not free
        is held by callers waiting for room (or by the engine): they waited for each other until
        ``offload_wait`` (review 159). Then a
        caller that holds pool pages (:meth:`wait_for_load_room` with ``holding``) gives up, its
        pages go back as it ends and the others look again; with none holding any, this one gives
        up. The state is looked at again whenever one of those may have changed (a page given
        back, a chunk ready, a load or stream ended or began to wait, the background emptied)."""
        pool = self.pool
        if pool.table.has_room():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.offload_wait
        holding = asyncio.current_task() in self._room_holders
        self._room_waiters += 1
        self._wake_room_waiters()  # one more caller that frees nothing while it waits
        try:
            while True:
                if self._closed:
                    return True
                if pool.table.has_room():
                    return True
                if self._nothing_frees_room() and (holding or not self._room_holders):
                    return False
                # Both registered now, before any await: nothing between the look and the wait is missed.
                waits: list[asyncio.Future[Any]] = [pool.table.wait_reclaimable(), self._wait_room_changed()]
                if not pool.ready:
                    waits.append(asyncio.ensure_future(pool.wait_ready()))
                disk = self._disk
                if disk is not None and self._disk_writes(disk):
                    # The write-behind's end gives its references back, but a page another caller
                    # still holds (the engine's match, a waiting stream) goes onto no LRU and wakes
                    # nobody: without this the waiters slept to offload_wait once the disk was idle.
                    waits.append(asyncio.ensure_future(disk.flush()))
                left = deadline - loop.time()
                if left <= 0 or not await self._first_of(waits, left):
                    return False
        finally:
            self._room_waiters -= 1

    def _nothing_frees_room(self) -> bool:
        """Whether nothing in flight can free a pool page: every load and stream running waits for
        room (:meth:`_wait_for_load_room`), no background work is pending, every chunk is usable
        and the disk tier neither reads nor writes."""
        pool = self.pool
        if self.loads_running > self._room_waiters or self._background or not pool.ready:
            return False
        disk = self._disk
        if disk is not None:
            busy = disk.statistics()
            if busy.write_behind_queued or busy.write_behind_writing or busy.in_flight:
                return False
        # A reservation in flight (an offload's copy, a TP rank's) is committed onto the LRU or
        # into the write-behind, or aborted: it frees a page as a copy does (two loads gave up at
        # once beside an offload still copying, where they had waited for its pages before 62ee642).
        return not pool.table.statistics().reserved

    @staticmethod
    def _disk_writes(disk: DiskTier) -> bool:
        """Whether ``disk``'s write-behind holds pages: queued, or being written."""
        busy = disk.statistics()
        return bool(busy.write_behind_queued or busy.write_behind_writing or busy.writes_in_flight)

    def _landed_or_gone(self, handle: PageHandle, ok: bool, gone: bool) -> Promotion | NoPage:
        """:meth:`_read_into_pool`, but a read that missed a page the tier no longer held when it
        was started, or that it evicted under the read (``gone``) aborts the page as
        :attr:`NoPage.GONE`, not a fault."""
        if not ok and gone:
            self.pool.table.abort(handle)
            return NoPage.GONE
        return self._read_into_pool(handle, ok)

    def _read_into_pool(self, handle: PageHandle, ok: bool) -> Promotion | NoPage:
        """A promotion's read of ``handle``'s reserved page ended: commit it (a reference kept) or
        abort it (a miss, counted)."""
        pool = self.pool
        if not ok:
            pool.table.abort(handle)
            self.faults.record("disk_read_failed", "a disk page could not be read back (see disk statistics)")
            return NoPage.MISS
        self._promoted += 1
        self._bytes["disk_to_pool"] += self.layout.page_bytes
        kept = pool.table.commit(handle, keep=True)
        assert kept is not None  # keep=True always returns the reference
        return Promotion(kept, read=True)

    async def _already_in(self, key: PageKey, outcome: ReserveOutcome,
                          waits: CommitWaits | None = None, windowed: bool = False,
                          again: bool = True) -> Promotion | NoPage:
        """A reference on ``key``, in the pool (PRESENT) or being brought in by another call
        (PENDING: wait for its commit, ``commit_wait`` at most: a miss then, as a match stops
        there; review 115); nothing was read by this call. A miss when it is gone. ``waits``: the
        call's (:class:`CommitWaits`: ``commit_wait`` in all and one expiry between its waits; a page its
        own promotions are reading takes a fresh ``commit_wait``, :attr:`CommitWaits.reading`);
        None: this promotion's own.

        A page the other call gave up (an offload cancelled or whose copy failed, another load's
        read that failed: aborted) is promoted from disk by this call when the disk still holds
        it, once (``again``; ``windowed`` as :meth:`_promote`): before, the abort was a miss, and a
        load of pages all on disk stopped at the first one a cancelled offload had reserved,
        counted ``load_shortened`` (review 195), where a match in its place goes on to the disk. So
        is a page committed and evicted for room before this call looked (review 204); one reserved
        again by a third call meanwhile is waited for in turn, within the same bound (review 205)."""
        table = self.pool.table
        handle = None
        waits = CommitWaits() if waits is None else waits
        if outcome is not ReserveOutcome.PENDING or await self._wait_call(key, waits, "a load"):
            # Committed, but the waiter resumes loop hops later: a page committed with no reference
            # (the disk held it already) may have been evicted for room meanwhile. Taken for a miss,
            # the load stopped there with the page still on disk (review 204): read again below.
            handle = table.acquire(key)
            # Evicted and reserved again by a third call before this one looked (another load's
            # read of it, an offload): waited for in turn, within the same bound. Taken for a
            # miss (not FREE, so not read below), the load stopped there (review 205).
            while (handle is None and table.state_of(key) is PageState.RESERVED
                   and await self._wait_call(key, waits, "a load")):
                handle = table.acquire(key)
        if handle is not None:
            return Promotion(handle, read=False)
        disk = self._disk
        if (again and not self._closed and disk is not None and table.state_of(key) is PageState.FREE
                and disk.contains(key)):
            return await self._promote(key, windowed, again=False, waits=waits)
        return NoPage.MISS

    async def _wait_call(self, key: PageKey, waits: CommitWaits, who: str) -> bool:
        """:meth:`_wait_written` for a wait of the call of ``waits``: within what is left of its
        ``commit_wait`` (time spent while any of its waits ran; waits that run together spend it
        together), one expiry counted between them. A page the call's own promotions are reading
        (:attr:`CommitWaits.reading`) takes a fresh ``commit_wait`` and spends none of it."""
        if key in waits.reading:
            return await self._wait_written(key, self._commit_deadline(), who, waits.expired)
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not waits.running:
            waits.since = now
        waits.running += 1
        deadline = now + self.config.commit_wait - waits.spent - (now - waits.since)
        try:
            return await self._wait_written(key, deadline, who, waits.expired)
        finally:
            waits.running -= 1
            if not waits.running:
                waits.spent += loop.time() - waits.since

    def _settle_reads(self, read: asyncio.Future[list[bool]], handles: list[PageHandle]) -> None:
        """A batch read abandoned by a cancelled caller finished: keep each page that verified."""
        oks = read.result() if not read.cancelled() and read.exception() is None else [False] * len(handles)
        for handle, ok in zip(handles, oks, strict=True):
            self._settle_page(handle, ok)

    def _settle_read(self, read: asyncio.Future[bool], handle: PageHandle) -> None:
        """A read abandoned by a cancelled caller finished: keep the page if it verified."""
        self._settle_page(handle, not read.cancelled() and read.exception() is None and read.result())

    def _settle_page(self, handle: PageHandle, ok: bool) -> None:
        """Commit (``ok``) or abort an abandoned read's reserved page, unless the close freed it."""
        if handle.released:
            return
        if ok:
            self._promoted += 1
            self.pool.table.commit(handle)
        else:
            self.pool.table.abort(handle)

    # -- prefetch -------------------------------------------------------------------------------

    async def prefetch(self, tokens: Tokens, salt: Salt = None) -> PrefetchResult:
        """Read the disk pages that follow the pool's prefix of ``tokens`` into the pool."""
        pool, _ = self._running()
        keys = self.keys(tokens, salt)
        table = pool.table
        in_pool = 0
        # A page another call is writing is waited for, as a match does (commit_wait at most, in
        # all). It was counted in the pool and passed (review 202): when its writer then gave it
        # up (an offload cancelled, a copy or read failed), the prefetch had reported a page that
        # was not there and read nothing, and the load after it read the page from disk itself.
        # The same bound holds for its promotions' waits (commit_wait for the call: reviews 214, 217).
        waits = CommitWaits()
        expired = waits.expired
        for key in keys:
            # Refresh pages already in the pool too: the request they wait for is coming.
            if not table.touch(key):
                if table.state_of(key) is not PageState.RESERVED:
                    break
                if not (await self._wait_call(key, waits, "a prefetch") and table.touch(key)):
                    break  # given up (read from disk below when it is there), or its writer is stopped
            in_pool += 1
        # Not past a page whose writer is stopped: its promotion would wait for the same writer.
        if self._disk is None or in_pool == len(keys) or expired or self._closed:
            return PrefetchResult(in_pool, 0)
        count = self._disk.keys_present_prefix(keys[in_pool:])
        # Counted as a load running until its pages went back: between its reads' end and its
        # release (the gather, the shield: a few loop turns) it holds pages that come back while
        # the disk is idle and nothing is reserved, and a load waiting for room that looked then
        # gave up (pool_exhausted) a moment before they went onto the LRU. It never waits for room
        # loads hold itself (only for chunks being prepared), so they never wait on each other.
        self.load_began()
        try:
            tasks = self._promote_groups(keys[in_pool : in_pool + count], waits=waits)
            gathered = asyncio.gather(*tasks)
            try:
                groups = await asyncio.shield(gathered)
            except BaseException:
                # Cancelled, or a group raised: the others go on in the background and drop what they
                # bring (before, only a cancel adopted them; a raise left their references for good).
                for task in tasks:
                    self._adopt(task)
                # Nobody awaits the gather now: its end (a group cancelled too, by a loop-wide cancel,
                # or raising) is read here, never logged as "exception was never retrieved".
                gathered.add_done_callback(_read_outcome)
                raise
            promotions = [p for group in groups for p in group]
            self._release_handles([p.handle for p in promotions if isinstance(p, Promotion)])
        finally:
            self.load_ended()  # its pages are evictable (or in the background's hands): waiters look again
        promoted = 0
        for promotion in promotions:
            if not isinstance(promotion, Promotion):
                break  # a miss (counted), or withdrawn by the close (counted below)
            promoted += promotion.read  # not a page another call read (or that was in the pool)
        withdrawn = sum(1 for p in promotions if p is NoPage.WITHDRAWN)
        if withdrawn:
            self.withdraw(withdrawn)  # pages the close kept this prefetch from reading, as load counts them
        return PrefetchResult(in_pool, promoted)
