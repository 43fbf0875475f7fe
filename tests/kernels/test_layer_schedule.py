"""The planning of layer-wise STAGING loads: page groups, the buffer reuse schedule, staging split.

Pure Python: the GPU pipeline issues exactly these units (``PageMover._load_layers_staged``).
"""

from __future__ import annotations

import pytest

from aiokv.kernels.mover import (
    LAYER_BUFFERS,
    PACE_BYTES,
    feed_paced,
    layer_groups,
    layer_schedule,
    pace_window,
    slab_runs,
    split_layer_staging,
)


@pytest.mark.parametrize("capacity", [1, 5, 42])
@pytest.mark.parametrize("count", [1, 7, 37, 128])
def test_groups_cover_every_page_once_in_order_within_the_cap(count: int, capacity: int) -> None:
    groups = layer_groups(count, capacity)
    assert [p for g in groups for p in g] == list(range(count))
    assert len(groups) == -(-count // capacity)  # the fewest groups the cap allows
    sizes = [len(g) for g in groups]
    assert max(sizes) <= capacity
    assert max(sizes) - min(sizes) <= 1, sizes  # balanced: no short tail group


def test_groups_balance_a_long_prefix() -> None:
    # 128 pages (32K tokens of 256) through buffers of 42 slabs: 4 groups of 32, not 42+42+42+2.
    assert [len(g) for g in layer_groups(128, 42)] == [32, 32, 32, 32]


def test_groups_refuse_empty_arguments() -> None:
    for count, capacity in [(0, 4), (3, 0), (-1, 2)]:
        with pytest.raises(ValueError, match="must be positive"):
            layer_groups(count, capacity)


@pytest.mark.parametrize("buffers", [1, 3])
@pytest.mark.parametrize(("layers", "groups"), [(2, 1), (32, 1), (61, 5)])
def test_schedule_goes_layer_by_layer_and_reuses_buffers_in_rotation(layers: int, groups: int, buffers: int) -> None:
    units = layer_schedule(layers, groups, buffers)
    assert [(u.layer, u.group) for u in units] == [(layer, g) for layer in range(layers) for g in range(groups)]
    for k, unit in enumerate(units):
        assert unit.buffer == k % buffers
        # A copy waits for a scatter exactly when its buffer served an earlier unit of the call...
        assert unit.reuse == any(u.buffer == unit.buffer for u in units[:k])
        # ...and never for one of the ``buffers - 1`` units before it: the copy engine runs ahead.
        assert unit.buffer not in {u.buffer for u in units[max(0, k - buffers + 1) : k]}
    ends = [u for u in units if u.ends_layer]
    assert [u.layer for u in ends] == list(range(layers))
    assert all(u.group == groups - 1 for u in ends)  # a layer is ready after its last group only


def test_schedule_replayed_on_two_streams_never_overwrites_an_unread_buffer() -> None:
    # Replay the issue order on a model of the two streams: the copy stream runs as far ahead as
    # its waits allow (the worst case for reuse), the scatter stream as late as possible. Each
    # scatter must find its own unit's bytes in the buffer.
    units = layer_schedule(6, 4, LAYER_BUFFERS)
    contents: dict[int, int] = {}
    scattered: set[int] = set()
    last_reader: dict[int, int] = {}  # buffer -> unit whose scatter frees it
    copied = 0
    for k, unit in enumerate(units):
        # The copy stream runs every copy whose wait (the previous reader of its buffer) is met.
        while copied < len(units):
            nxt = units[copied]
            waits_for = last_reader.get(nxt.buffer) if nxt.reuse else None
            if waits_for is not None and waits_for not in scattered:
                break
            contents[nxt.buffer] = copied
            last_reader[nxt.buffer] = copied
            copied += 1
        assert contents[unit.buffer] == k, f"unit {k} would scatter unit {contents[unit.buffer]}'s bytes"
        scattered.add(k)
    assert copied == len(units)


def test_staging_split_into_up_to_three_equal_buffers() -> None:
    cases = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (3, 1), 64: (3, 21), 128: (3, 42), 122: (3, 40)}
    for slabs, expected in cases.items():
        count, each = split_layer_staging(slabs)
        assert (count, each) == expected, slabs
        assert count * each <= slabs


def test_slab_runs_join_consecutive_pages_within_one_registration() -> None:
    # Registrations of 4 pages: 0-3, 4-7, 8-11. Runs never cross one (a copy may not span two
    # cudaHostRegister ranges) and never join pages that are not consecutive.
    ids = [2, 3, 4, 5, 6, 9, 8, 10, 11, 12]
    assert slab_runs(ids, 4) == [(0, 2, 2), (2, 4, 3), (5, 9, 1), (6, 8, 1), (7, 10, 2), (9, 12, 1)]
    assert slab_runs(ids, 1) == [(j, p, 1) for j, p in enumerate(ids)]
    assert slab_runs(list(range(5)), 100) == [(0, 0, 5)]
    assert slab_runs([], 4) == []
    covered = [p for _, first, n in slab_runs(ids, 4) for p in range(first, first + n)]
    assert covered == ids


# -- pacing: how far a layer-wise load is queued ahead of the GPU ----------------------------------


def test_pace_window_in_bytes_never_below_the_buffers() -> None:
    assert pace_window(42 << 20) == PACE_BYTES // (42 << 20)  # a 32K-token 8B hit: 6 units of 42 MiB
    assert pace_window(1 << 40) == LAYER_BUFFERS + 1  # huge units: still one ahead of the buffers
    assert pace_window(1 << 20, pace_bytes=8 << 20) == 8
    with pytest.raises(ValueError, match="positive"):
        pace_window(0)


@pytest.mark.parametrize(("count", "window"), [(1, 4), (10, 4), (128, 6), (5, 5)])
def test_feed_issues_in_order_each_after_the_unit_a_window_earlier(count: int, window: int) -> None:
    done: set[int] = set()  # units the "GPU" finished: only those the feeder waited for
    trace: list[tuple[str, int]] = []

    def issue(k: int) -> None:
        if k >= window:  # waiting for a unit covers the earlier ones (a stream completes in order)
            assert k - window <= max(done, default=-1), f"unit {k} queued before unit {k - window} was done"
        trace.append(("issue", k))

    def wait(k: int) -> None:
        assert ("issue", k) in trace, f"waited for unit {k} before queuing it"
        done.add(k)
        trace.append(("wait", k))

    assert feed_paced(count, window, issue, wait, lambda: False) == count
    assert [k for op, k in trace if op == "issue"] == list(range(count))
    waits = [k for op, k in trace if op == "wait"]
    assert waits == sorted(set(waits)), "waits for later and later units"
    # At any time at most `window` units are queued and not known done (a wait covers every unit
    # up to the one waited for: a stream completes in order).
    known = -1
    for op, k in trace:
        if op == "wait":
            known = k
        else:
            assert k - known <= window
    # Woken once per half window, not once per unit: the feeding thread takes the GIL back rarely.
    half = max(1, window // 2)
    assert len(waits) <= -(-max(0, count - window) // half), waits


def test_feed_stops_before_the_next_unit_and_after_a_wait() -> None:
    issued: list[int] = []
    stop = [False]

    def issue(k: int) -> None:
        issued.append(k)
        if k == 2:
            stop[0] = True

    assert feed_paced(10, 4, issue, lambda k: None, lambda: stop[0]) == 3
    assert issued == [0, 1, 2]

    issued.clear()
    stop[0] = False

    def wait(k: int) -> None:
        stop[0] = True  # stopped while waiting for the GPU: the unit that needed the wait is not queued

    assert feed_paced(10, 4, issued.append, wait, lambda: stop[0]) == 4
    assert issued == [0, 1, 2, 3]


def test_feed_propagates_a_failed_issue_with_the_count_so_far() -> None:
    def issue(k: int) -> None:
        if k == 5:
            raise RuntimeError("launch refused")

    with pytest.raises(RuntimeError, match="launch refused"):
        feed_paced(10, 4, issue, lambda k: None, lambda: False)
