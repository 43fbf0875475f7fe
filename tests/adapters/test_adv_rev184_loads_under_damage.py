"""Seeded random runs of vLLM 0.33's real ``TieringOffloadingManager`` with the aiokv tier, played
as the scheduler plays it, with promotions (disk -> CPU loads) under eviction and real damage to
the page files (review 184). rev176's driver checks the lookup books with nothing evicted or
damaged; this one checks what a load delivers while files are evicted, overwritten and deleted
behind the tier, requests finish at any point between lookup, promotion and its report, and (by
seed) the loop thread dies, ``reset_cache`` drains, or vLLM shuts down with work in flight.

Requests ask a few keys each step, one key at a time as ``_maximal_prefix_lookup`` does; a key
the manager answers HIT is read from the CPU chunk at once (``prepare_load``, the GPU worker's
read) and keys answered MISS are computed and stored (``prepare_store``/``complete_store``: the
cascade to aiokv). The disk budget holds 6 chunks of the 12 keys, so stores evict.

The oracle, after every call: a chunk vLLM reads for a key holds exactly that key's payload (a HIT
verdict the load cannot honour must end as a failed promotion, never as other bytes); at the end,
with every request finished, ``has_pending_work`` goes False within ``SETTLE_STEPS`` step ends,
vLLM's manager holds no job (each reported exactly once: it asserts an unknown one) and the tier
keeps no verdict, asker or lookup out; a shutdown returns within ``BOUND_S`` and one poll then
reports every job.

``AIOKV_REV184_SEEDS=N`` drives N seeds instead of the default few.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import CHUNK_BYTES, STEP, keys_of, make_manager, page_files, payload, read_chunk, tier_of, write_chunk

ROUNDS = 300
EXTRA = int(os.environ.get("AIOKV_REV184_SEEDS", "0"))
SEEDS = list(range(EXTRA)) if EXTRA else [3, 4, 5, 6, 7, 8]
SETTLE_STEPS = 8
BOUND_S = 10.0
KEYS = keys_of("dmg", 12)
INDEX = {key: i for i, key in enumerate(KEYS)}


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


class Drive:
    def __init__(self, manager: TieringOffloadingManager, root: Path, rng: random.Random, seed: int) -> None:
        self.m, self.tier, self.root, self.rng = manager, tier_of(manager), root, rng
        self.kill, self.shut = seed % 3 == 0, seed % 3 == 1
        self.live: dict[str, tuple[ReqContext, list[bytes]]] = {}
        self.made = 0
        self.loaded = 0  # chunks read through a HIT (a promotion's or the CPU tier's own)
        self.op = 0

    def start(self) -> None:
        if len(self.live) >= 4:
            return
        self.made += 1
        ctx = ReqContext(req_id=f"r{self.made}")
        with self.m.lock:
            self.m.on_new_request(ctx)
        self.live[ctx.req_id] = (ctx, self.rng.sample(KEYS, self.rng.randint(1, 4)))

    def finish(self) -> None:
        if not self.live:
            return
        ctx, _ = self.live.pop(self.rng.choice(sorted(self.live)))
        with self.m.lock:
            self.m.on_request_finished(ctx)

    def ask(self) -> None:
        """One request's lookups: a HIT is read at once and must hold the key's payload; misses
        are computed and stored, most of the time."""
        if not self.live:
            return
        ctx, keys = self.live[self.rng.choice(sorted(self.live))]
        misses = []
        with self.m.lock:
            for key in keys:
                result = self.m.lookup(key, ctx)
                if result is LookupResult.HIT:
                    spec = self.m.prepare_load([key], ctx)
                    data = read_chunk(self.m, int(spec.chunk_ids[0]))
                    assert data == payload(INDEX[key]), f"op {self.op}: wrong KV for key {INDEX[key]}"
                    self.m.complete_load([key], ctx)
                    self.loaded += 1
                elif result is LookupResult.MISS:
                    misses.append(key)
            if misses and self.rng.random() < 0.7:
                out = self.m.prepare_store(misses, ctx)
                if out is not None and out.keys_to_store:
                    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                        write_chunk(self.m, int(chunk), payload(INDEX[key]))
                    self.m.complete_store(list(out.keys_to_store), ctx)

    def step_end(self) -> None:
        with self.m.lock:
            self.m.on_schedule_end(STEP)
        if self.rng.random() < 0.5:
            self.tier.drain_jobs()

    def damage(self) -> None:
        """Overwrite 16 bytes of a page file somewhere (header or payload) behind the tier."""
        files = page_files(self.root)
        if not files:
            return
        path = self.rng.choice(files)
        try:
            with open(path, "r+b") as f:
                f.seek(self.rng.randrange(max(1, path.stat().st_size)))
                f.write(os.urandom(16))
        except FileNotFoundError:  # evicted meanwhile
            pass

    def delete(self) -> None:
        files = page_files(self.root)
        if files:
            self.rng.choice(files).unlink(missing_ok=True)

    def die(self) -> None:
        thread = self.tier._store.thread
        if self.kill and thread.died is None:
            thread.loop.call_soon_threadsafe(_die)

    def reset(self) -> None:
        with self.m.lock:
            self.m.reset_cache()
            self.m.on_reset_flushed()

    def pending(self) -> None:
        with self.m.lock:
            self.m.has_pending_work()

    OPS = (("start", 12), ("finish", 8), ("ask", 35), ("step_end", 25), ("damage", 7), ("delete", 3),
           ("die", 0.5), ("reset", 1), ("pending", 8.5))

    def run(self, rounds: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for self.op in range(rounds):
            getattr(self, self.rng.choices(names, weights)[0])()
        if self.shut:
            self.shut_down()
        else:
            self.settle()

    def shut_down(self) -> None:
        with self.m.lock:
            self.m.on_schedule_end(STEP)  # promotions of this step submitted: in flight at shutdown
        began = time.monotonic()
        self.m.shutdown()
        assert time.monotonic() - began < BOUND_S, "vLLM's shutdown took too long"
        with self.m.lock:
            self.m._process_finished_jobs()
            assert not self.m._jobs, f"jobs never reported after shutdown: {sorted(self.m._jobs)}"
            assert not self.tier.has_pending_work()

    def settle(self) -> None:
        for ctx, _ in list(self.live.values()):
            with self.m.lock:
                self.m.on_request_finished(ctx)
        self.live.clear()
        for _ in range(SETTLE_STEPS):
            with self.m.lock:
                self.m.on_schedule_end(STEP)
            self.tier.drain_jobs()
            with self.m.lock:
                if not self.m.has_pending_work():
                    break
        else:
            raise AssertionError(f"has_pending_work still True after {SETTLE_STEPS} steps")
        tier = self.tier
        assert not self.m._req_state and not self.m._jobs
        assert (tier._wanted, tier._req_keys, tier._verdicts, tier._queued, tier._asked) == ({}, {}, {}, {}, set())
        assert tier._lookups_out == 0 and not tier._unreported


@pytest.mark.parametrize("seed", SEEDS)
def test_loads_under_eviction_damage_and_finishing_requests_deliver_only_the_right_bytes(
        tmp_path: Path, managers: list[TieringOffloadingManager], seed: int) -> None:
    managers.append(manager := make_manager(tmp_path, options={"disk_bytes": 6 * CHUNK_BYTES}))
    drive = Drive(manager, tmp_path, random.Random(seed), seed)
    drive.run(ROUNDS)
    assert drive.loaded > 0  # the oracle was exercised: HITs were read
    if not drive.kill and not drive.shut:
        stats = drive.tier.statistics()
        assert stats["reads"] > 0 and stats["evictions"] > 0  # promotions ran, stores evicted
