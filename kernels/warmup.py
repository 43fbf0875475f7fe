"""The warm-up: compile and launch, once, every Triton variant a :class:`PageMover`'s copies use.

Triton compiles a kernel per variant (:data:`aiokv.kernels.launch.LaunchKey`: constexprs, and for
each other argument its type and whether it is divisible by 16; an int equal to 1 is a variant of
its own). A variant's first launch compiles it (or loads it from Triton's disk cache) and loads it
onto the device: ~0.5 s on an H200, a loop stall when a cache's first copy launches it on the event
loop. :func:`warm_up` does that work beforehand, on the thread that calls it.

It runs the mover's own planning (:meth:`PageMover._chunks`, ``_deal`` and ``_lane_slices`` over the
staging lanes, ``_layer_chunks`` for layer-wise loads, ``_index`` for index tensors) for every call
shape that can reach a new variant, and launches through the same :class:`CopyPlan` code on a scratch
twin of each plan (:meth:`CopyPlan.scratch_twin`: same constants and pointer alignment, strides of
the same class, a few KiB of scratch). Only the slot indices (their offset in a lane's index
tensor), the token count, the skip and the first layer vary between the calls of one plan; the
shapes enumerated reach every class of them:

- whole pages over the staging lanes: 1..3x the staging pages (every partial chunk of each lane,
  the chunks after the first at both offset parities);
- layer-wise loads: 1..4x a layer buffer's capacity (one to four groups);
- the DIRECT plan: 1..16 pages (every page count modulo 16);
- skips: see :func:`skip_values`; layers: the first of each class (0, 1, 2 stand for all).

One launch per distinct set of the varying arguments' specializations is enough (the plan's own
are fixed); the twins also skip keys already launched. Everything runs on a stream of its own and
touches only the twins' scratch: copies may run meanwhile. Shapes of page-aligned calls (skip 0:
what an engine whose blocks are pages does), on every path a copy may take, come first; ``on_ready``
is called once they are warm.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .paths import TransferPath

if TYPE_CHECKING:
    from .launch import CopyPlan, LaunchKey
    from .mover import PageMover, _Lane


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did."""

    variants: int
    """Distinct kernel variants launched (each compiled, or loaded from Triton's cache, at its first)."""
    ready_variants: int
    """Of those, the variants of page-aligned calls, warm when ``on_ready`` was called."""
    seconds: float
    ready_seconds: float
    stopped: bool
    """``stop`` was set before the end: some variants may not be warm."""


class _Stopped(Exception):
    """Internal: the caller asked the warm-up to stop."""


def skip_values(tokens: int) -> list[int]:
    """Skips whose launches cover every skip in ``[0, tokens)``: a skip ``s >= 18`` has the
    specialization, residue modulo 16 and parity of ``16 + s % 16`` (or ``s % 16`` when that is at
    least 2), so of one in ``[0, 18)``; ``tokens - 1`` is the load of a page's last token alone."""
    return sorted(set(range(min(tokens, 18))) | {tokens - 1})


def warm_up(
    mover: PageMover, stop: threading.Event | None = None, on_ready: Callable[[], None] | None = None
) -> WarmUp:
    """Launch every Triton variant ``mover``'s copies can launch, once, on scratch (module docstring).

    Blocks the calling thread until its launches completed on the device (run it off the event
    loop); ``on_ready()`` is called from it once the variants of page-aligned calls are warm (also
    when it fails or stops before: nobody waits for it in vain). ``stop`` set: returns early
    (``stopped``). Nothing to do for the REFERENCE path (no kernels). Raises what a launch raises
    (a compile error, out of device memory).
    """
    began = time.perf_counter()
    if mover.effective_path is TransferPath.REFERENCE:
        if on_ready is not None:
            on_ready()
        return WarmUp(0, 0, 0.0, 0.0, False)
    run = _Run(mover, stop)
    ready: tuple[int, float] | None = None
    stopped = False
    try:
        with run.on_device():
            try:
                run.phase(aligned=True)
                # Done on the device before copies go on: they may use what the warm-up built for the
                # mover (the DIRECT plan's address tables, copied to the GPU on this stream).
                run.synchronize()
                ready = (len(run.seen), time.perf_counter() - began)
                if on_ready is not None:
                    on_ready()
                run.phase(aligned=False)
            except _Stopped:
                stopped = True
            finally:
                run.synchronize()
    finally:
        if ready is None and on_ready is not None:
            on_ready()
    variants, ready_s = ready or (len(run.seen), time.perf_counter() - began)
    return WarmUp(len(run.seen), variants, time.perf_counter() - began, ready_s, stopped)


class _Run:
    """One warm-up: the call shapes of each plan the mover launches, one launch per new key."""

    def __init__(self, mover: PageMover, stop: threading.Event | None) -> None:
        from .launch import specialization  # loaded already: the mover's plans launch through it

        self.spec = specialization
        self.mover = mover
        self.stop = stop
        self.seen: set[LaunchKey] = set()
        self.tokens = mover.kv.layout.page_tokens
        self.stream: torch.cuda.Stream | None = None
        self.lane: _Lane | None = None
        self.twins: dict[int, CopyPlan] = {}
        self.done: set[object] = set()
        classes: dict[object, int] = {}
        for layer in range(mover.kv.layout.num_layers):
            classes.setdefault(specialization(layer), layer)
        self.layers = sorted(classes.values())

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The KV device and a stream of the warm-up's own current on this thread (CUDA)."""
        from .mover import _Lane

        device = self.mover.kv.device
        if device.type != "cuda":
            self.lane = _Lane(None, None, None)
            yield
            return
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.lane = _Lane(self.stream, None, None)
            with torch.cuda.stream(self.stream):
                yield

    def phase(self, aligned: bool) -> None:
        """Page-aligned calls (skip 0), or all the others."""
        skips = [0] if aligned else [s for s in skip_values(self.tokens) if s]
        mover = self.mover
        if mover.effective_path is TransferPath.STAGING:
            if aligned:
                self.whole_pages(mover._offload_lanes, None)
            self.whole_pages(mover._load_lanes, skips)
            self.layered(skips)
            # Loads read the pool DIRECT while a paced layer-wise load holds the staging.
            self.direct(gathers=False, skips=skips)
        else:
            self.direct(gathers=aligned and mover.kv.tp.writer, skips=skips)

    # -- call shapes ----------------------------------------------------------------------------

    def whole_pages(self, lanes: list[_Lane], skips: list[int] | None) -> None:
        """Offloads (``skips`` None) or loads of 1..3x the staging pages over ``lanes``, chunked and
        indexed as :meth:`PageMover.offload`/:meth:`PageMover.load` do."""
        mover, tokens = self.mover, self.tokens
        capacity = sum(lane.staging.shape[0] for lane in lanes if lane.staging is not None)
        index = self.index(3 * capacity * tokens)  # each lane's is a fresh tensor like this one
        for count in range(1, 3 * capacity + 1):
            for skip in skips or [0]:
                chunks = mover._chunks(count, list(range(count)), skip, tokens)
                for lane, mine in mover._deal(chunks, lanes):
                    assert lane.staging is not None
                    twin = self.twin(lane.plan, lane.staging.shape[0])
                    for chunk, (a, b) in zip(mine, mover._lane_slices(mine), strict=True):
                        slots = index[a:b]
                        if self.new(id(lane.plan), slots, chunk.skip):
                            if skips is None:
                                twin.gather(slots, None)
                            else:
                                twin.scatter(None, slots, chunk.skip)

    def layered(self, skips: list[int]) -> None:
        """STAGING layer-wise loads of 1..4x a layer buffer's capacity, grouped and indexed as
        :meth:`PageMover.load_layers`/:meth:`PageMover.start_layers` do: each group shape on each
        buffer's plan, for a layer of each class."""
        mover, tokens = self.mover, self.tokens
        staging = mover._layered
        if staging is None:
            return
        capacity = staging.capacity
        twins = [self.twin(plan, capacity) for plan in staging.plans]
        index = self.index(4 * capacity * tokens)
        for count in range(1, 4 * capacity + 1):
            ids = list(range(count))
            for skip in skips:
                for group in mover._layer_chunks(ids, skip, capacity, tokens):
                    slots = index[group.slot_begin : group.slot_end]
                    if self.new("layered", slots, group.skip):
                        for twin in twins:
                            for layer in self.layers:
                                twin.scatter(None, slots, group.skip, range(layer, layer + 1))

    def direct(self, gathers: bool, skips: list[int]) -> None:
        """DIRECT copies of 1..16 pages, indexed as :meth:`PageMover.offload`/``load``/``load_layers``
        do: gathers (offloads), whole-page and per-layer scatters."""
        mover, tokens = self.mover, self.tokens
        try:
            plan = mover._direct_plan()
        except ValueError:
            return  # the pool is not mapped for the kernels: a real DIRECT copy would fail alike
        twin = self.twin(plan, 1)
        for count in range(1, 17):
            zero_ids = [0] * count  # the twin's scratch has one page
            if gathers:
                slots, ids = self.fresh([0] * (count * tokens)), self.fresh(zero_ids)
                if self.new("gather", slots, 0, ids):
                    twin.gather(slots, ids)
            for skip in skips:
                slots, ids = self.fresh([0] * (count * tokens - skip)), self.fresh(zero_ids)
                if self.new("scatter", slots, skip, ids):
                    twin.scatter(ids, slots, skip)
                    for layer in self.layers:
                        twin.scatter(ids, slots, skip, range(layer, layer + 1))

    # -- helpers --------------------------------------------------------------------------------

    def new(self, plan: object, slots: torch.Tensor, skip: int, ids: torch.Tensor | None = None) -> bool:
        """Whether a call of ``plan`` with these varying arguments may launch a variant not launched
        yet (first checking ``stop``)."""
        if self.stop is not None and self.stop.is_set():
            raise _Stopped
        spec = self.spec
        shape = (plan, spec(slots), spec(slots.numel()), spec(skip), None if ids is None else spec(ids))
        if shape in self.done:
            return False
        self.done.add(shape)
        return True

    def twin(self, plan: CopyPlan | None, pages: int) -> CopyPlan:
        """``plan``'s scratch twin, for launches that address pages below ``pages`` (one per plan)."""
        assert plan is not None
        twin = self.twins.get(id(plan))
        if twin is None:
            twin = self.twins[id(plan)] = plan.scratch_twin(self.seen, pages)
        return twin

    def index(self, length: int) -> torch.Tensor:
        """An index tensor of slots 0 as a copy makes one (fresh, on the KV device)."""
        return self.fresh(torch.zeros(length, dtype=torch.int64))

    def fresh(self, values: torch.Tensor | list[int]) -> torch.Tensor:
        assert self.lane is not None
        return self.mover._index(values, self.lane)

    def synchronize(self) -> None:
        """Wait (host, GIL released) until the launches are done on the device: scratch is freed
        after, and the first real copy finds the kernels loaded, not still launching."""
        if self.stream is not None:
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self.stream)
            done.synchronize()
