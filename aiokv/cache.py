"""`KVCache`: the object an inference engine embeds.

A thin facade over two halves that also run apart: the :class:`aiokv.manager.CacheManager`
(keys, page table, tiers, counters; no engine tensors) and an in-process worker
(:class:`aiokv.transfers.LocalTransfers`: the kernels moving bytes between the engine's KV buffer
and the pool). It validates every argument at this edge, the slot indices against the engine's
buffer included, before anything changes.

Four coroutines on one event loop: ``match`` (longest cached prefix), ``load`` (prefix into the
engine's KV slots), ``offload`` (the engine's KV into the pool, then write-behind to disk) and
``prefetch`` (disk -> pool). A cancelled caller never leaks a reference and never leaves a copy
touching its slots (see ``docs/design.md``, cancellation contract).

On a path that launches Triton kernels, ``start`` also starts the warm-up (:mod:`aiokv.kernels.warmup`)
in a thread: it compiles and loads every kernel variant this layout's copies use, so that no copy
compiles one on the event loop. Copies that arrive before the variants of page-aligned calls are
warm wait for them (an await, never a loop stall); :meth:`KVCache.wait_warm` waits for all.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from aiokv.closing import await_close
from aiokv.config import CacheConfig
from aiokv.cuda import CompletionBridge
from aiokv.facade import CacheFacade
from aiokv.kernels import TransferPath
from aiokv.kernels.mover import PageMover
from aiokv.kernels.warmup import WarmUp, prime_quietly, warm_up
from aiokv.keys import Salt, Tokens, check_salt, token_array, tp_part
from aiokv.layout import KVBuffer, KVBufferLike, KVLayout, TPSlice
from aiokv.loadpath import TURN_PAGES
from aiokv.manager import CacheManager
from aiokv.pool import run_in_new_thread
from aiokv.results import LoadResult, Match, OffloadResult
from aiokv.slots import SlotValidator, warm_read_back
from aiokv.stream import LoadStream
from aiokv.transfers import LocalTransfers

log = logging.getLogger(__name__)

_STUCK_REPORT_MIN_S = 1.0
"""Least seconds between two warnings of a close waiting on a copy still running (they come every
``close_timeout``; a ``close_timeout`` of 0 would log at every loop turn)."""


def _nothing(_: object) -> None:
    """Nothing to dispose of (a closed bridge, an import)."""


def _build_mover(
    kv: KVBuffer, pages: torch.Tensor, path: TransferPath, staging_pages: int, run_pages: int
) -> PageMover:
    """The cache's mover, on the calling thread with the KV buffer's device current (CUDA)."""
    if kv.device.type != "cuda":
        return PageMover(kv, pages, path, staging_pages, run_pages=run_pages)
    with torch.cuda.device(kv.device):
        # Offloads of pages whose slots are one run each go by one copy-engine memcpy a page, as a
        # TP rank's do (TPConfig.offload_runs): on the H200 a group of 8-16 such pages held the
        # loop ~0.5x as long as the gather (an index upload and a kernel launch a staging chunk).
        mover = PageMover(kv, pages, path, staging_pages, run_pages=run_pages, slot_runs=True)
    prime_quietly(kv.device, max(kv.num_slots, len(pages)))  # warmup.py, step 4: here on the start's thread
    return mover


def _warm_up(mover: PageMover, stop: threading.Event, on_ready: Callable[[], None]) -> WarmUp:
    """The warm-up thread: the read-back of strided CUDA slots, then the copy kernels' variants."""
    if mover.kv.device.type == "cuda":
        warm_read_back(mover.kv.device)
    return warm_up(mover, stop, on_ready)


def _transfer_path(cuda: bool, configured: TransferPath | None) -> TransferPath:
    """The path a cache uses: the configured one, else staging on CUDA and the torch reference on CPU."""
    return configured or (TransferPath.STAGING if cuda else TransferPath.REFERENCE)


def _start_modules(path: TransferPath) -> tuple[str, ...]:
    """Modules a start on ``path`` needs beyond the package (which never imports Triton itself)."""
    return () if path is TransferPath.REFERENCE else ("aiokv.kernels.launch",)


def _import_all(names: Sequence[str]) -> None:
    for name in names:
        importlib.import_module(name)


def _load_triton_driver() -> None:
    """Load Triton's CUDA driver utilities (a compiled helper module) now rather than at the first
    kernel launch, on the loop. Best effort: a failure here shows again, precisely, at that launch."""
    try:
        from triton.runtime import driver

        driver.active.get_current_device()
    except Exception as exc:  # an older or newer Triton's API; nothing the caller can act on here
        log.debug("Triton's driver not preloaded: %r", exc)


def _load_triton_specialization() -> None:
    """Run Triton's argument specialization once: its first call imports ~50 modules (~0.1 s holding
    the GIL), which the warm-up thread or the first launch would otherwise import under the loop."""
    from aiokv.kernels.launch import specialization

    specialization(0)


def _set_ready(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class KVCache(CacheFacade):
    """Tiered KV cache for one model layout and one engine KV buffer.

    ``kv_buffer`` is the engine's KV cache: a tensor ``[L, S, rows, D]``, a list of L tensors
    ``[S, rows, D]`` or ``(k_list, v_list)`` of ``[S, H, D]`` (see :class:`aiokv.layout.KVBuffer`),
    on a CUDA device or the CPU. Use as ``async with KVCache(config, layout, kv) as cache``.
    On CUDA, ``await cache.wait_warm()`` before serving keeps the kernel warm-up out of the first
    requests' way (module docstring).
    """

    def __init__(self, config: CacheConfig | None, layout: KVLayout, kv_buffer: KVBufferLike) -> None:
        if config is None:
            config = CacheConfig()
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.config = config
        self.layout = layout
        self.tp = TPSlice.of(layout, config.tp_rank, config.tp_size)
        self.kv = KVBuffer.wrap(layout, kv_buffer, self.tp)
        self._cuda = self.kv.device.type == "cuda"
        # Pages of a rank that holds part of the heads carry only its rows: key them apart.
        self._manager = CacheManager(
            config, layout, part=tp_part(self.tp, layout), writer=self.tp.writer, register_cuda=self._cuda
        )
        self._bridge = CompletionBridge()
        self._slots = SlotValidator(self.kv, self._bridge, self._manager.track)
        self._transfers: LocalTransfers | None = None
        self._close_task: asyncio.Future[None] | None = None
        self._bridge_closed: asyncio.Future[None] | None = None  # the close's join of the bridge's threads
        self._warm: asyncio.Future[WarmUp] | None = None
        """The warm-up thread's result (None: not started, or no kernels to warm)."""
        self._warm_ready: asyncio.Future[None] | None = None
        """Resolved once the variants of page-aligned copies are warm (or the warm-up ended)."""
        self._warm_stop = threading.Event()
        self._starting: asyncio.Future[None] | None = None  # resolved when a start() in flight has settled

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the pool, the copy engine and (when configured) the disk tier.

        Raises ``RuntimeError`` after :meth:`aclose`, and when ``aclose`` is called while it runs:
        the close waits for it, and it builds no copy engine and starts no warm-up once the close
        began, so nothing it made outlives the cache.
        """
        if self._close_task is not None:
            raise RuntimeError("the KVCache is closed: a closed cache cannot be started again")
        if self._transfers is not None:
            self._manager.check_running()
            return
        if self._starting is not None and not self._starting.done():
            raise RuntimeError("KVCache.start() is already running")
        starting = self._starting = asyncio.get_running_loop().create_future()
        try:
            await self._start()
        finally:
            starting.set_result(None)

    async def _start(self) -> None:
        # Threads before the pool's preparation holds the mmap lock (see CompletionBridge.prestart),
        # started from a thread of their own: Thread.start waits until the new thread runs.
        await run_in_new_thread(functools.partial(self._bridge.prestart, self._cuda), "aiokv-prestart", _nothing)
        self._check_not_closing()
        pool = await self._manager.start()
        self._check_not_closing()
        cfg = self.config
        path = _transfer_path(self._cuda, cfg.transfer_path)
        missing = [name for name in _start_modules(path) if name not in sys.modules]
        if missing:
            # Not preloaded: import in a thread, yet an import holds the GIL for its whole body
            # (Triton's 24-95 ms on an H200 host) and the loop waits for it. Counted and logged
            # once (the first cache of a process is the only one to import).
            began = time.perf_counter()
            await run_in_new_thread(functools.partial(_import_all, missing), "aiokv-import", _nothing)
            spent = (time.perf_counter() - began) * 1e3
            self._manager.faults.record(
                "start_imports",
                f"start imported {', '.join(missing)} itself ({spent:.0f} ms, mostly holding the GIL: "
                f"a loop stall); call KVCache.preload({str(self.kv.device)!r}) before the event loop runs",
            )
            self._check_not_closing()
        # Built on a thread: its CUDA streams and staging buffers took ~7 ms on an H200 host (a
        # stream's creation alone), a loop stall. A mover a close made useless is simply dropped.
        mover = await run_in_new_thread(
            functools.partial(_build_mover, self.kv, pool.pages, path, cfg.staging_pages, pool.chunk_pages),
            "aiokv-mover", _nothing,
        )
        if self._close_task is not None:
            del mover  # not kept alive (its GPU staging and streams) by the raised error's traceback
            self._check_not_closing()
        # No await from here on: the close (waiting for this start) sees all of it or none.
        self._transfers = LocalTransfers(mover, self._bridge, self.kv.device)
        self._manager.attach(self._transfers)
        if mover.effective_path is not TransferPath.REFERENCE:
            self._start_warm_up(mover)

    def _check_not_closing(self) -> None:
        """Raise once :meth:`aclose` began: a start it waits for makes nothing more (the close frees
        the bridge's threads, the manager and the pool it made so far)."""
        if self._close_task is not None:
            raise RuntimeError("the KVCache was closed while it was starting")

    def _start_warm_up(self, mover: PageMover) -> None:
        """Start the warm-up thread (see the module docstring); nothing awaits it here."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def on_ready() -> None:  # on the warm-up thread
            try:
                loop.call_soon_threadsafe(_set_ready, ready)
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

        self._warm_ready = ready
        self._warm = run_in_new_thread(
            functools.partial(_warm_up, mover, self._warm_stop, on_ready), "aiokv-warmup", _nothing
        )
        self._warm.add_done_callback(self._warmed)

    def _warmed(self, done: asyncio.Future[WarmUp]) -> None:
        if self._warm_ready is not None:
            _set_ready(self._warm_ready)
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            self._manager.faults.record(
                "warm_up_failed", f"kernel warm-up failed ({error!r}): copies compile what they launch, on the loop"
            )
            return
        result = done.result()
        if result.precompile_error is not None:
            # Compiled in-process instead (the loop may have stalled on the GIL meanwhile): say so once.
            self._manager.faults.record(
                "precompile_failed", f"kernel compile helper failed ({result.precompile_error}): compiled in-process"
            )
        log.debug("aiokv: %d kernel variants warm in %.2f s (page-aligned copies: %d in %.2f s)%s",
                  result.variants, result.seconds, result.ready_variants, result.ready_seconds,
                  ", stopped" if result.stopped else "")

    async def _kernels_ready(self) -> None:
        """Wait (an await: the loop goes on) until the variants of page-aligned copies are warm."""
        ready = self._warm_ready
        if ready is not None and not ready.done():
            await asyncio.shield(ready)

    async def wait_warm(self) -> WarmUp | None:
        """Wait until the warm-up started by :meth:`start` has compiled and loaded every Triton
        kernel variant this cache's copies can launch; returns what it did.

        An engine that serves right after start may call it first: copies that arrive before the
        variants of page-aligned calls are warm wait for those (seconds when Triton's disk cache is
        cold), and a copy whose variant is not warm yet (a load that starts mid-page) compiles it
        itself, on the loop. None where no kernels
        run (a CPU KV buffer, or before :meth:`start`) or when the warm-up failed (counted as
        ``warm_up_failed`` in ``stats().errors``). Cancelling the call does not stop the warm-up.

        Unlike the calls that serve, it never raises for a closed cache: the close stops the
        warm-up and waits for it, and a ``wait_warm`` during or after the close returns what it did
        (``stopped`` True when the close cut it short). An engine's set-up awaiting it while a
        shutdown closes the cache thus ends the same whether its call came before the close or
        after; its next serving call raises ``RuntimeError``.
        """
        warm = self._warm
        if warm is None:
            return None
        await asyncio.wait([warm])  # a cancelled caller raises here; the warm-up goes on
        return None if warm.cancelled() or warm.exception() is not None else warm.result()

    async def wait_started(self) -> None:
        """Wait until every piece of start-up work running in the background is over: the pool's
        chunks prepared (and registered with CUDA), the disk tier's io_uring registration of the
        pool, and the kernel warm-up (:meth:`wait_warm`). Until then copies already work, but that
        work shares the process's CPU, GIL and memory-map lock with the engine. Faults in any of
        them are counted, not raised. Raises ``RuntimeError`` before :meth:`start`.
        """
        self._manager.check_running()
        await self._manager.pool.wait_ready()
        disk = self._manager.disk
        if disk is not None:
            await disk.wait_registered()
        await self.wait_warm()

    @staticmethod
    def preload(device: torch.device | str, transfer_path: TransferPath | None = None) -> tuple[str, ...]:
        """Import what the first :meth:`start` of a cache on ``device`` would import, so it stalls
        its event loop on no import; returns the modules imported (empty when none was needed).

        Call it once per process before the engine's event loop runs (or from any thread: it blocks
        for the imports, ~0.2-1 s for Triton, holding the GIL much of it). ``device`` is the KV
        buffer's (``"cuda"``, ``"cuda:1"``, a ``torch.device``; a CPU buffer needs nothing);
        ``transfer_path`` as in :class:`CacheConfig` (``None``: the device's default). On CUDA it
        also loads Triton's driver utilities, which the first kernel launch would load, and runs
        Triton's argument specialization once (its first call imports ~50 modules). Without it,
        ``start`` imports them in a thread and counts ``start_imports`` in ``stats().errors``.
        Raises ``TypeError``/``ValueError`` for a bad device or path, ``ImportError`` when Triton
        is not installed.
        """
        if isinstance(device, str):
            try:
                device = torch.device(device)
            except RuntimeError as exc:
                raise ValueError(f"not a device: {device!r} ({exc})") from None
        if not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}")
        if transfer_path is not None and not isinstance(transfer_path, TransferPath):
            raise TypeError(f"transfer_path must be a TransferPath or None, got {type(transfer_path).__name__}")
        cuda = device.type == "cuda"
        needed = _start_modules(_transfer_path(cuda, transfer_path))
        missing = tuple(name for name in needed if name not in sys.modules)
        _import_all(missing)
        if needed:  # a path that launches kernels
            if cuda:
                _load_triton_driver()
            _load_triton_specialization()
        return missing

    async def aclose(self) -> None:
        """Wait (up to ``close_timeout``) for background copies and write-behind, then free everything.

        A copy still running past it (a stopped GPU, a copy a cancelled load left on the copy
        thread) is waited for without a bound, warned every ``close_timeout``: the pool is never
        freed under it. Idempotent. The close runs once, in a task every call waits for: a cancelled
        ``aclose`` raises ``CancelledError`` but the close goes on to the end (bridge, pool) without a retry.
        A close whose task a loop-wide cancel ended is run anew by the next call.
        """
        await await_close(self._close_running)

    def _close_running(self) -> asyncio.Future[None]:
        if self._close_task is None or self._close_task.cancelled():
            # Anew when a loop-wide cancel ended the close's own task (await_close): each step of
            # _close may run again.
            self._close_task = asyncio.ensure_future(self._close())
        return self._close_task

    async def _close(self) -> None:
        if self._starting is not None:
            # A start in flight may still be opening the manager or importing: it makes nothing
            # more once it sees this close (no copy engine, no warm-up thread) and raises.
            await asyncio.wait([self._starting])
        self._warm_stop.set()
        if self._warm is not None:
            # Stops between two launches (at worst after the one compile in progress); it touches
            # only its own scratch, yet nothing of it may run once the cache is closed.
            await asyncio.wait([self._warm])
        transfers = self._transfers
        if transfers is not None:
            transfers.offloads.close()  # paced offloads still waiting never reach the GPU
        try:
            await self._manager.aclose()
        finally:
            if transfers is not None:
                try:
                    async with asyncio.timeout(self.config.close_timeout):
                        await transfers.offloads.drain()
                except TimeoutError:
                    # Only a GPU stopped for close_timeout gets here; the bridge's close below then
                    # waits for those copies' events (the pool is not freed under them).
                    log.error("aiokv: offload copies still running after %.0f s at close",
                              self.config.close_timeout)
            await self._close_bridge()
            await self._manager.close_pool()

    async def _close_bridge(self) -> None:
        """Join the bridge's threads: the last fence before the pool is freed (a copy whose load was
        cancelled may still read or write pool pages on its copy thread). Off the loop, on a thread
        the loop does not wait to start (to_thread's first call would start the default executor's
        thread here). Never cancelled (awaited through ``asyncio.wait``) and kept: a close cut by a
        loop-wide cancel and run anew awaits the same join (``bridge.close()`` returns at once the
        second time: the pool was freed under a copy the first join still waited for). Unbounded,
        warned every ``close_timeout``."""
        joined = self._bridge_closed
        if joined is None or (joined.done() and joined.exception() is not None):  # (no thread left: again)
            joined = self._bridge_closed = run_in_new_thread(self._bridge.close, "aiokv-bridge-close", _nothing)
        # Unbounded (a copy cannot be stopped) but never silent: a stopped GPU held the close for good.
        report_s = max(self.config.close_timeout, _STUCK_REPORT_MIN_S)
        waited = 0.0
        while not joined.done():
            await asyncio.wait({joined}, timeout=report_s)  # a cancel of this close leaves the join running
            if not joined.done():
                waited += report_s
                log.warning("aiokv: the close has waited %.0f s for the completion bridge's threads (a copy still "
                            "running: a stopped GPU?); the pool is freed only after them", waited)
        joined.result()

    # -- the engine's calls ---------------------------------------------------------------------

    async def load(self, match: Match, slots: torch.Tensor, *, from_token: int = 0) -> LoadResult:
        """Copy tokens ``[from_token, match.tokens)`` of ``match`` into the KV ``slots``.

        ``slots``: 1-D integer tensor, one slot per token, ``len == match.tokens - from_token``.
        Pool pages start copying at once; disk pages are read into the pool and copied as each
        arrives. Returns when the data is in the KV buffer and the current CUDA stream is ordered
        after the copies. A fault below shortens the result to the valid contiguous prefix.
        Consumes ``match``. Raises ``TypeError``/``ValueError`` for bad arguments (nothing changes).
        """
        count = self._manager.check_load(match, from_token)
        host = await self._before_load(match, slots, count)
        return await self._manager.load(match, host, from_token)

    async def start_load(
        self, match: Match, slots: torch.Tensor, *, from_token: int = 0, layered: bool = False
    ) -> LoadStream:
        """Start loading ``match`` from its last page backwards while the engine computes it from the
        front: a compute-or-load split (see :class:`aiokv.stream.LoadStream`). Returns at once.

        Arguments as for :meth:`load`; consumes ``match``. ``layered``: copy layer by layer, so the
        engine can prefill the uncached tail while later layers still arrive (``stream.launched()``,
        then ``wait_layer``/``order_layer`` before each layer). Raises ``TypeError``/``ValueError``
        for bad arguments (nothing changes).
        """
        if not isinstance(layered, bool):
            raise TypeError(f"layered must be a bool, got {type(layered).__name__}")
        count = self._manager.check_load(match, from_token)
        host = await self._before_load(match, slots, count)
        return self._manager.start_load(match, host, from_token, layered)

    async def _before_load(self, match: Match, slots: torch.Tensor, count: int) -> torch.Tensor:
        """The checked host slots of a load of ``match``, once the kernels are warm.

        The manager takes ``match`` only after these awaits (the slots' read-back on CUDA, a loop
        turn after checking a long call's slots, the warm-up): a load cancelled here, or one that
        finds the cache closing when they end, releases it (consumed, as by a cancelled load), else
        its pool pages stay referenced. Bad slots raise with the match still the caller's (nothing
        changes).
        """
        try:
            host = await self._slots.check(slots, count)
            if count > TURN_PAGES * self.layout.page_tokens:
                # Bounded host work per loop turn: the engine's step that took the match's pages
                # and checked the slots does not also start the load (16K tokens: ~0.5 ms in one).
                await asyncio.sleep(0)
            await self._kernels_ready()
            if self._close_task is not None:  # the close began meanwhile: nothing more is launched
                raise RuntimeError("the cache is closed")
            self._manager.check_running()
        except (TypeError, ValueError):
            raise
        except BaseException:
            match.release()
            raise
        return host

    async def offload(self, tokens: Tokens, slots: torch.Tensor, *, salt: Salt = None) -> OffloadResult:
        """Copy the KV of the full pages of ``tokens`` (held in ``slots``) into the pool.

        ``slots``: 1-D integer tensor, one KV slot per token (``len(slots) == len(tokens)``).
        Pages already cached are skipped; the rest are gathered on a side stream ordered after the
        current CUDA stream, committed, then queued for disk. A page another call is writing is
        waited for (``commit_wait`` at most, in all) and copied by this call if that call gives it
        up (cancelled, a failed copy). Returns when the engine may reuse the slots. Pool
        exhaustion and copy faults are counted, never raised; bad arguments raise
        ``TypeError``/``ValueError`` before anything changes.
        """
        self._manager.check_running()
        ids = token_array(tokens)
        if isinstance(tokens, (np.ndarray, torch.Tensor)):
            # A copy of our own: the keys are hashed after the awaits below (a CUDA read-back of the
            # slots, seconds of warm-up), and an engine that rewrites its token buffer meanwhile
            # would have this KV stored under another prompt's keys.
            ids = ids.copy()
        check_salt(salt)
        host = await self._slots.check(slots, int(ids.size))
        await self._kernels_ready()
        return await self._manager.offload(ids, host, salt)


