"""Rank processes whose engine closes their worker and lives on (importable by spawned children).

Commands on the control pipe: ``"keep socket"`` takes copies of the worker's connection (what a
child the engine forked without exec holds: the connection outlives the worker's own close) and
answers how many; ``"drop socket"`` closes them; ``"close"`` closes the worker (copies running finish
first) and answers ``("closed", error)`` (the async runner first ``("closing", None)``, once its
session ended: it takes no spec from then on); anything else ends the process. Rank ``r`` runs the
thread runner when ``r`` is even, the async runner (copies on its copy thread) when odd.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
import os
import socket
from typing import Any

import torch
from held_rank import Held, HeldRanks, _hold
from tp_helpers import full_kv, rank_kv

from aiokv.layout import KVLayout
from aiokv.tp import RankWorker, RankWorkerThread, TPConfig


def _own_socket_copies(address: str) -> list[socket.socket]:
    """Copies (``dup``) of this process's connections to ``address``: every descriptor is listed
    before any is copied (a copy may take the number the listing's own descriptor had)."""
    sockets: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:"):
                sockets.setdefault(target, int(name))
    found = []
    for fd in sockets.values():
        copy = socket.socket(fileno=os.dup(fd))
        try:
            ours = copy.family == socket.AF_UNIX and copy.getpeername() == address
        except OSError:
            ours = False
        if ours:
            found.append(copy)
        else:
            copy.close()
    return found


def _socket_command(command: object, address: str, copies: list[Any]) -> object:
    if command == "keep socket":
        copies.extend(_own_socket_copies(address))
        return len(copies)
    for sock in copies:
        sock.close()
    copies.clear()
    return "dropped"


def closing_rank_main(
    ctrl: multiprocessing.connection.Connection, address: str, rank: int, tp_size: int, layout: KVLayout,
    seed: int, slots: int, config: TPConfig, held: Held | None,
) -> None:
    torch.set_num_threads(1)
    if held is not None:
        _hold(held)
    kv = rank_kv(full_kv(layout, seed, slots), layout, rank, tp_size)
    copies: list[Any] = []
    if rank % 2 == 0:
        runner = RankWorkerThread(address, rank, tp_size, layout, kv, config)
        runner.start()
        ctrl.send(("started", os.getpid()))
        while (command := ctrl.recv()) in ("keep socket", "drop socket", "close"):
            if command == "close":
                runner.close(120)
                ctrl.send(("closed", runner.error))
            else:
                ctrl.send(_socket_command(command, address, copies))
        runner.close(120)
        return

    async def main() -> None:
        worker = RankWorker(address, rank, tp_size, layout, kv, config)
        run = asyncio.create_task(worker.run())
        await asyncio.to_thread(ctrl.send, ("started", os.getpid()))
        while (command := await asyncio.to_thread(ctrl.recv)) in ("keep socket", "drop socket", "close"):
            if command == "close":
                closing = asyncio.create_task(worker.aclose())  # the engine closes its worker
                await worker.wait_detached()  # its session ended: it takes no spec from now on
                await asyncio.to_thread(ctrl.send, ("closing", None))
                await closing  # the process goes on
                await asyncio.wait({run})
                error = None if run.cancelled() else run.exception()
                await asyncio.to_thread(ctrl.send, ("closed", error))
            else:
                await asyncio.to_thread(ctrl.send, _socket_command(command, address, copies))
        await worker.aclose()

    asyncio.run(main())


class ClosingRanks(HeldRanks):
    """CPU rank processes that close their worker on command and live on; ranks in ``held`` have
    their copies held (:class:`~held_rank.Held`)."""

    def start(self, rank: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=closing_rank_main,
            args=(child, self.address, rank, self.tp_size, self.layout, self.seed, self.slots, self.config,
                  self.held.get(rank)),
            daemon=True,
        )
        proc.start()
        child.close()
        self.procs[rank], self.ctrl[rank] = proc, parent
