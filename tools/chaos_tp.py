"""Chaos runs of a 2-rank `TPCache` on CPU: rank workers (or managers) SIGKILLed or SIGSTOPped at random
moments while clients play an engine's requests, against prefix oracles.

Each seed (default mode) starts a `TPCache` (pool of 16 or 40 pages, disk tier; MHA, one head per
rank or MLA; `max_jobs` 1, 6 or 64) and two rank processes (one thread runner, one async runner;
copies inline or on their copy threads, slowed at times), then runs the test soak's clients (match,
plain / from-token / streamed / layered loads, prefill, offload, prefetch; a third cancelled at
random moments, and at times right as a rank's report is read) while a fault injector, at moments
drawn from the seed (uniform, not only while transfers are in flight), does one of: SIGKILL a rank
or both (at times again, or SIGSTOPped a while, as it restarts: connecting, attaching or registering
the pool), SIGSTOP one or both for 10 ms-3 s then SIGCONT, SIGSTOP then SIGKILL while stopped, or
shut a live rank's socket down as a third party would (``ss -K``; the process lives on and keeps
its buffer, so every oracle still holds for it). The cache is then closed: under the clients'
traffic, or after it with a rank stopped briefly or past the close's fence, killed, stopped then
killed, restarted and stopped while it attaches, or its socket shut down. A second
`TPCache` on the same socket and disk directories must get the live ranks back and serve every
document from disk bit-exact. ``--manager-kills N`` instead SIGKILLs N managers in turn (child
processes offloading and loading; a rank stopped across one at times; at times one killed while the
live ranks attach its pool) over the same directories
and live ranks, then serves every prompt from one here.

Oracles (every KV value is a hash of its whole prefix, salt, layer, row and lane: adv_helpers):
- every token a load or stream reports as loaded is bit-exact on every rank whose process lived
  through the call (the test soak skips all ranks once any was restarted; here only that one);
- a rank's engine wait on a layered stream (``wait_layer``) that reports a layer ready finds, right
  then, that layer's KV for every token the stream reports loaded;
- a call admitted while a rank was not attached loads nothing (never a hit one rank lacks);
- no call hangs (each bounded), no exception escapes into the loop or out of a client (a call on a
  closed cache raises ``RuntimeError``), every close ends (bounded);
- nothing referenced, reserved or in flight after the traffic; no /dev/shm segment of this process
  or of a killed manager, aiokv thread or file descriptor left once everything closed.

    python tools/chaos_tp.py --seeds 20               # seeds 0..19
    python tools/chaos_tp.py --seed-list 7 12 --faults 6 -v
    python tools/chaos_tp.py --seeds 20 --manager-kills 3

Exit status 1 when a seed failed (each failure is printed with its seed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The test soak's helpers (rank processes, oracle, clients); the rank children get this sys.path.
sys.path[:0] = [str(ROOT / "tests" / "tp"), str(ROOT / "tests")]

import adv_helpers as adv  # noqa: E402
import torch  # noqa: E402
from adv_helpers import (  # noqa: E402
    CALL_S,
    START_S,
    AdvRanks,
    RankGone,
    Soak,
    idx,
    prefill,
    sever_socket,
    stop_process,
)
from child_procs import fork_context  # noqa: E402
from tp_helpers import CONFIG, rank_kv  # noqa: E402

from aiokv import CacheConfig, KVLayout  # noqa: E402
from aiokv.results import Match  # noqa: E402
from aiokv.storage import DiskConfig  # noqa: E402
from aiokv.tp import RankWorker, RankWorkerThread, TPCache  # noqa: E402

LAYOUTS = {
    "mha": KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4),
    "mha-1head": KVLayout.mha(2, 2, 8, torch.bfloat16, page_tokens=4),  # one head per rank
    "mla": KVLayout.mla(2, 16, torch.float16, page_tokens=4),  # rank 0 writes, both read
}
NUM_SLOTS = 640
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)


def cache_config(layout: KVLayout, disk: Path, pages: int = 40) -> CacheConfig:
    # A pool of 40 pages (or fewer) against ~100 distinct pages: eviction to disk and promotions from it.
    page_bytes = layout.for_tp(2).page_bytes
    return CacheConfig(cpu_bytes=pages * page_bytes, namespace="tp-chaos",
                       pool_chunk_bytes=8 * page_bytes, launch_pages=1, launch_turn_s=0,
                       offload_wait=0.5, commit_wait=1.0, close_timeout=5.0,
                       disk=DiskConfig(directory=disk, capacity_bytes=400 * (page_bytes + 4096)))


async def check_slots(ranks: AdvRanks, tokens: Sequence[int], salt: str | None, slots: Sequence[int], low: int,
                      high: int, gens: tuple[int, ...], tally: adv.Tally, what: str) -> None:
    """The soak's check, per rank: only a rank restarted since ``gens`` is skipped (its buffer is
    another process's); a rank that lived through the call must hold what the call claimed."""
    if high <= low:
        return
    for rank in range(ranks.tp_size):
        if ranks.generation[rank] != gens[rank]:
            continue
        try:
            got = await ranks.read(rank, slots[low:high])
        except RankGone:
            continue
        if ranks.generation[rank] != gens[rank]:
            continue
        want = adv.rank_prefix_kv(ranks.layout, tokens[:high], adv.SALTS[salt], rank, ranks.tp_size)[:, low:high]
        if not torch.equal(got, want):
            bad = (got != want).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            zeros = bool((got[:, bad] == 0).all()) if bad else False
            tally.wrong.append(f"{what}: rank {rank} wrong KV at tokens {[low + b for b in bad][:8]} of "
                               f"[{low}, {high}) (prompt {list(tokens[:3])}.. len {len(tokens)}, salt {salt}, "
                               f"gens {gens} -> {ranks.generations()}, zeros {zeros})")
    tally.verified_tokens += high - low


# The soak's methods call the module's check: use the per-rank one.
adv.check_slots = check_slots

_CALLS: set[asyncio.Task[Any]] = set()
"""The clients' cache calls in flight (those ``maybe_cancelled`` runs): a rank's report may cancel one."""
_maybe_cancelled = adv.maybe_cancelled


async def _tracked_maybe_cancelled(rng: random.Random, call: Any, tally: adv.Tally) -> Any:
    task = asyncio.ensure_future(call)
    _CALLS.add(task)
    task.add_done_callback(_CALLS.discard)
    return await _maybe_cancelled(rng, task, tally)


adv.maybe_cancelled = _tracked_maybe_cancelled


def cancel_on_reports(cache: TPCache, rng: random.Random, faults: Faults, rate: float = 0.03) -> None:
    """At ``rate`` of the ranks' reports (DONE frames, read by the group), cancel a client's call in
    flight right then: just before the report resolves its job, or just after (its done-callbacks
    scheduled, not run). The call's clean-up then meets a job ending under it."""
    table = cache.group.jobs
    report = table.report

    def reporting(job_id: int, rank: int, status: Any, text: str = "") -> bool:
        victim = rng.choice(sorted(_CALLS, key=id)) if _CALLS and rng.random() < rate else None
        before = rng.random() < 0.5
        if victim is not None and before:
            victim.cancel()
        found = report(job_id, rank, status, text)
        if victim is not None and not before:
            victim.cancel()
        faults.report_cancels += victim is not None
        return found

    table.report = reporting  # type: ignore[method-assign]


# -- rank processes whose engine waits on a layered load's layers -------------------------------------


LAYER_WAIT_S = 20.0
"""Bound on a rank engine's wait for one layer (a stop of its own process lasts 7 s at most)."""


def layer_rank_main(ctrl: Any, address: str, rank: int, tp_size: int, layout: KVLayout, slots: int, threaded: bool,
                    config: Any, slow_s: float = 0.0) -> None:
    """``adv_helpers.adv_rank_main`` plus ``("layers", load, slots)``: per layer, the engine's wait
    (``wait_layer``, bounded) then a snapshot of that layer at ``slots`` (``[(ok, raw), ...]``)."""
    torch.set_num_threads(1)
    if slow_s:
        adv._slow_copies(slow_s)
    kv = rank_kv(torch.zeros(layout.num_layers, slots, layout.rows, layout.head_dim, dtype=layout.dtype),
                     layout, rank, tp_size)

    def layer(at: list[int], i: int) -> Any:
        return adv._raw(kv[i, torch.as_tensor(at, dtype=torch.int64)])

    if threaded:
        with RankWorkerThread(address, rank, tp_size, layout, kv, config) as runner:
            ctrl.send(("started", os.getpid()))
            while True:
                command = ctrl.recv()
                if command[0] == "layers":
                    _, load, at = command
                    replies: Any = []
                    try:
                        for i in range(layout.num_layers):
                            replies.append((runner.wait_layer(load, i, LAYER_WAIT_S), layer(at, i)))
                    except TimeoutError:
                        replies = ("hang", len(replies))
                    ctrl.send(replies)
                    continue
                reply = adv._serve(command, kv, runner.statistics)
                if reply is None:
                    break
                ctrl.send(reply)
        ctrl.send(("stopped", runner.error))
        return

    async def main() -> None:
        async with RankWorker(address, rank, tp_size, layout, kv, config) as worker:
            await asyncio.to_thread(ctrl.send, ("started", os.getpid()))
            while True:
                command = await asyncio.to_thread(ctrl.recv)
                if command[0] == "layers":
                    _, load, at = command
                    replies: Any = []
                    try:
                        for i in range(layout.num_layers):
                            async with asyncio.timeout(LAYER_WAIT_S):
                                ok = await worker.wait_layer(load, i)
                            replies.append((ok, layer(at, i)))
                    except TimeoutError:
                        replies = ("hang", len(replies))
                    await asyncio.to_thread(ctrl.send, replies)
                    continue
                reply = adv._serve(command, kv, worker.statistics)
                if reply is None:
                    break
                await asyncio.to_thread(ctrl.send, reply)
        await asyncio.to_thread(ctrl.send, ("stopped", None))

    asyncio.run(main())


class LayerRanks(AdvRanks):
    """AdvRanks whose processes also answer ``("layers", load, slots)``."""

    def start(self, rank: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(  # type: ignore[attr-defined]
            target=layer_rank_main,
            args=(child, self.address, rank, self.tp_size, self.layout, self.slots, rank % 2 == 0, self.config,
                  self.slow_s),
            daemon=True,
        )
        proc.start()
        child.close()
        self.generation[rank] += 1
        self.ranks[rank] = adv.Rank(proc, parent, self.generation[rank])


async def rank_layers(ranks: AdvRanks, stream: Any, slots: Sequence[int], low: int, high: int,
                      gens: tuple[int, ...], hung: list[str]) -> dict[int, list[tuple[bool, Any]]]:
    """Each rank's engine waits on every layer of ``stream`` and reads that layer at ``slots[low:high]``
    right after its wait; per rank that lived through it, ``[(ready, raw layer), ...]``. A wait
    past :data:`LAYER_WAIT_S` goes to ``hung``."""
    load = stream.layered_load()
    out: dict[int, list[tuple[bool, Any]]] = {}

    async def one(rank: int) -> None:
        if ranks.generation[rank] != gens[rank]:
            return
        try:
            replies = await ranks.ask(rank, ("layers", load, list(slots[low:high])))
        except (RankGone, KeyError):
            return
        if ranks.generation[rank] != gens[rank]:
            return
        if replies[0] == "hang":
            hung.append(f"rank {rank}'s engine wait for layer {replies[1]} of {load} lasted {LAYER_WAIT_S} s")
        else:
            out[rank] = replies

    await asyncio.gather(*(one(r) for r in range(ranks.tp_size)))
    return out


def check_rank_layers(ranks: AdvRanks, seen: dict[int, list[tuple[bool, Any]]], tokens: Sequence[int],
                      salt: str | None, low: int, loaded_from: int, high: int, tally: adv.Tally) -> int:
    """A layer a rank's wait reported ready held, right then, the oracle's KV of every token the
    stream reports loaded (``[loaded_from, high)``; ``seen`` read ``[low, high)``). Returns the
    (rank, layer) pairs checked."""
    checked = 0
    for rank, replies in seen.items():
        want = adv.rank_prefix_kv(ranks.layout, tokens[:high], adv.SALTS[salt], rank, ranks.tp_size)
        for i, (ok, raw) in enumerate(replies):
            got = adv._tensor(raw, ranks.layout.dtype)[loaded_from - low:]  # [tokens, rows, D]
            checked += ok and loaded_from < high
            if ok and not torch.equal(got, want[i, loaded_from:high]):
                tally.wrong.append(f"rank {rank}'s wait_layer({i}) said ready, wrong KV in [{loaded_from}, {high}) "
                                   f"(prompt {list(tokens[:3])}.., gens -> {ranks.generations()})")
    return checked


@dataclasses.dataclass
class Faults:
    kills: int = 0
    stops: int = 0
    stop_kills: int = 0
    busy: int = 0
    severs: int = 0
    """Rank sockets shut down by a third party (the process lives on, unaware)."""
    start_stops: int = 0
    """Restarted ranks SIGSTOPped while they connect or attach."""
    report_cancels: int = 0
    """Client calls cancelled as a rank's report was read."""
    layer_checks: int = 0
    """(rank, layer) pairs a rank's engine wait reported ready and the oracle checked."""
    log: list[str] = dataclasses.field(default_factory=list)


class ChaosSoak(Soak):
    """The soak's clients against random kills and stops; loads also check their admission."""

    def __init__(self, cache: TPCache, ranks: AdvRanks, seed: int) -> None:
        super().__init__(cache, ranks, seed)
        self.faults = Faults()
        self.t0 = time.monotonic()
        self.closed_errors = 0

    def note(self, what: str) -> None:
        self.faults.log.append(f"{time.monotonic() - self.t0:7.3f} {what}")

    async def chaos_run(self, clients: int, kills: int, close_midway: bool = False) -> list[str]:
        """Clients against ``kills`` faults; ``close_midway``: then close the cache under the
        clients' traffic. Returns what the clients raised that a closing cache does not document."""
        tasks = [asyncio.create_task(self._client(self.seed * 1000 + i)) for i in range(clients)]
        raised: list[str] = []
        try:
            await self._killer(kills)
            if close_midway:
                await asyncio.sleep(self.rng.uniform(0.0, 0.3))
                self.note("close under traffic")
                async with asyncio.timeout(CALL_S):
                    await self.cache.aclose()
            else:
                self.target = self.tally.offloads + 20
                async with asyncio.timeout(CALL_S):
                    await self.enough.wait()
        finally:
            self.stop.set()
            async with asyncio.timeout(START_S):  # every request ends: no hang
                results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                # A call on a closed cache raises RuntimeError (documented); anything else is not.
                if close_midway and isinstance(result, RuntimeError) and "close" in str(result):
                    self.closed_errors += 1
                    continue
                raised.append("".join(traceback.format_exception(result)))
        return raised

    async def _killer(self, kills: int) -> None:
        rng, ranks, cache = self.rng, self.ranks, self.cache
        for _ in range(kills):
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            if rng.random() < 0.5:
                for _ in range(400):  # at times a moment with transfers in flight (bounded: 2 s)
                    if cache.group_statistics().jobs.in_flight:
                        self.faults.busy += 1
                        break
                    await asyncio.sleep(0.005)
            else:
                await asyncio.sleep(rng.uniform(0.0, 0.05))
            kind = rng.choice(["kill", "kill", "stop", "stop", "stopkill", "both", "stopboth", "sever", "sever"])
            victim = rng.randrange(ranks.tp_size)
            if kind == "sever":
                await self._sever(victim)
                continue
            if kind in ("stop", "stopboth"):
                stopped = list(range(ranks.tp_size)) if kind == "stopboth" else [victim]
                pids = [ranks.ranks[v].proc.pid for v in stopped]
                hold = rng.choice([rng.uniform(0.01, 0.2), rng.uniform(0.2, 1.5), rng.uniform(1.5, 3.0)])
                self.note(f"stop ranks {stopped} for {hold:.3f} s")
                try:
                    for pid in pids:
                        assert pid is not None
                        await stop_process(pid)
                    await asyncio.sleep(hold)
                    async with asyncio.timeout(3):  # the manager's loop still serves
                        match = await cache.match(list(range(90_000, 90_000 + 8 * self.t)))
                    match.release()
                finally:
                    for pid in pids:
                        assert pid is not None
                        os.kill(pid, signal.SIGCONT)
                self.faults.stops += 1
                continue
            victims = list(range(ranks.tp_size)) if kind == "both" else [victim]
            for v in victims:
                if kind == "stopkill":
                    pid = ranks.ranks[v].proc.pid
                    assert pid is not None
                    await stop_process(pid)
                    hold = rng.uniform(0.0, 1.0)
                    self.note(f"stop rank {v}, kill after {hold:.3f} s")
                    await asyncio.sleep(hold)
                    ranks.kill(v)
                    os.kill(pid, signal.SIGCONT)  # reaped at once
                    self.faults.stop_kills += 1
                else:
                    self.note(f"kill rank {v}")
                    ranks.kill(v)
                    self.faults.kills += 1
            async with asyncio.timeout(60):  # the group notices each death
                while set(victims) & cache.group.attached:
                    await cache.group.wait_change()
            await asyncio.sleep(rng.choice([0.0, rng.uniform(0.0, 0.5)]))  # traffic with a rank missing
            for v in victims:
                ranks.start(v)
            if rng.random() < 0.2:
                # Stopped while it starts (connecting, attaching or registering the pool), then on again.
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                v = victims[0]
                pid = ranks.ranks[v].proc.pid
                assert pid is not None
                hold = rng.uniform(0.05, 1.5)
                self.note(f"stop rank {v} while it starts for {hold:.3f} s")
                await stop_process(pid)
                await asyncio.sleep(hold)
                os.kill(pid, signal.SIGCONT)
                self.faults.start_stops += 1
            elif rng.random() < 0.3:
                # Killed again while it starts (connecting or attaching the pool).
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                v = victims[0]
                if v not in cache.group.attached:
                    self.note(f"kill rank {v} while it starts")
                    ranks.kill(v)
                    self.faults.kills += 1
                    async with asyncio.timeout(60):
                        while v in cache.group.attached:
                            await cache.group.wait_change()
                    ranks.start(v)
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            await ranks.reap_dead()

    async def _sever(self, victim: int) -> None:
        """A third party shuts rank ``victim``'s socket down; its process lives on (its buffer is
        still the engine's: every oracle still holds for it), drains and attaches again."""
        cache = self.cache
        pid = self.ranks.ranks[victim].proc.pid
        assert pid is not None
        for _ in range(400):  # mostly while it owes reports (bounded: 2 s)
            if victim in cache.group.jobs.owing_ranks():
                break
            await asyncio.sleep(0.005)
        session = cache.group.sessions()[victim]
        # At times stopped across the shutdown (a stall, a swap): the copy it runs lands a while
        # later, once the engine's clients may have reused what the manager handed back.
        stall = self.rng.choice([0.0, self.rng.uniform(0.05, 0.5)])
        if stall:
            await stop_process(pid)
        try:
            shut = sever_socket(pid, os.fspath(cache.address))
            self.note(f"sever rank {victim}'s socket (session {session}, {shut} shut, stopped {stall:.3f} s)")
            if shut:
                async with asyncio.timeout(60):  # the group notices
                    while cache.group.sessions()[victim] == session:
                        await cache.group.wait_change()
                await asyncio.sleep(stall)
        finally:
            if stall:
                os.kill(pid, signal.SIGCONT)
        if not shut:
            return  # between sessions
        self.faults.severs += 1
        # The prefix oracles miss a late copy that lands the bytes the engine wrote anyway; this
        # does not. In that order: copies of the ended session start nothing after the shutdown,
        # so one running now ran when the manager was asked, its report unsent (never sendable).
        owing = victim in cache.group.jobs.owing_ranks()
        with contextlib.suppress(RankGone):
            stats = await self.ranks.ask(victim, ("stats",))
            if not owing and not stats.attached and stats.in_flight:
                self.tally.wrong.append(f"rank {victim}'s socket shut down: the manager let go of its jobs while "
                                        f"it still ran {stats.in_flight} copies of them")
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()

    async def _load(self, tokens: list[int], salt: str | None, slots: list[int], match: Match,
                    rng: random.Random, gens: tuple[int, ...]) -> int:
        """The soak's load, plus: a call admitted with a rank missing loads nothing."""
        if not match.tokens:
            return 0
        cache, ranks, tally = self.cache, self.ranks, self.tally
        mode = rng.choice(["plain", "from", "stream", "layered"])
        first = rng.randrange(0, match.tokens + 1) if mode != "plain" else 0
        try:
            await prefill(ranks, tokens, salt, slots, 0, first)
            if mode in ("plain", "from"):
                tally.loads += 1

                async def load() -> tuple[tuple[int, ...], Any]:
                    sessions = cache.group.sessions()  # what the call is admitted with (no await between)
                    return sessions, await cache.load(match, idx(slots[first:match.tokens]), from_token=first)

                sessions, result = await adv.maybe_cancelled(rng, load(), tally)
                assert result.tokens <= match.tokens
                if 0 in sessions and result.tokens > first:
                    tally.wrong.append(f"{mode}: admitted with sessions {sessions}, loaded [{first}, "
                                       f"{result.tokens}) (a hit a missing rank lacks)")
                if not result.tokens:
                    return 0
                tally.loaded_tokens += result.tokens - first
                await check_slots(ranks, tokens, salt, slots, first, result.tokens, gens, tally, mode)
                return int(result.tokens)
            tally.streams += 1
            sessions = cache.group.sessions()
            async with cache.start_load(match, idx(slots[first:match.tokens]), from_token=first,
                                        layered=mode == "layered") as stream:
                seen: dict[int, list[tuple[bool, Any]]] = {}
                if mode == "layered" and isinstance(ranks, LayerRanks) and rng.random() < 0.5:
                    # Nothing claimed: each rank's engine waits on every layer (as before its
                    # attention) and reads it; checked against what finish() reports loaded.
                    claimed = stream.claim(first)
                    async with asyncio.timeout(CALL_S):
                        await stream.launched()
                    seen = await rank_layers(ranks, stream, slots, first, match.tokens, gens, tally.wrong)
                else:
                    claimed = stream.claim(rng.randrange(first, match.tokens + 1))
                await prefill(ranks, tokens, salt, slots, first, claimed)
                if mode == "layered" and rng.random() < 0.5:
                    async with asyncio.timeout(CALL_S):
                        await stream.launched()
                        for layer in range(ranks.layout.num_layers):
                            await stream.wait_layer(layer)
                res = await adv.maybe_cancelled(rng, stream.finish(), tally)
            assert claimed <= res.claimed <= res.loaded_from <= match.tokens, res
            self.faults.layer_checks += check_rank_layers(ranks, seen, tokens, salt, first, res.loaded_from,
                                                          match.tokens, tally)
            if 0 in sessions and res.loaded_tokens:
                tally.wrong.append(f"{mode}: admitted with sessions {sessions}, loaded "
                                   f"[{res.loaded_from}, {match.tokens}) (a hit a missing rank lacks)")
            await check_slots(ranks, tokens, salt, slots, res.loaded_from, match.tokens, gens, tally, mode)
            tally.loaded_tokens += res.loaded_tokens
            await prefill(ranks, tokens, salt, slots, res.claimed, res.loaded_from)
            return match.tokens
        except asyncio.CancelledError:
            return -1


def own_segments() -> set[str]:
    """This process's pool segments in /dev/shm (names carry the creator's pid)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"aiokv-{os.getpid()}-")}


async def close_with_fault(cache: TPCache, ranks: AdvRanks, rng: random.Random, soak: ChaosSoak,
                           fault: str) -> None:
    """Close the cache, at times with a rank stopped (continued later: briefly, or past the close's
    fence), killed during the close, stopped then killed, restarted and stopped mid-attach, or with
    its socket shut down by a third party (the process lives on)."""
    if fault == "none":
        async with asyncio.timeout(CALL_S):
            await cache.aclose()
        return
    victim = rng.randrange(ranks.tp_size)
    if fault == "attach":
        # A fresh process stopped while it connects or attaches: the close must not wait for it.
        ranks.kill(victim)
        await ranks.reap_dead()
        ranks.start(victim)
        await asyncio.sleep(rng.uniform(0.0, 0.3))
    pid = ranks.ranks[victim].proc.pid
    assert pid is not None
    address = os.fspath(cache.address)
    closing = asyncio.ensure_future(cache.aclose())
    await asyncio.sleep(rng.uniform(0.0, 0.05))
    if fault == "sever":
        soak.note(f"sever rank {victim}'s socket during the close")
        sever_socket(pid, address)
    elif fault in ("stop", "stop_long", "attach", "stop_kill"):
        hold = {"stop": rng.uniform(0.0, 1.0), "stop_long": rng.uniform(5.5, 7.0), "attach": rng.uniform(0.5, 2.0),
                "stop_kill": rng.uniform(0.0, 2.0)}[fault]
        soak.note(f"{fault}: stop rank {victim} during the close for {hold:.3f} s")
        await stop_process(pid)
        await asyncio.sleep(hold)
        if fault == "stop_kill":
            ranks.kill(victim)
        os.kill(pid, signal.SIGCONT)
    else:
        soak.note(f"kill rank {victim} during the close")
        ranks.kill(victim)
    async with asyncio.timeout(CALL_S):
        await closing
    if victim not in ranks.ranks:
        await ranks.reap_dead()
        ranks.start(victim)


async def after_traffic(cache: TPCache, ranks: AdvRanks, rng: random.Random, soak: ChaosSoak,
                        failures: list[str]) -> None:
    """Traffic ended with every rank back: every document loads bit-exact, nothing is left held;
    then the close, at times with a fault."""
    await soak.verify_docs()
    await cache.flush()
    stats, group = cache.stats(), cache.group_statistics()
    if stats.pool_reserved or stats.pool_referenced:
        failures.append(f"references left: {stats}")
    if group.jobs.in_flight or group.waiting:
        failures.append(f"jobs left: {group}")
    cache.pool.table.check_invariants()
    fault = rng.choice(["none", "none", "stop", "stop_long", "kill", "stop_kill", "attach", "sever"])
    await close_with_fault(cache, ranks, rng, soak, fault)


_SEEDS_RUN = [0]


def _fds() -> set[str]:
    """This process's open file descriptors, each as its target (numbers are reused)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return out


async def _threads_left(before: set[str]) -> set[str]:
    """aiokv threads still running once the caches closed (idle pool threads get a bounded moment)."""
    for _ in range(500):
        left = adv.aiokv_threads() - before
        if not left:
            return left
        await asyncio.sleep(0.01)
    return left


@dataclasses.dataclass
class SeedResult:
    seed: int
    failures: list[str]
    """Empty: every oracle held."""
    tally: adv.Tally | None
    faults: Faults | None


async def one_seed(seed: int, faults: int, clients: int, verbose: bool = False) -> SeedResult:
    """Run one seed on the running loop (its exception handler is replaced meanwhile)."""
    loop = asyncio.get_running_loop()
    escaped: list[str] = []
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        escaped.append(f"{context.get('message')}: {context.get('exception')!r}")

    loop.set_exception_handler(handler)
    try:
        return await _one_seed(seed, faults, clients, verbose, escaped)
    finally:
        loop.set_exception_handler(previous)


async def _one_seed(seed: int, faults: int, clients: int, verbose: bool, escaped: list[str]) -> SeedResult:
    rng = random.Random(seed ^ 0xC4A05)
    failures: list[str] = []
    before = own_segments()
    threads_before = adv.aiokv_threads()
    fds_before = _fds()
    with tempfile.TemporaryDirectory(prefix="aiokv-chaos-") as tmp:
        disk, sock = Path(tmp) / "disk", Path(tmp) / "sock"
        layout = LAYOUTS[rng.choice(list(LAYOUTS))]
        cache = TPCache(cache_config(layout, disk, rng.choice([16, 40])), layout, tp_size=2, num_slots=NUM_SLOTS,
                        tp_config=dataclasses.replace(CONFIG, max_jobs=rng.choice([1, 6, 64])), directory=sock)
        ranks: AdvRanks | None = None
        soak: ChaosSoak | None = None
        try:
            await cache.start()
            # Copies on the ranks' copy threads, slowed at times, or inline on their loops (small ones).
            # At times a rank reads one spec at a time (the rest wait in its socket: paused reading).
            rank_config = dataclasses.replace(rng.choice([RANK_CONFIG, CONFIG]),
                                              worker_max_inflight=rng.choice([1, 2, 256]))
            ranks = LayerRanks(cache.address, layout, 2, NUM_SLOTS, rank_config, slow_s=rng.choice([0.0, 0.02, 0.05]))
            ranks.start_all()
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            soak = ChaosSoak(cache, ranks, seed)
            cancel_on_reports(cache, random.Random(seed ^ 0x5E9), soak.faults)
            close_midway = rng.random() < 0.25
            failures.extend(f"a client raised: {e}" for e in await soak.chaos_run(clients, faults, close_midway))
            if close_midway:
                if cache.pool.table.statistics().reserved:
                    failures.append("reservations left after the close")
            else:
                await after_traffic(cache, ranks, rng, soak, failures)
            # A new cache on the same directories: the live ranks re-attach, disk pages serve.
            async with TPCache(cache_config(layout, disk), layout, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                               directory=sock) as again:
                async with asyncio.timeout(START_S):
                    await again.wait_ranks()
                soak.cache = again
                before_final = soak.tally.verified_tokens
                await soak.verify_docs()
                if soak.tally.verified_tokens == before_final:
                    failures.append("the new cache served nothing from disk")
                await ranks.stop_all()
        except Exception:
            failures.append("raised:\n" + traceback.format_exc())
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CALL_S):
                    await cache.aclose()
            if ranks is not None:
                with contextlib.suppress(Exception):
                    await ranks.continue_and_kill_all()
    if soak is not None:
        failures.extend(soak.tally.wrong[:20])
        if verbose or failures:
            print(f"seed {seed}: {soak.tally}\n  faults {dataclasses.replace(soak.faults, log=[])}")
            for line in soak.faults.log:
                print("   ", line)
    left = own_segments() - before
    threads = await _threads_left(threads_before)
    if threads:
        failures.append(f"threads left after the close: {sorted(threads)}")
    fds = _fds() - fds_before
    if fds and _SEEDS_RUN[0]:  # the first seed starts the fork server and resource tracker (for good)
        failures.append(f"file descriptors left open: {sorted(fds)}")
    _SEEDS_RUN[0] += 1
    if left:
        failures.append(f"segments left in /dev/shm: {sorted(left)}")
    failures.extend(f"escaped into the loop: {e}" for e in escaped)
    return SeedResult(seed, failures, soak.tally if soak else None, soak.faults if soak else None)


# -- the manager killed at random moments -------------------------------------------------------------

MGR_LAYOUT = LAYOUTS["mha"]
MGR_PROMPTS = 24
MGR_PAGES = 4


def _mgr_prompt(i: int) -> list[int]:
    return [7000 * (i + 1) + j for j in range(MGR_PAGES * MGR_LAYOUT.page_tokens)]


def _mgr_slots(i: int) -> list[int]:
    n = MGR_PAGES * MGR_LAYOUT.page_tokens
    return list(range(i * n, (i + 1) * n))


def _mgr_config(disk: Path) -> CacheConfig:
    # 40 pool pages for 96 pages of prompts: offloads evict to disk while the manager dies.
    return cache_config(MGR_LAYOUT, disk, 40)


def manager_main(ctrl: Any, disk: str, sock: str, seed: int) -> None:
    """A scheduler process: sends ``("address", path, pool)``, waits for its ranks and the driver's
    ``"go"`` (the ranks hold the prompts' KV), then offloads the prompts in a random order, flushing
    at times, and loads random ones into the upper slots, until it is killed."""
    torch.set_num_threads(1)
    rng = random.Random(seed)

    async def main() -> None:
        async with TPCache(_mgr_config(Path(disk)), MGR_LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                           directory=sock) as cache:
            ctrl.send(("address", cache.address, cache.pool.name))
            await cache.wait_ranks()
            assert ctrl.recv() == "go"  # the ranks hold the prompts' KV (prefilled by the driver)
            upper = MGR_PROMPTS * MGR_PAGES * MGR_LAYOUT.page_tokens
            while True:
                i = rng.randrange(MGR_PROMPTS)
                if rng.random() < 0.6:
                    await cache.offload(_mgr_prompt(i), idx(_mgr_slots(i)))
                    if rng.random() < 0.2:
                        await cache.flush()
                else:
                    match = await cache.match(_mgr_prompt(i))
                    n = match.tokens
                    await cache.load(match, idx(range(upper, upper + n)))

    asyncio.run(main())


async def manager_seed(seed: int, kills: int, verbose: bool = False) -> SeedResult:
    """``kills`` managers in turn (child processes) SIGKILLed at random moments over the same socket and
    disk directories, the same live ranks re-attaching to each; then one here serves every prompt:
    what it loads is bit-exact on both ranks, and the ranks map only its pool."""
    rng = random.Random(seed ^ 0x3A9A)
    early = random.Random(seed ^ 0xEA71)  # kills as the ranks attach (apart: rng's draws as before)
    early_kills = 0
    failures: list[str] = []
    tally = adv.Tally()
    ctx = fork_context()
    ranks: AdvRanks | None = None
    before = own_segments()
    managers: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="aiokv-chaos-mgr-") as tmp:
        disk, sock = Path(tmp) / "disk", Path(tmp) / "sock"
        stopped: int | None = None
        try:
            for k in range(kills):
                parent, child = ctx.Pipe()
                manager = ctx.Process(  # type: ignore[attr-defined]
                    target=manager_main, args=(child, os.fspath(disk), os.fspath(sock), seed * 100 + k), daemon=True)
                manager.start()
                managers.append(manager)
                child.close()
                async with asyncio.timeout(START_S):
                    kind, address, _ = await asyncio.to_thread(parent.recv)
                assert kind == "address"
                if ranks is None:
                    ranks = AdvRanks(address, MGR_LAYOUT, 2, NUM_SLOTS, rng.choice([RANK_CONFIG, CONFIG]),
                                     slow_s=rng.choice([0.0, 0.02]))
                    ranks.start_all()
                    for i in range(MGR_PROMPTS):
                        for rank in range(2):
                            await ranks.write(rank, _mgr_slots(i),
                                              adv.rank_prefix_kv(MGR_LAYOUT, _mgr_prompt(i), 0, rank, 2))
                if k and early.random() < 0.3:
                    # Killed while the live ranks attach its pool (before any traffic): they must
                    # let go of it and attach the next one.
                    await asyncio.sleep(early.uniform(0.0, 0.2))
                    assert manager.pid is not None
                    os.kill(manager.pid, signal.SIGKILL)
                    await asyncio.to_thread(manager.join, 30)
                    parent.close()
                    early_kills += 1
                    continue
                parent.send("go")
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                if rng.random() < 0.3:
                    # The manager stopped a while (its ranks wait; nothing times out), then on again.
                    assert manager.pid is not None
                    await stop_process(manager.pid)
                    await asyncio.sleep(rng.uniform(0.1, 2.0))
                    os.kill(manager.pid, signal.SIGCONT)
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                if stopped is None and rng.random() < 0.3:
                    # A rank stopped (mid-copy, maybe) when its manager dies, continued once a later
                    # manager runs: it finishes into the dead pool and must re-attach cleanly.
                    stopped = ranks.ranks[rng.randrange(2)].proc.pid
                    assert stopped is not None
                    await stop_process(stopped)
                assert manager.pid is not None
                os.kill(manager.pid, signal.SIGKILL)
                await asyncio.to_thread(manager.join, 30)
                parent.close()
                if stopped is not None and rng.random() < 0.5:
                    os.kill(stopped, signal.SIGCONT)
                    stopped = None
            assert ranks is not None
            async with TPCache(_mgr_config(disk), MGR_LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                               directory=sock) as cache:
                if stopped is not None:
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                    os.kill(stopped, signal.SIGCONT)
                    stopped = None
                async with asyncio.timeout(START_S):
                    await cache.wait_ranks()
                for rank in range(2):
                    maps = await ranks.ask(rank, ("maps",))
                    if maps != {cache.pool.name}:
                        failures.append(f"rank {rank} maps {sorted(maps)}, not only the new pool {cache.pool.name}")
                gens = ranks.generations()
                top = NUM_SLOTS - MGR_PAGES * MGR_LAYOUT.page_tokens
                for i in range(MGR_PROMPTS):
                    async with asyncio.timeout(CALL_S):
                        match = await cache.match(_mgr_prompt(i))
                        slots = list(range(top, top + match.tokens))
                        result = await cache.load(match, idx(slots))
                    tally.loaded_tokens += result.tokens
                    await check_slots(ranks, _mgr_prompt(i), None, slots, 0, result.tokens, gens, tally,
                                      f"prompt {i} after {kills} manager kills ({match}, {result})")
                await ranks.stop_all()
        except Exception:
            failures.append("raised:\n" + traceback.format_exc())
        finally:
            for manager in managers:
                if manager.is_alive():
                    os.kill(manager.pid, signal.SIGKILL)
                    await asyncio.to_thread(manager.join, 30)
            if ranks is not None:
                with contextlib.suppress(Exception):
                    await ranks.continue_and_kill_all()
    failures.extend(tally.wrong[:20])
    if verbose or failures:
        print(f"manager seed {seed}: {tally}, {early_kills} managers killed as the ranks attached")
    left = own_segments() - before
    # The killed managers' pools: their ranks let go of them (and reclaim them) as they re-attach.
    left |= {name for name in os.listdir("/dev/shm") for m in managers if name.startswith(f"aiokv-{m.pid}-")}
    if left:
        failures.append(f"segments left in /dev/shm: {sorted(left)}")
    return SeedResult(seed, failures, tally, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="run seeds 0..N-1")
    parser.add_argument("--first", type=int, default=0, help="first seed of --seeds")
    parser.add_argument("--seed-list", type=int, nargs="*", help="run exactly these seeds")
    parser.add_argument("--faults", type=int, default=4, help="faults per seed")
    parser.add_argument("--clients", type=int, default=10, help="request loops per seed")
    parser.add_argument("--manager-kills", type=int, default=0,
                        help="instead: kill this many managers in turn per seed (then verify with a new one)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = args.seed_list if args.seed_list else list(range(args.first, args.first + args.seeds))
    failed = 0
    for seed in seeds:
        start = time.monotonic()
        if args.manager_kills:
            failures = asyncio.run(manager_seed(seed, args.manager_kills, args.verbose)).failures
        else:
            failures = asyncio.run(one_seed(seed, args.faults, args.clients, args.verbose)).failures
        status = "ok" if not failures else "FAILED"
        print(f"seed {seed}: {status} ({time.monotonic() - start:.1f} s)", flush=True)
        for f in failures:
            print(f"  seed {seed}: {f}", flush=True)
        failed += bool(failures)
    print(f"{len(seeds) - failed}/{len(seeds)} seeds held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
