"""Adversarial (review 293): malformed calls to a running ``TPCache`` and to its rank workers' API,
drawn by Hypothesis: the cache's token ids, salts, host slots, ``from_token``, ``layered``, match
handles (consumed, another cache's, not a match), ``estimate``/``note_prefill``, an open stream's
``claim``/``wait_front``/``wait_layer``/``order_layer``; the ranks' ``begin_stream``,
``wait_layer`` (on the worker's loop and blocking), and ``RankWorkerThread``'s timeouts
(``wait_attached``, ``wait_warm``, ``wait_layer``, ``close``). ``tests/cache`` fuzzes
``KVCache``'s calls; the TP side had a few fixed cases only.

Each drawn call must raise ``TypeError``/``ValueError`` whose message names the argument, and
change nothing: the statistics, the page table, the rank group's and every worker's statistics,
every rank's KV buffer, the held match (still held), the open stream (its result at the end is the
full, bit-exact load), and the workers (attached, their threads running). Afterwards a valid load
serves bit-exact bytes on every rank, and calls after ``aclose`` raise ``RuntimeError``.

Before the fix: ``RankWorkerThread.close(timeout="1")`` stopped the worker, then raised
``Thread.join``'s ``TypeError`` naming nothing; a NaN one stopped it and raised ``ValueError``
("Invalid value NaN"); ``wait_attached``/``wait_warm`` queued their wait on the worker's loop, then
raised ``TypeError`` naming nothing for a string timeout, and ``TimeoutError`` at once for a NaN
or negative one (``wait_warm(nan)`` returned instead); ``wait_layer`` took a NaN or negative one
as 0.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loop_probes import until_thread
from tp_helpers import CONFIG, full_kv, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVCache, KVLayout, Match
from aiokv.tp import RankWorkerThread, TPCache, TPLoadStream

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
PAGES = 4
N = PAGES * T
SLOTS = 96
TP = 2
EXAMPLES = 10
CALLS_PER_EXAMPLE = 60
_namespaces = itertools.count()


def _config() -> CacheConfig:
    return CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace=f"tp-rev293-{next(_namespaces)}",
                       pool_chunk_bytes=8 * LAYOUT.page_bytes)


# -- bad values -------------------------------------------------------------------------------------


def _bad_token_element() -> st.SearchStrategy[object]:
    return st.one_of(
        st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2), st.integers(max_value=-1),
        st.integers(min_value=2**63, max_value=2**80), st.just(np.float64(1.0)), st.just(np.uint64(2**63)),
        st.just([1]), st.just(b"1"),
    )


@st.composite
def bad_tokens(draw: st.DrawFn) -> object:
    kind = draw(st.integers(0, 5))
    if kind == 0:  # a list or tuple with one bad element somewhere
        values: list[object] = draw(st.lists(st.integers(0, 2**63 - 1), max_size=10))
        values.insert(draw(st.integers(0, len(values))), draw(_bad_token_element()))
        return tuple(values) if draw(st.booleans()) else values
    if kind == 1:
        dtype = draw(st.sampled_from([np.float32, np.float64, np.bool_, object]))
        return np.zeros(draw(st.integers(0, 9)), dtype=dtype)
    if kind == 2:
        dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.bool, torch.complex64]))
        return torch.zeros(draw(st.integers(0, 9))).to(dtype)
    if kind == 3:  # integers, but negative or not 1-D
        return draw(st.sampled_from([torch.full((8,), -1), np.full(8, -3, dtype=np.int32),
                                     torch.zeros(2, 4, dtype=torch.long), np.zeros((), dtype=np.int64),
                                     torch.full((4,), 2**63, dtype=torch.uint64), torch.arange(8).to_sparse()]))
    if kind == 4:
        return draw(st.sampled_from([range(8), {1, 2}, {1: 2}, "12345678", b"\x00" * 8, bytearray(8), 7, None,
                                     np.int64(3), iter([1, 2])]))
    return [True] * draw(st.integers(1, 9))


def bad_salts() -> st.SearchStrategy[object]:
    return st.one_of(st.integers(), st.floats(), st.booleans(), st.lists(st.integers(), max_size=2),
                     st.just(bytearray(b"s")), st.just(object()), st.text(max_size=3).map(lambda text: text + "\ud800"))


@st.composite
def bad_slots(draw: st.DrawFn, count: int) -> object:
    """Host slots that a call needing ``count`` of them must refuse."""
    base = torch.arange(SLOTS - count, SLOTS)
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return draw(st.sampled_from([None, base.tolist(), tuple(base.tolist()), base.numpy(), 3]))
    if kind == 1:
        dtype = draw(st.sampled_from([torch.int8, torch.uint8, torch.float32, torch.float64, torch.bool]))
        return base.to(dtype)
    if kind == 2:
        return draw(st.sampled_from([base.view(1, -1), base.view(-1, 1), torch.tensor(5)]))
    if kind == 3:  # too short or too long
        return torch.arange(count + draw(st.sampled_from([-count, -1, 1, 5])))
    if kind == 4:  # negative or out of range, somewhere
        bad = base.clone()
        bad[draw(st.integers(0, count - 1))] = draw(st.sampled_from([-1, -(2**63), SLOTS, SLOTS + 7, 2**63 - 1]))
        return bad if draw(st.booleans()) else bad.clamp(-(2**31), 2**31 - 1).to(torch.int32)  # still bad
    if kind == 5:  # a duplicate, written or by a stride-0 view
        if draw(st.booleans()):
            return base[:1].expand(count)
        bad = base.clone()
        i, j = draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
        bad[i] = bad[j]
        return bad
    if kind == 6:
        return draw(st.sampled_from([base.to_sparse(), base.to("meta")]))
    return base.float().requires_grad_()


def _bad_ints(low: int, high: int) -> st.SearchStrategy[object]:
    """Values an int argument in ``[low, high]`` must refuse."""
    return st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high + 1), st.just(10**400),
                     st.sampled_from([None, 1.0, True, "0", np.int64(low), torch.tensor(low)]),
                     st.floats(allow_nan=True))


def bad_timeouts() -> st.SearchStrategy[object]:
    return st.one_of(st.floats(max_value=-1e-9), st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                     st.floats(min_value=threading.TIMEOUT_MAX * 2, allow_infinity=False),
                     st.integers(max_value=-1), st.just(10**400),
                     st.sampled_from(["1", b"1", True, False, [1.0], np.int64(1), torch.tensor(1.0), object()]))


# -- the check ---------------------------------------------------------------------------------------


class Rig:
    """The running cache, its rank workers (threads of this process) and what must not change."""

    def __init__(self, cache: TPCache, other: KVCache, workers: Sequence[RankWorkerThread],
                 kv: Sequence[torch.Tensor]) -> None:
        self.cache, self.other, self.workers, self.kv = cache, other, workers, kv

    async def state(self) -> tuple[object, ...]:
        cache = self.cache
        cache.pool.table.check_invariants()
        s = cache.stats()
        group = cache.group_statistics()
        workers = [await asyncio.to_thread(worker.statistics) for worker in self.workers]
        return (s.lookups, dict(s.hit_tokens), s.miss_tokens, dict(s.loaded_tokens), dict(s.bytes_moved),
                s.pages_stored, s.pages_skipped, s.pages_dropped, s.pool_free, s.pool_reserved, s.pool_ready,
                s.pool_referenced, s.write_behind_queue, dict(s.errors), cache.pool.table.statistics(),
                group.attached, group.connections, group.jobs, group.waiting, group.fenced, *workers)

    async def refused(self, what: str, names: tuple[str, ...], call: Callable[[], Any],
                      held: Sequence[Match] = (), thread: bool = False) -> None:
        """``call()`` (awaited if a coroutine; in a thread when ``thread``, for blocking calls) raises
        TypeError/ValueError naming one of ``names``, and nothing changed."""
        before, kv_before = await self.state(), [kv.clone() for kv in self.kv]
        try:
            outcome = await asyncio.to_thread(call) if thread else call()
            if inspect.isawaitable(outcome):
                outcome = await outcome
        except (TypeError, ValueError) as exc:
            refusal = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # what the contract forbids, reported as such
            raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), not TypeError/ValueError") from exc
        else:
            if isinstance(outcome, TPLoadStream):
                await outcome.aclose()
            raise AssertionError(f"{what}: accepted ({outcome!r:.80})")
        assert any(name in refusal for name in names), f"{what}: names none of {names}: {refusal}"
        for worker in self.workers:
            assert worker.worker.attached and worker._thread.is_alive(), f"{what}: refused, but a worker stopped"
        assert await self.state() == before, f"{what}: refused, but the cache or a worker changed"
        for rank, (kv, old) in enumerate(zip(self.kv, kv_before, strict=True)):
            assert torch.equal(kv, old), f"{what}: refused, but rank {rank}'s KV buffer changed"
        for match in held:
            assert not match.released, f"{what}: refused, but {match!r} was consumed"


async def _bad_call(rig: Rig, data: st.DataObject, tokens: list[int], held: Match, stream: TPLoadStream,
                    spent: Match, foreign: Match) -> None:
    """One drawn bad call. ``held``: a match of the pool pages, ``stream``: an open layered stream
    (launched, every layer in), ``spent``: the match it consumed, ``foreign``: another cache's."""
    cache = rig.cache
    entry = data.draw(st.sampled_from(["load", "start_load", "from_token", "layered", "handle", "tokens", "salt",
                                       "offload_slots", "estimate", "note_prefill", "stream", "begin_stream",
                                       "worker_wait_layer", "thread_wait_layer", "timeout"]), label="entry")
    free = torch.arange(SLOTS - N, SLOTS)  # slots no prompt lives in
    refused = functools.partial(rig.refused, held=[held])
    if entry in ("load", "start_load"):
        slots = data.draw(bad_slots(N), label="slots")
        call = cache.load if entry == "load" else cache.start_load
        await refused(f"{entry}(slots={slots!r:.80})", ("slots",), functools.partial(call, held, slots))
    elif entry == "from_token":
        start = data.draw(_bad_ints(0, N), label="from_token")
        call = data.draw(st.sampled_from([cache.load, cache.start_load]), label="call")
        await refused(f"{call.__name__}(from_token={start!r})", ("from_token",),
                      functools.partial(call, held, free, from_token=start))
    elif entry == "layered":
        layered = data.draw(st.sampled_from([0, 1, None, "yes", np.bool_(True), torch.tensor(True)]), label="layered")
        await refused(f"start_load(layered={layered!r})", ("layered",),
                      functools.partial(cache.start_load, held, free, layered=layered))
    elif entry == "handle":
        handle, names = data.draw(st.sampled_from([
            (spent, ("already loaded or released",)), (foreign, ("another",)), (None, ("match",)),
            ("m", ("match",)), (3, ("match",)), (stream, ("match",))]), label="handle")
        name = data.draw(st.sampled_from(["load", "start_load", "estimate"]), label="call")
        calls = {"load": functools.partial(cache.load, handle, free),
                 "estimate": functools.partial(cache.estimate, handle),
                 "start_load": functools.partial(cache.start_load, handle, free)}
        await refused(f"{name}({handle!r:.60})", names, calls[name])
        assert not foreign.released
    elif entry == "tokens":
        bad = data.draw(bad_tokens(), label="tokens")
        name = data.draw(st.sampled_from(["offload", "match", "prefetch", "keys"]), label="call")
        calls = {"offload": functools.partial(cache.offload, bad, free[:8]),
                 "match": functools.partial(cache.match, bad),
                 "prefetch": functools.partial(cache.prefetch, bad), "keys": functools.partial(cache.keys, bad)}
        await refused(f"{name}({bad!r:.80})", ("token ids",), calls[name])
    elif entry == "salt":
        salt = data.draw(bad_salts(), label="salt")
        name = data.draw(st.sampled_from(["offload", "match", "prefetch", "keys"]), label="call")
        calls = {"offload": functools.partial(cache.offload, tokens, free, salt=salt),
                 "match": functools.partial(cache.match, tokens, salt=salt),
                 "prefetch": functools.partial(cache.prefetch, tokens, salt=salt),
                 "keys": functools.partial(cache.keys, tokens, salt)}
        await refused(f"{name}(salt={salt!r})", ("salt",), calls[name])
    elif entry == "offload_slots":
        slots = data.draw(bad_slots(N), label="slots")
        await refused(f"offload(slots={slots!r:.80})", ("slots",), functools.partial(cache.offload, tokens, slots))
    elif entry == "estimate":
        bad = data.draw(st.sampled_from([None, 3, "m", N, object()]), label="estimate")
        await refused(f"estimate({bad!r})", ("match",), functools.partial(cache.estimate, bad))
    elif entry == "note_prefill":
        args = data.draw(st.sampled_from([(0, 1.0), (-1, 1.0), (10, 0), (10, -1.0), (10, math.nan), (10, math.inf),
                                          (1.5, 1.0), (True, 1.0), (10, "1"), (10, 1.0, -1), (10, 1.0, 1.5),
                                          (10, 1.0, True), (10, 1.0, 2**53 + 1)]), label="note_prefill")
        await refused(f"note_prefill{args}", ("tokens", "seconds", "prefix"),
                      functools.partial(cache.note_prefill, *args))
    elif entry == "stream":
        name = data.draw(st.sampled_from(["claim", "wait_front", "wait_layer", "order_layer"]), label="stream call")
        if name == "claim":
            value = data.draw(st.sampled_from([None, 1.5, True, "4", np.int64(4), torch.tensor(4)]), label="end")
            names: tuple[str, ...] = ("end",)
        elif name == "wait_front":
            value = data.draw(_bad_ints(stream.from_token, stream.tokens), label="token")
            names = ("token",)
        else:
            value = data.draw(_bad_ints(0, LAYOUT.num_layers - 1), label="layer")
            names = ("layer",)
        await refused(f"stream.{name}({value!r})", names, functools.partial(getattr(stream, name), value))
    elif entry == "begin_stream":
        worker = data.draw(st.sampled_from(rig.workers), label="worker")
        epoch = (await asyncio.to_thread(worker.statistics)).epoch
        which = data.draw(st.booleans(), label="bad stream_id")
        bad = data.draw(_bad_ints(0 if which else 1, 2**64 - 1), label="value")
        args = (bad, epoch) if which else (stream.stream_id, bad)
        await refused(f"begin_stream{args!r}", ("stream_id",) if which else ("epoch",),
                      functools.partial(worker.begin_stream, *args))
    elif entry in ("worker_wait_layer", "thread_wait_layer"):
        worker = data.draw(st.sampled_from(rig.workers), label="worker")
        if data.draw(st.booleans(), label="bad load"):
            load = data.draw(st.sampled_from([None, stream, stream.stream_id, held, (stream.epoch, 1)]), label="load")
            layer: object = 0
            names = ("load",)
        else:
            load, layer = stream.layered_load(), data.draw(_bad_ints(0, LAYOUT.num_layers - 1), label="layer")
            names = ("layer",)
        if entry == "worker_wait_layer":  # RankWorker.wait_layer runs on the worker's loop
            async def on_worker_loop() -> bool:
                return await worker.worker.wait_layer(load, layer)  # type: ignore[arg-type]

            assert worker._loop is not None
            await refused(f"RankWorker.wait_layer({load!r:.40}, {layer!r})", names, lambda: asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(on_worker_loop(), worker._loop)))  # type: ignore[arg-type]
        else:
            await refused(f"RankWorkerThread.wait_layer({load!r:.40}, {layer!r})", names,
                          functools.partial(worker.wait_layer, load, layer, 5.0), thread=True)
    else:
        worker = data.draw(st.sampled_from(rig.workers), label="worker")
        timeout = data.draw(bad_timeouts(), label="timeout")
        name = data.draw(st.sampled_from(["wait_attached", "wait_warm", "wait_layer", "close"]), label="call")
        call = (functools.partial(worker.wait_layer, stream.layered_load(), 0, timeout) if name == "wait_layer"
                else functools.partial(getattr(worker, name), timeout))
        await refused(f"RankWorkerThread.{name}(timeout={timeout!r:.40})", ("timeout",), call, thread=True)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
@pytest.mark.asyncio
async def test_bad_calls_to_a_tp_cache_and_its_ranks_are_refused_by_name_and_change_nothing(
        data: st.DataObject) -> None:
    full = full_kv(LAYOUT, 29, SLOTS)
    kv = [rank_kv(full, LAYOUT, rank, TP) for rank in range(TP)]
    original = [k.clone() for k in kv]
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + N)) for i in range(2)]  # at slots [i*N, (i+1)*N)
    cache = TPCache(_config(), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG)
    async with cache, KVCache(_config(), LAYOUT, full_kv(LAYOUT, 30, SLOTS)) as other:
        workers = [RankWorkerThread(cache.address, rank, TP, LAYOUT, kv[rank], CONFIG) for rank in range(TP)]
        async with threads_off_loop(*workers):
            async with asyncio.timeout(30):
                await cache.wait_ranks()
            for i, tokens in enumerate(prompts):
                assert (await cache.offload(tokens, torch.arange(i * N, (i + 1) * N))).stored == PAGES
            await other.offload(prompts[0], torch.arange(N))
            held = await cache.match(prompts[0])
            spent = await cache.match(prompts[1])
            foreign = await other.match(prompts[0])
            assert held.tokens == spent.tokens == foreign.tokens == N
            target = torch.arange(2 * N, 3 * N)
            stream = cache.start_load(spent, target, layered=True)
            try:
                async with asyncio.timeout(30):
                    await stream.launched()
                    for layer in range(LAYOUT.num_layers):
                        assert await stream.wait_layer(layer)
                # The stream gives its pages back as its copies' reports come in: settled before the
                # first "before" of the calls.
                await until_thread(lambda: cache.stats().pool_referenced == held.pool_pages, "the stream's pages back")
                rig = Rig(cache, other, workers, kv)
                for _ in range(CALLS_PER_EXAMPLE):
                    await _bad_call(rig, data, prompts[0], held, stream, spent, foreign)
                result = await stream.finish()
                assert result.loaded_from == 0 and result.loaded_tokens == N
                got = await cache.load(held, torch.arange(3 * N, 4 * N))  # a valid call afterwards
                assert got.tokens == N
                for rank in range(TP):
                    assert torch.equal(kv[rank][:, 2 * N : 3 * N], original[rank][:, N : 2 * N])
                    assert torch.equal(kv[rank][:, 3 * N : 4 * N], original[rank][:, :N])
                    assert torch.equal(kv[rank][:, : 2 * N], original[rank][:, : 2 * N])
                    assert torch.equal(kv[rank][:, 4 * N :], original[rank][:, 4 * N :])
            finally:
                held.release()
                foreign.release()
                await stream.aclose()
    # Calls after the close: RuntimeError, as documented.
    for name, call in (("match", functools.partial(cache.match, prompts[0])),
                       ("offload", functools.partial(cache.offload, prompts[0], torch.arange(N))),
                       ("prefetch", functools.partial(cache.prefetch, prompts[0])),
                       ("start", cache.start), ("wait_ranks", cache.wait_ranks)):
        with pytest.raises(RuntimeError):
            await call()
        assert cache.stats().pool_referenced == 0, name


# -- the defect, alone (failed before the fix) --------------------------------------------------------


@pytest.mark.asyncio
async def test_a_rank_thread_refuses_a_bad_timeout_before_it_stops_or_waits() -> None:
    kv = [rank_kv(full_kv(LAYOUT, 31, SLOTS), LAYOUT, rank, TP) for rank in range(TP)]
    original = [k.clone() for k in kv]
    tokens = list(range(500, 500 + N))
    async with TPCache(_config(), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG) as cache:
        workers = [RankWorkerThread(cache.address, rank, TP, LAYOUT, kv[rank], CONFIG) for rank in range(TP)]
        async with threads_off_loop(*workers):
            async with asyncio.timeout(30):
                await cache.wait_ranks()
            for timeout in ("1", math.nan, -1.0, True):
                for name in ("close", "wait_attached", "wait_warm"):
                    with pytest.raises((TypeError, ValueError), match="timeout"):  # close: was join's errors
                        await asyncio.to_thread(getattr(workers[1], name), timeout)
                    assert workers[1]._thread.is_alive() and workers[1].worker.attached, f"{name}({timeout!r})"
            # The worker serves on: an offload and a load through both ranks, bit-exact.
            assert (await cache.offload(tokens, torch.arange(N))).stored == PAGES
            loaded = await cache.load(await cache.match(tokens), torch.arange(N, 2 * N))
            assert loaded.tokens == N
            for rank in range(TP):
                assert torch.equal(kv[rank][:, N : 2 * N], original[rank][:, :N])
