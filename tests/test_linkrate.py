"""`gradient-cache plan --measure-link`: the copy-rate arithmetic on stand-in CUDA events,
and what the plan says without a GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from gradient_cache import cli
from gradient_cache.linkrate import measure_link
from gradient_cache.planner import DEFAULT_LINK_GBPS


class TimedEvent:
    """An event whose elapsed time to another comes from a script of milliseconds."""

    def __init__(self, script: Iterator[float]) -> None:
        self._script = script

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: TimedEvent) -> float:
        return next(self._script)


class ScriptedCuda:
    """Enough of `torch.cuda` for `measure_link`, copies on the CPU, times from a script."""

    def __init__(self, milliseconds: list[float]) -> None:
        self._script = iter(milliseconds)

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device: object) -> str:
        return "stand-in GPU"

    def Stream(self, device: object = None) -> object:  # torch.cuda's name
        return object()

    def Event(self, enable_timing: bool = False) -> TimedEvent:  # torch.cuda's name
        return TimedEvent(self._script)

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        yield


def test_rates_are_bytes_over_the_median_timed_copy_after_a_warm_up() -> None:
    copied = []

    def allocate(nbytes: int) -> torch.Tensor:
        host = torch.zeros(nbytes, dtype=torch.uint8)
        copied.append(host)
        return host

    # Per direction: a slow warm-up (left out), then three copies; medians 10 and 40 ms.
    cuda = ScriptedCuda([500.0, 9.0, 10.0, 11.0, 500.0, 40.0, 30.0, 50.0])
    rate = measure_link(
        copy_bytes=10**8, repeats=3, cuda=cuda, device=torch.device("cpu"), allocate_pinned=allocate
    )
    assert rate.device_to_host_gbps == pytest.approx(10**8 / 0.010 / 1e9)  # 10 GB/s
    assert rate.host_to_device_gbps == pytest.approx(10**8 / 0.040 / 1e9)  # 2.5 GB/s
    assert rate.slower_gbps == rate.host_to_device_gbps
    assert rate.device_name == "stand-in GPU" and len(copied) == 1


def test_measuring_without_a_gpu_raises_and_bad_sizes_are_refused() -> None:
    class NoCuda(ScriptedCuda):
        def is_available(self) -> bool:
            return False

    with pytest.raises(RuntimeError, match="no CUDA device"):
        measure_link(cuda=NoCuda([]))
    with pytest.raises(ValueError, match="copy_bytes=0"):
        measure_link(copy_bytes=0, cuda=ScriptedCuda([]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the plan where no GPU is")
def test_the_plan_says_which_rate_it_assumed_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--params", "1000000", "--measure-link"]) == 0
    captured = capsys.readouterr()
    line = next(text for text in captured.out.splitlines() if text.startswith("Host link"))
    assert f"{DEFAULT_LINK_GBPS:g} GB/s" in line and "measured nothing" in line
    assert "no CUDA device" in captured.err


def test_a_given_rate_is_said_to_be_given_and_excludes_measuring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--params", "1000000", "--link-gbps", "12.5"]) == 0
    assert "Host link: 12.5 GB/s per direction (given with --link-gbps)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", "--params", "1000000", "--link-gbps", "12.5", "--measure-link"])
    assert "not allowed with argument --link-gbps" in capsys.readouterr().err
