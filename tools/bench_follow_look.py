"""How long a following cache's look at the writer's directory takes, with the process otherwise
idle, beside threads that run Python all the time (an engine's scheduler), and beside its own event
loop kept busy (tasks matching prompts nobody stored, one after another), as ratios.

A cache that finds its disk directory held by another cache follows it: every
``follow_interval_s`` a thread of its own (``aiokv-disk-follow``) examines each of the 256
fan-out directories (one io_uring ``statx`` batch, or an ``fstat`` each) and lists those that
changed (``storage/follow.py``). Each system call releases the GIL; beside a thread running Python,
taking it back may wait up to the switch interval (``sys.getswitchinterval()``, 5 ms). This puts
``--pages`` pages on disk from a writer process (which keeps the directory), starts a follower here,
and times ``--repeats`` looks of each kind, alternated idle / busy per round: ``changed`` (the
writer stored ``--changed`` pages into as many fan-out directories since the last look: those are
listed again), ``steady`` (the look right after: nothing new, but those directories are listed
once more, their times being under ``SETTLE_NS`` old) and ``settled`` (a look once the writer's
last store is ``SETTLE_NS`` old: the lock's calls and the 256 ``fstat``s, or the one ``statx``
batch, only). Each time runs from asking for the look to its result applied on the loop (the
look's thread started, the loop woken). The busy loop is the costly neighbour: its thread drops
and takes the GIL back at every turn (each ``epoll_wait``), so the look's thread, which wants it
back after each of its system calls, waits for the forced switch.

``--stat``: how a look examines the fan-out directories: ``statx`` (one io_uring batch, the
default of ``storage/follow.py``), ``fstat`` (one system call each, as before), or ``both``
(default: each measured in the same run, with the fstat/statx ratio of the medians).

    python tools/bench_follow_look.py
    python tools/bench_follow_look.py --pages 2000 --repeats 5 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gil import spinning

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.storage import DiskConfig, DiskTier, ReadOnly, follow
from aiokv.storage.layoutdir import SETTLE_NS

NAMESPACE = "bench-follow"
LAYOUT = KVLayout.mha(2, 2, 64, torch.float16, page_tokens=16)  # 8 KiB pages: the look costs per file, not per byte


def _config(root: Path, pages: int, backend: DiskBackend, interval: float) -> CacheConfig:
    disk = DiskConfig(directory=root, capacity_bytes=4 * pages * (LAYOUT.page_bytes + 4096), backend=backend,
                      follow_interval_s=interval)
    return CacheConfig(cpu_bytes=(pages + 64) * LAYOUT.page_bytes, disk=disk, namespace=NAMESPACE)


def _prompt(seed: int, pages: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * LAYOUT.page_tokens,), generator=gen).tolist()


async def _writer(root: Path, pages: int, backend: DiskBackend) -> None:
    """The writer process: stores ``pages`` pages, says ``ready``, then on each ``store N`` line
    stores N more pages (one prompt of N pages: keys spread over the fan-out directories) and says
    ``stored``; ``exit`` closes."""
    kv = torch.randn(LAYOUT.num_layers, 2 * pages * LAYOUT.page_tokens, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
    async with KVCache(_config(root, pages, backend, interval=2.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        step = 16  # pages per prompt, each flushed: within the write-behind queue (none dropped)
        for start in range(0, pages, step):
            n = min(step, pages - start)
            # A prompt's pages' keys chain: each lands in a fan-out directory of its own.
            await cache.offload(_prompt(start, n), torch.arange(n * LAYOUT.page_tokens))
            await cache.flush()
        assert cache.disk is not None
        print("ready", cache.disk.statistics().pages, flush=True)
        for round_, line in enumerate(sys.stdin):
            words = line.split()
            if words[0] == "exit":
                break
            n = int(words[1])
            await cache.offload(_prompt(10_000_000 + round_, n), torch.arange(n * LAYOUT.page_tokens))
            await cache.flush()
            print("stored", flush=True)


MODES = ("idle", "python", "loop")
KINDS = ("steady", "changed", "settled")


@contextlib.asynccontextmanager
async def _busy_loop(cache: KVCache, tasks: int) -> AsyncIterator[None]:
    """``tasks`` tasks on this loop matching prompts nobody stored, one after another (an engine
    asking about misses), until the block ends."""
    stop = asyncio.Event()
    unknown = _prompt(-1 % 2**31, 4)

    async def turn() -> None:
        while not stop.is_set():
            await cache.match(unknown)
            await asyncio.sleep(0)

    running = [asyncio.create_task(turn()) for _ in range(tasks)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*running)


class _Timer:
    """Times looks of a following tier: from asking for one to its result applied."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.applied = asyncio.Event()
        real = tier._apply_look

        async def counted(found: object) -> None:
            try:
                await real(found)  # type: ignore[arg-type]
            finally:
                self.applied.set()

        tier._apply_look = counted  # type: ignore[method-assign,assignment]

    async def look(self) -> float:
        await asyncio.sleep(0.05)  # a look the follow loop began before this round ends first
        self.applied.clear()
        began = time.perf_counter()
        self.tier._look_soon()
        await asyncio.wait_for(self.applied.wait(), 600)
        return time.perf_counter() - began


async def _bench(args: argparse.Namespace, backend: DiskBackend, root: Path) -> dict[str, list[float]]:
    command = [sys.executable, __file__, "--writer", str(root), "--pages", str(args.pages), "--backend", backend.value]
    # Started once, before anything is timed: its blocking start costs the loop nothing measured.
    writer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    assert writer.stdin is not None and writer.stdout is not None
    times: dict[str, list[float]] = {f"{kind} {mode}": [] for kind in KINDS for mode in MODES}
    try:
        ready = writer.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("the writer process did not start")
        on_disk = int(ready[1])
        kv = torch.zeros(LAYOUT.num_layers, 2 * LAYOUT.page_tokens, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        async with KVCache(_config(root, args.pages, backend, interval=3600.0), LAYOUT, kv) as follower:
            tier = follower.disk
            if tier is None or tier.read_only is not ReadOnly.LOCKED:
                raise RuntimeError("the second cache does not follow the writer's directory")
            timer = _Timer(tier)
            await timer.look()  # the first look lists every fan-out directory
            for _ in range(args.repeats):
                for mode in MODES:
                    writer.stdin.write(f"store {args.changed}\n")
                    writer.stdin.flush()
                    if await asyncio.to_thread(writer.stdout.readline) != "stored\n":
                        raise RuntimeError("the writer process failed to store")
                    with spinning(args.spinners if mode == "python" else 0):
                        async with _busy_loop(follower, args.spinners if mode == "loop" else 0):
                            times[f"changed {mode}"].append(await timer.look())
                            times[f"steady {mode}"].append(await timer.look())
                            await asyncio.sleep(SETTLE_NS / 1e9)  # the writer's last changes settled
                            times[f"settled {mode}"].append(await timer.look())
            if tier.statistics().pages < on_disk:
                raise RuntimeError(f"the follower indexed {tier.statistics().pages} of the writer's {on_disk} pages")
        writer.stdin.write("exit\n")
        writer.stdin.flush()
        writer.wait(60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--changed", type=int, default=8, help="pages the writer stores between looks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spinners", type=int, default=1, help="Python threads, and loop tasks, kept busy")
    parser.add_argument("--dir", type=Path, default=None, help="where the page files go (default: a temp dir)")
    parser.add_argument("--backend", choices=[b.value for b in DiskBackend], default=None,
                        help="one backend (default: threads and uring_fixed)")
    parser.add_argument("--stat", choices=["statx", "fstat", "both"], default="both",
                        help="how a look examines the fan-out directories (default: both, compared)")
    parser.add_argument("--json", type=Path, default=None, help="also write the times here")
    parser.add_argument("--writer", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pages <= 0 or args.changed <= 0 or args.repeats <= 0 or args.spinners <= 0:
        parser.error("--pages, --changed, --repeats and --spinners must be positive")
    if args.writer is not None:
        asyncio.run(_writer(args.writer, args.pages, DiskBackend(args.backend)))
        return
    backends = [DiskBackend(args.backend)] if args.backend else [DiskBackend.THREADS, DiskBackend.URING_FIXED]
    print(f"python {sys.version.split()[0]}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms, "
          f"{args.pages} pages on disk, {args.changed} stored between looks, {args.spinners} spinning thread(s)")
    print(f"{'backend':12} {'stat':6} {'look':8} {'idle ms':>9} {'python ms':>10} {'loop ms':>9} "
          f"{'python/idle':>12} {'loop/idle':>10}")
    stats = ["fstat", "statx"] if args.stat == "both" else [args.stat]
    report: dict[str, dict[str, list[float]]] = {}
    for backend in backends:
        for how in stats:
            follow.BATCHED_STATX = how == "statx"
            root = Path(tempfile.mkdtemp(prefix="aiokv-bench-follow-", dir=args.dir))
            try:
                times = asyncio.run(_bench(args, backend, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            report[f"{backend.value} {how}"] = times
            for kind in KINDS:
                idle, python, loop = (statistics.median(times[f"{kind} {mode}"]) for mode in MODES)
                print(f"{backend.value:12} {how:6} {kind:8} {idle * 1e3:9.2f} {python * 1e3:10.2f} {loop * 1e3:9.2f} "
                      f"{python / idle:12.2f} {loop / idle:10.2f}")
        if len(stats) == 2:
            for kind in KINDS:
                ratios = [statistics.median(report[f"{backend.value} fstat"][f"{kind} {mode}"]) /
                          statistics.median(report[f"{backend.value} statx"][f"{kind} {mode}"]) for mode in MODES]
                print(f"{backend.value:12} {'fstat/statx':15} {kind:8}" + "".join(f" {r:9.2f}x" for r in ratios))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
