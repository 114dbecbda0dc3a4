"""How compressed gradient accumulation should combine micro-batches: measured, not guessed.

    python -m perf.accumulation [--micro-batches 4] [--ratio 100] [--steps 3]

For the "small" TinyGPT on stdlib source bytes, takes each micro-batch's real gradients
and compares, per step, three ways to accumulate top-k payloads against the exact dense sum:

* union: keep every micro-batch's selection and sum them at restore (the v1 engine; host
  memory grows with the micro-batches, merging needs host work or a growing list);
* re-select: add the cached payload into the next gradient and select again (the v2 engine:
  one payload per parameter, no host work);
* one selection of the dense sum (what a cache holding dense sums would send; the bound).

Prints the relative L2 error and cosine similarity to the dense sum over all compressed
tensors, and the entries kept relative to one payload. Accuracy cost of compression itself
is the quality benchmark's business; this only compares the accumulation rules.
"""

from __future__ import annotations

import argparse

import torch

from gradient_cache.codecs import TopKEncoder
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, byte_corpus, make_batches
from gradient_cache.engine.config import EngineConfig

BATCH_SIZE = 8


def micro_batch_gradients(micro_batches: int, steps: int, seed: int) -> list[list[dict]]:
    """Per step, per micro-batch: {name: flat gradient} of the compressible tensors."""
    config = GPT_SIZES["small"]
    train_tokens, _ = byte_corpus()
    torch.manual_seed(seed)
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    minimum = EngineConfig().min_compress_numel
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(steps):
        step = []
        summed = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for _ in range(micro_batches):
            x, y = make_batches(
                train_tokens, batch_size=BATCH_SIZE, seq_len=config.seq_len, generator=generator
            )
            (model(x, y)[1] / micro_batches).backward()
            step.append(
                {
                    n: p.grad.reshape(-1).clone()
                    for n, p in model.named_parameters()
                    if p.numel() >= minimum
                }
            )
            for n, p in model.named_parameters():
                summed[n] += p.grad
                p.grad = None  # the next micro-batch's gradient on its own
        for n, p in model.named_parameters():  # step on the sum, so later steps are realistic
            p.grad = summed[n]
        optimizer.step()
        optimizer.zero_grad()
        result.append(step)
    return result


def compare(steps: list[list[dict]], ratio: float) -> dict[str, dict[str, float]]:
    encoder = TopKEncoder(ratio=ratio, selection="exact")
    totals = {rule: {"err2": 0.0, "dot": 0.0, "norm2": 0.0, "kept": 0} for rule in RULES}
    reference = {"sum2": 0.0, "kept": 0}
    for step in steps:
        for name in step[0]:
            grads = [mb[name] for mb in step]
            dense = torch.stack(grads).sum(0)
            reference["sum2"] += float(dense.square().sum())
            reference["kept"] += encoder.encode(dense)[0].values.numel()
            for rule, combine in RULES.items():
                result, kept = combine(encoder, grads)
                figures = totals[rule]
                figures["err2"] += float((result - dense).square().sum())
                figures["dot"] += float(result @ dense)
                figures["norm2"] += float(result.square().sum())
                figures["kept"] += kept
    rows = {}
    for rule, figures in totals.items():
        rows[rule] = {
            "relative_l2_error": (figures["err2"] / reference["sum2"]) ** 0.5,
            "cosine": figures["dot"] / (figures["norm2"] * reference["sum2"]) ** 0.5,
            "entries_vs_one_payload": figures["kept"] / reference["kept"],
        }
    return rows


def union(encoder: TopKEncoder, grads: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    payloads = [encoder.encode(g)[0] for g in grads]
    result = torch.zeros_like(grads[0])
    for payload in payloads:
        result = payload.add_to(result)
    kept = torch.cat([p.indices for p in payloads]).unique().numel()
    return result, kept


def reselect(encoder: TopKEncoder, grads: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    payload = encoder.encode(grads[0])[0]
    for grad in grads[1:]:
        payload = encoder.encode(payload.add_to(grad.clone()))[0]
    return payload.decode_into(torch.empty_like(grads[0])), payload.values.numel()


def select_sum(encoder: TopKEncoder, grads: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    payload = encoder.encode(torch.stack(grads).sum(0))[0]
    return payload.decode_into(torch.empty_like(grads[0])), payload.values.numel()


RULES = {"union (v1)": union, "re-select (v2)": reselect, "top-k of the dense sum": select_sum}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=100)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = micro_batch_gradients(args.micro_batches, args.steps, args.seed)
    rows = compare(steps, args.ratio)
    print(
        f"TinyGPT small, {args.micro_batches} micro-batches of {BATCH_SIZE}, ratio "
        f"{args.ratio:g}, {args.steps} steps, seed {args.seed}; tensors >= min_compress_numel\n"
    )
    print("| rule | relative L2 error | cosine to the dense sum | entries kept vs one payload |")
    print("|---|---:|---:|---:|")
    for rule, row in rows.items():
        print(
            f"| {rule} | {row['relative_l2_error']:.4f} | {row['cosine']:.4f} | "
            f"{row['entries_vs_one_payload']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
