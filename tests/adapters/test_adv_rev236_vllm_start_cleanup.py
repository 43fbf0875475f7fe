"""Review 236 of 7549f3b: a vLLM tier whose start failed once the disk tier started closes it
again and releases its view of vLLM's region, even when that close itself fails.

The cleanup closed the store first and released the view after: a close raising (its disk tier's
close failing) skipped the release, so the failed tier, which the exception's frames keep alive,
held vLLM's region exported (vLLM cannot unmap it: ``mmap.close`` raises ``BufferError``), and the
close's error replaced the start's own. Both faults are injected (the registration with io_uring
refused, as review 235's test does, and the store's close raising after it really closed)."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, bare_tier, offloading_spec, tier_threads

from aiokv.adapters.store import PageFileStore


@pytest.fixture
def spec(tmp_path: Path) -> Any:
    return offloading_spec(tmp_path / "spec-source")


def test_a_failing_close_of_a_failed_start_still_releases_the_region(
    spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(self: PageFileStore, region: memoryview) -> None:
        raise OSError("registration refused")

    real_close = PageFileStore.close

    def close_then_fail(self: PageFileStore) -> None:
        real_close(self)
        raise OSError("close failed")

    monkeypatch.setattr(PageFileStore, "register_memory", refuse)
    monkeypatch.setattr(PageFileStore, "close", close_then_fail)
    before = tier_threads()
    region = mmap.mmap(-1, 4 * CHUNK_BYTES)  # vLLM's region: a mapping it unmaps at shutdown
    view = memoryview(region).cast("B", (4, CHUNK_BYTES))
    # ``failed`` kept: as vLLM's handler keeps the exception, and with it the failed tier's frames.
    with caplog.at_level(logging.ERROR, logger="aiokv.adapters.vllm"), \
            pytest.raises(OSError, match=r"registration refused|close failed") as failed:
        bare_tier(spec, view, tmp_path / "cache")
    assert str(failed.value) == "registration refused", f"the start's error was replaced by {failed.value!r}"
    assert any("close failed" in r.getMessage() or (r.exc_info and "close failed" in str(r.exc_info[1]))
               for r in caplog.records), "the failing close was not logged"
    assert tier_threads() == before
    view.release()
    region.close()  # BufferError while the failed tier still exported the region
    del failed
