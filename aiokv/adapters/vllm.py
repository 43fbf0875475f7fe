"""vLLM 0.33: aiokv's disk tier as a secondary tier of vLLM's ``TieringOffloadingManager``.

Configure it in ``kv_connector_extra_config`` of vLLM's ``OffloadingConnector``::

    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 34359738368,
    "secondary_tiers": [{"type": "AiokvTier", "module_path": "aiokv.adapters.vllm",
                         "disk_dir": "/mnt/nvme/aiokv", "disk_bytes": 1099511627776,
                         "namespace": "llama-3.1-8b"}]

The tier runs in vLLM's scheduler process. vLLM calls it synchronously, under its manager lock; every
call here only updates dictionaries and deques and queues work for aiokv's event loop on a thread
of the tier's own (:class:`~aiokv.adapters.loopthread.LoopThread`) without waking it, so no call
waits for a disk, a copy or the loop, and none makes a system call (in which the loop thread could
take the GIL). The loop looks for queued work every ``poll_s`` while busy, every ``idle_poll_s``
once parked (``idle_poll_s=0``: ``on_schedule_end`` wakes it instead, one system call per step):

- ``lookup`` answers from verdicts the loop produced; an unknown key is queued and answered RETRY
  (vLLM keeps scanning and asks again next step); ``on_schedule_end`` posts the step's queue.
- ``submit_store`` / ``submit_load`` queue one job. ``get_finished_jobs`` pops the finished ones
  (a load reports the keys that arrived when only some did); ``drain_jobs`` blocks, as vLLM's
  contract asks, until every job and lookup is done, whether a step end handed it over or not.

Chunk ``c`` of vLLM's shared CPU region is row ``c`` of ``primary_kv_view``. Keys: vLLM's offload
key (block hash, which mixes its cache salt, LoRA and multimodal hashes, plus the KV group) under
aiokv's seed of the model identity (model, dtype, chunk geometry, parallel layout, and from the
engine's ``VllmConfig`` revision, overrides, online quantization...: :mod:`.vllmidentity`) and namespace.
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, JobResult, SecondaryTierManager, TransferJob

from aiokv.storage import DiskStatistics

from .aside import Aside
from .loopthread import LoopDied
from .store import PageFileStore, StoreConfig
from .vllmidentity import engine_config, spec_facts

_DEFAULT: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(StoreConfig)}

log = logging.getLogger(__name__)

_Answer = list[tuple[OffloadKey, bool]]

SWEEP_WINDOW = 32
"""Pages in a row still on disk after which the search for evicted pages stops (KV events)."""

_PREFIX = "vllm:kv_offload_aiokv_"
# Counters: the disk tier's statistics field each one follows (vLLM gets the increase per call). A chosen
# few of DiskStatistics' counters, not a mirror: the store writes through, never behind (its
# write_behind_* counters stay 0).
_COUNTERS = {
    "corrupt_pages": ("corrupt", "Page files that failed verification on read (the load missed; deleted, "
                                 "or kept by a read-only tier, e.g. a reader of another writer's directory)."),
    "dropped_writes": ("dropped", "Page writes dropped for capacity (no room could be made)."),
    "refused_writes": ("writes_refused", "Page writes refused because the directory is read-only here."),
    "evictions": ("evictions", "Page files evicted (least recently used) to keep within disk_bytes."),
    "io_errors": ("errors", "I/O faults of the disk tier, by kind (each failed a page or a start-up scan entry)."),
}
_GAUGES = {
    "bytes_stored": ("bytes_stored", "Bytes of page files on disk."),
    "capacity_bytes": ("effective_capacity_bytes",
                       "The byte budget in force (disk_bytes, or less while the disk is short)."),
    "read_only": ("read_only", "1 while the tier serves reads but refuses writes (read-only, locked...)."),
}


@dataclasses.dataclass
class _Outcome:
    """A finished job as the loop reports it to vLLM's thread."""

    result: JobResult
    failed: list[OffloadKey] = dataclasses.field(default_factory=list)
    """Keys of a load that did not arrive (their verdicts become MISS)."""
    stored: list[OffloadKey] = dataclasses.field(default_factory=list)
    """Keys a store put on disk (KV events)."""
    gone: list[OffloadKey] = dataclasses.field(default_factory=list)
    """Keys a failed load found no longer on disk (corrupt: deleted, or kept unserved by a read-only
    tier; KV events)."""
    evicted: list[OffloadKey] = dataclasses.field(default_factory=list)
    """Keys this tier stored whose files the disk tier has removed since (evicted for room; KV events)."""


class AiokvTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM is untyped for mypy here
    """aiokv page files as a vLLM secondary tier (storage medium).

    Options (the tier's config entries besides ``type`` and ``module_path``): ``disk_dir`` (default
    ``$XDG_CACHE_HOME/aiokv``), ``disk_bytes`` (64 GiB), ``namespace``, ``disk_backend`` (``auto``,
    ``uring_fixed``, ``uring``, ``threads``), ``direct_io``, ``queue_depth``, ``staging_pages``,
    ``poll_s`` / ``linger_s`` / ``idle_poll_s`` (how often the loop polls while busy, how long
    before it parks, how often it looks while parked; 0: on_schedule_end wakes it instead),
    ``locality`` (``LOCAL``/``REMOTE``, vLLM's tier filter), ``enable_kv_events`` (KV events for
    pages stored, pages a load found gone, and pages evicted for room; only where vLLM publishes
    KV events),
    ``zero_copy`` (default true: chunks move straight between vLLM's region, registered with
    io_uring, and their files; false: through staging pages), ``close_timeout`` (30 s, > 0: how
    long :meth:`shutdown` waits for transfers in flight before it raises). Raises
    ``TypeError``/``ValueError`` for a wrong option and ``OSError`` when the directory cannot be used.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        disk_dir: str | None = None,
        disk_bytes: int | None = None,
        namespace: str = "default",
        disk_backend: str = "auto",
        direct_io: bool | None = None,
        queue_depth: int = _DEFAULT["queue_depth"],
        staging_pages: int = _DEFAULT["staging_pages"],
        poll_s: float = _DEFAULT["poll_s"],
        linger_s: float = _DEFAULT["linger_s"],
        idle_poll_s: float = _DEFAULT["idle_poll_s"],
        locality: str | None = None,
        enable_kv_events: bool = False,
        zero_copy: bool = _DEFAULT["zero_copy"],
        close_timeout: float = _DEFAULT["close_timeout"],
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(enable_kv_events, bool):
            raise TypeError(f"enable_kv_events must be a bool, got {enable_kv_events!r}")
        options: dict[str, object] = {"namespace": namespace, "disk_backend": disk_backend,
                                      "direct_io": direct_io, "queue_depth": queue_depth,
                                      "staging_pages": staging_pages, "poll_s": poll_s, "linger_s": linger_s,
                                      "idle_poll_s": idle_poll_s, "zero_copy": zero_copy,
                                      "close_timeout": close_timeout}
        if disk_dir is not None:
            options["disk_dir"] = disk_dir
        if disk_bytes is not None:
            options["disk_bytes"] = disk_bytes
        # close_timeout=0 is refused there (with 0 every shutdown raised, the tier never closed).
        config = StoreConfig.from_options(options)
        if locality is not None:
            from vllm.v1.kv_offload.base import Locality

            self.locality = Locality(locality)
        events_on = enable_kv_events and bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        if enable_kv_events and not events_on:
            log.warning("aiokv tier: enable_kv_events is set but vLLM's KV cache events are off")
        num_chunks = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        self._chunk_bytes = self.block_size_bytes
        self._num_chunks = num_chunks  # chunk ids are checked against it in every state (after shutdown too)
        # Checked before the store starts: a view the rows cannot be cut from failed only once the
        # store had started, and the failed tier kept its thread, staging pool and directory lock.
        if not primary_kv_view.c_contiguous or primary_kv_view.nbytes != num_chunks * self._chunk_bytes:
            raise ValueError(f"primary_kv_view must be C-contiguous rows of {self._chunk_bytes} bytes (its stride), "
                             f"got shape {primary_kv_view.shape}, strides {primary_kv_view.strides}")
        # Also before the store: a view with no row failed cutting its rows, a read-only one making
        # its tensor (a warning otherwise, and the first load's copy into it a crash), each once the
        # store had started, whose thread and directory lock the failed tier then kept.
        if not num_chunks or primary_kv_view.readonly:
            raise ValueError(f"primary_kv_view must be writable and hold at least one chunk, got "
                             f"{'a read-only view' if primary_kv_view.readonly else 'no chunk'}")
        # The bookkeeping before the store: everything after the store's start is in the try below,
        # whose cleanup closes it (an interrupt after that try left the disk tier open for good).
        # Lookups: verdicts of the loop, kept while a request still asks about the key.
        self._verdicts: dict[OffloadKey, bool] = {}
        self._wanted: dict[OffloadKey, set[str]] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        # Keys to post at the step end, in order (a dict: a key whose last asker finished first is
        # dropped from it, unposted).
        self._queued: dict[OffloadKey, None] = {}
        self._asked: set[OffloadKey] = set()
        # The loop appends to these deques and vLLM's thread pops them: no lock, no future, so no
        # call here ever waits for the loop thread or lets it take the GIL. Answers: (a posted
        # lookup's, or a store's keys now on disk), in the order the loop made them, so that a
        # lookup answered before a store completed does not undo the store's HIT.
        self._answers: collections.deque[tuple[bool, _Answer]] = collections.deque()
        self._lookups_out = 0
        # Jobs: posted to the loop without waking it; each reports (result, keys that failed).
        self._finished: collections.deque[_Outcome] = collections.deque()
        self._unreported: set[int] = set()
        self._shut = False
        self._released = False  # the view of vLLM's region let go (shutdown)
        self._closing: Aside | None = None  # shutdown()'s close of the store, once handed over
        self._dead = False  # the loop thread died and every job it held is answered for
        # Metrics: the loop leaves a statistics snapshot here when asked (get_stats, one step behind).
        self._snapshots: collections.deque[DiskStatistics] = collections.deque()
        self._snapshot_asked = False
        self._reported: DiskStatistics | None = None
        # KV events (vLLM's own file tier does the same): only when vLLM publishes them at all.
        self._events: list[OffloadingEvent] | None = None
        # With events: the pages this tier stored, least recently used first, as the disk tier
        # orders them (a store, a load attempt and a touch make a page the most recent in both),
        # so that pages it evicts are found at the front. Loop only.
        self._mirror: collections.OrderedDict[bytes, OffloadKey] | None = None
        if events_on:
            self._events = []
            self._mirror = collections.OrderedDict()
        # The store first: if it cannot start, no view of vLLM's region is held (vLLM keeps a region
        # mapped while anything exports it, and the exception's frames would keep these alive).
        vllm_config = engine_config(offloading_spec)
        if vllm_config is None:
            log.warning("aiokv tier: vLLM's VllmConfig was not found where the tier was built; the page identity "
                        "names only the offloading config (model path, KV dtype, geometry, parallel layout): give "
                        "each revision, hf_overrides or quantization of one model path a namespace of its own")
        facts = spec_facts(offloading_spec, self._chunk_bytes, vllm_config)
        held: list[PageFileStore] = []
        undo = Aside(functools.partial(self._undo_start, held), "aiokv-vllm-cleanup")  # before anything it undoes
        try:
            # Constructed into ``held`` by C code (list.extend over map), where no signal handler runs
            # between the constructor's return and the append: assigned in Python, an interrupt (a
            # KeyboardInterrupt from a signal handler, Ctrl-C at start-up) landing as the call returned
            # left the store open (its thread, ring and directory lock) with nobody holding it. A
            # constructor that raised cleaned up after itself (``held`` is then empty).
            held.extend(map(PageFileStore, [config], ["vllm"], [facts], [self._chunk_bytes]))
            self._store = held[0]
            # [num_chunks, chunk_bytes] uint8 over vLLM's region, no copy (rows are contiguous).
            self._bytes_view = primary_kv_view.cast("B")
            self._region = torch.frombuffer(self._bytes_view, dtype=torch.uint8).view(num_chunks, self._chunk_bytes)
            if config.zero_copy and self._bytes_view.nbytes:
                # Chunks move straight between the region and their files: register it as io_uring
                # fixed buffers (pinning runs in the background; until then plain buffers).
                store, region = self._store, self._bytes_view
                store.thread.call(lambda: store.register_memory(region)).result()
            log.info("aiokv tier: %s (%d chunks of %d bytes)", self._store.directory, num_chunks, self._chunk_bytes)
        except BaseException:
            # Undone on a thread of its own (aside.py), handed over by this clause's first call (C code: no
            # signal's handler runs before it), and waited for. Made on this thread, an interrupt (Ctrl-C
            # pressed twice or three times) landing between its steps skipped the rest: the store's close
            # never handed over to the loop, the disk tier left open for good (threads, ring, directory lock),
            # vLLM's region exported.
            try:
                _thread.start_new_thread(undo.start, ())
            except RuntimeError:  # no thread may start (a pids limit): made here, exposed as before
                undo.run()
            undo.wait()  # an interrupt here leaves it running to its end
            raise

    def _undo_start(self, held: list[PageFileStore]) -> None:
        """A tier that failed to start holds nothing: no thread, no directory lock (a retry in this
        process served read-only), no view of vLLM's region. The view goes even if the close fails (the
        exception's frames keep this tier alive); the close may go on on the loop, which may still pin
        the region for io_uring: the view goes once it ended, as shutdown() does. ``held``: the store,
        or nothing when its constructor failed (it closed what it had opened)."""
        if not held:
            self._let_go()
            return
        store = held[0]
        try:
            store.close()
        except Exception:
            log.exception("aiokv tier: closing the disk tier of a failed start failed")
            self._let_go()
        except BaseException:
            # Interrupted: made on vLLM's thread, where no other could start. The close goes on on the loop:
            # let go once it ended; close() again hands it over should the interrupt have landed before it
            # reached the loop (it returns at once otherwise): the tier was left open for good.
            with contextlib.suppress(Exception):
                store.close()
            store.when_closed(self._let_go)
            raise
        else:
            store.when_closed(self._let_go)  # at once: the close ended (a death's: once its end is over)

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT/MISS from the loop's verdict; RETRY while it is being looked up (never blocks). MISS
        for everything once the loop thread died or the tier shut down. ``TypeError`` for a key that
        is not ``bytes`` or a ``req_context`` that is not vLLM's ``ReqContext`` (nothing changed)."""
        _check_key(key)
        _check_context(req_context)
        if self._shut or self._reap():
            return LookupResult.MISS
        self._take_answers()
        req_id = req_context.req_id
        self._req_keys.setdefault(req_id, set()).add(key)
        self._wanted.setdefault(key, set()).add(req_id)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if key not in self._asked:
                self._asked.add(key)
                self._queued[key] = None
            return LookupResult.RETRY
        return LookupResult.HIT if verdict else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Post the step's queued lookups to the loop. With ``idle_poll_s=0`` also wake the loop
        if it is parked with work queued: the one hand-over per step that may make a system call
        (by default a parked loop finds the work itself within ``idle_poll_s``)."""
        self._take_answers()
        if self._shut or self._reap():
            return
        if self._queued:
            queued, self._queued = list(self._queued), {}
            store = self._store
            keys, page_keys = [], []
            for key in queued:  # lookup() checked them; a key that still fails alone is a MISS
                try:
                    page_keys.append(store.key(key))
                except Exception:
                    log.exception("aiokv tier: key %r has no page key; a miss", key)
                    self._asked.discard(key)
                    if key in self._wanted:
                        self._verdicts[key] = False
                    continue
                keys.append(key)

            def look_up() -> None:
                try:
                    hits = store.contains(page_keys)
                except Exception:
                    log.exception("aiokv tier: lookup failed; treating the keys as misses")
                    hits = [False] * len(keys)
                self._answers.append((True, list(zip(keys, hits, strict=True))))

            try:
                store.thread.post_call(look_up)
            except LoopDied:  # died since the check: the keys stay asked, and _reap answers them MISS
                self._reap()
                return
            self._lookups_out += 1
        if self._store.config.idle_poll_s == 0:
            self._store.thread.wake()

    def _take_answers(self) -> None:
        """Verdicts from the loop's answers, in its order: a posted lookup's (the key is no longer
        out), and a completed store's HITs (a MISS cached for a key some request still asks about
        would be stale: a lost hit)."""
        while self._answers:
            posted, answers = self._answers.popleft()
            if posted:
                self._lookups_out -= 1
            for key, hit in answers:
                if posted:
                    self._asked.discard(key)
                if key in self._wanted:
                    self._verdicts[key] = hit

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's verdicts (a later request looks its keys up afresh) and its lookups
        not posted yet that no other request asks about. ``TypeError`` for a ``req_context`` that is
        not vLLM's ``ReqContext`` (nothing changed)."""
        _check_context(req_context)
        req_id = req_context.req_id
        for key in self._req_keys.pop(req_id, ()):
            users = self._wanted.get(key)
            if users is None:
                continue
            users.discard(req_id)
            if not users:
                del self._wanted[key]
                self._verdicts.pop(key, None)
                if key in self._queued:  # not posted yet: no one would take the answer vLLM stepped for
                    del self._queued[key]
                    self._asked.discard(key)

    # -- jobs -----------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue writing the job's chunks (pinned by vLLM until the job is reported). No system call:
        the loop picks the job up at its next poll, or when ``on_schedule_end`` wakes it."""
        pairs, job_id = self._pairs(job_metadata), job_metadata.job_id
        if pairs is None:
            return
        self._start(job_id, lambda: self._store_job(job_id, pairs))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue reading the job's chunks into the primary slots vLLM allocated (as ``submit_store``)."""
        pairs, job_id = self._pairs(job_metadata, load=True), job_metadata.job_id
        if pairs is None:
            return
        self._start(job_id, lambda: self._load_job(job_id, pairs))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark the keys' page files most recently used (LRU), those on disk; queued for the loop
        like a job (no system call), picked up at its next poll. ``TypeError`` for keys that are not
        a collection of ``bytes`` or a ``req_context`` that is not vLLM's ``ReqContext`` (nothing
        queued)."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            # (None raised "'NoneType' object is not iterable", naming nothing)
            raise TypeError(f"keys must be a collection of bytes, got {type(keys).__name__}")
        keys = list(keys)
        for key in keys:
            _check_key(key)
        _check_context(req_context)
        if self._shut or not keys or self._reap():
            return
        store, mirror = self._store, self._mirror
        page_keys = [store.key(key) for key in keys]

        def touch() -> None:
            store.touch(page_keys)
            if mirror is not None:
                _move_to_end(mirror, page_keys)

        try:
            store.thread.post_call(touch)
        except LoopDied:  # died since the check: nothing left to touch (reads miss from now on)
            self._reap()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call (never blocks). A load that got some of its keys
        reports them in ``successful_keys``; the keys that failed become MISS verdicts."""
        self._reap()
        results = []
        while self._finished:
            outcome = self._finished.popleft()
            self._unreported.discard(outcome.result.job_id)
            for key in outcome.failed:
                if key in self._wanted:
                    self._verdicts[key] = False  # a failed load must not be promoted again
            if self._events is not None:
                for keys, removed in ((outcome.stored, False), (outcome.gone + outcome.evicted, True)):
                    if keys:
                        self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed,
                                                            locality=self.locality))
            results.append(outcome.result)
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        """KV events since the last call (``enable_kv_events``): pages stored, pages a load found
        gone (a corrupt file is no longer served: deleted, or kept by a read-only tier), pages
        evicted for room (found after each store job). Pages stored by an earlier process are not
        reported when evicted (their vLLM keys are not known here)."""
        if self._events:
            events, self._events = self._events, []
            yield from events

    def has_pending_work(self) -> bool:
        """True while a job is not reported yet or a lookup some request still asks about is queued
        or unanswered (one whose askers all finished would only keep vLLM stepping, empty steps,
        for an answer nobody takes). No system call, no wait: it takes the answers the loop left,
        as ``lookup`` does."""
        if self._shut:  # lookups are answered MISS; only jobs failed at submit remain to report
            return bool(self._unreported)
        self._reap()
        # An answer already in counts as taken: vLLM steps the engine while this is True, and
        # answers a drain (or the idle loop) left would otherwise cost one more, empty, step.
        self._take_answers()
        # Queued keys are all asked about; a posted one may have lost its askers.
        return bool(self._unreported or self._queued or any(key in self._wanted for key in self._asked))

    def drain_jobs(self) -> None:
        """Block until every submitted job and posted lookup completed, whether or not
        ``on_schedule_end`` handed them over; results stay for ``get_finished_jobs``. If the loop
        thread died, wait for it to end instead: its jobs are then reported failed."""
        if self._shut:
            return
        if not self._reap(wait=True):
            try:
                self._store.thread.quiesce()
            except LoopDied:
                self._reap(wait=True)

    def shutdown(self) -> None:
        """Drain, close the disk tier and its thread, and let go of vLLM's region (vLLM unmaps it
        next and keeps it mapped while anything still exports it). Idempotent.

        The drain waits ``close_timeout`` at most: transfers still in flight then (disk I/O stuck in
        the kernel: a hung file system) may still read or write vLLM's region, so this raises
        ``RuntimeError`` holding on to it, and vLLM, whose shutdown re-raises a tier's failure, keeps
        the region mapped (its contract for a tier that failed to shut down). Call again once they
        ended. A loop thread that died is waited for as long (its end cancels the transfers in
        flight, each waiting for its I/O), then its jobs are reported failed.

        An interrupt of the calling thread during the disk tier's close (``KeyboardInterrupt`` from
        a signal handler) is raised at once; the close goes on on the tier's loop, which may still
        use the region (its registration with io_uring) until it ended: the region is let go then.
        A later call waits ``close_timeout`` at most for that end (``RuntimeError`` holding on to
        the region after it) and lets go of it; it closes the disk tier first when the interrupt came
        before that close began or reached the tier's loop (the region is held until then).

        The store's close and the region's release run on a thread of their own, handed over by the first
        call after this tier is marked shut (C code: no signal's handler runs before it; see aside.py), and
        waited for: an interrupt landing at the entry of the store's ``close()`` (made here) left no close
        begun, the disk tier open for good (threads, ring, directory lock) and the region exported unless
        vLLM called shutdown() again."""
        if self._shut:
            if not self._released:
                # The first call's close, its caller interrupted, goes on on its thread: its end first
                # (close() made meanwhile on this thread might begin a second close of the store). Made
                # here if it never began (no thread could start, and an interrupt landed before it ran).
                if self._closing is not None:
                    self._closing.run()  # returns at once once begun
                    if not self._closing.ended(self._store.config.close_timeout):
                        raise self._still_moving("the disk tier's close, its caller interrupted, is still running")
                # A shutdown interrupted in or after the store's close: finish it (and close the store if
                # the interrupt came before its close began or was handed over to its loop: at once otherwise).
                self._store.close()
                if not self._store.wait_closed(self._store.config.close_timeout):
                    raise self._still_moving("the disk tier's close, its caller interrupted, is still running")
                self._let_go()
            return
        thread, bound = self._store.thread, self._store.config.close_timeout
        if thread.died is None:
            try:
                thread.quiesce(bound)
            except LoopDied:
                pass  # died meanwhile: waited for below
            except TimeoutError:
                raise self._still_moving("transfers of vLLM's region are still in flight") from None
        if thread.died is not None:
            if not thread.wait_ended(bound):
                raise self._still_moving("the loop thread that died is still cancelling transfers of vLLM's region")
            self._reap(wait=True)  # answers for its jobs
        closing = self._closing = Aside(self._close_store, "aiokv-vllm-close")  # made before the mark
        self._shut = True
        try:
            _thread.start_new_thread(closing.start, ())
        except RuntimeError:  # no thread may start (a pids limit): made here, exposed as before
            closing.run()
        closing.wait()  # an interrupt here leaves it running to its end

    def _close_store(self) -> None:
        """shutdown()'s close of the store, then its release of vLLM's region (on a thread of its own,
        or inline where none may start)."""
        try:
            self._store.close()
        except BaseException:
            # Interrupted (made inline: the close goes on on the loop), or the close failed (it ended):
            # the region is the tier's until its close ended; let go of it then, this call or not.
            self._store.when_closed(self._let_go)
            raise
        self._let_go()

    def _let_go(self) -> None:
        """Release the view of vLLM's region (its tensor first: it exports the view). Idempotent;
        from the engine's thread, or the store's loop thread once the store's close ended."""
        self._region = torch.empty(0, dtype=torch.uint8)
        if hasattr(self, "_bytes_view"):  # a start that failed before it made the view has none
            self._bytes_view.release()
        self._released = True

    def _still_moving(self, what: str) -> RuntimeError:
        return RuntimeError(f"aiokv tier: {what} after close_timeout ({self._store.config.close_timeout} s): disk "
                            "I/O stuck in the kernel? The region must stay mapped until it ends; shut the tier down "
                            "again then")

    def config_info(self) -> ConfigInfoMapping:
        return {"aiokv_namespace": self._store.config.namespace, "aiokv_dir": str(self._store.directory)}

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("aiokv_namespace", "aiokv_dir")

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The disk tier's own metrics (vLLM already counts the bytes and time of every job)."""
        metrics: dict[str, OffloadingMetricMetadata] = {}
        for name, (_, doc) in _COUNTERS.items():
            labels = (TIER_LABEL, "kind") if name == "io_errors" else (TIER_LABEL,)
            metrics[_PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=labels)
        for name, (_, doc) in _GAUGES.items():
            metrics[_PREFIX + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=(TIER_LABEL,))
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The metrics of :meth:`build_metric_definitions` (never blocks: figures of the loop's
        snapshot asked for at the previous call; counters as increases since the last report).
        None when there is no snapshot yet or nothing changed."""
        if self._shut or self._reap():
            return None
        latest = None
        while self._snapshots:
            latest = self._snapshots.popleft()
            self._snapshot_asked = False
        if not self._snapshot_asked:
            store, snapshots = self._store, self._snapshots
            try:
                store.thread.post_call(lambda: snapshots.append(store.statistics()))
            except LoopDied:  # died since the check: no more figures
                self._reap()
                return None
            self._snapshot_asked = True
        if latest is None:
            return None
        stats = OffloadingConnectorStats()
        tier = (self.tier_type,)
        before = self._reported
        for name, (field, _) in _COUNTERS.items():
            if field == "errors":
                old = before.errors if before is not None else {}
                for kind, count in latest.errors.items():
                    if count - old.get(kind, 0):
                        stats.increase_counter(_PREFIX + name, count - old.get(kind, 0), (self.tier_type, kind.value))
                continue
            increase = getattr(latest, field) - (getattr(before, field) if before is not None else 0)
            if increase:
                stats.increase_counter(_PREFIX + name, increase, tier)
        stats.set_gauge(_PREFIX + "bytes_stored", latest.bytes_stored, tier)
        stats.set_gauge(_PREFIX + "capacity_bytes", latest.effective_capacity_bytes, tier)
        stats.set_gauge(_PREFIX + "read_only", int(latest.read_only is not None), tier)
        self._reported = latest
        return stats

    def statistics(self) -> Mapping[str, object]:
        """The disk tier's statistics (blocks briefly on the loop; for tests and tools)."""
        return vars(self._store.thread.call(self._store.statistics).result())

    # -- internals ------------------------------------------------------------------------------

    def _pairs(self, job: TransferJob, load: bool = False) -> list[tuple[OffloadKey, int]] | None:
        """The job's (key, chunk) pairs, checked before anything is queued: ``bytes`` keys, integer
        chunk ids (a float was truncated) in a 1-D array (a 2-D one was flattened), one per key,
        inside the region, and for a load no chunk named twice (two reads into one chunk race, and
        the loser's valid page file was counted corrupt and deleted). ``TypeError``/``ValueError``
        otherwise, in every state: after shutdown too (the region's size is the one vLLM gave, vLLM
        still submits ids inside it). None for a valid job after shutdown: it is reported failed (the
        region is gone), as a job the loop can no longer run. A job id still in flight (not yet
        returned by ``get_finished_jobs``) is a ``ValueError``: both jobs ran and the id was reported
        twice, which vLLM's scheduler asserts against."""
        if not isinstance(job, TransferJob):
            raise TypeError(f"job must be a TransferJob, got {type(job).__name__}")  # was AttributeError
        if isinstance(job.job_id, bool) or not isinstance(job.job_id, int):
            raise TypeError(f"job id must be an int, got {type(job.job_id).__name__}")
        if job.job_id in self._unreported:
            raise ValueError(f"job id {job.job_id} is still in flight (not yet reported by get_finished_jobs)")
        if isinstance(job.keys, (str, bytes)) or not isinstance(job.keys, Iterable):
            raise TypeError(f"job {job.job_id}: keys must be a list of bytes, got {type(job.keys).__name__}")
        keys = list(job.keys)
        for key in keys:
            _check_key(key)
        try:
            ids = np.asarray(job.chunk_ids)
        except ValueError:  # ragged nesting: numpy's "inhomogeneous shape", naming nothing
            raise ValueError(f"job {job.job_id}: chunk ids must be a 1-D array of integers, got a ragged "
                             f"{type(job.chunk_ids).__name__}") from None
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"job {job.job_id}: chunk ids must be integers, not {ids.dtype}")
        # vLLM passes a 1-D array (one chunk per key); a 2-D one, or a scalar, was flattened and taken.
        if ids.ndim != 1:
            raise ValueError(f"job {job.job_id}: chunk ids must be 1-D, got shape {ids.shape}")
        chunks = [int(c) for c in ids.tolist()]
        if len(keys) != len(chunks):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(chunks)} chunk ids")
        # Against the region's size as vLLM gave it, not the region's tensor (empty once let go): after
        # shutdown ids outside it were not checked and the job was reported failed.
        bad = [c for c in chunks if not 0 <= c < self._num_chunks]
        if bad:
            raise ValueError(f"job {job.job_id}: chunk ids {bad[:4]} outside [0, {self._num_chunks})")
        if load and len(set(chunks)) != len(chunks):
            twice = sorted({c for c in chunks if chunks.count(c) > 1})
            raise ValueError(f"job {job.job_id}: a load names chunk ids {twice[:4]} more than once")
        if self._shut:
            self._start(job.job_id, _never)
            return None
        return list(zip(keys, chunks, strict=True))

    def _start(self, job_id: int, job: Callable[[], Coroutine[Any, Any, _Outcome]]) -> None:
        # Reap before the job is ours to answer: a reap meeting the death answers every unreported
        # job, and this one was then answered twice (vLLM asserts on the second).
        alive = not self._shut and not self._reap()
        self._unreported.add(job_id)
        if alive:
            try:
                self._store.thread.post(self._report(job_id, job))
                return
            except LoopDied:  # died since the check (post closed the coroutine)
                pass
        self._finished.append(_Outcome(JobResult(job_id=job_id, success=False)))

    def _reap(self, wait: bool = False) -> bool:
        """True once the loop thread died (then nothing more reaches the disk). When its thread has
        ended (``wait``: wait for that, it is cancelling its work), answer for it once: every job
        not reported fails, every lookup still out is a MISS."""
        if self._dead:
            return True
        thread = self._store.thread
        if thread.died is None:
            return False
        if wait:
            thread.close()  # joins the ending thread; drops what was posted after it died
        if not thread.dead:
            return True  # still cancelling its work: answered for at a later call
        thread.close()
        self._dead = True
        log.error("aiokv tier: the loop thread died (%r); jobs in flight are reported failed, lookups miss",
                  thread.died)
        self._take_answers()
        answered = {outcome.result.job_id for outcome in self._finished}
        for job_id in sorted(self._unreported - answered):
            self._finished.append(_Outcome(JobResult(job_id=job_id, success=False)))
        for key in (*self._asked, *self._queued):
            if key in self._wanted:
                self._verdicts[key] = False
        self._asked.clear()
        self._queued.clear()
        self._lookups_out = 0
        return True

    async def _report(self, job_id: int, job: Callable[[], Coroutine[Any, Any, _Outcome]]) -> None:
        """Run ``job()`` and queue its result for ``get_finished_jobs``, exactly once, whatever
        happens. The job's coroutine is made here: a report dropped or cancelled before it started
        leaves no coroutine that was never awaited (the tier answers for the job then)."""
        try:
            outcome = await job()
        except asyncio.CancelledError:
            self._finished.append(_Outcome(JobResult(job_id=job_id, success=False)))
            raise
        except Exception:
            log.exception("aiokv tier: job %d failed", job_id)
            outcome = _Outcome(JobResult(job_id=job_id, success=False))
        self._finished.append(outcome)

    async def _store_job(self, job_id: int, pairs: list[tuple[OffloadKey, int]]) -> _Outcome:
        start = time.monotonic()
        store = self._store
        done = await asyncio.gather(*(store.store(store.key(key), [self._region[c]]) for key, c in pairs),
                                    return_exceptions=True)
        stored = [key for (key, _), ok in zip(pairs, done, strict=True) if ok is True]
        _log_errors(done)
        if stored:  # verdicts HIT from here on, after the lookups the loop answered before
            self._answers.append((False, [(key, True) for key in stored]))
        result = JobResult(job_id=job_id, success=len(stored) == len(pairs), transfer_time=time.monotonic() - start,
                           transfer_bytes=len(stored) * self._chunk_bytes)
        evicted: list[OffloadKey] = []
        if self._mirror is not None:
            for key in stored:
                page_key = store.key(key)
                self._mirror[page_key] = key
                self._mirror.move_to_end(page_key)
            evicted = self._sweep()
        return _Outcome(result, stored=stored, evicted=evicted)

    def _sweep(self) -> list[OffloadKey]:
        """Keys of pages this tier stored that the disk tier no longer has, out of the mirror: from
        its least recently used end until ``SWEEP_WINDOW`` pages in a row are still there (the disk
        tier evicts from that end, recycling one of its first few files that no read holds)."""
        assert self._mirror is not None
        store, gone, present = self._store, [], 0
        for page_key in self._mirror:
            if store.contains([page_key])[0]:
                present += 1
                if present >= SWEEP_WINDOW:
                    break
            else:
                gone.append(page_key)
        return [self._mirror.pop(page_key) for page_key in gone]

    async def _load_job(self, job_id: int, pairs: list[tuple[OffloadKey, int]]) -> _Outcome:
        start = time.monotonic()
        store = self._store
        done = await asyncio.gather(*(store.load(store.key(key), [self._region[c]]) for key, c in pairs),
                                    return_exceptions=True)
        _log_errors(done)
        loaded = [key for (key, _), ok in zip(pairs, done, strict=True) if ok is True]
        failed = [key for (key, _), ok in zip(pairs, done, strict=True) if ok is not True]
        result = JobResult(
            job_id=job_id,
            success=not failed,
            successful_keys=tuple(loaded) if failed and loaded else None,
            transfer_time=time.monotonic() - start,
            transfer_bytes=len(loaded) * self._chunk_bytes,
        )
        there = store.contains([store.key(key) for key in failed])
        gone = [key for key, on_disk in zip(failed, there, strict=True) if not on_disk]
        if self._mirror is not None:  # every read made its page the most recent; gone ones are reported here
            _move_to_end(self._mirror, [store.key(key) for key, _ in pairs])
            for key in gone:
                self._mirror.pop(store.key(key), None)
        return _Outcome(result, failed=failed, gone=gone)


def _check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"offload keys must be bytes, not {type(key).__name__}")


def _check_context(req_context: object) -> None:
    # vLLM always passes its ReqContext (its scheduler's, or one its tiers make; never None); anything
    # else raised AttributeError on ``req_id``, naming nothing.
    if not isinstance(req_context, ReqContext):
        raise TypeError(f"req_context must be vLLM's ReqContext, not {type(req_context).__name__}")


async def _never() -> _Outcome:
    raise RuntimeError("a job after shutdown is never run")


def _move_to_end(mirror: collections.OrderedDict[bytes, OffloadKey], page_keys: Iterable[bytes]) -> None:
    for page_key in page_keys:
        if page_key in mirror:
            mirror.move_to_end(page_key)


def _log_errors(done: list[bool | BaseException]) -> None:
    errors = [r for r in done if isinstance(r, BaseException)]
    if errors:
        log.error("aiokv tier: %d page transfers raised; first: %r", len(errors), errors[0])
