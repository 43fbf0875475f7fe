"""A reader store's ``close()`` while its staleness check is stuck in the kernel (review 108).

A reader (SGLang's MLA ranks but the writer) looks for page files it lacks on a worker thread of its
own (``ReaderCheck``). With the file system hung (``gate_helpers``: the ext4's device stops
answering; its journal checkpointed and caches dropped first, so the look must read the device)
that look blocks in the kernel, and ``close()`` joined the worker without a bound: it hung as long
as the disk did, past ``close_timeout``. Now it returns within the bound; the worker ends by itself
once its look returned (it only looks: nothing of the engine's is touched). Root only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import gated_ext4

pytestmark = pytest.mark.root

PAGE = 8192
CLOSE_S = 1.0
MARGIN_S = 3.0
BOUND_S = 30.0


def _uncached(mount: Path) -> None:
    """Make the next metadata lookups read the device: a freeze checkpoints the journal (whose
    buffers drop_caches keeps), then clean caches are dropped."""
    for flag in ("-f", "-u"):
        done = subprocess.run(["fsfreeze", flag, str(mount)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"fsfreeze {flag} is not possible here: {done.stderr.strip()}")
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def test_reader_close_keeps_close_timeout_while_its_staleness_check_is_held(tmp_path: Path) -> None:
    with gated_ext4(tmp_path, 320) as (mount, gate):
        config = StoreConfig(directory=mount / "kv", queue_depth=4, close_timeout=CLOSE_S, reader_refresh_s=0)
        writer = PageFileStore(config, "test", {"model": "m"}, PAGE, sharing=Sharing.WRITER)
        try:
            assert writer.thread.run(writer.store(writer.key(b"there"), [torch.ones(PAGE, dtype=torch.uint8)]))
        finally:
            writer.close()
        reader = PageFileStore(config, "test", {"model": "m"}, PAGE, sharing=Sharing.READER)
        check_thread = reader._check._thread if reader._check is not None else None
        assert check_thread is not None
        done = threading.Event()
        try:
            # A key whose file would sit beside the one written: the look reads that directory.
            fan = reader.key(b"there").hex()[:2]
            missing = next(k for k in (reader.key(b"m%d" % i) for i in range(100_000)) if k.hex()[:2] == fan)
            _uncached(mount)
            gate.hold()
            looking = reader.thread.submit(reader.fresh_contains([missing]))
            gate.wait_held()
            assert not looking.done(), "the look was answered from a cache: the gate did not hold it"
            began = time.monotonic()
            closing = threading.Thread(target=lambda: (reader.close(), done.set()), name="close", daemon=True)
            closing.start()
            assert done.wait(CLOSE_S + MARGIN_S), "a reader's close() hangs while its check is held in the kernel"
            assert time.monotonic() - began < CLOSE_S + MARGIN_S
            assert check_thread.is_alive()  # still in the kernel: left to end by itself
            gate.release()
            check_thread.join(BOUND_S)
            assert not check_thread.is_alive()
        finally:
            gate.release()
            done.wait(BOUND_S)
            reader.close()
            reader.thread.close()
