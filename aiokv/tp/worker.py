"""`RankWorker`: the rank process's end of the link: attach the manager's pool, run its specs.

One worker per tensor-parallel rank, in the rank's own process, with the engine's KV buffer holding
this rank's heads only. A session: connect to the manager's socket, hello (version, rank, tp_size,
layout fingerprint), map the pool named in the reply (:meth:`PagePool.attach`), confirm its epoch,
then run specs through a :class:`~aiokv.tp.executor.RankExecutor` and report each completion.

When the manager goes away or fences the link (EOF), or the engine closes the worker, the worker
takes no spec more, starts nothing new (copies queued on its copy thread are withdrawn and reported
``WORKER_CLOSING``), lets the copies running finish and report, then says CLOSED (the last job it
took: the manager fails what it sent after that at once, protocol 9) and only then closes its end
(closed by its engine, once the manager ended the link too, ``handshake_timeout_s`` at most). A
connection that ends without CLOSED tells the manager only that no copy of the session runs any
more if the process is gone: it holds a live one's jobs (protocol 4) until that process says hello
again. The worker then drops the old mapping and reconnects with a bounded backoff; the next hello
names the new pool. A worker that ends (closed, or its ``run()`` cancelled) after a session whose
CLOSED may not have got through says that hello once more; and workers of one process run sessions
of a rank with a manager, and such farewells, one at a time (a forked child starts with none), so a
hello of this process always comes after its copies for that rank are over.

Two runners: ``async with RankWorker(...)`` on the engine's own event loop, or
:class:`RankWorkerThread` (its own thread and loop) for an engine whose model runner is synchronous.

Layer-wise loads: a layered LOAD spec is copied layer by layer (paced on a CUDA rank's STAGING
path, :mod:`aiokv.tp.paced`); a rank reports each landed layer to the manager (LAYERS frames) and
both runners offer ``wait_layer(load, layer)`` to the engine's rank process, which calls it before
layer ``layer``'s attention (see :mod:`aiokv.tp.stream`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from aiokv.cuda import CompletionBridge
from aiokv.kernels import TransferPath
from aiokv.kernels.warmup import WarmUp
from aiokv.layout import KVBuffer, KVBufferLike, KVLayout, TPSlice
from aiokv.paths import path_setting
from aiokv.pool import PagePool
from aiokv.reclaim import reclaim

from .cancels import Cancels, in_thread
from .config import TPConfig
from .endpoint import transport_peer, trusted_peer
from .executor import Announced, RankExecutor, RankReport
from .layers import LayerProgress, wait_all, wait_all_async
from .owner import OWNER_NAME, OwnedElsewhere, owned_elsewhere, read_record
from .rankwarm import RankWarmUp
from .specs import LayeredLoad, TransferSpec
from .wire import (
    MAX_TP_SIZE,
    PROTOCOL_VERSION,
    Attached,
    Closed,
    Done,
    FrameKind,
    FrameParser,
    Hello,
    Layers,
    ProtocolError,
    RankStatus,
    Refuse,
    RefuseReason,
    StreamBegins,
    Welcome,
    Withdrawn,
    frame,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_LINK_ERRORS = (asyncio.IncompleteReadError, ConnectionError, ValueError, TimeoutError, OSError)


class WorkerRefusedError(RuntimeError):
    """The manager refused this worker for good (wrong protocol version, layout, tp_size or rank), or
    this worker refused the manager's pool (a KV buffer with fewer slots than the cache addresses)."""

    def __init__(self, reason: RefuseReason, text: str) -> None:
        who = "the worker refused the manager's pool" if reason is RefuseReason.SLOTS else "manager refused the worker"
        super().__init__(f"{who} ({reason.name}): {text}")
        self.reason = reason
        self.text = text

    def __reduce__(self) -> tuple[type[WorkerRefusedError], tuple[RefuseReason, str]]:
        # Rank processes report it to their parent (multiprocessing pickles it): rebuilt from both parts.
        return type(self), (self.reason, self.text)


# The worker of each (manager's socket, rank) whose session runs in this process, from its connect
# until its copies are over (review 196). A manager holds a rank whose connection ended under a live
# process until that process says hello again, taking the hello to mean the old session drained (a
# worker runs its sessions one at a time). A second worker of the rank in the same process (made
# while the first still drained) said hello at once: the held jobs failed under the first worker's
# running copies, which then landed in slots the engine had reused. It now waits for the first.
_SESSIONS: dict[tuple[int, int, int], RankWorker] = {}
# Duplicates of the sockets of links whose copies a teardown abandoned (see _keep_open).
_ABANDONED_SOCKETS: set[int] = set()
_SESSIONS_LOCK = threading.Lock()  # workers of one process may run on different threads' loops


def _forget_sessions() -> None:
    """In a child forked without exec: the parent's sessions are not this process's (the manager
    tells processes apart by pid), and their tasks never end here: an inherited entry kept every
    worker of that rank made in the child waiting for good (review 197). The lock may have been
    held by another thread of the parent at the fork."""
    global _SESSIONS_LOCK
    _SESSIONS.clear()
    _SESSIONS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_sessions)


class _RetryLater(Exception):
    """A refusal worth retrying (rank still held by a dying connection, manager closing)."""


class _AttachFailed(Exception):
    """The pool named in the welcome could not be mapped."""


class _FarewellNotSent(Exception):
    """The farewell's connection ended with an error before its hello went out (a failed write)."""


class _Stranger(Exception):
    """The process listening at the address belongs to another user (retried: ours may come back)."""


@dataclass(frozen=True)
class WorkerStatistics:
    """State and counts of one :class:`RankWorker`."""

    rank: int
    tp_size: int
    writer: bool
    attached: bool
    epoch: int | None
    pool_name: str | None
    sessions: int
    """Pools attached so far (1 + re-attachments)."""
    connect_failures: int
    """Attempts that found no manager listening."""
    link_errors: int
    """Sessions ended by a malformed frame, a timeout, a refusal worth retrying or a failed attach."""
    specs: int
    reports: dict[RankStatus, int]
    in_flight: int
    registered_chunks: tuple[int, int]
    """``(ready, total)`` pool chunks registered with CUDA in the current session."""
    transfer_path: TransferPath | None
    """The path this rank's copies take in the current session (None while detached)."""
    layered_loads: int = 0
    """Layered LOAD specs of the current session (copied layer by layer)."""
    paced_loads: int = 0
    """Of those, CUDA loads fed a few units at a time (``TPConfig.pace_bytes``)."""
    warm_up_failed: int = 0
    """Kernel warm-ups (one per session on a path that launches kernels) that raised."""
    runs_offloaded: int = 0
    """Pages of the current session offloaded by run copies (``TPConfig.offload_runs``), not gathered."""
    stream_marks: int = 0
    """Load streams of the current session whose mark this rank recorded (at the engine's
    announcement, :meth:`RankWorker.begin_stream`, or at their STREAM_BEGINS frame)."""
    stream_marks_failed: int = 0
    """Of the current session, load streams whose mark could not be recorded (a CUDA error): their
    copies were ordered after the engine's stream at their launch."""
    stream_marks_missed: int = 0
    """LOAD specs of the current session naming a stream whose mark this rank did not hold (failed,
    dropped as old, or never announced): ordered after the engine's stream at their launch."""
    stream_marks_announced: int = 0
    """Of ``stream_marks``, marks recorded at the engine's announcement (:meth:`RankWorker.begin_stream`),
    before the rank read the stream's frame."""
    stream_announces_held: int = 0
    """Announcements (since the worker started) that found the stream's mark held already (its
    frame read first, or announced before): the earlier mark was kept."""
    stream_announces_ignored: int = 0
    """Announcements (since the worker started) that recorded nothing: another pool's epoch or no
    pool attached, a stream whose frame was read and whose mark is gone (or, same epoch, read by an
    earlier session), an id too far ahead of the streams begun here, a session whose epoch an
    earlier pool had (another group: ids may be its), a closing worker, or a record that raised."""
    farewells_lost: int = 0
    """Farewell hellos owed that did not go out within ``handshake_timeout_s`` (each failed write
    is tried again until then): the manager holds the rank until this process exits."""
    copies_abandoned: int = 0
    """Copies still running when a cancelled teardown stopped waiting for them
    (``TPConfig.abandon_copies_s``): left to the process's exit."""
    connects_refused_elsewhere: int = 0
    """Of ``connect_failures``, connects refused while the socket's directory was claimed (its
    ``manager.owner`` record) by a manager on another host, or through another mount of a shared
    file system: its socket refuses every connect from here, so this rank never attaches to it
    (logged once per claim, naming the host and the record file)."""
    owner_elsewhere: str | None = None
    """That manager (host, boot id, pid, start) as the record names it, while the last connect was
    refused so; None otherwise."""


class RankWorker:
    """Rank ``rank`` of ``tp_size``: runs the manager's specs on ``kv`` (this rank's heads only).

    ``address``: the manager's socket (``RankGroup.address``). ``kv``: anything ``KVBuffer.wrap``
    accepts, holding this rank's slice (``TPSlice.of(layout, rank, tp_size)``). ``engine_stream``:
    CUDA only; the stream the engine uses the KV buffer on (default: the current stream of the
    buffer's device, in the constructing thread). ``path``: the mover's transfer path.
    Raises ``ValueError``/``TypeError`` for a buffer that does not fit the layout and rank.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        rank: int,
        tp_size: int,
        layout: KVLayout,
        kv: KVBufferLike,
        config: TPConfig | None = None,
        engine_stream: torch.cuda.Stream | None = None,
        path: TransferPath | None = None,
    ) -> None:
        # Checked before anything reads them: a str layout raised AttributeError, a dict config was
        # accepted and failed inside run().
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if config is not None and not isinstance(config, TPConfig):
            raise TypeError(f"config must be a TPConfig or None, got {type(config).__name__}")
        if engine_stream is not None and not isinstance(engine_stream, torch.cuda.Stream):
            raise TypeError(f"engine_stream must be a torch.cuda.Stream or None, got {type(engine_stream).__name__}")
        if path is not None and not isinstance(path, TransferPath):
            raise TypeError(f"path must be a TransferPath or None, got {type(path).__name__}")
        self.address = path_setting(address, "address")  # Path() raised naming no argument
        self.tp = TPSlice.of(layout, rank, tp_size)
        if tp_size > MAX_TP_SIZE:  # its hello could not be encoded (struct.error at connect)
            raise ValueError(f"tp_size must be at most {MAX_TP_SIZE} (a hello carries it in 16 bits), got {tp_size}")
        self.layout = layout
        self.page_layout = layout.for_tp(tp_size)
        """The pool's page format (rank-major parts); its fingerprint is what the manager checks."""
        self.kv = KVBuffer.wrap(layout, kv, self.tp)
        self.config = config or TPConfig()
        if self.kv.device.type == "cuda" and engine_stream is None:
            engine_stream = torch.cuda.current_stream(self.kv.device)
        self._engine_stream = engine_stream
        self._path = path
        self._copy_on_loop = False  # RankWorkerThread: its loop is a copy thread of its own
        self._bridge: CompletionBridge | None = None
        self._executor: RankExecutor | None = None
        self._epoch: int | None = None
        self._pool_name: str | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._ended = asyncio.Event()
        self._run_started = False
        self._session_task: asyncio.Task[bool] | None = None
        self._claimant: asyncio.Task[object] | None = None  # the task holding this worker's _SESSIONS entry
        self._farewell_owed = False  # the last session may have left the rank held (see _farewell)
        # Copies left running by a cancelled teardown (_drain): the rank's entry is kept for good.
        self._copies_abandoned = 0
        self._farewells_lost = 0
        self._own_task: asyncio.Task[None] | None = None
        self._sessions = self._connect_failures = self._link_errors = self._specs = 0
        self._refused_elsewhere = 0  # connects refused where the directory's owner is elsewhere
        self._owner_elsewhere: str | None = None  # that owner, as its record describes it
        self._owner_logged: str | None = None  # the token of the claim logged last (once per claim)
        self._warm_up_failed = 0
        self._warm: RankWarmUp | None = None  # the current session's kernel warm-up
        self._reports: collections.Counter[RankStatus] = collections.Counter()
        self._announces: collections.Counter[Announced] = collections.Counter()
        self._announces_lock = threading.Lock()  # begin_stream is called from the engine's threads
        # Per pool epoch of the recent sessions: the pool attached last with it and the newest
        # stream whose frame a session of it read. Ids restart at 1 in every group and RankGroup
        # takes an epoch from its caller, so two groups can share one: an announcement of the
        # earlier group's stream (a step still in the engine's queue) was recorded as the mark of
        # the later group's stream of that id before that stream began (review 125).
        self._epochs: collections.OrderedDict[int, tuple[str, int]] = collections.OrderedDict()

    # -- running --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve and reconnect until :meth:`aclose`. Raises :class:`WorkerRefusedError` when
        the manager refuses this worker for good. Cancelled, it ends as :meth:`aclose` does (the
        session's copies drain, the farewell hello if owed) and then raises the cancel."""
        if self._run_started:
            raise RuntimeError("RankWorker.run() is already running (or ran)")
        self._run_started = True
        self._bridge = CompletionBridge()
        delay = 0.0
        try:
            loop = asyncio.get_running_loop()
            while not self._closing and not self._copies_abandoned:
                attached = False
                began = loop.time()
                self._session_task = loop.create_task(self._session())
                try:
                    attached = await self._session_task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if not self._closing or (current is not None and current.cancelling()):
                        raise
                except FileNotFoundError:
                    self._connect_failures += 1  # no manager listening (yet, or any more)
                    self._owner_elsewhere = None
                except ConnectionRefusedError:
                    self._connect_failures += 1  # no manager listening, or one this host cannot reach
                    self._note_owner_elsewhere()
                except WorkerRefusedError as exc:
                    self._error = exc
                    raise
                except (_RetryLater, _AttachFailed, _Stranger, *_LINK_ERRORS) as exc:
                    self._link_errors += 1
                    log.warning("rank %d: session ended: %s: %s", self.tp.rank, type(exc).__name__, exc)
                finally:
                    self._session_task = None
                # At once after a session that lasted (a manager restarted); backing off after one
                # that attached and ended at once, as after a failed one: a manager (or whoever
                # listens there) that accepts and drops every session would have the rank map the
                # pool and scan /dev/shm in a tight loop.
                lasted = attached and loop.time() - began >= self.config.reconnect_max_s
                delay = 0.0 if lasted else min(max(2 * delay, self.config.reconnect_initial_s),
                                               self.config.reconnect_max_s)
                if delay and not self._closing:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._stop.wait()
        finally:
            bridge, self._bridge = self._bridge, None
            cancels = Cancels()
            try:
                # Also when run() itself was cancelled (an engine's task group torn down, not
                # aclose): its session drained first, and the manager held the rank for good after
                # a cut socket (review 197). Bounded (handshake_timeout_s); the cancel is raised after.
                with _SESSIONS_LOCK:  # a skipped farewell hands its debt over under it (_claim)
                    owed = self._farewell_owed and not self._copies_abandoned
                if owed:
                    # Each try a task of its own (a connect), tried again through loop-wide cancels
                    # within one deadline (review 202: a farewell cut so left the rank held).
                    try:
                        await self._farewell(cancels)
                    except asyncio.CancelledError:
                        # Cut past its deadline: lost, but the cancel is kept and the bridge still
                        # closes (review 203: its copy thread was left).
                        cancels.cancelled = True
                if not self._copies_abandoned:  # else its copy thread may be in an abandoned copy
                    await cancels.outlast(in_thread(bridge.close))  # joins its threads: off the loop
                elif self._executor is not None:
                    # Its threads end once the abandoned copies are over (while the loop runs, as the
                    # link closes then); they were left running for the process's life.
                    self._executor.drained().add_done_callback(lambda _: bridge.close_nowait())
            finally:
                self._ended.set()  # what a close without a task of its own waits for
                self._notify()
            cancels.raise_if_cancelled()

    def _note_owner_elsewhere(self) -> None:
        """After a refused connect: where the socket's directory is claimed by a manager on another
        host (or through another mount: a shared file system), its socket refuses every connect
        from here as a dead one's does, and the rank retried for ever, counted, never logged (the
        user could not tell why it never attached). Counted, logged once per claim (a warning
        naming the host and the record file). An unreadable record (a claim being made) says
        nothing yet. One small read per refused connect, on the loop as the connect's own lookup."""
        directory = self.address.parent
        found = None
        try:
            found = read_record(directory)
            where = None if found is None else owned_elsewhere(found, directory)
        except (OSError, OwnedElsewhere):
            where = None
        if found is None or where is None:
            self._owner_elsewhere = None
            return
        self._refused_elsewhere += 1
        self._owner_elsewhere = found.describe()
        if found.token != self._owner_logged:
            self._owner_logged = found.token
            log.warning(
                "rank %d: %s refuses every connect from here: %s claims it for a manager on %s (%s). A "
                "Unix socket answers only on the host (and mount) that bound it, so this rank cannot attach "
                "to that manager; run the rank on that host, or give this host's manager a directory of its "
                "own. Retrying (counted in connect_failures).",
                self.tp.rank, self.address, directory / OWNER_NAME, where, found.describe(),
            )

    async def _session(self) -> bool:
        """One connection; True when it got as far as attaching the pool. Raises :class:`_RetryLater`
        while another worker of this process runs a session of this rank at this address."""
        with self._claim(farewell=False):
            return await self._connected_session()

    @contextlib.contextmanager
    def _claim(self, farewell: bool) -> Iterator[None]:
        """Hold this process's entry of (the manager's socket, this rank) for the current task: a
        session, or the farewell hello. Raises :class:`_RetryLater` while another worker holds it;
        a ``farewell`` refused so hands its debt to that worker (review 201): one that had claimed
        the entry and was cancelled before its hello (a loop turn from it) said none, and the
        manager held the rank for this process until it exited (its jobs, the group's close hung).
        Its own hello, or its farewell at its end (its ``run()``'s finally reads the debt under the
        lock, after its entry went), frees the rank; an extra one is harmless (the rank's entry is
        held for it: no copy of this process runs for the rank)."""
        # The socket itself, however it is named (a link, another path to its directory): a manager
        # restarted there listens on another one, and holds nothing of the old one's sessions.
        found = os.stat(self.address)  # FileNotFoundError: no manager listening, as from a connect
        key = (found.st_dev, found.st_ino, self.tp.rank)
        with _SESSIONS_LOCK:
            other = _SESSIONS.get(key)
            if other is not None and other is not self and other._in_session():
                if farewell:
                    other._farewell_owed = True
                raise _RetryLater(f"another worker of rank {self.tp.rank} in this process is in a session with "
                                  f"{self.address} (or says its farewell): this one waits until its copies are over")
            _SESSIONS[key] = self
            self._claimant = asyncio.current_task()
        try:
            yield
        finally:
            with _SESSIONS_LOCK:
                # Kept for good after abandoned copies: a hello of this process for the rank would
                # have the manager free it under them.
                if _SESSIONS.get(key) is self and not self._copies_abandoned:
                    del _SESSIONS[key]

    def _in_session(self) -> bool:
        """Whether the task holding this worker's entry runs (read from any thread: a stale entry of
        ``_SESSIONS``, a task whose loop was closed under it, is not one)."""
        if self._copies_abandoned:
            return True  # its copies may run past its loop's end (see _drain)
        task = self._claimant
        return task is not None and not task.done() and not task.get_loop().is_closed()

    async def _drain(self, executor: RankExecutor, cancels: Cancels) -> bool:
        """Wait until ``executor``'s started specs reported, through any number of cancels; False
        once ``abandon_copies_s`` passed since the first cancel meanwhile with copies still running.
        A copy hung for good (a wedged GPU or host copy) kept the teardown, and ``asyncio.run``,
        waiting through every SIGTERM: the process never exited (review 212)."""
        loop = asyncio.get_running_loop()
        # A plain future awaited through Cancels.outlast, as every teardown step: True once drained,
        # False when the bound armed by the first cancel passed first.
        ended: asyncio.Future[bool] = loop.create_future()
        timer: asyncio.TimerHandle | None = None

        def end(drained: bool) -> None:
            if not ended.done():
                ended.set_result(drained)

        def cancelled() -> None:
            nonlocal timer
            if timer is None:
                # Drained by then unless copies still count: the copies' end and the bound may land
                # in one turn of the loop, the bound's callback first (review 216).
                timer = loop.call_later(self.config.abandon_copies_s, lambda: end(not executor.in_flight))

        executor.drained().add_done_callback(lambda _: end(True))

        try:
            return await cancels.outlast(ended, cancelled)
        finally:
            if timer is not None:
                timer.cancel()

    async def _farewell(self, cancels: Cancels) -> None:
        """Say hello once more, and close: the worker closes and its last session ended without its
        CLOSED reaching the manager (a third party cut the socket). The manager then holds the rank
        while this process lives (its copies might run) until the process says hello again, which a
        closing worker never did: the rank's jobs, and the group's close, waited for good (review
        196). Its copies are over now; the manager takes this hello for that and frees the rank.
        Best effort (a connect, ``handshake_timeout_s`` at most); nothing if no manager listens there.

        Awaited in ``run()``'s own task, whose cancels ``cancels`` remembers; each try is a task of
        its own. A loop-wide cancel (a loop's shutdown, an application's cancelling every task) that
        cuts a try, or lands on the try's task before it began, has it made anew within the one
        deadline, after which the cancel is raised. The loop of tries lived in that task itself: a
        cancel landing before its first step (an application's shutdown step in the same loop turn)
        ended it without running a line, and the farewell was lost (review 204)."""
        self._farewell_owed = False
        hello = Hello(PROTOCOL_VERSION, self.tp.rank, self.tp.size, self.page_layout.fingerprint, self.kv.device.type)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.handshake_timeout_s
        failed = 0
        while True:
            try:
                if await cancels.outlast(self._farewell_try(hello, deadline, failed)):
                    return
                # Its hello did not go out (review 212: a failed write was taken for a farewell said,
                # and the manager held the rank while the process lived): tried again until the deadline.
                failed += 1
                if loop.time() >= deadline:
                    self._farewells_lost += 1
                    log.warning("rank %d: the farewell hello did not reach the manager in %.1f s: it holds "
                                "the rank until this process exits", self.tp.rank, self.config.handshake_timeout_s)
                    return
            except asyncio.CancelledError:
                # Only a loop-wide cancel reaches the try's task: made anew until the deadline (run
                # anew three times at most, the removed Cancels.finish, three such cancels lost it
                # and the manager held the rank while the process lived: review 203).
                if loop.time() >= deadline:
                    raise

    async def _farewell_try(self, hello: Hello, deadline: float, failed: int) -> bool:
        """One try of :meth:`_farewell` (a fresh task: its timeout's cancel is its own), after
        ``failed`` tries whose hello did not go out (backing off as reconnects do). True when the
        farewell is over (said, left to another worker, or no manager there to hold the rank); False
        when its hello did not go out (a failed write, or the deadline passed)."""
        try:
            # The entry is held until the hello is out (review 197): a worker of the rank here that
            # began a session after a mere check, and whose socket was then cut under its copies,
            # had its hold ended by this late hello (same pid) while its copies ran: wrong KV.
            async with asyncio.timeout_at(deadline):
                if failed:
                    await asyncio.sleep(min(self.config.reconnect_initial_s * 2 ** (failed - 1),
                                            self.config.reconnect_max_s))
                with self._claim(farewell=True):
                    await self._say_farewell(hello)
        except _RetryLater:
            pass  # another worker of the rank here is in a session: its hello, or its farewell, tells the manager
        except (_FarewellNotSent, TimeoutError) as exc:
            log.info("rank %d: farewell not sent: %s: %s", self.tp.rank, type(exc).__name__, exc)
            return False
        except (_Stranger, *_LINK_ERRORS) as exc:
            log.info("rank %d: no farewell to the manager: %s: %s", self.tp.rank, type(exc).__name__, exc)
        return True

    async def _say_farewell(self, hello: Hello) -> None:
        loop = asyncio.get_running_loop()
        transport, link = await loop.create_unix_connection(
            lambda: _WorkerLink(self, self.config.max_frame_bytes), os.fspath(self.address))
        try:
            _check_manager(transport)
            # Not waiting for the reply (a manager that accepts and never answers would hold
            # the close): the manager reads the hello before the end that follows it.
            link.write(frame(FrameKind.HELLO, hello.encode()))
        finally:
            transport.close()  # after the hello is flushed
        # The end of the close tells whether it was: a write that failed (the socket shut down by a
        # third party) ends the connection with an error, and the manager never read the hello.
        await link.wait_lost()
        if link.broken:
            raise _FarewellNotSent("the connection ended with an error before the hello went out")

    async def _connected_session(self) -> bool:
        loop = asyncio.get_running_loop()
        transport, link = await loop.create_unix_connection(
            lambda: _WorkerLink(self, self.config.max_frame_bytes), os.fspath(self.address)
        )
        self._owner_elsewhere = None  # reached: no longer refused
        try:
            _check_manager(transport)
            async with asyncio.timeout(self.config.handshake_timeout_s):
                welcome = await self._hello(link)
                executor = await self._attach(welcome, link)
            self._executor = executor
            warm = self._warm = RankWarmUp(executor._mover, self._warmed_badly, executor._chunks[:1])
            self._epoch, self._pool_name = welcome.epoch, welcome.pool_name
            self._sessions += 1
            self._notify()
            # Only now the manager learns of the attach: an engine that announces a stream once the
            # group is attached (RankWorker.begin_stream) finds this session's executor, not None.
            link.write(frame(FrameKind.ATTACHED, Attached(welcome.epoch, True).encode()))
            log.info("rank %d: attached pool %s (epoch %#x)", self.tp.rank, welcome.pool_name, welcome.epoch)
            try:
                await self._serve(link, executor, warm)
            finally:
                self._epoch = self._pool_name = None
                self._notify()
                warm.stop()
                # No spec read from now on runs, nothing new starts (queued copies are withdrawn).
                # The copies running end and their reports go out while the socket is still open;
                # then CLOSED names the last spec taken (the manager fails what came after: never
                # run) and only then is the socket closed. Without that frame the manager takes the
                # end to mean none of this session's copies runs only once the process is gone.
                # Then the mapping is dropped. Every step runs to its end even if the session is
                # cancelled again meanwhile (a second aclose, or run() cancelled then aclose): the
                # cancel is raised once the mapping is gone.
                link.stop_taking()
                executor.fence()  # no frame moves newest_stream from here on
                self._remember_epoch(welcome.epoch, welcome.pool_name, executor.newest_stream)
                # No step here runs in a task of its own: a loop-wide cancel (asyncio.run ending,
                # an application's SIGTERM handler) cuts such a task; run anew three times at most
                # (the removed Cancels.finish), three such cancels cut the drain under a running
                # copy (review 203: wrong KV). Plain futures, and coroutines awaited in this task through
                # Cancels.outlast, outlast any number of cancels.
                cancels = Cancels()
                if not await self._drain(executor, cancels):
                    # Abandoned to the process's exit: no CLOSED, the link left open (the manager
                    # holds the rank's jobs while they run), the pool left mapped (a copy may write
                    # it), no farewell.
                    self._copies_abandoned = executor.in_flight
                    self._farewell_owed = False
                    log.warning("rank %d: teardown cancelled again: %d copies still running are abandoned",
                                self.tp.rank, executor.in_flight)
                    _keep_open(link, executor)
                    raise asyncio.CancelledError
                manager_writes = link.say_closed()
                await cancels.settle(warm.aclose())  # it plans over the mover's view of the mapping
                self._warm = None
                ended = True
                if manager_writes:
                    # The manager may still be writing specs: closed now, the socket would fail its
                    # next write before it read CLOSED (and it would hold this rank as cut off).
                    ended = await link.wait_peer_end(loop.time() + self.config.handshake_timeout_s, cancels)
                link.close()
                await cancels.settle(executor.aclose())  # runs each of its steps through cancels
                self._executor = None
                # A killed manager's segment: the new manager's start saw it held by us (LIVE) and
                # left it; nothing else would reclaim it while the host stays quiet.
                await cancels.outlast(in_thread(functools.partial(_reclaim_left, welcome.pool_name)))
                # A CLOSED not written, a link ended by an error (a write that failed: the socket
                # cut; a manager gone without reading it) or not ended by the manager in time (it
                # may have found the CLOSED wanting): the manager may hold the rank.
                self._farewell_owed = not link.said_closed or link.broken or not ended
                cancels.raise_if_cancelled()
            return True
        finally:
            link.close()

    async def _hello(self, link: _WorkerLink) -> Welcome:
        hello = Hello(PROTOCOL_VERSION, self.tp.rank, self.tp.size, self.page_layout.fingerprint, self.kv.device.type)
        link.write(frame(FrameKind.HELLO, hello.encode()))
        kind, payload = await link.read()
        self._farewell_owed = False  # the manager handled a hello of this process since: holds nothing of ours
        if kind is FrameKind.REFUSE:
            refusal = Refuse.decode(payload)
            if refusal.reason.retry:
                raise _RetryLater(refusal.text)
            raise WorkerRefusedError(refusal.reason, refusal.text)
        if kind is not FrameKind.WELCOME:
            raise ProtocolError(f"expected a welcome, got {kind.name}")
        welcome = Welcome.decode(payload)
        if welcome.version != PROTOCOL_VERSION:
            raise WorkerRefusedError(RefuseReason.VERSION, f"manager speaks protocol {welcome.version}")
        if welcome.tp_size != self.tp.size:
            raise WorkerRefusedError(RefuseReason.TP_SIZE, f"manager has tp_size {welcome.tp_size}")
        if welcome.fingerprint != self.page_layout.fingerprint or welcome.page_bytes != self.page_layout.page_bytes:
            raise WorkerRefusedError(RefuseReason.LAYOUT, "manager's layout differs from this worker's")
        if welcome.num_slots > self.kv.num_slots:
            # Specs may name any slot below the manager's count: every copy touching the rest would
            # fail (BAD_SPEC), each load a miss and each offload dropped. Refused before attaching;
            # the manager is told why (its log, attach_failures), and this worker stops.
            why = (f"rank {self.tp.rank}'s KV buffer has {self.kv.num_slots} token slots, fewer than the "
                   f"{welcome.num_slots} the cache addresses (TPCache num_slots)")
            link.write(frame(FrameKind.ATTACHED, Attached(welcome.epoch, False, why).encode()))
            raise WorkerRefusedError(RefuseReason.SLOTS, why)
        return welcome

    async def _attach(self, welcome: Welcome, link: _WorkerLink) -> RankExecutor:
        assert self._bridge is not None
        cancels = Cancels()
        try:
            # A cancel (aclose, the handshake's timeout) does not abandon the thread mapping the
            # pool: the mapping it returns would stay in this process for good.
            memory = await cancels.outlast(in_thread(functools.partial(PagePool.attach, welcome.pool_name,
                                                                       self.page_layout)))
            if cancels.cancelled:
                await cancels.outlast(in_thread(memory.close))
                cancels.raise_if_cancelled()
            try:
                if memory.num_pages != welcome.num_pages:
                    raise ValueError(f"segment holds {memory.num_pages} pages, the manager says {welcome.num_pages}")
                # Ids up to the newest frame an earlier session of this epoch read are not streams
                # about to begin (the same group re-attached: begun already; another group given
                # the same epoch: maybe the earlier group's). An epoch last attached with another
                # pool is surely another group: no announcement of this session is trusted.
                seen = self._epochs.get(welcome.epoch)
                trusted = seen is None or seen[0] == welcome.pool_name
                if not trusted:
                    log.warning("rank %d: pool %s has the epoch %#x of an earlier pool (%s): the engine's "
                                "announcements are ignored in this session", self.tp.rank, welcome.pool_name,
                                welcome.epoch, seen[0] if seen is not None else "")
                executor = RankExecutor(
                    self.kv, memory, welcome.epoch, self._bridge, self.config, self._engine_stream, self._path,
                    self._copy_on_loop, _layer_reporter(link), newest_stream=0 if seen is None else seen[1],
                    announcements=trusted, first_job=welcome.first_job,
                )
                self._remember_epoch(welcome.epoch, welcome.pool_name, executor.newest_stream)
            except BaseException:
                memory.close()
                raise
        except Exception as exc:
            cancels.raise_if_cancelled()  # cancelled while the attach failed: the cancel wins
            why = f"{type(exc).__name__}: {exc}"
            link.write(frame(FrameKind.ATTACHED, Attached(welcome.epoch, False, why).encode()))
            raise _AttachFailed(f"pool {welcome.pool_name}: {why}") from exc
        return executor  # the caller writes ATTACHED once the session's state is set

    async def _serve(self, link: _WorkerLink, executor: RankExecutor, warm: RankWarmUp) -> None:
        """Run specs until the manager closes the connection (frames are handled in the link's read
        callback: no task wake-up per spec), the first once the kernels of page-aligned copies are
        warm (launched before, it would compile them on this loop). Raises what ended the link otherwise."""
        try:
            if not warm.ready.done():
                link.hold()  # specs wait unread meanwhile (backpressure on the manager)
                await link.until(warm.ready)
            link.serve(executor)
            await link.wait_ended()
        except asyncio.IncompleteReadError:
            log.info("rank %d: the manager closed the connection", self.tp.rank)

    async def wait_warm(self) -> WarmUp | None:
        """Wait until the current session's kernel warm-up ended (specs already wait for the
        variants of page-aligned copies; a rank may wait for all before serving); returns what it
        did. None while detached, where no kernels run, or when it failed (counted in
        ``statistics().warm_up_failed``). Cancelling the call does not stop the warm-up."""
        warm = self._warm
        if warm is None:
            return None
        await warm.wait_ended()
        return warm.result

    def _warmed_badly(self, _: BaseException) -> None:
        self._warm_up_failed += 1  # logged by the warm-up

    def _run_spec(self, link: _WorkerLink, executor: RankExecutor, payload: bytes) -> None:
        """One SPEC frame, in the read callback. Raises ``ValueError`` for a malformed spec."""
        spec = TransferSpec.from_bytes(payload)
        self._specs += 1
        link.took(spec.job_id)
        report = executor.execute(spec)
        if report.done():  # refused at once, or copied on this loop: no extra loop turn
            self._report(link, spec.job_id, report)
        else:
            report.add_done_callback(functools.partial(self._report, link, spec.job_id))
        if executor.in_flight >= self.config.worker_max_inflight:
            report.add_done_callback(lambda _: link.room())  # runs after the executor counted it out

    def _report(self, link: _WorkerLink, job_id: int, report: asyncio.Future[RankReport]) -> None:
        result = report.result()
        self._reports[result.status] += 1
        if result.status is not RankStatus.OK:
            log.warning("rank %d: job %d: %s %s", self.tp.rank, job_id, result.status.name, result.text)
        link.write(frame(FrameKind.DONE, Done(job_id, result.status, result.text).encode()))
        link.reported()

    # -- load streams ---------------------------------------------------------------------------

    _EPOCHS_KEPT = 64  # recent epochs remembered (a session each at most; a flapping manager's are few)

    def _remember_epoch(self, epoch: int, pool_name: str, newest: int) -> None:
        """Keep ``epoch``'s pool and the newest stream any session of it read (never lowered)."""
        seen = self._epochs.get(epoch)
        self._epochs[epoch] = (pool_name, max(newest, 0 if seen is None else seen[1]))
        self._epochs.move_to_end(epoch)
        while len(self._epochs) > self._EPOCHS_KEPT:
            self._epochs.popitem(last=False)

    def begin_stream(self, stream_id: int, epoch: int) -> bool:
        """The engine announces a load stream: record this rank's mark for it now.

        ``stream_id``, ``epoch``: ``TPLoadStream.stream_id`` and ``TPLoadStream.epoch`` of the
        scheduler's stream, carried in the engine's own step message. Call from the rank's engine
        thread (any thread; also on the worker's loop) at the start of the step that carries them,
        before queuing that step's kernels: on CUDA the mark is an event recorded on the engine's
        stream right then, and the stream's copies on this rank are ordered after it, so they wait
        for the engine's steps sent before ``start_load`` and not for the chunks it queues from now
        on. Without the call the rank records its mark when its worker reads the stream's
        STREAM_BEGINS frame, which also covers the chunks the engine queued until that read. When
        both exist, the earlier-recorded mark is kept (see ``RankExecutor.announce_stream``).

        Returns True when this call's mark is the one the stream's copies follow; False when it
        recorded nothing (counted in :meth:`statistics`): the stream's mark was held already (its
        frame was read first), the epoch is not the attached pool's (a stream of another manager;
        ids are per pool) or no pool is attached, the stream's frame was read and its mark is gone,
        the id is more than ``TPConfig.stream_marks`` past the newest stream begun here, the
        session is closing, or the record raised. Every group draws its own random epoch; should two
        share one anyway (each numbers streams from 1): ids up to the newest frame a session of that epoch read are
        refused, and so is every announcement of a session whose epoch an earlier pool had. None of
        these leaves a copy unordered: the frame's mark, or the engine's stream at each copy's
        launch, orders them. ``stream_id`` 0 (a stream
        without an id: ``TPLoadStream.stream_id`` documents when) is a no-op returning False, not
        counted. CPU ranks record no event (copies run in spec order) but take the call. Raises
        ``TypeError`` for a non-int argument and ``ValueError`` for one outside ``[0, 2**64)``
        (``epoch``: ``(0, 2**64)``).
        """
        if isinstance(stream_id, bool) or not isinstance(stream_id, int):
            raise TypeError(f"stream_id must be an int, got {type(stream_id).__name__}")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise TypeError(f"epoch must be an int, got {type(epoch).__name__}")
        if not 0 <= stream_id < 2**64:
            raise ValueError(f"stream_id must be in [0, 2**64), got {stream_id}")
        if not 0 < epoch < 2**64:
            raise ValueError(f"epoch must be in (0, 2**64), got {epoch}")
        if stream_id == 0:
            return False
        executor = self._executor  # read once: the loop may end the session meanwhile
        if executor is None or executor.epoch != epoch:
            outcome = Announced.STALE
        else:
            outcome = executor.announce_stream(stream_id)
        with self._announces_lock:
            self._announces[outcome] += 1
        return outcome is Announced.RECORDED

    # -- layer-wise loads -----------------------------------------------------------------------

    def _layer_progress(self, load: LayeredLoad, layer: int) -> list[LayerProgress] | None:
        """The progress of ``load``'s jobs in the current session (None: another pool or detached)."""
        if not isinstance(load, LayeredLoad):
            raise TypeError(f"load must be a LayeredLoad, got {type(load).__name__}")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.layout.num_layers})")
        executor = self._executor  # read once: another thread may end the session meanwhile
        if executor is None or executor.epoch != load.epoch:
            return None
        return [executor.layers.progress(job) for job in load.jobs]

    def _order_layer(self, progress: Sequence[LayerProgress], layer: int) -> None:
        if self._engine_stream is not None:
            for p in progress:
                if p.events:
                    self._engine_stream.wait_event(p.events[layer])

    async def wait_layer(self, load: LayeredLoad, layer: int) -> bool:
        """Wait until layer ``layer`` of every copy of ``load`` is in this rank's buffer.

        ``load``: ``TPLoadStream.layered_load()`` of the scheduler's stream, carried to the rank by
        the engine. CPU: waits for the bytes (the spec may not even have arrived yet). CUDA: waits
        until the layer's copies are queued (a paced load queues them as the GPU gets through the
        earlier ones), then makes the engine's stream wait for the layer on the GPU (no host wait
        for the bytes). Returns False when a copy failed (on a rank, or before it was sent:
        ``load.unsent``) or can no longer deliver the layer (the worker detached, the pool is
        another one): the engine must not rely on it
        (the scheduler's ``finish()`` then reports the load shortened). Bound it with
        ``asyncio.timeout``. Raises ``TypeError``/``ValueError`` for bad arguments.
        """
        progress = self._layer_progress(load, layer)
        if progress is None:
            return False
        ok = await wait_all_async(progress, layer)
        if ok:
            self._order_layer(progress, layer)
        return ok and not load.unsent

    # -- state ----------------------------------------------------------------------------------

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    @property
    def attached(self) -> bool:
        """True while a pool is mapped and specs are served."""
        return self._epoch is not None

    async def wait_attached(self) -> int:
        """Wait until a pool is attached; returns its epoch. Raises :class:`WorkerRefusedError` when
        refused for good and ``RuntimeError`` once the worker stopped."""
        while True:
            if self._error is not None:
                raise self._error
            if self._epoch is not None:
                return self._epoch
            if self._ended.is_set():
                raise RuntimeError(f"rank {self.tp.rank}'s worker has stopped")
            await self._changed.wait()

    async def wait_detached(self) -> None:
        """Wait until no pool is attached (the manager went away, or the worker stopped)."""
        while self._epoch is not None:
            await self._changed.wait()

    def statistics(self) -> WorkerStatistics:
        """State and counts (call on the worker's loop)."""
        executor = self._executor
        with self._announces_lock:
            announces = self._announces.copy()
        return WorkerStatistics(
            rank=self.tp.rank,
            tp_size=self.tp.size,
            writer=self.tp.writer,
            attached=self.attached,
            epoch=self._epoch,
            pool_name=self._pool_name,
            sessions=self._sessions,
            connect_failures=self._connect_failures,
            link_errors=self._link_errors,
            specs=self._specs,
            reports=dict(self._reports),
            in_flight=executor.in_flight if executor is not None else 0,
            registered_chunks=executor.registered_chunks if executor is not None else (0, 0),
            transfer_path=executor.transfer_path if executor is not None else None,
            layered_loads=executor.layered_loads if executor is not None else 0,
            paced_loads=executor.paced_loads if executor is not None else 0,
            warm_up_failed=self._warm_up_failed,
            runs_offloaded=executor.runs_offloaded if executor is not None else 0,
            stream_marks=executor.stream_marks if executor is not None else 0,
            stream_marks_failed=executor.stream_marks_failed if executor is not None else 0,
            stream_marks_missed=executor.stream_marks_missed if executor is not None else 0,
            stream_marks_announced=executor.stream_marks_announced if executor is not None else 0,
            stream_announces_held=announces[Announced.HELD],
            stream_announces_ignored=sum(announces.values()) - announces[Announced.RECORDED]
            - announces[Announced.HELD],
            copies_abandoned=self._copies_abandoned,
            farewells_lost=self._farewells_lost,
            connects_refused_elsewhere=self._refused_elsewhere,
            owner_elsewhere=self._owner_elsewhere,
        )

    # -- lifetime -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop: take no spec more and start nothing new (queued copies are withdrawn and reported
        ``WORKER_CLOSING``), let the copies running finish and report, tell the manager (a CLOSED
        frame: the specs it sent that were not taken fail ``WORKER_CLOSING`` there at once), wait
        for it to end the link (``TPConfig.handshake_timeout_s`` at most), unmap the pool, end
        :meth:`run`. A last session whose CLOSED may not have got through (its socket cut) is followed
        by one more hello, so the manager frees the rank (a connect, ``handshake_timeout_s`` at most).
        Idempotent."""
        self._closing = True
        self._stop.set()
        if self._session_task is not None:
            self._session_task.cancel()
        if self._own_task is not None:
            await asyncio.wait({self._own_task})
            if not self._own_task.cancelled() and (exc := self._own_task.exception()) is not None:
                log.debug("rank %d: worker ended with %r", self.tp.rank, exc)
        elif self._run_started:
            await self._ended.wait()

    async def __aenter__(self) -> RankWorker:
        self._own_task = asyncio.get_running_loop().create_task(self.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _layer_reporter(link: _WorkerLink) -> Callable[[int, int], None]:
    """Sends LAYERS frames on ``link`` from whatever thread a layer landed on (the loop's own
    directly: a copy running on the loop blocks it until the copy ends)."""
    loop = asyncio.get_running_loop()
    owner = threading.get_ident()

    def send(job_id: int, landed: int) -> None:
        link.write(frame(FrameKind.LAYERS, Layers(job_id, landed).encode()))

    def landed(job_id: int, count: int) -> None:
        if threading.get_ident() == owner:
            send(job_id, count)
        else:
            loop.call_soon_threadsafe(send, job_id, count)

    return landed


def _keep_open(link: _WorkerLink, executor: RankExecutor) -> None:
    """Keep ``link``'s connection open while ``executor``'s abandoned copies run (review 216).

    Its end tells the manager no copy of this session runs unless it watches this process (a
    pidfd): a worker in the manager's own process, or one it cannot watch, had the job's slots and
    pages handed back under the copies still writing them. A duplicate of its socket outlives the
    loop (a transport collected at the loop's end closes its socket); both close once the copies
    end while the loop runs (their reports go out first), else at the process's exit."""
    fd = link.dup_socket()
    if fd >= 0:
        _ABANDONED_SOCKETS.add(fd)

    def over(_: object) -> None:
        link.close()
        if fd >= 0:
            _ABANDONED_SOCKETS.discard(fd)
            os.close(fd)

    executor.drained().add_done_callback(over)


class _WorkerLink(asyncio.Protocol):
    """The worker's end of one connection. During the handshake frames queue for :meth:`read`;
    once serving, each SPEC frame runs in the read callback that received it."""

    def __init__(self, worker: RankWorker, max_bytes: int) -> None:
        self._worker = worker
        self._parser = FrameParser(max_bytes)
        self._transport: asyncio.Transport | None = None
        self._frames: collections.deque[tuple[FrameKind, bytes]] = collections.deque()
        self._executor: RankExecutor | None = None
        self._changed: asyncio.Future[None] | None = None  # wakes read() / wait_ended()
        self._end: BaseException | None = None  # what ended the link, once it ended
        self._on_end: list[Callable[[], None]] = []  # called once it ended (wait_peer_end's futures)
        self._paused = False
        self._taking = True  # SPEC frames run; False once the session ends (stop_taking)
        self._last_taken = 0  # the job id of the last spec run in this session (0: none)
        self._taken = 0  # SPEC frames run in this session (the manager counts those it wrote)
        self._unreported = 0  # specs run whose DONE is not written yet
        self._said_closed = False  # CLOSED written: nothing more is
        self.broken = False  # the connection ended with an error (a failed write, a reset)
        self._lost: asyncio.Future[None] | None = None  # wait_lost()'s, resolved by connection_lost
        self._was_lost = False

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._end is not None or not self._taking:
            return  # after stop_taking: read (the manager's end must be seen) and dropped
        executor = self._executor
        try:
            for kind, payload in self._parser.feed(data):
                if kind is FrameKind.STREAM_BEGINS and executor is not None:
                    # At once, even while specs wait in the queue for room: the mark then covers the
                    # least of the engine's work queued after the stream began (any time from the
                    # frame's arrival on covers all queued before it; its specs come after it).
                    executor.begin_stream(StreamBegins.decode(payload).stream)
                else:
                    self._frames.append((kind, payload))
        except ProtocolError as exc:
            self._ended(exc)
            return
        if self._executor is not None:
            self._pump()
        self._wake()

    def eof_received(self) -> bool:
        # The manager closed (or fenced) the link: nothing more is read. Keep our end open so the
        # reports of the copies still running go out; the session closes it once they are over.
        self._ended(asyncio.IncompleteReadError(self._parser.pending, None))
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.broken = self.broken or exc is not None
        self._was_lost = True
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        self._ended(exc if exc is not None else asyncio.IncompleteReadError(self._parser.pending, None))

    async def wait_lost(self) -> None:
        """Wait until the transport is gone (``connection_lost``: after a close, the buffer flushed
        or the connection broken)."""
        if not self._was_lost:
            if self._lost is None:
                self._lost = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._lost)

    @property
    def said_closed(self) -> bool:
        """Whether CLOSED was written (handed to the transport: it may still fail to go out)."""
        return self._said_closed

    # -- the session's side ---------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        # After CLOSED nothing is written (a late LAYERS frame; the write side may be shut down).
        if self._transport is not None and not self._transport.is_closing() and not self._said_closed:
            self._transport.write(data)  # buffered: never blocks

    async def read(self) -> tuple[FrameKind, bytes]:
        """The next handshake frame. Raises ``asyncio.IncompleteReadError`` at EOF, what broke the
        link otherwise (a :class:`ProtocolError`, a connection error)."""
        while not self._frames:
            if self._end is not None:
                raise self._end
            await self._wait()
        return self._frames.popleft()

    def serve(self, executor: RankExecutor) -> None:
        """From now on SPEC frames run on ``executor`` as they arrive (frames already queued first)."""
        self._executor = executor
        self._pump()
        self.room()  # reading resumes if :meth:`hold` paused it

    def hold(self) -> None:
        """Read nothing more until :meth:`serve`."""
        self._pause()

    async def until(self, future: asyncio.Future[None]) -> None:
        """Wait for ``future``; raises what ended the link if it ends first."""
        while not future.done():
            if self._end is not None:
                raise self._end
            await asyncio.wait({future, self._wait()}, return_when=asyncio.FIRST_COMPLETED)

    def _pump(self) -> None:
        """Run queued SPEC frames until the worker is full (then reading pauses: backpressure)."""
        executor = self._executor
        assert executor is not None
        try:
            while self._frames and self._end is None and self._taking:
                if executor.in_flight >= self._worker.config.worker_max_inflight:
                    self._pause()
                    return
                kind, payload = self._frames.popleft()
                if kind is FrameKind.WITHDRAWN:  # in order with the specs around it
                    executor.layers.withdrawn(Withdrawn.decode(payload).job_id)
                    continue
                if kind is FrameKind.STREAM_BEGINS:  # one that arrived before serving began
                    executor.begin_stream(StreamBegins.decode(payload).stream)
                    continue
                if kind is not FrameKind.SPEC:
                    raise ProtocolError(f"expected a spec, got {kind.name}")
                self._worker._run_spec(self, executor, payload)
        except Exception as exc:  # ProtocolError, a malformed spec, or a bug running one
            # Also when the pump runs from a spec's report (room()): an exception escaping there
            # left reading paused and the link up, and the manager waited for specs never run.
            self._ended(exc)

    async def wait_ended(self) -> None:
        """Return when the link ended; raises what ended it (``IncompleteReadError`` at EOF)."""
        while self._end is None:
            await self._wait()
        raise self._end

    def _pause(self) -> None:
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def room(self) -> None:
        """A spec ended: run what waits and read again once there is room."""
        if not self._paused or self._executor is None or self._end is not None or not self._taking:
            return
        self._pump()
        if self._executor.in_flight < self._worker.config.worker_max_inflight and self._transport is not None:
            self._paused = False
            if not self._transport.is_closing():
                self._transport.resume_reading()

    def took(self, job_id: int) -> None:
        """The spec of ``job_id`` runs now (its DONE is owed: :meth:`reported`)."""
        self._last_taken = job_id
        self._taken += 1
        self._unreported += 1

    def reported(self) -> None:
        """A DONE frame was written for a spec :meth:`took`."""
        self._unreported -= 1

    def stop_taking(self) -> None:
        """The session ends: no spec runs from now on (frames queued or read later are dropped:
        never run, the manager fails them at :meth:`say_closed`)."""
        self._taking = False
        self._frames.clear()

    def say_closed(self) -> bool:
        """Write CLOSED (the last job taken) after :meth:`stop_taking` and the drain: every spec
        taken reported and no copy runs. Returns True when the manager may still write (it has not
        ended its side): then this side's writing is shut down and reading goes on, so its end is
        seen (:meth:`wait_peer_end`). Nothing is written on a link broken by a bad frame (the
        manager cannot be trusted to read it), one already closed, or while a DONE is owed."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._said_closed:
            return False
        if self._end is not None and not isinstance(self._end, asyncio.IncompleteReadError):
            return False
        if self._taking or self._unreported:
            log.warning("rank %d: session ends with %d reports owed: not said closed",
                        self._worker.tp.rank, self._unreported)
            return False
        transport.write(frame(FrameKind.CLOSED, Closed(self._last_taken, self._taken).encode()))
        self._said_closed = True
        if self._end is not None:
            return False  # the manager's EOF came first: it writes nothing more
        if transport.can_write_eof():
            transport.write_eof()
        if self._paused:
            self._paused = False
            transport.resume_reading()
        return True

    async def wait_peer_end(self, deadline: float, cancels: Cancels) -> bool:
        """Wait until the manager ended its side (or the link broke), until the loop's time
        ``deadline`` at most; False when it did not. Through any number of cancels (``cancels``
        remembers them): the wait is a plain future with a timer, no task a loop-wide cancel cuts."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[bool] = loop.create_future()

        def settle(value: bool) -> None:
            if not ended.done():
                ended.set_result(value)

        timer = loop.call_at(deadline, settle, False)
        self._on_end.append(functools.partial(settle, True))
        try:
            if self._end is not None:
                settle(True)
            if not await cancels.outlast(ended):
                log.warning("rank %d: the manager did not end the link in time after CLOSED; closing it",
                            self._worker.tp.rank)
                return False
            return True
        finally:
            timer.cancel()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def dup_socket(self) -> int:
        """A duplicate of the connection's socket descriptor (-1: none is open)."""
        transport = self._transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or sock.fileno() < 0:
            return -1
        try:
            return os.dup(sock.fileno())
        except OSError:
            return -1

    def _wait(self) -> asyncio.Future[None]:
        if self._changed is None or self._changed.done():  # done: a cancelled waiter's
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)

    def _ended(self, exc: BaseException) -> None:
        if self._end is None:
            self._end = exc
            on_end, self._on_end = self._on_end, []
            for call in on_end:
                call()
            transport = self._transport
            broken = not isinstance(exc, asyncio.IncompleteReadError)
            if broken and transport is not None and not transport.is_closing():
                # A broken link: nothing more is read. It is not aborted: the session closes it once
                # the copies in flight are over (the manager reads its end as "none of them runs").
                transport.pause_reading()
        self._wake()


def _check_manager(transport: asyncio.BaseTransport) -> None:
    """Raise :class:`_Stranger` unless the peer is a process of this user (or root), before a byte
    is sent: the manager checks its workers the same way. A closed cache removes the directory it
    made while its workers keep reconnecting to the path; another user who then listened there got
    this rank's hello and could name the pool it attached and have it run specs (the engine's KV
    copied into that user's memory, or that user's bytes into the engine's KV)."""
    pid, uid = transport_peer(transport)
    if not trusted_peer(uid):
        raise _Stranger(f"the process listening at the manager's address (pid {pid}) belongs to uid {uid}, "
                        f"not to this user ({os.getuid()}): nothing sent")


def _reclaim_left(pool_name: str) -> None:
    """Reclaim the segment a session left if nobody holds it and its creator is gone (never one a
    live manager or another rank holds: :func:`aiokv.reclaim.reclaim`'s rules). Best effort."""
    prefix = pool_name.lstrip("/").rsplit("-", 3)[0]
    try:
        reclaim(prefix)
    except Exception as exc:  # a scan that fails leaves the segment to the next pool's start
        log.debug("rank: reclaiming segments after leaving %s failed: %r", pool_name, exc)


def _check_timeout(timeout: object) -> float | None:
    """A blocking call's ``timeout``: None (no bound) or seconds in ``[0, threading.TIMEOUT_MAX]``.

    Checked before the call does anything: a bad one reached ``Future.result`` or ``Thread.join``
    after the call had already queued its wait on the worker's loop (or, for ``close``, stopped the
    worker), raising their ``TypeError``/``ValueError``/``OverflowError`` naming nothing, and a NaN or
    negative one was a ``TimeoutError`` at once.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not 0 <= timeout <= threading.TIMEOUT_MAX:  # NaN too
        raise ValueError(f"timeout must be in [0, {threading.TIMEOUT_MAX:g}] seconds or None (no bound), "
                         f"got {timeout!r}")
    return float(timeout)


class RankWorkerThread:
    """A :class:`RankWorker` on its own thread and event loop, for synchronous model runners.

    Same arguments as :class:`RankWorker`; the KV buffer is validated and the engine's CUDA stream
    captured in the constructing thread. ``start()`` / ``close()``, or ``with RankWorkerThread(...)``.
    A blocking call's ``timeout`` is None or seconds in ``[0, threading.TIMEOUT_MAX]``; any other is a
    ``TypeError``/``ValueError`` before the call does anything.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        rank: int,
        tp_size: int,
        layout: KVLayout,
        kv: KVBufferLike,
        config: TPConfig | None = None,
        engine_stream: torch.cuda.Stream | None = None,
        path: TransferPath | None = None,
    ) -> None:
        self.worker = RankWorker(address, rank, tp_size, layout, kv, config, engine_stream, path)
        # This loop serves nobody else: CPU copies run on it directly, saving two thread hand-offs
        # per spec (the copy thread's wake-up and the loop's), which dominate a small spec's latency.
        self.worker._copy_on_loop = True
        self._thread = threading.Thread(target=self._main, name=f"aiokv-rank{rank}", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        """What ended the worker's run, if it did not end by :meth:`close`."""

    def start(self) -> None:
        """Start the thread and its loop (returns once the loop runs)."""
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.run(self._amain())

    async def _amain(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        run = self._loop.create_task(self.worker.run())
        stop = self._loop.create_task(self._stop.wait())
        await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        await self.worker.aclose()
        await asyncio.wait({run, stop})
        if not run.cancelled() and (exc := run.exception()) is not None:
            self.error = exc

    def _call(self, fn: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        timeout = _check_timeout(timeout)
        if self._loop is None or not self._thread.is_alive():
            raise RuntimeError("the worker thread is not running")

        async def call() -> T:
            return await fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def wait_attached(self, timeout: float | None = None) -> int:
        """Block until a pool is attached; returns its epoch. Raises ``TimeoutError`` after ``timeout``
        seconds and :class:`WorkerRefusedError` when refused for good."""
        return self._call(self.worker.wait_attached, timeout)

    def wait_warm(self, timeout: float | None = None) -> WarmUp | None:
        """:meth:`RankWorker.wait_warm`, blocking the calling thread. Raises ``TimeoutError`` after
        ``timeout`` seconds."""
        return self._call(self.worker.wait_warm, timeout)

    def wait_layer(self, load: LayeredLoad, layer: int, timeout: float | None = None) -> bool:
        """:meth:`RankWorker.wait_layer`, blocking the calling thread (the model runner's).

        Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        timeout = _check_timeout(timeout)
        worker = self.worker
        progress = worker._layer_progress(load, layer)
        if progress is None:
            return False
        ok = wait_all(progress, layer, timeout)
        if ok:
            worker._order_layer(progress, layer)
        return ok and not load.unsent

    def begin_stream(self, stream_id: int, epoch: int) -> bool:
        """:meth:`RankWorker.begin_stream`, called directly from the engine's thread (it does not go
        through the worker's loop: the mark is recorded on the calling thread, right then). Works
        after :meth:`close` too (returns False, counted)."""
        return self.worker.begin_stream(stream_id, epoch)

    def statistics(self) -> WorkerStatistics:
        """The worker's statistics, read on its loop."""

        async def read() -> WorkerStatistics:
            return self.worker.statistics()

        return self._call(read, None)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker (copies in flight finish first) and join the thread. Idempotent.

        After CLOSED the worker waits for the manager to end the link (``handshake_timeout_s`` at
        most), so do not call this on the thread running the manager's loop (a ``TPCache`` in this
        process): from a coroutine there, ``await asyncio.to_thread(thread.close)``.

        Raises ``TimeoutError`` when the thread did not end within ``timeout`` seconds, and
        ``TypeError``/``ValueError`` for a bad ``timeout`` (the worker is left running).
        """
        timeout = _check_timeout(timeout)
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.ident is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"rank {self.worker.tp.rank}'s worker thread did not stop in {timeout} s")

    def __enter__(self) -> RankWorkerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
