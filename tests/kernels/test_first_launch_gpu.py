"""A variant's first launch from two threads at once, on a real GPU (review 230; the CPU test with
a stand-in kernel is ``test_first_launch.py``).

Each round drops Triton's in-memory kernels, so the next launch loads the variant's binary again
(from Triton's disk cache). Thread A launches the scatter; thread B waits until the variant is in
Triton's cache and launches at once, while A may still be loading the module (GIL released, the
function handle not set yet). Without the first-launch lock B's launch failed or ran nothing; with
it both launches land, bit-exact. Skipped without CUDA.
"""

from __future__ import annotations

import threading

import pytest
import torch

from aiokv.kernels import _jit, launch
from aiokv.kernels.launch import CopyPlan
from aiokv.layout import KVBuffer, KVLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUT = KVLayout.mha(2, 2, 64, torch.float16, page_tokens=16)
ROUNDS = 40


def _copy(plan: CopyPlan, slots: torch.Tensor, go: threading.Event, cache: dict[object, object] | None,
          errors: list[BaseException]) -> None:
    """Scatter pages 0-1 into ``slots``; with ``cache``: first wait until the variant is in it."""
    go.wait()
    while cache is not None and not cache:
        pass
    try:
        plan.scatter(None, slots, 0)
        torch.cuda.current_stream().synchronize()
    except BaseException as error:  # the test reports it
        errors.append(error)


def test_two_threads_launching_a_variant_first_both_land(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _jit.scatter_kernel
    if not hasattr(kernel, "device_caches"):
        pytest.skip("this Triton keeps no per-device kernel cache")
    rows, tokens = 2 * LAYOUT.num_kv_heads, LAYOUT.page_tokens
    generator = torch.Generator().manual_seed(5)
    pages = torch.randint(-(2**15), 2**15, (2, *LAYOUT.page_shape), generator=generator, dtype=torch.int16)
    pages = pages.view(LAYOUT.dtype).cuda()
    kv = [torch.zeros(LAYOUT.num_layers, 4 * tokens, rows, LAYOUT.head_dim, dtype=LAYOUT.dtype, device="cuda")
          for _ in range(2)]
    plans = [CopyPlan(KVBuffer.wrap(LAYOUT, buffer), pages) for buffer in kv]
    slots = [torch.arange(0, 2 * tokens, device="cuda"), torch.arange(2 * tokens, 4 * tokens, device="cuda")]
    want = pages.permute(1, 0, 2, 3, 4).reshape(LAYOUT.num_layers, 2 * tokens, rows, LAYOUT.head_dim)
    plans[0].scatter(None, slots[0], 0)  # compiled into Triton's disk cache
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    for round_ in range(ROUNDS):
        kernel.device_caches.clear()
        monkeypatch.setattr(launch, "_first_launched", set(), raising=False)  # raising: the A/B tree before the fix
        for buffer in kv:
            buffer.zero_()
        torch.cuda.synchronize()
        cache = kernel.device_caches[device][0]
        errors: list[BaseException] = []
        go = threading.Event()
        threads = [threading.Thread(target=_copy, args=(plans[i], slots[i], go, cache if i else None, errors))
                   for i in range(2)]
        for thread in threads:
            thread.start()
        go.set()
        for thread in threads:
            thread.join(60)
        assert errors == [], f"round {round_}: {errors!r}"
        torch.cuda.synchronize()
        for i in range(2):
            got = kv[i][:, slots[i]].view(torch.int16)
            assert torch.equal(got, want.view(torch.int16)), f"round {round_}: copy {i}"
