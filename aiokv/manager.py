"""`CacheManager`: the bookkeeping half of the cache, with no engine tensors and no CUDA.

It owns keys, the pool's page table, admission, the disk tier, the counters and every piece of
in-flight work; it decides which pool pages and which slots each transfer touches and hands the
transfer to a :class:`aiokv.transfers.Transfers` (the in-process worker of ``KVCache``, or the
rank workers of a tensor-parallel group). State changes are synchronous code between awaits;
coroutines await only transfer completions, disk completions and commit futures.

Slots reach the manager as validated host int64 tensors (one slot per token); validating them
against the engine's buffer is the caller's job (``KVCache`` does it at its public edge).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from aiokv.config import Admission, CacheConfig
from aiokv.costs import (
    CostModel,
    LoadEstimate,
    RateMeter,
    RatesFileError,
    decode_rates,
    encode_rates,
    read_rates_file,
    write_rates_file,
)
from aiokv.faults import FaultLog
from aiokv.keys import PageKey, Salt, Tokens, namespace_seed, page_keys
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, PageState, Reservation, ReserveOutcome, StaleHandleError
from aiokv.pool import PagePool, run_in_new_thread
from aiokv.results import CacheStatistics, LoadResult, Match, OffloadResult, PrefetchResult, Tier
from aiokv.storage import DiskTier
from aiokv.storage.faults import fault_name
from aiokv.stream import LoadStream
from aiokv.transfers import Copy, CopyWithdrawn, Transfers

log = logging.getLogger("aiokv.cache")


def _nothing(_: object) -> None:
    """A thread's result nobody takes any more (the rates read or write of a cancelled call)."""

RATES_SAVE_INTERVAL_S = 30.0
"""The learned rates are saved at most this often while they change (and at close).
TODO(lead): a ``CacheConfig`` field."""


@dataclass(frozen=True, slots=True)
class Promotion:
    """A disk page in the pool for one call (:meth:`CacheManager._promote`): a reference on it."""

    handle: PageHandle
    read: bool
    """Whether this call read the page from disk. False: it was in the pool already, or another
    call's read brought it in; such a page cost this call no disk time and must not be counted as
    a disk read (it would inflate the learned disk rate, which is saved across restarts)."""


class CacheManager:
    """Keys, tiers and page lifetimes for one layout; bytes move through a :class:`Transfers`.

    ``part`` is mixed into every key (a tensor-parallel rank's head slice when its pages hold only
    its rows, see :func:`aiokv.keys.tp_part`); ``writer`` False makes offloads store nothing (a
    replica that must not write pages). ``register_cuda`` registers the pool with CUDA in this
    process (the in-process worker copies on a GPU). ``device``: the kind of device the bytes move
    to (``"cuda"``, ``"cpu"``, ...; default from ``register_cuda``): rates saved by a cache on
    another kind are not used. ``device_later``: the workers are elsewhere (a tensor-parallel
    group) and their kind becomes known with :meth:`set_device`; until then no rate is read or
    saved (nothing would say which device they belong to).
    """

    def __init__(
        self, config: CacheConfig, layout: KVLayout, *, part: bytes = b"", writer: bool = True,
        register_cuda: bool = False, device: str | None = None, device_later: bool = False,
    ) -> None:
        if device is not None and not isinstance(device, str):
            raise TypeError(f"device must be a str or None, got {type(device).__name__}")
        if device is not None and device_later:
            raise ValueError("device and device_later exclude each other")
        if config.cpu_bytes < layout.page_bytes:
            raise ValueError(f"cpu_bytes {config.cpu_bytes} is smaller than one page ({layout.page_bytes} bytes)")
        self.config = config
        self.layout = layout
        self._part = part
        self._writer = writer
        self._register_cuda = register_cuda
        self._seeds: dict[Salt, bytes] = {}
        self._pool: PagePool | None = None
        self._disk: DiskTier | None = None
        self._transfers: Transfers | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._seen: OrderedDict[PageKey, None] = OrderedDict()
        self._started = False
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None  # the one close; every aclose() waits for it
        self._starting: asyncio.Future[None] | None = None  # resolved when start() has settled
        self.faults = FaultLog(log)
        self.costs = CostModel(config.prefill_tokens_per_s)
        self.device_kind: str | None = None if device_later else device or ("cuda" if register_cuda else "cpu")
        """What the saved rates are keyed by, with the layout's fingerprint (None: not known yet)."""
        for meter in self.costs.meters().values():
            meter.listener = self._rates_changed
        self._rates_dirty = False  # a rate changed since the last save
        self._rates_saved_at: float | None = None  # time.monotonic() of the last save started
        self._rates_lock = asyncio.Lock()  # one write of the file at a time
        self._rates_task: asyncio.Task[None] | None = None  # the last save started in the background
        self._lookups = 0
        self._hit_tokens: Counter[Tier] = Counter()
        self._loaded_tokens: Counter[Tier] = Counter()
        self._miss_tokens = 0
        self._bytes: Counter[str] = Counter()
        self._stored = self._skipped = self._dropped = self._promoted = 0
        self._withdrawn = 0  # pages a call did not copy because the close began first (not a fault)

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self) -> PagePool:
        """Create the pool (usable once its first chunk is ready) and, when configured, the disk tier.

        Raises ``RuntimeError`` after :meth:`aclose`. Returns the pool so the caller can build the
        worker that moves bytes into it, then :meth:`attach` it.
        """
        if self._closed:
            raise RuntimeError("the cache is closed: a closed cache cannot be started again")
        if self._started:
            return self.pool
        self._started = True
        starting = self._starting = asyncio.get_running_loop().create_future()
        try:
            return await self._open()
        finally:
            starting.set_result(None)

    async def _open(self) -> PagePool:
        cfg = self.config
        # Set-up runs in a thread (the loop never blocks on it); usable once the first chunk is
        # prepared, the rest fill in behind (pages of ready chunks only).
        pool = await PagePool.open(
            self.layout,
            cfg.cpu_bytes,
            register_cuda=self._register_cuda,
            chunk_bytes=cfg.pool_chunk_bytes,
            workers=cfg.pool_workers,
        )
        if self._closed:  # aclose() ran while the pool was being set up: it must not outlive the cache
            await pool.aclose()
            raise RuntimeError("the cache was closed while it was starting")
        self._pool = pool
        if cfg.disk is not None:
            # One fault log: the tier counts its I/O faults (disk_eio, ...) where the cache counts its own.
            disk = DiskTier(cfg.disk, self.layout, self._pool, self.faults)
            try:
                await disk.start()
                self._disk = disk
            except OSError as exc:
                self.faults.record("disk_unavailable", f"disk tier at {cfg.disk.directory} is off: {exc}")
                await disk.aclose()
            else:
                if self._closed:  # the close waited for this start: it closes the tier, then the pool goes
                    raise RuntimeError("the cache was closed while it was starting")
                await self._restore_rates(disk)
        return self._pool

    def attach(self, transfers: Transfers) -> None:
        """Use ``transfers`` to move bytes between the engine's slots and the pool."""
        self._transfers = transfers

    async def aclose(self) -> None:
        """Wait (up to ``close_timeout``) for in-flight work and write-behind, then close the disk tier.

        Idempotent; a cancelled ``aclose`` keeps closing in the background and every later call
        waits for that close to end, so the disk tier (whose I/O may still use pool pages) is
        closed before anyone frees the pool. The worker (``transfers``) must be closed by its owner
        after this returns, then the pool (:meth:`close_pool`).
        """
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self._starting is not None:
            await self._starting  # a start in flight may still be opening the disk tier over the pool
        try:
            async with asyncio.timeout(self.config.close_timeout):
                while self._background:
                    # asyncio.wait, not gather: a timeout must not cancel the jobs' futures.
                    await asyncio.wait(set(self._background))
        except TimeoutError:
            self.faults.record("close_timeout", f"{len(self._background)} background jobs still running at close")
        if self._disk is not None:
            # A failure here is counted, not raised: the close task's outcome is what every later
            # aclose() and close_pool() see, and the pool and bridge must still be freed after it.
            try:
                await self._save_rates()
            except Exception as exc:
                self.faults.record("rates_not_saved", f"rates not saved at close: {exc!r}")
            try:
                await self._disk.aclose()
            except Exception as exc:
                self.faults.record("close_failed", f"the disk tier's close failed: {exc!r}")

    async def close_pool(self) -> None:
        """Free the pool (after :meth:`aclose` and the worker that copies into it are closed).

        Waits for the close first: the pool is never freed under an open disk tier.
        """
        await self.aclose()
        self._transfers = None
        if self._pool is not None:
            await self._pool.aclose()

    async def flush(self) -> None:
        """Wait until every page queued for disk so far is written (or dropped)."""
        self._running()
        if self._background:
            # asyncio.wait, not gather: cancelling flush() must not cancel the jobs' futures.
            await asyncio.wait(set(self._background))
        if self._disk is not None:
            await self._disk.flush()
            if self._rates_due():
                self._start_rates_save()
            saving = self._rates_task
            if saving is not None and not saving.done():
                await asyncio.wait({saving})  # also one a rate folded during this flush started

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

    def _running(self) -> tuple[PagePool, Transfers]:
        if self._closed:
            raise RuntimeError("the cache is closed")
        if self._pool is None or self._transfers is None:
            raise RuntimeError("the cache is not started: use `async with KVCache(...)` or await start()")
        return self._pool, self._transfers

    def check_running(self) -> None:
        """Raise ``RuntimeError`` unless started and not closed."""
        self._running()

    # -- the learned rates across restarts -------------------------------------------------------

    def set_device(self, kind: str) -> None:
        """The workers' device kind (``device_later``): the rates are labelled by it from now on and
        the saved rates of that kind are read in the background (``flush``/``aclose`` wait for it).

        Another kind than before (the ranks were replaced by ranks on another device) forgets what
        was measured: those rates belong to the other device. Ignored once closing. Raises
        ``TypeError``/``ValueError`` for a kind that is not a non-empty str.
        """
        if not isinstance(kind, str):
            raise TypeError(f"kind must be a str, got {type(kind).__name__}")
        if not kind:
            raise ValueError("kind must not be empty")
        if kind == self.device_kind or self._closed:
            return
        if self.device_kind is not None:
            log.warning("aiokv: the workers now copy on %s, not %s: rates measured so far forgotten",
                        kind, self.device_kind)
            self.costs.reset()
            self._rates_dirty = False
        self.device_kind = kind
        disk = self._disk
        if disk is not None:
            task = asyncio.ensure_future(self._restore_rates(disk))

            def settled() -> None:
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    self.faults.record("rates_ignored", f"reading the saved rates failed: {error!r}")

            self.track(task, settled)

    async def _restore_rates(self, disk: DiskTier) -> None:
        """Take the rates a previous cache saved in ``disk``'s layout directory, when they are
        ours (this layout, this device kind) and sound; anything else is ignored and counted.
        A meter that measured something since the start keeps its own."""
        kind = self.device_kind
        if kind is None:
            return  # not known yet: read once set_device() names it
        where = disk.files.layout_dir
        async with self._rates_lock:  # never between a save's encode and its rename
            try:
                # A thread the loop does not wait to start (to_thread's first call would start the
                # default executor's thread on the loop).
                data = await run_in_new_thread(functools.partial(read_rates_file, where), "aiokv-rates", _nothing)
                if data is None:
                    return  # a first start
                saved = decode_rates(data, self.layout.fingerprint.hex(), kind)
            except (RatesFileError, OSError) as exc:
                self.faults.record("rates_ignored", f"saved rates in {where} not used ({exc})")
                return
        if self.device_kind != kind:
            return  # relabelled while reading
        meters = self.costs.meters()
        for name, (rate, samples) in saved.rates.items():
            if name == "prefill" and self.config.prefill_tokens_per_s is not None:
                continue  # the engine's own figure wins over a learned one
            if meters[name].samples:
                continue  # measured here since the start: newer than the file
            meters[name].restore(rate, samples)
        if saved.clamped:
            self.faults.record("rates_clamped", f"saved rates out of bounds, clamped: {', '.join(saved.clamped)}",
                               len(saved.clamped))

    def _rates_due(self) -> bool:
        saved = self._rates_saved_at
        return self._rates_dirty and (saved is None or time.monotonic() - saved >= RATES_SAVE_INTERVAL_S)

    def _rates_changed(self) -> None:
        """A meter folded an observation: save the rates in the background when one is due."""
        self._rates_dirty = True
        if self._disk is None or self._closed or not self._rates_due():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # folded off the loop: the next flush or the close saves them
        self._start_rates_save()

    def _start_rates_save(self) -> None:
        self._rates_saved_at = time.monotonic()  # one save started per interval
        task = self._rates_task = asyncio.ensure_future(self._save_rates())

        def settled() -> None:
            error = None if task.cancelled() else task.exception()
            if error is not None:
                self.faults.record("rates_not_saved", f"saving the rates failed: {error!r}")

        self.track(task, settled)  # flush/aclose wait for it

    async def _save_rates(self) -> None:
        """Write the rates file off the loop when they changed since the last save; only the
        directory's lock holder writes. A failed write is counted."""
        async with self._rates_lock:
            disk, kind = self._disk, self.device_kind
            if disk is None or disk.read_only is not None or not self._rates_dirty or kind is None:
                return  # kind None: measured before the workers said which device they copy on
            data = encode_rates(self.costs, self.layout.fingerprint.hex(), kind)
            self._rates_dirty = False
            self._rates_saved_at = time.monotonic()
            try:
                await run_in_new_thread(functools.partial(write_rates_file, disk.files.layout_dir, data),
                                        "aiokv-rates", _nothing)
            except OSError as exc:
                self._rates_dirty = True
                self.faults.record("rates_not_saved", f"rates not saved in {disk.files.layout_dir}: {exc}")

    # -- keys -----------------------------------------------------------------------------------

    def keys(self, tokens: Tokens, salt: Salt = None) -> list[PageKey]:
        """Page keys of the full pages of ``tokens`` under this cache's namespace and ``salt``."""
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

    # -- match ----------------------------------------------------------------------------------

    async def match(self, tokens: Tokens, salt: Salt = None) -> Match:
        """The longest prefix of full pages cached in the pool, then on disk (see ``KVCache.match``)."""
        pool, _ = self._running()
        keys = self.keys(tokens, salt)
        self._lookups += 1
        handles: list[PageHandle] = []
        try:
            for key in keys:
                handle = pool.table.acquire(key)
                reserved = handle is None and pool.table.state_of(key) is PageState.RESERVED
                if reserved and await pool.table.wait_committed(key):
                    handle = pool.table.acquire(key)
                if handle is None:
                    break
                handles.append(handle)
        except BaseException:
            self._release_handles(handles)
            raise
        disk_pages = 0
        if self._disk is not None and len(handles) < len(keys):
            disk_pages = self._disk.keys_present_prefix(keys[len(handles) :])
        self._note_seen(keys)
        t = self.layout.page_tokens
        self._hit_tokens[Tier.POOL] += len(handles) * t
        self._hit_tokens[Tier.DISK] += disk_pages * t
        self._miss_tokens += (len(keys) - len(handles) - disk_pages) * t
        return Match(self, tuple(keys), handles, disk_pages, t, self._release_handles)

    def _release_handles(self, handles: Sequence[PageHandle]) -> None:
        if self._pool is None:
            return
        for handle in handles:
            if not handle.released:
                self._pool.table.release(handle)

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
        promotions: list[asyncio.Task[Promotion | None]] = []
        consumed = 0
        cut = False  # the close began: nothing more was launched (the rest is withdrawn, not a fault)
        started = time.perf_counter()
        try:
            group = self.config.launch_pages
            launched = 0
            while pool_part:
                await asyncio.sleep(0)  # bounded host work per loop turn (validation, then launches)
                if self._closed:
                    # No copy may start once the close began: it frees the pool after the copies
                    # launched so far (a CUDA copy launched after its bridge closed had no waiter).
                    cut = True
                    break
                part, pool_part = pool_part[:group], pool_part[group:]
                lo = 0 if launched == 0 else launched * t - skip
                hi = (launched + len(part)) * t - skip
                ids = [pool.table.check(h) for h in part]
                copies.append((transfers.load(ids, slots[lo:hi], skip if launched == 0 else 0), part, Tier.POOL))
                launched += len(part)
            measured = self._measure([c.future for c, _, _ in copies], launched, started, self.costs.pool,
                                     self.layout.payload_bytes)
            disk_start = max(first, match.pool_pages)
            if self._closed:
                cut = True  # no disk reads either
            else:
                promotions = [asyncio.ensure_future(self._promote(key)) for key in keys[disk_start : match.pages]]
            if promotions:
                # Only the pages these promotions read count (one already in the pool took no disk
                # time); a miss (None) folds nothing: a failed read fails fast.
                tasks = list(promotions)

                def read() -> int:
                    return sum(1 for task in tasks if (p := task.result()) is not None and p.read)

                self._measure(list(tasks), read, time.perf_counter(), self.costs.disk, self.layout.page_bytes,
                              lambda f: f.result() is not None)
            for offset, task in enumerate(promotions):
                # Shielded: a cancelled load still lets the page land in the pool (released later).
                promoted = await asyncio.shield(task)
                consumed += 1
                if promoted is None:
                    break
                handle = promoted.handle
                if self._closed:
                    self._release_handles([handle])
                    cut = True
                    break
                page = disk_start + offset
                page_skip = skip if page == first else 0
                lo = page * t + page_skip - from_token
                hi = (page + 1) * t - from_token
                copies.append(
                    (transfers.load([pool.table.check(handle)], slots[lo:hi], page_skip), [handle], Tier.DISK)
                )
            outcomes = await asyncio.shield(
                asyncio.gather(*(c.future for c, _, _ in copies), return_exceptions=True)
            )
        except BaseException:
            # Nothing may still write the caller's slots once we raise (the engine reuses them).
            await transfers.quiesce([c for c, _, _ in copies], offload=False)
            self._release_handles(pool_part)
            for copy, held, _ in copies:
                self._after(copy.future, held, commit=None)
            for task in promotions[consumed:]:
                self._adopt(task)
            raise
        measured()
        # The valid prefix ends at the first copy that failed (a copy error is a fault, not a raise).
        loaded = {Tier.POOL: 0, Tier.DISK: 0}
        for (_, held, tier), outcome in zip(copies, outcomes, strict=True):
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
        self._loaded_tokens[Tier.POOL] += pool_loaded * t
        self._loaded_tokens[Tier.DISK] += disk_loaded * t
        self._bytes["pool_to_gpu"] += (pool_loaded + disk_loaded) * self.layout.payload_bytes
        launched_pages = sum(len(held) for _, held, _ in copies)
        withdrawn = match.pages - first - launched_pages if cut else 0
        self._withdrawn += withdrawn
        if end < match.tokens and not (withdrawn and pool_loaded + disk_loaded == launched_pages):
            # Cut only by the close (every launched copy landed): withdrawn, not a fault.
            self.faults.record("load_shortened", f"load stopped at token {end} of {match.tokens}")
        return LoadResult(end, match.tokens, from_token, pool_loaded, disk_loaded)

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
        return LoadStream(self, match, slots, from_token, layered)

    def estimate(self, match: Match) -> LoadEstimate:
        """What loading ``match`` would cost by the rates measured so far, and where a split meets."""
        if not isinstance(match, Match):
            raise TypeError(f"match must be a Match, got {type(match).__name__}")
        return self.costs.estimate(match.pool_pages, match.disk_pages, self.layout.page_tokens,
                                   self.layout.page_bytes)

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

        future.add_done_callback(settle)

    def _adopt(self, task: asyncio.Future[Promotion | None]) -> None:
        """Let a promotion nobody waits for finish in the background, then drop its reference."""

        def finish() -> None:
            if not task.cancelled() and task.exception() is None:
                promoted = task.result()
                if promoted is not None:
                    self._release_handles([promoted.handle])

        self.track(task, finish)

    def _after(self, future: asyncio.Future[None], handles: list[PageHandle], commit: bool | None) -> None:
        """When a copy abandoned by a failing caller completes, release (None) or abort its pages."""
        pool = self.pool

        def finish() -> None:
            if not future.cancelled():
                future.exception()  # retrieved: a failed abandoned copy is only counted
            for handle in handles:
                if handle.released:
                    continue
                if commit is None:
                    pool.table.release(handle)
                elif commit:
                    pool.table.commit(handle)
                else:
                    pool.table.abort(handle)

        self.track(future, finish)

    # -- disk promotions ------------------------------------------------------------------------

    async def _promote(self, key: PageKey) -> Promotion | None:
        """Bring ``key`` from disk into the pool and return a reference on it, saying whether this
        call read it (not when it was in the pool or another call's read brought it); None on any
        miss."""
        pool = self.pool
        disk = self._disk
        (res,) = pool.reserve([key])
        if res.outcome in (ReserveOutcome.PRESENT, ReserveOutcome.PENDING):
            return await self._already_in(key, res.outcome)
        # Right after start the pool may still be preparing chunks: wait for them (not for disk I/O:
        # a load's own promotions hold their pages until its copies end, so that could not help).
        while res.outcome is ReserveOutcome.EXHAUSTED and disk is not None and await self._wait_for_room(disk_io=False):
            (res,) = pool.reserve([key])  # a chunk became usable or a page was freed: try again
        if res.outcome in (ReserveOutcome.PRESENT, ReserveOutcome.PENDING):
            return await self._already_in(key, res.outcome)
        if res.outcome is ReserveOutcome.EXHAUSTED or disk is None:
            self.faults.record("pool_exhausted", "no free or evictable pool page for a disk promotion")
            return None
        handle = res.handle
        assert handle is not None
        read = asyncio.ensure_future(disk.read(key, handle))
        try:
            ok = await asyncio.shield(read)
        except asyncio.CancelledError:
            # The kernel may still be writing into the page: free it only once the read is over.
            self.track(read, lambda: self._settle_read(read, handle))
            raise
        except Exception:
            ok = False
        if not ok:
            pool.table.abort(handle)
            self.faults.record("disk_read_failed", "a disk page could not be read back (see disk statistics)")
            return None
        self._promoted += 1
        self._bytes["disk_to_pool"] += self.layout.page_bytes
        kept = pool.table.commit(handle, keep=True)
        assert kept is not None  # keep=True always returns the reference
        return Promotion(kept, read=True)

    async def _already_in(self, key: PageKey, outcome: ReserveOutcome) -> Promotion | None:
        """A reference on ``key``, in the pool (PRESENT) or being brought in by another call
        (PENDING: wait for its commit); nothing was read by this call. None when it is gone."""
        table = self.pool.table
        if outcome is ReserveOutcome.PENDING and not await table.wait_committed(key):
            return None
        handle = table.acquire(key)
        return None if handle is None else Promotion(handle, read=False)

    def _settle_read(self, read: asyncio.Future[bool], handle: PageHandle) -> None:
        """A read abandoned by a cancelled caller finished: keep the page if it verified."""
        ok = not read.cancelled() and read.exception() is None and read.result()
        if handle.released:
            return
        if ok:
            self._promoted += 1
            self.pool.table.commit(handle)
        else:
            self.pool.table.abort(handle)

    # -- offload --------------------------------------------------------------------------------

    async def offload(self, tokens: Tokens, slots: torch.Tensor, salt: Salt = None) -> OffloadResult:
        """Store the full pages of ``tokens`` not already cached (see ``KVCache.offload``).

        ``slots``: host int64, one per token, checked against the engine's buffer by the caller.
        """
        self._running()
        keys = self.keys(tokens, salt)
        if not keys:
            return OffloadResult(0, 0, 0)
        if not self._writer:
            # Replicated heads / MLA on rank > 0: the writer rank stores the page.
            return OffloadResult(0, len(keys), 0)
        admitted_before = None
        if self.config.admission is Admission.SEEN_TWICE:
            admitted_before = {k for k in keys if k in self._seen}
        self._note_seen(keys)
        t = self.layout.page_tokens
        stored = skipped = dropped = withdrawn = 0
        start = 0
        # Rounds: store what the pool can take; when it is full of pages the write-behind still
        # holds, wait (bounded) for them to reach disk and go on, instead of dropping the rest.
        while start < len(keys):
            if self._closed:
                # The close began between rounds: what still needed a copy is withdrawn (dropped,
                # not a fault); pages in the pool or being written meanwhile would have been skipped.
                state_of = self.pool.table.state_of
                held = sum(1 for key in keys[start:] if state_of(key) is not PageState.FREE)
                skipped += held
                withdrawn += len(keys) - start - held
                dropped += len(keys) - start - held
                break
            reservations = self.pool.reserve(keys[start:])
            room = next((i for i, r in enumerate(reservations) if r.outcome is ReserveOutcome.EXHAUSTED),
                        len(reservations))
            counts = await self._store(keys[start : start + room], reservations[:room],
                                       slots[start * t : (start + room) * t], admitted_before)
            stored, skipped, dropped = stored + counts[0], skipped + counts[1], dropped + counts[2]
            withdrawn += counts[3]
            start += room
            if start < len(keys) and not await self._wait_for_room():
                dropped += len(keys) - start
                self.faults.record("pool_exhausted", f"{len(keys) - start} pages not offloaded: the pool is full "
                                   "of referenced pages")
                break
        self._stored += stored
        self._skipped += skipped
        self._dropped += dropped
        self._withdrawn += withdrawn
        return OffloadResult(stored, skipped, dropped)

    async def _wait_for_room(self, *, disk_io: bool = True) -> bool:
        """Wait (``offload_wait`` at most) until a pool page may be free: a chunk still being
        prepared becomes usable, or (``disk_io``) the write-behind or a read releases one. False
        when nothing in flight can free a page, or none came in time."""
        pool, disk = self.pool, self._disk
        waits: list[asyncio.Future[None]] = []
        if not pool.ready:
            waits.append(asyncio.ensure_future(pool.wait_ready()))
        if disk is not None and disk_io:
            busy = disk.statistics()
            if busy.write_behind_queued or busy.in_flight:
                waits.append(asyncio.ensure_future(pool.table.wait_reclaimable()))
        if not waits:
            return False
        try:
            done, _ = await asyncio.wait(waits, timeout=self.config.offload_wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return bool(done)

    async def _store(
        self, keys: Sequence[PageKey], reservations: Sequence[Reservation], slots: torch.Tensor,
        admitted_before: set[PageKey] | None,
    ) -> tuple[int, int, int, int]:
        """Copy the RESERVED pages of one round, commit them and queue them for disk.

        ``slots`` holds ``len(keys) * page_tokens`` host slots. Returns (stored, skipped, dropped,
        withdrawn): withdrawn pages (also dropped) were never copied because the cache began
        closing first, a paced copy still waiting (:class:`CopyWithdrawn`) or a group not launched.
        """
        pool, transfers = self._running()
        new = [(i, r.handle) for i, r in enumerate(reservations) if r.handle is not None]
        skipped = len(reservations) - len(new)  # PRESENT or PENDING: a round holds no EXHAUSTED key
        if not new:
            return 0, skipped, 0, 0
        t = self.layout.page_tokens
        handles = [h for _, h in new]
        index = torch.tensor([i for i, _ in new], dtype=torch.long)
        chosen = slots.view(len(keys), t).index_select(0, index).reshape(-1)
        group = self.config.launch_pages
        copies: list[tuple[Copy, list[PageHandle]]] = []
        unlaunched: list[PageHandle] = []
        try:
            for begin in range(0, len(handles), group):
                # Bounded host work per loop turn: validation above, then each group's launches.
                await asyncio.sleep(0)
                if self._closed:
                    # The close began: nothing more goes to the copy engine (as the pacer's close
                    # withdraws what waits); the close frees the pool once launched copies ended.
                    unlaunched = handles[begin:]
                    break
                part = handles[begin : begin + group]
                copies.append((transfers.offload(chosen[begin * t : (begin + len(part)) * t], [h.page for h in part]),
                               part))
            outcomes = await asyncio.shield(asyncio.gather(*(c.future for c, _ in copies), return_exceptions=True))
        except BaseException:
            # Cancelled (or a launch refused its arguments): the slots may be reused as soon as we
            # return, so no copy may still read them, and launched pages are aborted (their bytes
            # cannot be trusted), the rest at once.
            await transfers.quiesce([c for c, _ in copies], offload=True)
            launched = {id(h) for _, part in copies for h in part}
            for copy, part in copies:
                self._after(copy.future, part, commit=False)
            for handle in handles:
                if id(handle) not in launched:
                    pool.table.abort(handle)
            raise
        # Withdrawn by the close (never ran) is not a failure: aborted alike, counted apart.
        withdrawn = unlaunched + [h for (_, part), out in zip(copies, outcomes, strict=True)
                                  if isinstance(out, CopyWithdrawn) for h in part]
        errors = [out for out in outcomes if out is not None and not isinstance(out, CopyWithdrawn)]
        failed = [h for (_, part), out in zip(copies, outcomes, strict=True)
                  if out is not None and not isinstance(out, CopyWithdrawn) for h in part]
        if errors:
            self.faults.record("copy_failed", f"offload copy failed: {errors[0]!r}")
        if failed or withdrawn:
            bad = {id(h) for h in failed} | {id(h) for h in withdrawn}
            for handle in failed + withdrawn:
                pool.table.abort(handle)
            new = [(i, h) for i, h in new if id(h) not in bad]
        self._bytes["gpu_to_pool"] += len(new) * self.layout.payload_bytes
        commit, to_disk = pool.table.commit, self._disk is not None  # once per page: locals
        for i, handle in new:
            key = keys[i]
            admit = to_disk and (admitted_before is None or key in admitted_before)
            kept = commit(handle, keep=admit)
            if kept is not None:
                self._write_behind(key, kept)
        return len(new), skipped, len(failed) + len(withdrawn), len(withdrawn)

    def _write_behind(self, key: PageKey, handle: PageHandle) -> None:
        disk = self._disk
        if disk is None or disk.contains(key) or disk.read_only is not None:
            # A read-only tier (another cache writes this directory, or the file system is
            # read-only) refuses writes by design: not a full queue, nothing to count here.
            self._release_handles([handle])
            return
        if disk.write_behind_nowait(key, handle):
            self._bytes["pool_to_disk"] += self.layout.page_bytes
        else:
            self._release_handles([handle])
            if not self._closed:  # a closing tier accepts no more writes by design: not a full queue
                self.faults.record("write_behind_full", "write-behind queue full: page kept in the pool only")

    # -- prefetch -------------------------------------------------------------------------------

    async def prefetch(self, tokens: Tokens, salt: Salt = None) -> PrefetchResult:
        """Read the disk pages that follow the pool's prefix of ``tokens`` into the pool."""
        pool, _ = self._running()
        keys = self.keys(tokens, salt)
        in_pool = 0
        for key in keys:
            # Refresh pages already in the pool too: the request they wait for is coming.
            if not pool.table.touch(key) and pool.table.state_of(key) is PageState.FREE:
                break
            in_pool += 1
        if self._disk is None or in_pool == len(keys):
            return PrefetchResult(in_pool, 0)
        count = self._disk.keys_present_prefix(keys[in_pool:])
        tasks = [asyncio.ensure_future(self._promote(key)) for key in keys[in_pool : in_pool + count]]
        try:
            promotions = await asyncio.shield(asyncio.gather(*tasks))
        except asyncio.CancelledError:
            for task in tasks:
                self._adopt(task)
            raise
        promoted = 0
        for promotion in promotions:
            if promotion is None:
                break
            promoted += promotion.read  # not a page another call read (or that was in the pool)
        self._release_handles([p.handle for p in promotions if p is not None])
        return PrefetchResult(in_pool, promoted)

    # -- statistics -----------------------------------------------------------------------------

    def stats(self) -> CacheStatistics:
        """A frozen snapshot of the counters."""
        pool = self.pool.statistics()
        disk = self._disk.statistics() if self._disk is not None else None
        errors = dict(self.faults.counts())  # the disk tier's faults included: it shares the log
        if disk is not None:
            for kind in disk.errors:
                errors.setdefault(fault_name(kind), 0)  # every disk kind reported, zeros included
        return CacheStatistics(
            lookups=self._lookups,
            hit_tokens=MappingProxyType({tier: self._hit_tokens[tier] for tier in Tier}),
            miss_tokens=self._miss_tokens,
            loaded_tokens=MappingProxyType({tier: self._loaded_tokens[tier] for tier in Tier}),
            bytes_moved=MappingProxyType(
                {k: self._bytes[k] for k in ("gpu_to_pool", "pool_to_gpu", "pool_to_disk", "disk_to_pool")}
            ),
            pages_stored=self._stored,
            pages_skipped=self._skipped,
            pages_dropped=self._dropped,
            pages_promoted=self._promoted,
            pages_withdrawn=self._withdrawn,
            pool_free=pool.pages.free,
            pool_reserved=pool.pages.reserved,
            pool_ready=pool.pages.ready,
            pool_referenced=pool.pages.referenced,
            write_behind_queue=disk.write_behind_queued if disk is not None else 0,
            background_jobs=len(self._background),
            errors=MappingProxyType(errors),
            pool=pool,
            disk=disk,
        )
