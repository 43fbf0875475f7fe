"""Byte movers between the engine's KV buffer (token-slot indexed) and pool pages.

``gather``/``scatter`` are Triton kernels behind typed launch wrappers; ``reference_gather`` /
``reference_scatter`` do the same in plain torch (the test oracle; a CPU buffer's offloads and loads
go by ``hostcopy.HostGather`` / ``HostScatter``); :class:`PageMover` runs whole-page offloads and loads on side CUDA
streams through a :class:`TransferPath`;
:func:`warm_up` compiles and launches, once, every kernel variant a mover's copies use.

Triton is imported with the first use of a mover or kernel, not with ``import aiokv``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .paths import TransferPath

if TYPE_CHECKING:
    from .launch import CopyPlan, gather, scatter
    from .mover import PageMover
    from .reference import reference_gather, reference_scatter
    from .warmup import WarmUp, warm_up

_LAZY = {
    "CopyPlan": ".launch",
    "gather": ".launch",
    "scatter": ".launch",
    "PageMover": ".mover",
    "reference_gather": ".reference",
    "reference_scatter": ".reference",
    "WarmUp": ".warmup",
    "warm_up": ".warmup",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "CopyPlan",
    "PageMover",
    "TransferPath",
    "WarmUp",
    "gather",
    "reference_gather",
    "reference_scatter",
    "scatter",
    "warm_up",
]
