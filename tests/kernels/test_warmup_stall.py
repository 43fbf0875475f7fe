"""The warm-up imports no module of aiokv on its thread (:mod:`aiokv.kernels.warmup`).

An import compiles the module's source when no bytecode is cached (``PYTHONDONTWRITEBYTECODE``, a
fresh tree), holding the GIL throughout: the warm-up's first import of ``precompile`` held it
~8.6 ms (4 ms before the cache listings) while the engine's event loop waited, the loop's worst
stall of the warm-up on the H200. Each warm-up here runs in a fresh interpreter that imported what
an engine's process has before its loop runs (the package, and what ``KVCache.preload`` imports on
CUDA), as on CUDA (variants kept loaded, a real helper process compiling for sm_90 first; launches
interpreted): a cold Triton cache (a helper starts), then a restart on it (listed: no helper).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiokv.kernels.paths import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: movers under the Triton interpreter")

SCRIPT = r"""
import json, sys

import torch

import aiokv
from aiokv.kernels import PageMover, TransferPath
from aiokv.kernels.launch import specialization  # what KVCache.preload imports on CUDA
from aiokv.kernels import warmup
from aiokv.layout import KVBuffer, KVLayout, TPSlice
from triton.backends.compiler import GPUTarget

specialization(0)
warmup._compiles = lambda device: True
warmup._compile_target = lambda: (GPUTarget("cuda", 90, 32), sys.argv[1])
layout = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
kv = KVBuffer.wrap(layout, torch.zeros(layout.num_layers, 64, layout.rows, layout.head_dim, dtype=layout.dtype),
                   TPSlice.of(layout))
pool = torch.zeros((8, layout.page_bytes // layout.itemsize), dtype=layout.dtype)
pool = pool[:, : layout.payload_bytes // layout.itemsize].view(8, *layout.page_shape)
mover = PageMover(kv, pool, TransferPath.DIRECT, 2)
warmup.variants_of(mover)  # the enumeration is not what this checks
before = set(sys.modules)
result = warmup.warm_up(mover)
imported = sorted(name for name in set(sys.modules) - before if name.split(".")[0] == "aiokv")
print(json.dumps({"imported": imported, "variants": result.variants, "precompiled": result.precompiled,
                  "cached": result.cached, "error": result.precompile_error}))
"""


def _warm_up_in_a_fresh_process(cache: Path) -> dict[str, object]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True,
                         timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert isinstance(out, dict)
    return out


def test_the_warm_up_imports_no_module_of_aiokv_on_its_thread(tmp_path: Path) -> None:
    cold = _warm_up_in_a_fresh_process(tmp_path / "triton")
    assert cold["error"] is None and cold["precompiled"] == cold["variants"], cold  # a real helper ran
    assert isinstance(cold["variants"], int) and cold["variants"] > 0, cold
    assert cold["imported"] == [], f"the warm-up imported these on its thread: {cold}"
    restart = _warm_up_in_a_fresh_process(tmp_path / "triton")  # listed: no helper, the listings read
    assert restart["error"] is None and restart["cached"] == restart["variants"] == cold["variants"], restart
    assert restart["imported"] == [], f"the warm-up imported these on its thread: {restart}"
