"""KV buffers whose layers (or K and V) share memory are refused at wrap.

A list naming one tensor twice, a stacked buffer expanded along its layer dimension, or views that
overlap: a load into one layer would change another, and the engine would read another layer's KV.
K and V views of one ``[S, 2, H, D]`` tensor interleave without sharing a byte and stay accepted."""

from __future__ import annotations

import random

import pytest
import torch

from aiokv.layout import KVBuffer, KVLayout, _first_shared

LAYOUT = KVLayout.mha(3, 4, 8, torch.float16, page_tokens=4)  # rows 8, head_dim 8: 64 elements a slot
SLOT = 64


def _view(base: torch.Tensor, offset: int, stride: int, slots: int = 20, rows: int = 8) -> torch.Tensor:
    return base.as_strided((slots, rows, 8), (stride, 8, 1), offset)


def test_an_expanded_layer_dimension_is_refused() -> None:
    kv = torch.zeros(1, 20, 8, 8, dtype=torch.float16).expand(3, 20, 8, 8)
    with pytest.raises(ValueError, match="layers 0 and 1 of the KV buffer share memory"):
        KVBuffer.wrap(LAYOUT, kv)


def test_one_tensor_named_twice_is_refused() -> None:
    a, b = torch.zeros(20, 8, 8, dtype=torch.float16), torch.zeros(20, 8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="layer tensors 0 and 2 share memory"):
        KVBuffer.wrap(LAYOUT, [a, b, a])


def test_k_and_v_lists_of_the_same_tensors_are_refused() -> None:
    k = [torch.zeros(20, 4, 8, dtype=torch.float16) for _ in range(3)]
    with pytest.raises(ValueError, match=r"K of layer (\d) and V of layer \1 share memory"):
        KVBuffer.wrap(LAYOUT, (k, k))


def test_a_layer_starting_inside_anothers_last_slot_is_refused() -> None:
    base = torch.zeros(4 * 20 * SLOT, dtype=torch.float16)
    layers = [_view(base, 0, SLOT), _view(base, 19 * SLOT + 32, SLOT), _view(base, 40 * SLOT, SLOT)]
    with pytest.raises(ValueError, match="layer tensors 0 and 1 share memory"):
        KVBuffer.wrap(LAYOUT, layers)


def test_layers_of_different_slot_strides_that_meet_are_refused() -> None:
    base = torch.zeros(80 * SLOT, dtype=torch.float16)
    layers = [_view(base, 0, SLOT), _view(base, 19 * SLOT, 2 * SLOT), _view(base, 60 * SLOT, SLOT)]
    with pytest.raises(ValueError, match="layer tensors 0 and 1 share memory"):
        KVBuffer.wrap(LAYOUT, layers)


def test_interleaved_layers_and_k_v_views_that_share_no_byte_are_accepted() -> None:
    # vLLM's per-layer [S, 2, H, D]: K and V are views of one tensor, interleaved slot by slot.
    per_layer = [torch.zeros(20, 2, 4, 8, dtype=torch.float16) for _ in range(3)]
    split = KVBuffer.wrap(LAYOUT, ([t[:, 0] for t in per_layer], [t[:, 1] for t in per_layer]))
    assert split.num_slots == 20
    # Layers interleaved with different slot strides, none sharing a byte (spans overlap).
    base = torch.zeros(100 * SLOT, dtype=torch.float16)
    layers = [_view(base, 0, 2 * SLOT), _view(base, SLOT, 4 * SLOT), _view(base, 3 * SLOT, 4 * SLOT)]
    assert KVBuffer.wrap(LAYOUT, layers).num_slots == 20
    # One stacked allocation, and layers that are slices of one tensor.
    assert KVBuffer.wrap(LAYOUT, torch.zeros(3, 20, 8, 8, dtype=torch.float16)).num_slots == 20
    whole = torch.zeros(20, 3, 8, 8, dtype=torch.float16)
    assert KVBuffer.wrap(LAYOUT, [whole[:, i] for i in range(3)]).num_slots == 20


def _shares_by_brute_force(tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    owned: dict[int, int] = {}
    pairs = []
    for index, t in enumerate(tensors):
        for slot in range(t.shape[0]):
            start = t[slot].data_ptr()
            for byte in range(start, start + t.shape[1] * t.shape[2] * t.element_size()):
                other = owned.setdefault(byte, index)
                if other != index:
                    pairs.append((min(other, index), max(other, index)))
    return min(pairs) if pairs else None


@pytest.mark.parametrize("seed", range(40))
def test_the_check_agrees_with_a_byte_by_byte_look(seed: int) -> None:
    rng = random.Random(seed)
    base = torch.zeros(4096, dtype=torch.float16)
    slots = rng.choice([1, 2, 5])
    tensors = []
    for _ in range(rng.randint(2, 4)):
        rows = rng.choice([1, 2])
        block = rows * 8
        stride = block * rng.choice([1, 2, 3]) + rng.choice([0, 0, 4, 8])
        offset = rng.randrange(0, 600, 4)
        tensors.append(_view(base, offset, stride, slots=slots, rows=rows))
    expected = _shares_by_brute_force(tensors)
    found = _first_shared(tensors)
    assert (found is None) == (expected is None), (found, expected)
    if found is not None:  # the pair reported does share a byte
        assert _shares_by_brute_force([tensors[found[0]], tensors[found[1]]]) is not None
