"""Review 122: the rates file against a hostile or broken co-tenant, every fault real.

- The cache directory's root renamed away after the start and a symlink to another directory of
  ours put at its name (the layout directory's name inside it is a real directory): the disk tier
  kept its own descriptors, but the rates were read and saved by name, so the save went through
  the link, outside the cache directory. Now both go through the tier's descriptor (fails before).
- A hard link to one of the cache's page files at the rates file's name, a character device node
  there, a 1 TiB sparse file: ignored and counted at the start, the name replaced at the save, the
  page file and the device untouched; the hit still loads bit-exact.
- Another process holding the layout directory's ``flock`` for good (SIGSTOPped while holding it):
  the start restores the saved rates (a read takes no lock), a save gives up after
  ``RATES_LOCK_WAIT_S`` and is counted, ``flush`` and ``aclose`` keep their bounds, the loop never
  stalls, the file in place stays whole; once the holder is gone the next cache saves.
- The rates file replaced by other files (sound ones, garbage, a torn one, a FIFO, a symlink) as
  fast as a thread can rename while caches start: each start restores one of the sound files'
  rates whole or ignores and counts what it found, never raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt, record_loop_gaps

from aiokv import KVCache
from aiokv.costs import CostModel
from aiokv.rates_file import RATES_FILE, RATES_LOCK_WAIT_S, RATES_TEMP, decode_rates, encode_rates

T = LAYOUT.page_tokens
N = 6 * T
PAGE = LAYOUT.page_bytes
FINGERPRINT = LAYOUT.fingerprint.hex()
KIND = DEVICE.type
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (device nodes, chown)")


def _valid(seconds: float) -> bytes:
    costs = CostModel()
    costs.disk.update(PAGE, seconds)
    return encode_rates(costs, FINGERPRINT, KIND)


def _disk_rate(path: Path) -> float:
    return decode_rates(path.read_bytes(), FINGERPRINT, KIND).rates["disk"][0]


def _teach(cache: KVCache, seconds: float) -> None:
    for _ in range(8):
        cache.manager.costs.disk.update(PAGE, seconds)


async def _fill_disk(root: Path, tokens: list[int]) -> None:
    async with KVCache(config(root, pool_pages=32), LAYOUT, make_kv(1)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()


async def _loads_bit_exact(cache: KVCache, kv: torch.Tensor, tokens: list[int]) -> None:
    """The prompt (offloaded by :func:`_fill_disk` from make_kv(1)'s first slots) loads from disk
    into ``kv``'s next slots, bit-exact."""
    match = await cache.match(tokens)
    assert match.disk_pages == len(tokens) // T, match
    loaded = await cache.load(match, torch.arange(len(tokens), 2 * len(tokens)))
    assert loaded.tokens == len(tokens), loaded
    assert torch.equal(kv[:, len(tokens):2 * len(tokens)], make_kv(1)[:, :len(tokens)])


@pytest.mark.asyncio
async def test_a_root_swapped_for_a_link_after_the_start_never_gets_the_rates(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    planted = _valid(0.030)
    cache = KVCache(config(root), LAYOUT, make_kv(1))
    await cache.start()
    try:
        os.rename(root, tmp_path / "root.moved")
        (elsewhere / FINGERPRINT).mkdir(parents=True, mode=0o700)
        (elsewhere / FINGERPRINT / RATES_FILE).write_bytes(planted)  # never to be read or replaced
        os.chmod(elsewhere / FINGERPRINT / RATES_FILE, 0o600)
        os.symlink(elsewhere, root)
        _teach(cache, 0.010)
    finally:
        await cache.aclose()
    assert "rates_not_saved" not in cache.stats().errors, cache.stats().errors
    # Before: the save went through the link (elsewhere's file replaced, the cache's own had none).
    assert (elsewhere / FINGERPRINT / RATES_FILE).read_bytes() == planted
    assert sorted(os.listdir(elsewhere / FINGERPRINT)) == [RATES_FILE]
    assert _disk_rate(tmp_path / "root.moved" / FINGERPRINT / RATES_FILE) == pytest.approx(PAGE / 0.010)


def _page_file(layout_dir: Path) -> Path:
    pages = [p for p in layout_dir.glob("*/*") if p.is_file() and not p.name.startswith(".")]
    assert pages, sorted(layout_dir.iterdir())
    return pages[0]


def _plant_hard_link(d: Path) -> Path:
    page = _page_file(d)
    os.link(page, d / RATES_FILE)  # regular, ours, 0600: only its size gives it away
    return page


def _plant_null(d: Path) -> Path:
    os.mknod(d / RATES_FILE, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    return d / RATES_FILE


def _plant_zero(d: Path) -> Path:
    os.mknod(d / RATES_FILE, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: reads never end
    return d / RATES_FILE


def _plant_sparse(d: Path) -> Path:
    with open(d / RATES_FILE, "wb") as f:
        f.truncate(1 << 40)
    os.chmod(d / RATES_FILE, 0o600)
    return d / RATES_FILE


PLANTS = {"hard-link-to-a-page": _plant_hard_link, "dev-null": _plant_null, "dev-zero": _plant_zero,
          "sparse-1TiB": _plant_sparse}


@root_only
@pytest.mark.asyncio
@pytest.mark.parametrize("plant", list(PLANTS))
async def test_a_link_device_or_huge_file_at_the_name_is_ignored_and_replaced(tmp_path: Path, plant: str) -> None:
    tokens = prompt(5, N)
    await _fill_disk(tmp_path, tokens)
    d = tmp_path / FINGERPRINT
    planted = PLANTS[plant](d)
    page_hash = hashlib.sha256(planted.read_bytes()).hexdigest() if plant.startswith("hard") else None
    async with asyncio.timeout(20):
        kv = make_kv(4)
        async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
            await cache.pool.wait_ready()
            assert cache.stats().errors["rates_ignored"] == 1, cache.stats().errors
            assert all(m.rate is None for m in cache.manager.costs.meters().values())
            await _loads_bit_exact(cache, kv, tokens)
            await assert_quiescent(cache)
            _teach(cache, 0.010)
            learned = cache.manager.costs.disk.rate  # (the load's own read folded in too)
    assert stat.S_ISREG((d / RATES_FILE).lstat().st_mode)
    assert _disk_rate(d / RATES_FILE) == pytest.approx(learned)
    assert not [p for p in os.listdir(d) if p.startswith(RATES_TEMP)]
    if page_hash is not None:  # the page file kept its bytes (the name was replaced, not written)
        assert hashlib.sha256(planted.read_bytes()).hexdigest() == page_hash
        assert os.stat(planted).st_nlink == 1


# -- the layout directory's flock held for good --------------------------------------------------------

_HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@contextlib.contextmanager
def _stopped_holder(directory: Path):  # type: ignore[no-untyped-def]
    """A process that took the directory's exclusive flock and stopped itself (SIGSTOP) with it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.asyncio
async def test_a_stopped_process_holding_the_directory_lock_costs_bounded_waits_only(tmp_path: Path) -> None:
    tokens, later = prompt(6, N), prompt(7, N)
    await _fill_disk(tmp_path, tokens)
    d = tmp_path / FINGERPRINT
    saved = _valid(0.030)
    (d / RATES_FILE).write_bytes(saved)
    os.chmod(d / RATES_FILE, 0o600)
    gaps: list[float] = []
    ticker = asyncio.ensure_future(record_loop_gaps(gaps))
    try:
        with _stopped_holder(d):
            started = time.monotonic()
            kv = make_kv(4)
            cache = KVCache(config(tmp_path, pool_pages=32, close_timeout=1.0), LAYOUT, kv)
            try:
                await cache.start()
                start_s = time.monotonic() - started
                # The read takes no lock: the saved rates are restored.
                assert cache.manager.costs.disk.rate == pytest.approx(PAGE / 0.030)
                await _loads_bit_exact(cache, kv, tokens)  # a disk read: a rate folded, a save started
                _teach(cache, 0.010)
                started = time.monotonic()
                await cache.flush()  # waits for that save: it gives up after the lock's wait
                flush_s = time.monotonic() - started
                errors = dict(cache.stats().errors)
                # Pages queued for disk at the close: written, whatever the held save does.
                await cache.offload(later, torch.arange(N))
            finally:
                started = time.monotonic()
                await cache.aclose()
                close_s = time.monotonic() - started
            after = dict(cache.stats().errors)
            assert (d / RATES_FILE).read_bytes() == saved  # whole, not replaced under the lock
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
    assert start_s < 5.0, start_s
    assert flush_s < RATES_LOCK_WAIT_S + 3.0, flush_s
    assert errors.get("rates_not_saved", 0) >= 1, errors
    assert close_s < 1.0 + 3.0, close_s  # close_timeout, not the held lock
    assert after.get("rates_not_saved", 0) > errors["rates_not_saved"], after
    # The tier closed within the bound (before: the held save used it all, and the tier, given
    # 0 s, reported stuck I/O and dropped its queued pages).
    assert after.get("close_timeout", 0) == 0, after
    assert cache.stats().disk is not None and cache.stats().disk.dropped == 0, cache.stats().disk
    assert max(gaps) < 0.25, sorted(gaps)[-5:]  # no wait on the loop (2 loaded cores: generous)
    # The holder gone, the next cache saves.
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(4)) as cache:
        await cache.pool.wait_ready()
        _teach(cache, 0.002)
        learned = cache.manager.costs.disk.rate
        assert (await cache.match(later)).disk_pages == N // T  # the close wrote them
    assert _disk_rate(d / RATES_FILE) == pytest.approx(learned)
    assert learned != pytest.approx(PAGE / 0.030)


@pytest.mark.asyncio
async def test_a_background_save_held_at_the_close_leaves_the_tier_its_bound(tmp_path: Path) -> None:
    # The first fold starts a save in the background (held behind the stopped holder's flock) and
    # the cache closes at once, pages queued for disk: the close waited for that save with its
    # whole bound before closing the tier (then given 0 s: queued pages dropped, "stuck I/O").
    tokens = prompt(8, N)
    (tmp_path / FINGERPRINT).mkdir(mode=0o700, parents=True)
    with _stopped_holder(tmp_path / FINGERPRINT):
        cache = KVCache(config(tmp_path, pool_pages=32, close_timeout=1.0), LAYOUT, make_kv(1))
        try:
            await cache.start()
            await cache.pool.wait_ready()
            await cache.offload(tokens, torch.arange(N))
            _teach(cache, 0.010)  # due at once: a save starts in the background, held
            assert cache.stats().background_jobs >= 1
        finally:
            started = time.monotonic()
            await cache.aclose()
            close_s = time.monotonic() - started
        errors = dict(cache.stats().errors)
        disk = cache.stats().disk
    assert close_s < 1.0 + 3.0, close_s
    assert errors.get("close_timeout", 0) == 0, errors
    assert errors.get("rates_not_saved", 0) >= 1, errors
    assert disk is not None and disk.dropped == 0, disk
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, make_kv(4)) as cache:
        assert (await cache.match(tokens)).disk_pages == N // T


# -- the file replaced while it is read -----------------------------------------------------------------


def _replacer(d: Path, stop: threading.Event, rates: tuple[bytes, bytes]) -> None:
    """Rename other files over the rates file until ``stop``: two sound ones, garbage, a torn one,
    a FIFO and a symlink."""
    garbage, torn = b"\x00not json\xff" * 10, rates[0][: len(rates[0]) // 2]
    i = 0
    while not stop.is_set():
        temp = d / f"swap-{i % 8}"
        kind = i % 6
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        if kind < 4:
            temp.write_bytes((rates[0], rates[1], garbage, torn)[kind])
            os.chmod(temp, 0o600)
        elif kind == 4:
            os.mkfifo(temp, 0o600)
        else:
            os.symlink(d.parent / "nowhere", temp)
        os.rename(temp, d / RATES_FILE)
        i += 1


@pytest.mark.asyncio
async def test_a_file_replaced_while_caches_start_is_restored_whole_or_ignored(tmp_path: Path) -> None:
    (tmp_path / FINGERPRINT).mkdir(mode=0o700, parents=True)
    d = tmp_path / FINGERPRINT
    rates = (_valid(0.010), _valid(0.002))
    stop = threading.Event()
    mover = threading.Thread(target=_replacer, args=(d, stop, rates))
    mover.start()
    seen: list[object] = []
    try:
        for i in range(8):
            async with asyncio.timeout(20):
                cache = KVCache(config(tmp_path, pool_pages=8), LAYOUT, make_kv(i))
                try:
                    await cache.start()
                    errors = cache.stats().errors
                    rate = cache.manager.costs.disk.rate
                    seen.append(rate if rate is not None else ("ignored", errors.get("rates_ignored", 0)))
                    # A sound file's rate whole, or nothing and one count.
                    assert (rate is None and errors.get("rates_ignored", 0) == 1) or (
                        rate in (pytest.approx(PAGE / 0.010), pytest.approx(PAGE / 0.002))
                        and errors.get("rates_ignored", 0) == 0), (rate, errors)
                finally:
                    await cache.aclose()
    finally:
        stop.set()
        mover.join()
    assert len(seen) == 8, seen
