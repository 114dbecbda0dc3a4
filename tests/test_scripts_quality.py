"""perf/quality.py and perf/soak.py run end to end (tiny settings), so they cannot rot.

Apart from tests/test_scripts.py so pytest-xdist (one file per worker) can run the two
halves side by side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from test_scripts import run

from perf import quality, soak


def summarized(
    main: Callable[[list[str]], None], saved: Path, capsys: pytest.CaptureFixture
) -> str:
    """What ``main(["--summarize", saved])`` prints, run in this process: the script's own
    run above went through ``python -m`` already, and a second interpreter only added the
    4 s of importing torch and the package again."""
    capsys.readouterr()
    main(["--summarize", str(saved)])
    return capsys.readouterr().out


# r100's cache warns that top-k takes some tensors (the script's own stderr, as ever).
@pytest.mark.filterwarnings("ignore:compression_ratio=100")
def test_quality_timing_prints_its_table(capsys: pytest.CaptureFixture) -> None:
    """In this process (``--time`` trains there, no runs' processes): the benchmark's test
    below runs the script through ``python -m``, and a second interpreter only added the
    4 s of importing torch and the package again."""
    capsys.readouterr()
    quality.main(["--time", "--settings", "plain", "r100", "--rounds", "1", "--time-steps", "2"])
    out = capsys.readouterr().out
    assert "|---" in out


def test_quality_benchmark_pairs_seeds_and_counts_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A few steps of the quality benchmark: lossless equals plain, bytes follow the recipe.
    One runs' process (--jobs 1): a second only added its own start, importing torch and
    the package, on CI's two cores that the other worker keeps busy. Two validation
    batches, not 32: the 32 took 1.5 s of a run's 1.9 s, and two tell lossless's loss
    (plain's, to the bit) from the compressed one's as well."""
    out_json = tmp_path / "quality.json"
    out = run(
        "-m", "perf.quality", "--settings", "r1", "r100-ef-int8", "--optimizers", "adamw",
        "--seeds", "0", "1", "--steps", "2", "--jobs", "1", "--val-batches", "2",
        "--any-corpus", "--out", str(out_json),
    )  # fmt: skip
    report = json.loads(out_json.read_text())
    assert len(report["runs"]) == 2 * 3  # plain is always run, to pair with
    rows = {(row["optimizer"], row["setting"]): row for row in report["rows"]}
    optimizer = "adamw"  # one: the benchmark runs each optimizer alike
    assert rows[(optimizer, "r1")]["gap_mean"] == 0  # lossless offload is plain, bit for bit
    assert rows[(optimizer, "r1")]["host_bytes"] >= rows[(optimizer, "r1")]["dense_bytes"]
    compressed = rows[(optimizer, "r100-ef-int8")]
    assert compressed["gap_mean"] != 0 and compressed["gap_std"] is not None
    # Two int8 residuals (1.0625 B an entry each: the current one and a pending
    # step's) and 1% payloads: about 56% of lossless; one residual crosses PCIe.
    assert 0.5 < compressed["host_bytes"] / compressed["dense_bytes"] < 0.6
    assert 0.25 < compressed["pcie_bytes"] / (2 * compressed["dense_bytes"]) < 0.35
    assert compressed["device_bytes"] == 0
    assert "| adamw | r100-ef-int8 |" in out
    assert summarized(quality.main, out_json, capsys).strip() in out  # re-printed


def test_soak_returns_tensors_threads_and_hooks_to_their_start_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_json = tmp_path / "soak.json"
    out = run(
        "-m", "perf.soak", "--settings", "r1", "default", "--steps", "9", "--warmup", "3",
        "--sample-every", "3", "--any-corpus", "--out", str(out_json),
        "--png", str(tmp_path / "soak.png"),
    )  # fmt: skip
    results = json.loads(out_json.read_text())["results"]
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")
    verdict_rows = [line for line in out.splitlines() if line.endswith("| (no plain run) |")]
    assert [row.split(" | ")[:2] for row in verdict_rows] == [["| r1", "1"], ["| default", "1"]]
    assert [r["setting"] for r in results] == ["r1", "default"]
    for result in results:
        assert result["start"] == result["end"]
        assert result["start"]["tensors"] > 0 and result["rss_peak_mib"] > 0
        assert [step for step, _, _ in result["curve"]] == [3, 6, 9]
        assert all(rss > 0 and tensors > 0 for _, rss, tensors in result["curve"])
        assert math.isfinite(result["rss_slope_mib_per_1000"])
    assert "| default | 1 | 9 |" in out
    assert summarized(soak.main, out_json, capsys).strip() in out  # re-printed


def test_the_soak_verdict_compares_each_settings_mean_slope_with_plains_plus_the_target() -> None:
    from perf.soak import TARGET_SHARE, verdict, verdict_markdown

    def result(setting: str, share: float) -> dict:
        return {"setting": setting, "rss_slope_share_per_1000": share}

    rows = verdict(
        [
            result("plain", 0.0002), result("r1", 0.0001), result("default", 0.0009),
            result("plain", 0.0), result("r1", 0.0010), result("default", 0.0005),
        ]
    )  # fmt: skip
    by_setting = {row["setting"]: row for row in rows}
    assert by_setting["plain"]["meets"] is None
    assert by_setting["plain"]["mean"] == pytest.approx(0.0001)
    # r1's mean, 0.055%, is above the target alone but within plain's mean plus the target.
    assert by_setting["r1"]["mean"] == pytest.approx(0.00055) and by_setting["r1"]["meets"]
    assert (by_setting["r1"]["low"], by_setting["r1"]["high"]) == (0.0001, 0.0010)
    assert by_setting["default"]["mean"] == pytest.approx(0.0007)
    assert not by_setting["default"]["meets"]
    assert by_setting["default"]["limit"] == pytest.approx(0.0001 + TARGET_SHARE)
    table = verdict_markdown(rows)
    assert "| r1 | 2 | +0.055% | +0.010% | +0.100% | met (≤ +0.060%) |" in table
    assert "| default | 2 | +0.070% |" in table and "missed (≤ +0.060%)" in table
    assert verdict([result("r1", 0.0)])[0]["meets"] is None  # nothing to compare with


def test_the_soak_slope_is_the_least_squares_fit() -> None:
    from perf.soak import slope_per_thousand

    growing = [
        (step, 300 + 0.002 * step + (0.5 if step % 200 else -0.5)) for step in range(0, 10_001, 100)
    ]
    assert slope_per_thousand(growing) == pytest.approx(2.0, abs=0.05)
    assert slope_per_thousand([(100, 5.0), (200, 5.0), (300, 5.0)]) == 0
    assert slope_per_thousand([(100, 5.0)]) == 0
