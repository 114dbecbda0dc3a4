"""Perf runs: fast smoke tests by default, full benchmarks with ``--benchmark-enable``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from perf.harness import ROWS, benchmarks_enabled, cpu_model, cpu_snapshot, others_share, render

_SESSION_START = cpu_snapshot()


@pytest.fixture(scope="session")
def full_run(request: pytest.FixtureRequest) -> bool:
    """True when benchmarks run for real: full sizes and rounds; else tiny, once each."""
    return benchmarks_enabled(request.config)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["cpu_model"] = cpu_model()


def pytest_benchmark_update_json(
    config: pytest.Config, benchmarks: list, output_json: dict
) -> None:
    # The rows behind the printed tables, memory figures included (they are not timings).
    output_json["gradient_cache_tables"] = dict(ROWS)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    tables = render()
    if benchmarks_enabled(config) and tables:
        terminalreporter.write_sep("=", "gradient-cache perf tables (markdown)")
        terminalreporter.write_line(tables)
        share = others_share(_SESSION_START, cpu_snapshot())
        terminalreporter.write_line(
            f"\nOther processes used {share:.0%} of this machine's CPU during the run."
        )
