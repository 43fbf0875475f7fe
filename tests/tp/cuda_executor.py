"""Shared by the CUDA tests of one rank's executor (``test_executor_*_gpu.py``,
``test_adv_rev226_direct_load_fault_gpu.py``): their marks and their layout."""

from __future__ import annotations

import pytest
import torch

from aiokv.layout import KVLayout

CUDA_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
"""``pytestmark`` of a module whose tests need a CUDA device (skipped without one)."""

LAYOUT = KVLayout.mha(4, 8, 128, torch.bfloat16, page_tokens=16)
"""The full model's layout; a rank's executor holds a TP-2 slice of it."""
T = LAYOUT.page_tokens
