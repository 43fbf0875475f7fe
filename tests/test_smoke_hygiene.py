import asyncio

import pytest


@pytest.mark.asyncio
async def test_loop_runs() -> None:
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, 1)
    assert await fut == 1


def test_sync_test_gets_hygiene_too() -> None:
    assert True is not False
