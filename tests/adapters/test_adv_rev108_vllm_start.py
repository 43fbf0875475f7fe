"""A vLLM tier whose start fails part-way holds nothing afterwards (review 108).

vLLM hands the tier a view of its CPU region; a view the tier cannot cut rows from used to fail
only after the disk tier had started, and the failed tier kept its loop thread, staging pool and
the directory's lock: a second tier over the same directory (a retry in the same process) then
served read-only. Now a view that is not C-contiguous rows is refused before anything starts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, make_manager, tier_of

from aiokv.adapters.vllm import AiokvTier


def _tier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "aiokv-vllm"}


@pytest.fixture
def spec(tmp_path: Path) -> Any:
    """vLLM's real offloading spec (from a manager made and shut down elsewhere)."""
    manager = make_manager(tmp_path / "spec-source")
    spec = tier_of(manager)._offloading_spec
    manager.shutdown()
    return spec


def _tier(spec: Any, view: memoryview, disk_dir: Path) -> AiokvTier:
    return AiokvTier(spec, view, "aiokv", disk_dir=str(disk_dir), disk_bytes=64 * CHUNK_BYTES, queue_depth=4)


def test_a_region_view_with_strided_rows_is_refused_before_anything_starts(spec: Any, tmp_path: Path) -> None:
    before = _tier_threads()
    rows = np.zeros((4, 2 * CHUNK_BYTES), dtype=np.uint8)
    with pytest.raises(ValueError, match="C-contiguous rows"):
        _tier(spec, memoryview(rows[:, :CHUNK_BYTES]), tmp_path / "cache")
    assert _tier_threads() == before
    assert not (tmp_path / "cache").exists()  # nothing was created
    # Nothing holds the directory either: a tier started next over it writes.
    again = _tier(spec, memoryview(np.zeros((4, 2 * CHUNK_BYTES), dtype=np.uint8)), tmp_path / "cache")
    try:
        assert again.statistics()["read_only"] is None
    finally:
        again.shutdown()
