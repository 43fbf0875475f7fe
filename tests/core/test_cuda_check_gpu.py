"""A CUDA runtime call aiokv makes directly and the runtime refuses leaves no error behind for torch.

Found with a real fault (an invalid pitch): the refused ``cudaMemcpy2DAsync`` stayed the thread's
last CUDA error, and torch's next kernel launch raised it as its own failure. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import aiokv.cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_refused_raw_copy_leaves_no_last_error_for_the_next_launch() -> None:
    if not aiokv.cuda.raw_memcpy_available():
        pytest.skip("no CUDA runtime library to call directly")
    src = torch.zeros(64, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):
        # A destination pitch below the width: the runtime refuses it (cudaErrorInvalidPitchValue).
        aiokv.cuda.memcpy2d_async(dst.data_ptr(), 1, src.data_ptr(), 16, 16, 2, stream)
    out = torch.arange(8, device="cuda") + 1  # a kernel launch: torch checks the last error after it
    torch.cuda.synchronize()
    assert out.sum().item() == 36
