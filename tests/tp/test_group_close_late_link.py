"""A connection the group's listening socket accepted before the close, but made only after the
close ended its links, is ended too.

asyncio makes an accepted connection a few loop turns after the accept (in a task): a rank whose
session a close fence ended says hello again at once, and the group, which since review 177 listens
until no job is in flight, accepted it and made it after its close had listed the links it ends:
left open, its socket leaked (a ``ResourceWarning`` failed ``test_tp_close_fence`` in a loaded run).
Here the making of one accepted connection is held until the close has ended its links, then let go
while the close still runs: from Python 3.12 on, ``Server.wait_closed`` (the close's last await) waits
for every connection the server accepted, so the close ends only once that late one is ended too (a
test that held the making until after the close hung there for good; 3.11 did not wait)."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest
import torch
from loop_probes import until
from tp_helpers import new_pool

from aiokv.layout import KVLayout
from aiokv.tp import RankGroup, TPConfig
from aiokv.tp import group as group_module

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)


@pytest.mark.asyncio
async def test_a_connection_made_after_the_close_is_ended(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    real = group_module._RankLink.connection_made
    held: list[tuple[Any, asyncio.BaseTransport]] = []
    accepted = asyncio.Event()

    def made_later(link: Any, transport: asyncio.BaseTransport) -> None:
        held.append((link, transport))
        accepted.set()

    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        group = RankGroup(LAYOUT, 2, pool.name, pool.num_pages, TPConfig(), tmp_path / "mgr")
        await group.start()
        monkeypatch.setattr(group_module._RankLink, "connection_made", made_later)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, os.fspath(group.address))
        async with asyncio.timeout(10):
            await accepted.wait()  # accepted: its making is held
        closing = asyncio.ensure_future(group.aclose())
        await until(lambda: group._links_ended)  # the close ended every link it knew
        monkeypatch.setattr(group_module._RankLink, "connection_made", real)
        link, transport = held[0]
        link.connection_made(transport)  # made now: after that
        await until(lambda: transport.get_extra_info("socket").fileno() == -1)  # closed on the loop
        assert transport.is_closing()
        assert link not in group._links
        async with asyncio.timeout(10):
            await closing  # 3.12: the server's wait_closed waited for this connection
    finally:
        client.close()
        await pool.aclose()
