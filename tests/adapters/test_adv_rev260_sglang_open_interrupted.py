"""Review 260: SGLang's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
start-up) as a pool's ``PageFileStore`` constructor returned, before the backend kept the store (its
``_Pool`` not made, or not in ``_pools`` yet): the backend's ``close()`` closes the pools it holds,
so the store was never closed, and the loop thread it shares was stopped under it (no finalizer runs
after a close): the disk tier open for good (its threads, ring and directory lock), its staging pool
mapped. The backend now constructs each store into its list of stores by C code (``list.extend`` over
``map``), where no signal handler runs between the constructor's return and the append, and closes
every store of that list.

Two ways there: the KV pool's store as the backend opens its pools (``_open_all``, whose cleanup closes
them), and a hybrid model's pool registered at run time (``register_mem_host_pool_v2`` once the pools
are open: the store of the next ``close()``).

The interrupts are real (``SIGUSR1`` to the constructing thread, its handler raising), sent by a trace
function (``sys.settrace``, opcode events) at the first opcode the caller runs once the constructor
returned.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from store_helpers import Interrupted, raise_interrupted, tier_closed, wait_for

from aiokv.adapters.store import PageFileStore

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

BOUND_S = 10.0

Tracer = Callable[[types.FrameType, str, Any], Any]


@contextmanager
def _interrupted_once_constructed(stores: list[PageFileStore]) -> Iterator[list[int]]:
    """While in the block, ``SIGUSR1`` is sent to this (the main) thread at the first opcode its caller
    runs once a ``PageFileStore`` constructor returned (the store appended to ``stores``); its handler
    raises :class:`Interrupted` there (in the trace function: raised in the caller at that opcode).
    Yields the count of signals handled."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    main = threading.get_ident()
    count = [0]
    armed: list[types.FrameType] = []

    def handler(signum: int, frame: object) -> None:
        count[0] += 1
        raise_interrupted(signum, frame)

    def local(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        if event == "return" and frame.f_code is PageFileStore.__init__.__code__:
            stores.append(frame.f_locals["self"])
            caller = frame.f_back  # C calls (map) have no frame: the Python frame that called
            assert caller is not None
            caller.f_trace, caller.f_trace_opcodes = local, True
            armed.append(caller)
        elif event == "opcode" and armed and frame is armed[0]:
            armed.clear()
            signal.pthread_kill(main, signal.SIGUSR1)  # its handler raises here
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Tracer | None:
        return local if frame.f_code is PageFileStore.__init__.__code__ else None

    previous, before = signal.signal(signal.SIGUSR1, handler), sys.gettrace()
    sys.settrace(calls)
    try:
        yield count
    finally:
        sys.settrace(before)
        signal.signal(signal.SIGUSR1, previous)


def _mamba_pool(slots: int) -> Any:
    h = sglang_helpers
    temporal = torch.zeros(h.LAYERS, slots, 4, 16, dtype=torch.float32)
    conv = (torch.zeros(h.LAYERS, slots, 8, 3, dtype=torch.bfloat16),)
    info = h.MambaStateBufferInfo(temporal=temporal, conv=conv, extra_checkpoint_buffers=())
    pool = h.MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    pool.test_device_buffers = (temporal, conv)
    return pool


def _assert_closed(store: PageFileStore) -> None:
    disk = store._disk
    assert disk is not None
    wait_for(lambda: tier_closed(disk), "the store's disk tier closed: left open by an interrupt as it was made",
             BOUND_S)
    assert store._pool is None or store._pool.memory.segment.closed, "its staging pool left mapped"


def test_an_interrupt_as_the_kv_pools_store_was_made_closes_it(tmp_path: Path, backends: list[Any]) -> None:
    h = sglang_helpers
    backend = h.attach(backends, tmp_path / "kv", h.host_pool(4), True, options={"close_timeout": BOUND_S})
    stores: list[PageFileStore] = []
    with _interrupted_once_constructed(stores) as count, pytest.raises(Interrupted):
        backend.on_host_pools_registered()  # SGLang's controller: opens the pools' files
    assert count[0] == 1 and len(stores) == 1
    try:
        _assert_closed(stores[0])
        thread = stores[0].thread
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the pools' loop thread was left running"
    finally:
        for store in stores:
            with contextlib.suppress(RuntimeError):  # the loop stopped: the tier is beyond reach (before the fix)
                store.close()
            store.thread.close()


def test_an_interrupt_as_a_pool_registered_at_run_time_was_made_leaves_it_to_close(
        tmp_path: Path, backends: list[Any]) -> None:
    h = sglang_helpers
    backend = h.attach(backends, tmp_path / "kv", h.host_pool(4), True, options={"close_timeout": BOUND_S})
    backend.on_host_pools_registered()
    thread = backend._loop()
    stores: list[PageFileStore] = []
    with _interrupted_once_constructed(stores) as count, pytest.raises(Interrupted):
        backend.register_mem_host_pool_v2(_mamba_pool(8), "mamba")
    assert count[0] == 1 and len(stores) == 1
    try:
        backend.close()
        _assert_closed(stores[0])
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the pools' loop thread was left running"
    finally:
        for store in stores:
            if thread._thread.is_alive():
                store.close()
        thread.close()
