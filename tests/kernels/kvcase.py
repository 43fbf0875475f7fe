"""Builders for kernel tests: KV buffers of every form filled with random bits, poisoned pages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from aiokv.kernels.launch import interpreting
from aiokv.layout import BufferForm, KVBuffer, KVKind, KVLayout, TPSlice
from aiokv.pool import PagePool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ALL_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
]
POISON = 0xA5
SLOT_PAD = 8
"""Extra elements after each slot's rows: the slot stride is free, the kernels must honour it."""


@contextlib.contextmanager
def poisoned_pool(layout: KVLayout, pages: int, register_cuda: bool | None = None) -> Iterator[PagePool]:
    """A ready pool of ``pages`` pages of ``layout``, every byte ``POISON``; closed on exit."""
    pool = PagePool.create(layout, pages * layout.page_bytes, register_cuda=register_cuda)
    pool.wait_ready_blocking()
    pool.pages.view(torch.uint8).fill_(POISON)
    try:
        yield pool
    finally:
        pool.close()


def triton_usable() -> bool:
    """The Triton kernels can run here: a GPU, or the interpreter on CPU tensors."""
    return DEVICE.type == "cuda" or interpreting()


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` with uniformly random bytes (NaN payloads included), on the generator's
    device (a CUDA generator makes real shapes' hundreds of MiB on the GPU, not on a loaded host)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen,
                        device=gen.device)
    return raw.view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` for bit-exact comparison (``torch.equal`` on floats treats NaN != NaN)."""
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device == b.device:  # (on the GPU: real shapes' copies to the host cost the suite minutes)
        return torch.equal(bits(a), bits(b))
    return torch.equal(bits(a).cpu(), bits(b).cpu())


def _strided(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` [S, r, D] copied into memory whose slot stride is ``r*D + SLOT_PAD``."""
    s, r, d = values.shape
    store = torch.zeros((s, r * d + SLOT_PAD), dtype=values.dtype, device=device)
    view = store[:, : r * d].view(s, r, d)
    view.copy_(values.to(device))
    return view


def full_kv(layout: KVLayout, slots: int, gen: torch.Generator) -> torch.Tensor:
    """The whole model's KV ``[L, S, rows, D]`` (every head), random bits, on the CPU."""
    return random_bits((layout.num_layers, slots, layout.rows, layout.head_dim), layout.dtype, gen)


def rank_kv(
    layout: KVLayout, full: torch.Tensor, form: BufferForm, tp: TPSlice, device: torch.device = DEVICE
) -> KVBuffer:
    """Rank ``tp``'s share of ``full`` in buffer form ``form``, on ``device``."""
    dim = layout.head_dim
    if layout.kind is KVKind.MLA:
        k, v = full, None
    else:
        heads = layout.num_kv_heads
        lo, hi = tp.head_start, tp.head_start + tp.local_heads
        k, v = full[:, :, lo:hi], full[:, :, heads + lo : heads + hi]
    if form is BufferForm.SPLIT_KV:
        assert v is not None
        k_list = [_strided(k[i], device) for i in range(layout.num_layers)]
        v_list = [_strided(v[i], device) for i in range(layout.num_layers)]
        return KVBuffer.wrap(layout, (k_list, v_list), tp)
    rows = k if v is None else torch.cat([k, v], dim=2)
    if form is BufferForm.STACKED:
        n, s, r, _ = rows.shape
        store = torch.zeros((n, s, r * dim + SLOT_PAD), dtype=layout.dtype, device=device)
        stacked = store[:, :, : r * dim].view(n, s, r, dim)
        stacked.copy_(rows.to(device))
        return KVBuffer.wrap(layout, stacked, tp)
    return KVBuffer.wrap(layout, [_strided(rows[i], device) for i in range(layout.num_layers)], tp)


def empty_like_kv(kv: KVBuffer, fill: int = POISON) -> KVBuffer:
    """A KV buffer of the same form and strides as ``kv``, every byte ``fill``."""

    def clone(t: torch.Tensor) -> torch.Tensor:
        s, r, d = t.shape
        store = torch.full((s, (r * d + SLOT_PAD) * t.element_size()), fill, dtype=torch.uint8, device=t.device)
        return store.view(t.dtype)[:, : r * d].view(s, r, d)

    if kv.form is BufferForm.SPLIT_KV:
        return KVBuffer.wrap(
            kv.layout, ([clone(t) for t in kv.k_layers], [clone(t) for t in kv.v_layers]), kv.tp
        )
    if kv.form is BufferForm.STACKED:
        layers = kv.k_layers
        s, r, d = layers[0].shape
        n = len(layers)
        store = torch.full((n, s, (r * d + SLOT_PAD) * layers[0].element_size()), fill, dtype=torch.uint8,
                           device=kv.device)
        return KVBuffer.wrap(kv.layout, store.view(kv.layout.dtype)[:, :, : r * d].view(n, s, r, d), kv.tp)
    return KVBuffer.wrap(kv.layout, [clone(t) for t in kv.k_layers], kv.tp)


def kv_tensors(kv: KVBuffer) -> list[torch.Tensor]:
    """Every layer tensor of ``kv`` (K then V lists)."""
    return list(kv.k_layers) + list(kv.v_layers)


def kv_snapshot(kv: KVBuffer) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in kv_tensors(kv)]


def kv_equal(a: KVBuffer, b: KVBuffer | list[torch.Tensor]) -> bool:
    other = b if isinstance(b, list) else kv_tensors(b)
    return all(same_bits(x, y) for x, y in zip(kv_tensors(a), other, strict=True))


def poisoned_pages(layout: KVLayout, count: int, device: torch.device = DEVICE) -> torch.Tensor:
    """``[count, L, T, rows, D]`` with every byte ``POISON``, page stride padded like the pool's."""
    page_elems = layout.page_bytes // layout.itemsize + 64
    payload = layout.payload_bytes // layout.itemsize
    raw = torch.full((count, page_elems * layout.itemsize), POISON, dtype=torch.uint8, device=device)
    return raw.view(layout.dtype)[:, :payload].view(count, *layout.page_shape)


def distinct_slots(count: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` distinct random slots (CPU int64)."""
    return torch.randperm(num_slots, generator=gen)[:count]


def kv_rows(kv: KVBuffer) -> torch.Tensor:
    """``[L, S, rows_local, D * itemsize]`` bytes of the rank's KV (K heads then V heads), padding dropped."""
    if kv.form is BufferForm.SPLIT_KV:
        pairs = zip(kv.k_layers, kv.v_layers, strict=True)
        return torch.stack([torch.cat([k.view(torch.uint8), v.view(torch.uint8)], dim=1) for k, v in pairs]).cpu()
    return torch.stack([t.view(torch.uint8) for t in kv.k_layers]).cpu()


def rank_rows(layout: KVLayout, rows: torch.Tensor, tp: TPSlice) -> torch.Tensor:
    """The rows of ``rows`` ``[..., rows, D]`` (full page rows) that rank ``tp`` holds."""
    if layout.kind is KVKind.MLA:
        return rows
    heads = layout.num_kv_heads
    lo, hi = tp.head_start, tp.head_start + tp.local_heads
    return torch.cat([rows[..., lo:hi, :], rows[..., heads + lo : heads + hi, :]], dim=-2)


def page_tokens_rows(pages: torch.Tensor, page_ids: list[int]) -> torch.Tensor:
    """``[L, P*T, rows, D * itemsize]`` bytes: the tokens of ``pages[page_ids]`` concatenated, per layer."""
    picked = pages.view(torch.uint8)[page_ids].cpu()
    p, n, t, r, d = picked.shape
    return picked.permute(1, 0, 2, 3, 4).reshape(n, p * t, r, d)
