"""A process that exits while aiokv works exits with its own status: no crash, no hang.

An engine's process may end with the cache busy and never closed (an error escaping its main
coroutine, ``sys.exit`` from a handler). Four tasks offload to the pool and the disk tier and load
back; after a random moment the main coroutine raises ``SystemExit(7)``: ``asyncio.run`` cancels the
tasks and closes the loop, then the interpreter ends with aiokv's threads (copy, disk, checksum)
and its ring still there. The process must exit 7.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BUSY = '''
import asyncio, random, sys
from pathlib import Path

import torch

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout

backend, seed, disk = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
rng = random.Random(seed)
layout = KVLayout.mha(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_tokens=16)


async def main() -> None:
    kv = torch.randn(4, 4096, 4, 64).to(torch.float16)
    config = CacheConfig(cpu_bytes=8 << 20, disk_dir=disk, disk_bytes=1 << 30, disk_backend=DiskBackend(backend),
                         namespace=f"exit-busy-{seed}")
    cache = KVCache(config, layout, kv)
    await cache.start()

    async def work() -> None:
        while True:
            tokens = [rng.randrange(50) for _ in range(16 * rng.randrange(1, 16))]
            await cache.offload(tokens, torch.arange(len(tokens)))
            hit = await cache.match(tokens)
            await cache.load(hit, torch.arange(2048, 2048 + hit.tokens))

    tasks = [asyncio.create_task(work()) for _ in range(4)]
    await asyncio.sleep(rng.uniform(0.2, 1.5))
    assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
    raise SystemExit(7)


asyncio.run(main())
'''


@pytest.mark.parametrize("backend", ["uring_fixed", "threads"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_process_exiting_while_the_cache_works_exits_with_its_status(
        tmp_path: Path, backend: str, seed: int) -> None:
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    done = subprocess.run([sys.executable, str(script), backend, str(seed), str(tmp_path / "disk")],
                          env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, (done.returncode, done.stderr[-4000:])
