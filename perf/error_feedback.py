"""Does error feedback pay for itself? Validation loss of a tiny GPT, with and without it.

    python perf/error_feedback.py [--steps 300] [--seeds 2] [--optimizer adamw|sgd]

Trains the "tiny" TinyGPT on stdlib source bytes from the same seed and batches:
plain PyTorch, then the cache at ratios 100 and 1000 with error feedback on and off.
Prints a markdown table of the final validation loss (mean over seeds) and the loss
gap to plain. This measurement chose EngineConfig.error_feedback's default.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gradient_cache import create_gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, byte_corpus, make_batches

BATCH_SIZE = 8
VAL_BATCHES = 16


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.03, momentum=0.9),
}


def final_val_loss(
    *, steps: int, seed: int, ratio: float | None, error_feedback: bool, optimizer_name: str
) -> float:
    config = GPT_SIZES["tiny"]
    train_tokens, val_tokens = byte_corpus()
    torch.manual_seed(seed)
    model = TinyGPT(config)
    manager = (
        create_gradient_cache(model, compression_ratio=ratio, error_feedback=error_feedback)
        if ratio is not None
        else None
    )
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = make_batches(
            train_tokens, batch_size=BATCH_SIZE, seq_len=config.seq_len, generator=generator
        )
        model(x, y)[1].backward()
        if manager is not None:
            manager.apply_gradients()
        optimizer.step()
        optimizer.zero_grad()
    val_generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        losses = [
            model(
                *make_batches(
                    val_tokens,
                    batch_size=BATCH_SIZE,
                    seq_len=config.seq_len,
                    generator=val_generator,
                )
            )[1].item()
            for _ in range(VAL_BATCHES)
        ]
    return statistics.fmean(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    args = parser.parse_args()
    variants = [("plain", None, False)] + [
        (f"r={ratio} {'with' if ef else 'without'} error feedback", ratio, ef)
        for ratio in (100, 1000)
        for ef in (True, False)
    ]
    print(
        f"tiny GPT, {args.steps} steps, batch {BATCH_SIZE}, {args.optimizer}, "
        f"seeds 0..{args.seeds - 1}"
    )
    print("\n| run | val loss | gap to plain |\n|---|---:|---:|")
    plain = None
    for name, ratio, ef in variants:
        loss = statistics.fmean(
            final_val_loss(
                steps=args.steps,
                seed=seed,
                ratio=ratio,
                error_feedback=ef,
                optimizer_name=args.optimizer,
            )
            for seed in range(args.seeds)
        )
        plain = loss if plain is None else plain
        print(f"| {name} | {loss:.4f} | {loss - plain:+.4f} |", flush=True)


if __name__ == "__main__":
    main()
