"""vLLM's shutdown while a promotion's read is held in the kernel (review 108).

The ext4 under the page files stops answering (``gate_helpers``: a FUSE-backed loop device whose
reads are held), a promotion's read into vLLM's CPU region is in flight, and vLLM shuts the tier
down. vLLM's contract (``TieringOffloadingManager.shutdown``): a tier whose shutdown raises may still
use the primary region, so vLLM keeps it mapped. The tier's shutdown waited for the read without a
bound: vLLM's shutdown hung for as long as the disk did. Now it waits ``close_timeout`` and then
raises, holding on to the region; once the read ends, a second shutdown goes through (root only).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm_helpers import CHUNK_BYTES, STEP, keys_of, make_manager, payload, step, store, tier_of

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import gated_ext4

CLOSE_S = 1.0
MARGIN_S = 3.0
BOUND_S = 30.0


def _hold_a_promotion(manager: Any, gate: Any, reads_started: bool = True,
                      held: Callable[[], None] | None = None) -> tuple[list[Any], Any]:
    """Two chunks stored, pushed out of vLLM's CPU tier, looked up again: their promotion's reads
    reach the gated file system and wait there. Returns their keys and the request context, once
    both reads started (``reads_started``): the gate holding a request is not enough, the ext4's
    own I/O is held there too (seen within a second with nothing of the tier's in flight), and a
    loop death then came before the loop took the job up (see
    test_shutdown_after_the_loop_died_before_a_posted_load_started_lets_go). ``held()`` runs once
    the gate holds, before the job is submitted."""
    keys = keys_of("held", 2)
    store(manager, "r1", keys, [1, 2])
    store(manager, "r2", keys_of("evictor", 8), range(100, 108))  # the CPU tier forgets keys
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
    step(manager)
    with manager.lock:
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 2
    gate.hold()
    if held is not None:
        held()
    with manager.lock:
        manager.on_schedule_end(STEP)  # submit_load: the reads reach the gate and wait there
    gate.wait_held()
    if reads_started:
        _until_reads_in_flight(manager, 2)
    return keys, ctx


def _until_reads_in_flight(manager: Any, reads: int) -> None:
    """Until the disk tier has ``reads`` page reads started: each holds an I/O slot until its
    completion (which the held gate keeps from coming), and a cancelled job waits for that."""
    tier = tier_of(manager)
    pause, deadline = threading.Event(), time.monotonic() + BOUND_S
    while tier.statistics()["reads_in_flight"] < reads:
        assert time.monotonic() < deadline, f"the promotion's {reads} reads did not start"
        pause.wait(0.001)


@pytest.mark.root
def test_shutdown_with_a_promotion_held_in_the_kernel_keeps_its_bound_and_the_region(tmp_path: Path) -> None:
    with gated_ext4(tmp_path, 320) as (mount, gate):  # room above the tier's 256 MiB free-space floor
        manager = make_manager(mount / "kv", cpu_chunks=8, options={"close_timeout": CLOSE_S, "direct_io": True})
        tier = tier_of(manager)
        done = threading.Event()
        outcome: list[BaseException | None] = []
        try:
            keys, ctx = _hold_a_promotion(manager, gate)

            def shut() -> None:
                try:
                    manager.shutdown()
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)
                finally:
                    done.set()

            began = time.monotonic()
            threading.Thread(target=shut, name="vllm-shutdown", daemon=True).start()
            assert done.wait(CLOSE_S + MARGIN_S), "vLLM's shutdown hangs while a read is held in the kernel"
            took = time.monotonic() - began
            (error,) = outcome
            assert isinstance(error, RuntimeError) and "still" in str(error), error
            assert took >= CLOSE_S * 0.9
            # vLLM keeps its region mapped after a tier's shutdown failed: the read may land in it.
            with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
                assert flat.nbytes > 0
            assert tier._bytes_view.nbytes == 8 * CHUNK_BYTES  # the tier still holds its view of the region
            gate.release()
            tier.drain_jobs()  # the held reads end; the job is reported
            with manager.lock:
                found = [manager.lookup(k, ctx) for k in keys]
            assert found == [LookupResult.HIT] * 2  # the held reads ended well
            hits = [k for k, f in zip(keys, found, strict=True) if f is LookupResult.HIT]
            with manager.lock:
                spec = manager.prepare_load(hits, ctx)
                with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
                    got = [bytes(flat[int(c) * CHUNK_BYTES : (int(c) + 1) * CHUNK_BYTES]) for c in spec.chunk_ids]
                manager.complete_load(hits, ctx)
                manager.on_request_finished(ctx)
            seeds = dict(zip(keys, [1, 2], strict=True))
            assert got == [payload(seeds[k]) for k in hits]
        finally:
            gate.release()
            done.wait(BOUND_S)
            manager.shutdown()


def test_close_timeout_is_an_option_of_both_engines(tmp_path: Path) -> None:
    """It bounds vLLM's shutdown and SGLang's close and clear; SGLang ignored it (a warning) and
    vLLM refused it (TypeError), so the 30 s default was the only bound either could have."""
    manager = make_manager(tmp_path / "vllm", options={"close_timeout": 2.5})
    try:
        assert tier_of(manager)._store.config.close_timeout == 2.5
    finally:
        manager.shutdown()
    sglang_helpers = pytest.importorskip("sglang_helpers")
    made: list[object] = []
    backend = sglang_helpers.attach(made, tmp_path / "sglang", sglang_helpers.host_pool(2), True,
                                    options={"close_timeout": 2.5})
    try:
        assert backend.config.close_timeout == 2.5
    finally:
        backend.close()


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


class _OtherIoFirst:
    """The interleaving that failed the died-loop test once (a loaded full run): the gate already
    holds other I/O (here an O_DIRECT read of another file; there the ext4's own) when the
    promotion is submitted, and the loop is held in a callback from before the job is posted until
    the test's next hand-over to the loop after ``gate.wait_held()`` returned: a death queued then
    comes before the loop took the job up, as a starved loop thread let it."""

    def __init__(self, mount: Path, gate: Any, thread: Any) -> None:
        self._gate, self._thread = gate, thread
        self._other = mount / "other"
        self._other.write_bytes(b"x" * 4096)
        with open(self._other, "rb+") as f:
            os.fsync(f.fileno())
        self._entered, self.unblock = threading.Event(), threading.Event()
        self._reader = threading.Thread(target=self._read_other, name="other-read", daemon=True)

    def _read_other(self) -> None:  # held at the gate: O_DIRECT always reaches the device
        fd = os.open(self._other, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mmap.mmap(-1, 4096)], 0)
        finally:
            os.close(fd)

    def _hold_the_loop(self) -> None:
        self._entered.set()
        self.unblock.wait(BOUND_S)

    def held(self) -> None:
        """For ``_hold_a_promotion``: the loop held before the job is posted and the other read
        sent; once the test saw a request held at the gate, its next hand-over to the loop (the
        death, or a look at the tier's reads) is queued, then the loop let go."""
        self._thread.call(self._hold_the_loop)
        assert self._entered.wait(BOUND_S)
        self._reader.start()
        wait_held, loop = self._gate.wait_held, self._thread.loop
        hand_over = loop.call_soon_threadsafe

        def then_let_go(*args: Any, **kwargs: Any) -> Any:
            del loop.call_soon_threadsafe  # the loop's own again
            handle = hand_over(*args, **kwargs)
            self.unblock.set()
            return handle

        def then_let_go_at_the_next_hand_over() -> None:
            wait_held()
            loop.call_soon_threadsafe = then_let_go

        self._gate.wait_held = then_let_go_at_the_next_hand_over

    def end(self) -> None:
        """After ``gate.release()``: the loop and the other read let go (idempotent)."""
        self.unblock.set()
        if self._reader.ident is not None:
            self._reader.join(BOUND_S)


def _shut_in_a_thread(manager: Any) -> tuple[threading.Event, list[BaseException | None]]:
    """vLLM's ``shutdown()`` on a thread of its own: set once it returned or raised, and how."""
    done, outcome = threading.Event(), list[BaseException | None]()

    def shut() -> None:
        try:
            manager.shutdown()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=shut, name="vllm-shutdown", daemon=True).start()
    return done, outcome


@pytest.mark.root
@pytest.mark.parametrize("other_io_first", [False, True], ids=["alone", "other_io_first"])
def test_shutdown_after_the_loop_died_with_a_read_held_keeps_its_bound(tmp_path: Path, other_io_first: bool) -> None:
    """The loop thread dies (a SystemExit let out on it) while a promotion's read is held in the
    kernel: its end cancels the job, which waits for the read before it lets go of vLLM's chunk.
    vLLM's shutdown joined that dying thread without a bound; now it raises after close_timeout,
    holding the region, and goes through once the read ended. ``other_io_first``: the gate held
    other I/O before the promotion's reads (_OtherIoFirst): the death came before the job started,
    shutdown rightly went through, and this test failed (``AssertionError: None``) until
    _hold_a_promotion waited for the reads themselves."""
    with gated_ext4(tmp_path, 320) as (mount, gate):
        manager = make_manager(mount / "kv", cpu_chunks=8, options={"close_timeout": CLOSE_S, "direct_io": True})
        tier = tier_of(manager)
        thread = tier._store.thread
        other = _OtherIoFirst(mount, gate, thread)
        done = threading.Event()
        try:
            _hold_a_promotion(manager, gate, held=other.held if other_io_first else None)
            thread.loop.call_soon_threadsafe(_die)
            pause, deadline = threading.Event(), time.monotonic() + BOUND_S
            while thread.died is None:  # set as the loop ends, before its work is cancelled
                assert time.monotonic() < deadline, "the loop did not die"
                pause.wait(0.001)
            done, outcome = _shut_in_a_thread(manager)
            assert done.wait(CLOSE_S + MARGIN_S), "vLLM's shutdown hangs on a dying loop whose read is held"
            (error,) = outcome
            assert isinstance(error, RuntimeError), error
            assert tier._bytes_view.nbytes == 8 * CHUNK_BYTES  # still held: the read may land in it
            gate.release()
            thread._thread.join(BOUND_S)
            assert thread.dead
        finally:
            gate.release()
            other.end()
            done.wait(BOUND_S)
            manager.shutdown()


@pytest.mark.root
def test_shutdown_after_the_loop_died_before_a_posted_load_started_lets_go(tmp_path: Path) -> None:
    """That interleaving without the wait for the reads (_OtherIoFirst): the death comes before the
    loop took the promotion's job up. Its end drops (or cancels unstarted) the job: no read ever
    touches vLLM's region, the thread ends at once, and shutdown rightly goes through, letting go
    of the region (the job reported failed)."""
    with gated_ext4(tmp_path, 320) as (mount, gate):
        manager = make_manager(mount / "kv", cpu_chunks=8, options={"close_timeout": CLOSE_S, "direct_io": True})
        tier = tier_of(manager)
        thread = tier._store.thread
        other = _OtherIoFirst(mount, gate, thread)
        done = threading.Event()
        try:
            reads_before = tier.statistics()["reads"]
            _hold_a_promotion(manager, gate, reads_started=False, held=other.held)  # on the other read
            thread.loop.call_soon_threadsafe(_die)
            assert thread.wait_ended(BOUND_S), "the loop did not end"
            done, outcome = _shut_in_a_thread(manager)
            assert done.wait(CLOSE_S + MARGIN_S), "vLLM's shutdown hangs on a loop that ended"
            assert outcome == [None]  # nothing of the tier's reads into the region: it lets go
            assert tier._store._disk is not None
            assert tier._store._disk.statistics().reads == reads_before  # the job never read
            with pytest.raises(ValueError, match="released"):
                _ = tier._bytes_view.nbytes  # let go of: vLLM may unmap the region
        finally:
            gate.release()
            other.end()
            done.wait(BOUND_S)
            manager.shutdown()
