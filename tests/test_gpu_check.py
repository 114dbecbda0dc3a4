"""perf/gpu_check.sh on a machine without a GPU: its arguments, its time plan, its
preflight, what each pytest part selects (its --dry-run collects them on the CPU), its
refusal; and test_cuda.py's widened-race helper on the stand-in streams."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import test_cuda
import torch
from helpers import assert_same_parameters, batches, make_model, train
from test_cuda import widen_race_windows
from test_stream_order import SMALL, fake_accelerator  # noqa: F401  (the stand-in's fixture)

import gradient_cache

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "perf" / "gpu_check.sh"
# A session has 15 device minutes, the machine's start (1-2 minutes) included: the full
# check, then a --quick rerun, each a part that hangs included.
FULL_BUDGET_S, QUICK_BUDGET_S = 420, 180
PYTEST_PARTS = ("tests_sync_and_races", "tests_cuda_rest", "sanitizer")
# Makes the modules in GC_BLOCK absent for the script's pythons, as on the lent image.
SITECUSTOMIZE = """
import os
import sys

BLOCKED = {name for name in os.environ.get("GC_BLOCK", "").split(",") if name}


class Absent:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent)
"""


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


@functools.cache
def absent_modules() -> str:
    """A folder whose sitecustomize.py hides the modules GC_BLOCK names."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_absent_"))
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(folder)


@functools.cache
def on_the_image(*args: str, absent: str = "bitsandbytes,torchao") -> subprocess.CompletedProcess:
    """The script as on the lent image: this python, no bitsandbytes or torchao (or what
    ``absent`` names) and no pytest plugin loaded from an entry point, so no
    pytest-benchmark, whose --benchmark-disable pyproject's addopts holds."""
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        PYTHONPATH=absent_modules(),
        GC_BLOCK=absent,
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


@functools.cache
def dry_run(*args: str) -> subprocess.CompletedProcess:
    """The script's --dry-run on the image (once per arguments: it collects every part's
    tests, seconds each, and prints the same for every test reading it)."""
    return on_the_image("--dry-run", *args)


def plan(*args: str) -> dict[str, int]:
    result = dry_run(*args)
    assert result.returncode == 0, result.stderr
    return {
        name: int(seconds)
        for name, seconds in (
            line.split()[:2] for line in result.stdout.splitlines() if not line[:1].isspace()
        )
    }


def selections(*args: str) -> dict[str, list[str]]:
    """Each pytest part's test ids, as its --dry-run line counts and lists them."""
    result = dry_run(*args)
    assert result.returncode == 0, result.stderr
    selected: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    part = ""
    for line in result.stdout.splitlines():
        if line[:1].isspace():
            selected[part].append(line.strip())
        elif "selects" in line:
            part, _, _, count, _ = line.split()
            selected[part], counts[part] = [], int(count)
    assert counts == {part: len(ids) for part, ids in selected.items()}
    return selected


def time_plan(*args: str) -> dict[str, int]:
    """The dry run's last line: the parts' timeouts together, their deadline, the setup's
    timeouts (device query, preflight) and the whole (setup, then the deadline)."""
    words = dry_run(*args).stdout.splitlines()[-1].split()
    return {key: int(value) for key, value in zip(words[::2], words[1::2], strict=True)}


def test_the_parts_run_most_valuable_first_within_the_budget() -> None:
    full, quick = plan(), plan("--quick")
    assert list(full)[:2] == ["tests_sync_and_races", "memory_table"]
    assert list(full)[-1] == "total"  # then the budget, on the same line
    full_time, quick_time = time_plan(), time_plan("--quick")
    # The whole call, setup included, fits: the full check and a quick rerun after it.
    assert full_time["whole"] <= FULL_BUDGET_S and quick_time["whole"] <= QUICK_BUDGET_S
    for times in (full_time, quick_time):
        assert times["whole"] == times["setup"] + times["budget"]
    # Every part's timeout together fits the deadline, which starts after the setup: no
    # part is cut short by another, nor by the preflight.
    assert full["total"] < full_time["budget"] and quick["total"] < quick_time["budget"]
    assert full["total"] == sum(seconds for name, seconds in full.items() if name != "total")
    # --quick: the first parts only, each at most its full timeout, all within its budget.
    quick_parts = [name for name in quick if name != "total"]
    assert quick_parts == [name for name in full if name != "total"][: len(quick_parts)]
    assert all(quick[name] <= full[name] for name in quick_parts)
    assert all(seconds > 0 for seconds in full.values())


def test_the_deadline_starts_after_the_preflight() -> None:
    """The preflight imports torch and every part's modules: counted in the parts' deadline
    (as it was), it cut the last part (peers_cuda) short."""
    lines = SCRIPT.read_text().splitlines()
    preflight = lines.index('run_preflight > "$out/preflight.txt"')
    starts = [i for i, line in enumerate(lines) if line.startswith("start=$SECONDS")]
    assert starts and all(i > preflight for i in starts)


def test_each_pytest_part_selects_its_own_tests() -> None:
    """Collected on the CPU by --dry-run, with each part's exact pytest command."""
    selected = selections()
    assert set(selected) == set(PYTEST_PARTS)
    assert all(selected.values())  # none empty
    first = selected["tests_sync_and_races"]
    widened = "tests/test_cuda.py::test_widened_race_windows_still_give_the_reference_result"
    never_wait = "tests/test_cuda.py::test_backward_hooks_never_wait_on_the_host"
    # Part 1: the widened race and the sync-free hooks, the default codec's (int8) included.
    for case in ("lossless", "default", "ladder-q3", "ratio-100"):
        assert f"{widened}[{case}]" in first
    assert f"{never_wait}[default]" in first
    # No test runs twice plainly; the sanitizer reruns tests the plain parts run.
    plain = selected["tests_sync_and_races"] + selected["tests_cuda_rest"]
    assert len(plain) == len(set(plain))
    assert set(selected["sanitizer"]) <= set(plain)
    # Every test of test_cuda.py runs in a plain part, and the CUDA variants elsewhere.
    functions = {name for name in dir(test_cuda) if name.startswith("test_")}
    assert functions == {
        test.split("::")[1].split("[")[0] for test in plain if test.startswith("tests/test_cuda")
    }
    assert "tests/test_accounting.py::test_cuda_meter_reads_the_allocator" in plain
    assert any(test.endswith("-cuda]") for test in plain if "test_training.py" in test)
    assert not any(test.endswith("-cpu]") for test in plain)


def test_the_preflight_leaves_out_the_peers_whose_packages_are_absent() -> None:
    errors = dry_run().stderr
    assert "peers_cuda leaves out bnb cache-fused-bnb: bitsandbytes is not installed" in errors
    assert (
        "peers_cuda leaves out cpu-offload cpu-offload-grads torchao: torchao is not installed"
        in errors
    )


def test_the_preflight_says_what_a_bare_image_lacks() -> None:
    """Without psutil, `import gradient_cache` fails: every part says so, none collects."""
    result = on_the_image("--dry-run", absent="psutil")
    assert result.returncode == 1
    for part in plan():
        if part != "total":
            assert f"preflight: {part} will be skipped: import " in result.stderr
    assert result.stderr.count("No module named 'psutil'") == len(plan()) - 1
    assert "selects" not in result.stdout


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


def test_the_widened_race_helper_fits_the_backend_it_wraps(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """test_cuda.py's `widen_race_windows` around the real accelerator backend on the
    stand-in streams (its sleeps noted, not slept): training through it is bit for bit training
    without it, and the sleeps land on the compute, encode and copy streams."""
    accelerator = request.getfixturevalue("fake_accelerator")
    data = batches(3)
    reference, widened = make_model(), make_model()
    options = dict(backend_factory=accelerator.factory, bucket_size_mb=SMALL)  # default codec
    ref_manager = gradient_cache.create_gradient_cache(reference, **options)
    manager = gradient_cache.create_gradient_cache(widened, **options)
    backend = manager.engine.backend
    sleeps: list[str] = []
    widen_race_windows(
        monkeypatch, backend, sleep=lambda: sleeps.append(accelerator.checker.active)
    )
    for fused_step in (False, True):
        train(reference, data, manager=ref_manager, fused_step=fused_step)
        train(widened, data, manager=manager, fused_step=fused_step)
    assert_same_parameters(reference, widened)
    accelerator.checker.assert_clean()
    assert set(sleeps) == {"compute", backend.encode_stream.name, backend.copy_stream.name}


def test_the_larger_than_device_part_runs_on_the_cpu_with_plain_bits(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """perf/larger_than_device.py, the part of issue 43, on its CPU stand-in (no cap to
    enforce): the cache's weights equal plain's, and the floors come from the planner; its
    JSON is written as each run ends, so a run cut off keeps the runs before it."""
    from perf import larger_than_device

    report = larger_than_device.main(["--device", "cpu", "--size", "tiny", "--steps", "2"])
    assert report["bit_for_bit"] is True and report["cache_error"] == ""
    assert report["plain_under_cap"] == "not enforced on a CPU"
    assert report["cap_enforced"] is False and report["cache_peak_bytes"] is None
    assert report["cap_bytes"] == report["weight_bytes"] // 2
    assert report["link_floor_s"] > 0 and report["compute_floor_s"] > 0
    assert report["cache_summary"]["parameters_host_mb"] > 0

    class CutOff(BaseException):  # as a timeout's signal would end it
        pass

    train = larger_than_device.train

    def cut_off_at_the_cache(*args: object, bucket: float | None = None) -> object:
        if bucket is not None:
            raise CutOff
        return train(*args)

    monkeypatch.setattr(larger_than_device, "train", cut_off_at_the_cache)
    path = tmp_path / "larger.json"
    with pytest.raises(CutOff):
        larger_than_device.main(
            ["--device", "cpu", "--size", "tiny", "--steps", "1", "--json", str(path)]
        )
    kept = json.loads(path.read_text())
    assert kept["runs_finished"] == ["plain"] and kept["plain_error"] == ""
    assert kept["plain_step_s"] > 0 and "cache_error" not in kept
