import asyncio

import pytest


@pytest.mark.asyncio
async def test_runs_under_both_loops(request: pytest.FixtureRequest) -> None:
    loop = asyncio.get_running_loop()
    name = request.node.callspec.id
    assert ("uvloop" in type(loop).__module__) == (name == "uvloop")
