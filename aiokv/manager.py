"""`CacheManager`: the bookkeeping half of the cache, with no engine tensors and no CUDA.

It owns keys, the pool's page table, admission, the disk tier, the counters and every piece of
in-flight work; it decides which pool pages and which slots each transfer touches and hands the
transfer to a :class:`aiokv.transfers.Transfers` (the in-process worker of ``KVCache``, or the
rank workers of a tensor-parallel group). State changes are synchronous code between awaits;
coroutines await only transfer completions, disk completions and commit futures.

Slots reach the manager as validated host int64 tensors (one slot per token); validating them
against the engine's buffer is the caller's job (``KVCache`` does it at its public edge).

This module holds what the manager owns for its whole life: start and close, the learned rates
saved across restarts, and the statistics. The paths pages take are mixed in from
:mod:`aiokv.loadpath` (match, load, disk promotions, prefetch) and :mod:`aiokv.offloadpath`
(offload rounds, write-behind); the state, keys, page references and in-flight work they share
are :mod:`aiokv.managerbase`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from pathlib import Path
from types import MappingProxyType

from aiokv.closing import await_close
from aiokv.config import CacheConfig
from aiokv.layout import KVLayout
from aiokv.loadpath import LoadPath
from aiokv.offloadpath import OffloadPath
from aiokv.pool import PagePool, PoolStatistics, run_in_new_thread
from aiokv.rates_file import RatesFileError, decode_rates, encode_rates, read_rates_file, write_rates_file
from aiokv.results import CacheStatistics, Tier
from aiokv.storage import DiskTier
from aiokv.storage.disk import CLOSE_STALL_S
from aiokv.storage.faults import fault_name
from aiokv.transfers import Transfers

log = logging.getLogger("aiokv.cache")


def _nothing(_: object) -> None:
    """A thread's result nobody takes any more (the rates read or write of a cancelled call)."""


class _FdHandoff:
    """A descriptor handed to a thread that may never run: the thread takes it, or the caller
    closes it once its wait ended (a thread that could not start, ``RuntimeError``, took nothing;
    the descriptor leaked before). Whichever comes first wins, under a lock."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError("the rates read or save was given up before its thread ran")
        return fd

    def close_untaken(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class _GivenUp:
    """Set by the close that gave up waiting for its rates save and counted it ``rates_not_saved``:
    that save, failing later in its thread, is not counted a second time."""

    __slots__ = ("counted",)

    def __init__(self) -> None:
        self.counted = False


def _write_rates_handed(directory: Path, data: bytes, handoff: _FdHandoff) -> bool:
    return write_rates_file(directory, data, handoff.take())


def _read_rates_handed(directory: Path, handoff: _FdHandoff) -> bytes | None:
    return read_rates_file(directory, handoff.take())


RATES_SAVE_INTERVAL_S = 30.0
"""The learned rates are saved at most this often while they change (and at close).
TODO(lead): a ``CacheConfig`` field."""
RATES_READ_WAIT_S = 1.0
"""How long a start waits for the saved rates (a few hundred bytes: milliseconds). A read held
longer in the kernel (a hung device, a stuck network file system) goes on in the background and
restores the rates once it ends, counted ``rates_late``: the start must not hang on a hint (it
did, for as long as the device did: review 114)."""
RATES_CLOSE_WAIT_S = CLOSE_STALL_S
"""The least a close waits for its rates save, whatever is left of ``close_timeout`` (background
jobs may have used it all up): a healthy save takes milliseconds, so one not over by then is held
in the kernel (a frozen file system) or behind another process's lock; it is counted
``rates_not_saved`` and left to end in its thread. As the disk tier's close is given up only past
:data:`~aiokv.storage.disk.CLOSE_STALL_S`: a healthy save given 0 s was counted as a fault, then
left to land unwaited (after the close returned, if the loop still ran)."""


class CacheManager(LoadPath, OffloadPath):
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
        super().__init__(config, layout, part=part, writer=writer)
        self._register_cuda = register_cuda
        self._started = False
        self._close_task: asyncio.Task[None] | None = None  # the one close; every aclose() waits for it
        self._starting: asyncio.Future[None] | None = None  # resolved when start() has settled
        self.device_kind: str | None = None if device_later else device or ("cuda" if register_cuda else "cpu")
        """What the saved rates are keyed by, with the layout's fingerprint (None: not known yet)."""
        for meter in self.costs.meters().values():
            meter.listener = self._rates_changed
        self._rates_dirty = False  # a rate changed since the last save
        self._rates_saved_at: float | None = None  # time.monotonic() of the last save started
        self._rates_lock = asyncio.Lock()  # one write of the file at a time
        self._rates_task: asyncio.Task[None] | None = None  # the last save started in the background
        # Reads and saves of the rates file in the background (also in _background): the close
        # does not wait for them before it closes the tier (they touch no page and no pool memory).
        self._rates_jobs: set[asyncio.Future[None]] = set()

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
                restoring = self._restore_in_background(disk)
                # asyncio.wait: a read stuck past the bound (or this start cancelled) goes on, tracked.
                done, _ = await asyncio.wait({restoring}, timeout=RATES_READ_WAIT_S)
                if not done:
                    self.faults.record("rates_late", f"the saved rates in {disk.files.layout_dir} were not read within "
                                                     f"{RATES_READ_WAIT_S} s: the start goes on without them")
        return self._pool

    def attach(self, transfers: Transfers) -> None:
        """Use ``transfers`` to move bytes between the engine's slots and the pool."""
        self._transfers = transfers

    async def aclose(self) -> None:
        """Wait (up to ``close_timeout``) for in-flight work and write-behind, then close the disk tier.

        Idempotent; a cancelled ``aclose`` keeps closing in the background and every later call
        waits for that close to end, so the disk tier (whose I/O may still use pool pages) is
        closed before anyone frees the pool. The worker (``transfers``) must be closed by its owner
        after this returns, then the pool (:meth:`close_pool`). A close whose task a loop-wide
        cancel ended is run anew by the next call.
        """
        await await_close(self._close_running)

    def _close_running(self) -> asyncio.Future[None]:
        if self._close_task is None:
            self._begin_close()
        if self._close_task is None or self._close_task.cancelled():
            # Anew when a loop-wide cancel ended the close's own task (await_close): the disk tier
            # maybe left open and the pool never freed (review 205). Each step of _close may run again.
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        return self._close_task

    async def _close(self) -> None:
        if self._starting is not None:
            await self._starting  # a start in flight may still be opening the disk tier over the pool
        loop = asyncio.get_running_loop()
        # One bound for the whole close: background jobs, the rates file and the disk tier (whose
        # writes can hang in the kernel for as long as a frozen or hung file system says).
        deadline = loop.time() + self.config.close_timeout
        try:
            async with asyncio.timeout_at(deadline):
                # Every job but the rates file's (one held, up to RATES_LOCK_WAIT_S behind another
                # process's flock, took the bound from the tier's close, review 122).
                while len(self._background) > len(self._rates_jobs):
                    # asyncio.wait, not gather: a timeout must not cancel the jobs' futures.
                    await asyncio.wait(set(self._background), return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            self.faults.record("close_timeout", f"{len(self._background)} background jobs still running at close")
        if self._disk is not None:
            # A failure here is counted, not raised: the close task's outcome is what every later
            # aclose() and close_pool() see, and the pool and bridge must still be freed after it.
            # The save and the tier's close run side by side, each within the bound: a save held
            # (the directory's flock kept by a stopped process: RATES_LOCK_WAIT_S) once used it all
            # up, and the tier, given 0 s, dropped its queued pages as if its I/O were stuck
            # (review 122). The save writes through its own descriptor of the tier's directory.
            # It is waited for at least RATES_CLOSE_WAIT_S: a healthy save, given what the jobs left
            # (0 s), was counted as not saved; a save held in the kernel still ends the wait.
            try:
                held: int | None = self._disk.layout_dir_fd()
            except (OSError, RuntimeError):
                held = None  # the save tries again itself, and counts what it meets
            given_up = _GivenUp()
            saving = asyncio.ensure_future(self._save_rates(held, given_up))
            closing = asyncio.ensure_future(self._disk.close_within(max(0.0, deadline - loop.time())))
            try:
                done, _ = await asyncio.wait({saving}, timeout=max(RATES_CLOSE_WAIT_S, deadline - loop.time()))
            except asyncio.CancelledError:
                # The close cut (a loop-wide cancel): the save goes on unwaited, its end still
                # retrieved (counted there if it failed: nothing counted it here).
                saving.add_done_callback(functools.partial(self._given_up_rates_ended, given_up))
                # So does the tier's close (a cancel of this task alone does not reach it): its end
                # retrieved too, a failure counted once (the close run anew sees the same one).
                # Review 300: "Task exception was never retrieved", counted only if run anew.
                closing.add_done_callback(functools.partial(self._cut_disk_close_ended, self._disk))
                raise
            if not done:  # its thread stays stuck in the kernel; it touches no pool memory
                # Counted here, once: a failure of it once its thread goes on is not counted again.
                given_up.counted = True
                self.faults.record("rates_not_saved", "rates file still being written at close")
                saving.add_done_callback(functools.partial(self._given_up_rates_ended, given_up))
            elif not saving.cancelled() and (exc := saving.exception()) is not None:
                self.faults.record("rates_not_saved", f"rates not saved at close: {exc!r}")
            try:
                if not await closing:
                    self.faults.record("close_timeout", "disk I/O stuck in the kernel at close: the pool stays "
                                                        "mapped until it ends")
            except Exception as exc:
                self._disk_close_failed(self._disk, exc)

    def _disk_close_failed(self, disk: DiskTier, exc: BaseException) -> None:
        """Count ``disk``'s close failing, once: a close cut while the tier's close ran and the close
        run anew both see that one close's failure (the same exception), and so does the tier where a
        ``close_within`` gave up on that close (it counts it itself). The tier keeps what was counted
        (:meth:`DiskTier.close_failure_counted`), for all of them: without a tier nothing fails."""
        if disk.close_failure_counted(exc):
            return
        self.faults.record("close_failed", f"the disk tier's close failed: {exc!r}")

    def _cut_disk_close_ended(self, disk: DiskTier, task: asyncio.Future[bool]) -> None:
        """The end of ``disk``'s close (``close_within``) that a cancelled close left unwaited."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return  # closed, or given up as stuck (that the close run anew counts, if any)
        log.warning("aiokv: the disk tier's close a cancelled close left failed later: %r", exc, exc_info=exc)
        self._disk_close_failed(disk, exc)

    async def close_pool(self) -> None:
        """Free the pool (after :meth:`aclose` and the worker that copies into it are closed).

        Waits for the close first: the pool is never freed under an open disk tier.
        """
        await self.aclose()
        self._transfers = None
        if self._pool is not None:
            disk = self._disk
            if disk is not None and not disk.io_ended.done():
                # I/O stuck in the kernel still reads or writes pool pages: unmapped once it ended.
                self._pool.close_after(disk.io_ended)
            else:
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
            self._restore_in_background(disk)

    def _restore_in_background(self, disk: DiskTier) -> asyncio.Future[None]:
        """:meth:`_restore_rates` as a job ``flush``/``aclose`` wait for (the close within its
        bound: a read stuck in the kernel touches no pool memory); a failure is counted."""
        task = asyncio.ensure_future(self._restore_rates(disk))
        self._rates_job(task)

        def settled() -> None:
            error = None if task.cancelled() else task.exception()
            if error is not None:
                self.faults.record("rates_ignored", f"reading the saved rates failed: {error!r}")

        self.track(task, settled)
        return task

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
                # Through the tier's own descriptor: the directory's name may lead elsewhere now.
                # Handed over: a thread that cannot start (RuntimeError) takes nothing, and the
                # descriptor is closed here (it leaked before).
                handoff = _FdHandoff(disk.layout_dir_fd())
                try:
                    data = await run_in_new_thread(functools.partial(_read_rates_handed, where, handoff),
                                                   "aiokv-rates", _nothing)
                finally:
                    handoff.close_untaken()
                if data is None:
                    return  # a first start
                saved = decode_rates(data, self.layout.fingerprint.hex(), kind)
            except (RatesFileError, OSError, RuntimeError) as exc:  # RuntimeError: the tier closed
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
            meters[name].restore(rate, samples, saved.fits.get(name))
        if saved.clamped:
            self.faults.record("rates_clamped", f"saved rates out of bounds, clamped: {', '.join(saved.clamped)}",
                               len(saved.clamped))

    def _given_up_rates_ended(self, given_up: _GivenUp, task: asyncio.Future[None]) -> None:
        """The end of a rates save the close stopped waiting for. Its own faults (``OSError``,
        ``RuntimeError``) it counts or logs itself (:meth:`_save_rates`); anything else it raised
        (the rates refused by their encoding, a bug) is retrieved and logged here, and counted
        ``rates_not_saved`` unless the close counted the save already. Review 296: nothing
        retrieved it, and the engine's loop reported "Task exception was never retrieved"."""
        if task.cancelled():
            log.info("aiokv: the rates save the close stopped waiting for was cancelled")
            return
        exc = task.exception()
        if exc is None:
            return
        # Its traceback logged each time (not a fault of the file system's: a bug or a refused value).
        log.warning("aiokv: the rates save the close stopped waiting for failed later (%s): %r",
                    "counted then" if given_up.counted else "counted now", exc, exc_info=exc)
        if not given_up.counted:
            self.faults.record("rates_not_saved", f"the rates save the close stopped waiting for failed: {exc!r}")

    def _rates_job(self, task: asyncio.Future[None]) -> None:
        """Count ``task`` among the rates file's background jobs until it ends (registered before
        :meth:`track`: both callbacks run in the same turn, so the close's count stays true)."""
        self._rates_jobs.add(task)
        task.add_done_callback(self._rates_jobs.discard)

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
        self._rates_job(task)

        def settled() -> None:
            error = None if task.cancelled() else task.exception()
            if error is not None:
                self.faults.record("rates_not_saved", f"saving the rates failed: {error!r}")

        self.track(task, settled)  # flush/aclose wait for it

    async def _save_rates(self, held: int | None = None, given_up: _GivenUp | None = None) -> None:
        """Write the rates file off the loop when they changed since the last save; only the
        directory's lock holder writes. A failed write is counted, unless the close that gave up
        waiting for it counted it already (``given_up``). ``held``: a descriptor of the tier's
        directory (:meth:`DiskTier.layout_dir_fd`, taken before its close began) that this call owns."""
        try:
            async with self._rates_lock:
                disk, kind = self._disk, self.device_kind
                if disk is None or disk.read_only is not None or not self._rates_dirty or kind is None:
                    return  # kind None: measured before the workers said which device they copy on
                data = encode_rates(self.costs, self.layout.fingerprint.hex(), kind)
                self._rates_dirty = False
                self._rates_saved_at = time.monotonic()
                handoff: _FdHandoff | None = None
                try:
                    # Into the directory the tier uses, never wherever its name leads now (review 122:
                    # the root renamed away and a link put there had the rates written outside it).
                    handoff = _FdHandoff(disk.layout_dir_fd() if held is None else held)
                    held = None  # the handoff owns it now
                    await run_in_new_thread(functools.partial(_write_rates_handed, disk.files.layout_dir, data,
                                                              handoff), "aiokv-rates", _nothing)
                except asyncio.CancelledError:
                    # Its outcome unknown (the thread goes on; what it raises is dropped): unsaved, for
                    # the next save (review 299: a close cut by a loop-wide cancel ran anew, found
                    # nothing to save, and a failure of this one lost the rates uncounted).
                    self._rates_dirty = True
                    raise
                except (OSError, RuntimeError) as exc:  # RuntimeError: the tier closed, or no thread left
                    self._rates_dirty = True
                    what = f"rates not saved in {disk.files.layout_dir}: {exc}"
                    if given_up is not None and given_up.counted:
                        log.info("aiokv: %s (the save the close gave up, counted then)", what)
                    else:
                        self.faults.record("rates_not_saved", what)
                finally:
                    if handoff is not None:
                        handoff.close_untaken()  # its thread never ran: could not start, or not yet
        finally:
            if held is not None:
                os.close(held)

    # -- statistics -----------------------------------------------------------------------------

    def stats(self) -> CacheStatistics:
        """A frozen snapshot of the counters, in every state: before the start, while it runs, after
        it failed or was cancelled, after the close. Without a pool (none opened yet, or the start
        was cut before it opened) the pool's counts are zeros (:meth:`PoolStatistics.unopened`);
        a monitor calls this at any time (it raised "not started" after a cancelled start)."""
        pool = self._pool.statistics() if self._pool is not None else PoolStatistics.unopened(self.layout.page_bytes)
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
