"""`TPCache.start` racing `aclose`: nothing the start made outlives the cache.

Regression: an ``aclose`` that ran while ``start`` was inside ``RankGroup.start`` found no group,
closed the manager and freed the pool; ``start`` then kept the group it had opened and returned
normally, its socket still listening for rank workers of a pool that no longer existed. Now the
close waits for the start in flight, which closes the group it opened and raises RuntimeError.

``RankGroup.start`` is held on an ``asyncio.Event`` (before it binds, or after: listening) so the
close runs at a known point; the sockets and the pool are real.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, SLOTS

from aiokv import CacheConfig, KVLayout
from aiokv.tp import TPCache
from aiokv.tp import group as group_module
from aiokv.tp.endpoint import SOCKET_NAME

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)


def _cache(directory: Path) -> TPCache:
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-test",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    return TPCache(config, MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG, directory=directory)


def _accepts(path: Path) -> bool:
    """Whether something listens on the Unix socket ``path`` (a real connect)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
    return True


@pytest.mark.asyncio
@pytest.mark.parametrize("held", ["before-bind", "listening"])
async def test_a_close_during_start_leaves_no_listening_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()
    groups: list[group_module.RankGroup] = []
    real_start = group_module.RankGroup.start

    async def held_start(self: group_module.RankGroup) -> None:
        groups.append(self)
        if held == "listening":
            await real_start(self)
        entered.set()
        await gate.wait()
        if held == "before-bind":
            await real_start(self)

    monkeypatch.setattr(group_module.RankGroup, "start", held_start)
    directory = tmp_path / "sock"
    cache = _cache(directory)
    starting = asyncio.create_task(cache.start())
    closing: asyncio.Task[None] | None = None
    try:
        await entered.wait()
        (group,) = groups
        assert _accepts(directory / SOCKET_NAME) == (held == "listening")
        closing = asyncio.create_task(cache.aclose())
        for _ in range(20):  # loop turns: the close gets as far as it can while the start is held
            await asyncio.sleep(0)
        assert not closing.done()  # it waits for the start in flight
        assert not cache._manager.pool.closed  # nothing freed under the starting group
    finally:
        gate.set()  # never leave the start held when the test fails
    with pytest.raises(RuntimeError, match="closed while it was starting"):
        await starting
    assert closing is not None
    await closing
    # The group the start opened is closed: nothing listens, the socket and the directory are gone.
    assert group._closing and group._listener is None
    assert not _accepts(group.address)
    assert not directory.exists()
    assert cache._group is None
    with pytest.raises(RuntimeError):
        cache.group  # noqa: B018 - the property raises when there is no group
    with pytest.raises(RuntimeError):
        await cache.offload(list(range(8)), torch.arange(8))
    with pytest.raises(RuntimeError, match="cannot be started again"):
        await cache.start()
    await cache.aclose()  # idempotent


@pytest.mark.asyncio
async def test_a_start_without_a_close_still_listens(tmp_path: Path) -> None:
    # The same cache, undisturbed: the start returns and the group accepts rank workers.
    cache = _cache(tmp_path / "sock")
    await cache.start()
    try:
        assert _accepts(Path(cache.address))
    finally:
        await cache.aclose()
    assert not _accepts(Path(cache.group.address))


@pytest.mark.asyncio
async def test_a_second_start_while_one_runs_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()
    real_start = group_module.RankGroup.start

    async def held_start(self: group_module.RankGroup) -> None:
        entered.set()
        await gate.wait()
        await real_start(self)

    monkeypatch.setattr(group_module.RankGroup, "start", held_start)
    cache = _cache(tmp_path / "sock")
    first = asyncio.create_task(cache.start())
    try:
        await entered.wait()
        with pytest.raises(RuntimeError, match="already running"):
            async with asyncio.timeout(10):  # a bound only: a second start that waited on the gate hung
                await cache.start()
    finally:
        gate.set()
    await first  # the first start is not disturbed
    try:
        assert _accepts(Path(cache.address))
        await cache.start()  # started: a no-op
    finally:
        await cache.aclose()
