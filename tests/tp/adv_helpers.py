"""Adversarial TP tests' helpers: a prefix oracle and rank processes the test writes and reads.

The oracle ties each token's KV to its whole prefix (and salt): the value of token ``i`` at layer
``l``, row ``r``, lane ``d`` is a hash of ``(salt, tokens[: i + 1], l, r, d)``, so a page stored
from the wrong slots, a late copy of another prompt, or another rank's heads all show as a wrong
byte on the rank that got them. The rank processes start with a zeroed buffer; the test plays the
engine: it writes a prompt's KV into slots (its "prefill") and reads slots back after a load.

Importable by spawned children (tests/tp is on their ``sys.path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import threading
import time
from collections.abc import Coroutine, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import numpy as np
import torch
from child_procs import fork_context
from tp_helpers import CONFIG, rank_kv, shm_mappings

from aiokv.layout import KVLayout
from aiokv.results import Match
from aiokv.tp import RankWorker, RankWorkerThread, TPCache, TPConfig

CALL_S = 60.0
"""Bound on any one call of the cache: a call that takes longer is a hang."""
START_S = 120.0
"""Bound on spawning a rank process and its attach (torch import on a loaded 2-core machine)."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """splitmix64's finalizer, elementwise (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def prefix_hashes(tokens: Sequence[int], salt: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """``h[i]``: a hash of ``salt`` and ``tokens[: i + 1]`` (each step mixes the previous hash)."""
    out = np.empty(len(tokens), np.uint64)
    h = _mix(np.array([salt & 0xFFFFFFFFFFFFFFFF], np.uint64))
    for i, tok in enumerate(tokens):
        h = _mix(h ^ np.array([tok & 0xFFFFFFFFFFFFFFFF], np.uint64))
        out[i] = h[0]
    return out


def prefix_kv(layout: KVLayout, tokens: Sequence[int], salt: int) -> torch.Tensor:
    """Full-row KV ``[L, n, rows, D]`` of ``tokens`` (every head), each value a hash of the prefix.

    Values are integers in [-512, 511]: exact in fp16/bf16, never NaN, so ``torch.equal`` is exact.
    """
    L, rows, D = layout.num_layers, layout.rows, layout.head_dim
    h = prefix_hashes(tokens, salt)[None, :, None, None]
    lane = (np.arange(L, dtype=np.uint64)[:, None, None, None] * np.uint64(0x9E3779B97F4A7C15)
            + np.arange(rows, dtype=np.uint64)[None, None, :, None] * np.uint64(0xD1B54A32D192ED03)
            + np.arange(D, dtype=np.uint64)[None, None, None, :] * np.uint64(0x8CB92BA72F3D8DD7))
    with np.errstate(over="ignore"):
        bits = _mix(h + lane) >> np.uint64(54)
    values = bits.astype(np.int64) - 512
    return torch.from_numpy(values).to(layout.dtype)


def rank_prefix_kv(layout: KVLayout, tokens: Sequence[int], salt: int, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of :func:`prefix_kv` (its K heads, then its V heads)."""
    return rank_kv(prefix_kv(layout, tokens, salt), layout, rank, tp_size)


# -- rank processes ---------------------------------------------------------------------------------


def _raw(t: torch.Tensor) -> tuple[bytes, tuple[int, ...]]:
    return t.contiguous().view(torch.uint8).numpy().tobytes(), tuple(t.shape)


def _tensor(raw: tuple[bytes, tuple[int, ...]], dtype: torch.dtype) -> torch.Tensor:
    data, shape = raw
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def _serve(command: Any, kv: torch.Tensor, stats: Any) -> Any:
    """One command of the test on this rank's buffer; None ends the loop."""
    kind = command[0]
    if kind == "write":  # the engine's prefill of these slots
        _, slots, raw = command
        kv[:, torch.as_tensor(slots, dtype=torch.int64)] = _tensor(raw, kv.dtype)
        return ("ok",)
    if kind == "read":
        _, slots = command
        return _raw(kv[:, torch.as_tensor(slots, dtype=torch.int64)])
    if kind == "stats":
        return stats()
    if kind == "threads":
        return sorted(t.name for t in threading.enumerate())
    if kind == "maps":
        return shm_mappings()
    return None


def _slow_copies(slow_s: float) -> None:
    """Each CPU copy of this process (HostGather.offload or HostScatter.load in the rank's mover) first
    sleeps up to ``slow_s`` (one in ten 4 ``slow_s`` longer): a copy still running when its call
    returned, or landing late into slots given to another prompt, gets a window wide enough to show."""
    from aiokv.kernels import mover

    rng = random.Random(os.getpid())

    def slowed(copy: Any) -> Any:
        def slow_copy(*args: Any) -> None:
            time.sleep(rng.uniform(0, slow_s) + (4 * slow_s if rng.random() < 0.1 else 0.0))
            copy(*args)

        return slow_copy

    mover.HostGather.offload = slowed(mover.HostGather.offload)  # type: ignore[method-assign]
    mover.HostScatter.load = slowed(mover.HostScatter.load)  # type: ignore[method-assign]


def adv_rank_main(
    ctrl: multiprocessing.connection.Connection, address: str, rank: int, tp_size: int, layout: KVLayout,
    slots: int, threaded: bool, config: TPConfig, slow_s: float = 0.0,
) -> None:
    """A rank process with a zeroed KV buffer of its heads; serves ``write``/``read``/``stats``/``stop``."""
    torch.set_num_threads(1)
    if slow_s:
        _slow_copies(slow_s)
    kv = rank_kv(torch.zeros(layout.num_layers, slots, layout.rows, layout.head_dim, dtype=layout.dtype),
                 layout, rank, tp_size)
    if threaded:
        with RankWorkerThread(address, rank, tp_size, layout, kv, config) as runner:
            ctrl.send(("started", os.getpid()))
            while True:
                reply = _serve(ctrl.recv(), kv, runner.statistics)
                if reply is None:
                    break
                ctrl.send(reply)
        ctrl.send(("stopped", runner.error))
        return

    async def main() -> None:
        async with RankWorker(address, rank, tp_size, layout, kv, config) as worker:
            await asyncio.to_thread(ctrl.send, ("started", os.getpid()))
            while True:
                # Commands run on the worker's loop (the engine's thread); replies go out from a
                # thread so a long one never stalls the worker's reports.
                reply = _serve(await asyncio.to_thread(ctrl.recv), kv, worker.statistics)
                if reply is None:
                    break
                await asyncio.to_thread(ctrl.send, reply)
        await asyncio.to_thread(ctrl.send, ("stopped", None))

    asyncio.run(main())


class RankGone(Exception):
    """The rank process died (or was killed) while the test talked to it."""


class Rank:
    """One rank process and its command pipe; commands are serialized by a lock."""

    def __init__(self, proc: BaseProcess, ctrl: multiprocessing.connection.Connection, generation: int) -> None:
        self.proc = proc
        self.ctrl = ctrl
        self.generation = generation
        self.lock = asyncio.Lock()
        self.started = False

    async def ask(self, command: object) -> Any:
        async with self.lock:
            try:
                async with asyncio.timeout(CALL_S):
                    if not self.started:
                        first = await asyncio.to_thread(self.ctrl.recv)
                        assert first[0] == "started", first
                        self.started = True
                    self.ctrl.send(command)
                    return await asyncio.to_thread(self.ctrl.recv)
            except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise RankGone(str(exc)) from exc


class AdvRanks:
    """``tp_size`` spawned rank processes (even ranks: thread runner, odd: async runner) that the test
    can SIGKILL and restart; :attr:`generation` counts each rank's processes."""

    def __init__(self, address: str, layout: KVLayout, tp_size: int, slots: int, config: TPConfig,
                 slow_s: float = 0.0) -> None:
        self.address, self.layout, self.tp_size, self.slots, self.config = address, layout, tp_size, slots, config
        self.slow_s = slow_s
        """Each rank copy sleeps up to this long first (0: copies run at full speed)."""
        self._ctx = fork_context()
        self.ranks: dict[int, Rank] = {}
        self.generation = [0] * tp_size
        self.dead: list[Rank] = []

    def start(self, rank: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=adv_rank_main,
            args=(child, self.address, rank, self.tp_size, self.layout, self.slots, rank % 2 == 0, self.config,
                  self.slow_s),
            daemon=True,
        )
        proc.start()
        child.close()
        self.generation[rank] += 1
        self.ranks[rank] = Rank(proc, parent, self.generation[rank])

    def start_all(self) -> None:
        for rank in range(self.tp_size):
            self.start(rank)

    def kill(self, rank: int) -> None:
        """SIGKILL rank ``rank``'s process (its generation ends at once: its buffer is gone)."""
        old = self.ranks.pop(rank)
        self.generation[rank] += 1  # before the signal: no task may count the dead buffer as its own
        assert old.proc.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(old.proc.pid, signal.SIGKILL)
        self.dead.append(old)  # its pipe is closed once reaped (a reader thread may still be in recv)

    async def stop(self, rank: int) -> None:
        """Close rank ``rank``'s worker cleanly (mid-traffic: it runs nothing new, its running copies
        end and report) and let its process exit; its generation ends at once, as for a kill."""
        old = self.ranks.pop(rank)
        self.generation[rank] += 1
        reply = await old.ask(("stop",))
        assert reply[0] == "stopped" and reply[1] is None, reply
        await asyncio.to_thread(old.proc.join, 60)
        assert old.proc.exitcode == 0, f"rank {rank} exited {old.proc.exitcode}"
        old.ctrl.close()

    def generations(self) -> tuple[int, ...]:
        return tuple(self.generation)

    async def write(self, rank: int, slots: Sequence[int], kv: torch.Tensor) -> None:
        r = self.ranks.get(rank)
        if r is None:
            raise RankGone(f"rank {rank} is restarting")
        assert await r.ask(("write", list(slots), _raw(kv))) == ("ok",)

    async def read(self, rank: int, slots: Sequence[int]) -> torch.Tensor:
        r = self.ranks.get(rank)
        if r is None:
            raise RankGone(f"rank {rank} is restarting")
        return _tensor(await r.ask(("read", list(slots))), self.layout.dtype)

    async def ask(self, rank: int, command: tuple[object, ...]) -> Any:
        return await self.ranks[rank].ask(command)

    async def stop_all(self) -> None:
        """Stop every worker cleanly, then join; each must exit 0 with no runner error."""
        for rank in sorted(self.ranks):
            r = self.ranks.pop(rank)
            reply = await r.ask(("stop",))
            assert reply[0] == "stopped" and reply[1] is None, reply
            await asyncio.to_thread(r.proc.join, 60)
            assert r.proc.exitcode == 0, f"rank {rank} exited {r.proc.exitcode}"
            r.ctrl.close()
        await self.reap_dead()

    async def reap_dead(self) -> None:
        for old in self.dead:
            await asyncio.to_thread(old.proc.join, 60)
            assert old.proc.exitcode == -signal.SIGKILL
            async with old.lock:  # no command of a task is still reading its pipe
                old.ctrl.close()
        self.dead.clear()

    async def kill_all(self) -> None:
        """Whatever a failed test left running."""
        for rank in list(self.ranks):
            self.kill(rank)
        await self.reap_dead()

    async def continue_and_kill_all(self) -> None:
        """:meth:`kill_all` after a SIGCONT to each rank: a test that stopped one may have failed
        before continuing it, and a stopped process is not reaped after SIGKILL until continued."""
        for r in self.ranks.values():
            if r.proc.pid is not None:
                os.kill(r.proc.pid, signal.SIGCONT)
        await self.kill_all()


# -- the soak: many engine requests against kills and cancels ---------------------------------------

SALTS: dict[str | None, int] = {None: 0, "tenant-b": 0x5EED}
R = TypeVar("R")


@dataclasses.dataclass
class Tally:
    """What a soak did, and every wrong byte it saw."""

    loads: int = 0
    loaded_tokens: int = 0
    verified_tokens: int = 0
    streams: int = 0
    offloads: int = 0
    stored: int = 0
    prefetches: int = 0
    cancelled: int = 0
    abandoned: int = 0
    kills: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)


class Slots:
    """The engine's slot space: LIFO reuse, so freed slots go to the next prompt at once."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        self.changed = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.free) >= n), CALL_S)
            taken = self.free[-n:]
            del self.free[-n:]
            return taken

    async def give(self, slots: list[int]) -> None:
        async with self.changed:
            self.free.extend(reversed(slots))
            self.changed.notify_all()


_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (the unified syscall table)


def socket_copies(pid: int, address: str) -> list[Any]:
    """Copies (``socket.socket``, this process's descriptors; the caller closes them) of process
    ``pid``'s connections to the Unix socket at ``address``, taken with ``pidfd_getfd``: what a child
    forked without exec, or a tool holding the descriptor, has. Raises ``PermissionError`` without
    ptrace rights over ``pid`` (root has them; a fork server's children are not this process's
    descendants under Yama's ptrace_scope 1)."""
    import ctypes
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    found: list[Any] = []
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd < 0:
                if ctypes.get_errno() == errno.EPERM:
                    raise PermissionError(f"no ptrace rights over pid {pid} (pidfd_getfd)")
                continue  # closed meanwhile
            sock = socket.socket(fileno=fd)
            try:
                ours = sock.family == socket.AF_UNIX and sock.getpeername() == address
            except OSError:
                ours = False
            if ours:
                found.append(sock)
            else:
                sock.close()
    finally:
        os.close(pidfd)
    return found


def sever_socket(pid: int, address: str) -> int:
    """A third party shuts down process ``pid``'s connection(s) to the Unix socket at ``address``
    (``shutdown(SHUT_RDWR)`` on a copy of its descriptor: what ``ss -K`` does). The process lives on
    and is not told. Returns how many connections were shut; raises as :func:`socket_copies`."""
    import socket

    copies = socket_copies(pid, address)
    for sock in copies:
        with sock, contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    return len(copies)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return bool(states) and all(s in ("T", "t") for s in states)


async def stop_process(pid: int, bound_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. ``kill`` only queues the
    signal: the thread it wakes must run before the others are told to stop, and on a loaded host
    (16 pytest workers on the H200 host) a rank went on serving a load sent after its SIGSTOP."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + bound_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {bound_s} s after SIGSTOP")
        await asyncio.sleep(0.001)


def idx(slots: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(slots), dtype=torch.int64)


async def maybe_cancelled(rng: random.Random, call: Coroutine[Any, Any, R], tally: Tally) -> R:
    """Await ``call``; one time in three it is cancelled after a random number of loop turns or a
    random sleep. Raises ``CancelledError`` when the cancel took; a call over :data:`CALL_S` fails."""
    task = asyncio.ensure_future(call)
    if rng.random() < 1 / 3:
        when = rng.random()
        if when < 1 / 3:
            for _ in range(rng.randrange(0, 6)):
                await asyncio.sleep(0)
        else:  # at times while the ranks copy (their copies take up to a few tens of ms here)
            await asyncio.sleep(rng.random() * (0.01 if when < 2 / 3 else 0.08))
        task.cancel()
    try:
        async with asyncio.timeout(CALL_S):
            return await task
    except asyncio.CancelledError:
        tally.cancelled += 1
        raise


async def check_slots(ranks: AdvRanks, tokens: Sequence[int], salt: str | None, slots: Sequence[int], low: int,
                      high: int, gens: tuple[int, ...], tally: Tally, what: str) -> None:
    """Every rank that lived through the call holds the oracle's KV of ``tokens[low:high]`` at
    ``slots[low:high]``; a rank restarted since ``gens`` is skipped (its buffer is another process's),
    the others are still checked (every rank that lived through a call must be bit-exact)."""
    if high <= low:
        return
    checked = False
    for rank in range(ranks.tp_size):
        if ranks.generations()[rank] != gens[rank]:
            continue
        try:
            got = await ranks.read(rank, slots[low:high])
        except RankGone:
            continue  # restarting now: its generation moved on
        if ranks.generations()[rank] != gens[rank]:
            continue
        checked = True
        want = rank_prefix_kv(ranks.layout, tokens[:high], SALTS[salt], rank, ranks.tp_size)[:, low:high]
        if not torch.equal(got, want):
            bad = (got != want).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            tally.wrong.append(f"{what}: rank {rank} wrong KV at tokens {[low + b for b in bad][:8]} of "
                               f"[{low}, {high}) (prompt {list(tokens[:3])}.. len {len(tokens)}, salt {salt})")
    if checked:
        tally.verified_tokens += high - low


async def prefill(ranks: AdvRanks, tokens: Sequence[int], salt: str | None, slots: Sequence[int], low: int,
                  high: int) -> None:
    """The engine computes ``tokens[low:high]``: every rank writes its heads into their slots."""
    if high <= low:
        return
    for rank in range(ranks.tp_size):
        kv = rank_prefix_kv(ranks.layout, tokens[:high], SALTS[salt], rank, ranks.tp_size)[:, low:high]
        await ranks.write(rank, slots[low:high], kv)


class Soak:
    """Clients playing an engine's requests over one slot space while a killer SIGKILLs and
    restarts rank processes (see tests/tp/test_tp_adversarial_soak.py)."""

    def __init__(self, cache: TPCache, ranks: AdvRanks, seed: int, docs: int = 6) -> None:
        self.cache, self.ranks = cache, ranks
        self.t = ranks.layout.page_tokens
        self.rng = random.Random(seed)
        self.seed = seed
        self.docs = [[self.rng.randrange(50_000) for _ in range(self.rng.randrange(2, 6) * self.t)]
                     for _ in range(docs)]
        self.tails = [[self.rng.randrange(50_000) for _ in range(3 * self.t + 3)] for _ in range(3)]
        self.tally = Tally()
        self.slots = Slots(ranks.slots)
        self.stop = asyncio.Event()
        self.target: int | None = None  # offloads to reach after the last restart
        self.enough = asyncio.Event()

    async def run(self, clients: int, kills: int) -> None:
        """``clients`` request loops until the killer made ``kills`` kills (all re-attached), then
        some more requests with every rank attached."""
        tasks = [asyncio.create_task(self._client(self.seed * 1000 + i)) for i in range(clients)]
        try:
            await self._killer(kills)
            # Traffic with every rank back, whatever the kills left time for (a slow restart of
            # four ranks on two cores may take most of the run).
            self.target = max(self.tally.offloads + 30, 60)
            async with asyncio.timeout(CALL_S):
                await self.enough.wait()
        finally:
            self.stop.set()
            async with asyncio.timeout(START_S):  # every request ends: no hang
                await asyncio.gather(*tasks)

    async def verify_docs(self) -> None:
        """Every rank attached, nothing cancelled: each document's cached prefix loads bit-exact
        into fresh slots on every rank (pool and disk pages)."""
        async with asyncio.timeout(START_S):
            await self.cache.wait_ranks()
        gens = self.ranks.generations()
        for doc in self.docs:
            for salt in SALTS:
                match = await self.cache.match(doc, salt=salt)
                slots = list(range(self.ranks.slots - match.tokens, self.ranks.slots))
                result = await self.cache.load(match, idx(slots))
                self.tally.loaded_tokens += result.tokens
                await check_slots(self.ranks, doc, salt, slots, 0, result.tokens, gens, self.tally, "final")

    def _prompt(self, rng: random.Random) -> list[int]:
        doc = rng.choice(self.docs)
        shared = doc[: rng.randrange(1, len(doc) + 1)]
        if rng.random() < 0.5:  # a tail other requests share too (its pages get loaded again)
            return shared + self.tails[rng.randrange(len(self.tails))][: rng.randrange(0, 3 * self.t + 3)]
        return shared + [rng.randrange(50_000) for _ in range(rng.randrange(0, 3 * self.t + 3))]

    async def _killer(self, kills: int) -> None:
        rng, ranks, cache = self.rng, self.ranks, self.cache
        while self.tally.kills < kills:
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            for _ in range(1000):  # a moment with transfers in flight (bounded: 5 s)
                if cache.group_statistics().jobs.in_flight:
                    break
                await asyncio.sleep(0.005)
            victims = list(range(ranks.tp_size)) if rng.random() < 0.2 else [rng.randrange(ranks.tp_size)]
            if not self.tally.kills:
                victims = [0]  # first a rank every transfer goes to (MLA: the only writer), mid-transfer
            # At times the engine stops the rank's worker cleanly, mid-traffic (never the first time).
            graceful = self.tally.kills > 0 and rng.random() < 0.25
            for victim in victims:
                if graceful:
                    await ranks.stop(victim)
                else:
                    ranks.kill(victim)
                self.tally.kills += 1
            async with asyncio.timeout(60):  # the group notices each death
                while set(victims) & cache.group.attached:
                    await cache.group.wait_change()
            for victim in victims:
                ranks.start(victim)
            if rng.random() < 0.25:
                # Killed again while it starts (importing, connecting or attaching the pool).
                await asyncio.sleep(rng.uniform(0.5, 3.0))
                victim = victims[0]
                if victim not in cache.group.attached:
                    ranks.kill(victim)
                    self.tally.kills += 1
                    async with asyncio.timeout(60):
                        while victim in cache.group.attached:
                            await cache.group.wait_change()
                    ranks.start(victim)
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            await ranks.reap_dead()

    async def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            if not self.cache.group.all_attached:
                await asyncio.sleep(0.02)  # some calls still meet a missing rank; most wait for it
                if rng.random() < 0.8:
                    continue
            if rng.random() < 0.1:
                await self._prefetch(rng)
            else:
                await self._request(rng)
            if self.target is not None and self.tally.offloads >= self.target:
                self.enough.set()

    async def _prefetch(self, rng: random.Random) -> None:
        """A queued request's disk pages promoted into the pool (manager only; cancelled at times)."""
        self.tally.prefetches += 1
        with contextlib.suppress(asyncio.CancelledError):
            await maybe_cancelled(rng, self.cache.prefetch(self._prompt(rng), salt=rng.choice(list(SALTS))),
                                  self.tally)

    async def _request(self, rng: random.Random) -> None:
        """One request: match (cancelled at times), load one of four ways, prefill the rest,
        offload; a rank restart abandons it (the engine loses that rank's state)."""
        tokens = self._prompt(rng)
        salt = rng.choice(list(SALTS))
        n = len(tokens)
        slots = await self.slots.take(n)
        gens = self.ranks.generations()
        try:
            try:
                match = await maybe_cancelled(rng, self.cache.match(tokens, salt=salt), self.tally)
            except asyncio.CancelledError:
                return
            try:
                loaded = await self._load(tokens, salt, slots, match, rng, gens)
            finally:
                if not match.released:
                    match.release()  # a rank went away before the load began
            if loaded < 0:
                # Cancelled: the engine drops the request and gives its slots to the next one at
                # once (the contract: no copy into them is pending any more).
                return
            await prefill(self.ranks, tokens, salt, slots, loaded, n)
            # The slots hold this prompt's KV, and nothing lands in them late (a copy of a call that
            # returned or was cancelled earlier, this request's or their previous owner's).
            await check_slots(self.ranks, tokens, salt, slots, 0, n, gens, self.tally, "before offload")
            if self.ranks.generations() != gens:
                self.tally.abandoned += 1
                return
            self.tally.offloads += 1
            with contextlib.suppress(asyncio.CancelledError):
                result = await maybe_cancelled(rng, self.cache.offload(tokens, idx(slots), salt=salt), self.tally)
                assert result.stored + result.dropped + result.skipped == n // self.t, result
                self.tally.stored += result.stored
            # Still this prompt's KV when the engine lets the slots go (nothing landed meanwhile).
            await check_slots(self.ranks, tokens, salt, slots, 0, n, gens, self.tally, "at release")
        except RankGone:
            self.tally.abandoned += 1
        finally:
            await self.slots.give(slots)

    async def _load(self, tokens: list[int], salt: str | None, slots: list[int], match: Match,
                    rng: random.Random, gens: tuple[int, ...]) -> int:
        """Load ``match`` as the engine would; returns how many tokens from the start the slots now
        hold, or -1 when the load was cancelled."""
        if not match.tokens:
            return 0
        cache, ranks, tally = self.cache, self.ranks, self.tally
        mode = rng.choice(["plain", "from", "stream", "layered"])
        first = rng.randrange(0, match.tokens + 1) if mode != "plain" else 0
        try:
            await prefill(ranks, tokens, salt, slots, 0, first)  # the engine's own prefix cache holds these
            if mode in ("plain", "from"):
                tally.loads += 1
                result = await maybe_cancelled(
                    rng, cache.load(match, idx(slots[first:match.tokens]), from_token=first), tally)
                assert result.tokens <= match.tokens
                if not result.tokens:
                    return 0
                tally.loaded_tokens += result.tokens - first
                await check_slots(ranks, tokens, salt, slots, first, result.tokens, gens, tally, mode)
                return result.tokens
            tally.streams += 1
            async with cache.start_load(match, idx(slots[first:match.tokens]), from_token=first,
                                        layered=mode == "layered") as stream:
                claimed = stream.claim(rng.randrange(first, match.tokens + 1))
                await prefill(ranks, tokens, salt, slots, first, claimed)
                if mode == "layered" and rng.random() < 0.5:
                    async with asyncio.timeout(CALL_S):
                        await stream.launched()
                        for layer in range(ranks.layout.num_layers):
                            await stream.wait_layer(layer)
                res = await maybe_cancelled(rng, stream.finish(), tally)
            assert claimed <= res.claimed <= res.loaded_from <= match.tokens, res
            await check_slots(ranks, tokens, salt, slots, res.loaded_from, match.tokens, gens, tally, mode)
            tally.loaded_tokens += res.loaded_tokens
            # The engine computes [claimed, loaded_from); then the whole match is in place.
            await prefill(ranks, tokens, salt, slots, res.claimed, res.loaded_from)
            return match.tokens
        except asyncio.CancelledError:
            return -1


def aiokv_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("aiokv")}


async def no_threads_left(before: set[str]) -> None:
    """The cache's threads end once it closed (the pool's idle preparation threads exit by
    themselves, so they get a bounded moment)."""
    for _ in range(500):
        if aiokv_threads() <= before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"threads left after close: {aiokv_threads() - before}")


async def attach_ranks(cache: TPCache, ranks_left: list[AdvRanks], layout: KVLayout, slots: int,
                       config: TPConfig | None = None, tp_size: int = 2) -> AdvRanks:
    """Start ``tp_size`` rank processes for ``cache`` and wait until all attached; they go into
    ``ranks_left`` (the fixture resumes and kills them at the test's end). ``config``: by default
    the tests' rank config with every copy on the ranks' copy threads (none inline)."""
    config = dataclasses.replace(CONFIG, inline_copy_bytes=0) if config is None else config
    ranks = AdvRanks(cache.address, layout, tp_size, slots, config)
    ranks_left.append(ranks)
    ranks.start_all()
    async with asyncio.timeout(START_S):
        await cache.wait_ranks()
    return ranks
