"""The example and the perf scripts run end to end (tiny settings), so they cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf.steps import DEFAULT_NAME

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_example_trains_three_ways_and_lossless_matches_plain() -> None:
    """Batches of 2 sequences, not the script's 8: lossless is plain bit for bit whatever the
    batch (the script's 8 validation batches of 16, each run, stay as shipped)."""
    out = run("examples/train_small.py", "--steps", "5", "--batch-size", "2")
    assert "| cache r=3 |" in out
    assert "max |weight(plain) - weight(cache r=1)| = 0" in out


def test_fsdp_example_under_torchrun_matches_plain_fsdp2_at_ratio_1() -> None:
    """torchrun, 2 CPU processes (gloo): the fused step with clipping, bit for bit."""
    out = run(
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "examples/train_fsdp.py",
        "--steps",
        "3",
    )
    assert "2 processes on cpu" in out
    assert "| cache r=3 |" in out
    assert "cache r=1 against plain FSDP2: max weight difference 0\n" in out


def test_fsdp_memory_report_prints_each_rank(tmp_path: Path) -> None:
    out = run("perf/fsdp_memory.py", "--model", "tiny", "--json", str(tmp_path / "m.json"))
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert sorted({row["rank"] for row in rows}) == [0, 1]
    by_variant = {(row["variant"], row["rank"]): row for row in rows}
    plain, fused = by_variant["plain FSDP2", 0], by_variant["cache r=1, fused step", 0]
    assert plain["backward_peak_mib"] == plain["gradient_mib"]  # all of them, to the step
    assert fused["backward_peak_mib"] < plain["backward_peak_mib"]
    # The step's peak is sampled in each bucket's update (the step hooks fire before the
    # first bucket, with no gradient in .grad): a bucket's gradients, not none, not all.
    applied = by_variant["cache r=1, apply + step", 0]
    assert plain["step_peak_mib"] == applied["step_peak_mib"] == plain["gradient_mib"]
    assert 0 < fused["step_peak_mib"] < plain["step_peak_mib"]
    assert "| cache r=100, fused step | 1 |" in out


def test_step_phases_times_every_phase_and_the_encoding(tmp_path: Path) -> None:
    out_json = tmp_path / "phases.json"
    out = run(
        "-m", "perf.step_phases", "--model", "tiny", "--batch-size", "2", "--rounds", "1",
        "--warmup", "0", "--json", str(out_json),
    )  # fmt: skip
    medians = json.loads(out_json.read_text())
    assert f"| {DEFAULT_NAME}, fused step |" in out
    assert medians["plain"]["encode"] == 0
    assert medians["cache r=1"]["encode"] > 0 and medians[DEFAULT_NAME]["encode"] > 0
    for phases in medians.values():
        assert phases["total"] >= phases["backward"] + phases["drain"] >= phases["encode"]


def test_step_phases_times_a_chosen_codec_beside_its_plain_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """In this process: the test above ran the script through ``python -m`` already, and a
    second interpreter only added the 4 s of importing torch and the package again."""
    from perf import step_phases

    out_json = tmp_path / "phases.json"
    step_phases.main([
        "--model", "tiny", "--batch-size", "2", "--rounds", "1", "--warmup", "0",
        "--variants", "cache q4", "--json", str(out_json),
    ])  # fmt: skip
    out = capsys.readouterr().out
    medians = json.loads(out_json.read_text())
    assert list(medians) == ["plain", "cache q4"]
    assert medians["cache q4"]["encode"] > 0
    assert medians["plain"]["paired"] == 1  # plain against itself, round by round
    one_round = medians["cache q4"]["total"] / medians["plain"]["total"]
    assert medians["cache q4"]["paired"] == pytest.approx(one_round)
    assert "| cache q4 |" in out and "| cache r=1 |" not in out


def test_paired_ratio_is_the_median_of_each_rounds_ratio() -> None:
    from perf.step_phases import paired_ratio

    # The machine slowed down for plain's second step and for both third ones: the ratio
    # of the medians says 11 / 20 = 0.55x; two rounds of three say 1.1x.
    plain = [10.0, 20.0, 20.0]
    variant = [11.0, 11.0, 22.0]
    assert paired_ratio(variant, plain) == pytest.approx(1.1)
    assert paired_ratio([1.0, 3.0, 4.0], [1.0, 2.0, 2.0]) == pytest.approx(1.5)


def test_gpu_report_tables_align_rows_with_different_columns() -> None:
    from perf.gpu_report import to_markdown

    table = to_markdown([{"variant": "plain", "ms": 1.0}, {"variant": "cache", "ms": 2.0, "x": 3}])
    header, _, plain, cache = table.splitlines()
    assert header == "| variant | ms | x |"
    assert plain == "| plain | 1.000 |  |" and cache == "| cache | 2.000 | 3 |"


def test_launch_counts_prints_eager_growing_and_fused_fixed(capsys) -> None:
    """In this process (it puts the codec paths back): two sizes, two codecs."""
    from gradient_cache.codecs import int8_kernels
    from perf import launch_counts

    paths = int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES
    launch_counts.main(["--sizes", "10", "19", "--codecs", "int8", "q3"])
    assert paths == (int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[:2] for row in rows] == [
        ["int8", "2^10"],
        ["int8", "2^19"],
        ["q3", "2^10"],
        ["q3", "2^19"],
    ]
    for small, large in (rows[:2], rows[2:]):
        eager_small, eager_large = map(int, small[2:4]), map(int, large[2:4])
        assert all(a < b for a, b in zip(eager_small, eager_large, strict=True))  # 1 chunk, 2
        assert small[4:] == large[4:] == ["2", "2"]  # one allocation and one operation each
