"""Seeded random interleavings of the aiokv tier's lookup bookkeeping and ``has_pending_work``
under vLLM 0.33's real ``TieringOffloadingManager`` and its lock (review 176: 6515299, 266523c).

The driver interleaves requests that start and finish (ids reused once finished), lookups through
the manager and straight to the tier (as the manager makes them on a primary miss), stores (GPU ->
CPU, cascaded to the tier), step ends, drains, ``reset_cache``, ``has_pending_work`` and job polls.

The oracle (a model of which keys are on disk and which requests live, checked after every call):

- a HIT only for a key on disk (nothing is evicted or damaged here: once on disk, always);
- a MISS never for a key that was on disk before its run of overlapping askers began (the tier
  keeps a verdict while some request asks about the key; a new run asks afresh);
- ``has_pending_work`` False only when no job is unreported and no lookup a live request asks
  about is out: a drain then reports no job and no answer anyone takes;
- at the end, every request finished: ``has_pending_work`` goes False within ``SETTLE_STEPS``
  step ends, nothing is left in the tier's lookup books, and every job was reported exactly once
  (vLLM's manager asserts an unknown job);
- in a third of the seeds the loop thread dies at a random point: the same, lookups then MISS;
- in another third vLLM shuts the manager down with requests live and work out: one poll then
  reports every job, ``has_pending_work`` is False and lookups MISS.
- a live request's lookups settle (no RETRY) within ``SETTLE_STEPS`` step ends and drains.

``AIOKV_REV176_SEEDS=N`` drives N seeds instead of the default few; ``AIOKV_REV176_ROUNDS`` the ops
per seed.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import STEP, keys_of, make_manager, on_disk, payload, store, tier_of, write_chunk

from aiokv.adapters.vllm import AiokvTier

ROUNDS = int(os.environ.get("AIOKV_REV176_ROUNDS", "250"))
EXTRA = int(os.environ.get("AIOKV_REV176_SEEDS", "0"))
SEEDS = list(range(EXTRA)) if EXTRA else [1, 2, 3, 4]
SETTLE_STEPS = 6
KEYS = keys_of("k", 10)
REQ_IDS = [f"r{i}" for i in range(5)]


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


class Drive:
    def __init__(self, manager: TieringOffloadingManager, rng: random.Random, kill: bool, shut: bool) -> None:
        self.m, self.tier, self.rng = manager, tier_of(manager), rng
        self.kill, self.dead, self.shut = kill, False, shut
        self.op = 0
        self.stored_at: dict[bytes, int] = {}  # key -> op index at which it was seen on disk
        self.live: dict[str, ReqContext] = {}
        self.first_ask: dict[str, dict[bytes, int]] = {}  # live (manager) request -> key -> op of first ask
        self.asked_by: dict[bytes, dict[str, int]] = {}  # key -> req (till the tier's finish) -> first ask
        # key -> op at which its run of overlapping askers began: the tier keeps a verdict while any
        # request asks about the key, so a MISS may be as old as that run, never older.
        self.epoch: dict[bytes, int] = {}

    # -- the model ----------------------------------------------------------------------------

    def refresh_disk(self) -> None:
        """Keys now on disk (asked on the loop, outside the manager lock; none once it died)."""
        if self.dead:
            return
        for key, there in zip(KEYS, on_disk(self.m, KEYS), strict=True):
            if there:
                self.stored_at.setdefault(key, self.op)

    def tier_live(self, req: str) -> bool:
        return req in self.m._req_state  # the manager finalizes (tier.on_request_finished) later

    def check_answer(self, req: str, key: bytes, result: LookupResult) -> None:
        if result == LookupResult.HIT:
            self.refresh_disk()
            assert key in self.stored_at, f"op {self.op}: HIT for {key!r} never stored"
        elif result == LookupResult.MISS and not self.dead:
            stored = self.stored_at.get(key)
            since = self.epoch.get(key)
            if stored is not None and since is not None:
                assert stored >= since, (f"op {self.op}: MISS to {req} for {key!r}, on disk since op {stored}, "
                                         f"before the run of overlapping askers began (op {since})")

    def note_ask(self, req: str, key: bytes) -> None:
        self.forget_finished()
        if not self.asked_by.get(key):
            self.epoch[key] = self.op
        self.first_ask[req].setdefault(key, self.op)
        self.asked_by.setdefault(key, {}).setdefault(req, self.op)

    def forget_finished(self) -> None:
        for key in list(self.asked_by):
            for r in [r for r in self.asked_by[key] if not self.tier_live(r)]:
                del self.asked_by[key][r]

    # -- the ops ------------------------------------------------------------------------------

    def start(self) -> None:
        free = [r for r in REQ_IDS if r not in self.live and not self.tier_live(r)]
        if not free:
            return
        req = self.rng.choice(free)
        self.forget_finished()
        ctx = ReqContext(req_id=req)
        with self.m.lock:
            self.m.on_new_request(ctx)
        self.live[req], self.first_ask[req] = ctx, {}

    def finish(self) -> None:
        if not self.live:
            return
        req = self.rng.choice(sorted(self.live))
        ctx = self.live.pop(req)
        del self.first_ask[req]
        with self.m.lock:
            self.m.on_request_finished(ctx)
        self.forget_finished()

    def tier_lookup(self) -> None:
        if not self.live:
            return
        req = self.rng.choice(sorted(self.live))
        key = self.rng.choice(KEYS)
        self.note_ask(req, key)
        with self.m.lock:
            result = self.tier.lookup(key, self.live[req])
        self.check_answer(req, key, result)

    def manager_lookup(self) -> None:
        if not self.live:
            return
        req = self.rng.choice(sorted(self.live))
        key = self.rng.choice(KEYS)
        self.note_ask(req, key)
        with self.m.lock:
            self.m.lookup(key, self.live[req])

    def store(self) -> None:
        if not self.live:
            return
        req = self.rng.choice(sorted(self.live))
        keys = self.rng.sample(KEYS, self.rng.randint(1, 2))
        ctx = self.live[req]
        with self.m.lock:
            out = self.m.prepare_store(keys, ctx)
            if out is None:
                return
            stored = list(out.keys_to_store)
            for key, chunk in zip(stored, out.store_spec.chunk_ids, strict=True):
                write_chunk(self.m, int(chunk), payload(KEYS.index(key)))
            if stored:
                self.m.complete_store(stored, ctx)

    def step_end(self) -> None:
        with self.m.lock:
            self.m.on_schedule_end(STEP)
        self.forget_finished()

    def drain(self) -> None:
        self.tier.drain_jobs()
        self.refresh_disk()

    def reset(self) -> None:
        with self.m.lock:
            self.m.reset_cache()
            self.m.on_reset_flushed()
        self.refresh_disk()
        self.forget_finished()

    def pending(self) -> None:
        with self.m.lock:
            busy = self.tier.has_pending_work()
        if busy:
            return
        # False: no job unreported, no lookup out that a live request asks about. A drain then
        # brings no job and no answer anyone takes (a lookup out for requests that all finished
        # does not count: its answer would only keep vLLM stepping).
        self.tier.drain_jobs()
        with self.m.lock:
            jobs = list(self.tier.get_finished_jobs())
            answers = sum(key in self.tier._wanted for posted, batch in self.tier._answers if posted
                          for key, _ in batch)
        assert jobs == [] and answers == 0, f"op {self.op}: has_pending_work False with {jobs} / {answers} out"

    def die(self) -> None:
        """The loop thread ends for real (a callback lets ``SystemExit`` out); from then on every
        lookup is a MISS and every job is reported failed."""
        if not self.kill or self.dead:
            return
        thread = self.tier._store.thread
        thread.loop.call_soon_threadsafe(_die)
        thread._thread.join(10.0)
        assert thread.dead, "the loop thread did not end"
        self.dead = True

    def poll(self) -> None:
        with self.m.lock:
            self.m._process_finished_jobs()

    OPS = (("start", 3), ("finish", 2), ("tier_lookup", 6), ("manager_lookup", 3), ("store", 3),
           ("step_end", 4), ("drain", 1), ("reset", 0.3), ("pending", 3), ("poll", 1),
           ("die", 0.3))

    def run(self, rounds: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for self.op in range(rounds):
            getattr(self, self.rng.choices(names, weights)[0])()
        if self.shut:
            self.shut_down()
            return
        self.settle_live()
        self.quiesce()

    def shut_down(self) -> None:
        """vLLM's shutdown with requests live and work out: every job is then reported (failed or
        not) by one poll, ``has_pending_work`` is False, and a lookup is a MISS at once."""
        self.m.shutdown()
        with self.m.lock:
            self.m._process_finished_jobs()
            assert not self.m._jobs, f"jobs never reported after shutdown: {sorted(self.m._jobs)}"
            assert not self.tier.has_pending_work()
            for _, ctx in sorted(self.live.items()):
                assert self.tier.lookup(KEYS[0], ctx) == LookupResult.MISS
                self.m.on_request_finished(ctx)
            assert not self.tier.has_pending_work()

    def settle_live(self) -> None:
        """Every live request's lookups settle within SETTLE_STEPS steps (each ended by a drain)."""
        for req, ctx in sorted(self.live.items()):
            for key in sorted(self.first_ask[req]):
                for _ in range(SETTLE_STEPS):
                    with self.m.lock:
                        result = self.tier.lookup(key, ctx)
                    self.check_answer(req, key, result)
                    if result != LookupResult.RETRY:
                        break
                    self.step_end()
                    self.drain()
                else:
                    raise AssertionError(f"{req}'s lookup of {key!r} is RETRY after {SETTLE_STEPS} steps")

    def quiesce(self) -> None:
        for req in sorted(self.live):
            self.op += 1
            ctx = self.live.pop(req)
            with self.m.lock:
                self.m.on_request_finished(ctx)
        for _ in range(SETTLE_STEPS):
            self.step_end()
            self.drain()
            with self.m.lock:
                if not self.m.has_pending_work():
                    break
        else:
            raise AssertionError(f"has_pending_work still True after {SETTLE_STEPS} steps")
        tier: AiokvTier = self.tier
        assert not self.m._req_state and not self.m._jobs
        assert (tier._wanted, tier._req_keys, tier._verdicts, tier._queued, tier._asked) == ({}, {}, {}, {}, set())
        assert tier._lookups_out == 0 and not tier._unreported and not tier._answers


@pytest.mark.parametrize("seed", SEEDS)
def test_random_interleavings(tmp_path: Path, managers: list[TieringOffloadingManager], seed: int) -> None:
    # Odd seeds: the loop parks without polling and on_schedule_end wakes it.
    manager = make_manager(tmp_path, cpu_chunks=3, options={"idle_poll_s": 0} if seed % 2 else None)
    managers.append(manager)
    Drive(manager, random.Random(seed), kill=seed % 3 == 0, shut=seed % 3 == 1).run(ROUNDS)


def _on_disk_manager(tmp_path: Path, managers: list[TieringOffloadingManager]) -> tuple[TieringOffloadingManager,
                                                                                         list[bytes]]:
    """A manager over a directory where an earlier manager stored two keys (its CPU tier is empty)."""
    first = make_manager(tmp_path)
    keys = keys_of("disk", 2)
    store(first, "r0", keys, [1, 2])
    first.shutdown()
    managers.append(manager := make_manager(tmp_path))
    return manager, keys


def test_a_shared_queued_key_keeps_its_lookup_when_one_asker_finishes(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """266523c drops a queued key only when no other request asks about it: the one left gets the
    real verdict (HIT for the key on disk), not RETRY forever and not a MISS."""
    manager, keys = _on_disk_manager(tmp_path, managers)
    tier = tier_of(manager)
    a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
    with manager.lock:
        manager.on_new_request(a)
        manager.on_new_request(b)
        assert tier.lookup(keys[0], a) == tier.lookup(keys[0], b) == LookupResult.RETRY
        manager.on_request_finished(a)
        assert tier.has_pending_work()
        manager.on_schedule_end(STEP)
    tier.drain_jobs()
    with manager.lock:
        assert not tier.has_pending_work()
        assert tier.lookup(keys[0], b) == LookupResult.HIT
        manager.on_request_finished(b)
        assert (tier._wanted, tier._verdicts, tier._queued, tier._asked) == ({}, {}, {}, set())


def test_a_reused_request_id_gets_the_verdict_of_a_lookup_posted_for_its_finished_namesake(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """A lookup posted for a request that then finished, its id reused by a new request asking the
    same key before the answer arrived: the answer (computed after the new ask) is the new one's
    verdict; it is not asked twice and does not stay RETRY."""
    manager, keys = _on_disk_manager(tmp_path, managers)
    tier = tier_of(manager)
    old, new = ReqContext(req_id="x"), ReqContext(req_id="x")
    with manager.lock:
        manager.on_new_request(old)
        assert tier.lookup(keys[1], old) == LookupResult.RETRY
        manager.on_schedule_end(STEP)  # posted
        manager.on_request_finished(old)
        manager.on_new_request(new)
        assert tier.lookup(keys[1], new) == LookupResult.RETRY
        assert not tier._queued  # the posted lookup answers it
        assert tier._lookups_out == 1  # still out (not has_pending_work: the loop may have answered)
    tier.drain_jobs()
    with manager.lock:
        assert tier.lookup(keys[1], new) == LookupResult.HIT
        manager.on_request_finished(new)
        assert not tier.has_pending_work()


def test_pending_work_while_a_promotion_is_in_flight_after_the_answers_are_taken(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """6515299 takes the answers in has_pending_work: with every answer taken and the request
    finished, the promotion's load (a job) still keeps it True until vLLM collected it."""
    manager, keys = _on_disk_manager(tmp_path, managers)
    tier = tier_of(manager)
    ctx = ReqContext(req_id="p")
    with manager.lock:
        manager.on_new_request(ctx)
        assert manager.lookup(keys[0], ctx) == LookupResult.RETRY
        manager.on_schedule_end(STEP)
    tier.drain_jobs()
    with manager.lock:
        assert manager.lookup(keys[0], ctx) == LookupResult.HIT_PENDING  # promotion reserved
        manager.on_request_finished(ctx)
        manager.on_schedule_end(STEP)  # submits the load
        assert tier._unreported
        assert tier.has_pending_work() and manager.has_pending_work()
    tier.drain_jobs()
    with manager.lock:
        assert tier.has_pending_work()  # done, not reported yet
        manager.on_schedule_end(STEP)  # collects it
        assert not tier.has_pending_work() and not manager.has_pending_work()
        assert manager.lookup(keys[0], ReqContext(req_id="q")) == LookupResult.HIT  # in the CPU tier now
