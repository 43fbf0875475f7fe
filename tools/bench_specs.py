"""Spec round trip: manager -> every rank worker -> all completions, in microseconds.

One manager (this process) and ``--workers`` rank processes (spawn) on one host. Each round submits
one OFFLOAD spec of one page and awaits the job, which resolves once every rank reported. Two copy
variants: "no-op copy" (the copy returns at once: transport, spec decoding and the job bookkeeping)
and "4 KiB page" (each rank really copies its head slice of a 4 KiB page through ``PageMover``'s
torch path); each under both runners: ``RankWorkerThread`` (its private loop is the copy thread) and
``RankWorker`` on the rank's own loop (copies hop to the bridge's copy thread). Baseline in the same
run: a bare asyncio Unix-domain echo over the same number of processes (the manager writes one frame
of the spec's size to every peer and waits for every reply), the transport's floor without aiokv.

    python tools/bench_specs.py                     # 8 workers, 3000 rounds, default loop
    python tools/bench_specs.py --loop uvloop --json out/bench_specs.json
    python tools/bench_specs.py --inproc            # aiokv's own CPU per round trip (one process)

``--inproc``: the manager and one worker (``RankWorker``) on one event loop in this process, so a
round trip is aiokv's own work on both ends (encode, socket writes and reads, decode, bookkeeping)
with no scheduling among processes: CPU microseconds per round trip (``time.process_time``) stay
comparable on a loaded machine, where the multi-process latencies do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiokv.layout import KVLayout, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankGroup, RankReport, RankStatus, RankWorker, RankWorkerThread, TPConfig

_FRAME = struct.Struct("<IB")


def layout_for(workers: int, page_tokens: int) -> KVLayout:
    """A tiny MHA layout with one KV head per worker: one page is a few KiB."""
    return KVLayout.mha(1, workers, 8, torch.float16, page_tokens=page_tokens)


def run_loop(main: Callable[[], Awaitable[None]], loop_name: str) -> None:
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


# -- child processes --------------------------------------------------------------------------------


def echo_child(address: str, ready: multiprocessing.connection.Connection, loop_name: str) -> None:
    async def main() -> None:
        reader, writer = await asyncio.open_unix_connection(address)
        ready.send("up")
        reply = _FRAME.pack(1 + 9, 6) + bytes(9)  # the size of a DONE frame
        try:
            while True:
                length, _kind = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                await reader.readexactly(length - 1)
                writer.write(reply)
        except asyncio.IncompleteReadError:
            writer.close()

    run_loop(main, loop_name)


def rank_child(
    address: str,
    rank: int,
    size: int,
    page_tokens: int,
    ctrl: multiprocessing.connection.Connection,
    loop_name: str,
    noop: bool,
    threaded: bool,
) -> None:
    torch.set_num_threads(1)
    if noop:
        # The copy thread still runs (and hops back to the loop); it just moves no bytes.
        RankExecutor._copy_on_thread = lambda self, spec, progress=None: RankReport(RankStatus.OK)  # type: ignore[method-assign]
    layout = layout_for(size, page_tokens)
    tp = TPSlice.of(layout, rank, size)
    kv = torch.randn(1, 4 * page_tokens, 2 * tp.local_heads, layout.head_dim).to(layout.dtype)

    if threaded:
        with RankWorkerThread(address, rank, size, layout, kv, TPConfig()) as runner:
            runner.wait_attached()
            ctrl.send("up")
            ctrl.recv()  # until the manager says stop
        return

    async def main() -> None:
        async with RankWorker(address, rank, size, layout, kv, TPConfig()) as worker:
            await worker.wait_attached()
            ctrl.send("up")
            await asyncio.to_thread(ctrl.recv)  # until the manager says stop

    run_loop(main, loop_name)


# -- measurements -----------------------------------------------------------------------------------


def summarize(samples_ns: list[int]) -> dict[str, float]:
    us = np.array(samples_ns, dtype=np.float64) / 1000
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "max_us": float(us.max()),
        "mean_us": float(statistics.fmean(us)),
    }


async def echo_baseline(args: argparse.Namespace, payload_bytes: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    directory = tempfile.mkdtemp(prefix="aiokv-bench-")
    address = os.path.join(directory, "echo.sock")
    peers: list[asyncio.StreamReader] = []
    writers: list[asyncio.StreamWriter] = []
    connected = asyncio.Event()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(reader)
        writers.append(writer)
        if len(peers) == args.workers:
            connected.set()

    server = await asyncio.start_unix_server(accept, path=address)
    procs = []
    pipes = []
    for _ in range(args.workers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=echo_child, args=(address, child, args.loop), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(parent)
    await connected.wait()
    for pipe in pipes:
        await asyncio.to_thread(pipe.recv)
    frame = _FRAME.pack(1 + payload_bytes, 5) + bytes(payload_bytes)

    async def one_reply(reader: asyncio.StreamReader) -> None:
        length, _ = _FRAME.unpack(await reader.readexactly(_FRAME.size))
        await reader.readexactly(length - 1)

    samples = []
    for i in range(args.warmup + args.rounds):
        start = time.perf_counter_ns()
        for writer in writers:
            writer.write(frame)
        # Replies are read in peer order: the round ends when the slowest peer answered, as a job does.
        for reader in peers:
            await one_reply(reader)
        if i >= args.warmup:
            samples.append(time.perf_counter_ns() - start)
    for writer in writers:
        writer.close()
    server.close()
    await server.wait_closed()
    for proc in procs:
        await asyncio.to_thread(proc.join, 30)
    os.unlink(address)
    os.rmdir(directory)
    return summarize(samples)


async def aiokv_round_trip(args: argparse.Namespace, noop: bool, threaded: bool) -> tuple[dict[str, float], int]:
    ctx = multiprocessing.get_context("spawn")
    layout = layout_for(args.workers, args.page_tokens)
    pool = PagePool.create(layout, 64 * layout.page_bytes, register_cuda=False)
    await pool.wait_ready()
    procs = []
    pipes = []
    try:
        async with RankGroup(layout, args.workers, pool.name, pool.num_pages, TPConfig()) as group:
            for rank in range(args.workers):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=rank_child,
                    args=(
                        os.fspath(group.address), rank, args.workers, args.page_tokens, child, args.loop, noop,
                        threaded,
                    ),
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
                pipes.append(parent)
            await group.wait_attached()
            for pipe in pipes:
                await asyncio.to_thread(pipe.recv)
            tokens = args.page_tokens
            specs = [
                group.spec(Direction.OFFLOAD, [i % pool.num_pages], np.arange(tokens) + (i % 3) * tokens)
                for i in range(args.warmup + args.rounds)
            ]
            spec_bytes = len(specs[0].to_bytes())
            samples = []
            for i, spec in enumerate(specs):
                start = time.perf_counter_ns()
                outcome = await group.submit_nowait(spec)
                elapsed = time.perf_counter_ns() - start
                if not outcome.ok:
                    raise RuntimeError(f"job failed: {outcome}")
                if i >= args.warmup:
                    samples.append(elapsed)
            for pipe in pipes:
                pipe.send("stop")
            for proc in procs:
                await asyncio.to_thread(proc.join, 60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        await pool.aclose()
    return summarize(samples), spec_bytes


async def inproc_round_trip(args: argparse.Namespace, noop: bool) -> dict[str, float]:
    """Manager and one worker on this loop; latency and CPU per round trip (see the module docstring)."""
    if noop:
        saved = RankExecutor._copy_on_thread
        RankExecutor._copy_on_thread = lambda self, spec, progress=None: RankReport(RankStatus.OK)  # type: ignore[method-assign]
    layout = layout_for(1, args.page_tokens)
    pool = PagePool.create(layout, 64 * layout.page_bytes, register_cuda=False)
    await pool.wait_ready()
    kv = torch.randn(1, 4 * args.page_tokens, layout.rows, layout.head_dim).to(layout.dtype)
    directory = tempfile.mkdtemp(prefix="aiokv-bench-")
    try:
        async with RankGroup(layout, 1, pool.name, pool.num_pages, TPConfig(), os.path.join(directory, "m")) as group, \
                RankWorker(group.address, 0, 1, layout, kv, TPConfig()) as worker:
            await worker.wait_attached()
            await group.wait_attached()
            tokens = args.page_tokens
            specs = [
                group.spec(Direction.OFFLOAD, [i % pool.num_pages], np.arange(tokens) + (i % 3) * tokens)
                for i in range(args.warmup + args.rounds)
            ]
            samples = []
            cpu_start = 0.0
            for i, spec in enumerate(specs):
                if i == args.warmup:
                    cpu_start = time.process_time()
                start = time.perf_counter_ns()
                outcome = await group.submit_nowait(spec)
                elapsed = time.perf_counter_ns() - start
                if not outcome.ok:
                    raise RuntimeError(f"job failed: {outcome}")
                if i >= args.warmup:
                    samples.append(elapsed)
            cpu_us = (time.process_time() - cpu_start) / args.rounds * 1e6
    finally:
        if noop:
            RankExecutor._copy_on_thread = saved  # type: ignore[method-assign]
        await pool.aclose()
        os.rmdir(directory)
    return {**summarize(samples), "cpu_us": cpu_us}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    noop, spec_bytes = await aiokv_round_trip(args, noop=True, threaded=True)
    tiny, _ = await aiokv_round_trip(args, noop=False, threaded=True)
    noop_async, _ = await aiokv_round_trip(args, noop=True, threaded=False)
    tiny_async, _ = await aiokv_round_trip(args, noop=False, threaded=False)
    echo = await echo_baseline(args, spec_bytes)
    return {
        "workers": args.workers,
        "rounds": args.rounds,
        "loop": args.loop,
        "cpus": os.cpu_count(),
        "spec_frame_bytes": spec_bytes + _FRAME.size,
        "page_bytes": layout_for(args.workers, args.page_tokens).page_bytes,
        "echo": echo,
        "thread_runner_noop": noop,
        "thread_runner_tiny_page": tiny,
        "async_runner_noop": noop_async,
        "async_runner_tiny_page": tiny_async,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8, help="rank processes (tp_size)")
    parser.add_argument("--rounds", type=int, default=3000, help="timed round trips")
    parser.add_argument("--warmup", type=int, default=300, help="untimed round trips first")
    parser.add_argument("--page-tokens", type=int, default=16, help="tokens per (tiny) page")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio", help="event loop, both sides")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--inproc", action="store_true", help="one process: aiokv's own CPU per round trip")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.inproc:
        async def run_inproc() -> None:
            result["inproc_noop"] = await inproc_round_trip(args, noop=True)
            result["inproc_tiny_page"] = await inproc_round_trip(args, noop=False)

        run_loop(run_inproc, args.loop)
        print(f"spec round trip in one process (manager + 1 worker on one loop), {args.rounds} rounds, "
              f"{args.loop} loop, load {os.getloadavg()[0]:.1f}")
        print(f"{'path':<32} {'p50 us':>8} {'p99 us':>8} {'CPU us/round':>13}")
        for name, key in (("no-op copy", "inproc_noop"), ("4 KiB page (PageMover)", "inproc_tiny_page")):
            row = result[key]
            print(f"{name:<32} {row['p50_us']:8.1f} {row['p99_us']:8.1f} {row['cpu_us']:13.1f}")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        return

    async def run() -> None:
        result.update(await measure(args))

    run_loop(run, args.loop)
    print(f"spec round trip, {args.workers} workers, {args.rounds} rounds, {args.loop} loop, {os.cpu_count()} CPUs")
    print(f"{'path':<44} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'p50 x':>6} {'p99 x':>6}")
    echo = result["echo"]
    rows = (
        ("bare asyncio UDS echo (baseline)", "echo"),
        ("spec -> all DONE, thread runner, no-op copy", "thread_runner_noop"),
        ("spec -> all DONE, thread runner, 4 KiB page", "thread_runner_tiny_page"),
        ("spec -> all DONE, async runner, no-op copy", "async_runner_noop"),
        ("spec -> all DONE, async runner, 4 KiB page", "async_runner_tiny_page"),
    )
    for name, key in rows:
        row = result[key]
        print(
            f"{name:<44} {row['p50_us']:8.1f} {row['p99_us']:8.1f} {row['max_us']:8.1f} "
            f"{row['p50_us'] / echo['p50_us']:6.2f} {row['p99_us'] / echo['p99_us']:6.2f}"
        )
    print("target: aiokv spec round trip p99 <= 300 us with 8 workers on one host")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    sys.exit(0)


if __name__ == "__main__":
    main()
