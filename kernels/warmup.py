"""The warm-up: compile and launch, once, every Triton variant a :class:`PageMover`'s copies use.

Triton compiles a kernel per variant (:data:`aiokv.kernels.launch.LaunchKey`: constexprs, and for
each other argument its type and whether it is divisible by 16; an int equal to 1 is a variant of
its own). A variant's first launch compiles it (or loads it from Triton's disk cache) and loads it
onto the device: ~0.3 s on an H200 host, a loop stall when a cache's first copy launches it on the
event loop. :func:`warm_up` does that work beforehand, on the thread that calls it, in four steps:

1. *Enumerate* (:func:`variants_of`): run the mover's own planning (:meth:`PageMover._chunks`,
   ``_deal`` and ``_lane_slices`` over the staging lanes, ``_layer_chunks`` for layer-wise loads)
   for every call shape that can reach a new variant, through scratch twins of its plans
   (:meth:`CopyPlan.scratch_twin`: same constants and pointer alignment, strides of the same class)
   that only name their variants. Only the slot indices (their offset in a lane's index tensor),
   the token count, the skip and the first layer vary between the calls of one plan; the shapes
   reach every class of them: whole pages over the staging lanes, 1..3x the staging pages (every
   partial chunk of each lane, the chunks after the first at both offset parities); layer-wise
   loads, 1..4x a layer buffer's capacity; the DIRECT plan, 1..16 pages (every count modulo 16);
   skips, see :func:`skip_values`; layers, the first of each class. The result, the variants and one
   call that first reaches each, is kept per process for movers whose plans have the same
   :meth:`CopyPlan.variant_signature` (a bounded table): a second cache does not enumerate again.
2. *Compile apart* (CUDA): a helper process compiles the variants not yet loaded in this process
   into Triton's disk cache (:mod:`aiokv.kernels.precompile`): Triton's compile holds the GIL for
   ~20 ms stretches, which stalled the event loop while the warm-up compiled on its thread. Variants
   an earlier helper listed there, under the same fingerprint and with Triton's entry whole, are left
   out: a restart with a warm cache starts no helper (its start-up took 1.7-2.9 s before the first
   launch). A listed variant whose launch here compiled after all is counted (``precompile_error``)
   and its listing removed.
3. *Launch* each variant not yet loaded in this process once, on the twins' scratch and a stream
   of its own (copies may run meanwhile), as soon as the helper has it: Triton then loads the
   binary from its disk cache (~2 ms of Python each) instead of compiling. A variant the helper
   could not compile is compiled here, as without it.

4. *Prime the host allocator* (CUDA, once a process per device, before the launches; a cache's
   start already did it on its own thread): a copy uploads its slot and page indices through fresh
   pinned buffers (:meth:`PageMover._index`) from torch's caching host allocator, which rounds a
   request up to a power of two and keeps freed blocks; the first request of a size class called
   ``cudaHostAlloc`` on the event loop (5-24 ms on an H200 host). On an H100 host a first load
   still stalled the loop 14 ms on that line with the start's priming then (one block a class from
   64 B; the forty-fourth session): whether in the driver or in taking the GIL back after it is not
   known; every class from 8 B with two blocks creates no block for such indices (GPU test), and
   the timing tests passed once after. :data:`PRIMED_BLOCKS` blocks of every class from 8 B to the largest
   index (the slots or pages, at most :data:`PINNED_INDEX_CAP` elements) are taken and freed
   (torch allocates without the GIL). A priming the stop cut short (or a block refused: logged,
   the start or warm-up goes on) leaves the device unprimed: a later one primes it
   (:func:`prime_host_allocator`).

Calls of page-aligned shapes (skip 0: what an engine whose blocks are pages does), on every path a
copy may take, come first; ``on_ready`` is called once they are launched and done on the device.
Variants a warm-up launched on a device are remembered per process: a later warm-up of the same
variants on that device launches nothing. Warm-ups of one device run one at a time.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

# Imported with this module (with the package, before an event loop runs), not at the first
# warm-up: there it ran on the warm-up's thread under the loop, and compiling its source (no cached
# bytecode: PYTHONDONTWRITEBYTECODE, a fresh tree) holds the GIL throughout: 8.6 ms on the CPU test
# machine, 4.1 ms before the cache listings doubled the file. It imports the standard library only.
from . import precompile as precompiler
from .paths import TransferPath, interpreting

if TYPE_CHECKING:
    from .launch import CopyPlan, LaunchKey
    from .mover import PageMover, _Lane

log = logging.getLogger(__name__)

MEMO_ENTRIES = 32
"""Enumerations kept per process (one per distinct set of plan signatures; a few KiB each)."""

YIELD_S = 0.0005
"""Pause between two launches, and every :data:`PACE_S` of enumeration (GIL released): a loop thread
asking for the GIL gets it within that much Python work, not the interpreter's 5 ms switch interval."""

PACE_S = 0.002


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
    skipped: int = 0
    """Variants the copies use that were loaded in this process already (not launched again)."""
    precompiled: int = 0
    """Variants a helper process compiled into Triton's disk cache before their launch here."""
    precompile_error: str | None = None
    """Why the helper process did not compile every variant (None: it did, or none was needed)."""
    cached: int = 0
    """Variants an earlier helper had left in Triton's disk cache (listed there): launched without a helper."""


class _Stopped(Exception):
    """Internal: the caller asked the warm-up to stop."""


def skip_values(tokens: int) -> list[int]:
    """Skips whose launches cover every skip in ``[0, tokens)``: a skip ``s >= 18`` has the
    specialization, residue modulo 16 and parity of ``16 + s % 16`` (or ``s % 16`` when that is at
    least 2), so of one in ``[0, 18)``; ``tokens - 1`` is the load of a page's last token alone."""
    return sorted(set(range(min(tokens, 18))) | {tokens - 1})


# -- enumeration ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One twin call that reaches new variants: its plan's index in :func:`_roles`, its arguments."""

    role: int
    op: Literal["gather", "scatter"]
    slots: tuple[int, int]
    """``(offset, length)`` of its slots in a fresh index tensor (the offset sets their alignment)."""
    ids: int | None
    """Page ids passed (all 0), or None."""
    skip: int
    layer: int | None
    """The one layer scattered, or None: all."""
    keys: tuple[LaunchKey, ...]
    """The variants it launches first."""


@dataclass(frozen=True)
class Variants:
    """The variants a mover's copies use, and one call reaching each (see the module docstring)."""

    keys: tuple[LaunchKey, ...]
    calls: tuple[_Call, ...]
    ready_calls: int
    """The first ``ready_calls`` calls are those of page-aligned shapes."""


_memo: collections.OrderedDict[tuple[object, ...], Variants] = collections.OrderedDict()
_loaded: dict[str, set[LaunchKey]] = {}
"""Per device: variants launched by a finished warm-up (compiled kernels only: their modules stay loaded)."""
_turns: dict[str, threading.Lock] = {}
"""Per device: held by the warm-up running there (a later one then finds the variants loaded)."""
_state_lock = threading.Lock()

_primed: dict[str, int] = {}
"""Per device: the largest index (int64 elements) whose size classes are primed in this process
(step 4)."""
_priming: set[str] = set()
"""Devices whose priming runs now (a second one beside it does nothing)."""

PINNED_INDEX_CAP = 1 << 21
"""Largest index (int64 elements, 16 MiB) whose pinned blocks step 4 takes ahead."""

PRIMED_BLOCKS = 2
"""Blocks of each class step 4 takes at once (a load's slot and page-id indices can be in flight
together)."""


def primed_elements(most: int) -> list[int]:
    """Element counts of the size classes (powers of two) an int64 index of 1 to ``most`` elements
    falls in, ``most`` capped at :data:`PINNED_INDEX_CAP`."""
    top = min(max(most, 1), PINNED_INDEX_CAP)
    classes = [1]
    while classes[-1] < top:
        classes.append(classes[-1] * 2)
    return classes


def prime_host_allocator(device: torch.device, most: int, stop: threading.Event | None = None) -> bool:
    """Step 4 of the module docstring for indices of up to ``most`` elements (a cache's slots or
    pages, whichever are more), once a process per device and size; True when this call primed.
    ``stop`` (looked at before each size class) cuts it short: then, as where a block is refused
    (raised), the device is not marked primed and a later call primes it (review 308: a mark taken
    first left a device part primed for good)."""
    if device.type != "cuda":
        return False
    key = str(device)
    classes = primed_elements(most)
    with _state_lock:
        if _primed.get(key, 0) >= classes[-1] or key in _priming:
            return False
        _priming.add(key)
    done = False
    held: list[torch.Tensor] = []
    try:
        for elements in classes:
            if stop is not None and stop.is_set():
                return False
            held.extend(torch.empty(elements, dtype=torch.int64, pin_memory=True) for _ in range(PRIMED_BLOCKS))
        done = True
        return True
    finally:
        del held  # freed unused by any stream: cached for the next request of the class
        with _state_lock:
            _priming.discard(key)
            if done:
                _primed[key] = max(_primed.get(key, 0), classes[-1])


def prime_quietly(device: torch.device, most: int, stop: threading.Event | None = None) -> bool:
    """:func:`prime_host_allocator` as a cache's start and the warm-up run it: a block refused
    (pinned memory short) is logged, not raised. Priming only spares the first copies an allocation
    on the loop: failing a start for it, or the warm-up (``wait_warm`` answered None,
    ``warm_up_failed`` counted, every variant warm), would cost more than it saves."""
    try:
        return prime_host_allocator(device, most, stop)
    except RuntimeError as err:
        log.warning("could not prime the pinned host allocator on %s (the first copies allocate their "
                    "index buffers themselves): %s", device, err)
        return False


def _roles(mover: PageMover) -> list[tuple[CopyPlan, int]]:
    """The plans the mover launches through, in a fixed order, each with the pages a twin needs."""
    roles: list[tuple[CopyPlan, int]] = []
    if mover.effective_path is TransferPath.STAGING:
        for lane in mover._offload_lanes + mover._load_lanes:
            assert lane.plan is not None and lane.staging is not None
            roles.append((lane.plan, lane.staging.shape[0]))
        if mover._layered is not None:
            roles.extend((plan, mover._layered.capacity) for plan in mover._layered.plans)
    try:
        roles.append((mover._direct_plan(), 1))  # the twin's scratch has one page
    except ValueError:
        pass  # the pool is not mapped for the kernels: a real DIRECT copy would fail alike
    return roles


def _signature(mover: PageMover, roles: list[tuple[CopyPlan, int]]) -> tuple[object, ...]:
    """What the enumeration's result depends on: the plans' variant signatures and the call shapes."""
    layered = mover._layered
    return (
        mover.effective_path, mover.kv.layout.page_tokens, mover.kv.layout.num_layers,
        tuple(len(lanes) for lanes in (mover._offload_lanes, mover._load_lanes)),
        None if layered is None else (layered.capacity, len(layered.plans)),
        tuple((plan.variant_signature(), pages) for plan, pages in roles),
    )


def variants_of(mover: PageMover) -> tuple[Variants, bool]:
    """The variants ``mover``'s copies use (see the module docstring) and whether they were known
    already (kept from an earlier mover of the same signature in this process). Thread-safe."""
    roles = _roles(mover)
    signature = _signature(mover, roles)
    with _state_lock:
        known = _memo.get(signature)
        if known is not None:
            _memo.move_to_end(signature)
            return known, True
    found = _Enumeration(mover, roles).run()
    with _state_lock:
        _memo[signature] = found
        _memo.move_to_end(signature)
        while len(_memo) > MEMO_ENTRIES:
            _memo.popitem(last=False)
    return found, False


class _Enumeration:
    """The call shapes of each plan the mover launches; one recorded call per new variant."""

    def __init__(self, mover: PageMover, roles: list[tuple[CopyPlan, int]]) -> None:
        from .launch import TwinLaunches, specialization

        self.spec = specialization
        self.mover = mover
        self.tokens = mover.kv.layout.page_tokens
        self.named = TwinLaunches(launch=False)
        cpu = torch.device("cpu")  # twins that launch nothing need no device memory
        self.twins = {id(plan): (i, plan.scratch_twin(self.named, pages, cpu)) for i, (plan, pages) in enumerate(roles)}
        self.calls: list[_Call] = []
        self.done: set[object] = set()
        self.since = time.perf_counter()
        classes: dict[object, int] = {}
        for layer in range(mover.kv.layout.num_layers):
            classes.setdefault(specialization(layer), layer)
        self.layers = sorted(classes.values())

    def run(self) -> Variants:
        self.phase(aligned=True)
        ready = len(self.calls)
        self.phase(aligned=False)
        return Variants(tuple(self.named.keys), tuple(self.calls), ready)

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

    def whole_pages(self, lanes: list[_Lane], skips: list[int] | None) -> None:
        """Offloads (``skips`` None) or loads of 1..3x the staging pages over ``lanes``, chunked and
        indexed as :meth:`PageMover.offload`/:meth:`PageMover.load` do."""
        mover, tokens = self.mover, self.tokens
        capacity = sum(lane.staging.shape[0] for lane in lanes if lane.staging is not None)
        for count in range(1, 3 * capacity + 1):
            for skip in skips or [0]:
                chunks = mover._chunks(count, list(range(count)), skip, tokens)
                for lane, mine in mover._deal(chunks, lanes):
                    for chunk, (a, b) in zip(mine, mover._lane_slices(mine), strict=True):
                        # Each lane's index is a fresh tensor: a chunk's slots start at offset a in it.
                        if self.new(id(lane.plan), a, b - a, chunk.skip):
                            op: Literal["gather", "scatter"] = "gather" if skips is None else "scatter"
                            self.call(lane.plan, op, (a, b - a), None, chunk.skip, None)

    def layered(self, skips: list[int]) -> None:
        """STAGING layer-wise loads of 1..4x a layer buffer's capacity, grouped and indexed as
        :meth:`PageMover.load_layers`/:meth:`PageMover.start_layers` do: each group shape on each
        buffer's plan, for a layer of each class."""
        mover, tokens = self.mover, self.tokens
        staging = mover._layered
        if staging is None:
            return
        capacity = staging.capacity
        for count in range(1, 4 * capacity + 1):
            ids = list(range(count))
            for skip in skips:
                for group in mover._layer_chunks(ids, skip, capacity, tokens):
                    slots = (group.slot_begin, group.slot_end - group.slot_begin)
                    if self.new("layered", *slots, group.skip):
                        for plan in staging.plans:
                            for layer in self.layers:
                                self.call(plan, "scatter", slots, None, group.skip, layer)

    def direct(self, gathers: bool, skips: list[int]) -> None:
        """DIRECT copies of 1..16 pages, indexed as :meth:`PageMover.offload`/``load``/``load_layers``
        do (fresh index tensors): gathers (offloads), whole-page and per-layer scatters."""
        try:
            plan = self.mover._direct_plan()
        except ValueError:
            return
        tokens = self.tokens
        for count in range(1, 17):
            if gathers and self.new("gather", 0, count * tokens, 0, True):
                self.call(plan, "gather", (0, count * tokens), count, 0, None)
            for skip in skips:
                slots = (0, count * tokens - skip)
                if self.new("scatter", *slots, skip, True):
                    self.call(plan, "scatter", slots, count, skip, None)
                    for layer in self.layers:
                        self.call(plan, "scatter", slots, count, skip, layer)

    def new(self, plan: object, offset: int, length: int, skip: int, ids: bool = False) -> bool:
        """Whether a call of ``plan`` with these varying arguments may reach a variant not named yet
        (slots at ``offset`` of a fresh int64 tensor: their alignment; page ids: a fresh tensor)."""
        now = time.perf_counter()
        if now - self.since >= PACE_S:  # let a waiting event loop have the GIL (see YIELD_S)
            time.sleep(YIELD_S)
            self.since = time.perf_counter()
        spec = self.spec
        shape = (plan, (offset * 8) % 16, spec(length), spec(skip), ids)
        if shape in self.done:
            return False
        self.done.add(shape)
        return True

    def call(self, plan: CopyPlan | None, op: Literal["gather", "scatter"], slots: tuple[int, int], ids: int | None,
             skip: int, layer: int | None) -> None:
        """Run the call on ``plan``'s naming twin; record it when it names new variants."""
        assert plan is not None
        role, twin = self.twins[id(plan)]
        before = len(self.named.keys)
        offset, length = slots
        index = torch.zeros(offset + length, dtype=torch.int64)[offset:]
        page_ids = None if ids is None else torch.zeros(ids, dtype=torch.int64)
        if op == "gather":
            twin.gather(index, page_ids)
        else:
            twin.scatter(page_ids, index, skip, None if layer is None else range(layer, layer + 1))
        if len(self.named.keys) > before:
            self.calls.append(_Call(role, op, slots, ids, skip, layer, tuple(self.named.keys[before:])))


# -- the warm-up ------------------------------------------------------------------------------------


def warm_up(
    mover: PageMover,
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
    precompile: bool = True,
) -> WarmUp:
    """Launch every Triton variant ``mover``'s copies can launch and this process has not loaded
    yet, once, on scratch (module docstring).

    Blocks the calling thread until its launches completed on the device (run it off the event
    loop); ``on_ready()`` is called from it once the variants of page-aligned calls are warm (also
    when it fails or stops before: nobody waits for it in vain). ``stop`` set: returns early
    (``stopped``; a helper process is killed). ``precompile``: on CUDA, compile in a helper process
    first (:mod:`aiokv.kernels.precompile`). Nothing to do for the REFERENCE path (no kernels).
    Raises what a launch raises (a compile error, out of device memory).
    """
    began = time.perf_counter()
    ready_called = False

    def ready() -> None:
        nonlocal ready_called
        if not ready_called and on_ready is not None:
            ready_called = True
            on_ready()

    try:
        if mover.effective_path is TransferPath.REFERENCE:
            return WarmUp(0, 0, 0.0, 0.0, False)
        with _turn(mover.kv.device, stop) as waited:
            if not waited:
                return WarmUp(0, 0, 0.0, 0.0, True)
            # First: a TP rank's copies may come before the warm-up ends (a cache primed at start).
            prime_quietly(mover.kv.device, max(mover.kv.num_slots, mover.pages.shape[0]), stop)
            return _Launches(mover, stop, precompile, began).run(ready)
    finally:
        ready()


@contextlib.contextmanager
def _turn(device: torch.device, stop: threading.Event | None) -> Iterator[bool]:
    """The warm-ups of one device one at a time; False: stopped while waiting for the one before."""
    with _state_lock:
        turn = _turns.setdefault(str(device), threading.Lock())
    while not turn.acquire(timeout=0.05):
        if stop is not None and stop.is_set():
            yield False
            return
    try:
        yield True
    finally:
        turn.release()


class _Launches:
    """Step 2 and 3 of one warm-up (module docstring)."""

    def __init__(self, mover: PageMover, stop: threading.Event | None, precompile: bool, began: float) -> None:
        from .launch import TwinLaunches

        self.mover = mover
        self.stop = stop
        self.began = began
        self.device = mover.kv.device
        self.compiled = _compiles(self.device)
        self.variants, _ = variants_of(mover)
        with _state_lock:
            loaded = set(_loaded.get(str(self.device), ())) if self.compiled else set()
        self.launches = TwinLaunches(done=loaded)
        self.pending = [key for key in self.variants.keys if key not in loaded]
        self.pending_set = set(self.pending)
        self.skipped = len(self.variants.keys) - len(self.pending)
        self.want_precompile = precompile and self.compiled and bool(self.pending)
        self.child: precompiler.Precompile | None = None
        self.child_index: dict[LaunchKey, int] = {}
        """The variants the helper compiles: their index in its keys."""
        self.listed: dict[LaunchKey, str] = {}
        """The variants found listed in Triton's cache: the hash of their entry there."""
        self.listing: tuple[str, dict[str, object]] | None = None
        """Triton's cache directory and this process's fingerprint (None: no helper wanted or possible)."""
        self.roles = _roles(mover)
        self.twins: dict[int, CopyPlan] = {}
        self.stream: torch.cuda.Stream | None = None
        self.index: torch.Tensor | None = None

    def run(self, ready: Callable[[], None]) -> WarmUp:
        variants = self.variants
        stopped = False
        ready_at: tuple[int, float] | None = None
        try:
            with self.on_device():
                try:
                    if self.stop is not None and self.stop.is_set():
                        raise _Stopped
                    if self.want_precompile:
                        self.start_child()
                    for number, call in enumerate(variants.calls):
                        if number == variants.ready_calls:
                            ready_at = self.ready(ready)
                        self.launch(call)
                    if ready_at is None:
                        ready_at = self.ready(ready)
                except _Stopped:
                    stopped = True
                finally:
                    self.synchronize()
        finally:
            if self.child is not None:
                self.child.close()
        if not stopped and self.compiled:
            with _state_lock:
                _loaded.setdefault(str(self.device), set()).update(self.launches.launched)
        launched = len(self.launches.keys)
        ready_variants, ready_s = ready_at or (launched, time.perf_counter() - self.began)
        child = self.child
        error = None if child is None else child.error or _failures(child.failures)
        if child is None and self.want_precompile and len(self.listed) < len(self.pending):
            error = "the helper process was not started"
        stale = self.stale() if not stopped else None
        if stale is not None:
            error = stale if error is None else f"{error}; {stale}"
        if error is not None and not stopped:
            log.warning("aiokv: kernel variants compiled in this process (%s): the event loop may stall", error)
        return WarmUp(launched, ready_variants, time.perf_counter() - self.began, ready_s, stopped, self.skipped,
                      0 if child is None else child.ok, None if stopped else error, len(self.listed))

    def ready(self, ready: Callable[[], None]) -> tuple[int, float]:
        # Done on the device before copies go on: they may use what the warm-up built for the
        # mover (the DIRECT plan's address tables, copied to the GPU on this stream).
        self.synchronize()
        at = (len(self.launches.keys), time.perf_counter() - self.began)
        ready()
        return at

    def start_child(self) -> None:
        """Start the helper for the pending variants not listed in Triton's cache (none: no helper)."""
        try:
            target, cache_dir = _compile_target()
        except Exception as exc:  # another Triton's API: compile here, as without a helper
            log.debug("aiokv: no helper process for the kernel compiles: %r", exc)
            return
        try:
            listing = precompiler.fingerprint(target)
        except Exception as exc:  # another Triton's layout: a helper for every variant, unlisted
            log.debug("aiokv: Triton's cache is not listed (%r): a helper compiles every variant", exc)
        else:
            self.listing = (cache_dir, listing)
            since = time.perf_counter()
            for key in self.pending:
                if self.stop is not None and self.stop.is_set():
                    raise _Stopped
                if time.perf_counter() - since >= PACE_S:  # a few syscalls a key: let the loop in
                    time.sleep(YIELD_S)
                    since = time.perf_counter()
                try:
                    found = precompiler.listed_variant(cache_dir, listing, key)
                except Exception as exc:  # never here by design: the helper compiles it, as unlisted
                    log.debug("aiokv: the listing of %r could not be read: %r", key, exc)
                    found = None
                if found is not None:
                    self.listed[key] = found
        missing = [key for key in self.pending if key not in self.listed]
        if missing:
            self.child_index = {key: i for i, key in enumerate(missing)}
            self.child = precompiler.Precompile(missing, target, cache_dir,
                                               None if self.listing is None else self.listing[1])

    def stale(self) -> str | None:
        """Count (and forget) listed variants this process compiled itself (see :func:`stale_entries`)."""
        if not self.listed or self.listing is None:
            return None
        launched = set(self.launches.launched)
        listed = {key: value for key, value in self.listed.items() if key in launched}
        index = self.device.index
        if self.device.type == "cuda" and index is None:
            index = torch.cuda.current_device()
        stale = precompiler.stale_entries(listed, index)
        if not stale:
            return None
        precompiler.forget(*self.listing, stale)
        return f"{len(stale)} variant(s) listed in Triton's cache were compiled in this process (listing removed)"

    def launch(self, call: _Call) -> None:
        """``call`` on its plan's scratch twin, once the helper process compiled its new variants."""
        if self.stop is not None and self.stop.is_set():
            raise _Stopped
        new = [key for key in call.keys if key in self.pending_set and key not in self.launches.keys]
        if not new:
            return  # loaded already: the twin would launch nothing
        if self.child is not None:
            for key in new:
                if key in self.child_index:
                    self.child.wait(self.child_index[key], self.stop)
            if self.stop is not None and self.stop.is_set():
                raise _Stopped
        plan, pages = self.roles[call.role]
        twin = self.twins.get(call.role)
        if twin is None:
            twin = self.twins[call.role] = plan.scratch_twin(self.launches, pages)
        offset, length = call.slots
        slots = self.zeros(offset + length)[offset:]
        ids = None if call.ids is None else self.zeros(call.ids)
        if call.op == "gather":
            twin.gather(slots, ids)
        else:
            twin.scatter(ids, slots, call.skip, None if call.layer is None else range(call.layer, call.layer + 1))
        if self.compiled:
            time.sleep(YIELD_S)

    def zeros(self, length: int) -> torch.Tensor:
        """``length`` slots 0 at the start of an int64 tensor on the device (a fresh allocation's alignment)."""
        if self.index is None or self.index.numel() < length:
            self.index = torch.zeros(max(length, 4096), dtype=torch.int64, device=self.device)
        return self.index[:length]

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The KV device and a stream of the warm-up's own current on this thread (CUDA)."""
        if self.device.type != "cuda":
            yield
            return
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(self.stream):
                yield

    def synchronize(self) -> None:
        """Wait (host, GIL released) until the launches are done on the device: scratch is freed
        after, and the first real copy finds the kernels loaded, not still launching."""
        if self.stream is not None:
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self.stream)
            done.synchronize()


def _compiles(device: torch.device) -> bool:
    """Whether launches on ``device`` compile (CUDA, not the interpreter): then variants stay loaded
    and a helper process compiles them first."""
    return device.type == "cuda" and not interpreting()


def _compile_target() -> tuple[object, str]:
    """Triton's target for the current device and its disk cache directory, as this process resolves them."""
    import triton

    return triton.runtime.driver.active.get_current_target(), str(triton.knobs.cache.dir)


def _failures(failures: dict[int, str]) -> str | None:
    if not failures:
        return None
    index, why = next(iter(failures.items()))
    return f"{len(failures)} variant(s) failed in the helper process, the first ({index}): {why}"
