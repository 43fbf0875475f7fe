"""Typed launch wrappers around the Triton bodies in :mod:`aiokv.kernels._jit`.

:class:`CopyPlan` binds one KV buffer to one page tensor (the pool, or a GPU staging buffer): it
picks the word size, builds the per-layer address tables once, and launches on the current stream.
:func:`gather` and :func:`scatter` are checked one-shot forms of the same.

Triton compiles one *variant* of a kernel per :data:`LaunchKey`: the constexprs, and for each other
argument its type and whether it is divisible by 16 (an integer equal to 1 is a variant of its own),
except the scatter's ``skip`` and ``first_layer`` (:data:`aiokv.kernels._jit.SCATTER_UNSPECIALIZED`:
by their type only).
:func:`launch_key` computes it with Triton's own specialization rule; :func:`record_launches` lets
tests and the warm-up (:mod:`aiokv.kernels.warmup`) see which variants launches use.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import triton

from aiokv.layout import KVBuffer

from . import _jit
from .checks import (
    PageIds,
    check_gather_counts,
    check_layers,
    check_page_ids,
    check_pages,
    check_scatter_counts,
    check_slots,
)
from .paths import interpreting
from .segments import Segment, segments

LaunchKey = tuple[str, tuple[object, ...], tuple[tuple[str, object], ...]]
"""What Triton compiles a kernel for: its name, each runtime argument's specialization, the constexprs."""

try:  # Triton's own rule (the one its launcher keys the compiled kernels by)
    from triton._C.libtriton import native_specialize_impl as _native_specialize
    from triton.backends.compiler import BaseBackend as _BaseBackend
except ImportError:  # another Triton version: the rule its documentation states
    _native_specialize = None


def specialization(arg: object, value: bool = True) -> object:
    """How Triton specializes one runtime argument: a tensor by dtype and 16-byte alignment, an int
    by width and divisibility by 16, ``1`` as a constant of its own; with ``value`` False (an
    argument the kernel lists in ``do_not_specialize``) an int by its width alone."""
    if _native_specialize is not None:
        return tuple(_native_specialize(_BaseBackend, arg, False, value, True))
    if isinstance(arg, torch.Tensor):
        return (str(arg.dtype), "D" if arg.data_ptr() % 16 == 0 else "")
    if isinstance(arg, bool) or not isinstance(arg, int):
        return (type(arg).__name__, None)
    width = "i32" if -(2**31) <= arg < 2**31 else "i64"
    if not value:
        return (width, None)
    if arg == 1:
        return ("constexpr", 1)
    return (width, "D" if arg % 16 == 0 else "")


def _positions(kernel: Any, names: tuple[str, ...]) -> frozenset[int]:
    """Positions of the arguments ``names`` in ``kernel``'s signature (a JIT or interpreted function)."""
    params = list(inspect.signature(kernel.fn).parameters)
    missing = set(names) - set(params)
    if missing:
        raise AssertionError(f"{kernel.fn.__name__} has no arguments {sorted(missing)}")
    return frozenset(params.index(n) for n in names)


_UNSPECIALIZED: dict[str, frozenset[int]] = {
    "gather": frozenset(),
    "scatter": _positions(_jit.scatter_kernel, _jit.SCATTER_UNSPECIALIZED),
}
"""Per kernel, the argument positions Triton keys by type alone (``do_not_specialize``)."""


def launch_key(name: str, args: tuple[object, ...], constexprs: dict[str, object]) -> LaunchKey:
    """The variant a launch of kernel ``name`` with these arguments compiles (see the module docstring)."""
    fixed = _UNSPECIALIZED[name]
    return (name, tuple(specialization(a, i not in fixed) for i, a in enumerate(args)),
            tuple(sorted(constexprs.items())))


@dataclass
class LaunchRecord:
    """What :func:`record_launches` saw: every launch's key and the thread it ran on, in order."""

    launch: bool = True
    """False: record only, launch nothing (tests enumerating variants without running kernels)."""
    hook: Callable[[LaunchKey], None] | None = None
    """Called with each key on the launching thread, after it is recorded and before the launch."""
    keys: list[LaunchKey] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)


class TwinLaunches:
    """What the scratch twins of one warm-up share (:meth:`CopyPlan.scratch_twin`): each variant is
    launched once; a launch of a variant in ``done`` or launched already is skipped."""

    def __init__(self, launch: bool = True, done: Iterable[LaunchKey] = ()) -> None:
        self.launch = launch
        """False: the twins' launches only add their keys (enumeration); nothing runs, nothing is recorded."""
        self.keys: list[LaunchKey] = []
        """The variants the twins launched (or named), in order."""
        self.launched: list[LaunchKey] = []
        """Of those, the ones really launched (not a launch a :func:`record_launches` suppressed)."""
        self._seen = set(done)

    def claim(self, key: LaunchKey) -> bool:
        """Whether ``key`` is new (then it is added)."""
        if key in self._seen:
            return False
        self._seen.add(key)
        self.keys.append(key)
        return True


_records: list[LaunchRecord] = []
_records_lock = threading.Lock()


@contextlib.contextmanager
def record_launches(launch: bool = True, hook: Callable[[LaunchKey], None] | None = None) -> Iterator[LaunchRecord]:
    """Record every kernel launch of every :class:`CopyPlan`, from any thread, while the block runs.

    ``launch=False`` also suppresses the launches (their keys are still recorded); ``hook`` sees
    each key on the launching thread before the launch (an exception from it fails the launch).
    For tests and diagnostics: the hot path pays one list check while nothing records.
    """
    record = LaunchRecord(launch, hook)
    with _records_lock:
        _records.append(record)
    try:
        yield record
    finally:
        with _records_lock:
            _records.remove(record)


def _observe(key: LaunchKey) -> bool:
    """Hand ``key`` to the active records; False when one of them suppresses launches."""
    name = threading.current_thread().name
    launch = True
    for record in list(_records):
        record.keys.append(key)
        record.threads.append(name)
        launch = launch and record.launch
        if record.hook is not None:
            record.hook(key)
    return launch


_first_launched: set[tuple[object, LaunchKey]] = set()
"""(device, variant) pairs whose first compiled launch in this process has returned."""
_first_launch_locks: dict[tuple[object, LaunchKey], threading.Lock] = {}
_first_launch_locks_guard = threading.Lock()


def _first_launch_lock(variant: tuple[object, LaunchKey]) -> threading.Lock:
    with _first_launch_locks_guard:
        return _first_launch_locks.setdefault(variant, threading.Lock())


_INTERPRETED = interpreting()
"""Fixed when Triton was imported (``_jit``'s decorators made interpreted functions or JIT ones)."""
_interpreter_lock = threading.Lock()
"""The interpreter is not thread-safe (it patches ``triton.language`` while a kernel runs): a
launch on the copy thread beside one on the warm-up thread failed. Compiled launches need no lock."""

_WORDS: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_VECTOR_BYTES = 16
_BLOCK_ELEMS = 4096
"""Words one program moves at most: 32 KiB of int64, enough to hide latency, few enough registers."""


def _word_view(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """1-D tensor of ``word``-byte ints starting at ``tensor``'s first element (to the storage's end)."""
    storage = tensor.untyped_storage()
    offset = tensor.data_ptr() - storage.data_ptr()
    count = (storage.nbytes() - offset) // word
    view = torch.empty(0, dtype=_WORDS[word], device=tensor.device)
    return view.set_(storage, offset // word, (count,), (1,))


def _aligned_like(words: torch.Tensor, count: int, device: torch.device) -> torch.Tensor:
    """``count`` scratch words of ``words``' dtype whose address is ``words``' modulo 16 bytes."""
    size = words.element_size()
    shift = (words.data_ptr() % 16) // size
    return torch.empty(shift + count, dtype=words.dtype, device=device)[shift:]


def _pow2_divisor(value: int, limit: int) -> int:
    """Largest power of two <= ``limit`` that divides ``value`` (``limit`` when value is 0)."""
    best = 1
    while best < limit and value % (best * 2) == 0:
        best *= 2
    return best


@dataclass(frozen=True)
class _SegmentLaunch:
    """Everything one segment's launch needs, in words."""

    kv_base: torch.Tensor
    layer_off: torch.Tensor
    slot_stride: torch.Tensor
    kv_col: int
    page_col: int
    width: int
    vec: int
    block_t: int
    block_w: int


class CopyPlan:
    """Launches gather/scatter between ``kv`` and one page tensor ``pages`` ``[N, L, T, rows, D]``.

    ``pages`` must be reachable by the kernels: on the KV buffer's GPU, or host memory registered
    with CUDA as mapped (the pool), or anything under the Triton interpreter. Launches go on the
    current stream of the KV device; index tensors must already be int64 on that device.
    """

    def __init__(self, kv: KVBuffer, pages: torch.Tensor) -> None:
        check_pages(kv, pages)
        if kv.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kv is on {kv.device}: Triton kernels need a CUDA KV buffer (or TRITON_INTERPRET=1)"
            )
        if kv.device.type == "cuda" and pages.device.type != "cuda" and not pages.is_pinned():
            raise ValueError("pages must be on the GPU or in pinned, device-mapped host memory")
        self.kv = kv
        self.pages = pages
        self.tokens = kv.layout.page_tokens
        itemsize = kv.layout.itemsize
        segs = segments(kv)
        page_strides = [pages.stride(i) * itemsize for i in range(3)]
        # One word size for the whole plan: the widest that divides every address and offset.
        common = math.gcd(pages.data_ptr(), *page_strides)
        for seg in segs:
            common = math.gcd(common, seg.kv_col * itemsize, seg.page_col * itemsize, seg.width * itemsize)
            for tensor in seg.layers:
                common = math.gcd(common, tensor.data_ptr(), tensor.stride(0) * itemsize)
        self.word = _pow2_divisor(common, 8)
        self.page_words = _word_view(pages, self.word)
        self.page_strides = [s // self.word for s in page_strides]
        self._launches = [self._segment(seg, common) for seg in segs]
        self._once: TwinLaunches | None = None
        """Set on a scratch twin: launch each variant once, skip the launches of a variant already in it."""

    def _segment(self, seg: Segment, common: int) -> _SegmentLaunch:
        word, itemsize = self.word, self.kv.layout.itemsize
        base = min(seg.layers, key=lambda t: t.data_ptr())
        offsets = [(t.data_ptr() - base.data_ptr()) // word for t in seg.layers]
        strides = [t.stride(0) * itemsize // word for t in seg.layers]
        device = self.kv.device
        width = seg.width * itemsize // word
        block_w = min(triton.next_power_of_2(width), _BLOCK_ELEMS)
        return _SegmentLaunch(
            kv_base=_word_view(base, word),
            layer_off=torch.tensor(offsets, dtype=torch.int64, device=device),
            slot_stride=torch.tensor(strides, dtype=torch.int64, device=device),
            kv_col=seg.kv_col * itemsize // word,
            page_col=seg.page_col * itemsize // word,
            width=width,
            vec=_pow2_divisor(common // word, max(1, _VECTOR_BYTES // word)),
            block_t=max(1, min(64, _BLOCK_ELEMS // block_w)),
            block_w=block_w,
        )

    def _grid(self, launch: _SegmentLaunch, n_tokens: int, layers: int | None = None) -> tuple[int, int, int]:
        return (
            triton.cdiv(n_tokens, launch.block_t),
            self.kv.layout.num_layers if layers is None else layers,
            triton.cdiv(launch.width, launch.block_w),
        )

    def gather(self, slots: torch.Tensor, page_ids: torch.Tensor | None) -> None:
        """``slots`` (int64, KV device) -> pages ``page_ids`` (int64 on the KV device; None: 0..P-1).

        Unchecked: callers validated the values. A non-writer rank writes nothing.
        """
        if not self.kv.tp.writer:
            return
        ids = slots if page_ids is None else page_ids
        for launch in self._launches:
            args = (launch.kv_base, launch.layer_off, launch.slot_stride, slots, self.page_words, ids, slots.numel(),
                    launch.kv_col, launch.page_col, launch.width, *self.page_strides)
            self._run(_jit.gather_kernel, "gather", self._grid(launch, slots.numel()), args,
                      self._constexprs(launch, page_ids is not None))

    def scatter(
        self, page_ids: torch.Tensor | None, slots: torch.Tensor, skip_first: int, layers: range | None = None
    ) -> None:
        """Tokens ``[skip_first, skip_first + len(slots))`` of pages ``page_ids`` -> ``slots``, for
        ``layers`` (a step-1 range; None: all). Unchecked."""
        ids = slots if page_ids is None else page_ids
        first, count = (0, None) if layers is None else (layers.start, len(layers))
        if count == 0:
            return
        for launch in self._launches:
            args = (launch.kv_base, launch.layer_off, launch.slot_stride, slots, self.page_words, ids, slots.numel(),
                    skip_first, first, launch.kv_col, launch.page_col, launch.width, *self.page_strides)
            self._run(_jit.scatter_kernel, "scatter", self._grid(launch, slots.numel(), count), args,
                      self._constexprs(launch, page_ids is not None))

    def _constexprs(self, launch: _SegmentLaunch, page_ids: bool) -> dict[str, object]:
        return {"T": self.tokens, "PAGE_IDS": page_ids, "VEC": launch.vec, "BLOCK_T": launch.block_t,
                "BLOCK_W": launch.block_w}

    def _run(self, kernel: Any, name: str, grid: tuple[int, int, int], args: tuple[object, ...],
             constexprs: dict[str, object]) -> None:
        """The one launch point of both kernels (the warm-up's twins and :func:`record_launches` see
        exactly what a copy launches)."""
        key = launch_key(name, args, constexprs)
        if self._once is not None and (not self._once.claim(key) or not self._once.launch):
            return
        if _records and not _observe(key):
            return
        if _INTERPRETED:
            with _interpreter_lock:
                kernel[grid](*args, **constexprs)
        elif (variant := (self.kv.device, key)) in _first_launched:
            kernel[grid](*args, **constexprs)
        else:
            # A variant's first launch in the process loads its binary: Triton puts the kernel in
            # its cache, sets its launcher, then loads the module with the GIL released, and only
            # then sets the function handle. Another thread launching the same variant meanwhile
            # finds it cached and launches with no function (a failed copy). The warm-up thread and
            # the copy threads launch the same variants, so each variant's first launch goes alone.
            with _first_launch_lock(variant):
                kernel[grid](*args, **constexprs)
                _first_launched.add(variant)
        if self._once is not None:
            self._once.launched.append(key)

    def variant_signature(self) -> tuple[object, ...]:
        """Everything of this plan that the variants of its launches depend on, besides each call's
        own arguments (slots, page ids, token count, skip, layers): equal signatures, equal variants
        for equal calls. Pointers enter by their alignment only."""
        return (
            self.kv.tp.writer, self.tokens, self.word, str(self.page_words.dtype), self.page_words.data_ptr() % 16,
            tuple(self.page_strides),
            tuple((str(x.kv_base.dtype), x.kv_base.data_ptr() % 16, x.kv_col, x.page_col, x.width, x.vec, x.block_t,
                   x.block_w) for x in self._launches),
        )

    def scratch_twin(self, once: TwinLaunches, pages: int, device: torch.device | None = None) -> CopyPlan:
        """A plan that launches the same Triton variants as this one and touches only its own scratch.

        Same word size, columns and constexprs, pointers with the same alignment (modulo 16 bytes),
        and page strides replaced by the smallest values of the same specialization (0 for a
        multiple of 16), so each launch has the key a copy through this plan would have while its
        memory stays a few KiB. Launch it with slots all 0 (its KV side is one row per segment,
        layer offsets 0) and pages below ``pages`` (page ids, or ``tokens // T`` without them).
        Launches a variant only once (see :class:`TwinLaunches`). Scratch is allocated on ``device``
        (default: the KV device, on the calling thread's current stream; the CPU is enough for a
        twin of ``once.launch`` False, whose launches only name their variants).
        """
        twin = object.__new__(CopyPlan)
        twin.kv, twin.tokens, twin.word = self.kv, self.tokens, self.word
        device, layers = device or self.kv.device, self.kv.layout.num_layers
        vec = max(x.vec for x in self._launches)  # every stride stays a multiple of each segment's VEC
        twin.page_strides = [_smallest_like(stride, vec) for stride in self.page_strides]
        page, layer, token = twin.page_strides
        span = (pages - 1) * page + (layers - 1) * layer + (self.tokens - 1) * token
        twin.page_words = _aligned_like(self.page_words, span + max(x.page_col + x.width for x in self._launches),
                                        device)
        twin.pages = twin.page_words
        zeros = torch.zeros(layers, dtype=torch.int64, device=device)
        twin._launches = [
            replace(x, kv_base=_aligned_like(x.kv_base, x.kv_col + x.width, device), layer_off=zeros, slot_stride=zeros)
            for x in self._launches
        ]
        twin._once = once
        return twin


def _smallest_like(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that Triton specializes as it does ``value`` (which is a
    multiple of it); ``value`` itself when none is found among the first few."""
    want = specialization(value)
    for candidate in range(0, min(value, 64 * multiple), multiple):
        if specialization(candidate) == want:
            return candidate
    return value


def _index(values: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    # The kernels read an index as contiguous: a strided view (a column of a block table, slots[::2])
    # would be read at the wrong elements, into the wrong slots or out of bounds.
    return torch.as_tensor(values, dtype=torch.int64).to(device=device, dtype=torch.int64).contiguous()


def gather(kv: KVBuffer, slots: torch.Tensor, pages: torch.Tensor, page_ids: PageIds | None = None) -> None:
    """Triton gather on the current stream: KV of ``slots`` -> ``pages[page_ids[i]]`` gets ``slots[i*T:(i+1)*T]``.

    ``pages``: ``[N, L, T, rows, D]`` of the layout dtype, on the GPU or pinned + mapped host memory;
    ``page_ids`` None means ``0..P-1``. Only this rank's rows are written; a non-writer TP replica
    writes nothing. Raises ``ValueError`` naming the offending argument.
    """
    plan = CopyPlan(kv, pages)
    check_slots(kv, slots)
    check_gather_counts(kv, slots, None if page_ids is None else len(page_ids))
    ids = None if page_ids is None else _index(check_page_ids(page_ids, pages.shape[0]), kv.device)
    plan.gather(_index(slots, kv.device), ids)


def scatter(
    kv: KVBuffer,
    pages: torch.Tensor,
    slots: torch.Tensor,
    page_ids: PageIds | None = None,
    skip_first: int = 0,
    layers: range | None = None,
) -> None:
    """Triton scatter on the current stream: tokens ``[skip_first, P*T)`` of ``pages[page_ids]`` -> ``slots``.

    ``len(slots) == P*T - skip_first`` with ``0 <= skip_first < T``; ``layers``: a step-1 range of
    layers to copy (None: all). Raises ``ValueError`` naming the offending argument.
    """
    layers = check_layers(kv, layers)
    plan = CopyPlan(kv, pages)
    check_slots(kv, slots)
    tokens = kv.layout.page_tokens
    if page_ids is None:
        count = -(-(slots.numel() + skip_first) // tokens)
        ids = None
    else:
        id_list = check_page_ids(page_ids, pages.shape[0])
        count = len(id_list)
        ids = _index(id_list, kv.device)
    check_scatter_counts(kv, slots, count, skip_first)
    plan.scatter(ids, _index(slots, kv.device), skip_first, layers)
