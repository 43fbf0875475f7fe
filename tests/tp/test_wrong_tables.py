"""tp_helpers.mover_wrong_tables (what tools/stress_tp_layered.py asks each rank after every load)
names a copy plan whose per-layer address table was overwritten after it was built."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import mover_wrong_tables

from aiokv.kernels import PageMover, TransferPath
from aiokv.kernels.paths import interpreting
from aiokv.layout import KVBuffer, KVLayout, TPSlice

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: the DIRECT plan under the Triton interpreter")


def test_an_overwritten_layer_offset_is_named() -> None:
    layout = KVLayout.mha(4, 2, 8, torch.float16, page_tokens=4)
    kv = KVBuffer.wrap(layout, torch.zeros(layout.num_layers, 64, layout.rows, layout.head_dim, dtype=layout.dtype),
                       TPSlice.of(layout))
    page_elems = layout.page_bytes // layout.itemsize
    pool = torch.zeros((8, page_elems), dtype=layout.dtype)[:, : layout.payload_bytes // layout.itemsize]
    mover = PageMover(kv, pool.view(8, *layout.page_shape), TransferPath.DIRECT, 2)
    plan = mover._direct_plan()
    assert mover_wrong_tables(mover) == []
    table = plan._launches[0].layer_off
    built = table.tolist()
    table[2] = table[1]  # layer 2's rows would land in layer 1
    assert mover_wrong_tables(mover) == [f"direct segment 0 layer_off: {table.tolist()}, built {built}"]
