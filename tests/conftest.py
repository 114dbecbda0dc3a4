"""Fixtures shared by the tests; helpers live in tests/helpers.py."""

from __future__ import annotations

import copy
import os

# MKL's sgemm on some Intel CPUs picks its code path by the operands' memory alignment:
# two bit-for-bit runs whose tensors sit at other addresses then differ (examples/
# train_small.py, one run in six). Strict reproducibility mode, read at MKL's first call,
# for this process and the scripts the tests start.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# Under pytest-xdist (the README's test command), one intra-op thread per worker and per
# script a test starts: a worker per core already keeps every core busy, and two threads
# each on two cores made the suite 1.6x slower (466 s against 288 s of pytest time).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch
from helpers import TiedLM, make_model

# Bit-for-bit comparisons need one intra-op thread count: LayerNorm's CPU backward sums
# per-thread partial results, so other counts give other bits (4e-5 after 10 AdamW steps).
# Lightning's launcher may lower the process-wide count; every test starts from this one.
if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)  # torch may have been imported before OMP_NUM_THREADS was set
THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def fixed_thread_count():
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture
def twin_models() -> tuple[TiedLM, TiedLM]:
    model = make_model()
    return model, copy.deepcopy(model)


# pytest-xdist's loadfile hands out the files with the most tests first, which leaves for
# last the files whose one demo run or pair of processes takes 15 to 40 s, alone on one
# worker while the other stands idle. The costliest files go first instead, longest first
# (each 10 to 41 s of one worker's time: `--junitxml` on the 2-core AMD VM, 2026-12-07),
# the rest behind them in collection order; perf/RESULTS.md, "The suite's order".
COSTLIEST_FIRST = (
    "test_demo_default_scenario.py",
    "test_scripts.py",
    "test_gpu_check.py",
    "test_scripts_quality.py",
    "test_demo_processes.py",
    "test_parameters_offload.py",
    "test_stream_order.py",
    "test_distributed.py",
    "test_transformers.py",
    "test_codecs.py",
    "test_lightning.py",
    "test_demo_larger_than_device.py",
    "test_metaflow.py",
    "test_compile.py",
    "test_weight_streamers.py",
    "test_demo.py",
    "test_call_orders.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # xdist's own order (most tests first) would undo this one; absent without xdist.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
