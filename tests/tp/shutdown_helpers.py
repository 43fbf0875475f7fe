"""Shared setup of the rank-shutdown review tests (reviews 201-204).

A real rank process (tp_size 1): worker A on the child's main-thread loop (``asyncio.run`` or
``uvloop.run``), its copies held (:mod:`held_rank`), and a control thread that answers the test's
commands (the child's loop may be blocked or shutting down meanwhile). The test's side starts the
child, asks it, and ends it. Importable by forked children (tests/tp is on their ``sys.path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

import torch
import uvloop
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_thread
from test_adv_rev197_farewell_race import MHA, SLOTS, _sever

from aiokv.tp import Direction, RankGroup, RankWorkerThread, TPConfig

BOUND_S = 60.0


def new_held() -> Held:
    """A :class:`Held` of the fork-server context the children run in."""
    ctx = fork_context()
    return Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))


def segment_held(name: str) -> list[str]:
    """This process's mappings and descriptors of segment ``name``."""
    base = name.lstrip("/")
    with open("/proc/self/maps") as maps:
        found = [line.strip() for line in maps if base in line]
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if base in target:
                found.append(f"fd {fd} -> {target}")
    return found


# -- the child's side ---------------------------------------------------------------------------


class RankChild:
    """The rank process's state: its KV buffer, named events, and the control thread.

    Commands: an event name of ``waits`` is answered with that event's ``wait(BOUND_S)``; one of
    ``sets`` sets that event (answer True); ``"sever"`` shuts this process's sockets to the manager
    down for real; ``"second"`` starts worker B (thread runner) of the rank; ``"dump"`` answers the
    KV bytes, ``("write", slots, value)`` writes them (the engine reusing the slots); ``commands``
    adds others; anything else ends the thread (``"end"``).
    """

    def __init__(self, ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig,
                 held: Held, waits: Iterable[str], sets: Iterable[str],
                 commands: dict[str, Callable[[], Any]] | None = None) -> None:
        torch.set_num_threads(1)
        _hold(held)
        self.ctrl, self.address, self.config = ctrl, address, config
        self.kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
        self.waits, self.sets = frozenset(waits), frozenset(sets)
        self.events = {name: threading.Event() for name in (*self.waits, *self.sets, "ended", "end")}
        self.commands = commands or {}
        self.on_end: list[Callable[[], None]] = []  # run by the control thread as it ends
        self.report: dict[str, Any] = {}

    def start(self) -> None:
        threading.Thread(target=self._control, daemon=True).start()
        self.ctrl.send(("started", os.getpid()))

    def run(self, main: Callable[[], Coroutine[Any, Any, None]], loop_kind: str = "asyncio") -> None:
        """``main()`` on this thread's loop, to the loop's end (a cancel it ends with is swallowed)."""
        with contextlib.suppress(asyncio.CancelledError):
            if loop_kind == "uvloop":
                uvloop.run(main())
            else:
                asyncio.run(main())

    def finish(self, pool_name: str | None = None) -> None:
        """After the loop's end: report the pool's mappings and the aiokv threads left (``"ended"``),
        then live on until the test ends the child."""
        if pool_name is not None:
            self.report["held"] = segment_held(pool_name)
            self.report["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokv-"))
        self.events["ended"].set()
        self.events["end"].wait(BOUND_S * 4)

    def _control(self) -> None:
        second: RankWorkerThread | None = None
        try:
            while True:
                command = self.ctrl.recv()
                reply: Any
                name = command if isinstance(command, str) else None  # a tuple may hold a list
                if name in self.commands:
                    reply = self.commands[name]()
                elif name in self.waits:
                    reply = self.events[name].wait(BOUND_S)
                elif name in self.sets:
                    self.events[name].set()
                    reply = True
                elif command == "sever":
                    reply = _sever(self.address, set())
                elif command == "second":
                    second = RankWorkerThread(self.address, 0, 1, MHA, self.kv, self.config)
                    second.start()
                    reply = "started"
                elif command == "dump":
                    reply = self.kv.numpy().copy()
                elif isinstance(command, tuple) and command[0] == "write":
                    _, at, value = command
                    self.kv[:, at] = value
                    reply = "written"
                else:
                    break
                self.ctrl.send(reply)
        finally:
            if second is not None:
                with contextlib.suppress(Exception):
                    second.close(BOUND_S)
            for call in self.on_end:
                call()
            self.events["end"].set()


# -- the test's side ----------------------------------------------------------------------------


class ChildLink:
    """The test's end of a rank child's control pipe."""

    def __init__(self, pipe: multiprocessing.connection.Connection) -> None:
        self.pipe = pipe

    async def ask(self, command: object, bound_s: float = BOUND_S) -> Any:
        self.pipe.send(command)
        async with asyncio.timeout(bound_s + 5.0):
            return await asyncio.to_thread(self.pipe.recv)

    def ask_blocking(self, command: object) -> Any:
        """On this loop's thread: the manager's loop reads nothing meanwhile."""
        self.pipe.send(command)
        assert self.pipe.poll(BOUND_S), f"no reply to {command!r}"
        return self.pipe.recv()


@contextlib.asynccontextmanager
async def rank_child(group: RankGroup, held: Held, target: Callable[..., None],
                     *args: object) -> AsyncIterator[ChildLink]:
    """Start ``target(ctrl, *args)`` in a forked child; yields once it said it started and A is
    attached (the manager saw it too). Ends the child (its held copies let go) on the way out."""
    parent, child = fork_context().Pipe()
    proc = fork_context().Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    link = ChildLink(parent)
    try:
        async with asyncio.timeout(BOUND_S * 2):
            assert (await asyncio.to_thread(parent.recv))[0] == "started"
            assert await link.ask("attached")
            await group.wait_attached()
        yield link
    finally:
        held.release(8)
        with contextlib.suppress(Exception):
            parent.send("end")
        end_child(proc, 30)


async def held_load(group: RankGroup, held: Held, slots: list[int]) -> Any:
    """Submit a LOAD of page 0 into ``slots``; returns it once A's copy began (held)."""
    load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots)))
    assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
    return load


async def sever_under_held_copy(group: RankGroup, link: ChildLink, held: Held, slots: list[int]) -> Any:
    """A's socket shut down for real under its held copy: the manager holds A's rank. Returns the load."""
    load = await held_load(group, held, slots)
    assert await link.ask("sever") == 1
    await until_thread(lambda: group.statistics().held_ranks == 1, "A's rank held", BOUND_S)
    return load


async def assert_no_copy_after_reuse(group: RankGroup, link: ChildLink, held: Held, slots: list[int],
                                     cancel: str, teardown_why: str) -> None:
    """A's copy held, its ``run()`` cancelled (command ``cancel``), its teardown under way
    (``"returned"``, else ``teardown_why``), worker B started: the load may end, and the engine
    reuse the slots, only once A's copy is over. The oracle is the rank's KV bytes."""
    load = await held_load(group, held, slots)
    assert await link.ask(cancel)
    assert await link.ask("returned"), teardown_why
    assert await link.ask("second") == "started"
    # A's copy still runs: no worker of this process may end the manager's view of it.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5.0):
            await asyncio.shield(load.wait())
    reused = load.done()
    if reused:  # the engine takes the slots back at once: its own KV goes there
        assert await link.ask(("write", slots, -7.0)) == "written"
    held.release()
    async with asyncio.timeout(BOUND_S):
        outcome = await load.wait()
    await until_thread(lambda: held.finished_copies() == 1, "A's copy", BOUND_S)
    if not reused:
        assert await link.ask(("write", slots, -7.0)) == "written"
    kv = torch.from_numpy(await link.ask("dump"))
    assert bool((kv[:, slots] == -7.0).all()), (
        f"the load ended ({outcome}) while A's copy ran (reused: {reused}); the copy landed after "
        "the engine reused the slots")
