"""`train`: a Hugging Face ``Trainer`` run with the gradient cache, its figures in the logs.

Where ``Trainer`` touches gradients in one optimizer step (transformers 5):

    per micro-batch:  training_step → accelerator.backward
    last micro-batch: ... → accelerator.clip_grad_norm_ (max_grad_norm, 1.0 by default;
                      unscale_ first under fp16) → on_pre_optimizer_step → optimizer.step

Clipping comes before any callback hook, so the cache is attached by
`gradient_cache.optimize` around ``trainer.train``: ``accelerator.clip_grad_norm_`` is
answered from the cache and ``optimizer.step()`` is the fused step (`routing`); under fp16
the GradScaler's unscale restores every gradient first (`gradient_readers`). A callback
logs the figures through ``Trainer.log``, so every reporter the trainer has (TensorBoard,
W&B, ...) receives them, and they are in ``trainer.state.log_history``; it also saves the
cache's state in every checkpoint folder (``gradient_cache.pt``) and loads it when
training resumes from one. transformers is imported only by this module.

A model on the host, set up on the device by the cache (``device=`` with
``offload_parameters=True``): the ``Trainer`` must be built with the model left on the host
(``place_model_on_device`` False: its ``__init__`` moves the whole model otherwise), and
`train` keeps accelerate's ``prepare`` from moving it when training starts; the ``Trainer``
still puts each batch on ``TrainingArguments.device``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..engine.config import DEFAULT_COMPRESSION_RATIO
from . import SUMMARY_LOGGED_FIELDS, missing_extra
from .decorator import manager_of, optimize

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:
    raise missing_extra(__name__, "transformers", "transformers", error) from error

#: Summary fields logged at each of the trainer's logging steps, as ``gradient_cache/<field>``:
#: every integration's, and the host bytes held.
TRAINER_LOGGED_FIELDS = (*SUMMARY_LOGGED_FIELDS, "host_held_mb")
#: The cache's state in each of the trainer's checkpoint folders.
STATE_FILE = "gradient_cache.pt"


def train(
    trainer: transformers.Trainer,
    *,
    compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
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
    on the CPU. At each logging step the ``TRAINER_LOGGED_FIELDS`` of the cache's summary are
    logged as ``gradient_cache/<field>``. Each checkpoint the trainer saves gets the
    cache's ``state_dict()`` as ``gradient_cache.pt``; with ``resume_from_checkpoint``
    (a folder, or True for the last one in ``output_dir``) it is loaded before the first
    step, so error-feedback residuals carry over. Returns what ``trainer.train`` returns.

    ``device`` (with ``offload_parameters=True``): the model, on the host, is set up on the
    trainer's device (``TrainingArguments.device``; a device without an index takes its
    index) from the host, its weights never whole on the device. Build the ``Trainer`` with
    arguments whose ``place_model_on_device`` is False (subclass your ``TrainingArguments``
    class with that property returning False); while ``trainer.train`` runs, accelerate's
    ``device_placement`` is False so that its ``prepare`` leaves the model where it is (the
    ``Trainer`` puts the batches on the device itself). Refused before any step: a trainer on
    another device, a model the ``Trainer`` already moved to the device, and
    ``fp16_full_eval``/``bf16_full_eval`` (the ``Trainer`` moves the model when training
    starts). With the weights on the host, ``bf16=True`` or ``fp16=True`` is refused too,
    before any step (accelerate's autocast would hold a cast copy of every weight): pass
    ``compute_dtype=torch.bfloat16`` instead.
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}.")
    resume_folder: str | None
    if resume_from_checkpoint is True:
        resume_folder = get_last_checkpoint(trainer.args.output_dir)
    else:
        resume_folder = resume_from_checkpoint or None
    scaler = getattr(trainer.accelerator, "scaler", None)  # fp16: accelerate's GradScaler
    if scaler is not None and "grad_scaler" not in options:
        options = {**options, "grad_scaler": scaler}  # its skipped steps leave no trace
    decorator = optimize(
        compression_ratio, exclude_layers=exclude_layers, verbose=verbose, **options
    )
    config = decorator.settings.config
    autocast = trainer.accelerator.autocast_handler  # accelerate's AutocastKwargs, or None
    check_precision(
        trainer.args,
        offload_optimizer_state=config.offload_optimizer_state,
        offload_parameters=config.offload_parameters,
        autocast_caches_weights=autocast is None or autocast.cache_enabled is not False,
    )
    # EngineConfig has refused device= without offload_parameters=True, naming the fix.
    device = config.device
    if device is not None:
        device = _check_set_up_from_host(trainer, torch.device(device))
        decorator = optimize(
            compression_ratio,
            exclude_layers=exclude_layers,
            verbose=verbose,
            **{**options, "device": device},
        )
    logger = _CacheCallback(trainer, resume_folder)
    cached_train = decorator(trainer.train)
    accelerator = trainer.accelerator
    placement = accelerator.device_placement
    if device is not None:
        # accelerate's prepare(model), when training starts, moves the whole model to its
        # device where device_placement is on; the cache sets it up from the host at its
        # first forward instead. Off, prepare also leaves the batches and the optimizer's
        # state where they are: the Trainer puts each batch on args.device itself
        # (_prepare_inputs), and the cache keeps the state on the host.
        accelerator.device_placement = False
    trainer.add_callback(logger)
    try:
        return cached_train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        accelerator.device_placement = placement
        trainer.remove_callback(logger)


def _check_set_up_from_host(trainer: transformers.Trainer, device: torch.device) -> torch.device:
    """The device the model is set up on from the host (``device=``): the trainer's
    (``TrainingArguments.device``, where it puts the batches). Refuses, before any step, a
    trainer on another device and one that moves or has moved the whole model there."""
    args = trainer.args
    target = args.device
    if target.type != device.type or device.index not in (None, target.index):
        raise ValueError(
            f"device={str(device)!r} sets the model up on {device}, and this Trainer runs on "
            f"{target} (TrainingArguments.device, where it puts the batches). Pass "
            f"device={str(target)!r}, or TrainingArguments that run on {device}."
        )
    if target.type == "cpu":
        return target  # the host is the device: nothing is moved
    params = [] if trainer.model is None else list(trainer.model.parameters())
    moved = [p.device for p in params if p.device.type != "cpu"]
    if moved and trainer.place_model_on_device:
        raise ValueError(
            f"device={str(device)!r} sets the model up on {target} from the host, and this "
            f"Trainer already moved the whole model to {moved[0]} in its __init__ "
            "(Trainer.place_model_on_device is True). Build the Trainer with arguments "
            "that leave the model on the host: a subclass of your TrainingArguments class "
            "whose place_model_on_device property returns False. Or drop device, for a "
            "model that fits the device."
        )
    full_eval = "fp16_full_eval" if args.fp16_full_eval else "bf16_full_eval"
    if args.fp16_full_eval or args.bf16_full_eval:
        raise ValueError(
            f"device={str(device)!r} cannot be combined with TrainingArguments({full_eval}="
            f"True): the Trainer then moves the whole model to {target} when training starts. "
            f"Drop {full_eval}, or device."
        )
    if getattr(args, "eval_on_start", False):
        raise ValueError(
            f"device={str(device)!r} cannot be combined with TrainingArguments(eval_on_start="
            "True): the cache sets the model up on the device at its first training "
            "forward, and that evaluation runs before it, on the model still on the host, "
            "with the batches on the device. Drop eval_on_start (evaluate after the first "
            "step, eval_steps), or device."
        )
    return target


def check_precision(
    args: transformers.TrainingArguments,
    *,
    offload_optimizer_state: bool,
    offload_parameters: bool = False,
    autocast_caches_weights: bool = True,
) -> None:
    """Refuse, before any step, what the first forward or step would refuse later, after
    the Trainer's set-up: ``fp16=True`` with the state offloaded, as the Lightning callback
    refuses ``"16-mixed"`` (the Trainer's GradScaler unscales every gradient at once, which
    would need the whole optimizer state on the device at the step); and ``bf16=True`` or
    ``fp16=True`` with the weights on the host, where accelerate's autocast keeps a cast
    copy of every weight until the forward ends (unless its ``AutocastKwargs`` turn that
    cache off)."""
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    if offload_parameters and precision is not None and autocast_caches_weights:
        raise ValueError(
            f"offload_parameters=True cannot run with TrainingArguments({precision}=True): "
            "the Trainer's autocast keeps a cast copy of every weight it meets until the "
            "forward ends, so the device would hold the whole model's weights. Set "
            f"{precision}=False and pass compute_dtype=torch.bfloat16 to train() instead "
            "(forward and backward in bf16 from the fp32 masters, a block at a time, as "
            "FSDP2's MixedPrecisionPolicy), or drop offload_parameters."
        )
    if offload_optimizer_state and args.fp16:
        raise ValueError(
            "offload_optimizer_state=True cannot run with TrainingArguments(fp16=True): the "
            "Trainer's GradScaler unscales every gradient at once before the step, which "
            "would need the whole optimizer state on the device. Use bf16=True (no "
            "GradScaler), or drop offload_optimizer_state (the gradients are still "
            "offloaded)."
        )


class _CacheCallback(transformers.TrainerCallback):
    """Logs the cache's figures through ``Trainer.log``; saves and loads its state."""

    def __init__(self, trainer: transformers.Trainer, resume_folder: str | None) -> None:
        self.trainer = trainer
        self.resume_folder = resume_folder

    def on_train_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> transformers.TrainerControl:
        if self.resume_folder is None or model is None:
            return control
        if optimizer is not None:
            # The trainer loaded the optimizer's state onto the device before this hook: with
            # offload_optimizer_state=True it goes to host memory before the first step.
            step = manager_of(model).optimizer_step
            if step is not None:
                step.offload_loaded_state([_unwrapped(optimizer)])
        path = os.path.join(self.resume_folder, STATE_FILE)
        if not os.path.exists(path):
            warnings.warn(
                f"{self.resume_folder} holds no gradient-cache state ({STATE_FILE}): it was "
                "saved without the cache. Training resumes with the cache starting afresh "
                "(error-feedback residuals at zero).",
                UserWarning,
                stacklevel=2,
            )
            return control
        manager_of(model).load_state_dict(torch.load(path, weights_only=True))
        return control

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
            self.trainer.log(
                {f"gradient_cache/{k}": float(summary[k]) for k in TRAINER_LOGGED_FIELDS}
            )
            # Trainer.log clears should_log; the trainer's own log of this step comes next.
            control.should_log = True
        return control

    def on_save(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> transformers.TrainerControl:
        # Called after the trainer wrote (and rotated) its checkpoint folders.
        if model is not None and args.should_save:
            assert args.output_dir is not None  # TrainingArguments sets one where None is given
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            torch.save(manager_of(model).state_dict(), os.path.join(folder, STATE_FILE))
        return control


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its ``optimizer``):
    the one whose step the fused step runs, and whose state the cache keys."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer
