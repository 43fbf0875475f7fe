"""LoopThread's non-waking hand-over: posted work is never lost, parked or polling."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiokv.adapters.loopthread import LoopDied, LoopThread


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    thread = LoopThread("aiokv-test", poll_s=0.001, linger_s=0.0)
    yield thread
    thread.close()


def test_posted_work_waits_for_a_wake_while_parked(lt: LoopThread) -> None:
    ran = threading.Event()
    assert lt.parked
    lt.post_call(ran.set)
    assert not ran.wait(0.02)  # no wake-up was sent: the loop did not see it
    assert lt.pending() == 1
    lt.wake()
    assert ran.wait(5)
    lt.quiesce(5)
    assert lt.pending() == 0


def test_quiesce_runs_posted_work_and_waits_for_its_coroutines(lt: LoopThread) -> None:
    done: list[int] = []

    async def work(n: int) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        done.append(n)

    for n in range(5):
        lt.post(work(n))
    lt.quiesce(5)  # never woken: quiesce itself picks the work up
    assert sorted(done) == list(range(5))


def test_a_busy_loop_picks_up_posted_work_without_a_wake(lt: LoopThread) -> None:
    gate: concurrent.futures.Future[None] = concurrent.futures.Future()
    started = threading.Event()

    async def busy() -> None:
        started.set()
        await asyncio.wrap_future(gate)

    lt.post(busy())
    lt.wake()
    assert started.wait(5)
    ran = threading.Event()
    lt.post_call(ran.set)  # the loop polls while `busy` runs
    assert ran.wait(5)
    gate.set_result(None)
    lt.quiesce(5)


def test_posts_racing_the_park_are_never_stranded(lt: LoopThread) -> None:
    """linger_s=0: the loop parks after every item, so each post races a park; the last item must
    still run with no hand-over after it but its own wake()."""
    count = 2000
    seen = [0]
    last = threading.Event()

    def one() -> None:
        seen[0] += 1
        if seen[0] == count:
            last.set()

    for _ in range(count):
        lt.post_call(one)
        lt.wake()
    assert last.wait(10), f"{count - seen[0]} posted calls stranded"


def test_a_posted_call_that_raises_does_not_stop_the_loop(lt: LoopThread, caplog: pytest.LogCaptureFixture) -> None:
    ran = threading.Event()

    def boom() -> None:
        raise ValueError("boom")

    lt.post_call(boom)
    lt.post_call(ran.set)
    lt.wake()
    assert ran.wait(5)
    assert "posted call raised" in caplog.text


def test_close_drops_unstarted_work_and_refuses_more() -> None:
    thread = LoopThread("aiokv-test")

    async def never() -> None:
        raise AssertionError("an unstarted coroutine ran")

    thread.post(never())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread.close()
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    with pytest.raises(RuntimeError):
        thread.post_call(lambda: None)
    late = never()
    with pytest.raises(RuntimeError):
        thread.post(late)
    thread.close()  # idempotent


def test_an_item_posted_as_the_loop_parks_keeps_it_polling(lt: LoopThread) -> None:
    """The interleaving the stress test above can only hope to hit: the engine's append lands after
    the loop's last poll but before it publishes "parked" (so the engine saw "polling" and sent no
    wake-up). The park's second look must find it."""
    ran = threading.Event()

    def post_then_park() -> None:
        lt._inbox.append(ran.set)  # as an engine thread would, between the poll and the park
        lt._park()

    lt.call(post_then_park).result(5)
    assert ran.wait(5)
    assert lt.pending() == 0


def test_a_parked_loop_with_idle_polling_finds_work_unwoken() -> None:
    thread = LoopThread("aiokv-test", poll_s=0.001, linger_s=0.0, idle_poll_s=0.005)
    try:
        ran = threading.Event()
        assert thread.parked
        thread.post_call(ran.set)  # no wake()
        assert ran.wait(5)
    finally:
        thread.close()


@pytest.mark.parametrize(("options", "error"), [
    ({"poll_s": float("inf")}, ValueError),
    ({"linger_s": float("nan")}, ValueError),
    ({"idle_poll_s": -1.0}, ValueError),
    ({"poll_s": 0.0}, ValueError),
    ({"poll_s": "1"}, TypeError),
    ({"linger_s": True}, TypeError),
], ids=["poll-inf", "linger-nan", "idle-negative", "poll-zero", "poll-str", "linger-bool"])
def test_polling_settings_a_loop_cannot_run_with_are_refused(options: dict[str, object], error: type) -> None:
    from aiokv.adapters.store import StoreConfig

    settings: dict[str, object] = {"poll_s": 0.001, "linger_s": 0.05, "idle_poll_s": 0.01, **options}
    with pytest.raises(error):
        LoopThread("bad", **settings)  # type: ignore[arg-type]
    with pytest.raises(error):
        StoreConfig(directory=Path("/nonexistent-aiokv"), **settings)  # type: ignore[arg-type]


# -- a loop that dies ----------------------------------------------------------------------------


def _die() -> None:
    raise SystemExit("injected")


def test_a_dying_loop_fails_its_waiters_runs_its_finalizers_and_refuses_more_work() -> None:
    """Regression: a loop ended by a BaseException left callers of run()/call() waiting for ever
    and the owner's resources open. Now: work in flight is cancelled (its cleanup runs),
    finalizers run on the loop, waiters get LoopDied, later hand-overs raise it."""
    thread = LoopThread("aiokv-test", poll_s=0.001, linger_s=0.0)
    try:
        started, cleaned, finalized = threading.Event(), threading.Event(), threading.Event()
        gate: concurrent.futures.Future[None] = concurrent.futures.Future()

        async def in_flight() -> None:
            started.set()
            try:
                await asyncio.wrap_future(gate)
            finally:
                cleaned.set()

        async def finalizer() -> None:
            await asyncio.sleep(0)
            finalized.set()

        thread.add_finalizer(finalizer)
        waiting = thread.submit(in_flight())
        assert started.wait(10)
        thread.post_call(_die)
        thread.wake()
        with pytest.raises((LoopDied, concurrent.futures.CancelledError)):
            waiting.result(10)
        thread.close()  # joins the dying thread; idempotent with what follows
        assert thread.dead and isinstance(thread.died, LoopDied)
        assert isinstance(thread.died.__cause__, SystemExit)
        assert cleaned.is_set() and finalized.is_set()
        with pytest.raises(LoopDied):
            thread.call(lambda: None)
        with pytest.raises(LoopDied):
            thread.run(asyncio.sleep(0))
        with pytest.raises(LoopDied):
            thread.post_call(lambda: None)
        with pytest.raises(LoopDied):
            thread.quiesce(5)
    finally:
        thread.close()


def test_a_quiesce_that_meets_the_fatal_call_raises_loop_died_not_system_exit() -> None:
    """Regression: quiesce runs posted calls inside its own task; a SystemExit there reached the
    waiting engine thread as SystemExit."""
    thread = LoopThread("aiokv-test", poll_s=0.001, linger_s=0.0)
    try:
        thread.post_call(_die)
        with pytest.raises(LoopDied):
            thread.quiesce(10)
    finally:
        thread.close()
    assert thread.dead


def test_a_loop_stopped_without_close_counts_as_dead() -> None:
    thread = LoopThread("aiokv-test", poll_s=0.001, linger_s=0.0)
    try:
        thread.loop.call_soon_threadsafe(thread.loop.stop)
        thread._thread.join(10)  # it ends by itself
        with pytest.raises(LoopDied):
            thread.call(lambda: None)
    finally:
        thread.close()
    assert thread.dead and "stopped without" in str(thread.died)


def test_a_long_quiesce_says_what_it_waits_for(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A quiesce that waits long logs the coroutine chain it waits on (a hang must be diagnosable)."""
    import aiokv.adapters.loopthread as loopthread

    monkeypatch.setattr(loopthread, "QUIESCE_REPORT_S", 0.01)
    thread = LoopThread("aiokv-test", poll_s=0.001, linger_s=0.0)
    try:
        gate: concurrent.futures.Future[None] = concurrent.futures.Future()

        async def inner() -> None:
            await asyncio.wrap_future(gate)

        async def outer() -> None:
            await inner()

        thread.post(outer())
        waiting = threading.Thread(target=thread.quiesce, args=(10,))
        with caplog.at_level("WARNING", logger="aiokv.adapters.loopthread"):
            waiting.start()
            for _ in range(1000):  # bounded: the report comes after 10 ms
                if "quiesce has waited" in caplog.text:
                    break
                gate_seen = threading.Event()
                gate_seen.wait(0.01)
            gate.set_result(None)
            waiting.join(10)
        assert not waiting.is_alive()
        assert "outer (test_loopthread.py" in caplog.text and "-> inner (test_loopthread.py" in caplog.text
    finally:
        thread.close()


def test_a_wake_racing_the_loop_s_death_raises_nothing_into_the_engine_thread() -> None:
    """Regression (the window review 108 named): wake() found the loop parked and alive, then the
    loop died and closed before its call_soon_threadsafe, which raised RuntimeError('Event loop is
    closed') into the engine's thread (vLLM's scheduler). Forced here: the loop really dies (a
    SystemExit out of a callback) and its thread ends right after wake()'s checks."""

    parked = threading.Event()  # set by the loop thread as it parks (no polling of the flag)

    class Racing(LoopThread):
        race = False

        @property  # type: ignore[override]
        def _parked(self) -> bool:
            return bool(self.__dict__["parked_flag"])

        @_parked.setter
        def _parked(self, value: bool) -> None:
            if self.race and not value and threading.current_thread() is threading.main_thread():
                self.race = False  # wake() passed its checks: the loop dies and closes now
                self.loop.call_soon_threadsafe(_die)
                assert self.wait_ended(10)
            self.__dict__["parked_flag"] = value
            if value:
                parked.set()

    thread = Racing("aiokv-test", poll_s=0.001, linger_s=0.0)
    try:
        assert parked.wait(10)
        assert thread.parked
        thread.post_call(lambda: None)
        thread.race = True
        thread.wake()  # must not raise
        assert thread.dead and isinstance(thread.died, LoopDied)
        with pytest.raises(LoopDied):
            thread.post_call(lambda: None)
    finally:
        thread.close()
