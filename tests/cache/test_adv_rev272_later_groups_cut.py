"""Helper-272: a load's read groups all start at once; a failed read in one group ends the load's
prefix there, yet the later groups went on reading (d058b19 stopped reads past a failed page only
within its own group). Their pages are never served: the reads were wasted I/O, holding pool pages
and I/O slots. Now a group whose read failed cuts the later ones (``aiokv.loadpath.GroupStop``): a
read of theirs not started yet never starts, one under way finishes and its pages go back.

Real EIO on the io_uring ring (``_eio``); groups of 2 pages, 4 groups; ``queue_depth`` 2, so the
later groups' pages wait for an I/O slot behind the first group's. The second group's reads are
held in front of the backend until the load returned (nothing sleeps): before the fix, once they
ended, the third and fourth groups' pages were read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt
from test_failed_copy_stops_work import _eio

from aiokv import KVCache

T = LAYOUT.page_tokens
GROUP = 2
"""Pages in one read group (``read_group_bytes``)."""
PAGES = 4 * GROUP
N = PAGES * T
POISON = 100.0


def _config(tmp_path: Path) -> Any:
    cfg = config(tmp_path, pool_pages=16, read_group_bytes=GROUP * LAYOUT.page_bytes)
    assert cfg.disk is not None
    return dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, queue_depth=GROUP))


@pytest.mark.asyncio
@pytest.mark.parametrize("failed", [0, 1])
async def test_a_failed_read_in_the_first_group_starts_no_read_in_the_later_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed: int,
) -> None:
    """Page ``failed`` (of the first group) fails with EIO on every read: the load returns pages
    ``[0, failed)`` bit-exact, the second group's reads (under way) finish, the third and fourth
    groups' pages are never read (before: all of them were), and every pool page comes back."""
    tokens = prompt(272, N)
    source = make_kv(272)
    async with KVCache(_config(tmp_path), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        assert (await writer.offload(tokens, torch.arange(N))).stored == PAGES
        await writer.flush()

    kv = torch.full_like(source, POISON)
    cache = KVCache(_config(tmp_path), LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        keys = cache._manager.keys(tokens)
        names = [bytes(key).hex() for key in keys]
        started: list[int] = []  # pages whose load the tier handed to the backend, in order
        held: list[tuple[Any, ...]] = []
        real = disk.backend.start_load

        def start_load(*args: Any) -> None:
            page = names.index(args[1])
            started.append(page)
            if GROUP <= page < 2 * GROUP:
                held.append(args)  # the second group's reads: under way until the load returned
            else:
                real(*args)

        monkeypatch.setattr(disk.backend, "start_load", start_load)
        _eio(cache, keys[failed], every=True)
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        reads = disk.statistics().reads
        result = await cache.load(match, torch.arange(N))
        assert result.tokens == failed * T
        for args in held:
            real(*args)
        await assert_quiescent(cache)  # every read the load left behind ended, every page came back
        assert max(started) < 2 * GROUP, f"pages read past the failed group's cut: {started}"
        assert disk.statistics().reads - reads == len(started)
        assert torch.equal(kv[:, : failed * T], source[:, : failed * T])
        assert bool((kv[:, failed * T : N] == POISON).all())  # nothing past the prefix was written
        errors = cache.stats().errors
        assert errors.get("disk_read_failed") == 1, errors  # the failed page only: cut pages are no fault
    finally:
        await cache.aclose()
