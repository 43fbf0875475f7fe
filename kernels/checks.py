"""Input checks shared by the Triton wrappers, the reference and :class:`PageMover`.

Every check runs before anything is launched and raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiokv.layout import KVBuffer

PageIds = Sequence[int] | torch.Tensor
"""Pool page indices: a sequence of ints or a 1-D integer tensor."""

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_pages(kv: KVBuffer, pages: torch.Tensor, name: str = "pages") -> None:
    """``pages`` must be ``[N, L, T, rows, D]`` of the layout dtype with contiguous token rows."""
    layout = kv.layout
    if not isinstance(pages, torch.Tensor):
        raise ValueError(f"{name} must be a tensor [N, L, T, rows, D], got {type(pages).__name__}")
    if pages.dtype != layout.dtype:
        raise ValueError(f"{name} has dtype {pages.dtype}, the layout has {layout.dtype}")
    if pages.dim() != 5 or tuple(pages.shape[1:]) != layout.page_shape:
        raise ValueError(
            f"{name} must have shape [N, {', '.join(map(str, layout.page_shape))}], got {tuple(pages.shape)}"
        )
    rows, dim = layout.rows, layout.head_dim
    if pages.stride(4) != 1 or pages.stride(3) != dim or pages.stride(2) != rows * dim:
        raise ValueError(f"{name} must have contiguous token rows (strides [*, *, {rows * dim}, {dim}, 1])")


def check_slots(kv: KVBuffer, slots: torch.Tensor, name: str = "slots") -> None:
    """``slots``: 1-D integer tensor of distinct slots in ``[0, kv.num_slots)``.

    Reading the values of a CUDA tensor waits for the current stream; pass CPU slots on a hot path.
    """
    check_slot_range(slots, kv.num_slots, name)


def check_slot_range(slots: torch.Tensor, num_slots: int, name: str = "slots") -> None:
    """``slots``: 1-D integer tensor of distinct slots in ``[0, num_slots)``; ``ValueError`` otherwise."""
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D integer tensor, got {type(slots).__name__}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    if slots.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype, got {slots.dtype}")
    if slots.numel() == 0:
        raise ValueError(f"{name} is empty")
    low_t, high_t = torch.aminmax(slots)
    low, high = int(low_t), int(high_t)
    if low < 0:
        raise ValueError(f"{name} holds a negative slot ({low})")
    if high >= num_slots:
        raise ValueError(f"{name} holds slot {high}, out of range for a KV buffer of {num_slots} slots")
    if has_duplicates(slots, num_slots):
        raise ValueError(f"{name} holds duplicated slots")


def has_duplicates(slots: torch.Tensor, num_slots: int) -> bool:
    """Whether the in-range index tensor ``slots`` repeats a value.

    A scatter into a bitmap of the buffer's slots (~10x cheaper than ``torch.unique``'s sort for
    a prompt's worth of slots) unless the buffer is far larger than the call.
    """
    count = slots.numel()
    if num_slots > 16 * count:
        return int(torch.unique(slots).numel()) != count
    seen = torch.zeros(num_slots, dtype=torch.bool, device=slots.device).index_fill_(0, slots.long(), True)
    return int(seen.sum()) != count


def check_page_ids(page_ids: PageIds, num_pages: int, name: str = "page_ids") -> list[int]:
    """Distinct page indices in ``[0, num_pages)``, as a list of ints."""
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dim() != 1 or page_ids.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {page_ids.dtype} {tuple(page_ids.shape)}")
        ids = [int(i) for i in page_ids.tolist()]
    else:
        ids = []
        for item in page_ids:
            if isinstance(item, bool) or not isinstance(item, int):
                raise ValueError(f"{name} must hold ints, got {type(item).__name__}")
            ids.append(item)
    if not ids:
        raise ValueError(f"{name} is empty")
    if min(ids) < 0:
        raise ValueError(f"{name} holds a negative page ({min(ids)})")
    if max(ids) >= num_pages:
        raise ValueError(f"{name} holds page {max(ids)}, out of range for {num_pages} pages")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} holds duplicated pages")
    return ids


def check_gather_counts(kv: KVBuffer, slots: torch.Tensor, page_count: int | None) -> int:
    """Pages a gather of ``slots`` fills; ``slots`` must be a whole number of pages matching ``page_count``."""
    tokens = kv.layout.page_tokens
    if slots.numel() % tokens:
        raise ValueError(f"slots holds {slots.numel()} slots, not a multiple of the page size ({tokens} tokens)")
    pages = slots.numel() // tokens
    if page_count is not None and page_count != pages:
        raise ValueError(f"page_ids names {page_count} pages but slots fill {pages} pages of {tokens} tokens")
    return pages


def check_scatter_counts(kv: KVBuffer, slots: torch.Tensor, page_count: int, skip_first: int) -> None:
    """``len(slots) == page_count * T - skip_first`` with ``0 <= skip_first < T``."""
    tokens = kv.layout.page_tokens
    if isinstance(skip_first, bool) or not isinstance(skip_first, int):
        raise ValueError(f"skip_first must be an int, got {type(skip_first).__name__}")
    if not 0 <= skip_first < tokens:
        raise ValueError(f"skip_first must be in [0, {tokens}) (tokens of the first page), got {skip_first}")
    expect = page_count * tokens - skip_first
    if slots.numel() != expect:
        raise ValueError(
            f"slots holds {slots.numel()} slots; {page_count} pages of {tokens} tokens "
            f"less skip_first={skip_first} need {expect}"
        )


def check_layers(kv: KVBuffer, layers: range | None) -> range | None:
    """``layers``: None (all) or a non-empty step-1 range within the layout's layers."""
    if layers is None:
        return None
    if not isinstance(layers, range) or layers.step != 1:
        raise ValueError(f"layers must be a range with step 1, got {layers!r}")
    if not 0 <= layers.start < layers.stop <= kv.layout.num_layers:
        raise ValueError(f"layers {layers!r} outside [0, {kv.layout.num_layers}) or empty")
    return layers
