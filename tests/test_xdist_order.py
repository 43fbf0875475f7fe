"""tests/xdist_order.py: every worksteal chunk starts with its share of the slow tests."""

from __future__ import annotations

import random
from typing import Any

import pytest
import xdist_order


def chunks(items: list[Any], workers: int) -> list[list[Any]]:
    out, start = [], 0
    for size in xdist_order.chunk_sizes(len(items), workers):
        out.append(items[start : start + size])
        start += size
    return out


def test_chunk_sizes_cover_the_collection_like_worksteal_hands_it_out() -> None:
    assert xdist_order.chunk_sizes(10, 4) == [2, 2, 3, 3]
    assert xdist_order.chunk_sizes(3, 4) == [0, 1, 1, 1]
    for total in range(0, 60):
        sizes = xdist_order.chunk_sizes(total, 16)
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("seed", range(20))
def test_each_chunk_starts_with_its_share_of_the_slow_tests(seed: int) -> None:
    rng = random.Random(seed)
    total, workers = rng.randrange(40, 400), rng.choice([2, 4, 16])
    weights: list[float | None] = [None] * total
    for i in rng.sample(range(total), rng.randrange(1, total // 4)):
        weights[i] = rng.choice([2.0, 2.0, 5.0, 20.0, 60.0])
    items = list(range(total))
    ordered = xdist_order.deal(items, weights, workers)
    assert sorted(ordered) == items, f"seed {seed}: not a permutation"
    rest = [i for i in ordered if weights[i] is None]
    assert rest == sorted(rest), f"seed {seed}: the other tests lost their order"
    loads = []
    for chunk in chunks(ordered, workers):
        marks = [weights[i] is not None for i in chunk]
        assert marks == sorted(marks, reverse=True), f"seed {seed}: a slow test after a quick one in {chunk}"
        loads.append(sum(weights[i] or 0.0 for i in chunk))
    slow = [w for w in weights if w is not None]
    # Longest first to the least loaded chunk: no chunk exceeds the mean by more than one test.
    assert max(loads) <= sum(slow) / workers + max(slow) + 1e-9, f"seed {seed}: {loads}"
    # The longest tests start on different workers.
    longest = sorted((i for i in items if weights[i] is not None), key=lambda i: -(weights[i] or 0.0))
    firsts = {ordered.index(c[0]) for c in chunks(ordered, workers) if c}
    assert all(ordered.index(i) in firsts for i in longest[: min(workers, len(longest))]), f"seed {seed}"


def test_a_plain_or_one_worker_run_keeps_the_order() -> None:
    items = list(range(10))
    weights: list[float | None] = [None, 5.0] * 5
    assert xdist_order.deal(items, weights, 1) == items
    with pytest.raises(ValueError, match="one weight per item"):
        xdist_order.deal(items, weights[:-1], 4)


class _Item:
    def __init__(self, marker: Any) -> None:
        self.nodeid = "t::x"
        self._marker = marker

    def get_closest_marker(self, name: str) -> Any:
        assert name == "slow"
        return self._marker


@pytest.mark.parametrize("bad", [0, -1.0, "60", None])
def test_a_slow_mark_with_a_bad_time_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError, match="positive number"):
        xdist_order.slow_seconds(_Item(pytest.mark.slow(seconds=bad).mark))  # type: ignore[arg-type]


def test_the_marks_time_or_the_default() -> None:
    assert xdist_order.slow_seconds(_Item(None)) is None  # type: ignore[arg-type]
    assert xdist_order.slow_seconds(_Item(pytest.mark.slow.mark)) == xdist_order.DEFAULT_SLOW_S  # type: ignore[arg-type]
    assert xdist_order.slow_seconds(_Item(pytest.mark.slow(seconds=45).mark)) == 45.0  # type: ignore[arg-type]


def test_the_deal_runs_after_the_marks_deselected(request: pytest.FixtureRequest) -> None:
    """The deal orders what runs: dealt before ``-m`` deselected (conftest's hook first, as pluggy
    calls the last registered first), a timing run's slow tests sat in one chunk, one after another
    (the H100 host's ``-m timing -n 6``: both 36-40 s warm-up tests on one worker, 115 s)."""
    impls = request.config.pluginmanager.hook.pytest_collection_modifyitems.get_hookimpls()
    called = list(reversed(impls))  # pluggy's call order
    ours = [i for i, impl in enumerate(called) if impl.function.__code__.co_filename.endswith("tests/conftest.py")]
    marks = [i for i, impl in enumerate(called) if request.config.pluginmanager.get_name(impl.plugin) == "mark"]
    assert len(ours) == 1 and len(marks) == 1, (ours, marks)
    assert ours[0] > marks[0], "the slow tests are dealt before -m/-k deselect"
