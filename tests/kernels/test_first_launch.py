"""A Triton variant's first launch goes alone (review 230).

Triton (3.9's ``JITFunction.run`` and ``CompiledKernel._init_handles``) caches a new kernel, sets its
launcher, then loads the module with the GIL released, and only then sets the function handle. A
second thread launching the same variant meanwhile finds it cached and launches with no function:
the copy fails. The warm-up thread and the copy threads launch the same variants. Here a stand-in
kernel follows Triton's order (launcher first, a load a test holds open, the handle last) and two
threads launch one variant through :meth:`CopyPlan._run`, the compiled branch (not the
interpreter's lock).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from aiokv.kernels import launch
from aiokv.kernels.launch import CopyPlan, interpreting
from aiokv.layout import KVBuffer, KVLayout

LAYOUT = KVLayout.mha(2, 2, 16, torch.float16, page_tokens=4)
DEVICE = torch.device("cpu" if interpreting() else "cuda")
"""A plan needs a CUDA buffer unless the interpreter runs (the stand-in kernel launches nothing)."""
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA")


class LazyKernel:
    """Triton's first-launch order: ``run`` set, the module load (held open by ``release``), then
    ``function``; a launch that reads ``function`` as None fails as Triton's launcher does."""

    def __init__(self, fail_first: bool = False) -> None:
        self.run: object | None = None
        self.function: object | None = None
        self.loading = threading.Event()
        self.release = threading.Event()
        self.launched: list[str] = []
        self.fail_first = fail_first

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        return self.launch

    def launch(self, *args: object, **constexprs: object) -> None:
        if self.run is None:
            self.run = object()
            self.loading.set()
            assert self.release.wait(30), "the test never let the module load end"
            if self.fail_first:
                self.run = None
                raise RuntimeError("module load refused")
            self.function = object()
        if self.function is None:
            raise TypeError("an integer is required (got type NoneType)")
        self.launched.append(threading.current_thread().name)


def _plan() -> CopyPlan:
    rows = 2 * LAYOUT.num_kv_heads
    kv = KVBuffer.wrap(LAYOUT, torch.zeros(LAYOUT.num_layers, 16, rows, LAYOUT.head_dim, dtype=LAYOUT.dtype,
                                           device=DEVICE))
    pages = torch.zeros(2, *LAYOUT.page_shape, dtype=LAYOUT.dtype, device=DEVICE)
    return CopyPlan(kv, pages)


def _launch(plan: CopyPlan, kernel: LazyKernel, errors: list[BaseException]) -> None:
    slots = torch.arange(4, dtype=torch.int64, device=DEVICE)
    try:
        plan._run(kernel, "scatter", (1, 1, 1), (slots, 4, 7), {"T": 4})
    except BaseException as error:  # the test reports it
        errors.append(error)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> dict[str, threading.Event]:
    """The compiled launch path, with a fresh first-launch record; reports which threads reached
    a first-launch lock."""
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    monkeypatch.setattr(launch, "_first_launched", set())
    monkeypatch.setattr(launch, "_first_launch_locks", {})
    at_lock: dict[str, threading.Event] = {"first": threading.Event(), "second": threading.Event()}
    real = launch._first_launch_lock

    def noting(variant: Any) -> threading.Lock:
        event = at_lock.get(threading.current_thread().name)
        if event is not None:
            event.set()
        return real(variant)

    monkeypatch.setattr(launch, "_first_launch_lock", noting)
    return at_lock


def test_a_second_thread_waits_for_the_first_launch_of_a_variant(compiled: dict[str, threading.Event]) -> None:
    plan, kernel, errors = _plan(), LazyKernel(), []
    first = threading.Thread(target=_launch, args=(plan, kernel, errors), name="first")
    second = threading.Thread(target=_launch, args=(plan, kernel, errors), name="second")
    first.start()
    assert kernel.loading.wait(30)
    second.start()
    # Before the fix the second launch found the launcher set and failed at once, never at a lock.
    while not compiled["second"].wait(0.01):
        assert second.is_alive(), f"the second launch ended without waiting: {errors}"
    assert kernel.launched == []
    kernel.release.set()
    first.join(30)
    second.join(30)
    assert errors == []
    assert kernel.launched == ["first", "second"]


def test_later_launches_of_a_variant_take_no_lock_and_a_failed_first_launch_does_not_count(
    compiled: dict[str, threading.Event],
) -> None:
    plan, kernel, errors = _plan(), LazyKernel(fail_first=True), []
    kernel.release.set()
    _launch(plan, kernel, errors)
    assert [type(e) for e in errors] == [RuntimeError] and launch._first_launched == set()
    locks: list[object] = []
    real = launch._first_launch_lock

    def counting(variant: Any) -> threading.Lock:
        locks.append(variant)
        return real(variant)

    launch._first_launch_lock = counting  # the fixture restores it
    kernel.fail_first = False
    for _ in range(3):
        _launch(plan, kernel, errors)
    assert len(errors) == 1 and len(locks) == 1  # the first successful launch only
    assert kernel.launched == ["MainThread"] * 3
