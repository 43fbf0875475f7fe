"""Layout geometry, fingerprint stability, KV buffer validation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from aiokv.layout import SUPPORTED_DTYPES, BufferForm, KVBuffer, KVKind, KVLayout, TPSlice


def test_mha_geometry_and_padding() -> None:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16)
    assert layout.page_shape == (32, 256, 16, 128)
    assert layout.payload_bytes == 32 * 256 * 16 * 128 * 2
    assert layout.page_bytes == layout.payload_bytes  # already a multiple of 4096
    odd = KVLayout.mha(3, 1, 10, torch.float32, page_tokens=5)
    assert odd.payload_bytes == 3 * 5 * 2 * 10 * 4
    assert odd.page_bytes == 4096 and odd.page_bytes % 4096 == 0


def test_mla_geometry() -> None:
    layout = KVLayout.mla(61, 576, torch.bfloat16)
    assert layout.kind is KVKind.MLA and layout.rows == 1
    assert layout.page_shape == (61, 256, 1, 576)
    assert layout.page_bytes % 4096 == 0 and layout.page_bytes >= layout.payload_bytes


def test_fingerprint_is_stable_across_processes_and_distinguishes_layouts() -> None:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16)
    code = (
        "import torch; from aiokv.layout import KVLayout; "
        "print(KVLayout.mha(32, 8, 128, torch.bfloat16).fingerprint.hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == layout.fingerprint.hex()
    # A pinned value: changing the fingerprint silently would orphan every disk cache.
    assert layout.fingerprint.hex() == "00e6af5fbb7b7cd98a2961670b81a75b"
    variants = [
        KVLayout.mha(32, 8, 128, torch.float16),
        KVLayout.mha(31, 8, 128, torch.bfloat16),
        KVLayout.mha(32, 4, 128, torch.bfloat16),
        KVLayout.mha(32, 8, 64, torch.bfloat16),
        KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=128),
        KVLayout.mla(32, 128, torch.bfloat16),
    ]
    prints = {v.fingerprint for v in variants} | {layout.fingerprint}
    assert len(prints) == len(variants) + 1


@pytest.mark.parametrize("dtype", list(SUPPORTED_DTYPES))
def test_every_supported_dtype(dtype: torch.dtype) -> None:
    layout = KVLayout.mha(2, 2, 16, dtype, page_tokens=16)
    assert layout.itemsize == torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: KVLayout.mha(0, 8, 128, torch.float16), ValueError, "num_layers"),
        (lambda: KVLayout.mha(2, 8, 128, torch.float64), ValueError, "not supported"),
        (lambda: KVLayout.mha(2, 8, 128, "bf16"), TypeError, "dtype"),
        (lambda: KVLayout.mha(2, 8.0, 128, torch.float16), TypeError, "num_kv_heads"),
        (lambda: KVLayout.mha(2, 8, 128, torch.float16, page_tokens=-1), ValueError, "page_tokens"),
        (lambda: KVLayout.mha(True, 8, 128, torch.float16), TypeError, "num_layers"),
    ],
)
def test_bad_layouts(call: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        call()  # type: ignore[operator]


LAYOUT = KVLayout.mha(3, 4, 8, torch.float16, page_tokens=4)


def test_buffer_forms() -> None:
    stacked = KVBuffer.wrap(LAYOUT, torch.zeros(3, 20, 8, 8, dtype=torch.float16))
    assert stacked.form is BufferForm.STACKED and stacked.num_slots == 20 and len(stacked.k_layers) == 3
    per_layer = KVBuffer.wrap(LAYOUT, [torch.zeros(20, 8, 8, dtype=torch.float16) for _ in range(3)])
    assert per_layer.form is BufferForm.PER_LAYER
    k = [torch.zeros(20, 4, 8, dtype=torch.float16) for _ in range(3)]
    v = [torch.zeros(20, 4, 8, dtype=torch.float16) for _ in range(3)]
    split = KVBuffer.wrap(LAYOUT, (k, v))
    assert split.form is BufferForm.SPLIT_KV and len(split.v_layers) == 3
    # A slot stride larger than the row block (e.g. a view into a wider buffer) is accepted.
    wide = torch.zeros(3, 20, 10, 8, dtype=torch.float16)[:, :, :8]
    assert KVBuffer.wrap(LAYOUT, wide).num_slots == 20


@pytest.mark.parametrize(
    ("kv", "error", "words"),
    [
        (torch.zeros(3, 20, 8, 8, dtype=torch.float32), TypeError, "dtype"),
        (torch.zeros(2, 20, 8, 8, dtype=torch.float16), ValueError, "layers"),
        (torch.zeros(3, 20, 6, 8, dtype=torch.float16), ValueError, "rows"),
        (torch.zeros(3, 20, 8, 16, dtype=torch.float16), ValueError, "head_dim"),
        (torch.zeros(3, 20, 8, dtype=torch.float16), ValueError, "4-D"),
        (torch.zeros(3, 20, 8, 16, dtype=torch.float16)[..., ::2], ValueError, "strides"),
        ([torch.zeros(20, 8, 8, dtype=torch.float16)] * 2, ValueError, "layer tensors"),
        ([torch.zeros(20, 8, 8, dtype=torch.float16)] * 2 + [torch.zeros(21, 8, 8, dtype=torch.float16)],
         ValueError, "slots"),
        # Slots sharing bytes: a load into one would change slots the caller did not name.
        (torch.zeros(3, 1, 8, 8, dtype=torch.float16).expand(3, 20, 8, 8), ValueError, "slots overlap"),
        ([torch.zeros(1, 8, 8, dtype=torch.float16).expand(20, 8, 8) for _ in range(3)], ValueError, "slots overlap"),
        (torch.zeros(3 * 20 * 64, dtype=torch.float16).as_strided((3, 20, 8, 8), (20 * 64, 32, 8, 1)), ValueError,
         "slots overlap"),
        ("kv", TypeError, "kv must be"),
        ([1, 2, 3], TypeError, "not a tensor"),
    ],
)
def test_bad_buffers(kv: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        KVBuffer.wrap(LAYOUT, kv)  # type: ignore[arg-type]


def test_tensor_parallel_slices() -> None:
    assert TPSlice.of(LAYOUT, 1, 2) == TPSlice(1, 2, 2, 2, True)
    # 8 ranks over 4 heads: two replicas per head, the even rank writes.
    assert TPSlice.of(LAYOUT, 3, 8) == TPSlice(3, 8, 1, 1, False)
    assert TPSlice.of(LAYOUT, 2, 8) == TPSlice(2, 8, 1, 1, True)
    mla = KVLayout.mla(2, 16, torch.float16)
    assert TPSlice.of(mla, 0, 4).writer and not TPSlice.of(mla, 3, 4).writer
    with pytest.raises(ValueError, match="divisible"):
        TPSlice.of(LAYOUT, 0, 3)
    with pytest.raises(ValueError, match="out of range"):
        TPSlice.of(LAYOUT, 2, 2)
    rank = KVBuffer.wrap(LAYOUT, torch.zeros(3, 20, 4, 8, dtype=torch.float16), TPSlice.of(LAYOUT, 1, 2))
    assert rank.is_partial and rank.rows_local == 4
    with pytest.raises(ValueError, match="rows"):
        KVBuffer.wrap(LAYOUT, torch.zeros(3, 20, 8, 8, dtype=torch.float16), TPSlice.of(LAYOUT, 1, 2))


@pytest.mark.parametrize("form", ["stacked", "per_layer", "split"])
def test_a_buffer_without_storage_is_refused_at_wrap(form: str) -> None:
    # Regression (adversarial run): a meta-device buffer was accepted and every offload then
    # failed below the caller (counted copy_failed); it is the caller's mistake, refused at once.
    layout = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
    kv = torch.zeros(2, 16, 4, 8, dtype=torch.float16, device="meta")
    arg: object = {"stacked": kv, "per_layer": list(kv.unbind(0)),
                   "split": ([t[:, :2] for t in kv.unbind(0)], [t[:, 2:] for t in kv.unbind(0)])}[form]
    with pytest.raises(ValueError, match="meta"):
        KVBuffer.wrap(layout, arg)  # type: ignore[arg-type]
