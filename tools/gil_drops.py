"""Count the GIL hand-overs of a CPU hit, per thread and per C call: where ``tools/bench_gil.py``'s
time beside an engine thread running Python goes.

Each time a thread lets the GIL go (a torch op, a syscall, a blocking wait, freeing a tensor) it
must take it back; beside a thread that runs Python it may wait a switch interval (5 ms) to. This
counts those takes for real: a small preloaded library wraps ``pthread_cond_signal`` and
``pthread_cond_timedwait`` (CPython 3.11 signals the GIL's ``switch_cond`` on every take and waits
on its ``cond`` for one), and a profile hook on every thread attributes each take to the innermost C
call that made it (takes outside any C call, such as freeing a temporary tensor, count only in the
thread's total). With ``--spin`` the hits run beside a spinning thread and the time each thread
waited for the GIL is reported too. Each hit also sums the takes attributed to C calls per thread
(the disk threads' syscalls among them) and counts the loop's epoll calls (one a turn of the
loop, each a GIL take). The set-up is ``bench_gil``'s (``--pages`` pages of
``--page-kib`` KiB offloaded, then loaded from disk and from the pool, each ``--repeats`` times);
each repeat first offloads ``--pages`` pages of a fresh prompt (the ``offload`` rows: the copy
thread's takes are the pool's gathers), dropped from the pool after it. Needs a C compiler
(``cc``) and glibc; Linux only.

    python tools/gil_drops.py --dir /var/tmp
    python tools/gil_drops.py --dir /var/tmp --spin --top 8
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
static int (*real_signal)(pthread_cond_t *);
static int (*real_wait)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
static void *take_cond, *wait_cond;
static __thread unsigned long takes;
static __thread unsigned long long waited_ns;
static __thread void *last, *before_last;
int pthread_cond_signal(pthread_cond_t *c) {
    if (!real_signal) real_signal = dlsym(RTLD_NEXT, "pthread_cond_signal");
    before_last = last; last = c;
    if (c == take_cond) takes++;
    return real_signal(c);
}
int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t) {
    if (!real_wait) real_wait = dlsym(RTLD_NEXT, "pthread_cond_timedwait");
    if (c != wait_cond) return real_wait(c, m, t);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int r = real_wait(c, m, t);
    clock_gettime(CLOCK_MONOTONIC, &b);
    waited_ns += (b.tv_sec - a.tv_sec) * 1000000000ULL + (b.tv_nsec - a.tv_nsec);
    return r;
}
void gil_calibrate(void) { take_cond = last; wait_cond = before_last; }
unsigned long gil_takes(void) { return takes; }
unsigned long long gil_waited_ns(void) { return waited_ns; }
"""
_MARK = "AIOKV_GIL_DROPS_LIB"


def _relaunch() -> None:
    """Build the library and run this script again with it preloaded."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("gil_drops: needs a C compiler (cc)")
    build = Path(tempfile.mkdtemp(prefix="aiokv-gil-drops-"))
    try:
        (build / "gil.c").write_text(_SOURCE)
        lib = build / "libgil.so"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(build / "gil.c"), "-ldl"], check=True)
        env = dict(os.environ, LD_PRELOAD=str(lib), **{_MARK: str(lib)})
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    finally:
        shutil.rmtree(build, ignore_errors=True)


class _Counter:
    """Per-thread GIL takes and waits, attributed to the outermost C call running at the time."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        self._takes, self._waited = lib.gil_takes, lib.gil_waited_ns
        self._takes.restype, self._waited.restype = ctypes.c_ulong, ctypes.c_ulonglong
        self.on = False
        self.by_call: collections.Counter[tuple[str, str]] = collections.Counter()
        self._local = threading.local()

    def snapshot(self) -> tuple[int, int]:
        """This thread's (takes, waited ns) so far."""
        return int(self._takes()), int(self._waited())

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append([self._takes(), 0])  # takes at the call, and those of C calls nested in it
        elif event in ("c_return", "c_exception"):
            stack = self._local.__dict__.get("stack")
            if stack:
                start, nested = stack.pop()
                takes = self._takes() - start
                if stack:
                    stack[-1][1] += takes
                if takes > nested and self.on:  # the innermost C call that made them
                    name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
                    owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
                    thread = threading.current_thread().name.rstrip("0123456789_-")
                    self.by_call[(thread, f"{owner}.{name}")] += takes - nested


async def _run(args: argparse.Namespace, backend: Any, root: Path, counter: _Counter) -> None:
    import bench_gil

    from aiokv import CacheConfig, KVCache
    from aiokv.storage import DiskConfig

    layout = bench_gil._layout(args.page_kib)
    n = args.pages * layout.page_tokens
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(layout.num_layers, 2 * n, layout.rows, layout.head_dim, generator=gen).to(layout.dtype)
    tokens = torch.randint(0, 50_000, (n,), generator=gen).tolist()
    disk = DiskConfig(directory=root, capacity_bytes=(4 + args.repeats) * args.pages * (layout.page_bytes + 4096),
                      backend=backend)
    config = CacheConfig(cpu_bytes=(2 * args.pages + 8) * layout.page_bytes, disk=disk, namespace="gil-drops",
                         pool_chunk_bytes=4 * layout.page_bytes)
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        slots = torch.arange(n, 2 * n)
        bridge = cache._bridge  # the copy thread's counters are read by a copy of their own
        for _ in range(args.repeats):
            fresh = torch.randint(0, 50_000, (n,), generator=gen).tolist()
            for tier in ("offload", "disk", "pool"):
                if tier == "disk":
                    for key in cache.keys(tokens):
                        cache.pool.table.discard(key)
                match = await cache.match(tokens)
                with bench_gil.spinning(1) if args.spin else contextlib.nullcontext():
                    copy0 = await bridge.run_cpu(counter.snapshot)
                    loop0 = counter.snapshot()
                    counter.by_call.clear()
                    counter.on = True
                    start = time.perf_counter()
                    if tier == "offload":
                        stored = (await cache.offload(fresh, slots)).stored
                    else:
                        await cache.load(match, slots)
                    took = time.perf_counter() - start
                    counter.on = False
                    loop1 = counter.snapshot()
                    copy1 = await bridge.run_cpu(counter.snapshot)
                if tier == "offload":
                    if stored != args.pages:
                        sys.exit(f"gil_drops: the offload stored {stored} of {args.pages} pages")
                    await cache.flush()  # its disk writes, before the hits are counted
                    for key in cache.keys(fresh):
                        cache.pool.table.discard(key)
                print(f"{backend.value:12} {tier:7} {took * 1e3:8.2f} ms  GIL takes: loop thread "
                      f"{loop1[0] - loop0[0]:4d} (waited {(loop1[1] - loop0[1]) / 1e6:6.1f} ms), copy thread "
                      f"{copy1[0] - copy0[0]:4d}"
                      f" (waited {(copy1[1] - copy0[1]) / 1e6:6.1f} ms)")
                threads: collections.Counter[str] = collections.Counter()
                for (thread, _), takes in counter.by_call.items():
                    threads[thread] += takes
                wakes = counter.by_call[("MainThread", "epoll.epoll.poll")]
                print("    attributed takes by thread: "
                      + ", ".join(f"{thread} {takes}" for thread, takes in threads.most_common())
                      + f"; the loop's epoll calls (one a loop turn, each a take): {wakes}")
                for (thread, call), takes in counter.by_call.most_common(args.top):
                    print(f"    {takes:5d}  {thread:12} {call}")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=39)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="C calls listed per hit (most takes first)")
    parser.add_argument("--spin", action="store_true", help="beside a thread running Python (bench_gil's spinner)")
    parser.add_argument("--dir", type=Path, default=None, help="where the page files go (default: a temp dir)")
    args = parser.parse_args()
    if min(args.pages, args.page_kib, args.repeats) <= 0 or args.top < 0:
        parser.error("--pages, --page-kib and --repeats must be positive, --top not negative")
    lib_path = os.environ.get(_MARK)
    if lib_path is None:
        _relaunch()
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    lib = ctypes.PyDLL(lib_path)  # PyDLL: reading the counters keeps the GIL (a CDLL call would let it go)
    time.sleep(0)  # one GIL release and take: the last two conditions signalled are the GIL's
    lib.gil_calibrate()
    counter = _Counter(lib)
    threading.setprofile(counter.profile)
    sys.setprofile(counter.profile)
    from aiokv import DiskBackend

    print(f"python {sys.version.split()[0]}, {args.pages} pages of {args.page_kib} KiB, "
          f"{'beside a spinning thread' if args.spin else 'idle'}; GIL takes per hit (each a release before it)")
    for backend in (DiskBackend.THREADS, DiskBackend.URING_FIXED):
        root = Path(tempfile.mkdtemp(prefix="aiokv-gil-drops-", dir=args.dir))
        try:
            asyncio.run(_run(args, backend, root, counter))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    sys.setprofile(None)
    threading.setprofile(None)


if __name__ == "__main__":
    main()
