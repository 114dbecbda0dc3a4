"""Each demo run's process (`gradient_cache.demo.processes`): fresh for every run, forked on
Linux from one process that only imported, spawned elsewhere; a run's error or its death
reported in the demo's process."""

from __future__ import annotations

import os
import resource
import signal
import sys

import pytest

from gradient_cache.demo.processes import fresh_processes

MIB = 1 << 20


def peak_rss_after(allocated_mib: int) -> tuple[int, int]:
    """This process's id and its peak RSS in MiB, after ``allocated_mib`` was held."""
    held = bytearray(allocated_mib * MIB)
    held[::4096] = b"\x01" * len(held[::4096])  # touched: resident
    del held
    return os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def fails() -> None:
    raise ValueError("the run's own error")


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_each_run_has_a_process_of_its_own_whose_peak_is_its_own() -> None:
    """A run that held 300 MiB leaves no trace in the next run's peak RSS: the next is not
    forked from it, nor from the demo's process, which holds 300 MiB more meanwhile (Linux:
    forked from a process that only imported)."""
    here = bytearray(300 * MIB)
    here[::4096] = b"\x01" * len(here[::4096])
    with fresh_processes() as in_fresh_process:
        first_pid, first_peak = in_fresh_process(peak_rss_after, 300)
        second_pid, second_peak = in_fresh_process(peak_rss_after, 0)
    assert len({first_pid, second_pid, os.getpid()}) == 3
    assert first_peak - second_peak >= 250, (first_peak, second_peak)
    del here


@pytest.mark.parametrize("platform", ["linux", "win32"], ids=["forked", "spawned"])
def test_a_runs_error_or_death_is_reported_and_the_next_run_goes_on(
    platform: str, monkeypatch: pytest.MonkeyPatch
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
            assert in_fresh_process(peak_rss_after, 0)[0] != os.getpid()
