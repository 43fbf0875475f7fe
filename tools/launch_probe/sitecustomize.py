"""A launch probe for Triton kernels, for GPU runs: put this folder on ``PYTHONPATH`` and set
``AIOKV_PROBE_DIR`` to a folder; every Python process started so (pytest workers, rank processes,
the precompile helpers) then checks each Triton launch and logs to ``probe-<pid>.log`` there.

Why: the wrong KV seen twice on a GPU TP rank (docs/measurements.md, forty-first and forty-second
sessions) looked like a launch of a kernel variant compiled for other argument values (an int equal
to 1 is compiled in as a constant). After every ``JITFunction.run`` this compares the
``CompiledKernel`` launched (its ``src.constants``, signature and 16-divisibility attributes) with
the arguments passed and logs ``MISMATCH`` with both; it logs each compile (``COMPILE``), two
threads inside one kernel's ``run`` at once (``CONCURRENT``, the first 50), and its counters at the
first and every 500th checked launch (``COUNT``). Relies on Triton 3.x internals (checked with 3.6
and 3.9); a probe error is logged, never raised. Usage::

    mkdir -p /tmp/probe
    AIOKV_PROBE_DIR=/tmp/probe PYTHONPATH=tools/launch_probe AIOKV_TEST_DEVICE=cuda pytest ...
    grep -h MISMATCH /tmp/probe/*.log
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_DIR = os.environ.get("AIOKV_PROBE_DIR")
_lock = threading.Lock()
_stats = {"launches": 0, "checked": 0, "mismatch": 0, "concurrent": 0, "compiles": 0, "probe_errors": 0}
_inside: dict[int, set[int]] = {}


def _log(line: str) -> None:
    try:
        with open(os.path.join(_DIR or ".", f"probe-{os.getpid()}.log"), "a") as f:
            f.write(f"{time.time():.6f} {threading.current_thread().name} {line}\n")
    except OSError:
        pass


def _divisible(attrs: dict[Any, Any], index: int) -> bool:
    return any(a and a[0] == "tt.divisibility" for a in attrs.get((index,), []))


def check(fn: Any, kernel: Any, args: Sequence[object], kwargs: dict[str, object]) -> list[str]:
    """What of ``kernel`` (a CompiledKernel) does not fit the arguments of this launch of ``fn``."""
    src = getattr(kernel, "src", None)
    if src is None:
        return []
    consts = getattr(src, "constants", None) or {}
    sig = getattr(src, "signature", None) or {}
    attrs = getattr(src, "attrs", None) or {}
    values = list(args) + [kwargs.get(p.name) for p in fn.params[len(args):]]
    bad = []
    for i, (param, value) in enumerate(zip(fn.params, values, strict=False)):
        name = param.name
        if param.is_constexpr or sig.get(name) == "constexpr":
            if isinstance(value, int) and consts.get((i,), "<none>") != value:
                bad.append(f"{name}: compiled as {consts.get((i,), '<none>')!r}, launched with {value!r}")
        elif hasattr(value, "data_ptr"):
            if _divisible(attrs, i) and value.data_ptr() % 16:
                bad.append(f"{name}: compiled 16-aligned, pointer {value.data_ptr():#x}")
        elif isinstance(value, int) and not isinstance(value, bool) and _divisible(attrs, i) and value % 16:
            bad.append(f"{name}: compiled divisible by 16, launched with {value!r}")
    return bad


def _patch(jit: ModuleType) -> None:
    cls = jit.JITFunction
    run, do_compile = cls.run, cls._do_compile

    def probed_run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        with _lock:
            _stats["launches"] += 1
            others = _inside.setdefault(id(self), set())
            concurrent = bool(others)
            _stats["concurrent"] += concurrent
            first_concurrent = concurrent and _stats["concurrent"] <= 50
            others.add(me)
        if first_concurrent:
            _log(f"CONCURRENT {self.__name__} ints={[a for a in args if isinstance(a, int)][:6]}")
        try:
            kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            with _lock:
                _inside[id(self)].discard(me)
        try:
            bad = check(self, kernel, args, kwargs) if kernel is not None else []
            with _lock:
                _stats["checked"] += kernel is not None
                _stats["mismatch"] += bool(bad)
                count = _stats["checked"] % 500 == 1
            if bad:
                _log(f"MISMATCH {self.__name__} hash={getattr(kernel, 'hash', '?')}: " + "; ".join(bad))
            if count:
                _log(f"COUNT {_stats}")
        except Exception as exc:  # a probe that cannot check must not fail the launch
            with _lock:
                _stats["probe_errors"] += 1
            _log(f"probe error: {exc!r}")
        return kernel

    def probed_compile(self: Any, key: str, *rest: Any) -> Any:
        began = time.perf_counter()
        kernel = do_compile(self, key, *rest)
        with _lock:
            _stats["compiles"] += 1
        _log(f"COMPILE {self.__name__} {time.perf_counter() - began:.3f} s key={key[:300]}")
        return kernel

    cls.run, cls._do_compile = probed_run, probed_compile
    _log(f"patched triton {getattr(sys.modules.get('triton'), '__version__', '?')} argv={sys.argv[:4]}")


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``triton.runtime.jit`` as it is imported (nothing imported before it is needed)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != "triton.runtime.jit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module: ModuleType) -> None:
            exec_module(module)
            try:
                _patch(module)
            except Exception as exc:
                _log(f"patch failed: {exc!r}")

        loader.exec_module = patched_exec
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
