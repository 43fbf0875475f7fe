"""Page geometry and the description of an engine's KV buffer.

A *page* holds the KV of ``page_tokens`` consecutive tokens for every layer, layer-major:
``[num_layers, page_tokens, rows, head_dim]`` where ``rows = 2 * num_kv_heads`` (K heads, then
V heads) for MHA/GQA and ``rows = 1`` (the latent vector) for MLA. Its byte size is padded up to a
multiple of 4096 so disk I/O can use O_DIRECT straight from pool memory.

Pages a tensor-parallel cache shares between its ranks are *rank-major* instead
(:meth:`KVLayout.for_tp`): ``[parts, L, T, rows / parts, D]``, part p holding the K and V heads of
one rank's slice, so each rank's part is one contiguous block it can move with one copy-engine
memcpy per page. The format enters the fingerprint: whole-row and rank-major pages never share keys.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import numpy as np
import torch
import xxhash

PAGE_ALIGN = 4096
"""Page sizes are padded to this many bytes (the O_DIRECT alignment that works everywhere)."""

SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
"""Dtypes a page may hold, with the stable names that enter the fingerprint."""


class KVKind(enum.Enum):
    """Attention kind: separate K and V heads, or one compressed latent per token."""

    MHA = "mha"
    MLA = "mla"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's KV cache; every key and page file carries its fingerprint.

    Build with :meth:`mha` or :meth:`mla`. ``num_kv_heads`` and ``head_dim`` are the model's
    totals (before tensor parallelism); for MLA ``num_kv_heads`` is 1 and ``head_dim`` is the
    latent width.
    """

    kind: KVKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_tokens: int = 256
    parts: int = 1
    """Rank-major parts of each page: 1 for whole-row pages, more for a TP cache's (see :meth:`for_tp`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, KVKind):
            raise TypeError(f"kind must be a KVKind, got {self.kind!r}")
        _positive_int("num_layers", self.num_layers)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("page_tokens", self.page_tokens)
        _positive_int("parts", self.parts)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(SUPPORTED_DTYPES.values())
            raise ValueError(f"dtype {self.dtype} is not supported; use one of: {names}")
        if self.kind is KVKind.MLA and self.num_kv_heads != 1:
            raise ValueError("an MLA layout has exactly one latent row per token (num_kv_heads=1)")
        if self.num_kv_heads % self.parts or (self.kind is KVKind.MLA and self.parts != 1):
            raise ValueError(f"{self.parts} page parts do not split {self.num_kv_heads} {self.kind.value} heads")

    @classmethod
    def mha(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        page_tokens: int = 256,
    ) -> KVLayout:
        """Layout of an MHA/GQA model: pages ``[L, page_tokens, 2 * num_kv_heads, head_dim]``."""
        return cls(KVKind.MHA, num_layers, num_kv_heads, head_dim, dtype, page_tokens)

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, dtype: torch.dtype, page_tokens: int = 256) -> KVLayout:
        """Layout of an MLA model: pages ``[L, page_tokens, 1, latent_dim]``."""
        _positive_int("latent_dim", latent_dim)  # by its name here (it is the layout's head_dim)
        return cls(KVKind.MLA, num_layers, 1, latent_dim, dtype, page_tokens)

    @property
    def rows(self) -> int:
        """Rows per token per layer: ``2 * num_kv_heads`` (K then V) for MHA, 1 for MLA."""
        return 2 * self.num_kv_heads if self.kind is KVKind.MHA else 1

    @cached_property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page: ``(L, page_tokens, rows, head_dim)``; rank-major pages (``parts > 1``)
        ``(parts, L, page_tokens, rows / parts, head_dim)``."""
        if self.parts == 1:
            return (self.num_layers, self.page_tokens, self.rows, self.head_dim)
        return (self.parts, self.num_layers, self.page_tokens, self.rows // self.parts, self.head_dim)

    def for_tp(self, tp_size: int) -> KVLayout:
        """The page format of a cache whose ``tp_size`` ranks share each page (:class:`aiokv.tp.TPCache`).

        One rank-major part per distinct head slice: ``min(tp_size, num_kv_heads)`` parts for MHA
        (replicas of one head share a part), one for MLA (its latent is replicated, not split).
        Raises ``ValueError`` when ``tp_size`` and the heads do not divide.
        """
        whole = dataclasses.replace(self, parts=1)
        TPSlice.of(whole, 0, tp_size)  # tp_size and the heads divide
        parts = 1 if self.kind is KVKind.MLA else min(tp_size, self.num_kv_heads)
        return whole if parts == 1 else dataclasses.replace(self, parts=parts)

    @property
    def part_layout(self) -> KVLayout:
        """One part of a rank-major page as a whole-row layout (its heads only); ``self`` when ``parts == 1``.

        A rank moves its part with an ordinary mover over ``pages[:, part]`` of this layout.
        """
        if self.parts == 1:
            return self
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads // self.parts, parts=1)

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token in one layer (all its rows)."""
        return self.rows * self.head_dim * self.itemsize

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of KV in one page, before padding."""
        return self.num_layers * self.page_tokens * self.token_row_bytes

    @cached_property
    def page_bytes(self) -> int:
        """Bytes one page occupies in the pool and on disk: payload padded to 4096."""
        return -(-self.payload_bytes // PAGE_ALIGN) * PAGE_ALIGN

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes that identify this layout, stable across processes and Python versions."""
        text = (
            f"aiokv-layout-v1|{self.kind.value}|layers={self.num_layers}|heads={self.num_kv_heads}"
            f"|dim={self.head_dim}|dtype={SUPPORTED_DTYPES[self.dtype]}|page={self.page_tokens}"
        )
        if self.parts > 1:
            # Only rank-major pages add a term: whole-row fingerprints (and disk caches) stay as they were.
            text += f"|parts={self.parts}"
        return xxhash.xxh3_128_digest(text.encode("ascii"))

    def describe(self) -> str:
        """One line for logs: kind, shape, dtype and page size."""
        return (
            f"{self.kind.value} L={self.num_layers} H={self.num_kv_heads} D={self.head_dim} "
            f"{SUPPORTED_DTYPES[self.dtype]} page={self.page_tokens} tokens/{self.page_bytes} bytes"
            + (f" in {self.parts} rank-major parts" if self.parts > 1 else "")
        )


@dataclass(frozen=True)
class TPSlice:
    """What one tensor-parallel rank holds of each page.

    ``row_start``/``local_heads`` select the rank's contiguous K heads (and the same V heads);
    ``writer`` is False for replicas that must not write pages (t > kv heads, or MLA on rank > 0).
    """

    rank: int
    size: int
    head_start: int
    local_heads: int
    writer: bool

    @classmethod
    def of(cls, layout: KVLayout, rank: int = 0, size: int = 1) -> TPSlice:
        """Slice of ``layout`` held by rank ``rank`` of ``size``; raises ``ValueError`` when they don't divide."""
        _positive_int("tp_size", size)
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"tp_rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < size:
            raise ValueError(f"tp_rank {rank} out of range for tp_size {size}")
        if layout.kind is KVKind.MLA:
            # MLA's latent is replicated on every rank: one rank writes, all read.
            return cls(rank, size, 0, 1, rank == 0)
        heads = layout.num_kv_heads
        if size <= heads:
            if heads % size:
                raise ValueError(f"num_kv_heads {heads} is not divisible by tp_size {size}")
            local = heads // size
            return cls(rank, size, rank * local, local, True)
        if size % heads:
            raise ValueError(f"tp_size {size} is not a multiple of num_kv_heads {heads}")
        replicas = size // heads
        return cls(rank, size, rank // replicas, 1, rank % replicas == 0)

    @property
    def part(self) -> int:
        """Index of this rank's part in a rank-major page (:meth:`KVLayout.for_tp`); 0 for MLA."""
        return self.head_start // self.local_heads


class BufferForm(enum.Enum):
    """How an engine stores its KV cache in GPU (or CPU) memory."""

    STACKED = "stacked"
    """One tensor ``[L, S, rows, D]``."""
    PER_LAYER = "per_layer"
    """A list of L tensors ``[S, rows, D]``."""
    SPLIT_KV = "split_kv"
    """Two lists of L tensors ``[S, H, D]``: K and V (MHA only)."""


KVBufferLike = torch.Tensor | Sequence[torch.Tensor] | tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class KVBuffer:
    """A validated view of the engine's KV buffer, in the form the kernels consume.

    ``k_layers[l]`` is layer l's ``[S, rows_local, D]`` tensor for STACKED and PER_LAYER forms
    (rows_local = 2 * local heads, K heads then V heads; 1 for MLA) and ``v_layers`` is empty;
    for SPLIT_KV, ``k_layers[l]`` and ``v_layers[l]`` are ``[S, local_heads, D]``. Each slot's rows
    are contiguous in memory (``stride(-1) == 1``, ``stride(-2) == D``); the slot stride is free.
    """

    layout: KVLayout
    form: BufferForm
    tp: TPSlice
    k_layers: tuple[torch.Tensor, ...]
    v_layers: tuple[torch.Tensor, ...]
    num_slots: int
    device: torch.device

    @classmethod
    def wrap(cls, layout: KVLayout, kv: KVBufferLike, tp: TPSlice | None = None) -> KVBuffer:
        """Validate ``kv`` against ``layout`` and describe it.

        ``kv`` is one tensor ``[L, S, rows, D]``, a list of L tensors ``[S, rows, D]``, or a tuple
        ``(k_list, v_list)`` of L tensors ``[S, H, D]`` each, where rows/H count this rank's heads.
        Raises ``TypeError`` for a wrong container or dtype and ``ValueError`` for wrong shapes,
        devices, strides (rows not contiguous, or slots sharing bytes: an expanded tensor), layer
        or head counts.
        """
        if layout.parts != 1:
            raise ValueError("describe a KV buffer with the model's layout; rank-major page layouts are for pools")
        tp = tp or TPSlice.of(layout)
        mla = layout.kind is KVKind.MLA
        local_rows = 1 if mla else 2 * tp.local_heads
        if isinstance(kv, torch.Tensor):
            _check_dense(kv, "the KV buffer")
            if kv.dim() != 4:
                raise ValueError(
                    f"a stacked KV buffer must be 4-D [L, S, rows, D], got shape {tuple(kv.shape)}"
                )
            if kv.shape[0] != layout.num_layers:
                raise ValueError(f"KV buffer has {kv.shape[0]} layers, layout has {layout.num_layers}")
            form = BufferForm.STACKED
            k_layers: tuple[torch.Tensor, ...] = tuple(kv.unbind(0))
            v_layers: tuple[torch.Tensor, ...] = ()
            expect_rows = local_rows
        elif (
            isinstance(kv, tuple)
            and len(kv) == 2
            and all(isinstance(part, (list, tuple)) for part in kv)
        ):
            if mla:
                raise ValueError("an MLA layout has no separate K and V: pass one tensor or a list")
            form = BufferForm.SPLIT_KV
            k_layers = cls._layer_list(layout, cast(Sequence[torch.Tensor], kv[0]), "K")
            v_layers = cls._layer_list(layout, cast(Sequence[torch.Tensor], kv[1]), "V")
            expect_rows = tp.local_heads
        elif isinstance(kv, (list, tuple)):
            form = BufferForm.PER_LAYER
            k_layers = cls._layer_list(layout, kv, "KV")
            v_layers = ()
            expect_rows = local_rows
        else:
            raise TypeError(
                "kv must be a tensor [L, S, rows, D], a list of L tensors [S, rows, D] or a tuple "
                f"(k_list, v_list); got {type(kv).__name__}"
            )
        tensors = k_layers + v_layers
        for index, t in enumerate(tensors):
            # Before any shape is read: a layer that is 0-D raised IndexError at shape[0], a nested
            # one RuntimeError (its sizes), naming nothing.
            where = f"layer tensor {index}" if form is not BufferForm.STACKED else "KV buffer"
            _check_dense(t, where)
            if t.dim() != 3:
                raise ValueError(f"{where} must be 3-D [S, rows, D], got shape {tuple(t.shape)}")
        device = tensors[0].device
        if device.type not in ("cpu", "cuda"):  # e.g. meta (no storage): every copy would fail
            raise ValueError(f"KV buffer is on {device}: aiokv copies between the pool and CPU or CUDA memory")
        num_slots = tensors[0].shape[0]
        for index, t in enumerate(tensors):
            where = f"layer tensor {index}" if form is not BufferForm.STACKED else "KV buffer"
            if t.dtype != layout.dtype:
                raise TypeError(f"{where} has dtype {t.dtype}, layout has {layout.dtype}")
            if t.device != device:
                raise ValueError(f"{where} is on {t.device}, the first is on {device}")
            if t.shape[0] != num_slots:
                raise ValueError(f"{where} has {t.shape[0]} slots, the first has {num_slots}")
            if t.shape[1] != expect_rows:
                what = "latent rows" if mla else "heads" if form is BufferForm.SPLIT_KV else "rows (2 x heads)"
                raise ValueError(f"{where} has {t.shape[1]} {what}, expected {expect_rows} for this layout/TP rank")
            if t.shape[2] != layout.head_dim:
                raise ValueError(f"{where} has head_dim {t.shape[2]}, layout has {layout.head_dim}")
            if t.stride(2) != 1 or t.stride(1) != layout.head_dim:
                raise ValueError(
                    f"{where} must have contiguous rows (strides [*, {layout.head_dim}, 1]), "
                    f"got strides {t.stride()}"
                )
            if num_slots > 1 and t.stride(0) < expect_rows * layout.head_dim:
                # Slots that share bytes (an expanded tensor: stride 0): a load into one slot would
                # change others the caller did not name.
                raise ValueError(
                    f"{where}'s slots overlap (slot stride {t.stride(0)} < {expect_rows * layout.head_dim} "
                    "elements of a slot): each slot needs its own memory"
                )
        if num_slots == 0:
            raise ValueError("KV buffer has no slots")
        shared = _first_shared(tensors)
        if shared is not None:
            first, second = shared
            if form is BufferForm.STACKED:
                what = f"layers {first} and {second} of the KV buffer share memory (an expanded layer dimension?)"
            elif form is BufferForm.SPLIT_KV:
                names = [f"{'KV'[i // layout.num_layers]} of layer {i % layout.num_layers}" for i in shared]
                what = f"{names[0]} and {names[1]} share memory"
            else:
                what = f"layer tensors {first} and {second} share memory"
            # A load into one would change the other: the engine would read another layer's KV.
            raise ValueError(f"{what}: each layer (and K and V) needs its own memory")
        return cls(layout, form, tp, k_layers, v_layers, num_slots, device)

    @staticmethod
    def _layer_list(layout: KVLayout, layers: Sequence[torch.Tensor], what: str) -> tuple[torch.Tensor, ...]:
        items = tuple(layers)
        if len(items) != layout.num_layers:
            raise ValueError(f"{what} list has {len(items)} layer tensors, layout has {layout.num_layers}")
        for index, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} list item {index} is a {type(t).__name__}, not a tensor")
        return items

    @property
    def rows_local(self) -> int:
        """Rows of one slot per layer held by this rank (K and V together for SPLIT_KV)."""
        if self.layout.kind is KVKind.MLA:
            return 1
        return 2 * self.tp.local_heads

    def rank_part(self) -> KVBuffer:
        """This rank's slice as a whole-row buffer of its page part's layout (``part_layout`` of
        ``layout.for_tp(tp.size)``), for a mover over ``pages[:, tp.part]`` of a rank-major pool.

        Each page's part is one contiguous block there, so a mover copies it whole (STAGING: one
        memcpy per page). ``tp.writer`` is kept: a replica still writes nothing.
        """
        part_layout = self.layout.for_tp(self.tp.size).part_layout
        local = TPSlice(self.tp.rank, self.tp.size, 0, part_layout.num_kv_heads, self.tp.writer)
        return dataclasses.replace(self, layout=part_layout, tp=local)

    @property
    def is_partial(self) -> bool:
        """True when this rank holds only part of each page's rows (tensor parallelism)."""
        return self.rows_local != self.layout.rows


def _check_dense(t: torch.Tensor, where: str) -> None:
    """``TypeError`` naming ``where`` unless ``t`` is a dense (strided) tensor, not a nested one."""
    if t.is_nested or t.layout is not torch.strided:
        raise TypeError(f"{where} must be a dense (strided) tensor, got layout {t.layout}"
                        f"{' (nested)' if t.is_nested else ''}")


def _first_shared(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The first pair of ``tensors`` (indices) whose slots share a byte, else None.

    Each tensor is ``[S, rows, D]`` with contiguous rows: S blocks of ``rows * D`` elements, one per
    slot, ``stride(0)`` apart and not overlapping each other (checked by the caller). K and V views
    of one ``[S, 2, H, D]`` tensor interleave without sharing: the check is per block, not per span.
    Only pairs whose spans meet are compared (an engine's usual separate allocations cost a sort)."""
    spans: list[tuple[int, int, int]] = []
    for index, t in enumerate(tensors):
        size = t.element_size()
        start = t.data_ptr()
        block = t.shape[1] * t.shape[2] * size
        spans.append((start, start + (t.shape[0] - 1) * t.stride(0) * size + block, index))
    spans.sort()
    for position, (_start, end, index) in enumerate(spans):
        for other_start, _other_end, other in spans[position + 1:]:
            if other_start >= end:
                break
            if _blocks_meet(tensors[index], tensors[other]):
                return min(index, other), max(index, other)
    return None


def _blocks_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a slot block of ``a`` and one of ``b`` share a byte (see :func:`_first_shared`)."""
    size_a, size_b = a.element_size(), b.element_size()
    len_a, len_b = a.shape[1] * a.shape[2] * size_a, b.shape[1] * b.shape[2] * size_b
    slots = a.shape[0]
    step_a, step_b = a.stride(0) * size_a, b.stride(0) * size_b
    offset = b.data_ptr() - a.data_ptr()
    if slots == 1:
        return -len_b < offset < len_a
    if step_a == step_b:
        # Block i of a and block j of b meet iff -len_b < offset + k * step < len_a, k = j - i in
        # (-slots, slots); the distance grows with k, so only the first k past -len_b can.
        k = max(-(slots - 1), (-len_b - offset) // step_a + 1)
        return k <= slots - 1 and offset + k * step_a < len_a
    # Different slot strides (rare): each block of b against the block of a starting at or before it.
    starts_a = np.arange(slots, dtype=np.int64) * step_a
    starts_b = offset + np.arange(slots, dtype=np.int64) * step_b
    before = np.searchsorted(starts_a, starts_b, side="right") - 1
    hit_before = (before >= 0) & (starts_b < starts_a[np.maximum(before, 0)] + len_a)
    after = np.minimum(before + 1, slots - 1)
    hit_after = (before + 1 < slots) & (starts_a[after] < starts_b + len_b)
    return bool(np.any(hit_before | hit_after))
