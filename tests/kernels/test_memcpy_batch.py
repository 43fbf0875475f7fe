"""``aiokv.cuda.BatchCopier``: 2-D run copies through ``cudaMemcpy3DBatchAsync``, checked on the CPU.

A stand-in runtime carries the ops out on host memory the way the runtime documents them (pointer
operands, one-byte elements: row ``y`` of layer ``z`` at ``ptr + (z * layerHeight + y) * rowLength``),
so the ops the packer makes from a layer-wise load's plan must write exactly what ``memmove_runs``
(the 2-D copies' own semantics) writes. The struct layout is checked against ``driver_types.h``; the
version rule, the cap, the switch and the fallback after a refused batch against the stand-in. The
same copies on a GPU: ``test_mover_load_runs_gpu.py``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import cuda
from aiokv.cuda import BATCH_MAX_OPS, BatchCopier, Memcpy3DBatchOp, Memcpy3DOperand, batch_ops, batch_parts
from aiokv.kernels.slotruns import RunCopy, load_copies, memmove_runs, run_geometry
from aiokv.layout import KVBuffer, KVLayout


def test_the_op_struct_has_the_headers_layout() -> None:
    # struct cudaMemcpy3DOperand { enum type; union { struct { void *ptr; size_t rowLength;
    # size_t layerHeight; struct cudaMemLocation locHint; } ptr; struct { cudaArray_t array;
    # struct cudaOffset3D offset; } array; } op; }: 4 + 4 padding + 32.
    assert ctypes.sizeof(Memcpy3DOperand) == 40
    assert Memcpy3DOperand.op.offset == 8
    ptr = cuda._PointerOperand
    assert (ptr.ptr.offset, ptr.rowLength.offset, ptr.layerHeight.offset, ptr.locHint.offset) == (0, 8, 16, 24)
    # struct cudaMemcpy3DBatchOp { src; dst; struct cudaExtent extent; enum srcAccessOrder;
    # unsigned int flags; }: 112 bytes on x86-64.
    assert ctypes.sizeof(Memcpy3DBatchOp) == 112
    offsets = [getattr(Memcpy3DBatchOp, f).offset for f in ("src", "dst", "extent", "srcAccessOrder", "flags")]
    assert offsets == [0, 40, 80, 104, 108]


class FakeRuntime:
    """A runtime of ``version`` whose copies run on host memory; ``batch``: it has
    ``cudaMemcpy3DBatchAsync``; ``refuse_batches``: each batch call returns error 1 (nothing copied)."""

    def __init__(self, version: int, batch: bool = True, refuse_batches: bool = False) -> None:
        self.version = version
        self.refuse_batches = refuse_batches
        self.batches: list[int] = []
        """Ops per batch call, in call order (refused ones too)."""
        self.copies_2d = 0
        self.cleared = 0
        self.ops_seen: list[Memcpy3DBatchOp] = []
        if batch:
            self.cudaMemcpy3DBatchAsync = _Function(self._batch)

    def cudaRuntimeGetVersion(self, ref: Any) -> int:
        ref._obj.value = self.version
        return 0

    def _batch(self, *args: Any) -> int:
        if self.version >= 13000:
            count, ops, flags, stream = args
        else:
            count, ops, fail_index, flags, stream = args
            assert isinstance(fail_index, type(ctypes.byref(ctypes.c_size_t())))
        assert flags == 0 and stream == 77
        assert len(ops) == count
        self.batches.append(count)
        if self.refuse_batches:
            return 1
        for op in ops:
            self.ops_seen.append(op)
            src, dst = op.src.op.ptr, op.dst.op.ptr
            assert op.src.type == op.dst.type == 1  # pointer operands
            assert op.srcAccessOrder == 1 and op.flags == 0  # in stream order; flags 0
            for z in range(op.extent.depth):
                for y in range(op.extent.height):
                    ctypes.memmove(dst.ptr + (z * dst.layerHeight + y) * dst.rowLength,
                                   src.ptr + (z * src.layerHeight + y) * src.rowLength, op.extent.width)
        return 0

    def cudaMemcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                          stream: int) -> int:
        assert kind == 4 and stream == 77
        self.copies_2d += 1
        memmove_runs([RunCopy(dst, dpitch, src, spitch, width, height)])
        return 0

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0

    def cudaGetErrorString(self, err: int) -> bytes:
        return b"invalid argument"


class _Function:
    """A ctypes function's stand-in: callable, takes ``argtypes`` and ``restype``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.argtypes: list[Any] = []
        self.restype: Any = None

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class _Stream:
    cuda_stream = 77


STREAM: Any = _Stream()


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    """A CUDA 13 stand-in as the process's runtime (the 2-D fallback goes through it too), batches
    switched on (they are off by default)."""
    fake = FakeRuntime(13000)
    monkeypatch.setenv(cuda.BATCH_ENV, "1")
    monkeypatch.setattr(cuda, "_runtime_library", lambda: fake)
    monkeypatch.setattr(cuda, "_batch_copier", None)
    return fake


@dataclass(frozen=True)
class _Plan:
    kv: torch.Tensor
    """The KV buffer's one tensor ``[L, S, rows, D]``."""
    pages: torch.Tensor
    copies: list[RunCopy]


def _plan(tokens: int, layers: int, heads: int, ids: list[int], blocks: list[int], skip: int, run_pages: int,
          seed: int) -> _Plan:
    """A layer-wise load's copies of every layer (``load_copies``): pool pages ``ids`` into slot blocks
    ``blocks`` (page i's run from ``blocks[i] * tokens``; page 0 from its row ``skip``)."""
    layout = KVLayout.mha(layers, heads, 16, torch.float16, page_tokens=tokens)
    gen = torch.Generator().manual_seed(seed)
    pool = max(ids) + 1
    pages = torch.randint(-30000, 30000, (pool, layers, tokens, layout.rows, 16), generator=gen,
                          dtype=torch.int16).view(torch.float16)
    slots = (max(blocks) + 1) * tokens
    kv = torch.zeros((layers, slots, layout.rows, 16), dtype=torch.float16)
    geometry = run_geometry(KVBuffer.wrap(layout, kv), pages, layer_pitch=False)
    assert geometry is not None
    starts = [b * tokens for b in blocks]
    starts[0] += skip
    per_layer = load_copies(geometry, starts, ids, tokens, skip, run_pages)
    return _Plan(kv, pages, [c.at(layer) for layer in range(layers) for c in per_layer])


def _kv_bytes(kv: torch.Tensor) -> bytes:
    return kv.view(torch.int16).numpy().tobytes()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.sampled_from([1, 2, 5, 16]),
    layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    data=st.data(),
)
def test_the_batch_writes_what_the_2d_copies_write(tokens: int, layers: int, heads: int, data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 12), label="pages")
    # Pool pages and slot blocks: permutations with stretches consecutive on both sides (one copy each).
    ids = data.draw(st.permutations(range(count + 4)), label="ids")[:count]
    if data.draw(st.booleans(), label="consecutive ids"):
        ids = sorted(ids)
    blocks = data.draw(st.permutations(range(count + 2)), label="blocks")[:count]
    if data.draw(st.booleans(), label="consecutive blocks"):
        blocks = sorted(blocks)
    skip = data.draw(st.integers(0, tokens - 1), label="skip")
    run_pages = data.draw(st.sampled_from([1, 3, 64]), label="run_pages")
    plan = _plan(tokens, layers, heads, ids, blocks, skip, run_pages, seed=count)

    memmove_runs(plan.copies)
    expect = _kv_bytes(plan.kv)
    assert expect != bytes(len(expect))  # the plan copies something
    plan.kv.zero_()
    fake = FakeRuntime(13000)
    copier = BatchCopier(fake)
    n = len(plan.copies)
    if n == 1:
        return  # a single copy goes as a 2-D copy (test_more_copies_than_the_cap_go_in_several_calls)
    copier.copy(plan.copies, STREAM)  # (a 2-D copy would fail the test: no runtime for it)
    assert _kv_bytes(plan.kv) == expect
    assert fake.copies_2d == 0 and fake.batches == batch_parts(n)
    # Each op is its 2-D copy: source and destination, pitches, width and height.
    seen = [(op.dst.op.ptr.ptr, op.dst.op.ptr.rowLength, op.src.op.ptr.ptr, op.src.op.ptr.rowLength,
             op.extent.width, op.extent.height, op.extent.depth) for op in fake.ops_seen]
    assert seen == [(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, 1) for c in plan.copies]


def _copies(n: int) -> tuple[list[RunCopy], bytearray, bytearray]:
    """``n`` copies of 3 rows of 4 bytes from a patterned source into a zeroed destination."""
    src = bytearray(range(256)) * (n // 16 + 1) * 2
    dst = bytearray(len(src))
    s = (ctypes.c_char * len(src)).from_buffer(src)
    d = (ctypes.c_char * len(dst)).from_buffer(dst)
    base_s, base_d = ctypes.addressof(s), ctypes.addressof(d)
    copies = [RunCopy(base_d + 16 * i, 4 * n + 4, base_s + 16 * i + 1, 5 * n + 7, 4, 3) for i in range(n)]
    return copies, src, dst


def _expected(copies: list[RunCopy], size: int) -> bytes:
    buf = bytearray(size)
    out = (ctypes.c_char * size).from_buffer(buf)
    shift = ctypes.addressof(out) - min(c.dst for c in copies)
    memmove_runs([RunCopy(c.dst + shift, c.dpitch, c.src, c.spitch, c.width, c.height) for c in copies])
    return bytes(buf)


@pytest.mark.parametrize(("n", "calls"), [
    (1, []),  # a batch of one saves no call: a 2-D copy
    (2, [2]),
    (BATCH_MAX_OPS, [BATCH_MAX_OPS]),
    (BATCH_MAX_OPS + 1, [33, 32]),  # not 64 and a batch of one
    (2 * BATCH_MAX_OPS + 22, [50, 50, 50]),
])
def test_more_copies_than_the_cap_go_in_several_calls(runtime: FakeRuntime, n: int, calls: list[int]) -> None:
    copies, _, dst = _copies(n)
    cuda.memcpy2d_batch_async(copies, STREAM)
    assert runtime.batches == calls
    assert runtime.copies_2d == (1 if n == 1 else 0) and cuda.batch_copier().batch_calls == len(calls)
    assert bytes(dst) == _expected(copies, len(dst))


@given(st.integers(0, 2000))
def test_batch_parts_are_the_fewest_within_the_cap_and_even(count: int) -> None:
    parts = batch_parts(count)
    assert sum(parts) == count and len(parts) == -(-count // BATCH_MAX_OPS)
    assert all(1 <= p <= BATCH_MAX_OPS for p in parts)
    assert not parts or max(parts) - min(parts) <= 1


@pytest.mark.parametrize(("version", "has_symbol", "batches"), [
    (12060, True, False),  # before 12.8: no batch call, whatever the library exports
    (12080, False, False),  # the symbol missing
    (12080, True, True),  # 12.8: failIdx third
    (12090, True, True),
    (13000, True, True),  # 13: no failIdx
    (13020, True, True),
])
def test_the_runtime_version_picks_the_call(
    version: int, has_symbol: bool, batches: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeRuntime(version, batch=has_symbol)
    monkeypatch.setattr(cuda, "_runtime_library", lambda: fake)  # the 2-D copies' runtime
    copier = BatchCopier(fake)
    assert copier.version == version and copier.available == batches
    copies, _, dst = _copies(5)
    copier.copy(copies, STREAM)
    assert bytes(dst) == _expected(copies, len(dst))
    assert (fake.batches, fake.copies_2d) == (([5], 0) if batches else ([], 5))
    if batches:
        argtypes = fake.cudaMemcpy3DBatchAsync.argtypes
        assert len(argtypes) == (5 if version < 13000 else 4)


def test_switched_off_the_copies_go_one_2d_copy_each(runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda.BATCH_ENV, "0")
    copier = cuda.batch_copier()
    assert copier.available and not copier.enabled and not copier.active
    copies, _, dst = _copies(7)
    cuda.memcpy2d_batch_async(copies, STREAM)
    assert (runtime.batches, runtime.copies_2d) == ([], 7)
    assert bytes(dst) == _expected(copies, len(dst))


def test_on_only_where_the_environment_says_1(runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda.BATCH_ENV, "1")
    assert cuda.batch_copier().active


def test_off_by_default(runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda.BATCH_ENV, raising=False)
    copier = cuda.batch_copier()
    assert copier.available and not copier.active
    copies, _, dst = _copies(5)
    cuda.memcpy2d_batch_async(copies, STREAM)
    assert (runtime.batches, runtime.copies_2d) == ([], 5)
    assert bytes(dst) == _expected(copies, len(dst))


def test_a_refused_batch_is_copied_by_2d_copies_and_batches_stay_off(
    runtime: FakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    runtime.refuse_batches = True
    copies, _, dst = _copies(BATCH_MAX_OPS + 3)
    with caplog.at_level(logging.WARNING, logger="aiokv.cuda"):
        cuda.memcpy2d_batch_async(copies, STREAM)
        copier = cuda.batch_copier()
        assert not copier.available and copier.failure is not None and "CUDA error 1" in copier.failure
        # The refused call's copies (the first part) and the rest went by 2-D copies, all of them.
        assert (runtime.batches, runtime.copies_2d) == ([34], BATCH_MAX_OPS + 3)
        assert bytes(dst) == _expected(copies, len(dst))
        assert runtime.cleared == 1  # the refusal's error cleared: torch's next launch must not see it
        more, _, dst2 = _copies(2)
        cuda.memcpy2d_batch_async(more, STREAM)
        assert runtime.batches == [34] and runtime.copies_2d == BATCH_MAX_OPS + 5
        assert bytes(dst2) == _expected(more, len(dst2))
    warnings = [r for r in caplog.records if "cudaMemcpy3DBatchAsync" in r.getMessage()]
    assert len(warnings) == 1  # logged once


def test_a_refused_2d_fallback_copy_raises(runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "cudaMemcpy2DAsync", lambda *_: 1)
    copier = cuda.batch_copier()
    copier.enabled = False
    copies, _, _ = _copies(2)
    with pytest.raises(RuntimeError, match=r"cudaMemcpy2DAsync\(3 x 4 bytes\) failed: CUDA error 1"):
        cuda.memcpy2d_batch_async(copies, STREAM)


def test_the_packer_makes_one_op_per_copy() -> None:
    copies = [RunCopy(1000, 300, 5000, 7000, 256, 9), RunCopy(2000, 256, 9000, 256, 256, 1)]
    ops = batch_ops(copies)
    assert len(ops) == 2
    for op, c in zip(ops, copies, strict=True):
        assert (op.src.op.ptr.ptr, op.src.op.ptr.rowLength, op.src.op.ptr.layerHeight) == (c.src, c.spitch, c.height)
        assert (op.dst.op.ptr.ptr, op.dst.op.ptr.rowLength, op.dst.op.ptr.layerHeight) == (c.dst, c.dpitch, c.height)
        assert (op.extent.width, op.extent.height, op.extent.depth) == (c.width, c.height, 1)
        assert (op.src.op.ptr.locHint.type, op.dst.op.ptr.locHint.type) == (0, 0)  # no hint


def test_batches_refused_on_two_threads_at_once_turn_them_off_once(caplog: pytest.LogCaptureFixture) -> None:
    """Two feeding threads (two loads at once) share the process's copier: both in a batch call
    the runtime refuses, at the same time. Batches go off once: the first refusal is the one kept,
    logged once (before: each thread wrote its own failure over the other's and logged it), and
    each thread's copies land by 2-D copies."""
    fake = FakeRuntime(13000, refuse_batches=True)
    both_in = threading.Barrier(2, timeout=30)
    refuse = fake._batch

    def refused_together(*args: Any) -> int:
        both_in.wait()  # both threads inside a batch call before either sees its refusal
        return refuse(*args)

    fake.cudaMemcpy3DBatchAsync = _Function(refused_together)
    copier = BatchCopier(fake)
    jobs = [_copies(5), _copies(9)]
    errors: list[BaseException] = []

    def feed(copies: list[RunCopy]) -> None:
        try:
            copier.copy(copies, STREAM)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    # The 2-D copies go through the process's runtime: the stand-in's.
    with caplog.at_level(logging.WARNING, logger="aiokv.cuda"), \
            pytest.MonkeyPatch.context() as m:
        m.setattr(cuda, "_runtime_library", lambda: fake)
        threads = [threading.Thread(target=feed, args=(copies,)) for copies, _, _ in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert sorted(fake.batches) == [5, 9] and fake.copies_2d == 14
    for copies, _, dst in jobs:
        assert bytes(dst) == _expected(copies, len(dst))
    assert copier.failure is not None and not copier.available and copier.batch_calls == 0
    warnings = [r for r in caplog.records if "cudaMemcpy3DBatchAsync" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert copier.failure in warnings[0].getMessage()
