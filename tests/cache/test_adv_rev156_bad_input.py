"""Adversarial (review 156): malformed arguments to a running KVCache's public calls, drawn by
Hypothesis beyond the table of ``test_adv_bad_input.py``: token ids (lists of bad elements, numpy
arrays and tensors of every bad dtype, layout and shape, uint64 ids past 2**63, quantized, sparse
and nested tensors), salts (unhashable, lone surrogates), slot tensors (sparse, nested, wrong dtype,
out of range, duplicated, short, long), ``from_token`` and ``layered``.

Each call must raise ``TypeError``/``ValueError`` whose message names the argument, and change
nothing: the statistics, the page table, the disk index and the KV buffer compared before and
after, the match still the caller's. Afterwards a valid load serves bit-exact bytes.

Before the fixes: quantized token tensors raised ``RuntimeError``, nested ones (tokens or slots)
``RuntimeError``, sparse ones torch's ``TypeError`` naming no argument, uint64 ids >= 2**63 were
refused as "negative", an unhashable salt raised "unhashable type" and a lone surrogate salt a
``UnicodeEncodeError`` naming no argument.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import LAYOUT, SLOTS, assert_quiescent, config, make_kv, prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv import KVCache, Match

T = LAYOUT.page_tokens
N = 4 * T
EXAMPLES = 5
CALLS_PER_EXAMPLE = 30


def _quantized(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch, not gone
        return torch.quantize_per_tensor(values.float(), 1.0, 0, torch.qint32)


def _nested(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        return torch.nested.nested_tensor([values])


def _bad_token_element() -> st.SearchStrategy[object]:
    return st.one_of(
        st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=3), st.integers(max_value=-1),
        st.integers(min_value=2**63, max_value=2**80), st.just(np.float64(1.0)), st.just(np.uint64(2**63)),
        st.just(torch.tensor(3)), st.just([1]), st.just(b"1"),
    )


@st.composite
def bad_tokens(draw: st.DrawFn) -> object:
    """Token ids that every call must refuse."""
    good = st.integers(0, 2**63 - 1)
    kind = draw(st.integers(0, 9))
    if kind == 0:  # a list or tuple with one bad element somewhere
        values: list[object] = draw(st.lists(good, max_size=12))
        values.insert(draw(st.integers(0, len(values))), draw(_bad_token_element()))
        return tuple(values) if draw(st.booleans()) else values
    if kind == 1:  # numpy of a non-integer dtype
        dtype = draw(st.sampled_from([np.float16, np.float32, np.float64, np.bool_, np.complex64, object,
                                      "datetime64[s]", "U1"]))
        return np.zeros(draw(st.integers(0, 9)), dtype=dtype)
    if kind == 2:  # numpy of integers, but negative or past 2**63, or not 1-D
        which = draw(st.integers(0, 2))
        if which == 0:
            dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.int64]))
            return np.full(draw(st.integers(1, 9)), -draw(st.integers(1, 100)), dtype=dtype)
        if which == 1:
            return np.full(draw(st.integers(1, 9)), draw(st.integers(2**63, 2**64 - 1)), dtype=np.uint64)
        return np.zeros(draw(st.sampled_from([(2, 4), (1, 8), (), (2, 2, 2)])), dtype=np.int64)
    if kind == 3:  # torch of a non-integer dtype
        dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
                                      torch.complex64, torch.float8_e4m3fn]))
        return torch.zeros(draw(st.integers(0, 9))).to(dtype)
    if kind == 4:  # torch integers, negative, past 2**63 (uint64) or not 1-D
        which = draw(st.integers(0, 2))
        if which == 0:
            dtype = draw(st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64]))
            return torch.full((draw(st.integers(1, 9)),), -draw(st.integers(1, 100)), dtype=dtype)
        if which == 1:
            return torch.full((draw(st.integers(1, 9)),), draw(st.integers(2**63, 2**64 - 1)), dtype=torch.uint64)
        return torch.zeros(draw(st.sampled_from([(2, 4), (1, 8), (), (2, 2, 2)])), dtype=torch.long)
    if kind == 5:  # quantized, sparse, nested or meta tensors of valid-looking ids
        values = torch.arange(draw(st.integers(1, 9)))
        return draw(st.sampled_from([_quantized, torch.Tensor.to_sparse, _nested,
                                     lambda t: t.to("meta")]))(values)
    if kind == 6:  # containers that are not a list, tuple, array or tensor
        return draw(st.sampled_from([range(8), {1, 2}, {1: 2}, "12345678", b"\x00" * 8, bytearray(8),
                                     memoryview(b"abcdefgh"), iter([1, 2]), 7, 7.5, None, np.int64(3)]))
    if kind == 7:  # a list with elements past 2**64 (array('Q') overflows)
        return [draw(st.integers(2**64, 2**70))] * draw(st.integers(1, 9))
    if kind == 8:  # a list of numpy integers with one out of range
        return [np.int64(1)] * 3 + [draw(st.sampled_from([np.int64(-1), np.uint64(2**63)]))]
    return [True] * draw(st.integers(1, 9))


def bad_salts() -> st.SearchStrategy[object]:
    return st.one_of(
        st.integers(), st.floats(), st.booleans(), st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.just(bytearray(b"s")),
        st.just(memoryview(b"s")), st.just(object()),
        st.text(max_size=3).map(lambda text: text + "\ud800"),
    )


@st.composite
def bad_slots(draw: st.DrawFn, count: int) -> object:
    """Slots that a call needing ``count`` slots must refuse."""
    base = torch.arange(100, 100 + count)
    kind = draw(st.integers(0, 8))
    if kind == 0:
        return draw(st.sampled_from([None, base.tolist(), tuple(base.tolist()), base.numpy(), 3]))
    if kind == 1:
        dtype = draw(st.sampled_from([torch.int8, torch.int16, torch.uint8, torch.uint64, torch.float32, torch.bool]))
        return base.to(dtype)
    if kind == 2:
        return draw(st.sampled_from([base.view(1, -1), base.view(-1, 1), torch.tensor(5)]))
    if kind == 3:  # too short or too long
        return torch.arange(100, 100 + count + draw(st.sampled_from([-count, -1, 1, 5])))
    if kind == 4:  # negative or out of range, somewhere
        bad = base.clone()
        bad[draw(st.integers(0, count - 1))] = draw(st.sampled_from([-1, -(2**63), SLOTS, SLOTS + 7, 2**63 - 1]))
        return bad if draw(st.booleans()) else bad.clamp(-(2**31), 2**31 - 1).to(torch.int32)  # still bad
    if kind == 5:  # a duplicate
        bad = base.clone()
        i, j = draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
        bad[i] = bad[j]
        return bad
    if kind == 6:  # sparse, nested, meta, quantized
        return draw(st.sampled_from([torch.Tensor.to_sparse, _nested, lambda t: t.to("meta"), _quantized]))(base)
    if kind == 7:  # a strided view with a duplicate (expand)
        return base[:1].expand(count)
    return base.float().requires_grad_()


def _state(cache: KVCache) -> tuple[object, ...]:
    cache.pool.table.check_invariants()
    s = cache.stats()
    disk = cache.disk
    return (s.lookups, dict(s.hit_tokens), s.miss_tokens, dict(s.loaded_tokens), dict(s.bytes_moved), s.pages_stored,
            s.pages_skipped, s.pages_dropped, s.pages_promoted, s.pool_free, s.pool_reserved, s.pool_ready,
            s.pool_referenced, s.write_behind_queue, dict(s.errors), cache.pool.table.statistics(),
            None if disk is None else (disk.statistics().pages, disk.statistics().bytes_stored))


async def _outcome(call: Callable[[], Any]) -> object:
    outcome = call()
    return await outcome if asyncio.iscoroutine(outcome) else outcome


async def _refused(cache: KVCache, kv: torch.Tensor, what: str, names: tuple[str, ...],
                   call: Callable[[], Any], match: Match | None = None) -> None:
    """``call()`` (awaited if a coroutine) raises TypeError/ValueError naming one of ``names``, and
    nothing changed. Any other exception (or none) fails the test as it comes."""
    await cache.flush()
    before, kv_before = _state(cache), kv.clone()
    with pytest.raises((TypeError, ValueError)) as refused:
        await _outcome(call)
    text = str(refused.value)
    assert any(name in text for name in names), f"{what}: {refused.type.__name__} names none of {names}: {text}"
    assert _state(cache) == before, f"{what}: refused, but the cache changed"
    assert torch.equal(kv, kv_before), f"{what}: refused, but the KV buffer changed"
    if match is not None:
        assert not match.released, f"{what}: refused, but the match was consumed"


TOKEN_NAMES = ("token ids",)
SALT_NAMES = ("salt",)
SLOT_NAMES = ("slots",)


ENTRIES = ["match", "prefetch", "keys", "offload", "offload_salt", "match_salt", "prefetch_salt", "keys_salt",
           "offload_slots", "load", "start_load", "from_token", "layered"]
_roots = itertools.count()


async def _bad_call(cache: KVCache, kv: torch.Tensor, tokens: list[int], entry: str, data: st.DataObject) -> None:
    """One drawn bad call of ``entry``, checked by :func:`_refused`."""
    if entry in ("match", "prefetch", "keys", "offload"):
        bad = data.draw(bad_tokens(), label="tokens")
        calls: dict[str, Callable[[], Any]] = {
            "match": functools.partial(cache.match, bad), "prefetch": functools.partial(cache.prefetch, bad),
            "keys": functools.partial(cache.keys, bad),
            "offload": functools.partial(cache.offload, bad, torch.arange(8)),
        }
        await _refused(cache, kv, f"{entry}({bad!r})", TOKEN_NAMES, calls[entry])
    elif entry.endswith("_salt"):
        salt = data.draw(bad_salts(), label="salt")
        calls = {
            "match_salt": functools.partial(cache.match, tokens, salt=salt),
            "prefetch_salt": functools.partial(cache.prefetch, tokens, salt=salt),
            "keys_salt": functools.partial(cache.keys, tokens, salt),
            "offload_salt": functools.partial(cache.offload, tokens, torch.arange(N), salt=salt),
        }
        await _refused(cache, kv, f"{entry}({salt!r})", SALT_NAMES, calls[entry])
    elif entry == "offload_slots":
        slots = data.draw(bad_slots(N), label="slots")
        call = functools.partial(cache.offload, tokens, slots)
        await _refused(cache, kv, f"offload(slots={slots!r})", SLOT_NAMES, call)
    else:
        match = await cache.match(tokens)
        try:
            if entry in ("load", "start_load"):
                slots = data.draw(bad_slots(N), label="slots")
                call = functools.partial(cache.load if entry == "load" else cache.start_load, match, slots)
                await _refused(cache, kv, f"{entry}(slots={slots!r})", SLOT_NAMES, call, match)
            elif entry == "from_token":
                start = data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=N + 1), st.floats(),
                                            st.booleans(), st.none(), st.just(np.int64(4)), st.just("0")),
                                  label="from_token")
                call = functools.partial(cache.load, match, torch.arange(100, 100 + N), from_token=start)
                await _refused(cache, kv, f"load(from_token={start!r})", ("from_token",), call, match)
            else:
                layered = data.draw(st.sampled_from([0, 1, None, "yes", np.bool_(True), torch.tensor(True)]))
                call = functools.partial(cache.start_load, match, torch.arange(100, 100 + N), layered=layered)
                await _refused(cache, kv, f"start_load(layered={layered!r})", ("layered",), call, match)
        finally:
            match.release()


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
@pytest.mark.asyncio
async def test_drawn_bad_arguments_are_refused_by_name_and_change_nothing(data: st.DataObject, tmp_path: Path) -> None:
    kv = make_kv(5)
    tokens = prompt(5, N)
    async with KVCache(config(tmp_path / f"d{next(_roots)}", pool_pages=16), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(N))
        await cache.flush()
        original = kv.clone()
        for _ in range(CALLS_PER_EXAMPLE):
            await _bad_call(cache, kv, tokens, data.draw(st.sampled_from(ENTRIES)), data)
        assert torch.equal(kv, original)
        # A valid call afterwards serves bit-exact bytes.
        match = await cache.match(tokens)
        assert match.tokens == N
        result = await cache.load(match, torch.arange(100, 100 + N))
        assert result.tokens == N
        assert torch.equal(kv[:, 100 : 100 + N], original[:, :N])
        await assert_quiescent(cache)


# -- the defects, one by one (each failed before the fix) -------------------------------------------


@pytest.mark.asyncio
async def test_quantized_sparse_and_nested_tensors_are_type_errors_naming_the_argument(tmp_path: Path) -> None:
    kv = make_kv(6)
    tokens = prompt(6, N)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(N))
        ids = torch.tensor(tokens[:8])
        for bad in (_quantized(ids), ids.to_sparse(), _nested(ids)):
            await _refused(cache, kv, f"match({bad.layout}, {bad.dtype})", TOKEN_NAMES,
                           functools.partial(cache.match, bad))
            with pytest.raises(TypeError, match="token ids"):
                cache.keys(bad)
        for slots in (torch.arange(100, 100 + N).to_sparse(), _nested(torch.arange(100, 100 + N))):
            await _refused(cache, kv, "offload(sparse/nested slots)", SLOT_NAMES,
                           functools.partial(cache.offload, tokens, slots))
            match = await cache.match(tokens)
            await _refused(cache, kv, "load(sparse/nested slots)", SLOT_NAMES,
                           functools.partial(cache.load, match, slots), match)
            match.release()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_uint64_token_tensors_are_taken_as_they_are(tmp_path: Path) -> None:
    async with KVCache(config(None), LAYOUT, make_kv(7)) as cache:
        big = torch.full((8,), 2**63, dtype=torch.uint64)
        with pytest.raises(ValueError, match=r"< 2\*\*63"):  # was "non-negative, found -9223372036854775808"
            cache.keys(big)
        with pytest.raises(ValueError, match=r"< 2\*\*63"):
            cache.keys(torch.full((8,), 2**64 - 1, dtype=torch.uint64))  # was "found -1"
        ids = [0, 1, 2**63 - 1, 5, 2**40, 7, 8, 9]
        assert cache.keys(torch.tensor(ids, dtype=torch.uint64)) == cache.keys(ids)
        low = [*ids[:4], 1, 2, 3, 4]
        assert cache.keys(torch.tensor(low, dtype=torch.uint64)) == cache.keys(low)
        assert cache.keys(torch.tensor([1, 2, 3, 4], dtype=torch.uint32)) == cache.keys([1, 2, 3, 4])


@pytest.mark.asyncio
async def test_unhashable_and_unencodable_salts_are_named(tmp_path: Path) -> None:
    kv = make_kv(8)
    tokens = prompt(8, N)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(N))
        for salt in (bytearray(b"tenant"), ["a"], {"a": 1}):  # was "unhashable type: ..."
            with pytest.raises(TypeError, match="salt must be str, bytes or None"):
                await cache.match(tokens, salt=salt)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="salt must be str, bytes or None"):
                await cache.offload(tokens, torch.arange(N), salt=salt)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="salt must be encodable as UTF-8"):  # was a bare UnicodeEncodeError
            await cache.match(tokens, salt="tenant-\udc80")
        with pytest.raises(ValueError, match="salt must be encodable as UTF-8"):
            await cache.prefetch(tokens, salt="\ud800")
        hit = await cache.match(tokens)
        assert hit.tokens == N
        hit.release()
        await assert_quiescent(cache)

