"""Review 143: `tools/chaos_tp.py` for a couple of seeds (its many-seed runs are the real search).

Each seed runs a 2-rank `TPCache` on CPU under the soak's engine requests while rank processes are
SIGKILLed, SIGSTOPped and continued, stopped then killed, or their sockets shut down by a third
party, at moments drawn from the seed; then
closes it (at times with a rank stopped past the close's fence, or killed during it) and serves
every document from disk through a second cache the live ranks re-attach to. Its oracles: loaded
tokens bit-exact on every rank that lived through the call (not only when no rank restarted), a
call admitted with a rank missing loads nothing, no hang, nothing left referenced, no exception in
the loop, no thread, descriptor or /dev/shm segment left; a rank's engine wait (`wait_layer`)
that reports a layer ready finds its bytes there. The manager-kill mode SIGKILLs managers instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import chaos_tp


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [3, 101])
async def test_chaos_seeds_hold(seed: int) -> None:
    result = await chaos_tp.one_seed(seed, faults=2, clients=6)
    assert not result.failures, "\n".join(result.failures)
    assert result.tally is not None and result.faults is not None
    # The run did what it is for: faults landed, loads were served and checked.
    faults = result.faults
    assert faults.kills + faults.stops + faults.stop_kills + faults.severs >= 2, faults
    assert result.tally.verified_tokens > 100, result.tally


@pytest.mark.slow
@pytest.mark.asyncio
async def test_chaos_manager_kills_hold() -> None:
    # Three managers SIGKILLed in turn at random moments (a rank stopped across one at times), the
    # same live ranks re-attaching; a fourth serves every prompt bit-exact, and the dead managers'
    # segments are gone once the ranks let go.
    result = await chaos_tp.manager_seed(7, kills=3)
    assert not result.failures, "\n".join(result.failures)
    assert result.tally is not None and result.tally.verified_tokens > 100, result.tally
