"""Helpers of the TP tests: reference KV, rank slices, and rank processes (importable by spawned children)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
from collections.abc import AsyncIterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
from child_procs import fork_context

from aiokv.layout import KVKind, KVLayout, TPSlice
from aiokv.pagetable import PageHandle, ReserveOutcome
from aiokv.pool import PagePool
from aiokv.tp import RankExecutor, RankWorker, RankWorkerThread, TPConfig

SLOTS = 96
CONFIG = TPConfig(reconnect_initial_s=0.005, reconnect_max_s=0.2, handshake_timeout_s=30.0)


@contextlib.asynccontextmanager
async def threads_off_loop(*runners: RankWorkerThread) -> AsyncIterator[tuple[RankWorkerThread, ...]]:
    """Start ``runners`` and close them off this loop (all at once): a worker's close waits, after
    CLOSED, for the manager to end the link (``handshake_timeout_s`` at most), and a manager on this
    loop must be free to. Closing them with ``with`` on the loop stalls each close that long."""
    started: list[RankWorkerThread] = []
    try:
        for runner in runners:
            runner.start()
            started.append(runner)
        yield runners
    finally:
        await asyncio.gather(*(asyncio.to_thread(runner.close) for runner in started))


async def close_executor(executor: RankExecutor, bound_s: float = 10.0) -> None:
    """``executor.aclose()``, which must end within ``bound_s`` seconds (a close that hangs fails the
    test instead of holding it)."""
    closing = asyncio.ensure_future(executor.aclose())
    finished, _ = await asyncio.wait({closing}, timeout=bound_s)
    assert finished, "the executor's close did not end"


def full_kv(layout: KVLayout, seed: int, slots: int = SLOTS) -> torch.Tensor:
    """The full-head KV buffer every rank holds a slice of: ``[L, S, rows, D]``, distinct values."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, slots, layout.rows, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.dtype)


def rank_kv(full: torch.Tensor, layout: KVLayout, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full``: its K heads, then the same V heads (MLA: the whole latent)."""
    if layout.kind is KVKind.MLA:
        return full.clone()
    tp = TPSlice.of(layout, rank, size)
    heads, first, count = layout.num_kv_heads, tp.head_start, tp.local_heads
    k = full[:, :, first : first + count]
    v = full[:, :, heads + first : heads + first + count]
    return torch.cat([k, v], dim=2).contiguous()


def origins(original: torch.Tensor, rows: torch.Tensor) -> list[tuple[int, int]]:
    """The (layer, slot) of ``original`` ``[L, S, rows, D]`` whose bytes each of ``rows`` holds
    (``(-1, -1)``: none): a wrong row read too early shows its slot's old bytes, a misplaced write
    another layer's or token's."""
    flat = original.flatten(2)
    found = []
    for row in rows.flatten(1):
        hit = (flat == row).all(-1).nonzero()
        found.append((int(hit[0, 0]), int(hit[0, 1])) if len(hit) else (-1, -1))
    return found


def expected_page(full: torch.Tensor, slots: Sequence[int], layout: KVLayout) -> torch.Tensor:
    """The page the tokens in ``slots`` make, in ``layout``'s page format: ``[L, T, rows, D]``, or
    ``[parts, L, T, rows / parts, D]`` when rank-major (part p: the K heads of slice p, then its V heads)."""
    page = full[:, torch.as_tensor(list(slots), dtype=torch.int64)]
    return rank_major(page, layout)


def rank_major(page: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A whole-row page ``[L, T, rows, D]`` rearranged into ``layout``'s rank-major parts (a copy)."""
    if layout.parts == 1:
        return page
    heads, h = layout.num_kv_heads, layout.num_kv_heads // layout.parts
    parts = [torch.cat([page[:, :, p * h : (p + 1) * h], page[:, :, heads + p * h : heads + (p + 1) * h]], dim=2)
             for p in range(layout.parts)]
    return torch.stack(parts)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def reserve(pool: PagePool, keys: Sequence[bytes]) -> list[PageHandle]:
    handles = []
    for res in pool.reserve(keys):
        assert res.outcome is ReserveOutcome.RESERVED and res.handle is not None, res
        handles.append(res.handle)
    return handles


async def new_pool(layout: KVLayout, pages: int) -> PagePool:
    pool = PagePool.create(layout, pages * layout.page_bytes, register_cuda=False)
    await pool.wait_ready()
    return pool


# -- rank processes ---------------------------------------------------------------------------------


def rank_main(
    ctrl: multiprocessing.connection.Connection,
    address: str,
    rank: int,
    tp_size: int,
    layout: KVLayout,
    seed: int,
    slots: int,
    fill: bool,
    threaded: bool,
    device: str = "cpu",
    config: TPConfig = CONFIG,
    gate: Any = None,
) -> None:
    """A rank process: its own KV buffer (its slice of ``full_kv(seed)``, or zeros) and a worker.

    Commands on ``ctrl``: ``"dump"`` -> the buffer; ``"stats"`` -> the worker's statistics;
    ``"maps"`` -> the pool segments it has mapped;
    ``("layers", load, slots)`` -> per layer l: ``wait_layer(load, l)`` (the engine's wait before
    layer l's attention), then a snapshot of layer l at ``slots``: ``[(ok, raw bytes), ...]``;
    ``"tables"`` -> :func:`wrong_tables` of its worker's mover;
    ``"stop"`` -> close the worker, answer ``"stopped"`` and exit.
    ``gate``: a semaphore each layer of a layered CPU copy acquires before it is copied (the test
    lets layers land one by one).
    """
    torch.set_num_threads(1)
    if gate is not None:
        _gate_layers(gate)
    kv = rank_kv(full_kv(layout, seed, slots), layout, rank, tp_size).to(device)
    if not fill:
        kv.zero_()
    if threaded:
        with RankWorkerThread(address, rank, tp_size, layout, kv, config) as runner:
            ctrl.send(("started", os.getpid()))
            while True:
                command = ctrl.recv()
                if command == "dump":
                    ctrl.send(_raw(kv))
                elif command == "stats":
                    ctrl.send(runner.statistics())
                elif command == "maps":
                    ctrl.send(shm_mappings())
                elif command == "tables":
                    ctrl.send(wrong_tables(runner.worker))
                elif isinstance(command, tuple) and command[0] == "layers":
                    _, load, at = command
                    ctrl.send([(runner.wait_layer(load, layer, 120.0), _raw(kv[layer, at]))
                               for layer in range(layout.num_layers)])
                else:
                    break
        ctrl.send(("stopped", runner.error))
    else:
        asyncio.run(_async_rank(ctrl, address, rank, tp_size, layout, kv, config))


def _gate_layers(gate: Any) -> None:
    """Make each layer of a layered CPU copy wait for ``gate`` (the CPU path's per-layer call)."""
    from aiokv.kernels.hostcopy import HostScatter

    scatter = HostScatter.load

    def gated(host: Any, ids: Any, slots: Any, skip: int = 0, layers: range | None = None, *rest: Any) -> None:
        if layers is not None and len(layers) == 1:
            assert gate.acquire(timeout=120), "the test never let this layer land"
        scatter(host, ids, slots, skip, layers, *rest)  # rest: whatever later arguments it takes

    HostScatter.load = gated  # type: ignore[method-assign]


async def _async_rank(
    ctrl: multiprocessing.connection.Connection, address: str, rank: int, tp_size: int, layout: KVLayout,
    kv: torch.Tensor, config: TPConfig,
) -> None:
    # The worker shares this loop: every reply goes out from a thread. A reply longer than the
    # pipe's buffer (a layer snapshot, a dump) blocks its sender until the test reads it, and the
    # test may first await a job of this rank (stream.finish()), whose DONE needs this loop.
    async def reply(message: object) -> None:
        await asyncio.to_thread(ctrl.send, message)

    async with RankWorker(address, rank, tp_size, layout, kv, config) as worker:
        await reply(("started", os.getpid()))
        while True:
            command = await asyncio.to_thread(ctrl.recv)
            if command == "dump":
                await reply(_raw(kv))
            elif command == "stats":
                await reply(worker.statistics())
            elif command == "maps":
                await reply(shm_mappings())
            elif command == "tables":
                await reply(wrong_tables(worker))
            elif isinstance(command, tuple) and command[0] == "layers":
                _, load, at = command
                replies = []
                for layer in range(layout.num_layers):
                    async with asyncio.timeout(120):
                        ok = await worker.wait_layer(load, layer)
                    replies.append((ok, _raw(kv[layer, at])))
                await reply(replies)
            else:
                break
    await reply(("stopped", None))


def wrong_tables(worker: RankWorker) -> list[str]:
    """:func:`mover_wrong_tables` of ``worker``'s mover (none before it attached)."""
    executor = worker._executor
    mover = None if executor is None else executor._mover
    return [] if mover is None else mover_wrong_tables(mover)


def mover_wrong_tables(mover: Any) -> list[str]:
    """The copy plans of ``mover`` whose per-layer address tables (``layer_off``, ``slot_stride``,
    on the KV device) no longer hold what the plan was built with: each read back and compared with
    the tables of a plan built afresh on the same KV buffer and page tensor. A table overwritten
    after it was built (another stream's late write into a block the allocator handed over) would
    send a layer's rows to another layer, or nowhere, on a load that reports OK."""
    from aiokv.kernels.launch import CopyPlan

    plans: list[tuple[str, CopyPlan | None]] = [("direct", mover._direct)]
    plans += [(f"offload lane {i}", lane.plan) for i, lane in enumerate(mover._offload_lanes)]
    plans += [(f"load lane {i}", lane.plan) for i, lane in enumerate(mover._load_lanes)]
    if mover._layered is not None:
        plans += [(f"layer buffer {i}", plan) for i, plan in enumerate(mover._layered.plans)]
    wrong = []
    for name, plan in plans:
        if plan is None:
            continue
        fresh = CopyPlan(plan.kv, plan.pages)
        for index, (held, built) in enumerate(zip(plan._launches, fresh._launches, strict=True)):
            for table in ("layer_off", "slot_stride"):
                got, want = getattr(held, table).tolist(), getattr(built, table).tolist()
                if got != want:
                    wrong.append(f"{name} segment {index} {table}: {got}, built {want}")
    return wrong


def shm_mappings() -> set[str]:
    """Names of the aiokv shared-memory segments this process has mapped."""
    with open("/proc/self/maps") as maps:
        return {"/" + line.split("/dev/shm/")[1].split()[0] for line in maps if "/dev/shm/aiokv" in line}


def _raw(kv: torch.Tensor) -> tuple[bytes, tuple[int, ...]]:
    # Plain bytes: torch's pickler would move a tensor through shared memory of its own.
    return kv.cpu().contiguous().view(torch.uint8).numpy().tobytes(), tuple(kv.shape)


class RankProcesses:
    """``tp_size`` rank processes (spawned) attached to the manager at ``address``."""

    def __init__(
        self,
        address: Path,
        layout: KVLayout,
        tp_size: int,
        seed: int,
        fill: bool,
        slots: int = SLOTS,
        device: str = "cpu",
        config: TPConfig = CONFIG,
        gated: bool = False,
    ) -> None:
        self.address = os.fspath(address)
        self.slots = slots
        self.device = device
        self.config = config
        self.layout = layout
        self.tp_size = tp_size
        self.seed = seed
        self.fill = fill
        self._ctx = fork_context()  # CUDA-free server: ranks on a GPU initialise CUDA themselves
        self.procs: dict[int, BaseProcess] = {}
        self.ctrl: dict[int, multiprocessing.connection.Connection] = {}
        self.gates: dict[int, Any] = {r: self._ctx.Semaphore(0) for r in range(tp_size)} if gated else {}
        """Per rank: release once to let one layer of its layered copies land (``gated=True``)."""

    def start(self, rank: int) -> None:
        parent, child = self._ctx.Pipe()
        threaded = rank % 2 == 0  # both runners in every group
        proc = self._ctx.Process(
            target=rank_main,
            args=(
                child, self.address, rank, self.tp_size, self.layout, self.seed, self.slots, self.fill, threaded,
                self.device, self.config, self.gates.get(rank),
            ),
            daemon=True,
        )
        proc.start()
        child.close()
        self.procs[rank], self.ctrl[rank] = proc, parent

    def start_all(self) -> None:
        for rank in range(self.tp_size):
            self.start(rank)

    async def ask(self, rank: int, command: str) -> Any:
        conn = self.ctrl[rank]
        conn.send(command)
        reply = await asyncio.to_thread(conn.recv)
        while isinstance(reply, tuple) and reply and reply[0] == "started":
            reply = await asyncio.to_thread(conn.recv)
        return reply

    def send(self, rank: int, command: object) -> None:
        """Send ``command`` without waiting for the reply (read it with :meth:`reply`)."""
        self.ctrl[rank].send(command)

    async def reply(self, rank: int) -> Any:
        reply = await asyncio.to_thread(self.ctrl[rank].recv)
        while isinstance(reply, tuple) and reply and reply[0] == "started":
            reply = await asyncio.to_thread(self.ctrl[rank].recv)
        return reply

    def tensor(self, raw: tuple[bytes, tuple[int, ...]]) -> torch.Tensor:
        data, shape = raw
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.layout.dtype).view(shape)

    async def dump(self, rank: int) -> torch.Tensor:
        raw, shape = await self.ask(rank, "dump")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.layout.dtype).view(shape)

    def kill(self, rank: int) -> None:
        proc = self.procs[rank]
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)

    async def reap(self, rank: int) -> int | None:
        proc = self.procs.pop(rank)
        self.ctrl.pop(rank).close()
        await asyncio.to_thread(proc.join, 60)
        return proc.exitcode

    async def stop_all(self) -> None:
        """Stop every worker cleanly (copies finish), then join."""
        for rank in sorted(self.procs):
            reply = await self.ask(rank, "stop")
            assert reply[0] == "stopped" and reply[1] is None, reply
            assert await self.reap(rank) == 0

    async def kill_all(self) -> None:
        for rank in sorted(self.procs):
            with contextlib.suppress(ProcessLookupError):
                self.kill(rank)
            await self.reap(rank)
