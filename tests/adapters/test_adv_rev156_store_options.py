"""Adversarial (review 156): the adapters' options (vLLM's tier kwargs and SGLang's extra config
both go through ``StoreConfig.from_options``) refused by name, before any thread or file.

Before the fixes: a number of seconds given as an int too large for a float raised
``OverflowError`` (``float()``, ``math.isfinite``); ``close_timeout=1e300`` was taken, and a close
joining a reader's check thread raised ``OverflowError`` (beyond ``threading.TIMEOUT_MAX``);
``disk_dir=""`` put the page files in the working directory and one with a NUL byte failed at
open; a non-mapping raised ``AttributeError``; an unknown ``disk_backend`` was a ValueError naming
no option; ``queue_depth`` beyond the disk tier's bound and a namespace with a lone surrogate
failed only when the store opened.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from aiokv.adapters.loopthread import LoopThread, check_timing
from aiokv.adapters.store import StoreConfig

SECONDS = ["poll_s", "linger_s", "idle_poll_s", "writer_wait_s", "reader_refresh_s", "close_timeout"]


@pytest.mark.parametrize("name", SECONDS)
def test_seconds_too_large_for_a_float_are_value_errors(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=name):
        StoreConfig.from_options({"disk_dir": str(tmp_path), name: 10**400})
    with pytest.raises(ValueError, match=name):
        StoreConfig(directory=tmp_path, **{name: 10**400})


def test_timing_of_a_loop_thread_too_large_for_a_float() -> None:
    with pytest.raises(ValueError, match="linger_s"):
        check_timing(0.001, 10**400, 0.0)
    with pytest.raises(ValueError, match="poll_s"):
        LoopThread("aiokv-test", poll_s=10**400)


@pytest.mark.parametrize("name", ["writer_wait_s", "reader_refresh_s", "close_timeout"])
def test_waits_beyond_what_a_thread_may_wait_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=name):
        StoreConfig.from_options({"disk_dir": str(tmp_path), name: threading.TIMEOUT_MAX * 2})
    assert getattr(StoreConfig.from_options({"disk_dir": str(tmp_path), name: 3600}), name) == 3600.0


@pytest.mark.parametrize("disk_dir", ["", "a\x00b", "/tmp/x\x00"])
def test_empty_or_nul_directories_are_refused(disk_dir: str) -> None:
    with pytest.raises(ValueError, match=r"disk_dir|directory"):
        StoreConfig.from_options({"disk_dir": disk_dir})
    with pytest.raises(ValueError, match="directory"):
        StoreConfig(directory=Path(disk_dir))


@pytest.mark.parametrize("options", [None, [], [("disk_dir", "/tmp")], "disk_dir", 3])
def test_options_that_are_no_mapping_are_type_errors(options: Any) -> None:
    with pytest.raises(TypeError, match="aiokv options must be a mapping"):
        StoreConfig.from_options(options)


def test_unknown_names_of_any_type_are_listed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown aiokv options") as refused:
        StoreConfig.from_options({"disk_dir": str(tmp_path), 1: 2, None: 3, "disk_byte": 4})
    assert all(name in str(refused.value) for name in ("1", "None", "'disk_byte'"))


@pytest.mark.parametrize("backend", ["AUTO", "io_uring", "", "thread"])
def test_an_unknown_backend_names_the_option(backend: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_backend must be one of"):
        StoreConfig.from_options({"disk_dir": str(tmp_path), "disk_backend": backend})


def test_queue_depth_beyond_the_disk_tiers_bound(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="queue_depth must be at most 4096"):
        StoreConfig.from_options({"disk_dir": str(tmp_path), "queue_depth": 4097})
    assert StoreConfig.from_options({"disk_dir": str(tmp_path), "queue_depth": 4096}).queue_depth == 4096


def test_a_namespace_that_is_no_utf8(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="namespace must be encodable as UTF-8"):
        StoreConfig.from_options({"disk_dir": str(tmp_path), "namespace": "m\ud800"})
