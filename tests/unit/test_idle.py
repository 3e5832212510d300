"""``--idle-exit``'s clock (daemon/idle.py) on a fake clock, its setting and its argument: when the
daemon counts as unused, and how late it notices; the real daemon is tested in
tests/integration/test_idle_exit.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from h5serve.cli import build_parser
from h5serve.daemon.config import IDLE_CHECK_INTERVAL_S, DaemonConfig
from h5serve.daemon.idle import IdleWatch
from h5serve.errors import ConfigError
from h5serve.wire.runtime import resolve_runtime


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Use:
    """What the daemon's look finds (a load or a lease), and how often it was asked."""

    def __init__(self) -> None:
        self.busy = False
        self.looks = 0

    def __call__(self) -> bool:
        self.looks += 1
        return self.busy


def run(watch: IdleWatch, clock: Clock, use: Use, seconds: float, tick: float = 0.05) -> float | None:
    """Tick the control loop for ``seconds``: the time it first expired, else None."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = round(clock.now + tick, 6)
        if watch.expired(use):
            return clock.now
    return None


def test_unused_daemon_expires_after_seconds_and_at_most_a_tick_later() -> None:
    clock, use = Clock(), Use()
    started = clock.now
    watch = IdleWatch(2.5, clock)
    expired = run(watch, clock, use, 10)
    assert expired is not None and 2.5 <= expired - started <= 2.5 + 0.05 + 1e-9
    assert watch.expired(use)  # stays expired until an activity


def test_a_request_restarts_the_count_and_cancels_a_due_exit() -> None:
    clock, use = Clock(), Use()
    watch = IdleWatch(2.0, clock)
    assert run(watch, clock, use, 1.5) is None
    watch.touch()
    touched = clock.now
    expired = run(watch, clock, use, 10)
    assert expired is not None and 2.0 <= expired - touched <= 2.0 + 0.05 + 1e-9
    watch.touch()  # a request waited on the socket when it expired: answered, the exit is off
    assert not watch.expired(use)
    assert watch.idle_for() == 0.0


def test_a_lease_or_load_keeps_it_in_use_until_a_look_finds_it_gone() -> None:
    clock, use = Clock(), Use()
    watch = IdleWatch(2.0, clock)
    use.busy = True
    assert run(watch, clock, use, 30) is None  # held far past the deadline
    clock.now += 0.37  # released between two looks
    use.busy = False
    released = clock.now
    expired = run(watch, clock, use, 10)
    assert expired is not None
    # never sooner than SECONDS after the release, at most a look interval (and a tick) later
    assert 2.0 <= expired - released <= 2.0 + IDLE_CHECK_INTERVAL_S + 0.05 + 1e-9, expired - released


def test_the_look_is_taken_once_a_second_not_every_tick() -> None:
    clock, use = Clock(), Use()
    watch = IdleWatch(1000.0, clock)
    use.busy = True
    run(watch, clock, use, 60, tick=0.01)  # 6,000 ticks
    assert 59 <= use.looks <= 61, use.looks


def test_a_touch_is_all_a_request_costs() -> None:
    clock, use = Clock(), Use()
    watch = IdleWatch(5.0, clock)
    for _ in range(1000):
        clock.now += 0.001
        watch.touch()
    assert use.looks == 0 and watch.idle_for() == 0.0


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_config_refuses_what_is_no_number_of_seconds(value: float) -> None:
    with pytest.raises(ConfigError, match="idle_exit must be a number of seconds >= 0"):
        DaemonConfig(resolve_runtime("/tmp/h5s-unit-idle"), Path("/dev/shm"), idle_exit=value)
    assert DaemonConfig(resolve_runtime("/tmp/h5s-unit-idle"), Path("/dev/shm")).idle_exit == 0.0  # never


@pytest.mark.parametrize("text,value", [("0", 0.0), ("600", 600.0), ("1.5", 1.5)])
def test_the_argument_takes_seconds(text: str, value: float) -> None:
    assert build_parser().parse_args(["start", "--idle-exit", text]).idle_exit == value
    assert build_parser().parse_args(["start"]).idle_exit is None


@pytest.mark.parametrize("text,message", [
    ("-5", "argument --idle-exit: must be a number of seconds >= 0 (0: never), got '-5'"),
    ("soon", "argument --idle-exit: takes a number of seconds (0: never), got 'soon'"),
    ("nan", "argument --idle-exit: must be a number of seconds >= 0"),
    ("inf", "argument --idle-exit: must be a number of seconds >= 0"),
])
def test_the_argument_refuses_the_rest_as_bad_usage(text: str, message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["start", "--idle-exit", text])
    assert exited.value.code == 2 and message in capsys.readouterr().err
