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
