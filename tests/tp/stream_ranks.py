"""Two FakeRanks (claiming CUDA) for the TP load-stream tests: OFFLOAD specs reported at once, LOAD
specs queued for the test to report, every submitted job recorded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_group import FakeRank

from aiokv.tp import Direction, Job, RankGroup, TransferSpec


@dataclass
class StreamRanks:
    jobs: list[Job] = field(default_factory=list)
    """Every job submitted through ``group.submit_queued``, in order."""
    ranks: list[FakeRank] = field(default_factory=list)
    loads: list[asyncio.Queue[TransferSpec]] = field(default_factory=list)
    """Per rank, the LOAD specs it received (the test reports them)."""
    servers: list[asyncio.Future[None]] = field(default_factory=list)

    async def close(self) -> None:
        for server in self.servers:
            server.cancel()
        for rank in self.ranks:
            await rank.close()


async def stream_ranks(group: RankGroup, monkeypatch: pytest.MonkeyPatch) -> StreamRanks:
    """Connect two FakeRanks to ``group`` and serve their specs (close with :meth:`StreamRanks.close`)."""
    out = StreamRanks()
    real_submit = group.submit_queued

    def submit_queued(spec: TransferSpec, **kwargs: Any) -> Job:  # a spy: the real submit runs
        job = real_submit(spec, **kwargs)
        out.jobs.append(job)
        return job

    monkeypatch.setattr(group, "submit_queued", submit_queued)
    out.ranks = [await FakeRank.connect(group, r, device="cuda") for r in range(2)]
    out.loads = [asyncio.Queue(), asyncio.Queue()]

    async def serve(r: int) -> None:
        while True:
            try:
                spec = await out.ranks[r].next_spec()
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if spec.direction is Direction.OFFLOAD:
                out.ranks[r].report(spec.job_id)
            else:
                out.loads[r].put_nowait(spec)

    out.servers = [asyncio.ensure_future(serve(r)) for r in range(2)]
    return out
