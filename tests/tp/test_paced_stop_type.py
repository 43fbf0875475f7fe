"""A paced layer-wise load stopped on request is told from a fault by its exception's type, not
by its message (``PacedLoadStopped``; the feed itself needs a GPU: ``tests/tp/test_tp_gpu.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from aiokv.kernels.mover import PacedLoadStopped
from aiokv.tp.paced import stopped_by_request


@dataclass
class _Paced:
    stopped: bool


def test_a_requested_stop_is_told_from_a_fault_by_type() -> None:
    stop = PacedLoadStopped("layer-wise load stopped after 3 of 8 units")
    assert stopped_by_request(_Paced(stopped=True), stop)
    assert isinstance(stop, RuntimeError)  # callers catching RuntimeError still catch it
    # A fault raised while a stop was requested wins, whatever its text says.
    fault = RuntimeError("layer-wise load stopped after 3 of 8 units")
    assert not stopped_by_request(_Paced(stopped=True), fault)
    assert not stopped_by_request(_Paced(stopped=True), RuntimeError("CUDA error: an illegal memory access"))
    # The type without a stop request is not a requested stop either.
    assert not stopped_by_request(_Paced(stopped=False), stop)
