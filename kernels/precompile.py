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

*A restart with a warm cache starts no child.* Starting one costs 1.7-2.9 s (an interpreter importing
Triton) before the first launch, also when Triton's cache holds every variant already. So the child
lists each variant it compiled (or found) in a small file of its own under :data:`ENTRIES_DIR` in
Triton's cache directory: the launch key, the :func:`fingerprint` of what else decides Triton's cache
key (Triton's version and install, the target, ``_jit.py``'s source, Triton's environment), and the
files of Triton's entry. :func:`cached_variants` reads them back (a few syscalls per variant, no
compile, no Triton call) and the warm-up starts a child for the other variants only. A listing
decides nothing about a launch: Triton still looks its entry up itself, so a stale one costs at worst
a compile in the process (:func:`stale_entries` finds those afterwards: counted, and removed).

Run as a script (``python precompile.py``, a request as JSON on stdin) it is the child.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import stat
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

ENTRIES_DIR = "aiokv-variants"
"""Folder in Triton's cache directory where the child lists the variants it left there, a file each."""

_ENTRY_FORMAT = 1
_ENTRY_MAX_BYTES = 1 << 20
"""A listing, or a group or metadata file of Triton's, larger than this is not one (read no further)."""


class Precompile:
    """A child process compiling ``keys`` for ``target`` (a Triton ``GPUTarget``) into ``cache_dir``.

    Starts the child at once. :meth:`wait` blocks until it reported a key (from the thread that
    owns this object); :meth:`close` kills it if still running and reaps it. A child that cannot
    start, crashes or stalls past :data:`STALL_S` leaves :attr:`error` set; a key it could not compile
    is in :attr:`failures`. The caller compiles what is missing itself, as without a child.
    """

    def __init__(self, keys: Sequence[LaunchKey], target: Any, cache_dir: str,
                 listing: dict[str, object] | None = None) -> None:
        """``listing``: the parent's :func:`fingerprint`; the child then lists what it compiled."""
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
            "listing": listing,
        }
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        env.pop("TRITON_INTERPRET", None)
        self._child: subprocess.Popen[bytes] | None = None
        try:
            if not sys.executable:
                raise OSError("no Python executable to run (sys.executable is empty)")
            self._child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                # A session (and process group) of its own: Triton runs ptxas as its child, which
                # killing the helper alone left running (and holding the output pipe open).
                stderr=self._stderr, env=env, close_fds=True, start_new_session=True,
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
            # ASCII digits only: str.isdigit() accepts "²", which int() refuses (a ValueError out
            # of the warm-up instead of this fail).
            if (status not in ("ok", "fail") or not (index_text.isascii() and index_text.isdigit())
                    or int(index_text) != self.reported):
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
            # The whole group: Triton's ptxas too. The group is the child's own (start_new_session),
            # so this reaches nothing of ours, even once the child has exited.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
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


# -- the listing of variants in Triton's cache -------------------------------------------------------


def fingerprint(target: Any) -> dict[str, object]:
    """What decides, besides a launch key, which entry of Triton's cache a launch of it loads: Triton's
    version and install (its library's size and mtime: a reinstall changes them), the target
    (``GPUTarget``), the kernels' source, Triton's environment (``TRITON_*`` but the cache directory,
    and the variables Triton says invalidate its cache). JSON values only. Knobs a process sets in code
    are not in it: :func:`stale_entries` finds what they change. Raises what an unexpected Triton raises."""
    import triton
    from triton._C import libtriton

    from . import _jit

    with open(_jit.__file__, "rb") as source:
        digest = hashlib.sha256(source.read()).hexdigest()
    library = os.stat(libtriton.__file__)
    env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR"}
    env.update(libtriton.get_cache_invalidating_env_vars())
    return {
        "format": _ENTRY_FORMAT,
        "triton": str(triton.__version__),
        "install": [library.st_size, library.st_mtime_ns],
        "target": [str(target.backend), int(target.arch), int(target.warp_size)],
        "source": digest,
        "env": sorted([str(k), str(v)] for k, v in env.items()),
    }


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def _entry_path(cache_dir: str, listing: object, key: object) -> str:
    name = hashlib.sha256(_canonical([listing, key]).encode()).hexdigest()[:40]
    return os.path.join(cache_dir, ENTRIES_DIR, f"{name}.json")


def _plain_name(name: object) -> bool:
    """A file name within one folder (no separator, not ``.``/``..``): a listing names nothing elsewhere."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _read_small(path: str) -> bytes | None:
    """A regular file's bytes, or None (absent, too large, or not a regular file: a symlink is not
    followed and a FIFO or device never blocks, it is opened non-blocking and fstat'ed first)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _ENTRY_MAX_BYTES:
            return None
        return os.read(fd, _ENTRY_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def _is_file(path: object) -> bool:
    """A non-empty regular file."""
    try:
        info = os.stat(path) if isinstance(path, str) else None
    except (OSError, ValueError):
        return False
    return info is not None and stat.S_ISREG(info.st_mode) and info.st_size > 0


def _whole_group(group_file: str) -> dict[str, str] | None:
    """The files of a Triton cache entry (name -> path, from its group file) when the entry is whole:
    the group file reads as Triton writes it, each file it names is a non-empty regular file, and the
    metadata (``.json``) is a JSON object. None otherwise: a launch would compile it, or fail on it."""
    raw = _read_small(group_file)
    if raw is None:
        return None
    try:
        paths = json.loads(raw)["child_paths"]
        if not isinstance(paths, dict) or not paths:
            return None
        for name, path in paths.items():
            if not (isinstance(name, str) and _is_file(path)):
                return None
            if name.endswith(".json"):
                metadata = _read_small(path)
                if metadata is None or not isinstance(json.loads(metadata), dict):
                    return None
    except (ValueError, KeyError, TypeError, RecursionError):  # deep nesting: RecursionError
        return None
    return dict(paths)


def listed_variant(cache_dir: str, listing: dict[str, object], key: LaunchKey) -> str | None:
    """The hash of Triton's entry for ``key`` when a child listed it under this fingerprint and the
    entry is whole (:func:`_whole_group`, naming exactly the listed files: a cache hit for Triton);
    None otherwise (no listing, another fingerprint or key in it, a malformed one, Triton's entry
    partial or torn). Reads three small files, stats a few; never raises."""
    raw = _read_small(_entry_path(cache_dir, listing, key))
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
        if _canonical(entry["fingerprint"]) != _canonical(listing) or _canonical(entry["key"]) != _canonical(key):
            return None
        triton_hash, folder, files = entry["hash"], entry["dir"], entry["files"]
        if not (isinstance(triton_hash, str) and _plain_name(folder) and isinstance(files, list)
                and all(_plain_name(f) for f in files)):
            return None
        metadata = [f for f in files if f.endswith(".json")]
        if len(metadata) != 1:
            return None
        paths = _whole_group(os.path.join(cache_dir, folder, f"__grp__{metadata[0]}"))
        if paths is None or sorted(paths) != sorted(files):
            return None
    except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, or not the JSON a child writes
        return None
    return triton_hash


def stale_entries(listed: dict[LaunchKey, str], device: int | None = None) -> list[LaunchKey] | None:
    """Of the variants launched because they were listed (``listed``: key -> the entry's hash), those
    whose launch in this process did not load that entry: this process keys them otherwise (a knob
    set in code, another ptxas), so it compiled them itself. ``device``: only the kernels the JIT holds
    for that device index. None: this Triton holds its kernels otherwise (nothing can be told)."""
    from . import _jit

    loaded: set[object] = set()
    try:
        for function in (_jit.gather_kernel, _jit.scatter_kernel):
            caches = dict(function.device_caches)
            for index, kept in caches.items():
                if device is None or index == device:
                    loaded.update(getattr(kernel, "hash", None) for kernel in list(kept[0].values()))
    except (AttributeError, TypeError, LookupError, RuntimeError):
        return None
    return [key for key, triton_hash in listed.items() if triton_hash not in loaded]


def forget(cache_dir: str, listing: dict[str, object], keys: Sequence[LaunchKey]) -> None:
    """Remove the listings of ``keys`` (stale: the next start compiles them in a child again)."""
    for key in keys:
        with contextlib.suppress(OSError):
            os.unlink(_entry_path(cache_dir, listing, key))


def _list(cache_dir: str, listing: object, key: object, kernel: Any) -> None:
    """The child: list ``key``'s entry (``kernel``: what the JIT's warmup returned, Triton's
    ``CompiledKernel``). Nothing is listed when it is not what it looks like or cannot be written
    (the variant is then compiled in a child again next time)."""
    group, triton_hash = getattr(kernel, "metadata_group", None), getattr(kernel, "hash", None)
    if not isinstance(group, dict) or not group or not isinstance(triton_hash, str):
        return
    folders = {os.path.dirname(str(path)) for path in group.values()}
    if len(folders) != 1:
        return
    folder = folders.pop()
    if os.path.realpath(os.path.dirname(folder)) != os.path.realpath(cache_dir):
        return  # not an entry of this cache directory
    entry = {"fingerprint": listing, "key": key, "hash": triton_hash, "dir": os.path.basename(folder),
             "files": sorted(os.path.basename(str(path)) for path in group.values())}
    path = _entry_path(cache_dir, listing, key)
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "w") as out:
            json.dump(entry, out)
        os.replace(temporary, path)  # whole or absent: a reader never sees half of it
    with contextlib.suppress(OSError):
        os.unlink(temporary)


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
    """An argument Triton specializes as ``spec`` (a pointer of that dtype and alignment, or an int;
    ``specialize(arg, False)`` is an argument's key where the kernel does not specialize its value)."""
    kind = spec[0]
    candidates: list[object]
    if isinstance(kind, str) and kind.startswith("*") and kind[1:] in dtypes:
        candidates = [_Pointer(dtypes[kind[1:]], address) for address in (0, 8, 4, 2, 1)]
    else:
        candidates = [16, 17, 1, 0, 2**32, 2**32 + 1, 2**63 + 16, 2**63 + 17, -16, -17]
    for arg in candidates:
        if spec in (specialize(arg, True), specialize(arg, False)):
            return arg
    raise ValueError(f"no stand-in argument is specialized as {spec}")


def _whole_entries() -> type:
    """The child's cache manager: Triton's file cache, but an entry whose group file is torn, names a
    file that is gone or empty, or whose metadata is not JSON is a miss. Triton 3.6 returns such a group
    (dropping the missing files) or raises on it, and its launch then fails (``KeyError: 'cubin'``) in
    every process; a miss here compiles the variant again and rewrites the entry (atomically): repaired."""
    from triton.runtime.cache import FileCacheManager

    class WholeEntries(FileCacheManager):  # type: ignore[misc]
        def get_group(self, filename: str) -> dict[str, str] | None:
            return _whole_group(os.path.join(self.cache_dir, f"__grp__{filename}"))

    return WholeEntries


def _freeze(value: object) -> object:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _child_main() -> None:
    request = json.load(sys.stdin)
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    import importlib.util

    import triton.language as tl
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton._utils import canonicalize_dtype
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.runtime import driver

    driver.set_active(_TargetOnly(GPUTarget(*request["target"])))
    if knobs.cache.manager_class is None:  # Triton's file cache (not one the user configured)
        knobs.cache.manager_class = _whole_entries()
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

    def specialize(arg: object, value: bool) -> object:
        return tuple(native_specialize_impl(BaseBackend, arg, False, value, True))

    listing, cache_dir = request.get("listing"), os.environ["TRITON_CACHE_DIR"]
    for index, key in enumerate(request["keys"]):
        name, specs, constexprs = key
        try:
            kernel = getattr(jit, f"{name}_kernel")
            args = [_stand_in(_freeze(s), specialize, dtypes) for s in specs]  # type: ignore[arg-type]
            compiled = kernel.warmup(*args, grid=(1,), **dict(constexprs))
            if listing is not None:
                _list(cache_dir, listing, key, compiled)
            line = f"ok {index}"
        except Exception as exc:  # reported; the parent compiles this one itself
            line = f"fail {index} {type(exc).__name__}: {exc}".replace("\n", " ")[:1000]
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child_main()
