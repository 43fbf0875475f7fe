"""Page keys: determinism across processes, prefix property, isolation, input validation."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.keys import namespace_seed, page_keys, token_array
from aiokv.layout import KVLayout

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)


def _keys_in_child(tokens: list[int]) -> list[bytes]:
    return page_keys(tokens, 4, namespace_seed(LAYOUT, "ns", "tenant"))


def test_keys_match_the_definition() -> None:
    tokens = list(range(10))
    seed = namespace_seed(LAYOUT, "ns", None)
    keys = page_keys(tokens, 4, seed)
    assert len(keys) == 2  # the partial third page gets no key
    for i, key in enumerate(keys):
        prefix = np.asarray(tokens[: (i + 1) * 4], dtype="<u8").tobytes()
        assert key == xxhash.xxh3_128_digest(seed + (4).to_bytes(8, "little") + prefix)


def test_same_keys_in_another_process() -> None:
    tokens = [int(x) for x in np.random.default_rng(1).integers(0, 2**40, 64)]
    here = _keys_in_child(tokens)
    with multiprocessing.get_context("spawn").Pool(1) as workers:
        there = workers.apply(_keys_in_child, (tokens,))
    assert here == there and len(here) == 16


def test_all_input_kinds_agree() -> None:
    tokens = list(range(1000, 1040))
    seed = namespace_seed(LAYOUT, "ns", b"salt")
    expected = page_keys(tokens, 4, seed)
    assert page_keys(np.asarray(tokens, dtype=np.int32), 4, seed) == expected
    assert page_keys(np.asarray(tokens, dtype=np.uint64), 4, seed) == expected
    assert page_keys(torch.tensor(tokens), 4, seed) == expected
    assert page_keys(torch.tensor(tokens, dtype=torch.int32), 4, seed) == expected
    assert page_keys(tuple(tokens), 4, seed) == expected


@pytest.mark.parametrize(
    ("tokens", "error", "words"),
    [
        ([1.0, 2.0], TypeError, "float"),
        ([True, 1], TypeError, "bool"),
        (np.array([1.5]), TypeError, "float"),
        (np.array([True]), TypeError, "bool"),
        (torch.tensor([1.0]), TypeError, "float"),
        (torch.tensor([True]), TypeError, "bool"),
        ([-1, 2], ValueError, "non-negative"),
        (np.array([-5]), ValueError, "non-negative"),
        ([2**63], ValueError, r"2\*\*63"),
        (np.array([2**63], dtype=np.uint64), ValueError, r"2\*\*63"),
        (np.zeros((2, 2), dtype=np.int64), ValueError, "1-D"),
        (torch.zeros((2, 2), dtype=torch.int64), ValueError, "1-D"),
        ("abc", TypeError, "str"),
        ([1, "2"], TypeError, "str"),
        ((1, "2"), TypeError, "str"),
        ([1, None], TypeError, "NoneType"),
        ([3, torch.tensor(3)], TypeError, "Tensor"),  # an __index__ is not an int
        ([3, np.float64(3.0)], TypeError, "float64"),
        ([5, 2**64], ValueError, r"2\*\*63"),
        ((5, 2**63), ValueError, r"2\*\*63"),
        ((5, -(2**70)), ValueError, "non-negative"),
        ([np.int64(5), -1], ValueError, "non-negative"),
    ],
)
def test_bad_tokens_are_refused_with_a_clear_message(tokens: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        token_array(tokens)  # type: ignore[arg-type]


def _definition(tokens: list[int]) -> bytes:
    """The key material's bytes by definition: each id as a little-endian uint64 (no numpy)."""
    return b"".join(t.to_bytes(8, "little") for t in tokens)


@settings(max_examples=80, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**63 - 1) | st.sampled_from([0, 1, 2**63 - 1]), max_size=300))
def test_every_input_kind_gives_the_defined_bytes(tokens: list[int]) -> None:
    # token_array's list path became array('Q') after an exact type check (320 -> 150 us for
    # 4,096 ids): keys must not change, for any container.
    expected = _definition(tokens)
    kinds: list[object] = [tokens, tuple(tokens), np.asarray(tokens, dtype=np.uint64), [np.uint64(t) for t in tokens]]
    kinds += [np.asarray(tokens, dtype=np.int64), torch.tensor(tokens, dtype=torch.int64)]
    if all(t < 2**31 for t in tokens):
        kinds += [np.asarray(tokens, dtype=np.int32), torch.tensor(tokens, dtype=torch.int32)]
        kinds += [[np.int32(t) for t in tokens], torch.tensor(tokens, dtype=torch.int64)[::1]]
    for value in kinds:
        ids = token_array(value)  # type: ignore[arg-type]
        assert ids.dtype == np.dtype("<u8") and ids.ndim == 1 and ids.flags.c_contiguous
        assert ids.tobytes() == expected, type(value).__name__


def test_a_strided_tensor_and_a_big_list_give_the_defined_bytes() -> None:
    tokens = [int(x) for x in np.random.default_rng(2).integers(0, 2**63 - 1, 4096, dtype=np.int64)]
    assert token_array(tokens).tobytes() == _definition(tokens)
    wide = torch.tensor(tokens + tokens, dtype=torch.int64)[::2]  # a view with stride 2
    assert token_array(wide).tobytes() == _definition((tokens + tokens)[::2])


@pytest.mark.parametrize("mask", [[False, True, False], [False, False, False]])
def test_a_masked_token_array_is_refused(mask: list[bool]) -> None:
    # Regression: the ids under the mask were hashed as they are, a key of another prompt.
    tokens = np.ma.MaskedArray(np.array([4, 5, 6]), mask=mask)
    with pytest.raises(TypeError, match="masked array"):
        token_array(tokens)


def test_bad_token_lists_leave_the_list_unchanged() -> None:
    tokens = [4, 5, -6]
    with pytest.raises(ValueError, match="non-negative"):
        token_array(tokens)
    assert tokens == [4, 5, -6]


def test_bad_seed_namespace_salt_page_size() -> None:
    seed = namespace_seed(LAYOUT, "ns")
    with pytest.raises(ValueError, match="page_tokens"):
        page_keys([1, 2], 0, seed)
    with pytest.raises(ValueError, match="seed"):
        page_keys([1, 2], 1, b"short")
    with pytest.raises(TypeError, match="namespace"):
        namespace_seed(LAYOUT, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="salt"):
        namespace_seed(LAYOUT, "ns", 5)  # type: ignore[arg-type]


token_lists = st.lists(st.integers(min_value=0, max_value=2**63 - 1), min_size=0, max_size=80)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, cut=st.integers(min_value=0, max_value=80))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], cut: int) -> None:
    seed = namespace_seed(LAYOUT, "ns", "a")
    full = page_keys(tokens, 4, seed)
    part = page_keys(tokens[:cut], 4, seed)
    assert full[: len(part)] == part
    assert len(full) == len(tokens) // 4


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(min_value=0, max_value=2**32), min_size=16, max_size=64))
def test_salt_namespace_page_size_and_layout_give_disjoint_keys(tokens: list[int]) -> None:
    other_layout = KVLayout.mha(2, 2, 8, torch.bfloat16, page_tokens=4)
    base = set(page_keys(tokens, 4, namespace_seed(LAYOUT, "ns", "a")))
    variants = [
        page_keys(tokens, 4, namespace_seed(LAYOUT, "ns", "b")),
        page_keys(tokens, 4, namespace_seed(LAYOUT, "ns", None)),
        page_keys(tokens, 4, namespace_seed(LAYOUT, "ns", b"a")),
        page_keys(tokens, 4, namespace_seed(LAYOUT, "other", "a")),
        page_keys(tokens, 8, namespace_seed(LAYOUT, "ns", "a")),
        page_keys(tokens, 4, namespace_seed(other_layout, "ns", "a")),
    ]
    for keys in variants:
        assert base.isdisjoint(keys)


@settings(max_examples=40, deadline=None)
@given(a=token_lists, b=token_lists)
def test_different_tokens_give_different_keys(a: list[int], b: list[int]) -> None:
    seed = namespace_seed(LAYOUT, "ns")
    ka, kb = page_keys(a, 4, seed), page_keys(b, 4, seed)
    for i, (x, y) in enumerate(zip(ka, kb, strict=False)):
        assert (x == y) == (a[: (i + 1) * 4] == b[: (i + 1) * 4])
