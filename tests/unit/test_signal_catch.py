"""pylon.signals' handlers on a running loop: each signal acted on once, on uvloop and asyncio,
and the loop woken when the kernel gives the signal to a helper thread.

The kernel delivers a process-directed signal to any thread that does not block it. Here the
main thread blocks the signals, so a helper thread (started before the block) takes each one:
its C-level handler then runs beside the main thread's interpreter, which is where uvloop's
`add_signal_handler` acted on one signal twice (its own Python-level handler and the wakeup
byte, two sources).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvloop

from pylon.signals import IGNORED, REPORT, Signals, signal_name

BURSTS = 100


@contextmanager
def delivered_to_a_helper_thread(signals: tuple[int, ...]) -> Iterator[None]:
    """`signals` reach a helper thread only: blocked in the main thread while it lasts."""
    done = threading.Event()
    helper = threading.Thread(target=done.wait, daemon=True)
    helper.start()  # before the block: the helper keeps the signals unblocked
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        done.set()
        helper.join(timeout=10)


def run_on(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, None]
) -> None:
    loop = loop_factory()
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()


LOOPS = pytest.mark.parametrize(
    "loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)


@LOOPS
def test_each_signal_of_a_burst_is_acted_on_once(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """Each round sends every signal once and waits until each was acted on: exactly once."""
    burst = (*IGNORED, *REPORT)
    names = sorted(signal_name(sig) for sig in burst)
    acted: list[str] = []
    all_came = asyncio.Event()

    def tally(name: str) -> None:
        acted.append(name)
        if set(names) <= set(acted):
            all_came.set()

    def say(event: str, **fields: Any) -> None:
        assert event == "signal_ignored"
        tally(fields["signal"])

    async def main() -> None:
        signals = Signals(asyncio.Event(), asyncio.Event(), say)
        signals.on_report = lambda sig: tally(sig.name)
        with signals.handled():
            for _ in range(BURSTS):
                for sig in burst:
                    os.kill(os.getpid(), sig)
                await asyncio.wait_for(all_came.wait(), timeout=30)
                # What a second source would add comes within a loop turn or two.
                for _ in range(10):
                    await asyncio.sleep(0)
                assert sorted(acted) == names
                acted.clear()
                all_came.clear()

    with delivered_to_a_helper_thread(burst):
        run_on(loop_factory, main())


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_stop_signal_caught_on_a_helper_thread_wakes_an_idle_loop(loop_name: str) -> None:
    """The loop sleeps in its poll when the signal comes (the sender runs Python only once the
    loop has let go of the interpreter lock), to a thread that is not the loop's. And once:
    one SIGTERM starts the drain and never also forces it. In a fresh interpreter: after a
    uvloop loop has run in a process, an asyncio loop there wakes without the wakeup socket."""
    child = multiprocessing.get_context("spawn").Process(target=_stop_wakes, args=(loop_name,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the loop slept through the signal, or forced the drain"


def _stop_wakes(loop_name: str) -> None:
    async def main() -> None:
        stop, force = asyncio.Event(), asyncio.Event()
        signals = Signals(stop, force, lambda *_a, **_f: None)
        loop = asyncio.get_running_loop()
        idle, slept_through = threading.Event(), threading.Event()

        def send() -> None:  # the kernel gives it to the one thread that does not block it
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (inherited)
            idle.wait(timeout=30)
            os.kill(os.getpid(), signal.SIGTERM)

        def watchdog() -> None:  # a thread, not a loop timer: a timer would wake the loop
            slept_through.set()
            loop.call_soon_threadsafe(stop.set)

        sender, timer = threading.Thread(target=send), threading.Timer(20, watchdog)
        with signals.handled():
            timer.start()
            sender.start()
            loop.call_soon(idle.set)  # the loop's last act before it polls
            await stop.wait()  # no timer in the loop: only the signal's wakeup ends this
            timer.cancel()
            sender.join(timeout=10)
            for _ in range(10):
                await asyncio.sleep(0)
        assert not slept_through.is_set(), "the loop slept through the signal"
        assert not force.is_set()

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    run_on(factory, main())


def test_the_default_actions_come_back_after_the_block() -> None:
    async def main() -> None:
        with Signals(asyncio.Event(), asyncio.Event(), lambda *_a, **_f: None).handled():
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.set_wakeup_fd(-1) == -1  # no wakeup socket of ours left behind

    run_on(asyncio.new_event_loop, main())
