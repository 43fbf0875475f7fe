"""Kernel tests run the Triton kernels on the GPU, or under the Triton interpreter on a CPU-only machine.

``TRITON_INTERPRET`` must be set before triton is imported, hence at this module's import time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
