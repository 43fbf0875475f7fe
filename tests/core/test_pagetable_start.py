"""A page table of very many pages is built without per-page objects, so starting it never stalls the
loop, cyclic GC enabled (issue #11: "a start that never blocks")."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys

import pytest
import torch

from aiokv.layout import KVLayout
from aiokv.pagetable import PageTable
from aiokv.pool import PagePool

SMALL = KVLayout.mha(1, 1, 16, torch.bfloat16, page_tokens=8)
"""4 KiB pages: 262,144 of them in 1 GiB."""
MANY_PAGES = 1 << 18
CHUNK_PAGES = 4096
STALL_BOUND = 0.05
"""Seconds. With one Python object per page, the cyclic GC's passes over them stalled the loop
75-490 ms here (2-vCPU VM, idle to heavily loaded); the flat table 11-17 ms under the same load."""


def test_a_large_table_adds_no_object_per_page() -> None:
    # Regression: the table held one GC-tracked object per page; 262,144 of them made every full
    # collection walk them all, and creating them triggered those collections.
    gc.collect()
    before = len(gc.get_objects())
    table = PageTable(MANY_PAGES)
    for first in range(0, MANY_PAGES, CHUNK_PAGES):
        table.add_usable(range(first, first + CHUNK_PAGES))
    added = len(gc.get_objects()) - before
    assert added < 100, f"the table added {added} GC-tracked objects for {MANY_PAGES} pages"
    stats = table.statistics()
    assert (stats.usable, stats.free) == (MANY_PAGES, MANY_PAGES)
    table.check_invariants()


def test_add_usable_of_a_chunk_costs_the_same_in_a_small_and_a_large_table() -> None:
    # Chunks join the free list on the loop, one at a time: a cost growing with the table's size
    # (re-sorting every free page per chunk) made the last chunks of a large pool the slowest.
    def worst_add(capacity: int) -> int:
        table = PageTable(capacity)
        worst = 0
        for first in range(0, capacity, CHUNK_PAGES):
            before = len(table._fresh_starts)
            table.add_usable(range(first, first + CHUNK_PAGES))
            worst = max(worst, len(table._fresh_starts) - before)
        return worst

    assert worst_add(MANY_PAGES) == worst_add(4 * CHUNK_PAGES) == 1  # one run per chunk, whatever the size


@pytest.mark.timing
@pytest.mark.asyncio
async def test_open_of_a_262k_page_pool_with_gc_on_does_not_stall_the_loop() -> None:
    assert gc.isenabled()
    gc.collect()  # no collection owed by earlier tests lands in the measurement
    loop = asyncio.get_running_loop()
    worst = 0.0
    ticked = asyncio.Event()
    due = loop.time() + 0.001
    handle: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal worst, due, handle
        now = loop.time()
        worst = max(worst, now - due)
        ticked.set()
        due = now + 0.001
        handle = loop.call_at(due, tick)

    handle = loop.call_at(due, tick)
    await ticked.wait()
    worst = 0.0
    pool = await PagePool.open(SMALL, MANY_PAGES * SMALL.page_bytes, chunk_bytes=CHUNK_PAGES * SMALL.page_bytes)
    try:
        await pool.wait_ready()  # every chunk's pages joined the table on the loop
        stats = pool.statistics().pages
        assert (stats.capacity, stats.usable) == (MANY_PAGES, MANY_PAGES)
        assert worst < STALL_BOUND, f"the loop stalled {worst * 1e3:.0f} ms while a {MANY_PAGES}-page pool opened"
    finally:
        handle.cancel()
        await pool.aclose()


BUILD_RSS = """
import os
import torch  # what the pool's process has loaded already
from aiokv.pagetable import PageTable

def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident()
table = PageTable(1 << 20)
print(resident() - before)
"""


def test_building_a_table_writes_none_of_its_columns() -> None:
    # Regression (#11, first start): the columns were filled as they were made (bytearray,
    # array('q', [0]) * n, [None] * n: 26 MiB written for 1M pages), one C call each holding the
    # GIL, 4-8 ms for 262K pages in a fresh process: a loop stall although the table is built in
    # a worker thread. Now they are zeroed memory nobody wrote (the kernel maps zero pages on first
    # use). Resident memory is the witness: a fresh process, so no freed block is reused.
    run = subprocess.run([sys.executable, "-c", BUILD_RSS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    grown = int(run.stdout.split()[-1])
    assert grown < 2 << 20, f"building a 1M-page table made {grown >> 10} KiB resident"
