"""The rates file: the cost model's meters across restarts (format, checks, read and write).

The cost model's meters (:mod:`aiokv.costs`) outlive the process in the disk tier's layout
directory (:data:`RATES_FILE`), so the first hit after a restart plans its split as a warmed cache
would. The file is a hint, never trusted blindly: :func:`read_rates_file` refuses anything that is
not a small regular file of ours (a planted symlink, FIFO or directory; another owner's file; one
others may write), and :func:`decode_rates` one of another format, version, layout or device kind,
or with a value that is no finite number; rates outside :data:`RATE_BOUNDS` are clamped (into the
:class:`aiokv.costs.SavedRates` the cost model restores). :func:`write_rates_file` replaces it
atomically (a fresh owner-only temporary file, then ``rename``), never through a symlink.

Only the directory's lock holder saves, but a save's thread can be held in the kernel (a frozen or
hung file system) past its cache's close, and by then a later cache may hold the directory and
have saved its own rates. So each file carries when its newest measurement was taken
(``measured``: the boot and ``CLOCK_BOOTTIME``, :meth:`aiokv.costs.CostModel.folded_ns`; a cache
saves only after a measurement, so a later holder's file holds a later one), and a save renames
only under an exclusive ``flock`` of the layout directory, after checking that the file in place
was not measured later than its own: a late save is dropped, never replaces a newer holder's file
(review 117). The data is written to an unnamed file (``O_TMPFILE``) that gets a name of its own
only under that lock, just before the rename (where the file system has no ``O_TMPFILE``: a named
one from the start); the holder removes those names of dead processes.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import math
import os
import re
import reprlib
import secrets
import stat
import time
from pathlib import Path

from aiokv.costs import (
    BOOT_CLOCK,
    FIXED_MAX_S,
    MIN_CALL_AMOUNT,
    MIN_CALL_S,
    MOMENT_BOUNDS,
    CostModel,
    SavedFit,
    SavedRates,
)
from aiokv.shm import process_start_ticks

log = logging.getLogger("aiokv.cache")

RATES_FILE = ".rates"
"""In the disk tier's layout directory (a dot name: no page file, and tools listing pages skip it)."""
RATES_TEMP = ".rates.tmp"
"""Prefix of the temporary files written, then renamed over :data:`RATES_FILE`
(``.rates.tmp.<pid>-<start ticks>-<random>``; this very name is an older version's)."""
RATES_LOCK_WAIT_S = 2.0
"""How long a save waits for another's rename (held in the kernel) before it gives up (``OSError``)."""
RATES_FORMAT = "aiokv-rates"
RATES_VERSION = 3
"""Written and read. Older files are refused (a hint only: the meters then start afresh): version
2's prefill line was fitted without the calls' prefixes, so it underprices long prefixes."""
RATES_VERSIONS_READ = (3,)
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


def encode_rates(costs: CostModel, layout: str, device: str) -> bytes:
    """The rates file's bytes: the known meters' rates and sample counts (with their fixed costs,
    marginal rates and spreads where known), the layout fingerprint (hex), the device kind they
    were measured on and when the newest measurement was taken (where one was: not for rates only
    restored)."""
    rates: dict[str, dict[str, float | int | list[float]]] = {}
    for name, meter in costs.meters().items():
        if meter.rate is None:
            continue
        entry: dict[str, float | int | list[float]] = {"rate": meter.rate, "samples": meter.samples}
        fit = meter.saved_fit()
        if fit is not None and fit.spread is not None:
            entry["spread"] = fit.spread
        if fit is not None and fit.moments is not None:
            entry["moments"], entry["fitted"] = list(fit.moments), fit.fitted
            if fit.curve is not None:
                entry["curve"] = list(fit.curve)
        rates[name] = entry
    doc: dict[str, object] = {"format": RATES_FORMAT, "version": RATES_VERSION, "layout": layout,
                              "device": device, "rates": rates}
    folded, boot = costs.folded_ns(), _boot()
    if folded is not None and boot is not None:
        doc["measured"] = [boot, folded]  # (read by write_rates_file only: older versions ignore it)
    data = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
    if len(data) > RATES_MAX_BYTES:
        raise ValueError(f"rates file of {len(data)} bytes exceeds {RATES_MAX_BYTES}")
    return data


def decode_rates(data: bytes, layout: str, device: str) -> SavedRates:
    """Parse and check a rates file written by :func:`encode_rates` for ``layout`` on ``device``.

    Reads :data:`RATES_VERSIONS_READ`. Raises :class:`RatesFileError` for anything else, whatever
    the bytes (and nothing else: the file is only a hint, and one that raised otherwise would fail
    every start). Rates outside :data:`RATE_BOUNDS` are clamped, spreads to ``[0, FIXED_MAX_S]``,
    sample counts to ``[1, MAX_SAMPLES]``; a line's moments (or the prefill curve's) no calls could
    have produced are corrupt, as is a curve anywhere but with the prefill meter's line moments.
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
    version = doc.get("version")
    if isinstance(version, bool) or version not in RATES_VERSIONS_READ:
        raise RatesFileError("version", f"version {_shown(version)}, this aiokv reads {RATES_VERSIONS_READ}")
    if doc.get("layout") != layout:
        raise RatesFileError("foreign-layout", f"written for layout {_shown(doc.get('layout'))}")
    if doc.get("device") != device:
        raise RatesFileError("foreign-device",
                             f"measured on {_shown(doc.get('device'))}, this cache runs on {device!r}")
    entries = doc.get("rates")
    if not isinstance(entries, dict) or not set(entries) <= set(RATE_BOUNDS):
        raise RatesFileError("corrupt", "bad rates table")
    rates: dict[str, tuple[float, int]] = {}
    fits: dict[str, SavedFit] = {}
    clamped: list[str] = []
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not set(entry) <= set(_ENTRY_KEYS[version]):
            raise RatesFileError("corrupt", f"{name}: bad entry")
        rate, samples = entry.get("rate"), entry.get("samples")
        value = _finite(rate)
        if value is None:
            raise RatesFileError("corrupt", f"{name}: rate {_shown(rate)} is no finite number")
        if isinstance(samples, bool) or not isinstance(samples, int):
            raise RatesFileError("corrupt", f"{name}: samples {_shown(samples)} is no int")
        low, high = RATE_BOUNDS[name]
        out = not low <= value <= high
        rates[name] = (min(max(value, low), high), min(max(samples, 1), MAX_SAMPLES))
        spread = None
        if "spread" in entry:
            spread, spread_out = _bounded(name, "spread", entry["spread"], 0.0, FIXED_MAX_S)
            out = out or spread_out
        if ("moments" in entry) != ("fitted" in entry):
            raise RatesFileError("corrupt", f"{name}: moments without their count or the reverse")
        moments, fitted = None, 0
        if "moments" in entry:
            moments = _moments(name, entry["moments"])
            fitted = entry["fitted"]
            if isinstance(fitted, bool) or not isinstance(fitted, int):
                raise RatesFileError("corrupt", f"{name}: fitted {_shown(fitted)} is no int")
            fitted = min(max(fitted, 1), MAX_SAMPLES)
        curve = None
        if "curve" in entry:
            if name != "prefill" or moments is None:
                raise RatesFileError("corrupt", f"{name}: a curve without the prefill meter's moments")
            curve = _curve(name, entry["curve"], moments)
        if spread is not None or moments is not None:
            fits[name] = SavedFit(moments, fitted, spread, curve)
        if out:
            clamped.append(name)
    return SavedRates(rates, tuple(clamped), fits)


_ENTRY_KEYS = {3: ("rate", "samples", "spread", "moments", "fitted", "curve")}
"""The keys an entry of each version read may hold."""


def _moments(name: str, raw: object) -> tuple[float, float, float, float]:
    """Saved moving moments (mean x, y, x², xy) that some calls could have produced; corrupt otherwise:
    means in ``[MIN_CALL_AMOUNT, MOMENT_BOUNDS[0]]`` and ``[MIN_CALL_S, MOMENT_BOUNDS[1]]`` (every
    call a meter takes lies there; far below, a line's marginal rate priced a page at inf and the
    estimates raised), E[x²] >= E[x]² (up to rounding), E[x²] and E[xy] positive and within what
    those bounds allow (the line drawn from them is clipped as a learned one is)."""
    values = [_finite(v) for v in raw] if isinstance(raw, list) and len(raw) == 4 else None
    if values is None or any(v is None for v in values):
        raise RatesFileError("corrupt", f"{name}: moments {_shown(raw)} are not four finite numbers")
    mx, my, mxx, mxy = (float(v) for v in values if v is not None)
    max_x, max_y = MOMENT_BOUNDS
    low_x, low_y = MIN_CALL_AMOUNT * (1 - 1e-9), MIN_CALL_S * (1 - 1e-9)  # (moving means: up to rounding)
    if not (low_x <= mx <= max_x and low_y <= my <= max_y and mx * mx * (1 - 1e-9) <= mxx <= max_x * max_x
            and 0 < mxy <= max_x * max_y):
        raise RatesFileError("corrupt", f"{name}: moments {_shown(raw)} no calls could have produced")
    return mx, my, mxx, mxy


def _curve(name: str, raw: object, moments: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    """Saved moving means of q, q², t·q and q·seconds (q = t·(prefix + t/2) per call) that the calls
    behind ``moments`` (means of t, seconds, t², t·seconds) could have produced; corrupt otherwise:
    all positive and within what :data:`MOMENT_BOUNDS` allow (a prefix at most the largest amount),
    E[q²] >= E[q]², E[t·q]² <= E[t²]·E[q²] and E[q] >= E[t²]/2 (each call's q >= t²/2), up to rounding."""
    values = [_finite(v) for v in raw] if isinstance(raw, list) and len(raw) == 4 else None
    if values is None or any(v is None for v in values):
        raise RatesFileError("corrupt", f"{name}: curve {_shown(raw)} is not four finite numbers")
    mq, mqq, mtq, mqy = (float(v) for v in values if v is not None)
    max_x, max_y = MOMENT_BOUNDS
    max_q = 1.5 * max_x * max_x
    _, _, mtt, _ = moments
    if not (0 < mq <= max_q and mq * mq * (1 - 1e-9) <= mqq <= max_q * max_q and 0 < mtq <= max_x * max_q
            and 0 < mqy <= max_q * max_y and mtq * mtq <= mtt * mqq * (1 + 1e-9) and mq >= mtt / 2 * (1 - 1e-9)):
        raise RatesFileError("corrupt", f"{name}: curve {_shown(raw)} no calls could have produced")
    return mq, mqq, mtq, mqy


def _bounded(name: str, key: str, raw: object, low: float, high: float) -> tuple[float, bool]:
    """A saved value clamped to ``[low, high]``, and whether it was outside; corrupt unless finite."""
    value = _finite(raw)
    if value is None:
        raise RatesFileError("corrupt", f"{name}: {key} {_shown(raw)} is no finite number")
    return min(max(value, low), high), not low <= value <= high


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


def _open_dir(directory: Path, held: int | None) -> int:
    """The layout directory, and ours: a descriptor of its own (for the ``flock``) opened through
    ``held`` (a descriptor of it that this call closes: the disk tier's, the directory it uses
    whatever its name leads to now) when given, else by name, never through a symlink at its own."""
    if held is None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    else:
        try:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=held)
        finally:
            os.close(held)
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise RatesFileError("unsafe", f"{directory} is not this user's directory")
    return fd


def read_rates_file(directory: Path, held: int | None = None) -> bytes | None:
    """The rates file's bytes in ``directory``; None when there is none. Blocking: run in a thread.

    ``held``: a descriptor of the directory to use instead of its name (closed here; see
    :meth:`aiokv.storage.DiskTier.layout_dir_fd`). The file is opened with ``O_NOFOLLOW |
    O_NONBLOCK`` (a planted symlink fails, a FIFO never blocks), then required to be a regular
    file of ours that others cannot write, of at most
    :data:`RATES_MAX_BYTES`. Raises :class:`RatesFileError` for what is not ours, ``OSError``
    when the directory or the file cannot be read.
    """
    dir_fd = _open_dir(directory, held)
    try:
        return _read_at(dir_fd, directory)
    finally:
        os.close(dir_fd)


def _read_at(dir_fd: int, directory: Path) -> bytes | None:
    """:func:`read_rates_file` in the opened directory ``dir_fd``."""
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


def write_rates_file(directory: Path, data: bytes, held: int | None = None) -> bool:
    """Replace the rates file in ``directory`` with ``data`` atomically, unless the file in place
    holds a later measurement than ``data`` (then False: a save that ended after its cache's close,
    the directory held and saved by a later cache meanwhile). Blocking: run in a thread.
    ``held``: a descriptor of the directory to use instead of its name (closed here).

    An owner-only unnamed file (``O_TMPFILE``; else a fresh name of its own, ``O_CREAT | O_EXCL |
    O_NOFOLLOW``), then, under an exclusive ``flock`` of the directory (waited for up to
    :data:`RATES_LOCK_WAIT_S`), the check, a name of its own and a ``rename`` over
    :data:`RATES_FILE` (which replaces a symlink there, never writes through it). Not fsynced:
    after a crash the file may be stale or torn, and a torn one is refused when read. Raises
    ``OSError`` (``BlockingIOError`` when another save's rename held the lock too long); leaves no
    temporary file.
    """
    if len(data) > RATES_MAX_BYTES:
        if held is not None:
            os.close(held)
        raise ValueError(f"rates file of {len(data)} bytes exceeds {RATES_MAX_BYTES}")
    mine = _measured(data)
    dir_fd = _open_dir(directory, held)
    temp: str | None = None
    try:
        fd = _open_unnamed(dir_fd)
        if fd is None:
            temp = _temp_name()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            # Held from the check to the rename: a later save checks only once this one landed.
            _lock(dir_fd, directory)
            _remove_leftovers(dir_fd, keep=temp)
            try:
                there = _measured(_read_at(dir_fd, directory) or b"")
            except (RatesFileError, OSError):
                there = None  # unreadable or planted: not a newer save (the rename decides)
            if _later(there, mine):
                log.warning("aiokv: the rates file in %s holds a later cache's rates: a late save dropped",
                            directory)
                return False
            if temp is None:
                temp = _temp_name()
                os.link(f"/proc/self/fd/{fd}", temp, dst_dir_fd=dir_fd, follow_symlinks=True)
        finally:
            os.close(fd)
        os.rename(temp, RATES_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        temp = None
    finally:
        try:
            if temp is not None:
                os.unlink(temp, dir_fd=dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)  # drops the lock
    return True


def _open_unnamed(dir_fd: int) -> int | None:
    """An unnamed owner-only file in the directory (``O_TMPFILE``), to be linked in later; None
    where the file system or kernel has none (or no ``/proc`` to link it through)."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(".", os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise


_TEMP_NAME = re.compile(re.escape(RATES_TEMP) + r"\.(\d+)-(\d+)-[0-9a-f]{16}")


def _temp_name() -> str:
    """A temporary file name no other save uses: this process (pid, start ticks), then random."""
    pid = os.getpid()
    return f"{RATES_TEMP}.{pid}-{process_start_ticks(pid) or 0}-{secrets.token_hex(8)}"


def _remove_leftovers(dir_fd: int, keep: str | None) -> None:
    """Unlink the temporary files of saves that cannot end any more: those of dead processes (and
    the older versions' fixed name). A live process's may be a save still on its way (its own
    check drops it); another pid namespace's looks dead: that save then fails, and is counted."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        if name == keep or not name.startswith(RATES_TEMP):
            continue
        m = _TEMP_NAME.fullmatch(name)
        if m is not None and process_start_ticks(int(m[1])) == int(m[2]):
            continue
        if m is None and name != RATES_TEMP:
            continue  # not a name we make
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass  # a directory planted there, or gone meanwhile


def _lock(dir_fd: int, directory: Path) -> None:
    """Exclusive ``flock`` of the directory, waited for up to :data:`RATES_LOCK_WAIT_S`. Where
    the file system has no ``flock`` (some network ones), the check alone is left."""
    deadline = time.monotonic() + RATES_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise BlockingIOError(errno.EWOULDBLOCK, f"another save of the rates in {directory} is held "
                                                         f"past {RATES_LOCK_WAIT_S} s") from None
            time.sleep(0.005)  # a rename in flight: milliseconds unless held in the kernel
        except OSError as exc:
            if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return


@functools.cache
def _boot() -> str | None:
    """This boot's id: ``CLOCK_BOOTTIME`` readings of two boots cannot be compared."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _measured(data: bytes) -> tuple[str, int] | None:
    """The ``measured`` stamp of a rates file's bytes; None when it has none (an older version's,
    rates only restored, or not a rates file: a torn or foreign file's stamp decides nothing)."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != RATES_FORMAT:
        return None
    stamp = doc.get("measured")
    if (isinstance(stamp, list) and len(stamp) == 2 and isinstance(stamp[0], str)
            and isinstance(stamp[1], int) and not isinstance(stamp[1], bool)):
        return stamp[0], stamp[1]
    return None


def _later(there: tuple[str, int] | None, mine: tuple[str, int] | None) -> bool:
    """Whether the file in place (``there``) holds a later measurement than ``mine`` (one boot's
    only). A stamp ahead of this process's boot clock is no measurement it could be late for (a
    writer in a time namespace whose clock is ahead, a forged file): honoured, it kept every save
    out until a reboot (review 122)."""
    return (there is not None and mine is not None and there[0] == mine[0]
            and mine[1] < there[1] <= time.clock_gettime_ns(BOOT_CLOCK))
