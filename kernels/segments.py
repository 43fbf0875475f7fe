"""Which part of each token row a rank moves: the KV buffer's rows mapped onto the page's rows.

A page's token row (per layer) is ``rows * D`` elements: K heads ``[0, H)`` then V heads
``[H, 2H)`` for MHA, one latent row for MLA. Rank r holds heads ``[head_start, head_start + h)``
of K and the same of V, so it moves two segments (K and V) of ``h * D`` elements each; when it holds
every head of a stacked/per-layer buffer the two are adjacent on both sides and merge into one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiokv.layout import BufferForm, KVBuffer, KVKind


@dataclass(frozen=True)
class Segment:
    """``width`` elements at column ``kv_col`` of a KV slot <-> column ``page_col`` of a page token row."""

    layers: tuple[torch.Tensor, ...]
    """KV side, one ``[S, r, D]`` tensor per layer."""
    kv_col: int
    page_col: int
    width: int


def segments(kv: KVBuffer) -> tuple[Segment, ...]:
    """The segments rank ``kv.tp`` moves between its KV buffer and a page (columns in elements)."""
    layout = kv.layout
    dim = layout.head_dim
    if layout.kind is KVKind.MLA:
        return (Segment(kv.k_layers, 0, 0, dim),)
    heads, local, start = layout.num_kv_heads, kv.tp.local_heads, kv.tp.head_start
    width = local * dim
    if kv.form is BufferForm.SPLIT_KV:
        return (
            Segment(kv.k_layers, 0, start * dim, width),
            Segment(kv.v_layers, 0, (heads + start) * dim, width),
        )
    if local == heads:
        return (Segment(kv.k_layers, 0, 0, 2 * width),)
    return (
        Segment(kv.k_layers, 0, start * dim, width),
        Segment(kv.k_layers, width, (heads + start) * dim, width),
    )
