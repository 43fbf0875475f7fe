"""The compile helper's children end with it, and its output is parsed strictly (review findings).

Triton runs ``ptxas`` as a child of the helper: killing the helper alone (a stop, a stall, a close)
left it running, holding the helper's output pipe open. And a line whose index is a non-ASCII digit
("²": ``str.isdigit`` accepts it, ``int`` refuses it) raised ``ValueError`` out of the warm-up instead
of failing the helper. Real processes here: a shell script stands in for the interpreter.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
from test_warmup_precompile import _gone, _script, _target

from aiokv.kernels.precompile import Precompile


def _wait_for_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never written")
        time.sleep(0.01)
    return path.read_text().strip()


def _gone_soon(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        try:  # an orphan re-parented to us would linger as a zombie: reap it if it is ours
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("how", ["stop", "close"])
def test_the_helpers_own_children_end_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    grandchild = tmp_path / "grandchild.pid"
    # Like Triton's ptxas: a child of the helper that outlives a kill of the helper alone.
    monkeypatch.setattr(sys, "executable", _script(tmp_path, f"sleep 60 & echo $! > {grandchild}; exec sleep 60"))
    child = Precompile([("gather", (), ())], _target(), str(tmp_path))
    assert child._child is not None
    pid = child._child.pid
    orphan = int(_wait_for_file(grandchild))
    if how == "stop":
        stop = threading.Event()
        threading.Timer(0.1, stop.set).start()
        assert child.wait(0, stop) is False
        assert child.error == "stopped"
    else:
        child.close()
    assert _gone(pid)
    assert _gone_soon(orphan), "the helper's child survived it"


def test_a_non_ascii_digit_fails_the_helper_instead_of_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", _script(tmp_path, "cat >/dev/null; echo 'ok \u00b2'"))
    child = Precompile([("gather", (), ())], _target(), str(tmp_path))
    assert child.wait(0) is False  # raised ValueError before
    assert child.error is not None and "wrote" in child.error
    child.close()
