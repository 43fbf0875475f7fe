"""Transfer paths: which byte mover crosses between the GPU and the pool (no Triton import here)."""

from __future__ import annotations

import enum
import os

DEFAULT_STAGING_PAGES = 4
"""GPU staging per direction, in pages (here, not in the mover, so the config reads it without Triton)."""


class TransferPath(enum.Enum):
    """How pages cross between the GPU and the pool."""

    STAGING = "staging"
    """Default on CUDA: Triton gather -> GPU staging -> cudaMemcpyAsync to the pinned page (load: reverse)."""
    DIRECT = "direct"
    """Triton reads/writes the pool in place through its device-mapped address."""
    REFERENCE = "reference"
    """Plain torch; the only path for a CPU KV buffer."""


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
