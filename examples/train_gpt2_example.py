"""The seed's example: a GPT-2 training step decorated with the seed's own arguments.

    python examples/train_gpt2_example.py [--steps 20]

The model is a small GPT-2 built from a config (nothing is downloaded), trained on the
source code of a few standard-library modules as bytes. The decorator call is the seed's,
word for word: ``compression_ratio=10`` (each gradient in at most a tenth of its bytes: the
ladder's q2 here), ``memory_budget="80%"`` (on a GPU: after the first step, keep on the
device what fits in 80% of its memory; on a CPU there is nothing to budget), 5 dense
warm-up steps, and the summary logged every 5 steps.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import gradient_cache
from gradient_cache.demo.models import byte_corpus, make_batches


@gradient_cache.optimize(
    compression_ratio=10,
    memory_budget="80%",
    warmup_steps=5,
    verbose=True,
    checkpoint_frequency=5,
)
def train(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """A plain loop: forward, backward, clip, step. Returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256)
    model = transformers.GPT2LMHeadModel(config)
    tokens, _ = byte_corpus()
    generator = torch.Generator().manual_seed(0)
    batches = [
        make_batches(tokens, batch_size=8, seq_len=64, generator=generator)[0]
        for _ in range(args.steps)
    ]
    losses = train(model, batches)
    (summary,) = train.last_summaries
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    print(f"stored {summary['stored_gradient_mb']:.2f} MiB of {summary['dense_gradient_mb']:.2f}")
    print(summary["memory_budget"])


if __name__ == "__main__":
    main()
