"""Where the cache's step time goes: each phase of a training step, plain against the cache.

    python -m perf.step_phases [--rounds 12] [--warmup 3] [--model small] [--json PATH]
    python -m perf.step_phases --variants "cache q4" "cache sign"   # these and their plain
    python -m perf.step_phases --variants "cache r=1, fused step" \
        "cache r=1, fused step, state on host"   # the optimizer state on the host too

Trains copies of one TinyGPT with Adam, interleaved round robin on the same batches, and
prints the median milliseconds of each phase per variant: forward, backward, drain
(`compress_and_free_gradients`), restore (`apply_gradients`) and the optimizer step (for the
fused `step()`, restore and optimizer together). "encode" is the cache's encoding, timed
apart: it runs inside backward (full buckets) and the drain (the last, partial bucket).
A CPU measurement; on a GPU the phases overlap and host timers would not separate them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from gradient_cache.codecs import BLOCK_CODECS, LADDER
from gradient_cache.engine.config import DEFAULT_COMPRESSION_RATIO
from perf.steps import STEP_VARIANTS, StepVariant, Trainer, batch_stream, build, gpt

PHASES = ("forward", "backward", "encode", "drain", "restore", "optimizer", "total")
FUSED_ADAM_PLAIN = StepVariant(name="plain, Adam(fused=True)", fused_adam=True)
VARIANTS = [v for v in STEP_VARIANTS if not v.naive] + [FUSED_ADAM_PLAIN]
# The block codecs as a user picks them (`codec=` at the default ratio): run on request only.
CODEC_VARIANTS = [
    StepVariant(name=f"cache {codec}", ratio=DEFAULT_COMPRESSION_RATIO, codec=codec)
    for codec in LADDER
    if codec in BLOCK_CODECS
]
# The optimizer state in host memory too (offload_optimizer_state): on request only.
STATE_VARIANT = StepVariant(
    name="cache r=1, fused step, state on host", ratio=1, fused_step=True, state_on_host=True
)
ALL_VARIANTS = {v.name: v for v in [*VARIANTS, *CODEC_VARIANTS, STATE_VARIANT]}


def baseline_name(variant: StepVariant) -> str:
    """Plain PyTorch with the variant's optimizer: what its total is compared with."""
    return FUSED_ADAM_PLAIN.name if variant.fused_adam else "plain"


def with_baselines(names: list[str]) -> list[StepVariant]:
    """The named variants, each preceded (once) by the plain run it is compared with."""
    chosen: list[StepVariant] = []
    for name in names:
        variant = ALL_VARIANTS[name]
        for needed in (ALL_VARIANTS[baseline_name(variant)], variant):
            if needed not in chosen:
                chosen.append(needed)
    return chosen


def timed_encoding(trainer: Trainer) -> Callable[[], float]:
    """Time the cache's encoding of each bucket; returns a read-and-reset function.

    Through the engine's backend, its public face (`manager.engine.backend`): a bucket's
    encodes run inside its `encoding` context, and its `store` sends their payloads to host
    memory, as the pipeline's launch of a bucket does (inside backward and in the drain).
    """
    spent = [0.0]
    backend = trainer.cache.engine.backend
    encoding, store = backend.encoding, backend.store

    @contextlib.contextmanager
    def timed_encoding_of(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with encoding(params):
                yield
        finally:
            spent[0] += time.perf_counter() - start

    def timed_store(encoded: list, grads: list[torch.Tensor]) -> dict:
        start = time.perf_counter()
        try:
            return store(encoded, grads)
        finally:
            spent[0] += time.perf_counter() - start

    backend.encoding = timed_encoding_of
    backend.store = timed_store

    def take() -> float:
        value, spent[0] = spent[0], 0.0
        return value

    return take


def one_step(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Seconds of each phase of one step. The drain runs inside backward and the restore
    inside the optimizer phase: each is taken out of the phase around it."""
    spent: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def timed(name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        spent[name] += time.perf_counter() - start

    start = time.perf_counter()
    trainer.step(x, y, phase=timed, keep_logits=True)  # as this script always has
    total = time.perf_counter() - start
    return {
        "forward": spent["forward"],
        "backward": spent["backward"] - spent["drain"],
        "drain": spent["drain"],
        "restore": spent["restore"],
        "optimizer": spent["optimizer"] - spent["restore"],
        "total": total,
    }


def measure(
    *, variants: list[StepVariant], model: str, rounds: int, warmup: int, batch_size: int
) -> dict[str, dict]:
    base = gpt(model)
    trainers = {v.name: build(v, base) for v in variants}
    encoders = {
        v.name: timed_encoding(trainers[v.name]) for v in variants if trainers[v.name].cache
    }
    next_batch = batch_stream(base, batch_size=batch_size)
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for round_index in range(warmup + rounds):
        x, y = next_batch()
        # Every other round in reverse: no variant always runs first or right after another.
        for variant in variants if round_index % 2 == 0 else variants[::-1]:
            phases = one_step(trainers[variant.name], x, y)
            phases["encode"] = encoders[variant.name]() if variant.name in encoders else 0.0
            if round_index >= warmup:
                for name, seconds in phases.items():
                    samples[variant.name][name].append(seconds * 1e3)
    medians = {
        name: {phase: statistics.median(values) for phase, values in by_phase.items()}
        for name, by_phase in samples.items()
    }
    for variant in variants:
        totals = samples[variant.name]["total"]
        baseline = samples[baseline_name(variant)]["total"]
        medians[variant.name]["paired"] = paired_ratio(totals, baseline)
    return medians


def paired_ratio(totals: list[float], baseline: list[float]) -> float:
    """The median of each round's total over the baseline's in that round: steadier than
    the ratio of the two medians when the machine's speed drifts between rounds."""
    return statistics.median(t / b for t, b in zip(totals, baseline, strict=True))


def table(medians: dict[str, dict], variants: list[StepVariant]) -> str:
    """Markdown rows; "vs plain" compares totals with plain PyTorch on the same optimizer."""
    header = "| variant | " + " | ".join(PHASES) + " | vs plain | paired |"
    lines = [header, "|---|" + "---:|" * (len(PHASES) + 2)]
    for variant in variants:
        phases = medians[variant.name]
        plain = medians[baseline_name(variant)]["total"]
        cells = " | ".join(f"{phases[p]:.1f}" for p in PHASES)
        ratios = f"{phases['total'] / plain:.3f}x | {phases['paired']:.3f}x"
        lines.append(f"| {variant.name} | {cells} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(ALL_VARIANTS),
        default=[v.name for v in VARIANTS],
        help="variants to time (each with its plain baseline); default: all but the codecs'",
    )
    args = parser.parse_args(argv)
    variants = with_baselines(args.variants)
    medians = measure(
        variants=variants,
        model=args.model,
        rounds=args.rounds,
        warmup=args.warmup,
        batch_size=args.batch_size,
    )
    print(
        f"## Step phases: TinyGPT {args.model!r}, batch {args.batch_size}, Adam, "
        f"median ms of {args.rounds} interleaved rounds\n"
    )
    print(table(medians, variants))
    print(
        "\nencode is spent inside backward and drain; total is the whole step. "
        "Medians of each column are taken separately, so they need not add up. vs plain: "
        "the ratio of the total's medians; paired: the median of each round's ratio."
    )
    if args.json is not None:
        args.json.write_text(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
