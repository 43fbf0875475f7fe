"""The disk tier's faults, counted in a :class:`~aiokv.faults.FaultLog` (the manager's, when shared).

Kinds are ``disk_<ErrorKind value>`` (``disk_enospc``, ``disk_eio``, ...): the names the cache's
``stats().errors`` has always reported for the disk tier, so a manager that shares its log with the
tier counts each disk fault once under the same name.
"""

from __future__ import annotations

import errno
import logging
import traceback

from aiokv.faults import FaultLog

from .config import ErrorKind
from .safefiles import UnsafeFileError

log = logging.getLogger("aiokv.storage.disk")

_KINDS = {
    errno.ENOSPC: ErrorKind.ENOSPC, errno.EDQUOT: ErrorKind.ENOSPC, errno.EIO: ErrorKind.EIO,
    errno.EPERM: ErrorKind.EPERM, errno.EACCES: ErrorKind.EPERM, errno.EROFS: ErrorKind.EPERM,
    errno.ELOOP: ErrorKind.UNSAFE,  # O_NOFOLLOW met a symlink
    # A directory where a page file's name should be (planted: the tier makes none there): the
    # unlink of a refused name and a rename onto it answer EISDIR.
    errno.EISDIR: ErrorKind.UNSAFE,
}


def fault_name(kind: ErrorKind) -> str:
    """The :class:`FaultLog` kind of a disk fault."""
    return f"disk_{kind.value}"


def kind_of(exc: OSError) -> ErrorKind:
    """An :class:`UnsafeFileError` is UNSAFE; other errors go by errno."""
    return ErrorKind.UNSAFE if isinstance(exc, UnsafeFileError) else _KINDS.get(exc.errno or 0, ErrorKind.OTHER)


class DiskFaults:
    """I/O faults of one tier by :class:`ErrorKind`, recorded in ``log`` (logged once per kind)."""

    def __init__(self, faults: FaultLog | None) -> None:
        self.log = faults if faults is not None else FaultLog(log)

    def count(self, exc: OSError, what: str) -> None:
        """Count ``exc`` by kind; the first of each kind is logged with ``what`` failed."""
        self.log.record(fault_name(kind_of(exc)), f"disk tier: {what} failed: {exc}")

    def unexpected(self, what: str) -> None:
        """Count a bug-shaped failure (not an OSError) as OTHER, and log its traceback every time:
        once per failure (the fault log's first-of-a-kind warning carries it then)."""
        kind = fault_name(ErrorKind.OTHER)
        if self.log[kind] == 0:  # the record below logs: let its one line carry the traceback
            self.log.record(kind, f"disk tier: unexpected failure in {what}\n{traceback.format_exc().rstrip()}")
        else:
            self.log.record(kind, f"disk tier: unexpected failure in {what}")
            log.exception("disk tier: unexpected failure in %s", what)

    def snapshot(self) -> dict[ErrorKind, int]:
        """Counts by kind (every kind present, zeros included)."""
        return {kind: self.log[fault_name(kind)] for kind in ErrorKind}
