"""A vLLM tier whose start fails part-way holds nothing afterwards (review 108).

vLLM hands the tier a view of its CPU region; a view the tier cannot cut rows from used to fail
only after the disk tier had started, and the failed tier kept its loop thread, staging pool and
the directory's lock: a second tier over the same directory (a retry in the same process) then
served read-only. Now a view that is not C-contiguous rows is refused before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, bare_tier, offloading_spec, tier_threads


@pytest.fixture
def spec(tmp_path: Path) -> Any:
    return offloading_spec(tmp_path / "spec-source")


def test_a_region_view_with_strided_rows_is_refused_before_anything_starts(spec: Any, tmp_path: Path) -> None:
    before = tier_threads()
    rows = np.zeros((4, 2 * CHUNK_BYTES), dtype=np.uint8)
    with pytest.raises(ValueError, match="C-contiguous rows"):
        bare_tier(spec, memoryview(rows[:, :CHUNK_BYTES]), tmp_path / "cache")
    assert tier_threads() == before
    assert not (tmp_path / "cache").exists()  # nothing was created
    # Nothing holds the directory either: a tier started next over it writes.
    again = bare_tier(spec, memoryview(np.zeros((4, 2 * CHUNK_BYTES), dtype=np.uint8)), tmp_path / "cache")
    try:
        assert again.statistics()["read_only"] is None
    finally:
        again.shutdown()
