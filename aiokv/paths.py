"""Validation of the directory settings a user gives (``disk_dir``, ``DiskConfig.directory``, a TP
manager's socket directory, a rank worker's address): once, at the public edge, naming the setting.

Before, such a value reached ``pathlib``, ``os.fspath`` or the first system call unchecked: an int
raised "expected str, bytes or os.PathLike object" naming no setting, a path-like returning bytes
pathlib's own ``TypeError``, and a lone surrogate (``"\\ud800"``, which the file system encoding
cannot encode) was accepted and raised ``UnicodeEncodeError`` only at ``start``, naming nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["path_setting"]


def path_setting(value: object, label: str) -> Path:
    """``value`` (a ``str`` or an ``os.PathLike`` whose ``__fspath__`` gives a ``str``) as a ``Path``.

    Raises ``TypeError`` naming ``label`` for anything else, ``ValueError`` naming it for an empty
    string (``Path("")`` is the working directory), a NUL character, or text the file system
    encoding cannot encode (a lone surrogate: ``os.fsencode`` refuses it).
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{label} must be a path (str or os.PathLike), got {type(value).__name__}")
    try:
        text = os.fspath(value)
    except TypeError as exc:  # __fspath__ returned neither str nor bytes
        raise TypeError(f"{label} must be a path: {exc}") from None
    if not isinstance(text, str):
        raise TypeError(f"{label} must be a str path, got {type(text).__name__} from {type(value).__name__}")
    if not text:
        raise ValueError(f"{label} is an empty path (it would be the working directory)")
    if "\x00" in text:
        raise ValueError(f"{label} must not contain a NUL character, got {text!r}")
    try:
        os.fsencode(text)
    except UnicodeEncodeError as exc:
        raise ValueError(f"{label} cannot be encoded as a file name ({exc.reason} at index {exc.start}): "
                         f"{text!r}") from None
    return Path(text)
