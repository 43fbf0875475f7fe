"""The CUDA probe of a pool's first open initializes the driver without holding the GIL."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

import aiokv.shm as shm


def test_cuda_available_initializes_the_driver_through_ctypes_before_torchs_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (H200 host): the first torch.cuda.is_available() initialized the driver while
    # holding the GIL, 11-12 ms of loop stall from the pool's create thread. ctypes releases the
    # GIL for cuInit; torch's check then finds the driver up.
    calls: list[str] = []

    class Driver:
        def __init__(self, name: str) -> None:
            calls.append(f"open {name}")

        def cuInit(self, flags: Any) -> int:
            calls.append(f"cuInit {flags.value}")
            return 0

    monkeypatch.setattr(ctypes, "CDLL", Driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append("torch") is None)
    assert shm.cuda_available() is True
    assert calls == ["open libcuda.so.1", "cuInit 0", "torch"]


def test_cuda_available_without_a_driver_library_asks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert shm.cuda_available() is False
