"""The learned rates across restarts: saved in the disk tier's layout directory, read back at start,
used by the first hit's split plan; a file that is not ours or not sound is ignored and counted.

Every fault is a real file planted in the real directory (symlink, FIFO, directory, another owner's
file, a group-writable one, garbage, a truncated file, a wrong version, another layout or device).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt

import aiokv.manager as manager_module
from aiokv import KVCache
from aiokv.costs import CostModel, RateMeter
from aiokv.manager import CacheManager
from aiokv.rates_file import (
    RATE_BOUNDS,
    RATES_FILE,
    RATES_MAX_BYTES,
    RATES_TEMP,
    RATES_VERSION,
    RATES_VERSIONS_READ,
    RatesFileError,
    decode_rates,
    encode_rates,
    read_rates_file,
    write_rates_file,
)

T = LAYOUT.page_tokens
N = 12 * T
FINGERPRINT = LAYOUT.fingerprint.hex()
PAGE = LAYOUT.page_bytes
KIND = DEVICE.type  # the device kind a KVCache over the test's buffer keys its rates by
OTHER_KIND = "cpu" if KIND == "cuda" else "cuda"


def _layout_dir(root: Path) -> Path:
    return root / FINGERPRINT


def _temps(directory: Path) -> list[str]:
    """Temporary rates files left in ``directory`` (named ``RATES_TEMP`` + a per-save suffix)."""
    return [p.name for p in directory.iterdir() if p.name.startswith(RATES_TEMP)]


def _teach(cache: KVCache) -> None:
    """Rates a warmed cache would have learned: a page read in 10 ms, copied in 1 ms, computed in 4 ms."""
    costs = cache.manager.costs
    costs.disk.update(PAGE, 0.010)
    costs.pool.update(PAGE, 0.001)
    cache.note_prefill(T, 0.004)


async def _fill_disk(root: Path, tokens: list[int]) -> None:
    """Every page of ``tokens`` on disk; the cache closes (nothing learned: no rates file)."""
    async with KVCache(config(root, pool_pages=32), LAYOUT, make_kv(1)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()


async def _plan(cache: KVCache, tokens: list[int]) -> tuple[Any, int | None]:
    """The estimate and the stream's planned meeting point of a hit on ``tokens`` (the stream is
    closed before its loader runs: nothing is read, no rate changes)."""
    match = await cache.match(tokens)
    assert match.disk_pages == len(tokens) // T
    estimate = cache.estimate(match)
    stream = await cache.start_load(match, torch.arange(len(tokens)))
    planned = stream.planned
    assert stream.estimate == estimate
    await stream.aclose()
    return estimate, planned


def _valid_file(device: str = KIND, layout: str = FINGERPRINT, **rates: tuple[float, int]) -> bytes:
    costs = CostModel()
    for name, (rate, samples) in (rates or {"disk": (PAGE / 0.010, 3), "prefill": (T / 0.004, 5)}).items():
        costs.meters()[name].restore(rate, samples)
    return encode_rates(costs, layout, device)


@pytest.mark.asyncio
async def test_a_restarted_cache_plans_the_split_of_the_warmed_one(tmp_path: Path) -> None:
    tokens = prompt(1, N)
    await _fill_disk(tmp_path, tokens)
    assert not (_layout_dir(tmp_path) / RATES_FILE).exists()  # nothing learned, nothing saved
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(2)) as warm:
        await warm.pool.wait_ready()
        _teach(warm)
        warm_estimate, warm_plan = await _plan(warm, tokens)
        rates = {name: (m.rate, m.samples) for name, m in warm.manager.costs.meters().items()}
    assert warm_plan is not None and 0 < warm_plan < N  # a real split: part computed, part loaded
    saved = _layout_dir(tmp_path) / RATES_FILE
    st = saved.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert not _temps(_layout_dir(tmp_path))
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(3)) as restarted:
        await restarted.pool.wait_ready()
        assert {name: (m.rate, m.samples) for name, m in restarted.manager.costs.meters().items()} == rates
        estimate, plan = await _plan(restarted, tokens)
        assert (estimate, plan) == (warm_estimate, warm_plan)
        assert not {k: v for k, v in restarted.stats().errors.items() if k.startswith("rates") and v}
        await assert_quiescent(restarted)


@pytest.mark.asyncio
async def test_a_restarted_cache_keeps_the_fixed_costs_it_learned(tmp_path: Path) -> None:
    tokens = prompt(5, N)
    await _fill_disk(tmp_path, tokens)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(2)) as warm:
        await warm.pool.wait_ready()
        costs = warm.manager.costs
        for pages in (1, 4, 12, 2, 8):  # calls of spread sizes: a 30 ms first read, 5 ms per claim
            costs.disk.update(pages * PAGE, 0.030 + pages * 0.010)
            costs.pool.update(pages * PAGE, 0.0002 + pages * 0.001)
            warm.note_prefill(pages * T, 0.005 + pages * 0.004)
        lines = {name: (m.line(), m.spread) for name, m in costs.meters().items()}
        warm_estimate, _ = await _plan(warm, tokens)
    assert all(line is not None for line, _ in lines.values())
    assert warm_estimate.costs is not None and warm_estimate.costs.read_fixed == pytest.approx(0.030)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(3)) as restarted:
        await restarted.pool.wait_ready()
        assert {name: (m.line(), m.spread) for name, m in restarted.manager.costs.meters().items()} == lines
        estimate, _ = await _plan(restarted, tokens)
        assert estimate == warm_estimate
        await assert_quiescent(restarted)


@pytest.mark.asyncio
async def test_without_a_file_the_first_hit_has_no_plan_as_before(tmp_path: Path) -> None:
    tokens = prompt(2, N)
    await _fill_disk(tmp_path, tokens)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(2)) as cache:
        await cache.pool.wait_ready()
        estimate, plan = await _plan(cache, tokens)
        assert plan is None and estimate.split_token is None and estimate.recompute_seconds is None
        assert cache.stats().errors.get("rates_ignored", 0) == 0  # a first start is no fault


def _plant_garbage(d: Path) -> None:
    (d / RATES_FILE).write_bytes(b"\x00\xff garbage \x13" * 7)


def _plant_truncated(d: Path) -> None:
    data = _valid_file()
    (d / RATES_FILE).write_bytes(data[: len(data) // 2])


def _plant_version(d: Path) -> None:
    doc = json.loads(_valid_file())
    doc["version"] = max(RATES_VERSIONS_READ) + 1  # a later aiokv's file
    (d / RATES_FILE).write_text(json.dumps(doc))


def _plant_foreign_layout(d: Path) -> None:
    (d / RATES_FILE).write_bytes(_valid_file(layout="00" * 16))


def _plant_foreign_device(d: Path) -> None:
    (d / RATES_FILE).write_bytes(_valid_file(device=OTHER_KIND))


def _plant_nan(d: Path) -> None:
    (d / RATES_FILE).write_bytes(_valid_file().replace(b'"rate": ', b'"rate": NaN, "x": ', 1))


def _plant_oversize(d: Path) -> None:
    doc = json.loads(_valid_file())
    doc["pad"] = "x" * RATES_MAX_BYTES
    (d / RATES_FILE).write_text(json.dumps(doc))


def _plant_symlink(d: Path) -> None:
    elsewhere = d.parent.parent / "elsewhere-rates"
    elsewhere.write_bytes(_valid_file())  # a sound file: only the way it is reached is wrong
    (d / RATES_FILE).symlink_to(elsewhere)


def _plant_fifo(d: Path) -> None:
    os.mkfifo(d / RATES_FILE, 0o600)  # an open for reading must not block on it


def _plant_directory(d: Path) -> None:
    (d / RATES_FILE).mkdir()


def _plant_other_owner(d: Path) -> None:
    (d / RATES_FILE).write_bytes(_valid_file())
    os.chown(d / RATES_FILE, 54321, 54321)


def _plant_group_writable(d: Path) -> None:
    (d / RATES_FILE).write_bytes(_valid_file())
    os.chmod(d / RATES_FILE, 0o666)


PLANTS: dict[str, Callable[[Path], None]] = {
    "garbage": _plant_garbage, "truncated": _plant_truncated, "wrong-version": _plant_version,
    "foreign-layout": _plant_foreign_layout, "foreign-device": _plant_foreign_device, "nan": _plant_nan,
    "oversize": _plant_oversize, "symlink": _plant_symlink, "fifo": _plant_fifo, "directory": _plant_directory,
    "other-owner": _plant_other_owner, "group-writable": _plant_group_writable,
}


@pytest.mark.asyncio
@pytest.mark.parametrize("plant", list(PLANTS))
async def test_a_file_that_is_not_ours_or_not_sound_is_ignored_and_counted(tmp_path: Path, plant: str) -> None:
    if plant == "other-owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    tokens = prompt(3, N)
    await _fill_disk(tmp_path, tokens)
    PLANTS[plant](_layout_dir(tmp_path))
    async with asyncio.timeout(10):  # a FIFO that blocked the open would hang the start
        async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(4)) as cache:
            await cache.pool.wait_ready()
            assert all(m.rate is None for m in cache.manager.costs.meters().values())
            estimate, plan = await _plan(cache, tokens)
            assert plan is None and estimate.split_token is None  # behaves as with no file
            errors = cache.stats().errors
            assert errors["rates_ignored"] == 1 and errors.get("rates_clamped", 0) == 0
            _teach(cache)  # something to save at close: it replaces what was planted where it can
    saved = _layout_dir(tmp_path) / RATES_FILE
    if plant == "directory":
        assert saved.is_dir() and not _temps(_layout_dir(tmp_path))  # not replaced, no leftover
        return
    assert stat.S_ISREG(saved.lstat().st_mode) and stat.S_IMODE(saved.lstat().st_mode) == 0o600
    assert decode_rates(saved.read_bytes(), FINGERPRINT, KIND).rates["disk"][0] == pytest.approx(PAGE / 0.010)
    if plant == "symlink":
        # The symlink itself was replaced; its target was never written.
        assert (tmp_path.parent / "elsewhere-rates").read_bytes() == _valid_file()


@pytest.mark.asyncio
async def test_rates_out_of_bounds_are_clamped_and_counted(tmp_path: Path) -> None:
    (tmp_path / FINGERPRINT).mkdir(mode=0o700, parents=True)
    (tmp_path / FINGERPRINT / RATES_FILE).write_bytes(
        _valid_file(disk=(1e30, 2), pool=(5.0, 1), prefill=(500.0, 10**12)))
    async with KVCache(config(tmp_path), LAYOUT, make_kv(5)) as cache:
        costs = cache.manager.costs
        assert costs.disk.rate == RATE_BOUNDS["disk"][1] and costs.pool.rate == RATE_BOUNDS["pool"][0]
        assert costs.prefill.rate == 500.0 and costs.prefill.samples == 1_000_000
        assert cache.stats().errors["rates_clamped"] == 2


@pytest.mark.asyncio
async def test_a_configured_prefill_rate_wins_over_a_saved_one(tmp_path: Path) -> None:
    (tmp_path / FINGERPRINT).mkdir(mode=0o700, parents=True)
    (tmp_path / FINGERPRINT / RATES_FILE).write_bytes(_valid_file())
    async with KVCache(config(tmp_path, prefill_tokens_per_s=1234.0), LAYOUT, make_kv(6)) as cache:
        assert cache.manager.costs.prefill.rate == 1234.0
        assert cache.manager.costs.disk.rate == pytest.approx(PAGE / 0.010)  # the others are taken


@pytest.mark.asyncio
async def test_a_read_only_cache_reads_the_rates_and_never_writes_them(tmp_path: Path) -> None:
    (tmp_path / FINGERPRINT).mkdir(mode=0o700, parents=True)
    planted = _valid_file()
    (tmp_path / FINGERPRINT / RATES_FILE).write_bytes(planted)
    async with KVCache(config(tmp_path), LAYOUT, make_kv(7)) as owner:
        async with KVCache(config(tmp_path), LAYOUT, make_kv(8)) as second:  # finds the lock taken
            assert second.disk is not None and second.disk.read_only is not None
            assert second.manager.costs.disk.rate == pytest.approx(PAGE / 0.010)
            _teach(second)
            await second.flush()
        assert (tmp_path / FINGERPRINT / RATES_FILE).read_bytes() == planted
        assert owner.manager.costs.disk.samples == 3


def _spy_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the thread of every rates write (the real write still runs)."""
    threads: list[int] = []

    def spied(directory: Path, data: bytes, held: int | None = None) -> bool:
        threads.append(threading.get_ident())
        return write_rates_file(directory, data, held)

    monkeypatch.setattr(manager_module, "write_rates_file", spied)
    return threads


@pytest.mark.asyncio
async def test_rates_are_saved_off_the_loop_at_most_once_per_interval_and_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manager_module, "RATES_SAVE_INTERVAL_S", 3600.0)
    threads = _spy_writes(monkeypatch)
    saved = _layout_dir(tmp_path) / RATES_FILE
    async with KVCache(config(tmp_path), LAYOUT, make_kv(9)) as cache:
        loop_thread = threading.get_ident()
        cache.note_prefill(T, 0.004)  # the first change: saved at once, in the background
        await cache.flush()
        assert len(threads) == 1 and saved.exists()
        first = saved.read_bytes()
        for _ in range(50):  # changes within the interval: no write, flush included
            cache.note_prefill(T, 0.002)
            await asyncio.sleep(0)
        await cache.flush()
        assert len(threads) == 1 and saved.read_bytes() == first
        await assert_quiescent(cache)
    assert len(threads) == 2  # the close saved the latest
    assert loop_thread not in threads
    assert decode_rates(saved.read_bytes(), FINGERPRINT, KIND).rates["prefill"][1] == 51


@pytest.mark.asyncio
async def test_a_due_flush_saves_and_nothing_is_written_when_nothing_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manager_module, "RATES_SAVE_INTERVAL_S", 0.0)
    threads = _spy_writes(monkeypatch)
    async with KVCache(config(tmp_path), LAYOUT, make_kv(10)) as cache:
        await cache.flush()
        assert threads == []  # nothing learned: no file
        cache.note_prefill(T, 0.004)
        await cache.flush()
        writes = len(threads)
        assert writes >= 1
        await cache.flush()
    assert len(threads) == writes  # unchanged since: neither flush nor close writes again


@pytest.mark.asyncio
async def test_a_name_planted_at_the_temporary_file_is_removed_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    async with KVCache(config(tmp_path / "root"), LAYOUT, make_kv(11)) as cache:
        (_layout_dir(tmp_path / "root") / RATES_TEMP).symlink_to(victim)
        _teach(cache)
    assert victim.read_bytes() == b"keep me"
    saved = _layout_dir(tmp_path / "root") / RATES_FILE
    assert stat.S_ISREG(saved.lstat().st_mode) and not _temps(_layout_dir(tmp_path / "root"))


@pytest.mark.asyncio
async def test_a_failed_save_is_counted(tmp_path: Path) -> None:
    async with KVCache(config(tmp_path), LAYOUT, make_kv(12)) as cache:
        (_layout_dir(tmp_path) / RATES_FILE).mkdir()
        (_layout_dir(tmp_path) / RATES_FILE / "x").write_bytes(b"")  # rename cannot replace it
        _teach(cache)
        await cache.flush()
        assert cache.stats().errors["rates_not_saved"] >= 1
    assert not _temps(_layout_dir(tmp_path))


def test_decode_says_why_a_file_is_refused() -> None:
    good = _valid_file()
    assert decode_rates(good, FINGERPRINT, KIND).rates["disk"] == (PAGE / 0.010, 3)
    cases = {
        b"[1, 2]": "corrupt",
        good[:-3]: "corrupt",
        good.replace(f'"version": {RATES_VERSION}'.encode(), b'"version": 7'): "version",
        _valid_file(layout="ab" * 16): "foreign-layout",
        _valid_file(device=OTHER_KIND): "foreign-device",
        good.replace(b'"samples": 3', b'"samples": true'): "corrupt",
        good.replace(b'"samples": 3', b'"samples": 3}, "bogus": {"rate": 1.0, "samples": 1'): "corrupt",
        b" " * (RATES_MAX_BYTES + 1): "oversize",
    }
    for data, reason in cases.items():
        with pytest.raises(RatesFileError) as info:
            decode_rates(data, FINGERPRINT, KIND)
        assert info.value.reason == reason, data


def test_read_refuses_a_layout_directory_reached_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / RATES_FILE).write_bytes(_valid_file())
    (tmp_path / "link").symlink_to(real)
    assert read_rates_file(real) == _valid_file()
    link = tmp_path / "link"
    calls: list[Callable[[], object]] = [lambda: read_rates_file(link), lambda: write_rates_file(link, b"{}")]
    for call in calls:
        with pytest.raises(NotADirectoryError):  # O_DIRECTORY | O_NOFOLLOW on a symlink: ENOTDIR
            call()
    assert not _temps(real) and (real / RATES_FILE).read_bytes() == _valid_file()


async def _gate_reads(cache: KVCache, monkeypatch: pytest.MonkeyPatch, gate: asyncio.Event) -> list[int]:
    disk = cache.disk
    assert disk is not None
    real: Callable[..., Awaitable[bool]] = disk.read
    started = [0]

    async def held(*args: Any) -> bool:
        started[0] += 1
        await gate.wait()
        return await real(*args)

    monkeypatch.setattr(disk, "read", held)
    return started


@pytest.mark.asyncio
@pytest.mark.parametrize("saved", [True, False], ids=["persisted-rates", "no-file"])
async def test_the_first_hit_after_a_restart_skips_hopeless_reads_only_with_saved_rates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: bool
) -> None:
    # A warmed cache learned that the disk delivers a page in 10 s and the engine computes one in
    # a ms: after the engine's first claim it starts no read. A restarted cache does the same with
    # the saved rates; without them it reads on, as before (it cannot tell the paces apart).
    tokens = prompt(4, N)
    await _fill_disk(tmp_path, tokens)
    if saved:
        async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(13)) as warm:
            warm.manager.costs.disk.update(PAGE, 10.0)
            warm.note_prefill(1000 * T, 1.0)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(14)) as cache:
        await cache.pool.wait_ready()
        gate = asyncio.Event()
        started = await _gate_reads(cache, monkeypatch, gate)
        match = await cache.match(tokens)
        stream = await cache.start_load(match, torch.arange(N))
        try:
            assert stream.planned == (N if saved else None)  # the plan: compute it all
            assert stream.claim(T) == T
            for _ in range(5):
                await asyncio.sleep(0)  # the loader's turns: it would start reads here
            reads = started[0]
        finally:
            gate.set()
            await stream.aclose()
        assert reads == 0 if saved else reads >= 1
        await assert_quiescent(cache)


# -- what a measurement counts ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_load_with_a_failed_copy_folds_no_pool_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: the pool rate counted every launched page once all copies were done, the failed
    # ones included (a fast failure: an inflated rate, then saved in the rates file).
    tokens = prompt(60, 6 * T)
    async with KVCache(config(tmp_path, launch_pages=2, launch_turn_s=0), LAYOUT, make_kv(60)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(6 * T))
        mover = mover_of(cache)
        real = mover.load
        calls = {"n": 0}

        def second_group_fails(page_ids: list[int], slots: torch.Tensor, skip: int = 0, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("copy engine fault (injected)")
            # The CUDA event of the copy goes back: without it the load thinks the copy landed.
            return real(page_ids, slots, skip, **kwargs)

        monkeypatch.setattr(mover, "load", second_group_fails)
        loaded = await cache.load(await cache.match(tokens), torch.arange(100, 100 + 6 * T))
        assert loaded.shortened and cache.stats().errors["copy_failed"] == 1
        await asyncio.sleep(0)  # any done-callback folds by now
        assert cache.manager.costs.pool.samples == 0 and cache.manager.costs.pool.rate is None
        monkeypatch.setattr(mover, "load", real)
        await cache.load(await cache.match(tokens), torch.arange(100, 100 + 6 * T))
        assert cache.manager.costs.pool.samples == 1  # a load whose copies all landed is measured
        await assert_quiescent(cache)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the copy thread exists for CPU KV buffers")
@pytest.mark.asyncio
async def test_a_cancelled_load_folds_no_pool_rate(tmp_path: Path) -> None:
    # Regression: a cancelled load's withdrawn copies (never started) were counted as moved pages
    # once they were all done: 8 groups' bytes folded for the one group that ran.
    tokens = prompt(61, 8 * T)
    async with KVCache(config(tmp_path, launch_pages=1, launch_turn_s=0), LAYOUT, make_kv(61)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(8 * T))
        await cache.flush()
        gate = threading.Event()
        blocker = cache._bridge.run_cpu(gate.wait)  # the copy thread is busy with someone else's copy
        task = asyncio.create_task(cache.load(await cache.match(tokens), torch.arange(100, 100 + 8 * T)))
        try:
            for _ in range(50):
                await asyncio.sleep(0)  # the load queued all its copies (one group a turn) behind the blocker
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()  # never leave the copy thread blocked, also when the test fails
        await blocker
        await cache.flush()  # every abandoned copy has settled
        assert cache.manager.costs.pool.samples == 0 and cache.manager.costs.pool.rate is None
        await assert_quiescent(cache)
    # Nothing was measured: the close saved no pool rate.
    data = read_rates_file(_layout_dir(tmp_path))
    assert data is None or "pool" not in decode_rates(data, FINGERPRINT, KIND).rates


@pytest.mark.asyncio
async def test_measure_skips_cancelled_failed_and_missed_futures() -> None:
    loop = asyncio.get_running_loop()
    for settle in ("cancel", "fail", "miss"):
        meter = RateMeter()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(4)]
        fold = CacheManager._measure(futures, 4, time.perf_counter(), meter, 4096, lambda f: f.result() is not None)
        for future in futures[:3]:
            future.set_result(True)
        if settle == "cancel":
            futures[3].cancel()
        elif settle == "fail":
            futures[3].set_exception(OSError(5, "injected"))
        else:
            futures[3].set_result(None)  # a promotion that read nothing
        fold()
        assert meter.rate is None and meter.samples == 0, settle
        if settle == "fail":
            futures[3].exception()
    meter = RateMeter()
    delivered = [loop.create_future() for _ in range(2)]
    fold = CacheManager._measure(delivered, 2, time.perf_counter(), meter, 4096)
    for future in delivered:
        future.set_result(None)  # a copy's success
    fold()
    assert meter.samples == 1 and meter.rate is not None


def _fds_into(directory: Path) -> list[str]:
    """This process's descriptors open on ``directory`` itself."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == str(directory):
                found.append(name)
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return found


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["flush", "close"])
async def test_a_save_whose_thread_cannot_start_is_counted_and_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    # The interpreter's own error when no thread can be made, raised for the save's thread only:
    # the descriptor of the layout directory handed to it was left open (one per failed save).
    monkeypatch.setattr(manager_module, "RATES_SAVE_INTERVAL_S", 0.0)
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "aiokv-rates":
            raise RuntimeError("can't start new thread")
        start(self)

    directory = _layout_dir(tmp_path)
    async with KVCache(config(tmp_path), LAYOUT, make_kv(12)) as cache:
        await cache.pool.wait_ready()
        before = _fds_into(directory)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        cache.note_prefill(T, 0.004)
        if when == "flush":
            for _ in range(3):
                await cache.flush()
                cache.note_prefill(T, 0.003)
            assert cache.stats().errors["rates_not_saved"] >= 3
            assert _fds_into(directory) == before, "a failed save left its descriptor open"
            monkeypatch.setattr(threading.Thread, "start", start)
            await cache.flush()  # threads again: the save goes through
            assert (directory / RATES_FILE).exists()
    assert cache.stats().errors["rates_not_saved"] >= 1
    assert (directory / RATES_FILE).exists() is (when == "flush")
    assert _fds_into(directory) == []
    assert not _temps(directory)


@pytest.mark.asyncio
async def test_a_read_whose_thread_cannot_start_is_counted_and_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start's read of the saved rates, its thread refused as the interpreter refuses one when
    # no thread can be made: the duplicated descriptor of the layout directory meant for that
    # thread was left open (one per failed read; the save's twin above).
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "aiokv-rates":
            raise RuntimeError("can't start new thread")
        start(self)

    directory = _layout_dir(tmp_path)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    async with KVCache(config(tmp_path), LAYOUT, make_kv(12)) as cache:
        await cache.pool.wait_ready()
    assert cache.stats().errors["rates_ignored"] == 1
    assert _fds_into(directory) == [], "the failed read left the directory's descriptor open"
