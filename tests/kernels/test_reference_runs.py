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
