"""The example and the perf scripts run end to end (tiny settings), so they cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_example_trains_three_ways_and_lossless_matches_plain() -> None:
    out = run("examples/train_small.py", "--steps", "5")
    assert "cache r=100" in out
    assert "max |weight(plain) - weight(cache r=1)| = 0" in out


@pytest.mark.parametrize(
    "script",
    [
        ("perf/bench_core.py", "--quick"),
        ("perf/error_feedback.py", "--steps", "3", "--seeds", "1"),
    ],
    ids=["bench_core", "error_feedback"],
)
def test_perf_scripts_print_their_tables(script: tuple[str, ...]) -> None:
    assert "|---" in run(*script)


def test_step_phases_times_every_phase_and_the_encoding(tmp_path: Path) -> None:
    out_json = tmp_path / "phases.json"
    out = run(
        "-m", "perf.step_phases", "--model", "tiny", "--batch-size", "2", "--rounds", "1",
        "--warmup", "0", "--json", str(out_json),
    )  # fmt: skip
    medians = json.loads(out_json.read_text())
    assert "| cache r=100, fused step |" in out
    assert medians["plain"]["encode"] == 0
    assert medians["cache r=1"]["encode"] > 0 and medians["cache r=100"]["encode"] > 0
    for phases in medians.values():
        assert phases["total"] >= phases["backward"] + phases["drain"] >= phases["encode"]


def test_gpu_report_tables_align_rows_with_different_columns() -> None:
    from perf.gpu_report import to_markdown

    table = to_markdown([{"variant": "plain", "ms": 1.0}, {"variant": "cache", "ms": 2.0, "x": 3}])
    header, _, plain, cache = table.splitlines()
    assert header == "| variant | ms | x |"
    assert plain == "| plain | 1.000 |  |" and cache == "| cache | 2.000 | 3 |"
