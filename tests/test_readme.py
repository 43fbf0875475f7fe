"""The README's quick start runs, and its configuration table names every CacheConfig field."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiokv

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.slow(seconds=10)
def test_quick_start_runs() -> None:
    (block,) = _python_blocks()
    # A fresh interpreter: the block calls asyncio.run itself.
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Tier.POOL" in done.stdout


def test_configuration_table_lists_every_field() -> None:
    text = README.read_text()
    for field in dataclasses.fields(aiokv.CacheConfig):
        assert f"`{field.name}`" in text, f"README's configuration table misses {field.name}"


def test_public_api_is_pinned() -> None:
    assert sorted(aiokv.__all__) == [
        "Admission",
        "CacheConfig",
        "CacheStatistics",
        "DiskBackend",
        "KVCache",
        "KVLayout",
        "LoadResult",
        "Match",
        "OffloadResult",
        "PrefetchResult",
        "StaleHandleError",
        "Tier",
        "TransferPath",
    ]
    for name in aiokv.__all__:
        assert getattr(aiokv, name) is not None


def test_only_aiokv_is_installed_as_a_top_level_name() -> None:
    # kernels/ and storage/ install as aiokv.kernels and aiokv.storage, never as top-level names.
    import importlib.util

    assert importlib.util.find_spec("aiokv.kernels") is not None
    assert importlib.util.find_spec("aiokv.storage") is not None
    # Without PYTHONPATH: what the installation provides, not a source tree put on the path by hand
    # (a run from a plain copy of the repository makes kernels/ and storage/ top-level on purpose).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    outside = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('kernels'), u.find_spec('storage'))"],
        capture_output=True, text=True, cwd="/", check=True, env=env,
    )
    assert outside.stdout.strip() == "None None"
