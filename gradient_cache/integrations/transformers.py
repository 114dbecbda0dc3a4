"""`train`: a Hugging Face ``Trainer`` run with the gradient cache, its figures in the logs.

Where ``Trainer`` touches gradients in one optimizer step (transformers 5):

    per micro-batch:  training_step → accelerator.backward
    last micro-batch: ... → accelerator.clip_grad_norm_ (max_grad_norm, 1.0 by default;
                      unscale_ first under fp16) → on_pre_optimizer_step → optimizer.step

Clipping comes before any callback hook that could restore, so the cache is attached by
`gradient_cache.optimize` around ``trainer.train``: its clipping and unscaling readers put
the gradients back before ``clip_grad_norm_`` reads them (`gradient_readers`), and its
optimizer pre-hook before the step. A callback logs the figures through ``Trainer.log``,
so every reporter the trainer has (TensorBoard, W&B, ...) receives them, and they are in
``trainer.state.log_history``. transformers is imported only by this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import transformers

from .decorator import manager_of, optimize

#: Summary fields logged at each of the trainer's logging steps, as ``gradient_cache/<field>``.
LOGGED_FIELDS = (
    "memory_saved_mb",
    "stored_gradient_mb",
    "overall_compression_ratio",
    "kept_fraction",
    "residual_mb",
    "host_held_mb",
)


def train(
    trainer: transformers.Trainer,
    *,
    compression_ratio: float = 100,
    exclude_layers: Sequence[str] | None = None,
    verbose: bool = False,
    resume_from_checkpoint: str | bool | None = None,
    **options: Any,
) -> transformers.trainer_utils.TrainOutput:
    """``trainer.train(resume_from_checkpoint=...)`` with the trainer's model cached.

    ``compression_ratio``, ``exclude_layers``, ``verbose`` and ``options`` are as for
    `gradient_cache.create_gradient_cache`. Every argument of the ``Trainer`` keeps its
    meaning, ``max_grad_norm`` (clipping) and ``gradient_accumulation_steps`` included;
    at ``compression_ratio=1`` the run ends with plain ``Trainer``'s weights, bit for bit
    on the CPU. At each logging step the ``LOGGED_FIELDS`` of the cache's summary are
    logged as ``gradient_cache/<field>``. Returns what ``trainer.train`` returns.
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}.")
    logger = _SummaryLogger(trainer)
    cached_train = optimize(
        compression_ratio, exclude_layers=exclude_layers, verbose=verbose, **options
    )(trainer.train)
    trainer.add_callback(logger)
    try:
        return cached_train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        trainer.remove_callback(logger)


class _SummaryLogger(transformers.TrainerCallback):
    """At each logging step, logs the cache's figures through ``Trainer.log``."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer

    def on_step_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> transformers.TrainerControl:
        # DefaultFlowCallback, earlier in the list, has decided whether this step logs.
        if control.should_log and model is not None:
            summary = manager_of(model).get_compression_summary()
            self.trainer.log({f"gradient_cache/{k}": float(summary[k]) for k in LOGGED_FIELDS})
            # Trainer.log clears should_log; the trainer's own log of this step comes next.
            control.should_log = True
        return control
