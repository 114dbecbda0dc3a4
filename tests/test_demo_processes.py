"""Each demo run's process (`gradient_cache.demo.processes`): fresh for every run, forked on
Linux from one process that only imported, spawned elsewhere; a run's error or its death
reported in the demo's process."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from gradient_cache.demo import processes

MIB = 1 << 20


def fresh_processes() -> contextlib.AbstractContextManager[processes.InFreshProcess]:
    """The demo's, its forker importing nothing ahead: these runs make no optimizer, and
    what a demo's forker imports for its runs' (`processes.PRELOAD`, torch._dynamo) cost
    this file's four forkers 4 to 9 s of CPU in all."""
    return processes.fresh_processes(preload=())


def peak_rss_after(allocated_mib: int) -> tuple[int, int]:
    """This process's id and its peak RSS in MiB, after ``allocated_mib`` was held."""
    held = bytearray(allocated_mib * MIB)
    held[::4096] = b"\x01" * len(held[::4096])  # touched: resident
    del held
    return os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def replies_with(mib: int) -> bytes:
    return bytes(mib * MIB)


def stops(message: str) -> None:
    raise SystemExit(message)


def sleeps_after_saying_who(path: str) -> None:
    """Writes its own pid and its parent's (the forker's), then trains for a minute."""
    with open(path, "w") as out:
        out.write(f"{os.getpid()} {os.getppid()}")
    time.sleep(60)


def fails() -> None:
    raise ValueError("the run's own error")


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_each_run_has_a_process_of_its_own_whose_peak_is_its_own() -> None:
    """A run that held 300 MiB, and one whose reply was 200 MiB, leave no trace in the next
    run's peak RSS: the next is not forked from them, nor from the demo's process, which
    holds 300 MiB more meanwhile, and the forker held the reply a piece at a time (Linux:
    forked from a process that only imported)."""
    here = bytearray(300 * MIB)
    here[::4096] = b"\x01" * len(here[::4096])
    with fresh_processes() as in_fresh_process:
        first_pid, first_peak = in_fresh_process(peak_rss_after, 300)
        assert len(in_fresh_process(replies_with, 200)) == 200 * MIB
        second_pid, second_peak = in_fresh_process(peak_rss_after, 0)
    assert len({first_pid, second_pid, os.getpid()}) == 3
    assert first_peak - second_peak >= 250, (first_peak, second_peak)
    del here


def gone(pid: int, *, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def pids_when_written(path: Path) -> tuple[int, int]:
    deadline = time.monotonic() + 60  # a run that never starts fails the test, not the suite
    while not path.exists() or len(path.read_text().split()) < 2:
        assert time.monotonic() < deadline, "the run never wrote its pids"
        time.sleep(0.05)
    run, forker = map(int, path.read_text().split())
    return run, forker


def test_an_error_in_the_demo_while_a_run_is_in_flight_stops_the_run(tmp_path: Path) -> None:
    """The demo's process raising (a signal to its pid alone, a timeout) does not wait out
    the run: the run is killed and the forker ends."""
    path = tmp_path / "pids"
    pids: list[tuple[int, int]] = []

    def interrupt(signum: int, frame: object) -> None:
        pids.append(pids_when_written(path))
        raise TimeoutError("the demo's own error")

    previous = signal.signal(signal.SIGALRM, interrupt)
    started = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(TimeoutError), fresh_processes() as in_fresh_process:
            in_fresh_process(sleeps_after_saying_who, str(path))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 30
    run, forker = pids[0]
    assert gone(run) and gone(forker)


def test_a_forker_that_dies_is_reported_and_takes_its_run_with_it(tmp_path: Path) -> None:
    path = tmp_path / "pids"
    pids: list[tuple[int, int]] = []

    def kill_the_forker() -> None:
        pids.append(pids_when_written(path))
        os.kill(pids[0][1], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_forker)
    killer.start()
    with (
        fresh_processes() as in_fresh_process,
        pytest.raises(RuntimeError, match="forker process ended with exit code -9"),
    ):
        in_fresh_process(sleeps_after_saying_who, str(path))
    killer.join()
    assert gone(pids[0][0])  # PR_SET_PDEATHSIG: not left training


@pytest.mark.parametrize("platform", ["linux", "win32"], ids=["forked", "spawned"])
def test_a_runs_error_or_death_is_reported_and_the_next_run_goes_on(
    platform: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """An error is raised with the traceback from the run's process as its cause; a run
    killed by a signal says its exit code; the forker goes on after either. Both ways: a
    fork from a process that only imported (Linux), a spawn per run (elsewhere)."""
    monkeypatch.setattr(sys, "platform", platform)
    with fresh_processes() as in_fresh_process:
        with pytest.raises(ValueError, match="the run's own error") as raised:
            in_fresh_process(fails)
        assert "in fails" in str(raised.value.__cause__)
        with pytest.raises(RuntimeError, match=r"exit code -9 before reporting"):
            in_fresh_process(killed)
        if platform == "linux":  # the forker outlived the two (a spawn is new each run)
            # A run's own exit (the demo's process gone, say) is said, not swallowed.
            with pytest.raises(RuntimeError, match="exit code 1 before reporting"):
                in_fresh_process(stops, "the run's own reason to stop")
            assert "the run's own reason to stop" in capfd.readouterr().err
            assert in_fresh_process(peak_rss_after, 0)[0] != os.getpid()
