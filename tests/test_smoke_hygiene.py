import asyncio

import pytest


@pytest.mark.asyncio
async def test_loop_runs() -> None:
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, 1)
    assert await fut == 1


def test_sync_test_gets_hygiene_too() -> None:
    assert True is not False


def test_importing_aiokv_does_not_load_triton() -> None:
    # The package import is cheap: Triton loads with the first mover (a cache's start()).
    import subprocess
    import sys

    code = "import sys, aiokv; loaded = [m for m in sys.modules if m.split('.')[0] == 'triton']; print(loaded)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_version_is_exported() -> None:
    import aiokv

    assert isinstance(aiokv.__version__, str) and aiokv.__version__[0].isdigit()
