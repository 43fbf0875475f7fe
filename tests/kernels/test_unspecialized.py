"""The scatter's ``skip`` and ``first_layer`` are one variant whatever their value.

Triton specializes an int argument equal to 1 as a constant (and one divisible by 16 apart); the
scatter lists both in ``do_not_specialize`` (``aiokv.kernels._jit.SCATTER_UNSPECIALIZED``: the two
wrong-KV sightings on a GPU TP rank were what a launch of the ``first_layer == 1`` variant with
another layer writes). Checked with Triton's own JIT keying: a real process compiles the scatter for
sm_90 (Triton's CUDA backend and ``ptxas``, no device) for several values of each argument, and the
variants it compiled must be one per :func:`aiokv.kernels.launch.launch_key`, the same key for
every skip and first layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aiokv.kernels.launch import launch_key, specialization

COMPILE = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from aiokv.kernels import _jit
from aiokv.kernels.launch import launch_key
from aiokv.kernels.precompile import _Pointer, _TargetOnly

driver.set_active(_TargetOnly(GPUTarget("cuda", 90, 32)))
constexprs = {"T": 16, "PAGE_IDS": False, "VEC": 2, "BLOCK_T": 64, "BLOCK_W": 128}
rows = []
for n_tokens in (1, 33):
    for skip in (0, 1, 3):
        for first in (0, 1, 2, 17):
            ptrs = [_Pointer(tl.int64, 0) for _ in range(6)]
            ints = [n_tokens, skip, first, 0, 0, 64, 4096, 0, 128]
            kernel = _jit.scatter_kernel.warmup(*ptrs, *ints, grid=(1,), **constexprs)
            key = launch_key("scatter", (*ptrs, *ints), constexprs)
            rows.append([repr(key[1][6:9]), kernel.hash])
print(json.dumps(rows))
"""


def test_launch_key_ignores_skip_and_first_layer_values() -> None:
    base = (16, 16, 16, 16, 16, 16, 64)  # the scatter's first seven arguments
    keys = {launch_key("scatter", (*base, skip, first), {}) for skip in (0, 1, 2, 16) for first in (0, 1, 2, 16)}
    assert len(keys) == 1, keys
    # The gather's ints (and the scatter's others) still specialize: 1 and multiples of 16 apart.
    assert specialization(1) != specialization(2) != specialization(16)
    assert launch_key("gather", (1,), {}) != launch_key("gather", (2,), {})


@pytest.mark.slow
def test_triton_compiles_one_scatter_variant_per_launch_key(tmp_path: os.PathLike[str]) -> None:
    pytest.importorskip("triton._C.libtriton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)  # Triton's own JIT keying, as on a GPU
    run = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    by_key: dict[str, set[str]] = {}
    by_hash: dict[str, set[str]] = {}
    for key, digest in rows:
        by_key.setdefault(key, set()).add(digest)
        by_hash.setdefault(digest, set()).add(key)
    # One compiled kernel per key and one key per compiled kernel: launch_key is Triton's partition.
    assert all(len(v) == 1 for v in by_key.values()), by_key
    assert all(len(v) == 1 for v in by_hash.values()), by_hash
    # n_tokens 1 and 33 are two variants; every skip and first layer falls into them.
    assert len(by_hash) == 2, by_hash
