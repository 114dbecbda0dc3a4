"""perf/gpu_check.sh on a machine without a GPU: its arguments, its time plan, its refusal."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "perf" / "gpu_check.sh"
# One lent-GPU command may run 600 s; the check keeps a margin for the machine's start.
FULL_BUDGET_S, QUICK_BUDGET_S = 480, 180


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def plan(*args: str) -> dict[str, int]:
    result = check("--dry-run", *args)
    assert result.returncode == 0, result.stderr
    return {
        name: int(seconds)
        for name, seconds in (line.split()[:2] for line in result.stdout.splitlines())
    }


def test_the_parts_run_most_valuable_first_within_the_budget() -> None:
    full, quick = plan(), plan("--quick")
    assert list(full)[:2] == ["tests_sync_and_races", "memory_table"]
    assert list(full)[-1] == "total"  # then the budget, on the same line
    full_budget = int(check("--dry-run").stdout.split()[-1])
    quick_budget = int(check("--dry-run", "--quick").stdout.split()[-1])
    assert full_budget <= FULL_BUDGET_S and quick_budget <= QUICK_BUDGET_S
    # --quick: the first parts only, each at most its full timeout, all within its budget.
    quick_parts = [name for name in quick if name != "total"]
    assert quick_parts == [name for name in full if name != "total"][: len(quick_parts)]
    assert all(quick[name] <= full[name] for name in quick_parts)
    assert quick["total"] <= quick_budget
    assert all(seconds > 0 for seconds in full.values())


def test_an_unknown_argument_is_refused_with_the_usage() -> None:
    result = check("--fast")
    assert result.returncode == 2
    assert "unknown argument '--fast'" in result.stderr and "--quick" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
@pytest.mark.parametrize("args", [(), ("--quick",)])
def test_without_a_gpu_it_stops_at_once_and_says_why(args: tuple[str, ...], tmp_path) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
    )
    assert result.returncode == 1
    assert "needs a CUDA device" in result.stderr and "Nothing was run" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
