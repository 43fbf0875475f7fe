"""The warm-up's priming of torch's host allocator (``kernels/warmup.py``, step 4), stopped part way.

It is done once a process per device. The device was marked primed before the priming ran, so a
close that stopped the warm-up during it (the stop is looked at before each size class) left the
device marked with part of the classes, or none, primed: no later warm-up of the process primed it,
and its copies' indices called ``cudaHostAlloc`` on the loop after all. Now only a priming that ran
through marks the device; a stopped one is done again by the next.

The pinned blocks stand in as plain host tensors (no GPU here: ``torch.empty(pin_memory=True)``
needs CUDA; ``tests/core/test_prime_host_gpu.py`` counts the real blocks on a device); the stop is
the warm-up's own event, set as the third block is taken.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from aiokv.kernels import warmup

DEVICE = torch.device("cuda", 3)  # a name only: nothing here reaches a device


class Taken(list[int]):
    """Elements of each pinned block the priming took, in order; ``stop_at``: the stop is set as
    that many have been taken (the close's, while the priming runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()
        self.stop_at: int | None = None

    def take(self, elements: int) -> None:
        self.append(elements)
        if len(self) == self.stop_at:
            self.stop.set()


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Taken:
    """The blocks the priming takes (host tensors standing in for pinned ones); no device primed yet."""
    blocks = Taken()
    real_empty = torch.empty

    def empty(elements: int, *, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        assert pin_memory and dtype is torch.int64
        blocks.take(elements)
        return real_empty(elements, dtype=dtype)

    monkeypatch.setattr(warmup, "_primed", set())
    monkeypatch.setattr(warmup.torch, "empty", empty)
    return blocks


def _all_blocks() -> list[int]:
    return [max(1, (1 << shift) // 8) for shift in warmup.PRIMED_BYTES for _ in range(warmup.PRIMED_BLOCKS)]


def test_a_priming_stopped_part_way_is_done_again_by_a_later_one(taken: Taken) -> None:
    taken.stop_at = 3
    assert warmup.prime_host_allocator(DEVICE, taken.stop) is False  # stopped part way: not primed
    assert 3 <= len(taken) < len(_all_blocks())
    assert str(DEVICE) not in warmup._primed
    # The next warm-up (a new cache in the same process) primes every class.
    taken.clear()
    assert warmup.prime_host_allocator(DEVICE, threading.Event()) is True
    assert taken == _all_blocks()
    assert warmup.prime_host_allocator(DEVICE) is False  # once a process per device
    assert taken == _all_blocks()


def test_a_priming_stopped_before_it_began_marks_nothing(taken: Taken) -> None:
    stop = threading.Event()
    stop.set()
    assert warmup.prime_host_allocator(DEVICE, stop) is False
    assert taken == [] and str(DEVICE) not in warmup._primed
    assert warmup.prime_host_allocator(DEVICE) is True
    assert taken == _all_blocks()


def test_a_priming_that_fails_marks_nothing(taken: Taken, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block refused (cudaHostAlloc out of memory) raises as before; the device stays unmarked."""
    def refused(elements: int, *, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    with monkeypatch.context() as m:
        m.setattr(warmup.torch, "empty", refused)
        with pytest.raises(RuntimeError, match="out of memory"):
            warmup.prime_host_allocator(DEVICE)
    assert str(DEVICE) not in warmup._primed
    assert warmup.prime_host_allocator(DEVICE) is True
    assert taken == _all_blocks()


def test_the_warm_up_logs_a_refused_priming_and_goes_on(
    taken: Taken, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warm-up primes through prime_quietly: a refused block is a warning, not the warm-up's
    failure (which would answer wait_warm with None and count warm_up_failed); a later one primes."""
    def refused(elements: int, *, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger=warmup.__name__):
        m.setattr(warmup.torch, "empty", refused)
        assert warmup.prime_quietly(DEVICE) is False
    assert any("could not prime" in r.getMessage() and "out of memory" in r.getMessage() for r in caplog.records)
    assert str(DEVICE) not in warmup._primed
    assert warmup.prime_quietly(DEVICE) is True
    assert taken == _all_blocks()
