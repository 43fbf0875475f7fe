"""Review 266: SGLang's backend closed while the close of one pool's disk tier fails.

``close()`` closed its stores one after another in one ``for`` loop: the first whose close raised (its
disk tier's close failed part-way) skipped every store after it. Their disk tiers stayed open for good
(threads, io_uring ring, directory lock: a backend started again in this process served the directory
read-only), their staging pools mapped, and the pools' loop thread, finding their tasks still running,
kept running for them. Each store is now closed whatever the ones before raised; the first error is
raised once all were.

The fault is real: the KV pool's tier's directory-lock descriptor closed behind it, so that its close
meets a real ``EBADF`` from the kernel; the hybrid model's Mamba pool, registered at run time (SGLang's
``register_mem_host_pool_v2``), comes after it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from store_helpers import tier_closed
from test_adv_rev260_sglang_open_interrupted import _mamba_pool

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make engines installs it)")
sglang_helpers = pytest.importorskip("sglang_helpers")

BOUND_S = 10.0


def test_a_pools_failing_close_leaves_no_other_pool_open(tmp_path: Path, backends: list[Any]) -> None:
    h = sglang_helpers
    backend = h.attach(backends, tmp_path / "kv", h.host_pool(4), True, options={"close_timeout": 1.0})
    backend.on_host_pools_registered()  # SGLang's controller: opens the KV pool's files
    backend.register_mem_host_pool_v2(_mamba_pool(8), "mamba")
    stores = list(backend._stores)
    assert len(stores) == 2 and all(s._disk is not None and s._pool is not None for s in stores)
    failing, other = stores
    thread = backend._loop()
    lock_fd = failing._disk._dir.lock_fd
    assert lock_fd is not None
    os.close(lock_fd)  # its tier's close now fails with EBADF
    try:
        with pytest.raises(OSError, match="Bad file descriptor") as raised:
            backend.close()
        assert raised.value.errno == 9  # EBADF: the failing pool's error is still raised
        assert tier_closed(other._disk), "the pool after the failing one was left open: its close was skipped"
        assert other._pool is not None and other._pool.memory.segment.closed, "its staging pool was left mapped"
        thread._thread.join(BOUND_S)
        assert not thread._thread.is_alive(), "the pools' loop thread was left running"
    finally:
        if thread._thread.is_alive():
            thread.run(other._disk.aclose())
            thread.run(other._pool.aclose())
            thread.close()
