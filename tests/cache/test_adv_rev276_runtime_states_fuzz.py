"""Adversarial (review 276): malformed calls to a running ``KVCache`` in the states ``test_adv_bad_input``
and ``test_adv_rev156_bad_input`` do not reach: while the caller holds a match (of pool pages, or of
pages only on disk), while a compute-or-load stream is open (launched, not finished), and with
matches that are no longer the caller's (consumed by a stream, released, another cache's).

Each drawn call must raise ``TypeError``/``ValueError`` naming the argument and change nothing: the
statistics, the page table, the disk index, the KV buffer, the held match (still held) and the open
stream (its result at the end is the full, bit-exact load). Afterwards every prompt loads bit-exact.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import LAYOUT, SLOTS, assert_quiescent, config, make_kv, prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_adv_rev156_bad_input import bad_salts, bad_slots, bad_tokens

from aiokv import KVCache, Match
from aiokv.stream import LoadStream

T = LAYOUT.page_tokens
PAGES = 4
N = PAGES * T
EXAMPLES = 6
CALLS_PER_EXAMPLE = 30
_roots = itertools.count()


def _state(cache: KVCache) -> tuple[object, ...]:
    cache.pool.table.check_invariants()
    s = cache.stats()
    disk = cache.disk
    return (s.lookups, dict(s.hit_tokens), s.miss_tokens, dict(s.loaded_tokens), dict(s.bytes_moved), s.pages_stored,
            s.pages_skipped, s.pages_dropped, s.pages_promoted, s.pool_free, s.pool_reserved, s.pool_ready,
            s.pool_referenced, s.write_behind_queue, dict(s.errors), cache.pool.table.statistics(),
            None if disk is None else (disk.statistics().pages, disk.statistics().bytes_stored))


async def _refused(cache: KVCache, kv: torch.Tensor, what: str, names: tuple[str, ...], call: Callable[[], Any],
                   held: list[Match]) -> None:
    """``call()`` (awaited if a coroutine) raises TypeError/ValueError naming one of ``names``, and
    nothing changed; any other outcome fails the test naming the call."""
    before, kv_before = _state(cache), kv.clone()
    try:
        outcome = call()
        if asyncio.iscoroutine(outcome):
            outcome = await outcome
    except (TypeError, ValueError) as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # what the contract forbids, reported as such
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), not TypeError/ValueError") from exc
    else:
        if isinstance(outcome, LoadStream):
            await outcome.aclose()
        raise AssertionError(f"{what}: accepted ({outcome!r})")
    assert any(name in refusal for name in names), f"{what}: names none of {names}: {refusal}"
    assert _state(cache) == before, f"{what}: refused, but the cache changed"
    assert torch.equal(kv, kv_before), f"{what}: refused, but the KV buffer changed"
    for match in held:
        assert not match.released, f"{what}: refused, but {match!r} was consumed"


def _bad_ints(low: int, high: int) -> st.SearchStrategy[object]:
    """Values an int argument in ``[low, high]`` must refuse."""
    return st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high + 1), st.just(10**400),
                     st.sampled_from([None, 1.0, True, "0", np.int64(low), np.int32(low), torch.tensor(low)]),
                     st.floats(allow_nan=True))


async def _bad_call(cache: KVCache, other: KVCache, kv: torch.Tensor, data: st.DataObject, tokens: list[int],
                    held: list[Match], stream: LoadStream, spent: Match) -> None:
    """One drawn bad call; ``held``: matches the test holds (pool and disk pages), ``stream``: an open
    stream, ``spent``: the match the stream consumed."""
    entry = data.draw(st.sampled_from(["load", "start_load", "from_token", "layered", "stale", "foreign",
                                       "offload", "match", "prefetch", "salt", "estimate", "stream"]), label="entry")
    match = data.draw(st.sampled_from(held), label="match")
    free = torch.arange(SLOTS - N, SLOTS)  # slots no prompt lives in
    refused = functools.partial(_refused, cache, kv, held=held)
    if entry in ("load", "start_load"):
        slots = data.draw(bad_slots(match.tokens), label="slots")
        call = cache.load if entry == "load" else cache.start_load
        await refused(f"{entry}(held, slots={slots!r:.80})", ("slots",), functools.partial(call, match, slots))
    elif entry == "from_token":
        start = data.draw(_bad_ints(0, match.tokens), label="from_token")
        call = data.draw(st.sampled_from([cache.load, cache.start_load]), label="call")
        await refused(f"{call.__name__}(from_token={start!r})", ("from_token",),
                      functools.partial(call, match, free[: match.tokens], from_token=start))
    elif entry == "layered":
        layered = data.draw(st.sampled_from([0, 1, None, "yes", np.bool_(True), torch.tensor(True)]), label="layered")
        await refused(f"start_load(layered={layered!r})", ("layered",),
                      functools.partial(cache.start_load, match, free[: match.tokens], layered=layered))
    elif entry == "stale":  # the stream's match, consumed: StaleHandleError (a ValueError)
        call = data.draw(st.sampled_from([cache.load, cache.start_load]), label="call")
        await refused(f"{call.__name__}(consumed match)", ("already loaded or released",),
                      functools.partial(call, spent, free[: spent.tokens]))
        await refused("estimate(consumed match)", ("already loaded or released",),
                      functools.partial(cache.estimate, spent))
    elif entry == "foreign":  # a match of this cache handed to the other one, and the reverse
        foreign = await other.match(tokens)
        try:
            await refused("other.load(this cache's match)", ("another KVCache",),
                          functools.partial(other.load, match, free[: match.tokens]))
            await refused("load(other cache's match)", ("another KVCache",),
                          functools.partial(cache.load, foreign, free[: foreign.tokens]))
            assert not foreign.released
        finally:
            foreign.release()
    elif entry in ("offload", "match", "prefetch"):
        bad = data.draw(bad_tokens(), label="tokens")
        calls = {"offload": functools.partial(cache.offload, bad, free[:8]),
                 "match": functools.partial(cache.match, bad), "prefetch": functools.partial(cache.prefetch, bad)}
        await refused(f"{entry}({bad!r:.80})", ("token ids",), calls[entry])
    elif entry == "salt":
        salt = data.draw(bad_salts(), label="salt")
        name = data.draw(st.sampled_from(["offload", "match", "prefetch", "keys"]), label="call")
        calls = {"offload": functools.partial(cache.offload, tokens, torch.arange(N), salt=salt),
                 "match": functools.partial(cache.match, tokens, salt=salt),
                 "prefetch": functools.partial(cache.prefetch, tokens, salt=salt),
                 "keys": functools.partial(cache.keys, tokens, salt)}
        await refused(f"{name}(salt={salt!r})", ("salt",), calls[name])
    elif entry == "estimate":
        bad = data.draw(st.sampled_from([None, 3, "m", match.tokens, object()]), label="estimate")
        await refused(f"estimate({bad!r})", ("match",), functools.partial(cache.estimate, bad))
    else:
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


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
@pytest.mark.asyncio
async def test_bad_calls_while_matches_and_a_stream_are_held_change_nothing(data: st.DataObject,
                                                                            tmp_path: Path) -> None:
    kv = make_kv(27)
    root = tmp_path / f"d{next(_roots)}"
    prompts = [prompt(270 + i, N) for i in range(3)]  # slots [i*N, (i+1)*N): A, B, C
    # A pool of 8 pages for 12 offloaded: A's pages end up on disk only.
    async with KVCache(config(root, pool_pages=2 * PAGES), LAYOUT, kv) as cache, \
            KVCache(config(None, pool_pages=PAGES), LAYOUT, make_kv(28)) as other:
        for i, tokens in enumerate(prompts):
            assert (await cache.offload(tokens, torch.arange(i * N, (i + 1) * N))).stored == PAGES
            await cache.flush()
        await other.offload(prompts[0], torch.arange(N))
        original = kv.clone()
        on_disk = await cache.match(prompts[0])
        in_pool = await cache.match(prompts[2])
        assert on_disk.tokens == in_pool.tokens == N and on_disk.disk_pages > 0 and in_pool.pool_pages == PAGES
        spent = await cache.match(prompts[1])
        target = torch.arange(3 * N, 4 * N)
        stream = await cache.start_load(spent, target, layered=data.draw(st.booleans(), label="layered stream"))
        await stream.launched()
        for layer in range(LAYOUT.num_layers):
            assert await stream.wait_layer(layer)
        held = [on_disk, in_pool]
        try:
            for _ in range(CALLS_PER_EXAMPLE):
                await _bad_call(cache, other, kv, data, prompts[0], held, stream, spent)
            result = await stream.finish()
            assert result.loaded_from == 0 and torch.equal(kv[:, target], original[:, N : 2 * N])
            for match, source in ((on_disk, 0), (in_pool, 2)):
                got = await cache.load(match, torch.arange(4 * N, 5 * N))
                assert got.tokens == N and torch.equal(kv[:, 4 * N : 5 * N], original[:, source * N : (source + 1) * N])
        finally:
            for match in held:
                match.release()
            await stream.aclose()
        await assert_quiescent(cache)
        await assert_quiescent(other)
