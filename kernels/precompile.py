"""Compile kernel variants in a helper process, into Triton's disk cache.

Triton's compile of a variant (MLIR passes, then ``ptxas``) runs in C++ holding the GIL for stretches
of ~20 ms: compiled on a thread of the engine's process, it stalls the event loop that long (H200:
up to 23 ms while the warm-up compiled). :class:`Precompile` runs those compiles in a child
interpreter instead; the warm-up then launches each variant in the process, where Triton finds it
in its disk cache (``TRITON_CACHE_DIR``, passed on as the parent resolved it) and only loads the
binary (~2 ms of Python per variant; the module load releases the GIL).

The child imports Triton and ``_jit.py`` only (no torch, no CUDA context, no GPU memory): it compiles
for the parent's :class:`GPUTarget` through the JIT's own ``warmup`` with stand-in arguments that
Triton specializes exactly as the key says (checked, key by key), so the JIT computes the same
cache key the parent's launch will. It reports ``ok <i>`` or ``fail <i> <why>`` per key, in order.

Run as a script (``python precompile.py``, a request as JSON on stdin) it is the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .launch import LaunchKey

STALL_S = 120.0
"""The child is given up (killed) when it reports nothing for this long (one compile takes ~0.3 s)."""

_POLL_S = 0.05
"""How often a wait for the child looks at the caller's stop event."""


class Precompile:
    """A child process compiling ``keys`` for ``target`` (a Triton ``GPUTarget``) into ``cache_dir``.

    Starts the child at once. :meth:`wait` blocks until it reported a key (from the thread that
    owns this object); :meth:`close` kills it if still running and reaps it. A child that cannot
    start, crashes or stalls past :data:`STALL_S` leaves :attr:`error` set; a key it could not compile
    is in :attr:`failures`. The caller compiles what is missing itself, as without a child.
    """

    def __init__(self, keys: Sequence[LaunchKey], target: Any, cache_dir: str) -> None:
        from . import _jit

        self.keys = list(keys)
        self.ok = 0
        """Keys the child compiled (or found in the cache)."""
        self.reported = 0
        """Keys the child is done with, in order (compiled or failed)."""
        self.error: str | None = None
        """Why the child ended before its last key (None: it did not)."""
        self.failures: dict[int, str] = {}
        """Keys the child could not compile, by index: why."""
        self._buffer = b""
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        request = {
            "target": [target.backend, target.arch, target.warp_size],
            "jit_file": _jit.__file__,
            "jit_module": _jit.__name__,
            "sys_path": [p for p in sys.path if p],
            "keys": self.keys,  # tuples as JSON arrays: the child turns them back
        }
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        env.pop("TRITON_INTERPRET", None)
        self._child: subprocess.Popen[bytes] | None = None
        try:
            if not sys.executable:
                raise OSError("no Python executable to run (sys.executable is empty)")
            self._child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._stderr, env=env, close_fds=True,
            )
            assert self._child.stdin is not None
            with self._child.stdin:
                self._child.stdin.write(json.dumps(request).encode())
        except OSError as exc:  # no interpreter, no fork, or the child died before reading
            self._fail(f"the compile process did not start: {exc!r}")

    @property
    def running(self) -> bool:
        return self._child is not None and self.error is None and self.reported < len(self.keys)

    def wait(self, index: int, stop: threading.Event | None = None) -> bool:
        """Wait until the child is done with key ``index``; True when it compiled it. False when it
        failed that key, ended before it (:attr:`error`), or ``stop`` is set (the child is killed)."""
        last = time.monotonic()
        while self.reported <= index:
            if self.error is not None:
                return False
            if stop is not None and stop.is_set():
                self.close()
                return False
            assert self._child is not None and self._child.stdout is not None
            fd = self._child.stdout.fileno()
            readable, _, _ = select.select([fd], [], [], _POLL_S)  # releases the GIL while it waits
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._ended()
                    continue
                self._take(chunk)
                last = time.monotonic()
            elif time.monotonic() - last > STALL_S:
                self._fail(f"the compile process reported nothing for {STALL_S:.0f} s")
        return index not in self.failures

    def _take(self, chunk: bytes) -> None:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            status, _, rest = raw.decode(errors="replace").partition(" ")
            index_text, _, why = rest.partition(" ")
            if status not in ("ok", "fail") or not index_text.isdigit() or int(index_text) != self.reported:
                self._fail(f"the compile process wrote {raw[:200]!r}")
                return
            if status == "ok":
                self.ok += 1
            else:
                self.failures[self.reported] = why
            self.reported += 1

    def _ended(self) -> None:
        """EOF on the child's output: it exited."""
        code = self._child.wait() if self._child is not None else None
        if self.reported < len(self.keys):
            self._fail(f"the compile process exited with {code} after {self.reported} of {len(self.keys)} keys")

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = f"{why}{self._stderr_tail()}"
        self.close()

    def _stderr_tail(self) -> str:
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - 600))
            tail = self._stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends: {tail}" if tail else ""

    def close(self) -> None:
        """Kill the child if it still runs, reap it, release its pipes. Idempotent."""
        child, self._child = self._child, None
        if child is not None:
            if child.poll() is None:
                child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
            if self.reported < len(self.keys) and self.error is None:
                self.error = "stopped"
        with contextlib.suppress(OSError):
            self._stderr.close()

    def __enter__(self) -> Precompile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the child ------------------------------------------------------------------------------------


class _TargetOnly:
    """Triton's driver, reduced to what compiling for a known target needs: no device is touched."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0  # the JIT's per-device cache key; warmup launches nothing

    def get_current_stream(self, device: int) -> int:
        return 0


class _Pointer:
    """A tensor argument as Triton's specialization sees it: a dtype and an address."""

    def __init__(self, dtype: Any, address: int) -> None:
        self.dtype = dtype
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def _stand_in(spec: tuple[object, ...], specialize: Any, dtypes: dict[str, Any]) -> object:
    """An argument Triton specializes as ``spec`` (a pointer of that dtype and alignment, or an int)."""
    kind = spec[0]
    candidates: list[object]
    if isinstance(kind, str) and kind.startswith("*") and kind[1:] in dtypes:
        candidates = [_Pointer(dtypes[kind[1:]], address) for address in (0, 8, 4, 2, 1)]
    else:
        candidates = [16, 17, 1, 0, 2**32, 2**32 + 1, 2**63 + 16, 2**63 + 17, -16, -17]
    for arg in candidates:
        if specialize(arg) == spec:
            return arg
    raise ValueError(f"no stand-in argument is specialized as {spec}")


def _freeze(value: object) -> object:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _child_main() -> None:
    request = json.load(sys.stdin)
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    import importlib.util

    import triton.language as tl
    from triton._C.libtriton import native_specialize_impl
    from triton._utils import canonicalize_dtype
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.runtime import driver

    driver.set_active(_TargetOnly(GPUTarget(*request["target"])))
    spec = importlib.util.spec_from_file_location(request["jit_module"], request["jit_file"])
    assert spec is not None and spec.loader is not None
    jit = importlib.util.module_from_spec(spec)
    sys.modules[request["jit_module"]] = jit  # the JIT names kernels by module: as in the parent
    spec.loader.exec_module(jit)
    dtypes = {}
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "bfloat16",
                 "float32", "float64"):
        dtype = getattr(tl, name)
        dtypes[canonicalize_dtype(dtype)] = dtype

    def specialize(arg: object) -> object:
        return tuple(native_specialize_impl(BaseBackend, arg, False, True, True))

    for index, (name, specs, constexprs) in enumerate(request["keys"]):
        try:
            kernel = getattr(jit, f"{name}_kernel")
            args = [_stand_in(_freeze(s), specialize, dtypes) for s in specs]  # type: ignore[arg-type]
            kernel.warmup(*args, grid=(1,), **dict(constexprs))
            line = f"ok {index}"
        except Exception as exc:  # reported; the parent compiles this one itself
            line = f"fail {index} {type(exc).__name__}: {exc}".replace("\n", " ")[:1000]
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child_main()
