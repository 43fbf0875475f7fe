"""The reference's slice fast paths (one run of consecutive slots, one page) match a plain loop."""

from __future__ import annotations

import pytest
import torch

from aiokv.kernels import reference_gather, reference_scatter
from aiokv.layout import KVBuffer, KVLayout

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)


def _slots(kind: str, count: int) -> torch.Tensor:
    if kind == "run":
        return torch.arange(5, 5 + count)
    if kind == "reversed":
        return torch.arange(5 + count - 1, 4, -1)
    return torch.randperm(40)[:count]


@pytest.mark.parametrize("kind", ["run", "reversed", "random"])
@pytest.mark.parametrize(("pages", "skip"), [(1, 0), (1, 3), (3, 0), (3, 2)])
def test_gather_and_scatter_match_a_loop(kind: str, pages: int, skip: int) -> None:
    kv = torch.randn(2, 40, 4, 8).half()
    buffer = KVBuffer.wrap(LAYOUT, kv)
    pool = torch.full((5, *LAYOUT.page_shape), -1.0).half()
    ids = [4, 0, 2][:pages]
    slots = _slots(kind, pages * 4)
    reference_gather(buffer, slots, pool, ids)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(pool[ids[i // 4], :, i % 4], kv[:, slot])
    untouched = [p for p in range(5) if p not in ids]
    assert all(torch.all(pool[p] == -1) for p in untouched)

    target = torch.zeros_like(kv)
    back = KVBuffer.wrap(LAYOUT, target)
    dest = _slots(kind, pages * 4 - skip)
    reference_scatter(back, pool, dest, ids, skip)
    for j, slot in enumerate(dest.tolist()):
        i = j + skip
        assert torch.equal(target[:, slot], pool[ids[i // 4], :, i % 4])
    written = set(dest.tolist())
    assert all(torch.all(target[:, s] == 0) for s in range(40) if s not in written)


@pytest.mark.parametrize("kind", ["run", "random"])
@pytest.mark.parametrize("chunk_pages", [1, 2, 5])
def test_large_groups_copy_in_bounded_chunks_and_match_a_loop(kind: str, chunk_pages: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a launch group of many large pages gathered every page of a layer in one
    # index_select, a temporary past glibc's mmap threshold faulted in on every copy (a CPU pool hit
    # of 39 pages of 2 MiB in two groups took 3.5x the time of 20 groups). Now at most CHUNK_BYTES.
    from aiokv.kernels import reference

    page_layer_bytes = LAYOUT.page_tokens * LAYOUT.rows * LAYOUT.head_dim * 2  # one layer of one page, K and V
    monkeypatch.setattr(reference, "CHUNK_BYTES", chunk_pages * page_layer_bytes)
    selected: list[int] = []
    index_select = torch.Tensor.index_select

    def counted(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        out = index_select(self, dim, index)
        selected.append(out.shape[0])
        return out

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    kv = torch.randn(2, 40, 4, 8).half()
    pool = torch.full((9, *LAYOUT.page_shape), -1.0).half()
    ids = [8, 0, 3, 5, 1, 7, 2]
    slots = _slots(kind, len(ids) * 4)
    reference_gather(KVBuffer.wrap(LAYOUT, kv), slots, pool, ids)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(pool[ids[i // 4], :, i % 4], kv[:, slot])
    assert max(selected, default=0) <= chunk_pages * 4  # token rows of at most a chunk's pages
    selected.clear()
    target = torch.zeros_like(kv)
    dest = _slots(kind, len(ids) * 4 - 3)
    reference_scatter(KVBuffer.wrap(LAYOUT, target), pool, dest, ids, 3)
    for j, slot in enumerate(dest.tolist()):
        i = j + 3
        assert torch.equal(target[:, slot], pool[ids[i // 4], :, i % 4])
    assert all(torch.all(target[:, s] == 0) for s in range(40) if s not in set(dest.tolist()))
    assert max(selected, default=0) <= chunk_pages  # pages of at most one chunk (one page: a view)
    assert selected or chunk_pages == 1
