"""Review 236 of 0d427f8: a call racing ``close()`` is answered as a miss *and counted* in
``closed_misses``, once, whatever call it is.

A v2 transfer (``batch_get_v2``/``batch_set_v2``) whose backend closed after its open check found
the KV pool open (``_kv``) looked its pool up in the pools the close had cleared: it answered the miss, but
uncounted, and logged an error that the pool "is not registered" (SGLang's operator would look for
a registration bug). The race is forced as in review 235: ``close()`` runs inside the call right
after ``_kv`` answered (the close of SGLang's detaching thread landing there)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

sglang_helpers = pytest.importorskip("sglang_helpers")
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402


@pytest.mark.parametrize("name", ["batch_get_v2", "batch_set_v2"])
def test_a_v2_transfer_racing_close_counts_its_miss(
    tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    h = sglang_helpers
    backend, _pool = h.stored_backend(backends, tmp_path / "kv")
    h.close_right_after(monkeypatch, backend, "_kv")
    kv = PoolTransfer(name=PoolName.KV, host_indices=h.indices([2, 3]), keys=["p0", "p1"])
    with caplog.at_level(logging.ERROR, logger="aiokv.adapters.sglang"):
        got = getattr(backend, name)([kv])
    assert got == {"kv": [False, False]}
    assert backend.closed_misses == 1, "a v2 transfer racing close() missed uncounted"
    assert not [r for r in caplog.records if "not registered" in r.getMessage()], \
        "a closed backend's miss was logged as a pool never registered"
