"""Byte movers between the engine's KV buffer (token-slot indexed) and pool pages.

``gather``/``scatter`` are Triton kernels behind typed launch wrappers; ``reference_gather`` /
``reference_scatter`` do the same in plain torch (CPU KV buffers, test oracle); :class:`PageMover`
runs whole-page offloads and loads on side CUDA streams through a :class:`TransferPath`.
"""

from .launch import CopyPlan, gather, scatter
from .mover import PageMover, TransferPath
from .reference import reference_gather, reference_scatter

__all__ = [
    "CopyPlan",
    "PageMover",
    "TransferPath",
    "gather",
    "reference_gather",
    "reference_scatter",
    "scatter",
]
