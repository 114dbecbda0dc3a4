"""@gradient_cache.optimize under Metaflow's @step, in a real local run (no network)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

metaflow = pytest.importorskip("metaflow")

FLOW_FILE = Path(__file__).parent / "flows" / "cached_training_flow.py"


def load_flow_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cached_training_flow", FLOW_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decorated_step_trains_like_plain_pytorch_and_stores_its_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    env = {
        "USERNAME": "tester",
        "METAFLOW_HOME": str(tmp_path / "home"),
        "METAFLOW_DEFAULT_DATASTORE": "local",
        "METAFLOW_DEFAULT_METADATA": "local",
        "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(store),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # A subprocess, not metaflow.Runner: building a Runner loads Metaflow's vendored
    # typing_extensions, which patches `typing` so that torch._dynamo (imported by the
    # first optimizer a process creates) no longer imports in this process.
    run_id_file = tmp_path / "run_id"
    result = subprocess.run(
        [sys.executable, str(FLOW_FILE), "--no-pylint", "run", "--run-id-file", str(run_id_file)],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    flow = load_flow_module()
    model, data = flow.make_model_and_data()
    flow.train(model, data)  # the same training, without the cache

    previous_namespace = metaflow.get_namespace()
    metaflow.metadata(f"local@{store}")
    metaflow.namespace(None)
    try:
        task = metaflow.Run(f"CachedTrainingFlow/{run_id_file.read_text()}")["train"].task
        weights, summaries = task.data.weights, task.data.gradient_cache_summaries
    finally:
        metaflow.default_metadata()
        metaflow.namespace(previous_namespace)

    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    (summary,) = summaries
    assert (summary["model"], summary["steps"]) == ("Sequential", flow.STEPS)
    assert summary["memory_saved_mb"] > 0
