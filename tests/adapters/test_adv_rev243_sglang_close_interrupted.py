"""Review 243: SGLang's thread interrupted (a ``KeyboardInterrupt`` from a signal handler: Ctrl-C at
shutdown) while the backend's ``close()`` closes its pools' stores, which share one loop thread.

The interrupt left the first store's ``close()`` (its close goes on on the loop since 65dd6bf) and
then ``_close_pools`` itself: the stores after it were never closed, and its ``finally`` waited
``close_timeout`` for the calls in flight (the first close among them) and stopped the loop thread,
whose end cut that close before its disk tier closed. Both tiers were left open for good (checksum
and preparation threads, ring, lock), their staging pools mapped. Now the interrupt is raised at
once and the close goes on: every store closed, the loop thread stopped after them.

The interrupt is real (a signal to the thread in ``close()``, its handler raising); the KV pool's
registration (an MLA pool: one buffer a page, registered) is held in its pinning thread, which waits
on an event as its syscall would, so that the first store's close waits in ``_stop_registering``.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_probes import waiting_in
from store_helpers import Interrupted, hold_region_pinning, raise_interrupted, wait_for

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

BOUND_S = 30.0
CLOSE_S = 2.0  # the bound the unfixed close waited for the held close before stopping the loop


def _mamba_pool(slots: int) -> Any:
    h = sglang_helpers
    temporal = torch.zeros(h.LAYERS, slots, 4, 16, dtype=torch.float32)
    conv = (torch.zeros(h.LAYERS, slots, 8, 3, dtype=torch.bfloat16),)
    info = h.MambaStateBufferInfo(temporal=temporal, conv=conv, extra_checkpoint_buffers=())
    pool = h.MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    pool.test_device_buffers = (temporal, conv)
    return pool


def test_an_interrupted_close_closes_every_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                backends: list[Any]) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    h = sglang_helpers
    entered, gate = hold_region_pinning(monkeypatch, BOUND_S)
    kv, mamba = h.mla_pool(8), _mamba_pool(8)
    config = h.storage_config(tmp_path, True, mla=True, tp_size=1, options={"close_timeout": CLOSE_S})
    backend = StorageBackendFactory.create_backend("dynamic", config, kv)
    backends.append(backend)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    returned = threading.Event()
    main = threading.get_ident()
    helper: threading.Thread | None = None
    try:
        backend.on_host_pools_registered()  # opens both pools' files; the KV pool's registration held
        if not entered.wait(BOUND_S):
            pytest.skip("the disk tier did not register the host pool (no io_uring here)")
        thread = backend._loop()
        stores = [pool.store for pool in backend._pools.values()]
        assert len(stores) == 2 and all(s is not None and s.thread is thread for s in stores)
        tiers = [(s._pool, s._disk) for s in stores if s is not None]

        def interrupter() -> None:
            def close_waits() -> bool:
                return bool(thread.call(lambda: any(waiting_in(t, "_stop_registering")
                                                    for t in asyncio.all_tasks())).result())

            wait_for(close_waits, "the close waiting for the registration", BOUND_S)
            signal.pthread_kill(main, signal.SIGUSR1)
            # Before: the loop thread stopped (after close_timeout), its end cutting the held close.
            wait_for(lambda: returned.is_set() or thread._ending, "close() interrupted", BOUND_S)
            gate.set()

        helper = threading.Thread(target=interrupter, name="test-interrupter", daemon=True)
        helper.start()
        with pytest.raises(Interrupted):
            backend.close()
        returned.set()
        helper.join(BOUND_S)
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the pools' loop thread was never stopped"
        for pool, disk in tiers:
            assert disk is not None and disk._io_ended is not None and disk.io_ended.done(), \
                "a disk tier was left open"
            assert pool is not None and pool._released, "a staging pool was never freed"
        wait_for(lambda: not any(t.name.startswith("aiokv-") for t in threading.enumerate()),
                 "the backend's threads ended", BOUND_S)
        backend.close()  # returns at once
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gate.set()
        if helper is not None:
            helper.join(BOUND_S)
    gc.collect()
