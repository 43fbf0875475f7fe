"""tools/launch_probe: its check names a launch of a variant compiled for other argument values."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from aiokv.kernels import _jit

PROBE = Path(__file__).resolve().parent.parent / "tools" / "launch_probe"


def _probe() -> object:
    spec = importlib.util.spec_from_file_location("launch_probe", PROBE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_names_a_constant_launched_with_another_value() -> None:
    check = _probe().check  # type: ignore[attr-defined]
    # The JIT function's parameters as Triton lists them (the tests run the interpreter's stand-in).
    names = list(inspect.signature(_jit.scatter_kernel.fn).parameters)
    fn = SimpleNamespace(params=[SimpleNamespace(name=n, is_constexpr=n.isupper()) for n in names])
    words = torch.zeros(4, dtype=torch.int64)
    constexprs = {"T": 16, "PAGE_IDS": False, "VEC": 2, "BLOCK_T": 64, "BLOCK_W": 64}
    signature = {p.name: "i32" for p in fn.params} | {"first_layer": "constexpr"}
    src = SimpleNamespace(constants={(8,): 1, (15,): 16, (16,): False, (17,): 2, (18,): 64, (19,): 64},
                          signature=signature, attrs={(11,): [["tt.divisibility", 16]]})
    kernel = SimpleNamespace(src=src)
    args = [words] * 6 + [128, 1, 1, 0, 0, 64, 0, 0, 64]
    assert check(fn, kernel, args, constexprs) == []
    args[8] = 2  # layer 2 launched on the variant compiled for first_layer == 1
    assert check(fn, kernel, args, constexprs) == ["first_layer: compiled as 1, launched with 2"]
    args[11] = 65  # width no longer a multiple of 16 either
    assert check(fn, kernel, args, constexprs)[1] == "width: compiled divisible by 16, launched with 65"
    constexprs["VEC"] = 4
    assert "VEC: compiled as 2, launched with 4" in check(fn, kernel, args, constexprs)


def test_it_patches_triton_only_where_asked(tmp_path: Path) -> None:
    code = "import triton.runtime.jit as j; print(j.JITFunction.run.__name__)"
    env = {"PYTHONPATH": str(PROBE), "PATH": "/usr/bin:/bin"}
    on = subprocess.run([sys.executable, "-c", code], env={**env, "AIOKV_PROBE_DIR": str(tmp_path)},
                        capture_output=True, text=True, timeout=120, check=True)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert (on.stdout.strip(), off.stdout.strip()) == ("probed_run", "run")
    assert "patched triton" in next(tmp_path.glob("probe-*.log")).read_text()
