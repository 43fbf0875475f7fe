"""A KV buffer whose layers are over the largest pitch ``cudaMemcpy2DAsync`` takes (2**31-1 bytes)
apart: its offloads gather (a whole page's copy would take the layer step as its source pitch), its
loads go by run copies layer by layer (each copy's pitches are the pool's page stride and a block).
CPU: memmove (Triton's interpreter) over a lazily allocated 4 GiB buffer, only the slots used touched;
the GPU cases are in ``test_mover_load_runs_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from kvcase import DEVICE, POISON, random_bits, same_bits, triton_usable

from aiokv.kernels import PageMover, TransferPath, reference_gather
from aiokv.kernels import mover as mover_module
from aiokv.kernels.slotruns import MAX_PITCH, RunCopy, run_geometry
from aiokv.layout import KVBuffer, KVLayout

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" or not triton_usable(),
                                reason="the memmove form needs host buffers and Triton's interpreter")


def test_a_kv_layer_step_over_the_largest_pitch_loads_by_runs_layer_by_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KV buffer whose layers are over 2 GiB apart: a whole page cannot be one copy (its layer
    step would be a pitch, which cudaMemcpy2DAsync refuses), but loads step layers by address, so
    whole and layer-wise loads still go by runs (they staged before), with every pitch in range;
    an offload gathers. The buffer is allocated lazily: only the slots used are touched."""
    layout = KVLayout.mha(2, 1, 8, torch.float32, page_tokens=4)
    tokens, row = layout.page_tokens, layout.rows * layout.head_dim * layout.itemsize
    num_slots = MAX_PITCH // row + 8
    big = torch.empty((layout.num_layers, num_slots, layout.rows, layout.head_dim), dtype=layout.dtype)
    kv = KVBuffer.wrap(layout, big)
    gen = torch.Generator().manual_seed(5)
    pages = random_bits((6, *layout.page_shape), layout.dtype, gen)
    assert run_geometry(kv, pages) is None  # an offload's whole-page copy: refused
    geometry = run_geometry(kv, pages, layer_pitch=False)
    assert geometry is not None and not geometry.layer_pitch_fits
    assert geometry.segments[0].layer_step > MAX_PITCH

    seen: list[RunCopy] = []
    real = mover_module.memmove_runs

    def spying(batch: list[RunCopy]) -> None:
        seen.extend(batch)
        real(batch)

    monkeypatch.setattr(mover_module, "memmove_runs", spying)
    mover = PageMover(kv, pages, TransferPath.STAGING, 2, slot_runs=True)
    assert mover.load_runs
    used = big[:, : 16 * tokens]  # the slots this test uses, at the start of each layer
    used.view(torch.uint8).fill_(POISON)
    want = used.clone()
    rows = pages.transpose(0, 1).reshape(layout.num_layers, -1, layout.rows, layout.head_dim)  # [L, 6T, r, D]

    def loaded(ids: list[int], slots: torch.Tensor, skip: int) -> None:
        want[:, slots] = torch.cat([rows[:, p * tokens : (p + 1) * tokens] for p in ids], dim=1)[:, skip:]

    layered_ids, layered = [2, 3], torch.arange(10 * tokens, 12 * tokens)
    mover.load_layers(layered_ids, layered)
    loaded(layered_ids, layered, 0)
    assert same_bits(used, want)
    assert mover.runs_loaded == 2
    assert len(seen) == 2 * layout.num_layers  # one copy a page and layer (run_pages 1: pages apart)
    assert all(c.dpitch <= MAX_PITCH and c.spitch <= MAX_PITCH for c in seen)

    seen.clear()
    ids, slots = [4, 1, 5], torch.cat([torch.arange(1, tokens), torch.arange(5 * tokens, 7 * tokens)])
    assert mover.load(ids, slots, 1) is None
    loaded(ids, slots, 1)
    assert same_bits(used, want)
    # A whole load by layer: three runs (page 0 partly needed; pool pages 1 and 5 apart), 2 layers.
    assert len(seen) == 3 * layout.num_layers and mover.runs_loaded == 5
    assert all(c.dpitch <= MAX_PITCH and c.spitch <= MAX_PITCH for c in seen)

    seen.clear()
    out = torch.zeros_like(pages)
    gatherer = PageMover(kv, out, TransferPath.STAGING, 2, slot_runs=True)
    offloaded = torch.arange(20, 20 + 2 * tokens)  # two runs
    gatherer.offload(offloaded, [0, 3])
    assert gatherer.runs_offloaded == 0 and not seen
    reference = torch.zeros_like(pages)
    reference_gather(kv, offloaded, reference, [0, 3])
    assert same_bits(out, reference)
