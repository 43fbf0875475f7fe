"""A vLLM tier handed a region view it cannot use is refused before anything starts (review 235).

A view with no chunk row failed cutting its rows (``memoryview.cast``: ``TypeError``), and a
read-only one making its tensor (``torch.frombuffer`` warns; with the warning not an error the
tier started, and the first load's copy into the read-only memory would crash the process), each
once the disk tier had started: the failed tier kept its loop thread, staging pool and directory
lock, so a second tier over the same directory (a retry in the same process) served read-only and
stored nothing. Both are now a ``ValueError`` before the store starts (review 108 did the same for
strided rows)."""

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


def _read_only_rows(chunks: int) -> memoryview:
    return memoryview(bytes(chunks * CHUNK_BYTES)).cast("B", (chunks, CHUNK_BYTES))


@pytest.mark.parametrize(("kind", "view", "refusal"), [
    ("no chunk", lambda: memoryview(np.zeros((0, CHUNK_BYTES), dtype=np.uint8)), "no chunk"),
    ("read-only", lambda: _read_only_rows(4), "read-only"),
])
def test_an_unusable_region_view_is_refused_before_anything_starts(
    spec: Any, tmp_path: Path, kind: str, view: Any, refusal: str
) -> None:
    before = tier_threads()
    with pytest.raises(ValueError, match=refusal):
        bare_tier(spec, view(), tmp_path / "cache")
    assert tier_threads() == before, f"a tier refused for a {kind} view left its loop thread"
    assert not (tmp_path / "cache").exists()  # nothing was created
    # Nothing holds the directory either: a tier started next over it writes.
    again = bare_tier(spec, memoryview(np.zeros((4, CHUNK_BYTES), dtype=np.uint8)), tmp_path / "cache")
    try:
        assert again.statistics()["read_only"] is None
    finally:
        again.shutdown()


def test_a_start_failing_after_the_store_started_holds_nothing(
    spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails once the disk tier started (here the region's registration with io_uring,
    raising on the loop) closes it again: no thread, no directory lock, no view of the region."""
    from aiokv.adapters.store import PageFileStore

    def refuse(self: PageFileStore, region: memoryview) -> None:
        raise OSError("registration refused")

    monkeypatch.setattr(PageFileStore, "register_memory", refuse)
    before = tier_threads()
    rows = np.zeros((4, CHUNK_BYTES), dtype=np.uint8)
    view = memoryview(rows)
    with pytest.raises(OSError, match="registration refused"):
        bare_tier(spec, view, tmp_path / "cache")
    assert tier_threads() == before, "the failed tier left its loop thread"
    monkeypatch.undo()
    again = bare_tier(spec, memoryview(np.zeros((4, CHUNK_BYTES), dtype=np.uint8)), tmp_path / "cache")
    try:
        assert again.statistics()["read_only"] is None, "the failed tier kept the directory's lock"
    finally:
        again.shutdown()
    view.release()  # would raise BufferError while the failed tier still exported it
