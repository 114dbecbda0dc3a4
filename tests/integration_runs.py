"""What the ``device=`` integration tests share (tests/test_integrations_device.py on the
CPU, tests/emulated/test_integrations_on_device.py on the emulated device): a Lightning fit
and a Hugging Face ``Trainer`` with nothing but the training on, a small GPT-2, and the
bit-for-bit comparison. Importing it skips without Lightning or transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")


def same_weights(left: nn.Module, right: nn.Module) -> bool:
    pairs = zip(left.parameters(), right.parameters(), strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def fit(
    model: L.LightningModule, callbacks: list[L.Callback], samples: int, **trainer_kwargs: Any
) -> L.Trainer:
    """One epoch of ``samples`` random (16 -> 4) pairs in batches of 8, two batches a step,
    clipped at 0.05; no logger, checkpoint, progress bar or summary."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 16, generator=generator)
    data = TensorDataset(inputs, torch.randn(samples, 4, generator=generator))
    trainer = L.Trainer(
        callbacks=callbacks,
        max_epochs=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(data, 8))
    return trainer


def gpt2(*, layers: int, width: int, vocab: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=2, vocab_size=vocab, n_positions=16
    )
    return transformers.GPT2LMHeadModel(config)


def hf_trainer(
    model: nn.Module,
    folder: Any,
    ids: torch.Tensor,
    *,
    arguments: type = transformers.TrainingArguments,
    **extra: Any,
) -> transformers.Trainer:
    """A ``Trainer`` of ``model`` on the rows of ``ids`` (each its own label), two batches a
    step, with no report, save or progress bar; ``extra`` more ``arguments``."""
    args = arguments(
        output_dir=str(folder),
        gradient_accumulation_steps=2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    return transformers.Trainer(model=model, args=args, train_dataset=dataset)
