"""`RankGroup`: the manager's end of the link to the rank workers of one tensor-parallel group.

It listens on a Unix-domain socket in a private directory, admits one worker per rank after a hello
exchange (protocol version, tp_size and layout fingerprint must match; the worker attaches the pool
named in the reply and confirms its epoch), sends each submitted spec to the ranks that take part,
and resolves the job through its :class:`~aiokv.tp.jobs.JobTable` once every rank is accounted for.
A rank that dies fails its part of every job it had in flight (RANK_LOST); a worker that ends its
session says so first (a CLOSED frame after its last report) and what it never took fails at once
(WORKER_CLOSING); a connection that just ends under a live process holds the rank's jobs until that
process exits or says hello again (its copies may still run). Each attach starts a new session of
its rank (:meth:`RankGroup.sessions`); a spec carries the sessions its call was admitted for and
is sent only while its ranks are still in them, so a spec held for room (or a later round of the
same call) never reaches a restarted rank.

The group holds no engine tensors and moves no bytes; its loop only reads and writes small frames.
Connections are asyncio protocols on the Unix socket rather than stream tasks: a completion is
handled in the read callback that received it, with no task wake-up per rank (the round trip of a
spec to eight ranks is dominated by such wake-ups; see ``tools/bench_specs.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import functools
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from aiokv.layout import KVLayout, TPSlice
from aiokv.paths import path_setting

from . import endpoint as endpoint_module
from . import owner
from .config import TPConfig
from .endpoint import (
    Endpoint,
    ManagerStopping,
    claim_directory,
    release_claim,
    remove_endpoint,
    socket_identity,
    start_lock,
    transport_peer,
    trusted_peer,
    unlink_socket,
)
from .jobs import Job, JobStatistics, JobTable, RankFailure
from .room import RoomQueue
from .specs import Direction, IntArrayLike, TransferSpec
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

_STREAM_ID_MAX = 2**64 - 1
"""The last load stream id (a u64 on the wire, ``StreamBegins``)."""

_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
"""A pidfd of a Unix socket's peer process, as it connected (Linux 6.5; 77 where Python lacks the name)."""

ACCEPT_BACKLOG = 100
"""The listening socket's backlog, and the most connections accepted in one loop turn."""
ACCEPT_RETRY_S = 1.0
"""After an accept failed (EMFILE, ENFILE, ENOBUFS, ENOMEM): how long the listener pauses before it
accepts again (asyncio's own servers do the same)."""

log = logging.getLogger(__name__)

def _listen(path: str) -> socket.socket:
    """A non-blocking Unix-domain stream socket listening at ``path``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.setblocking(False)
        listener.bind(path)
        listener.listen(ACCEPT_BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener


@dataclass(frozen=True)
class GroupStatistics:
    """Connections and jobs of a :class:`RankGroup`."""

    address: str
    epoch: int
    pool_name: str
    tp_size: int
    attached: frozenset[int]
    connections: int
    """Connections accepted."""
    refused: int
    """Hellos refused (wrong version, layout, tp_size or rank; rank taken; closing)."""
    attach_failures: int
    """Workers that could not map the pool, confirmed another epoch, or refused to attach (a KV
    buffer with fewer slots than ``num_slots``)."""
    disconnects: int
    """Attached ranks that went away."""
    link_errors: int
    """Connections ended by a malformed or unexpected frame, or a handshake timeout."""
    jobs: JobStatistics
    waiting: int = 0
    """Submissions waiting for room now: held jobs (``submit_queued``) and ``submit`` calls."""
    fenced: int = 0
    """Ranks fenced: still owing reports at close after ``close_timeout_s``, or whose link broke
    with jobs in flight (told to run nothing new; their reports or their end were waited for)."""
    held_ranks: int = 0
    """Ranks held now: their connection ended without the worker's CLOSED frame while they owed
    reports, and their process lives (a third party cut the socket; their copies may still run).
    Their jobs stay in flight and their numbers taken until the process exits or says hello again."""
    worker_closes: int = 0
    """Attached ranks whose worker ended its session with a CLOSED frame (its engine closed it, or
    at a fence): the jobs sent to them that they never took failed WORKER_CLOSING at once."""


def draw_epoch() -> int:
    """A new group's epoch: 63 random bits, never 0 (two groups share one with probability 2**-63;
    the workers refuse what they can of a shared one anyway, see ``RankWorker.begin_stream``)."""
    return secrets.randbits(63) + 1


class RankGroup:
    """Manager side of one TP group: ``tp_size`` workers, one pool, every in-flight job.

    ``layout``: the model's layout; the pool holds pages of :attr:`page_layout` (rank-major parts).
    ``pool_name``/``num_pages``: the pool workers attach (``PagePool.name``, ``PagePool.num_pages``);
    :attr:`epoch` names this group in every spec and stream id: drawn at random for every group, never
    the caller's (stream and job ids restart at 1 in each group, so two groups sharing an epoch
    let a stale id of one name the other's: review 125). ``directory``: where to listen, created 0700
    (a fresh temporary directory when None); workers connect to :attr:`address`. A group restarted
    on the same directory listens at the same address, and live workers re-attach to its new pool.

    ``on_all_attached``: called on the loop, with :attr:`device_kind`, each time the last missing
    rank attaches (the ranks' device becomes known; a :class:`~aiokv.tp.TPCache` labels its rates
    by it). ``num_slots``: the token slots specs address (a ``TPCache``'s ``num_slots``); a worker
    whose KV buffer has fewer refuses to attach (counted in ``attach_failures``, its reason logged);
    None: not stated. Use as ``async with RankGroup(...) as group`` or :meth:`start` / :meth:`aclose`.
    Raises ``ValueError`` when ``tp_size`` does not divide the layout's heads (or they it), or for
    a ``num_slots`` that is not a positive int.
    """

    def __init__(
        self,
        layout: KVLayout,
        tp_size: int,
        pool_name: str,
        num_pages: int,
        config: TPConfig | None = None,
        directory: str | os.PathLike[str] | None = None,
        on_all_attached: Callable[[str], None] | None = None,
        num_slots: int | None = None,
    ) -> None:
        TPSlice.of(layout, 0, tp_size)  # a bad tp_size raised by its name before the slices are built
        if tp_size > MAX_TP_SIZE:  # a slice per rank: 2**63 ranks never returned
            raise ValueError(f"tp_size must be at most {MAX_TP_SIZE} (a rank's hello carries it in 16 bits), "
                             f"got {tp_size}")
        slices = [TPSlice.of(layout, rank, tp_size) for rank in range(tp_size)]
        if config is not None and not isinstance(config, TPConfig):  # a dict was taken, or {} as the defaults
            raise TypeError(f"config must be a TPConfig or None, got {type(config).__name__}")
        if directory is not None:  # here: at start an int raised naming nothing, "" was the working directory
            directory = path_setting(directory, "directory")
        if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, int)
                                      or not 0 < num_slots < 2**64):
            raise ValueError(f"num_slots must be a positive int or None, got {num_slots!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if not isinstance(pool_name, str) or not pool_name.startswith("/"):
            raise ValueError(f"pool_name must be a shared-memory name starting with '/', got {pool_name!r}")
        self.layout = layout
        self.page_layout = layout.for_tp(tp_size)
        """The pool's page format: one rank-major part per head slice (``layout.for_tp(tp_size)``)."""
        self.tp_size = tp_size
        self.pool_name = pool_name
        self.num_pages = num_pages
        self.num_slots = num_slots
        """Token slots the specs address (every rank's KV buffer has at least as many); None: not stated."""
        self.config = config or TPConfig()
        self.epoch = draw_epoch()
        self.writers = frozenset(s.rank for s in slices if s.writer)
        """Ranks that write pages: OFFLOAD specs go to these only (MLA: rank 0; one replica per head)."""
        self._all_ranks = frozenset(range(tp_size))
        self._rank_order = tuple(range(tp_size))
        self._writer_order = tuple(sorted(self.writers))
        self._directory = directory
        self._endpoint: Endpoint | None = None
        # (st_dev, st_ino) of the socket file this start bound, while its listener is open: the
        # only file the group ever unlinks (see _stop_listening).
        self._socket_id: tuple[int, int] | None = None
        # This start's claim on the directory (endpoint.claim_directory) while its listener is open:
        # released before the socket's name goes, while nobody else may replace it.
        self._claim: str | None = None
        # The listening socket and the accept loop are ours, not an asyncio.Server's: a connection
        # a Server accepted in the loop turn before its close() makes its transport a turn later,
        # when Server._attach's assert fails (CPython 3.11-3.13) and leaves the socket open for good
        # (found as "unclosed transport" after a fence: a rank reconnecting as the close began).
        self._listener: socket.socket | None = None
        self._accept_retry: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]]] = set()
        self._jobs = JobTable(self.config.max_jobs, on_room=self._room_freed)
        # Submissions waiting for room, in order: held jobs (submit_queued) and turns of submit().
        self._room = RoomQueue(self._jobs, self._send_held)
        self._ranks: dict[int, _RankLink] = {}  # claimed at hello, attached after ATTACHED
        self._links: set[_RankLink] = set()
        # Ranks whose connection ended while they owed reports and whose process still lives (a
        # third party shut the socket down): held until that process exits or says hello again.
        self._orphans: set[_RankLink] = set()
        self._links_ended = False  # the close ended every connection: later ones end at once
        self._all_attached = asyncio.Event()
        self._on_all_attached = on_all_attached
        self._changed = asyncio.Event()
        self._next_job = 1
        self._next_stream = 1  # load stream ids (begin_stream), never reused in this group
        # Each attach starts a new session of its rank (a number never reused in this group): a
        # call's jobs go only to the sessions it was admitted for (see sessions()).
        self._last_session = 0
        self._sessions: tuple[int, ...] = (0,) * tp_size
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        self._accepted = self._refused = self._attach_failures = self._disconnects = self._link_errors = 0
        self._fenced = 0
        self._worker_closes = 0

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the private directory and listen. Raises ``RuntimeError`` when a live manager owns it
        or another is starting there right now (it holds the directory's start lock), and
        ``endpoint.StartLockFailed`` (one) where that lock cannot be taken at all, and
        ``owner.OwnedElsewhere`` (one) where a manager on another host (or through another mount)
        claimed the directory: its socket cannot be probed from here, and nothing of it is removed. A
        manager stopping there (removing its directory) is waited for, ``endpoint.STOP_WAIT_S`` at most."""
        if self._listener is not None or self._closing:
            raise RuntimeError("RankGroup.start() called twice or after aclose()")
        # Only this start's socket is ever removed: a failed start's inode kept here had a retry that
        # failed before binding (another manager listening now) unlink that manager's socket, given
        # the freed inode number (ext4 reuses it at once).
        self._socket_id = None
        loop = asyncio.get_running_loop()
        try:
            # A manager stopping there holds the lock for its directory's removal, a few system
            # calls: refused, an engine restarting its manager right after a stop failed (review
            # 262). Waited for, bounded (a stop frozen there refuses this start in the end).
            deadline = loop.time() + endpoint_module.STOP_WAIT_S
            pause = endpoint_module.STOP_RETRY_FIRST_S
            while True:
                try:
                    listener = self._listen_locked()
                    break
                except ManagerStopping:
                    if loop.time() >= deadline:
                        raise
                await asyncio.sleep(pause)
                if self._closing:  # the close ran meanwhile, finding nothing to close
                    raise RuntimeError("RankGroup.aclose() was called as it started")
                pause = min(2 * pause, endpoint_module.STOP_WAIT_S / 10)
            loop.add_reader(listener.fileno(), self._accept_ready)
        except BaseException:
            self._stop_listening()
            # None when the lock was refused: the directory is the other start's then, even if
            # this one made it (removed, that start's bind failed; review 252).
            failed, self._endpoint = self._endpoint, None
            if failed is not None:
                remove_endpoint(failed)
            raise
        log.info(
            "rank group listening on %s: tp_size=%d, pool %s (epoch %#x, %d pages)",
            self.address, self.tp_size, self.pool_name, self.epoch, self.num_pages,
        )

    def _listen_locked(self) -> socket.socket:
        """Probe, bind and listen under the directory's start lock: bound but not yet listening, our
        socket refuses a probe as a dead one does, and another manager starting there unlinked it
        and bound its own; this one then listened where no rank could reach it, and both believed
        they owned the group (review 249). Raises what :func:`start_lock` raises."""
        with start_lock(self._directory) as endpoint:
            self._endpoint = endpoint
            # Claimed before the bind: another host's start, which this host's lock does not keep
            # out and whose probe our socket refuses, is refused by the claim (see endpoint).
            claim = claim_directory(endpoint)
            try:
                self._listener = listener = _listen(os.fspath(endpoint.socket_path))
            except BaseException:
                owner.remove_record(endpoint.directory, claim)  # under the start lock: still ours
                raise
            self._claim = claim
            self._socket_id = socket_identity(os.lstat(endpoint.socket_path))
        return listener

    async def aclose(self) -> None:
        """Stop accepting, wait ``close_timeout_s`` for jobs in flight, fence the ranks that still
        owe reports and wait for them, then close every connection. Idempotent; safe to cancel (the
        close goes on).

        Fencing a rank half-closes its connection: the worker runs nothing new (copies queued on
        its copy thread are withdrawn and reported WORKER_CLOSING, a layered CPU load stops at its
        next layer), reports the copies that were running once they end, says CLOSED (what it never
        took fails WORKER_CLOSING) and closes its end. A job
        therefore ends only when every rank reported or its connection ended (a worker closes it
        only once none of its copies runs; a dead rank's copies died with it): when this returns,
        no rank copies into or out of the memory of any job of this group, and the pool may be
        freed. A live rank stuck in a copy holds the close (a warning every ``close_timeout_s``);
        bound the wait with ``asyncio.timeout``: the close goes on without the caller.
        """
        if self._close_task is None:
            self._closing = True
            self._room.close()  # nothing held is sent any more; waiting submissions end now
        if self._close_task is None or self._close_task.cancelled():
            # Run anew when a loop-wide cancel (an application's SIGTERM handler cancelling every
            # task, a loop's shutdown) ended the close's own task: every later call raised that
            # cancel at once, the ranks still copying, the socket left listening (review 204).
            # Each step of _close may run again.
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        # Listening goes on until no job is in flight (every hello is refused, CLOSING): the hello
        # of an orphaned rank's process is what tells its copies are over (see _orphan).
        if not await self._wait_idle():
            self._fence_all()
            while not await self._wait_idle():
                log.warning(
                    "rank group closing: ranks %s still copying for %d jobs; waiting for their reports "
                    "(the slots and pages of those jobs are theirs until then)",
                    self._owing_pids(), self._jobs.in_flight,
                )
        self._stop_listening()
        # Every part was reported or ended with its connection: nothing is left to fail but a part
        # of no connection at all (a safety net; none is expected).
        self._jobs.fail_all(RankStatus.GROUP_CLOSED, "the rank group closed with the job in flight")
        for link in list(self._orphans):
            self._orphan_ended(link)
        # A connection accepted before the listener closed is made a loop turn or two later (in a
        # task, _connecting): made from now on, it is ended at once (it would be left open, never
        # listed below). Those tasks are waited for: each ends once its transport is made, so
        # every accepted socket is closed by the time this returns.
        self._links_ended = True
        links = list(self._links)
        for link in links:
            if link.transport is not None:
                link.transport.abort()  # no flush: a rank that stopped reading must not hold us
        if links:
            await asyncio.wait([link.closed for link in links])
        if self._connecting:
            await asyncio.wait(set(self._connecting))
        if self._endpoint is not None:
            remove_endpoint(self._endpoint)  # the socket's name went with the listener
        self._changed.set()

    async def _wait_idle(self) -> bool:
        """Wait ``close_timeout_s`` at most for no job in flight; True when none is."""
        if self._jobs.in_flight:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.close_timeout_s):
                    await self._jobs.wait_idle()
        return not self._jobs.in_flight

    def _accept_ready(self) -> None:
        """The listener is readable: accept what waits (``ACCEPT_BACKLOG`` at most this turn); each
        connection's transport is made in a task (the loop's own way), tracked in ``_connecting``."""
        listener = self._listener
        if listener is None:
            return
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BACKLOG):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                # Out of descriptors or memory: the listener stays readable, so pause rather than
                # spin; what waits in the backlog is accepted after the pause.
                log.warning("rank group: accepting a worker's connection failed (%r); pausing %.1f s",
                            exc, ACCEPT_RETRY_S)
                loop.remove_reader(listener.fileno())
                self._accept_retry = loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                return
            links: list[_RankLink] = []

            def protocol(links: list[_RankLink] = links) -> _RankLink:
                links.append(_RankLink(self))
                return links[-1]

            try:
                conn.setblocking(False)
                task = loop.create_task(loop.connect_accepted_socket(protocol, conn))
            except BaseException:
                conn.close()
                raise
            self._connecting.add(task)
            task.add_done_callback(functools.partial(self._connected, conn, links))

    def _connected(
        self, conn: socket.socket, links: list[_RankLink],
        task: asyncio.Task[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]],
    ) -> None:
        """An accepted connection's transport is made, or its making ended without one."""
        self._connecting.discard(task)
        if links and links[0].transport is not None:
            # The transport owns the socket (and closes it, however its making ended).
            if task.cancelled() or task.exception() is not None:
                self._made_then_cut(links[0])
            return
        # No transport took it: cancelled before it began (a loop-wide cancel), or it failed.
        conn.close()
        if not task.cancelled() and task.exception() is not None:
            log.warning("rank group: making the transport of a worker's connection failed: %r", task.exception())

    def _made_then_cut(self, link: _RankLink) -> None:
        """The link was made (``connection_made``), then its making ended without it (a loop-wide
        cancel before the task's next step): the loop closed the transport. asyncio tells the link
        (``connection_lost``, run by now or after the flush this abort cuts short); uvloop's
        ``_close()`` never does, and an abort after it does nothing: the link would stay listed,
        its ``closed`` never set, and the group's close wait for it for good (review 239). Its end
        is settled here then, a turn later (after what the abort scheduled)."""
        assert link.transport is not None
        link.transport.abort()

        def settle() -> None:
            if not link.closed.done():
                link.connection_lost(None)

        asyncio.get_running_loop().call_soon(settle)

    def _resume_accepting(self) -> None:
        self._accept_retry = None
        if self._listener is not None:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept_ready)

    def _stop_listening(self) -> None:
        """Accept nothing more and close the listener (idempotent): a worker connecting from now on
        is refused by the kernel; connections accepted before are made (and ended) in their tasks."""
        if self._accept_retry is not None:
            self._accept_retry.cancel()
            self._accept_retry = None
        listener, self._listener = self._listener, None
        if listener is not None:
            # The name goes first, while the open listener holds its inode: once closed, the file
            # is a dead manager's to one starting there, which removes it and binds a socket the
            # file system may give the same inode number (ext4 does), and our unlink after the
            # close then removed that live manager's socket (review 249).
            # The claim goes after the name: while it stands, another host's start is refused and
            # cannot replace the socket, so the name is still ours. Gone first, such a start took
            # the socket for a dead one's and bound its own, given the inode number freed, and our
            # unlink removed that live socket.
            if self._endpoint is not None:
                unlink_socket(self._endpoint.socket_path, self._socket_id)
                if self._claim is not None:
                    release_claim(self._endpoint, self._claim)
            self._claim = self._socket_id = None
            with contextlib.suppress(ValueError, OSError):  # not registered (a failed start, a pause)
                asyncio.get_running_loop().remove_reader(listener.fileno())
            listener.close()

    def _fence_all(self) -> None:
        owing = self._jobs.owing_ranks()
        log.warning(
            "rank group closing: %d jobs still in flight after %.1f s; fencing ranks %s (they run "
            "nothing new, report what runs, then end their connection)",
            self._jobs.in_flight, self.config.close_timeout_s, self._owing_pids(),
        )
        for link in list(self._links):
            if link.attached and link.rank in owing:
                self._fence(link)

    def _fence(self, link: _RankLink) -> None:
        """Half-close ``link``: the worker sees EOF, runs nothing new and ends the connection once
        its copies are over (the connection's end then settles whatever it did not report)."""
        transport = link.transport
        if transport is None or transport.is_closing() or link.fenced:
            return
        link.fenced = True
        self._fenced += 1
        transport.write_eof()  # after what is buffered: specs already sent still arrive (and report)
        # No longer attached for new work: a submit now fails NOT_ATTACHED before anything is sent
        # (writing after the EOF raised in the middle of sending, with the spec already at the
        # other ranks, and the caller's slots handed back under their copies).
        self._notify()

    def _owing_pids(self) -> dict[int, int]:
        """Rank -> pid of the ranks that still owe a report."""
        owing = self._jobs.owing_ranks()
        return {r: link.pid for r, link in sorted(self._ranks.items()) if r in owing}

    async def __aenter__(self) -> RankGroup:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- ranks ----------------------------------------------------------------------------------

    @property
    def address(self) -> Path:
        """The socket path workers connect to (after :meth:`start`)."""
        if self._endpoint is None:
            raise RuntimeError("the rank group is not started")
        return self._endpoint.socket_path

    @property
    def attached(self) -> frozenset[int]:
        """Ranks whose worker is connected, has the pool mapped and is not fenced."""
        return frozenset(r for r, conn in self._ranks.items() if conn.attached and not conn.fenced)

    @property
    def device_kind(self) -> str | None:
        """The kind of device the ranks copy on (their KV buffers': ``cpu``, ``cuda``, ...), once
        every rank is attached; ranks on different kinds give them sorted, joined by ``+``. None
        while a rank is missing."""
        if not self._all_attached.is_set():
            return None
        return "+".join(sorted({conn.device for conn in self._ranks.values() if conn.attached}))

    @property
    def all_attached(self) -> bool:
        """True when every rank is attached (a submit can succeed)."""
        return self._all_attached.is_set()

    def sessions(self) -> tuple[int, ...]:
        """Per rank, the session of its attachment now (0: not attached, or fenced).

        Every attach of a worker (a restarted rank process, or a live one re-attaching) starts a
        new session; a session ends with its connection or its fence. Capture this when a call is
        admitted and pass it with each of the call's specs (``submit*(spec, sessions=...)``): a
        spec is then sent only while each of its ranks is still in the session it was admitted
        for, never to a process that came after (its KV buffer holds its own engine's state).
        """
        return self._sessions

    async def wait_attached(self) -> None:
        """Wait until every rank is attached; raises ``RuntimeError`` once the group closes."""
        while not self._all_attached.is_set():
            if self._closing:
                raise RuntimeError("the rank group is closed")
            await self._changed.wait()

    async def wait_change(self) -> frozenset[int]:
        """Wait for the next change of :attr:`attached` (a rank came or went); returns the new set.

        Raises ``RuntimeError`` once the group closes.
        """
        if self._closing:
            raise RuntimeError("the rank group is closed")
        await self._changed.wait()
        return self.attached

    def _notify(self) -> None:
        # One event per change: waiters wake, re-check and wait on the next one.
        attached = self.attached
        self._sessions = tuple(self._ranks[r].session if r in attached else 0 for r in self._rank_order)
        completed = False
        if len(attached) == self.tp_size:
            completed = not self._all_attached.is_set()
            self._all_attached.set()
        else:
            self._all_attached.clear()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        kind = self.device_kind
        if completed and self._on_all_attached is not None and kind is not None:
            try:
                self._on_all_attached(kind)
            except Exception:  # the listener's fault must not end the rank's connection
                log.exception("rank group: on_all_attached(%r) failed", kind)

    # -- jobs -----------------------------------------------------------------------------------

    def spec(
        self,
        direction: Direction,
        page_ids: IntArrayLike,
        slots: IntArrayLike,
        skip_first: int = 0,
        layered: bool = False,
        stream: int = 0,
    ) -> TransferSpec:
        """A spec for this group's pool with the next job id (see :meth:`TransferSpec.build`).
        ``stream``: a LOAD's load stream (:meth:`begin_stream`), 0 for none."""
        job_id = self._next_job
        self._next_job += 1
        return TransferSpec.build(
            job_id, direction, self.epoch, self.layout.page_tokens, page_ids, slots, skip_first, layered, stream
        )

    def begin_stream(self) -> int:
        """A load stream begins: returns its id (for its LOAD specs, :meth:`spec`) and tells every
        attached rank now (a STREAM_BEGINS frame, ahead of any spec of the stream on its link).

        Each rank records its *mark* on its engine's stream when it reads the frame: the stream's
        copies there are ordered after that mark, so after everything the rank's engine had queued
        by then, and so after all it queued before this call. A rank that is not attached now gets
        nothing: the stream's specs (admitted for the sessions of now) never reach a later session
        of it. Returns 0 and sends nothing once the group is closing (nothing more is sent at all),
        or once the ids ran out (``2**64 - 1`` streams): the stream's copies are then ordered at
        their launch, as a stream no rank holds a mark of (before, the id's encoding raised
        ``struct.error`` out of ``start_load``).
        """
        if self._closing or self._next_stream > _STREAM_ID_MAX:
            return 0
        stream = self._next_stream
        self._next_stream += 1
        data = frame(FrameKind.STREAM_BEGINS, StreamBegins(stream).encode())
        for rank in self._rank_order:
            conn = self._ranks.get(rank)
            if conn is None or not conn.attached or conn.fenced or conn.transport is None \
                    or conn.transport.is_closing():
                continue
            conn.transport.write(data)  # buffered: never blocks (a 13-byte frame per stream)
        return stream

    def submit_nowait(self, spec: TransferSpec, sessions: Sequence[int] | None = None) -> Job:
        """Send ``spec`` to its ranks (OFFLOAD: the writers; LOAD: all) and return its :class:`Job`.

        A layered spec's job has one readiness future per layer (:attr:`Job.layer_futures`).
        Without every rank attached, or once closing, the job is returned already failed
        (NOT_ATTACHED / GROUP_CLOSED); nothing is sent. ``sessions``: what :meth:`sessions` said
        when the spec's call was admitted (None: now); a target rank in another session now (it
        attached again since: RANK_LOST; it was not attached then: NOT_ATTACHED) fails the job
        the same way, before any rank is sent anything. Raises ``asyncio.QueueFull`` when
        ``max_jobs`` jobs are in flight or others wait for room (:meth:`submit`,
        :meth:`submit_queued`: specs reach the ranks in the order they were submitted), and
        ``ValueError`` for a spec of another pool, page size or page range, one longer than
        ``max_frame_bytes``, a job id already in flight, or ``sessions`` not of one int per rank.
        """
        if self._closing:
            return self._closed_job(spec)
        targets, layers = self._check_spec(spec)
        admitted = self._admitted(sessions)
        if self._room.waiting:
            raise asyncio.QueueFull(f"{self._room.waiting} submissions wait for room ahead of job {spec.job_id}")
        return self._send_new(spec, targets, layers, admitted)

    def submit_queued(self, spec: TransferSpec, sessions: Sequence[int] | None = None) -> Job:
        """:meth:`submit_nowait` when there is room and nothing waits, else hold ``spec`` until room
        frees (in submission order) and send it then; returns its :class:`Job` at once.

        A held job's futures exist already (its layer futures too); it is sent only once earlier
        submissions were. :meth:`withdraw` ends it unsent. The group's close withdraws every held
        job at once: their outcome is ``withdrawn`` (nothing of them ran; not a failure). Ranks
        missing when its turn comes, or no longer in the ``sessions`` it was admitted for, fail
        it unsent, as :meth:`submit_nowait` would. Raises ``ValueError`` as :meth:`submit_nowait` does.
        """
        if self._closing:
            return self._closed_job(spec)
        targets, layers = self._check_spec(spec)
        admitted = self._admitted(sessions)
        if self._room.has_room():
            return self._send_new(spec, targets, layers, admitted)
        job = self._jobs.hold(spec, targets, layers, admitted)
        self._room.hold(job)
        return job

    def withdraw(self, jobs: Iterable[Job]) -> int:
        """Withdraw those of ``jobs`` still held (:meth:`submit_queued`): none of them is ever sent,
        all before the queue moves on. Returns how many were; jobs sent or ended are left alone."""
        ended = self._room.withdraw(jobs)
        self._tell_withdrawn(ended)
        return len(ended)

    async def submit(self, spec: TransferSpec, sessions: Sequence[int] | None = None) -> Job:
        """:meth:`submit_nowait` after waiting for room among the ``max_jobs`` in flight, in turn
        with other waiting submissions. ``sessions`` (None: now, before the wait) are checked when
        the turn comes.

        Cancelled while it waits: nothing is sent and nothing of it is kept. The group's close
        ends the wait at once: the job returned is ``withdrawn`` (not sent, not a failure).
        Raises ``ValueError`` (before waiting) as :meth:`submit_nowait` does.
        """
        if self._closing:
            return self._closed_job(spec)
        targets, layers = self._check_spec(spec)
        admitted = self._admitted(sessions)
        if self._room.has_room():
            return self._send_new(spec, targets, layers, admitted)
        if not await self._room.wait_turn():  # woken by the close: never sent
            return self._jobs.withdrawn_job(spec, targets, layers)
        return self._send_new(spec, targets, layers, admitted)  # at once: those behind us move after it

    @property
    def closing(self) -> bool:
        """True once :meth:`aclose` was called: nothing more is sent."""
        return self._closing

    def _closed_job(self, spec: TransferSpec) -> Job:
        targets = self.writers if spec.direction is Direction.OFFLOAD else self._all_ranks
        layers = self.layout.num_layers if spec.layered else 0
        failures = [RankFailure(r, RankStatus.GROUP_CLOSED, "the rank group is closed") for r in sorted(targets)]
        return self._jobs.failed_job(spec, failures, layers)

    def _check_spec(self, spec: TransferSpec) -> tuple[frozenset[int], int]:
        """The spec's target ranks and layer count; ``ValueError`` when it does not fit this group."""
        if spec.epoch != self.epoch:
            raise ValueError(f"spec epoch {spec.epoch:#x} is not this group's pool epoch {self.epoch:#x}")
        if spec.page_tokens != self.layout.page_tokens:
            raise ValueError(f"spec pages hold {spec.page_tokens} tokens; the layout's hold {self.layout.page_tokens}")
        if spec.stream >= self._next_stream:
            raise ValueError(f"spec names load stream {spec.stream}, which this group never began")
        if int(spec.page_ids.max()) >= self.num_pages:
            raise ValueError(f"spec names page {int(spec.page_ids.max())}; the pool has {self.num_pages}")
        if spec.encoded_bytes + 1 > self.config.max_frame_bytes:
            # Sent, the ranks' parsers would end the link at it (and at the next such spec).
            raise ValueError(f"spec of {spec.encoded_bytes} bytes does not fit a frame "
                             f"(TPConfig.max_frame_bytes={self.config.max_frame_bytes})")
        targets = self.writers if spec.direction is Direction.OFFLOAD else self._all_ranks
        return targets, self.layout.num_layers if spec.layered else 0

    def _admitted(self, sessions: Sequence[int] | None) -> tuple[int, ...]:
        """``sessions`` checked (one non-negative int per rank), or the sessions now when None."""
        if sessions is None:
            return self._sessions
        found = tuple(sessions)
        if len(found) != self.tp_size or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in found):
            raise ValueError(f"sessions must be {self.tp_size} non-negative ints (RankGroup.sessions()), "
                             f"got {sessions!r}")
        return found

    def _unsendable(self, targets: frozenset[int], sessions: tuple[int, ...]) -> list[RankFailure]:
        """Why a job admitted for ``sessions`` cannot be sent to ``targets`` now (empty: it can):
        a failure per rank not attached, and per target attached in another session than the
        one its call was admitted for (the process it was meant for is gone, or was not there)."""
        now = self._sessions
        if sessions == now and self._all_attached.is_set():
            return []  # the usual case: one comparison per submit
        missing = self._all_ranks - self.attached if not self._all_attached.is_set() else frozenset()
        failures = {r: RankFailure(r, RankStatus.NOT_ATTACHED, f"rank {r} is not attached") for r in missing}
        for rank in targets - missing:
            if sessions and sessions[rank] != now[rank]:
                pid = self._ranks[rank].pid
                if sessions[rank] == 0:
                    failures[rank] = RankFailure(
                        rank, RankStatus.NOT_ATTACHED,
                        f"rank {rank} was not attached when the call was admitted (now pid {pid})")
                else:
                    failures[rank] = RankFailure(
                        rank, RankStatus.RANK_LOST,
                        f"rank {rank} attached again (pid {pid}) since the call was admitted: the worker "
                        "it was admitted for is gone")
        return [failures[r] for r in sorted(failures)]

    def _send_new(self, spec: TransferSpec, targets: frozenset[int], layers: int, sessions: tuple[int, ...]) -> Job:
        failures = self._unsendable(targets, sessions)
        if failures:
            return self._jobs.failed_job(spec, failures, layers)
        job = self._jobs.open(spec, targets, layers, sessions)
        self._send(job)
        return job

    def _send(self, job: Job) -> None:
        data = frame(FrameKind.SPEC, job.spec.to_bytes())
        for rank in self._writer_order if job.spec.direction is Direction.OFFLOAD else self._rank_order:
            conn = self._ranks[rank]
            transport = conn.transport
            if transport is None or transport.is_closing() or conn.fenced:
                self._jobs.report(job.id, rank, RankStatus.RANK_LOST, f"rank {rank}'s connection is closing")
            else:
                transport.write(data)  # buffered: never blocks; bounded by max_jobs frames per rank
                conn.specs_sent += 1

    def _tell_withdrawn(self, jobs: Iterable[Job]) -> None:
        """Layered jobs ended unsent: their ids may be in a ``layered_load()`` the ranks' engines
        wait on (a held job's id is), and they never arrive, so each target rank is told (in order
        with the specs sent before): its waits for them end False instead of lasting until a later
        job arrives, or forever on an idle group."""
        for job in jobs:
            if not job.spec.layered:
                continue
            data = frame(FrameKind.WITHDRAWN, Withdrawn(job.id).encode())
            for rank in sorted(job.ranks):
                conn = self._ranks.get(rank)
                if conn is None or conn.fenced or conn.transport is None or conn.transport.is_closing():
                    continue  # its session ends: every wait of it ends with it
                conn.transport.write(data)

    def _room_freed(self) -> None:
        # The job table's on_room: the table is made first (the queue takes it), so it calls through here.
        self._room.room_freed()

    def _send_held(self, job: Job) -> None:
        """A held job's turn came (room is reserved for it): send it, or fail it unsent when ranks
        are missing or not in the sessions it was admitted for, as :meth:`submit_nowait` would."""
        failures = self._unsendable(job.ranks, job.sessions)
        if failures:
            if self._jobs.fail_held(job, failures):
                self._tell_withdrawn([job])
        else:
            self._jobs.admit(job)
            self._send(job)

    @property
    def jobs(self) -> JobTable:
        """The table owning every in-flight job (``in_flight``, ``pending_ranks``, ``wait_idle``)."""
        return self._jobs

    def statistics(self) -> GroupStatistics:
        """Connections, ranks and job counts."""
        return GroupStatistics(
            address=os.fspath(self._endpoint.socket_path) if self._endpoint else "",
            epoch=self.epoch,
            pool_name=self.pool_name,
            tp_size=self.tp_size,
            attached=self.attached,
            connections=self._accepted,
            refused=self._refused,
            attach_failures=self._attach_failures,
            disconnects=self._disconnects,
            link_errors=self._link_errors,
            jobs=self._jobs.statistics(),
            waiting=self._room.waiting,
            fenced=self._fenced,
            held_ranks=len(self._orphans),
            worker_closes=self._worker_closes,
        )

    # -- connections ----------------------------------------------------------------------------

    def _on_hello(self, link: _RankLink, hello: Hello) -> None:
        assert link.transport is not None
        link.pid, uid = transport_peer(link.transport)
        held = self._ranks.get(hello.rank) if trusted_peer(uid) else None
        if held is not None and held in self._orphans and held.pid == link.pid:
            # The orphan's own process begins a new session: a worker runs its sessions one at a
            # time and ends one only once its copies are over (RankWorker._session drains first).
            self._orphan_ended(held)
        refusal = self._check_hello(hello, uid)
        if refusal is not None:
            self._refused += 1
            log.warning("rank group: refused pid %d (rank %d): %s", link.pid, hello.rank, refusal.text)
            link.state = _LinkState.ENDED
            link.transport.write(frame(FrameKind.REFUSE, refusal.encode()))
            link.transport.close()  # after the refusal is flushed
            return
        link.rank = hello.rank
        link.device = hello.device
        link.watch_process(self._process_exited)
        self._ranks[hello.rank] = link  # claimed: a second hello for this rank is refused
        link.state = _LinkState.ATTACH
        welcome = Welcome(
            PROTOCOL_VERSION, self.tp_size, self.page_layout.fingerprint, self.epoch,
            self.num_pages, self.page_layout.page_bytes, self.pool_name, self.num_slots or 0, self._next_job,
        )
        link.transport.write(frame(FrameKind.WELCOME, welcome.encode()))

    def _on_attached(self, link: _RankLink, report: Attached) -> None:
        assert link.transport is not None
        if not report.ok or report.epoch != self.epoch:
            self._attach_failures += 1
            why = report.text if not report.ok else f"attached epoch {report.epoch:#x}"
            log.warning("rank group: rank %d (pid %d) cannot attach %s: %s", link.rank, link.pid, self.pool_name, why)
            link.state = _LinkState.ENDED
            link.transport.close()
            return
        link.state = _LinkState.SERVING
        link.attached = True
        self._last_session += 1
        link.session = self._last_session
        link.stop_timer()
        log.info("rank group: rank %d attached (pid %d)", link.rank, link.pid)
        self._notify()

    def _on_closed(self, link: _RankLink, closed: Closed) -> None:
        """The worker ended its session: it took the first ``closed.taken`` specs written on the link
        and none after, reported every one it took (those DONE frames came before this one) and
        runs nothing more. What the rank still owes was written after those and never run (checked:
        as many jobs as specs written after them): failed now, and the link ended without
        holding the rank (a connection that just ends is held while its process lives, see
        :meth:`_orphan`; this one said its copies are over)."""
        owed = self._jobs.owed_by(link.rank)
        if closed.taken > link.specs_sent or len(owed) != link.specs_sent - closed.taken:
            # What it owes is not what it says it never took (it took some and never reported
            # them, or counts otherwise): its word that nothing runs cannot be checked. Left to the
            # connection's end, as without the frame. Told by the order specs were written, not by
            # job id: ids follow the order specs were built, not sent (review 191).
            log.warning("rank group: rank %d (pid %d) closed having taken %d of the %d specs sent (the last job "
                        "%d) while it owes %d jobs; its connection's end decides", link.rank, link.pid,
                        closed.taken, link.specs_sent, closed.last_job, len(owed))
            return
        self._worker_closes += 1
        link.state = _LinkState.ENDED  # its later frames are not taken
        log.info("rank group: rank %d (pid %d) closed its worker after job %d", link.rank, link.pid, closed.last_job)
        self._settle_drop(link, RankStatus.WORKER_CLOSING,
                          f"rank {link.rank} (pid {link.pid}) closed its worker before it took the job")
        if link.transport is not None:
            link.transport.abort()  # the worker waits for this end before it closes its own

    def _on_link_error(self, link: _RankLink, why: str) -> None:
        self._link_errors += 1
        who = "before hello" if link.rank < 0 else f"of rank {link.rank} (pid {link.pid})"
        log.warning("rank group: connection %s ended: %s", who, why)
        if link.attached and link.rank in self._jobs.owing_ranks():
            # Its copies may still run: failing its jobs now would hand their slots back to the
            # engine under them. Fenced, the worker ends the connection once they are over, and
            # the connection's end fails what it owes (its later frames are ignored).
            link.state = _LinkState.ENDED
            self._fence(link)
        elif link.transport is not None:
            link.transport.abort()

    def _check_hello(self, hello: Hello, uid: int) -> Refuse | None:
        if not trusted_peer(uid):
            return Refuse(RefuseReason.PEER, f"peer uid {uid} is not this manager's user")
        if hello.version != PROTOCOL_VERSION:
            return Refuse(
                RefuseReason.VERSION,
                f"worker speaks protocol {hello.version}, this manager speaks {PROTOCOL_VERSION}",
            )
        if hello.tp_size != self.tp_size:
            return Refuse(RefuseReason.TP_SIZE, f"worker has tp_size {hello.tp_size}, the group has {self.tp_size}")
        if hello.fingerprint != self.page_layout.fingerprint:
            return Refuse(
                RefuseReason.LAYOUT,
                f"worker's page format fingerprint {hello.fingerprint.hex()} differs from the manager's "
                f"{self.page_layout.fingerprint.hex()} ({self.page_layout.describe()})",
            )
        if not 0 <= hello.rank < self.tp_size:
            return Refuse(RefuseReason.RANK_RANGE, f"rank {hello.rank} out of range for tp_size {self.tp_size}")
        if self._closing:
            return Refuse(RefuseReason.CLOSING, "the rank group is closing")
        if hello.rank in self._ranks:
            return Refuse(RefuseReason.RANK_TAKEN, f"rank {hello.rank} is already connected")
        return None

    def _drop(self, link: _RankLink, serving: bool) -> None:
        """``link``'s connection ended; ``serving``: it was serving then (not refused, not ended
        by a frame this side could not take)."""
        self._links.discard(link)
        if link.rank < 0 or self._ranks.get(link.rank) is not link:
            link.unwatch_process()
            return
        if serving and link.attached and link.rank in self._jobs.owing_ranks() and self._orphan(link):
            return
        self._settle_drop(link)

    def _process_exited(self, link: _RankLink) -> None:
        """``link``'s peer process exited (its pidfd is readable): none of its copies runs any more.

        Its connection may outlive it: another process holding a copy of its socket (a child it
        forked without exec, a tool that took the descriptor) kept it open, and the rank's jobs
        waited for reports that never came (a load or offload hung, and the close with it)."""
        link.exited = True
        link.unwatch_process()
        if link in self._orphans:
            self._orphan_ended(link)
        elif link.transport is not None and not link.transport.is_closing():
            log.warning("rank group: rank %d (pid %d) exited with its connection still open (another process "
                        "holds its socket)", link.rank, link.pid)
            link.transport.abort()  # its end settles what it owes (see _drop)

    def _orphan(self, link: _RankLink) -> bool:
        """Hold ``link``'s unreported parts if its process still lives; True when held.

        A worker ends its connection only once none of its copies runs, and a dead process's copies
        died with it; but a live worker's connection may end under it (a third party shut the
        socket down: ``ss -K``, a tool holding a copy of the descriptor). Its copies then still
        run: failing its jobs now handed their slots and pages back under them (the engine reused
        the slots, the rank's copy landed in them after the load returned). Held until the process
        exits or says hello again (its worker's session ended: drained first); meanwhile the rank
        counts as not attached and its number stays taken. Without a process handle (a worker in
        this process, a peer in another pid namespace, no pidfd): not held, as before. A worker
        that ends its session itself says so first (:meth:`_on_closed`): such a link never gets here."""
        if link.pidfd is None or link.exited:
            return False
        self._orphans.add(link)
        link.fenced = True  # not attached for new work from now on
        log.info("rank group: the connection of rank %d (pid %d) ended while it owed reports; its jobs stay in "
                 "flight until that process exits or attaches again", link.rank, link.pid)
        self._notify()
        return True

    def _orphan_ended(self, link: _RankLink) -> None:
        """An orphaned rank's process exited or began a new session: its copies are over."""
        if link not in self._orphans:
            return
        self._orphans.discard(link)
        if self._ranks.get(link.rank) is link:
            self._settle_drop(link)
        link.unwatch_process()

    def _settle_drop(self, link: _RankLink, status: RankStatus = RankStatus.RANK_LOST, text: str = "") -> None:
        """``link`` is gone: free its rank and fail what it owes (``status``, ``text``)."""
        link.unwatch_process()
        del self._ranks[link.rank]
        if link.attached:
            self._disconnects += 1
            failed = self._jobs.rank_lost(link.rank, status, text or f"rank {link.rank} (pid {link.pid}) lost")
            if not self._closing:
                level = logging.WARNING if failed else logging.INFO
                log.log(level, "rank group: rank %d (pid %d) detached; %d jobs failed", link.rank, link.pid, failed)
            self._notify()


class _LinkState(enum.Enum):
    HELLO = "hello"
    ATTACH = "attach"
    SERVING = "serving"
    ENDED = "ended"


class _RankLink(asyncio.Protocol):
    """One worker connection, driven by the loop's read callbacks.

    Frames are handled as they arrive, in the callback that read them: no task, and no task
    wake-up, per connection or per completion (eight ranks' completions cost one pass each).
    """

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.rank = -1
        self.pid = 0
        self.device = ""  # the kind of device the rank's KV buffer is on (from its hello)
        self.attached = False
        self.state = _LinkState.HELLO
        self.transport: asyncio.Transport | None = None
        self.parser = FrameParser(group.config.max_frame_bytes)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.fenced = False  # half-closed by the manager: the worker ends it once its copies are over
        self.session = 0  # this attachment's session (RankGroup.sessions()), set once attached
        self.specs_sent = 0  # SPEC frames written (a CLOSED says how many of the first it took)
        self.pidfd: int | None = None  # the peer process (at hello), to tell its exit from a severed socket
        self.exited = False  # the peer process exited (its pidfd became readable)
        self._timer: asyncio.TimerHandle | None = None

    def watch_process(self, exited: Callable[[_RankLink], None]) -> None:
        """Call ``exited(self)`` on the loop when the peer process (:attr:`pid`) exits, through a
        pidfd; nothing for this process, pid 0, or without pidfds (:attr:`pidfd` stays None)."""
        if self.pidfd is not None or not 0 < self.pid != os.getpid() or not hasattr(os, "pidfd_open"):
            return
        pidfd = self._peer_pidfd()
        if pidfd is None:
            # The process that connected is gone (its pid may be another's already): whoever
            # holds its socket now is not the worker that connected. Ended as when it exits later.
            self.exited = True
            asyncio.get_running_loop().call_soon(exited, self)
            return
        if pidfd < 0:
            return
        try:
            asyncio.get_running_loop().add_reader(pidfd, exited, self)
        except (OSError, ValueError, NotImplementedError, RuntimeError):
            os.close(pidfd)
            return
        self.pidfd = pidfd

    def _peer_pidfd(self) -> int | None:
        """A pidfd of the process that connected: ``SO_PEERPIDFD`` (Linux 6.5) names that process
        itself, where ``pidfd_open`` of the pid ``SO_PEERCRED`` gave may open an unrelated process
        that was given the pid after it exited (review 182: a rank's jobs then waited for that
        stranger's exit). None: that process is gone; -1: no pidfd to be had."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None and sys.platform == "linux":
            try:
                return int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    return None
                # ENOPROTOOPT: a kernel before 6.5; the pid's pidfd then (exact unless it was reused).
        try:
            return os.pidfd_open(self.pid)
        except OSError as exc:
            return None if exc.errno == errno.ESRCH else -1

    def unwatch_process(self) -> None:
        pidfd, self.pidfd = self.pidfd, None
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.group._links_ended:
            self.state = _LinkState.ENDED
            self.transport.abort()
            return
        self.group._links.add(self)
        self.group._accepted += 1
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.group.config.handshake_timeout_s, self._handshake_timeout)

    @property
    def ended(self) -> bool:
        """Whether frames from this connection are no longer taken."""
        return self.state is _LinkState.ENDED

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handshake_timeout(self) -> None:
        self._timer = None
        if not self.attached:
            self.group._on_link_error(self, "no hello/attach report within the handshake timeout")

    def _read_left(self) -> None:
        """Take the frames the peer wrote before the connection ended with an error, still unread.

        A write that fails (EPIPE: the worker closed its socket) ends the connection before the loop
        read what waits in it: a manager whose loop stalled past the worker's ``handshake_timeout_s``
        and then sent a spec before polling lost the worker's CLOSED, and held the rank until its
        process exited (review 196). Selector loops only: they close the socket after this callback
        (another loop may have closed the descriptor already, its number given to another file)."""
        transport = self.transport
        if transport is None or not isinstance(asyncio.get_running_loop(), asyncio.SelectorEventLoop):
            return
        sock = transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        for _ in range(64):  # bounded: a socket's receive buffer holds a few hundred KiB at most
            if fd < 0 or self.state is not _LinkState.SERVING:
                return
            try:
                data = os.read(fd, 1 << 16)  # non-blocking (asyncio's socket): EAGAIN once drained
            except OSError:
                return
            if not data:
                return
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return  # refused, or broken and fenced: only the connection's end matters now
        try:
            for kind, payload in self.parser.feed(data):
                if self.state is _LinkState.SERVING and kind is FrameKind.DONE:
                    done = Done.decode(payload)
                    self.group._jobs.report(done.job_id, self.rank, done.status, done.text)
                elif self.state is _LinkState.SERVING and kind is FrameKind.LAYERS:
                    layers = Layers.decode(payload)
                    self.group._jobs.report_layers(layers.job_id, self.rank, layers.landed)
                elif self.state is _LinkState.SERVING and kind is FrameKind.CLOSED:
                    self.group._on_closed(self, Closed.decode(payload))
                elif self.state is _LinkState.HELLO and kind is FrameKind.HELLO:
                    self.group._on_hello(self, Hello.decode(payload))
                elif self.state is _LinkState.ATTACH and kind is FrameKind.ATTACHED:
                    self.group._on_attached(self, Attached.decode(payload))
                elif self.state is not _LinkState.ENDED:
                    raise ProtocolError(f"unexpected {kind.name} frame in state {self.state.value}")
        except ProtocolError as exc:
            self.state = _LinkState.ENDED
            self.group._on_link_error(self, f"ProtocolError: {exc}")
        except Exception as exc:
            # A frame this side failed to handle (a bug, not the peer's): escaping, asyncio would
            # abort the transport and the connection's end would fail the rank's jobs while its
            # copies may still run. Fenced like a malformed frame instead.
            log.error("rank group: handling a frame of rank %d failed", self.rank, exc_info=True)
            self.state = _LinkState.ENDED
            self.group._on_link_error(self, f"{type(exc).__name__}: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_timer()
        if exc is not None and self.state is _LinkState.SERVING:
            self._read_left()
        serving = self.state is _LinkState.SERVING
        self.state = _LinkState.ENDED
        if exc is not None:
            log.debug("rank group: connection of rank %d ended: %r", self.rank, exc)  # e.g. reset by a killed rank
        self.group._drop(self, serving)
        self.closed.set_result(None)

