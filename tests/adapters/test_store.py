"""`PageFileStore` on its own (no engine): what both adapters rely on."""

from __future__ import annotations

from pathlib import Path

import torch

from aiokv.adapters.store import PageFileStore, StoreConfig, page_file_bytes

PAGE = 8192


def test_storing_a_page_already_on_disk_makes_it_recent(tmp_path: Path) -> None:
    """As the disk tier's own write of a stored key: a page stored again is the most recently used,
    so the page stored before it is the one evicted for room (vLLM's KV events for evictions find
    evicted pages by following that order)."""
    config = StoreConfig(directory=tmp_path, capacity_bytes=2 * page_file_bytes(PAGE), queue_depth=2)
    store = PageFileStore(config, "test", {"model": "m"}, PAGE)
    try:
        page = [torch.arange(PAGE, dtype=torch.int64).to(torch.uint8)]
        k1, k2, k3 = (store.key(name) for name in (b"k1", b"k2", b"k3"))
        for key in (k1, k2, k1, k3):  # k1 stored again while on disk, then k3 needs room
            assert store.thread.run(store.store(key, page)) is True
        assert store.thread.call(lambda: store.contains([k1, k2, k3])).result() == [True, False, True]
    finally:
        store.close()
