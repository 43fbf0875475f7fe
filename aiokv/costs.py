"""The cost model: how fast each tier delivers and how fast the engine prefills, measured online.

Rates are moving averages (EWMA) of what whole calls achieved — bytes over the wall time of a
load's pool copies, of its disk reads — so concurrency inside a call counts as it should. The
engine's prefill rate is given in the config, reported by the engine, or learned from the claims
of a :class:`aiokv.stream.LoadStream`. :meth:`CostModel.estimate` turns them into what a match
would cost to load, to recompute, and where a compute-or-load split would meet.

The rates outlive the process in the disk tier's layout directory (:data:`RATES_FILE`), so the
first hit after a restart plans its split as a warmed cache would. The file is a hint, never
trusted blindly: :func:`read_rates_file` refuses anything that is not a small regular file of
ours (a planted symlink, FIFO or directory; another owner's file; one others may write), and
:func:`decode_rates` one of another format, version, layout or device kind, or with a value that is
no finite number; rates outside :data:`RATE_BOUNDS` are clamped. :func:`write_rates_file` replaces
it atomically (a fresh owner-only temporary file, then ``rename``), never through a symlink.
"""

from __future__ import annotations

import errno
import json
import math
import os
import reprlib
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class RateMeter:
    """An exponentially weighted moving average of a rate (amount per second).

    ``samples`` counts the observations folded in (a restored meter keeps its count); ``listener``
    is called after each fold (the cache schedules saving the rates).
    """

    def __init__(self, weight: float = 0.3, initial: float | None = None) -> None:
        self._weight = weight
        self._initial = initial
        self._rate = initial
        self.samples = 0
        """Observations folded in so far (restored ones included)."""
        self.listener: Callable[[], None] | None = None

    def update(self, amount: float, seconds: float) -> None:
        """Fold in one observation; ignored when it carries no information."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self._rate = rate if self._rate is None else (1 - self._weight) * self._rate + self._weight * rate
        self.samples += 1
        if self.listener is not None:
            self.listener()

    def restore(self, rate: float, samples: int) -> None:
        """Take a saved state (already checked and clamped): the moving average goes on from it."""
        self._rate = rate
        self.samples = samples

    def reset(self) -> None:
        """Back to the state it was built with: what it measured belongs to another device."""
        self._rate = self._initial
        self.samples = 0

    @property
    def rate(self) -> float | None:
        """The current estimate, or None before the first observation."""
        return self._rate


@dataclass(frozen=True)
class LoadEstimate:
    """What loading a match would cost, by the rates measured so far (None: not known yet)."""

    pool_seconds: float | None
    """Copying its pool pages into the KV buffer."""
    disk_seconds: float | None
    """Reading its disk pages into the pool (before they are copied)."""
    recompute_seconds: float | None
    """Prefilling its tokens instead."""
    split_token: int | None
    """Where a compute-or-load split is expected to meet: compute ``[0, split)``, load the rest."""

    @property
    def load_seconds(self) -> float | None:
        """Loading the whole match (disk reads and copies overlap: the slower of the two bounds it)."""
        if self.pool_seconds is None or self.disk_seconds is None:
            return None
        return max(self.pool_seconds, self.disk_seconds)

    @property
    def worth_loading(self) -> bool | None:
        """Whether a plain load is expected to beat recomputing (None: not known yet).

        False as soon as one known part alone (the disk reads, say) takes as long as recomputing,
        even while the other's rate is unknown: aiokv never picks a load it expects to lose.
        """
        compute = self.recompute_seconds
        if compute is None:
            return None
        known = [part for part in (self.pool_seconds, self.disk_seconds) if part is not None]
        if any(part >= compute for part in known):
            return False
        load = self.load_seconds
        return None if load is None else load < compute


class CostModel:
    """Per-tier delivered throughput and the engine's prefill rate, with estimates built on them."""

    def __init__(self, prefill_tokens_per_s: float | None = None) -> None:
        self.pool = RateMeter()
        """Bytes per second copied from the pool into the KV buffer."""
        self.disk = RateMeter()
        """Bytes per second read from disk into the pool."""
        self.prefill = RateMeter(initial=prefill_tokens_per_s)
        """Tokens per second the engine prefills."""

    def meters(self) -> dict[str, RateMeter]:
        """The meters by the names they are saved under (the keys of :data:`RATE_BOUNDS`)."""
        return {"pool": self.pool, "disk": self.disk, "prefill": self.prefill}

    def reset(self) -> None:
        """Forget every measurement (the configured prefill rate stays)."""
        for meter in self.meters().values():
            meter.reset()

    def estimate(self, pool_pages: int, disk_pages: int, page_tokens: int, page_bytes: int) -> LoadEstimate:
        """Costs of a prefix of ``pool_pages`` pool pages followed by ``disk_pages`` disk pages."""
        pool_rate, disk_rate, prefill = self.pool.rate, self.disk.rate, self.prefill.rate
        pages = pool_pages + disk_pages
        copy = None if pool_rate is None else pages * page_bytes / pool_rate
        read = 0.0 if disk_pages == 0 else None if disk_rate is None else disk_pages * page_bytes / disk_rate
        recompute = None if prefill is None else pages * page_tokens / prefill
        split = None
        # Pages reaching disk: their reads bound the load whatever the copies cost, so an unknown
        # copy rate counts as free there (the split is then the latest the load can meet).
        copy_known = copy if copy is not None else 0.0 if disk_pages else None
        if pages and prefill is not None and copy_known is not None and read is not None:
            # Loading runs from the back, computing from the front: with the fronts meeting at page
            # k the prefix is ready after max(time to compute [0, k), time to load [k, P)).
            compute_page = page_tokens / prefill
            per_pool = copy_known / pages
            per_disk = read / disk_pages + per_pool if disk_pages else per_pool
            best_k, best = pages, pages * compute_page
            load = 0.0
            for k in range(pages - 1, -1, -1):
                load += per_disk if k >= pool_pages else per_pool
                ready = max(k * compute_page, load)
                if ready <= best:
                    best_k, best = k, ready
            k = best_k
            split = k * page_tokens
        return LoadEstimate(copy, read, recompute, split)


# -- the rates across restarts --------------------------------------------------------------------

RATES_FILE = ".rates"
"""In the disk tier's layout directory (a dot name: no page file, and tools listing pages skip it)."""
RATES_TEMP = ".rates.tmp"
"""Written, then renamed over :data:`RATES_FILE`; only the directory's lock holder writes."""
RATES_FORMAT = "aiokv-rates"
RATES_VERSION = 1
RATES_MAX_BYTES = 4096
"""A rates file is a few hundred bytes; anything larger is not ours and is not read."""
RATE_BOUNDS: dict[str, tuple[float, float]] = {
    "pool": (1e6, 1e13),  # bytes/s: 1 MB/s (a loaded CPU copy) to 10 TB/s (beyond any link)
    "disk": (1e5, 1e12),  # bytes/s: 100 kB/s (a throttled device) to 1 TB/s
    "prefill": (1.0, 1e9),  # tokens/s
}
"""Sane range of each saved rate: a value outside is clamped (and counted) when read back."""
MAX_SAMPLES = 1_000_000


class RatesFileError(ValueError):
    """A rates file that must not be used; ``reason`` is one of ``planted`` (not a regular file),
    ``unsafe`` (another owner's, or writable by others), ``oversize``, ``corrupt`` (not the format,
    a truncated file included), ``version``, ``foreign-layout``, ``foreign-device``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class SavedRates:
    """What :func:`decode_rates` accepted: ``(rate, samples)`` by meter name, clamped."""

    rates: dict[str, tuple[float, int]]
    clamped: tuple[str, ...]
    """Names of the rates that lay outside :data:`RATE_BOUNDS`."""


def encode_rates(costs: CostModel, layout: str, device: str) -> bytes:
    """The rates file's bytes: the known meters' rates and sample counts, with the layout
    fingerprint (hex) and the device kind they were measured on."""
    rates = {name: {"rate": meter.rate, "samples": meter.samples}
             for name, meter in costs.meters().items() if meter.rate is not None}
    doc = {"format": RATES_FORMAT, "version": RATES_VERSION, "layout": layout, "device": device, "rates": rates}
    data = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
    if len(data) > RATES_MAX_BYTES:
        raise ValueError(f"rates file of {len(data)} bytes exceeds {RATES_MAX_BYTES}")
    return data


def decode_rates(data: bytes, layout: str, device: str) -> SavedRates:
    """Parse and check a rates file written by :func:`encode_rates` for ``layout`` on ``device``.

    Raises :class:`RatesFileError` for anything else, whatever the bytes (and nothing else: the
    file is only a hint, and one that raised otherwise would fail every start). Rates outside
    :data:`RATE_BOUNDS` are clamped, sample counts to ``[1, MAX_SAMPLES]``.
    """
    if len(data) > RATES_MAX_BYTES:
        raise RatesFileError("oversize", f"{len(data)} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: 4 KiB hold 2048 levels of nesting, more than the parser recurses.
        raise RatesFileError("corrupt", f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != RATES_FORMAT:
        raise RatesFileError("corrupt", "not an aiokv rates file")
    if doc.get("version") != RATES_VERSION:
        raise RatesFileError("version", f"version {_shown(doc.get('version'))}, this aiokv reads {RATES_VERSION}")
    if doc.get("layout") != layout:
        raise RatesFileError("foreign-layout", f"written for layout {_shown(doc.get('layout'))}")
    if doc.get("device") != device:
        raise RatesFileError("foreign-device",
                             f"measured on {_shown(doc.get('device'))}, this cache runs on {device!r}")
    entries = doc.get("rates")
    if not isinstance(entries, dict) or not set(entries) <= set(RATE_BOUNDS):
        raise RatesFileError("corrupt", "bad rates table")
    rates: dict[str, tuple[float, int]] = {}
    clamped: list[str] = []
    for name, entry in entries.items():
        rate = entry.get("rate") if isinstance(entry, dict) else None
        samples = entry.get("samples") if isinstance(entry, dict) else None
        value = _finite(rate)
        if value is None:
            raise RatesFileError("corrupt", f"{name}: rate {_shown(rate)} is no finite number")
        if isinstance(samples, bool) or not isinstance(samples, int):
            raise RatesFileError("corrupt", f"{name}: samples {_shown(samples)} is no int")
        low, high = RATE_BOUNDS[name]
        if not low <= value <= high:
            clamped.append(name)
        rates[name] = (min(max(value, low), high), min(max(samples, 1), MAX_SAMPLES))
    return SavedRates(rates, tuple(clamped))


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a rate")


def _finite(rate: object) -> float | None:
    """``rate`` as a finite float; None for anything else (an int past a float's range included:
    ``float`` and ``math.isfinite`` raise ``OverflowError`` on it)."""
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        return None
    try:
        value = float(rate)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _shown(value: object) -> str:
    """A file's value for a message, bounded in length and depth (the file may hold anything)."""
    return reprlib.repr(value)


def _open_dir(directory: Path) -> int:
    """The layout directory, never through a symlink at its own name, and ours."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise RatesFileError("unsafe", f"{directory} is not this user's directory")
    return fd


def read_rates_file(directory: Path) -> bytes | None:
    """The rates file's bytes in ``directory``; None when there is none. Blocking: run in a thread.

    Opened with ``O_NOFOLLOW | O_NONBLOCK`` (a planted symlink fails, a FIFO never blocks), then
    required to be a regular file of ours that others cannot write, of at most
    :data:`RATES_MAX_BYTES`. Raises :class:`RatesFileError` for what is not ours, ``OSError``
    when the directory or the file cannot be read.
    """
    dir_fd = _open_dir(directory)
    try:
        try:
            fd = os.open(RATES_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise RatesFileError("planted", f"{directory / RATES_FILE}: {exc.strerror}") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RatesFileError("planted", f"{directory / RATES_FILE} is not a regular file")
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise RatesFileError("unsafe", f"{directory / RATES_FILE} is another user's or others may write it")
            if st.st_size > RATES_MAX_BYTES:
                raise RatesFileError("oversize", f"{directory / RATES_FILE} holds {st.st_size} bytes")
            chunks: list[bytes] = []
            size = 0
            while size <= RATES_MAX_BYTES and (chunk := os.read(fd, RATES_MAX_BYTES + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
            if size > RATES_MAX_BYTES:  # it grew since the fstat
                raise RatesFileError("oversize", f"{directory / RATES_FILE} holds more than {RATES_MAX_BYTES} bytes")
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def write_rates_file(directory: Path, data: bytes) -> None:
    """Replace the rates file in ``directory`` with ``data`` atomically. Blocking: run in a thread.

    A fresh owner-only temporary file (``O_CREAT | O_EXCL | O_NOFOLLOW``: whatever is planted under
    its name is removed, never followed), then ``rename`` over :data:`RATES_FILE` (which replaces a
    symlink there, never writes through it). Not fsynced: after a crash the file may be stale or
    torn, and a torn one is refused when read. Raises ``OSError``; leaves no temporary file.
    """
    if len(data) > RATES_MAX_BYTES:
        raise ValueError(f"rates file of {len(data)} bytes exceeds {RATES_MAX_BYTES}")
    dir_fd = _open_dir(directory)
    try:
        try:
            os.unlink(RATES_TEMP, dir_fd=dir_fd)  # a leftover of a crash (or a planted name)
        except FileNotFoundError:
            pass
        fd = os.open(RATES_TEMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        try:
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(RATES_TEMP, RATES_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(RATES_TEMP, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)
