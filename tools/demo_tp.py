"""The demo under tensor parallelism: a scheduler process and one process per TP rank (started by a forkserver).

Who runs where (as in vLLM's MultiprocExecutor or SGLang's TP workers)::

    scheduler process (asyncio loop)                  rank process r = 0..N-1 (multiprocessing 'forkserver')
      sessions, BlockTable, sampling (argmax)           LlamaModel shard: heads and MLP columns of rank r
      TPCache: one pool, page table, disk tier          KV buffer [L, S, 2 * H_kv / N, D]: its heads only
      TPRanks: a command pipe and a reply pipe  -->     runs each Step (prefill chunk or decode token),
               per rank, one reader thread      <--     all-reducing partial sums with gloo (CPU)
                                                        RankWorkerThread: scatters/gathers its heads
                     \\                                  /    between its KV buffer and the pool
                      one shared pool of whole pages in /dev/shm

The scheduler sends every rank the same ``Step`` (token ids, first position, host slot indices);
each rank computes its heads and MLP columns, and the two partial sums of every layer (attention's
output projection, the MLP's down projection) are summed by ``torch.distributed.all_reduce`` on the
gloo backend. Rank 0 returns the logits, the scheduler samples and sends the next step. aiokv's
``match``/``load``/``offload`` run on the scheduler with the same host slots for all ranks; the
``TPCache`` sends each rank's worker a transfer spec and reports a page only when every rank's copy
of its slice completed.

Layer-wise hits (``--load-path layered``, ``split-layered``, ``auto``) stream as in one process: the
scheduler starts ``TPCache.start_load(..., layered=True)`` and puts ``stream.layered_load()`` in the
tail's steps; each rank calls ``RankWorkerThread.wait_layer(load, l)`` just before layer ``l``'s
attention (CPU: until the layer's bytes are in its buffer; CUDA: its stream waits on the layer's
event), so the tail's projections overlap the rest of the load on every rank.

Every streamed hit is announced to the ranks in the engine's own channel: the next ``Step`` after
``start_load`` carries the stream's ``(stream_id, epoch)``, and each rank calls
``RankWorkerThread.begin_stream`` before running that step, so its copies are ordered after the
work of the steps sent before ``start_load`` and not after the chunks computed since.

Why gloo: it runs on CPU tensors in every torch build, needs no GPU per rank, and its summation order
is fixed, so two runs under the same split are bit-exact (the oracle's requirement). On CUDA the
ranks share one GPU (NCCL refuses two ranks on one device) and the partial sums make a round trip
through host memory for the all-reduce: correct, not fast; a real engine would use NCCL on a GPU
per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from demo_engine import (
    BlockTable,
    ClaimPolicy,
    First,
    LoadPath,
    Runs,
    ServingLoop,
    Session,
    admission_order,
    prefill_chunks,
    timed_run,
)
from demo_model import LlamaModel, ModelConfig, Shard
from demo_report import progress_bar

from aiokv import CacheConfig, KVLayout, Match
from aiokv.layout import TPSlice
from aiokv.stream import LoadStream
from aiokv.tp import LayeredLoad, RankWorkerThread, WorkerStatistics
from aiokv.tp.cache import TPCache
from aiokv.tp.stream import TPLoadStream

if TYPE_CHECKING:
    from demo import DemoConfig

Connection = multiprocessing.connection.Connection


# -- messages (pickled through the pipes; plain numpy and bytes, never tensors: torch's pickler
# -- would move tensors through shared memory segments of its own) ---------------------------------


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to build its shard and attach to the cache."""

    rank: int
    tp_size: int
    model: ModelConfig
    device: str
    max_positions: int
    num_slots: int
    layout: KVLayout
    cache_address: str
    store_url: str  # torch.distributed rendezvous: a file in a private temporary directory
    threads: int  # torch intra-op threads
    timeout_s: float  # bound of a collective and of the worker's attach


@dataclass(frozen=True)
class Step:
    """One model step for every rank: positions ``[start, start + len(tokens))`` into ``slots[:end]``."""

    seq: int
    tokens: np.ndarray  # int64 [M]
    start: int
    slots: np.ndarray  # int64 [start + M], host slot of every position so far
    logits: bool  # rank 0 returns the last position's logits
    load: LayeredLoad | None = None  # a layer-wise load each layer's attention waits for (its copies)
    streams: tuple[tuple[int, int], ...] = ()  # (stream_id, epoch) of load streams begun since the last step


@dataclass(frozen=True)
class Stop:
    """Close the worker and exit."""


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class StepDone:
    rank: int
    seq: int
    logits: bytes | None  # float32 [V], rank 0 only


@dataclass(frozen=True)
class Stopped:
    rank: int
    worker: WorkerStatistics
    error: str | None  # what ended the worker, if not the stop


@dataclass(frozen=True)
class Failed:
    rank: int
    text: str


RankReply = Ready | StepDone | Stopped | Failed


class RankFailedError(RuntimeError):
    """A rank process failed or exited; the TP group cannot compute any more."""


# -- the rank process -------------------------------------------------------------------------------


def _gloo_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks (gloo, on host memory; the same bytes on every rank)."""
    if x.device.type == "cpu":
        dist.all_reduce(x)
        return x
    host = x.cpu()
    dist.all_reduce(host)
    return host.to(x.device)


def rank_main(spec: RankSpec, commands: Connection, replies: Connection) -> None:
    """Entry of rank process ``spec.rank``: build the shard, attach the worker, run steps until Stop."""
    try:
        _serve_rank(spec, commands, replies)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            replies.send(Failed(spec.rank, f"{type(exc).__name__}: {exc}"))
        raise


def _serve_rank(spec: RankSpec, commands: Connection, replies: Connection) -> None:
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank on the same GPU in this demo
    dist.init_process_group(
        "gloo", init_method=spec.store_url, rank=spec.rank, world_size=spec.tp_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    try:
        shard = Shard(spec.rank, spec.tp_size)
        model = LlamaModel(spec.model, device, spec.max_positions, shard, _gloo_all_reduce)
        tp = TPSlice.of(spec.layout, spec.rank, spec.tp_size)
        if shard.kv_heads(spec.model) != (tp.head_start, tp.local_heads):
            raise ValueError(f"the model's KV heads {shard.kv_heads(spec.model)} are not aiokv's slice {tp}")
        kv = model.new_kv_buffer(spec.num_slots)
        # The model runner is synchronous: the worker runs on a thread and loop of its own. On CUDA
        # it orders its copies after this thread's current stream, the one the model runs on.
        with RankWorkerThread(spec.cache_address, spec.rank, spec.tp_size, spec.layout, kv) as worker:
            worker.wait_attached(spec.timeout_s)
            replies.send(Ready(spec.rank, os.getpid()))
            while True:
                try:
                    command = commands.recv()
                except EOFError:
                    break  # the scheduler is gone
                if isinstance(command, Stop):
                    break
                replies.send(_step(spec.rank, model, kv, command, worker, spec.timeout_s))
            stats = worker.statistics()
        error = None if worker.error is None else f"{type(worker.error).__name__}: {worker.error}"
        replies.send(Stopped(spec.rank, stats, error))
    finally:
        dist.destroy_process_group()


def _step(
    rank: int, model: LlamaModel, kv: torch.Tensor, step: Step, worker: RankWorkerThread, timeout_s: float
) -> StepDone:
    for stream_id, epoch in step.streams:
        # Before any of the step's kernels (its input copies included): the rank's copies of the
        # stream are ordered after this point on the stream the model runs on, so after every
        # earlier step (all sent before start_load) and not after this step's chunk or later ones.
        worker.begin_stream(stream_id, epoch)
    tokens = torch.from_numpy(step.tokens).to(model.device)
    slots = torch.from_numpy(step.slots).to(model.device)
    hook = None if step.load is None else _LayerWait(worker, step.load, timeout_s)
    hidden = model.hidden(tokens, step.start, slots, kv, hook)
    logits = None
    if rank == 0 and step.logits:
        logits = model.logits(hidden).cpu().numpy().tobytes()
    # Every rank's K/V of the step are written once hidden() returned (CPU), or are ordered before
    # the worker's next copies on this stream (CUDA): the scheduler may offload after the replies.
    return StepDone(rank, step.seq, logits)


class _LayerWait:
    """Before layer l's attention: this rank's copies of layer l are in (CPU), or its stream waits
    for them (CUDA). False (a copy failed, the worker detached) lets the step compute on: the
    scheduler's ``finish()`` then reports the load shortened and the tail is computed again."""

    def __init__(self, worker: RankWorkerThread, load: LayeredLoad, timeout_s: float) -> None:
        self._worker = worker
        self._load = load
        self._timeout_s = timeout_s

    def __call__(self, layer: int) -> None:
        self._worker.wait_layer(self._load, layer, self._timeout_s)  # raises TimeoutError: the step fails


# -- the scheduler's side ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    """A step sent to every rank, waiting for their replies."""

    done: asyncio.Future[torch.Tensor | None]
    waiting: set[int]
    logits: torch.Tensor | None = None


@dataclass(eq=False)
class _Rank:
    proc: BaseProcess
    commands: Connection
    replies: Connection
    reader: threading.Thread
    ready: asyncio.Future[int]
    stopped: asyncio.Future[Stopped | None]
    failure: str | None = None


class TPRanks:
    """``tp_size`` rank processes (forkserver children) driven step by step from the scheduler's event loop.

    Commands go down one pipe per rank; replies come back on another, read by one thread per rank
    that hands them to the loop (the loop never blocks on a pipe). ``async with`` starts the ranks
    and waits until each has built its shard and attached its worker to the cache; leaving stops
    them (a rank that does not stop in ``stop_timeout_s`` is killed) and joins every process.
    """

    def __init__(
        self,
        model: ModelConfig,
        device: str,
        tp_size: int,
        layout: KVLayout,
        cache_address: str,
        num_slots: int,
        max_positions: int,
        timeout_s: float = 120.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.tp_size = tp_size
        self.stop_timeout_s = stop_timeout_s
        threads = max(1, len(os.sched_getaffinity(0)) // tp_size)  # the ranks share this machine's cores
        self._specs = [
            RankSpec(rank, tp_size, model, device, max_positions, num_slots, layout, cache_address, "", threads,
                     timeout_s)
            for rank in range(tp_size)
        ]
        self._store_dir: Path | None = None
        self._ranks: list[_Rank] = []
        self._closed = False
        self._steps: dict[int, _Pending] = {}
        self._seq = itertools.count()
        self._begun: list[tuple[int, int]] = []  # streams to announce in the next step (begin_stream)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pids: tuple[int, ...] = ()
        self.workers: tuple[WorkerStatistics, ...] = ()
        """Each rank's worker statistics, once stopped."""
        self.worker_errors: tuple[str, ...] = ()
        """What ended a rank's worker before the stop, if anything did."""

    async def __aenter__(self) -> TPRanks:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Spawn the ranks and wait until each one is ready. Raises :class:`RankFailedError`."""
        if self._closed or self._ranks:
            raise RuntimeError("TPRanks can be started once")
        loop = self._loop = asyncio.get_running_loop()
        self._store_dir = Path(tempfile.mkdtemp(prefix="aiokv-demo-tp-"))
        store = (self._store_dir / "store").as_uri()
        # Never fork this process (it may hold CUDA or threads): the ranks fork from a fresh fork
        # server that imported torch and aiokv once (each spawned rank imported them itself, seconds
        # per rank; nothing there touches CUDA). Installed modules only: Python 3.11's fork server
        # ignores sys.path (the ranks get it and import the demo's own modules quickly).
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "aiokv"])
        for base in self._specs:
            spec = replace(base, store_url=store)
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            rep_read, rep_write = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=rank_main, args=(spec, cmd_read, rep_write), name=f"tp-rank{spec.rank}",
                               daemon=True)
            proc.start()
            cmd_read.close()  # the child's ends: EOF on the reply pipe then means the child exited
            rep_write.close()
            reader = threading.Thread(target=self._read, args=(spec.rank, rep_read), name=f"tp-rank{spec.rank}-replies",
                                      daemon=True)
            self._ranks.append(_Rank(proc, cmd_write, rep_read, reader, loop.create_future(), loop.create_future()))
            reader.start()
        self.pids = tuple(await asyncio.gather(*(r.ready for r in self._ranks)))

    def _read(self, rank: int, conn: Connection) -> None:
        """Reader thread: every reply to the loop, then the end of the pipe."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody waits any more
            while True:
                try:
                    reply: RankReply = conn.recv()
                except (EOFError, OSError):
                    break
                self._loop.call_soon_threadsafe(self._on_reply, reply)
            self._loop.call_soon_threadsafe(self._on_eof, rank)

    def _on_reply(self, reply: RankReply) -> None:
        r = self._ranks[reply.rank]
        if isinstance(reply, Ready):
            if not r.ready.done():
                r.ready.set_result(reply.pid)
        elif isinstance(reply, StepDone):
            pending = self._steps.get(reply.seq)
            if pending is None:
                return
            pending.waiting.discard(reply.rank)
            if reply.logits is not None:
                pending.logits = torch.frombuffer(bytearray(reply.logits), dtype=torch.float32)
            if not pending.waiting:
                del self._steps[reply.seq]
                if not pending.done.done():
                    pending.done.set_result(pending.logits)
        elif isinstance(reply, Stopped):
            if not r.stopped.done():
                r.stopped.set_result(reply)
        else:
            self._fail(reply.rank, reply.text)

    def _on_eof(self, rank: int) -> None:
        self._fail(rank, "exited")
        r = self._ranks[rank]
        if not r.stopped.done():
            r.stopped.set_result(None)

    def _fail(self, rank: int, text: str) -> None:
        r = self._ranks[rank]
        if r.failure is None:
            r.failure = text
        error = RankFailedError(f"rank {rank}: {r.failure}")
        if not r.ready.done():
            r.ready.set_exception(error)
        for seq, pending in list(self._steps.items()):
            if rank in pending.waiting:
                del self._steps[seq]
                if not pending.done.done():
                    pending.done.set_exception(error)

    def stream_began(self, stream: TPLoadStream) -> None:
        """Announce ``stream`` to every rank in the next step sent (whichever request's it is).

        The earliest step that may carry it: it is sent after ``start_load`` returned, so each rank
        runs it after every step sent before (their work is what the stream's copies must follow),
        and the earlier a rank records its mark, the fewer of its later chunks the copies wait for.
        A stream without an id (0) is not announced.
        """
        if stream.stream_id:
            self._begun.append((stream.stream_id, stream.epoch))

    async def step(
        self, tokens: Sequence[int], start: int, slots: torch.Tensor, logits: bool, load: LayeredLoad | None = None
    ) -> torch.Tensor | None:
        """Run positions ``[start, start + len(tokens))`` on every rank; rank 0's logits ``[V]`` float32.

        ``slots``: host int64 ``[start + len(tokens)]``. ``load``: a layer-wise load whose layer l
        each rank waits for before layer l's attention. Returns when every rank finished the step
        (its K/V are in every rank's buffer); None when ``logits`` is False. A cancelled caller
        still waits for the ranks to finish (they write the step's slots), then ``CancelledError``
        propagates. Raises :class:`RankFailedError` when a rank failed or exited.
        """
        if self._closed:
            raise RuntimeError("TPRanks is closed")
        for rank, r in enumerate(self._ranks):
            if r.failure is not None:
                raise RankFailedError(f"rank {rank}: {r.failure}")
        assert self._loop is not None
        seq = next(self._seq)
        pending = _Pending(self._loop.create_future(), set(range(self.tp_size)))
        self._steps[seq] = pending
        streams, self._begun = tuple(self._begun), []
        message = Step(seq, np.asarray(tokens, dtype=np.int64), start, slots.numpy(), logits, load, streams)
        for rank, r in enumerate(self._ranks):
            try:
                r.commands.send(message)  # small, and the rank is idle between steps: no long block
            except OSError as exc:
                self._fail(rank, f"command pipe: {exc}")
        return await _wait_settled(pending.done)

    async def aclose(self) -> None:
        """Stop every rank (bounded), kill those that do not stop, join processes and reader threads.

        Idempotent. Fills :attr:`workers` with the statistics of the ranks that stopped cleanly.
        """
        if self._closed:
            return
        self._closed = True
        ranks = self._ranks
        try:
            for r in ranks:
                with contextlib.suppress(OSError):
                    r.commands.send(Stop())
            if ranks:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.stop_timeout_s):
                        await asyncio.wait({r.stopped for r in ranks})
            stopped = [r.stopped.result() for r in ranks if r.stopped.done() and not r.stopped.cancelled()]
            self.workers = tuple(s.worker for s in stopped if s is not None)
            self.worker_errors = tuple(f"rank {s.rank}: {s.error}" for s in stopped if s is not None and s.error)
            await asyncio.gather(*(self._join(r) for r in ranks))
        finally:
            for r in ranks:
                r.commands.close()
                r.replies.close()
                if r.ready.done() and not r.ready.cancelled():
                    r.ready.exception()  # retrieved: a failed start was already reported
                r.ready.cancel()
            if self._store_dir is not None:
                shutil.rmtree(self._store_dir, ignore_errors=True)

    async def _join(self, r: _Rank) -> None:
        await asyncio.to_thread(r.proc.join, self.stop_timeout_s)
        if r.proc.is_alive():
            r.proc.kill()  # stuck (a collective waiting for a dead peer): ours to end
            await asyncio.to_thread(r.proc.join)
        await asyncio.to_thread(r.reader.join)  # ends at the reply pipe's EOF, now that the child exited


async def _wait_settled(done: asyncio.Future[torch.Tensor | None]) -> torch.Tensor | None:
    """Await ``done``; when cancelled, first wait until it resolves, then let ``CancelledError`` out."""
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        while not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({done})
        if not done.cancelled():
            done.exception()  # retrieved: the caller is gone, the error surfaces at the next step
        raise


class TPEngine(ServingLoop):
    """The serving loop of the scheduler process: model steps run on the TP ranks, slots are host indices.

    Cache hits may stream (``TPCache.start_load``): claimed chunks are steps like any other (a step
    returns once every rank computed it, so claims track the computation). Layer-wise hits carry
    the stream's ``layered_load()`` in the tail's steps: each rank waits per layer on its own copies.
    """

    def __init__(
        self,
        ranks: TPRanks,
        blocks: BlockTable,
        cache: TPCache | None,
        chunk_tokens: int,
        gen_tokens: int,
        keep_logits: bool = True,
        prefetch: bool = False,
        settle: bool = False,
        load_path: LoadPath = LoadPath.PLAIN,
        claim: ClaimPolicy = ClaimPolicy.AUTO,
    ) -> None:
        super().__init__(
            blocks, cache, chunk_tokens, gen_tokens, keep_logits, prefetch, settle, load_path, claim
        )
        self.ranks = ranks
        self.tp_cache = cache

    def _note_prefill(self, tokens: int, seconds: float, prefix: int) -> None:
        pass  # TPCache takes no prefill reports: its cost model learns the rate from claims

    async def _start_stream(self, match: Match, slots: torch.Tensor, start: int, layered: bool) -> LoadStream:
        assert self.tp_cache is not None
        stream = self.tp_cache.start_load(match, slots, from_token=start, layered=layered)
        self.ranks.stream_began(stream)  # the next step carries its id: each rank marks it then
        return stream

    async def _prefill(
        self,
        prompt: list[int],
        begin: int,
        end: int,
        slots: torch.Tensor,
        *,
        first: bool = False,
        layers: LoadStream | None = None,
        paced: bool = False,
    ) -> First | None:
        chunks = prefill_chunks(begin, end, self.chunk_tokens)
        load = None
        if layers is not None and chunks:
            assert isinstance(layers, TPLoadStream)
            load = layers.layered_load()  # the serving loop awaited launched(): the copies are fixed
        logits = None
        for i, (b, e) in enumerate(chunks):
            logits = await self.ranks.step(prompt[b:e], b, slots[:e], logits=first and i == len(chunks) - 1, load=load)
        if not first:
            return None
        assert logits is not None
        return First(logits, int(logits.argmax()))

    async def _decode(self, n: int, first: First, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        logits_list, generated = [first.logits], [first.token]
        token = first.token
        for i in range(self.gen_tokens - 1):
            logits = await self.ranks.step([token], n + i, slots[: n + i + 1], logits=True)
            assert logits is not None
            token = int(logits.argmax())
            logits_list.append(logits)
            generated.append(token)
        return logits_list, generated


async def serve_tp(
    cfg: DemoConfig,
    sessions: list[Session],
    layout: KVLayout,
    config: CacheConfig,
    kv_blocks: int,
    longest: int,
    progress: bool,
) -> Runs:
    """Warm up, serve ``sessions`` from scratch, then through a ``TPCache``, on ``cfg.tp`` rank processes.

    The cache lives through both runs (the ranks' workers attach once); the from-scratch run does
    not call it. Everything is stopped and joined before this returns, on errors too.
    """
    chunk = cfg.chunk_tokens or cfg.page_tokens
    num_slots = kv_blocks * cfg.page_tokens
    async with TPCache(config, layout, tp_size=cfg.tp, num_slots=num_slots) as cache:
        await cache.pool.wait_ready()  # set-up, not serving
        ranks = TPRanks(cfg.model, cfg.device, cfg.tp, layout, cache.address, num_slots, longest + cfg.gen_tokens)
        async with ranks:
            await cache.wait_ranks()
            warm = TPEngine(ranks, BlockTable(kv_blocks, cfg.page_tokens, False), None, chunk, 2, keep_logits=False)
            await warm.serve("warmup", "warmup", "warmup", 0,
                             [i % cfg.model.vocab for i in range(min(longest, 4 * chunk))])
            scratch_engine = TPEngine(ranks, BlockTable(kv_blocks, cfg.page_tokens, False), None, chunk, cfg.gen_tokens)
            scratch, wall_scratch = await timed_run(
                scratch_engine, sessions, cfg.concurrency, cfg.window, progress_bar("scratch", sessions, progress)
            )
            engine = TPEngine(
                ranks, BlockTable(kv_blocks, cfg.page_tokens, True), cache, chunk, cfg.gen_tokens,
                prefetch=cfg.prefetch, settle=cfg.settle, load_path=cfg.load_path, claim=cfg.claim,
            )
            # Admitted in the scratch run's order: each request has the same neighbours in both runs.
            cached, wall = await timed_run(
                engine, sessions, cfg.concurrency, cfg.window, progress_bar("cached", sessions, progress),
                admission_order(scratch),
            )
            stats = cache.stats()
        for line in ranks.worker_errors:
            print(f"warning: a rank's aiokv worker ended early: {line}", file=sys.stderr)
        return Runs(cached, scratch, wall, wall_scratch, stats, ranks.pids, ranks.workers)
