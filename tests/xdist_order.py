"""The order the tests are handed out in under pytest-xdist's ``--dist worksteal``.

worksteal gives worker i the i-th contiguous chunk of the collection (chunk sizes: what is left
divided by the workers left) and lets an idle worker take the back half of the longest queue. The
tests marked ``slow`` used to be sorted to the front: all in worker 0's chunk, run one after the
other there, and the longest (TP demos, a minute each) still running at the end of the GPU host's
run (they ended at 99%). Here each chunk starts with its share of the slow tests instead, dealt
longest first to the chunk with the least slow time so far, so every worker starts on its own.

``pytest.mark.slow(seconds=...)`` gives a test's rough time in the GPU host's 16-worker run
(``--durations``); a slow test without it counts ``DEFAULT_SLOW_S``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import pytest

DEFAULT_SLOW_S = 2.0

T = TypeVar("T")


def slow_seconds(item: pytest.Item) -> float | None:
    """The ``slow`` marker's ``seconds`` (``DEFAULT_SLOW_S`` when it names none); None when unmarked."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return None
    seconds = marker.kwargs.get("seconds", DEFAULT_SLOW_S)
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        raise TypeError(f"{item.nodeid}: pytest.mark.slow(seconds=...) takes a positive number, not {seconds!r}")
    return float(seconds)


def chunk_sizes(total: int, workers: int) -> list[int]:
    """The sizes of the contiguous chunks worksteal hands its idle workers at the start."""
    sizes: list[int] = []
    left = total
    for i in range(workers):
        size = left // (workers - i)
        sizes.append(size)
        left -= size
    return sizes


def deal(items: Sequence[T], weights: Sequence[float | None], workers: int) -> list[T]:
    """``items`` reordered so that each of the ``workers`` chunks starts with its share of the
    weighted (slow) items, longest first; the others keep their order and fill the chunks."""
    if len(items) != len(weights):
        raise ValueError("one weight per item")
    if workers < 2 or not items:
        return list(items)
    slow = sorted((i for i, w in enumerate(weights) if w is not None), key=lambda i: -(weights[i] or 0.0))
    rest = [items[i] for i, w in enumerate(weights) if w is None]
    heads: list[list[T]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for i in slow:
        chunk = min(range(workers), key=lambda c: loads[c])
        heads[chunk].append(items[i])
        loads[chunk] += weights[i] or 0.0
    ordered: list[T] = []
    taken = 0
    for head, size in zip(heads, chunk_sizes(len(items), workers), strict=True):
        fill = max(0, size - len(head))
        ordered += head + rest[taken : taken + fill]
        taken += fill
    ordered += rest[taken:]
    return ordered
