"""Review 235: SGLang's calls reaching a closed backend (its controller detaches the backend while,
or just before, its prefetch or backup thread asks).

Every call after ``close()`` raised ``RuntimeError("aiokv backend is closed")`` into SGLang's
thread, and a call racing the close raised ``KeyError('kv')`` (its pools cleared between the open
check and their use) or ``RuntimeError`` (the loop thread gone between the page checks and the
transfer), where a closed cache must answer a miss, counted, with nothing moved. The races are
forced by running ``close()`` inside the call at the point named (the close of SGLang's detaching
thread landing there)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sglang_helpers = pytest.importorskip("sglang_helpers")
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402


def _answer(call: Callable[[], object], what: str) -> object:
    """What ``call`` answers; raising into SGLang's thread fails the test."""
    try:
        return call()
    except Exception as exc:  # the outcome under test
        pytest.fail(f"{what} raised {exc!r} into SGLang's thread instead of missing")


def _calls(backend: Any) -> dict[str, tuple[Callable[[], object], object]]:
    """Each of SGLang's calls, and the miss it must answer once the backend is closed."""
    h = sglang_helpers
    page = torch.zeros_like(h.page(backend.mem_pool_host, 0))
    kv = PoolTransfer(name=PoolName.KV, host_indices=h.indices([2, 3]), keys=["p0", "p1"])
    return {
        "batch_exists": (lambda: backend.batch_exists(["p0", "p1"]), 0),
        "exists": (lambda: backend.exists("p0"), False),
        "batch_get_v1": (lambda: backend.batch_get_v1(["p0", "p1"], h.indices([2, 3])), [False, False]),
        "batch_set_v1": (lambda: backend.batch_set_v1(["n0"], h.indices([2])), [False]),
        "batch_exists_v2": (lambda: backend.batch_exists_v2(["p0", "p1"], []).kv_hit_pages, 0),
        "batch_get_v2": (lambda: backend.batch_get_v2([kv]), {"kv": [False, False]}),
        "batch_set_v2": (lambda: backend.batch_set_v2([kv]), {"kv": [False, False]}),
        "get": (lambda: backend.get("p0", page), None),
        "batch_get": (lambda: backend.batch_get(["p0"], [page]), [None]),
        "set": (lambda: backend.set("n1", page), False),
        "batch_set": (lambda: backend.batch_set(["n2"], [page]), False),
        "clear": (lambda: backend.clear(), False),
    }


def _snapshot(pool: Any) -> list[torch.Tensor]:
    return [sglang_helpers.page(pool, index) for index in range(4)]


def _racing_close(tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch, step: str, name: str) -> Any:
    """The call ``name`` with ``close()`` forced right after its ``step``, checked to answer its miss
    and move nothing; returns the backend."""
    backend, pool = sglang_helpers.stored_backend(backends, tmp_path / "kv")
    before = _snapshot(pool)
    sglang_helpers.close_right_after(monkeypatch, backend, step)
    call, miss = _calls(backend)[name]
    got = _answer(call, f"{name} racing close()")
    assert got == miss
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool), strict=True))
    return backend


def test_every_call_after_close_misses_and_moves_nothing(tmp_path: Path, backends: list[Any]) -> None:
    backend, pool = sglang_helpers.stored_backend(backends, tmp_path / "kv")
    before = _snapshot(pool)
    backend.close()
    calls = _calls(backend)
    for name, (call, miss) in calls.items():
        got = _answer(call, f"{name} after close()")
        assert got == miss, f"{name} after close() answered {got!r}, not a miss"
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool), strict=True)), "a closed backend moved bytes"
    assert backend.closed_misses == len(calls)
    backend.on_host_pools_registered()  # opens nothing once closed
    assert backend.statistics() == {}


@pytest.mark.parametrize("name", ["batch_exists", "batch_get_v1", "batch_set_v1", "batch_exists_v2", "batch_get_v2",
                                  "get", "batch_set", "clear"])
def test_a_close_right_after_the_open_check_makes_the_call_miss(
    tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The close lands after the call found the pools open (``_open_all``) and before it used them."""
    _racing_close(tmp_path, backends, monkeypatch, "_open_all", name)


@pytest.mark.parametrize("name", ["batch_get_v1", "batch_set_v1", "batch_get_v2", "batch_set_v2"])
def test_a_close_between_the_page_checks_and_the_transfer_makes_the_call_miss(
    tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The close lands after the call checked its pages (``_moves``) and before it handed them to
    the loop thread (gone by then)."""
    assert _racing_close(tmp_path, backends, monkeypatch, "_moves", name).closed_misses == 1
