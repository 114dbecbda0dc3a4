"""A Hugging Face ``Trainer`` run's device peak at the optimizer step, with and without the cache.

    python -m perf.trainer_memory                 # GPT-2, 8 layers, 256 wide, vocab 4096, 6 steps

The ``Trainer`` runs with its defaults (AdamW, ``max_grad_norm=1.0``) on the CPU; the peak
of each optimizer step (from ``on_pre_optimizer_step``, after the clip, to
``on_optimizer_step``) is counted by gradient_cache.demo.accounting.TensorMemoryTracker
(method and limits: perf/README.md), the largest over the run. Variants: plain
``trainer.train()``; `gradient_cache.integrations.transformers.train` at ratio 1 (the fused
step); the same with ``offload_optimizer_state=True``; and with ``fused_step=False`` (every
gradient restored before the clip). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import transformers

import gradient_cache
from gradient_cache.demo.accounting import MIB, TensorMemoryTracker
from gradient_cache.integrations import transformers as hf

#: name -> the cache's options (None: plain Trainer).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain Trainer": None,
    "cache, fused step": {},
    "cache, fused step, state on host": {"offload_optimizer_state": True},
    "cache, fused_step=False": {"fused_step": False},
}


class StepPeak(transformers.TrainerCallback):
    """The largest device peak over the trainer's optimizer steps."""

    def __init__(self, meter: TensorMemoryTracker) -> None:
        self.meter = meter
        self.peak = 0
        self.host = 0  # the most host-store bytes as a step began (all gradients cached)
        self._phase: Any = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.host = max(self.host, self.meter.reading().host_bytes)
        self._phase = self.meter.phase("step")
        self._phase.__enter__()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phase.__exit__(None, None, None)
        self.peak = max(self.peak, self.meter.peaks["step"].peak.device_bytes)


def step_peak(
    model: torch.nn.Module,
    make_trainer: Callable[[torch.nn.Module, str], transformers.Trainer],
    options: dict[str, Any] | None,
) -> tuple[int, int]:
    """The run's largest device peak at an optimizer step, and the most host-store bytes as
    a step began: plain ``trainer.train()`` where ``options`` is None, else ``hf.train``
    at ratio 1."""
    with tempfile.TemporaryDirectory() as folder:
        trainer = make_trainer(model, folder)

        def host() -> tuple[torch.Tensor, ...]:
            try:
                return gradient_cache.manager_of(model).cache_tensors().host
            except RuntimeError:  # no decorated call running: no cache
                return ()

        meter = TensorMemoryTracker(params=list(model.parameters()), host=host)
        peak = StepPeak(meter)
        trainer.add_callback(peak)
        with meter:
            if options is None:
                trainer.train()
            else:
                hf.train(trainer, compression_ratio=1, **options)
    return peak.peak, peak.host


def gpt2(layers: int, width: int, vocab: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=64
    )
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    ids = torch.randint(
        args.vocab, (8 * args.steps, 64), generator=torch.Generator().manual_seed(0)
    )
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    def make_trainer(model: torch.nn.Module, folder: str) -> transformers.Trainer:
        training = transformers.TrainingArguments(
            output_dir=folder,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        )
        return transformers.Trainer(model=model, args=training, train_dataset=dataset)

    sample = gpt2(args.layers, args.width, args.vocab)
    gradients = sum(p.numel() * p.element_size() for p in sample.parameters())
    print(
        f"GPT-2 {args.layers} layers, {args.width} wide, vocab {args.vocab}: "
        f"{sum(p.numel() for p in sample.parameters()) / 1e6:.2f} M parameters, gradients "
        f"{gradients / MIB:.1f} MiB, AdamW state {2 * gradients / MIB:.1f} MiB; "
        f"{args.steps} steps, batch 8 x 64 tokens, max_grad_norm 1.0, default bucket size\n"
    )
    print(
        "| run | step peak (MiB) | below plain (MiB) | of the gradients' bytes | host held (MiB) |"
    )
    print("|---|---:|---:|---:|---:|")
    plain = None
    for name, options in VARIANTS.items():
        model = gpt2(args.layers, args.width, args.vocab)
        peak, host = step_peak(model, make_trainer, options)
        plain = peak if plain is None else plain
        print(
            f"| {name} | {peak / MIB:.1f} | {(plain - peak) / MIB:.1f} | "
            f"{(plain - peak) / gradients:.2f} | {host / MIB:.1f} |"
        )


if __name__ == "__main__":
    main()
