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

    monkeypatch.setattr(warmup, "_primed", {})
    monkeypatch.setattr(warmup, "_priming", set())
    monkeypatch.setattr(warmup.torch, "empty", empty)
    return blocks


MOST = 1 << 18
"""A 256K-slot cache: classes of 1 to 2**18 elements (8 B to 2 MiB)."""


def _all_blocks(most: int = MOST) -> list[int]:
    return [elements for elements in warmup.primed_elements(most) for _ in range(warmup.PRIMED_BLOCKS)]


def test_a_priming_stopped_part_way_is_done_again_by_a_later_one(taken: Taken) -> None:
    taken.stop_at = 3
    assert warmup.prime_host_allocator(DEVICE, MOST, taken.stop) is False  # stopped part way: not primed
    assert 3 <= len(taken) < len(_all_blocks())
    assert str(DEVICE) not in warmup._primed
    # The next warm-up (a new cache in the same process) primes every class.
    taken.clear()
    assert warmup.prime_host_allocator(DEVICE, MOST, threading.Event()) is True
    assert taken == _all_blocks()
    assert warmup.prime_host_allocator(DEVICE, MOST) is False  # once a process per device
    assert taken == _all_blocks()


def test_a_priming_stopped_before_it_began_marks_nothing(taken: Taken) -> None:
    stop = threading.Event()
    stop.set()
    assert warmup.prime_host_allocator(DEVICE, MOST, stop) is False
    assert taken == [] and str(DEVICE) not in warmup._primed
    assert warmup.prime_host_allocator(DEVICE, MOST) is True
    assert taken == _all_blocks()


def test_a_priming_that_fails_marks_nothing(taken: Taken, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block refused (cudaHostAlloc out of memory) raises as before; the device stays unmarked."""
    def refused(elements: int, *, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    with monkeypatch.context() as m:
        m.setattr(warmup.torch, "empty", refused)
        with pytest.raises(RuntimeError, match="out of memory"):
            warmup.prime_host_allocator(DEVICE, MOST)
    assert str(DEVICE) not in warmup._primed
    assert warmup.prime_host_allocator(DEVICE, MOST) is True
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
        assert warmup.prime_quietly(DEVICE, MOST) is False
    assert any("could not prime" in r.getMessage() and "out of memory" in r.getMessage() for r in caplog.records)
    assert str(DEVICE) not in warmup._primed
    assert warmup.prime_quietly(DEVICE, MOST) is True
    assert taken == _all_blocks()


def test_classes_cover_every_index_up_to_the_largest() -> None:
    assert warmup.primed_elements(0) == [1]
    assert warmup.primed_elements(4) == [1, 2, 4]
    assert warmup.primed_elements(5) == [1, 2, 4, 8]
    assert warmup.primed_elements(1 << 40)[-1] == warmup.PINNED_INDEX_CAP
    # The forty-fourth session's stall: a 4-page load's page ids (4 elements, 32 B) fell in a class
    # under the 8 elements the start's priming began at; every class from one element is primed now.
    classes = warmup.primed_elements(MOST)
    for n in (1, 3, 4, 7, 300, MOST):
        assert 1 << (n - 1).bit_length() in classes, n  # torch's class: the next power of two


def test_a_larger_cache_later_primes_the_classes_it_adds(taken: Taken) -> None:
    assert warmup.prime_host_allocator(DEVICE, 16) is True
    assert taken == _all_blocks(16)
    assert warmup.prime_host_allocator(DEVICE, 9) is False  # within what is primed
    del taken[:]
    assert warmup.prime_host_allocator(DEVICE, 64) is True
    assert taken == _all_blocks(64)
    assert warmup._primed[str(DEVICE)] == 64
