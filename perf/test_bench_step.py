"""Training-step time of TinyGPT per variant, each paired round by round with plain PyTorch.

Every round runs one plain step (in pytest-benchmark's untimed setup, timed here) and then
one step of the variant (timed by pytest-benchmark), on the same batch. The ratio reported
is the median over rounds of variant / plain: drift of this shared machine hits both
halves of a round alike. The "plain" variant, paired with another plain model, shows the
noise floor. extra_info adds the host store, the process RSS (psutil) and the share of the
machine's CPU that other processes took during the rounds (near 0: the timing ran alone).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import psutil
import pytest

from gradient_cache.demo.models import TinyGPT
from perf.harness import MIB, cpu_snapshot, others_share, record
from perf.steps import STEP_VARIANTS, Batch, StepVariant, Trainer, batch_stream, build, gpt


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    model: str
    batch_size: int
    rounds: int
    warmup_rounds: int


FULL = StepSettings(model="small", batch_size=8, rounds=15, warmup_rounds=3)
SMOKE = StepSettings(model="tiny", batch_size=2, rounds=1, warmup_rounds=0)


@pytest.fixture(scope="module")
def settings(full_run: bool) -> StepSettings:
    return FULL if full_run else SMOKE


@pytest.fixture(scope="module")
def base(settings: StepSettings) -> TinyGPT:
    return gpt(settings.model)


@pytest.fixture(scope="module")
def plain_trainers() -> dict[StepVariant, Trainer]:
    """One plain model per optimizer kind, shared by the variants' rounds."""
    return {}


@pytest.mark.parametrize("variant", STEP_VARIANTS, ids=[v.name for v in STEP_VARIANTS])
def test_step(
    benchmark,
    variant: StepVariant,
    base: TinyGPT,
    settings: StepSettings,
    plain_trainers: dict[StepVariant, Trainer],
) -> None:
    benchmark.group = f"step: TinyGPT {settings.model}, batch {settings.batch_size}"
    trainer = build(variant, base)
    if variant.baseline not in plain_trainers:
        plain_trainers[variant.baseline] = build(variant.baseline, base)
    plain = plain_trainers[variant.baseline]
    next_batch = batch_stream(base, batch_size=settings.batch_size)
    plain_times: list[float] = []
    variant_times: list[float] = []
    shares: list[float] = []  # of the machine's CPU taken by other processes, per round
    round_start = cpu_snapshot()

    def plain_round() -> tuple[Batch, dict]:
        nonlocal round_start
        batch = next_batch()
        round_start = cpu_snapshot()
        start = time.perf_counter()
        plain.step(*batch)
        plain_times.append(time.perf_counter() - start)
        return batch, {}

    def variant_round(x, y) -> None:
        start = time.perf_counter()
        trainer.step(x, y)
        variant_times.append(time.perf_counter() - start)
        shares.append(others_share(round_start, cpu_snapshot()))

    benchmark.pedantic(
        variant_round,
        setup=plain_round,
        rounds=settings.rounds,
        warmup_rounds=settings.warmup_rounds,
    )
    skip = settings.warmup_rounds if benchmark.enabled else 0
    ratios = [v / p for v, p in zip(variant_times[skip:], plain_times[skip:], strict=True)]
    summary = trainer.cache.get_compression_summary() if trainer.cache else None
    row = {
        "variant": variant.name,
        "ms": statistics.median(variant_times[skip:]) * 1e3,
        "plain_ms": statistics.median(plain_times[skip:]) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "host_store_mib": summary["stored_gradient_mb"] + summary["residual_mb"] if summary else 0,
        "rss_mib": psutil.Process().memory_info().rss / MIB,
        "others_cpu": statistics.median(shares[skip:]),
        "parameters": base.num_parameters(),
    }
    benchmark.extra_info.update(row)
    if benchmark.enabled:
        record("step", **row)
