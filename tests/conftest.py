"""Suite-wide hygiene: no unhandled loop exceptions, no pending tasks, no leftover segments."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import hard_stop
import pytest
import pytest_asyncio
import torch
import xdist_order
from hypothesis import settings
from loop_probes import cancel_within

# Triton reads TRITON_INTERPRET when it is first imported, which any test importing aiokv may do
# (aiokv.kernels): without a GPU the kernel tests run under the interpreter, so set it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker's torch ran CPU ops on one thread per core: 16 workers on the
# H200 host's 16 cores ran up to 256 (load ~55), and the GPU suite was CPU-bound (the real-shape
# kernel tests alone 1,100 CPU-s). A worker gets its share of the cores; a plain run keeps torch's.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Property tests draw the same examples on every run (a seed per test), so the suite, and CI, is
# green or red the same way each time; AIOKV_HYPOTHESIS_RANDOM=1 explores new examples instead.
settings.register_profile("aiokv", derandomize=os.environ.get("AIOKV_HYPOTHESIS_RANDOM") != "1")
settings.load_profile("aiokv")

SHM_DIR = "/dev/shm"
BOTH_LOOPS_DIRS = ("cache",)
HYGIENE_CANCEL_S = 30.0
"""Test folders whose async tests run under the default loop and under uvloop."""


def pytest_configure(config: pytest.Config) -> None:
    """The hard stop (tests/hard_stop.py) watches every test and the end of the run."""
    if not config.pluginmanager.is_registered(hard_stop):
        config.pluginmanager.register(hard_stop, "aiokv-hard-stop")


@pytest.hookimpl(trylast=True)  # after -m/-k deselected: what is dealt is what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n``) each worker's first tests are its share of those marked ``slow``
    (tests/xdist_order.py: a long one handed out last ran alone for minutes at the end of the GPU
    host's parallel run). The order is the same in every worker; a plain run keeps the file order."""
    # The workers collect and order (the controller hands out indices): xdist does not give them
    # its -n option, only these variables (checked on the H200: the sort did not happen by -n).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = xdist_order.deal(items, [xdist_order.slow_seconds(item) for item in items], _WORKERS)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    """Default asyncio loop everywhere; uvloop too for the cache manager's suite."""
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if any(part in BOTH_LOOPS_DIRS for part in item.path.parts):
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what exists once the tests are collected (torch, triton, aiokv, the test items):
    the fixtures below collect garbage twice per test, and a full collection walks every object
    there is (0.1-0.3 s here with ~200K of them, about a quarter of the suite's time in CI).
    Frozen objects are never walked again; what the tests create stays collectable."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Unfreeze for the interpreter's shutdown (extensions check that their objects are freed)."""
    gc.unfreeze()


def _segments() -> set[str]:
    prefix = f"aiokv-{os.getpid()}-"
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def own_default_disk_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CacheConfig``'s default disk tier ($XDG_CACHE_HOME/aiokv) under a directory of the test's
    own, which spawned ranks inherit. Under the user's ``~/.cache/aiokv`` tests shared pages across
    tests and runs: a TP stream test checked its pool references before the offload's write-behind
    ended, which it did only on a machine's first run, when nothing was on disk yet (helper-141)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Every pool a test creates is closed (and its segment unlinked) by the end of the test."""
    before = _segments()
    yield
    gc.collect()
    left = _segments() - before
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"


@pytest_asyncio.fixture(autouse=True)
async def loop_hygiene() -> AsyncIterator[None]:
    """Fail a test that leaves an exception unhandled in the loop or a task pending."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        yield
        # Let completions that were already scheduled run, then collect dropped futures so that
        # "exception was never retrieved" is reported now, inside this test.
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks(loop) if t is not me and not t.done()]
        stuck = await cancel_within(pending, HYGIENE_CANCEL_S)
        assert not stuck, f"tasks left pending ignored their cancel for {HYGIENE_CANCEL_S} s: {stuck}"
        assert not pending, f"test left tasks pending: {pending}"
        assert not errors, f"unhandled exceptions in the event loop: {errors}"
    finally:
        loop.set_exception_handler(previous)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The whole suite leaves no segment of this process behind."""
    left = _segments()
    if left:
        print(f"\nleftover shared-memory segments: {sorted(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
