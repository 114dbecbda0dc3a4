"""Hugging Face Trainer, accelerate and PEFT with the cache, against the same runs without it.

Tiny GPT-2 models are built from a config (nothing is downloaded); every pair of runs starts
from the same seed and sees the same batches. Ratio 1 must end bit for bit as the plain run.
"""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")

import gradient_cache  # noqa: E402
from gradient_cache.integrations import transformers as hf  # noqa: E402

VOCAB = 128


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """64 fixed sequences of 16 token ids counting up from a random start (learnable: each
    token is the last plus one); each is its own language-modelling label."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        starts = torch.randint(VOCAB, (64, 1), generator=generator)
        self.ids = (starts + torch.arange(16)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def trainer_for(model: torch.nn.Module, tmp_path, **arguments) -> transformers.Trainer:
    """A Trainer with its defaults (max_grad_norm=1.0 among them) but for the run's size."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        **{
            "max_steps": 6,
            "per_device_train_batch_size": 4,
            "use_cpu": True,
            "report_to": "none",
            "save_strategy": "no",
            "disable_tqdm": True,
            "logging_steps": 2,
            **arguments,
        },
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens())


def weight_gap(left: torch.nn.Module, right: torch.nn.Module) -> float:
    pairs = zip(left.parameters(), right.parameters(), strict=True)
    return max((a - b).abs().max().item() for a, b in pairs)


@pytest.mark.parametrize(
    "arguments,options",
    [
        ({}, {}),
        ({"gradient_accumulation_steps": 2}, {}),
        ({"bf16": True}, {}),
        ({"gradient_accumulation_steps": 2}, {"offload_optimizer_state": True}),
        (
            {"gradient_accumulation_steps": 2},
            {"offload_optimizer_state": True, "offload_parameters": True},
        ),
    ],
    ids=["defaults", "accumulation", "bf16-autocast", "state-on-host", "weights-on-host"],
)
def test_trainer_at_ratio_1_ends_bit_for_bit_as_plain_trainer(tmp_path, arguments, options) -> None:
    """Also the gradient norms the trainer logs: clip_grad_norm_ answered from the cache."""
    plain = tiny_gpt2()
    plain_trainer = trainer_for(plain, tmp_path / "plain", **arguments)
    plain_trainer.train()
    cached = tiny_gpt2()
    cached_trainer = trainer_for(cached, tmp_path / "cached", **arguments)
    hf.train(cached_trainer, compression_ratio=1, bucket_size_mb=0.004, **options)
    assert plain_trainer.args.max_grad_norm == 1.0  # the default clipping is on
    assert weight_gap(plain, cached) == 0.0
    assert grad_norms(cached_trainer) == grad_norms(plain_trainer)
    assert len(grad_norms(plain_trainer)) == 3 and max(grad_norms(plain_trainer)) > 1.0  # clipped


def test_fp16_with_the_state_offloaded_is_refused_before_any_step(tmp_path) -> None:
    """fp16's GradScaler unscales every gradient at once: refused when the cache is set up,
    as Lightning's "16-mixed" is (it failed at the first step, after forward and backward);
    without the state offload fp16 is taken."""
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True)
    with pytest.raises(ValueError, match=r"fp16=True\).*Use bf16=True.*or drop offload"):
        hf.check_precision(arguments, offload_optimizer_state=True)
    hf.check_precision(arguments, offload_optimizer_state=False)
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_for(model, tmp_path / "run", fp16=True)
    with pytest.raises(ValueError, match="cannot run with TrainingArguments"):
        hf.train(trainer, compression_ratio=1, offload_optimizer_state=True)
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_with_the_weights_on_the_host_is_refused_before_any_step(
    tmp_path, precision: str
) -> None:
    """accelerate's autocast keeps a cast copy of every weight until the forward ends: with
    the weights on the host it is refused when train() begins (the first forward refused
    it before, naming a fix a Trainer user cannot take), naming compute_dtype."""
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_for(model, tmp_path, **{precision: True})
    with pytest.raises(ValueError, match=rf"\({precision}=True\).*compute_dtype=torch.bfloat16"):
        hf.train(
            trainer, compression_ratio=1, offload_parameters=True, offload_optimizer_state=True
        )
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_autocast_without_its_weight_cache_is_taken_with_the_weights_on_the_host(
    tmp_path,
) -> None:
    """Where the accelerator's AutocastKwargs turn autocast's weight cache off, bf16=True
    is taken with the weights on the host, bit for bit with the plain Trainer under the
    same autocast."""
    runs = []
    for name, options in (("plain", None), ("cached", {"offload_parameters": True})):
        model = tiny_gpt2()
        trainer = trainer_for(model, tmp_path / name, bf16=True, gradient_accumulation_steps=2)
        trainer.accelerator.autocast_handler = accelerate.utils.AutocastKwargs(cache_enabled=False)
        if options is None:
            trainer.train()
        else:
            hf.train(trainer, compression_ratio=1, offload_optimizer_state=True, **options)
        runs.append((model, grad_norms(trainer)))
    (plain, plain_norms), (cached, cached_norms) = runs
    assert weight_gap(plain, cached) == 0.0 and cached_norms == plain_norms


def fsdp2_mixed_precision_trainer(rank: int, out: str, folder: str, threads: int) -> None:
    """``compute_dtype``'s reference: the plain Trainer over the model under FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on each block and
    the root, on one process (a gloo group, an in-memory store); its weights, whole, and
    its logged gradient norms to ``out``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = tiny_gpt2()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    trainer = trainer_for(model, folder, gradient_accumulation_steps=2)
    trainer.train()
    weights = [p.full_tensor() for p in model.parameters()]
    torch.save({"weights": weights, "norms": grad_norms(trainer)}, out)
    dist.destroy_process_group()


def test_compute_dtype_through_train_is_fsdp2_mixed_precision_bit_for_bit(tmp_path) -> None:
    """The fix the refusal above names: bf16 compute from the fp32 masters on the host,
    through train(), ends on the weights and logs the gradient norms of the plain Trainer
    over the model under FSDP2's mixed precision (accumulation, clipping)."""
    out = str(tmp_path / "fsdp2.pt")
    threads = torch.get_num_threads()
    torch.multiprocessing.spawn(
        fsdp2_mixed_precision_trainer, args=(out, str(tmp_path / "plain"), threads)
    )
    reference = torch.load(out, weights_only=True)
    cached = tiny_gpt2()
    trainer = trainer_for(cached, tmp_path / "cached", gradient_accumulation_steps=2)
    hf.train(
        trainer,
        compression_ratio=1,
        offload_parameters=True,
        offload_optimizer_state=True,
        compute_dtype=torch.bfloat16,
    )
    assert grad_norms(trainer) == reference["norms"] and max(reference["norms"]) > 1.0
    for expected, param in zip(reference["weights"], cached.parameters(), strict=True):
        assert param.dtype == torch.float32 and torch.equal(expected, param)


def grad_norms(trainer: transformers.Trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def test_the_trainers_step_peak_falls_by_the_offloaded_bytes(tmp_path) -> None:
    """At the optimizer step the device holds a few buckets of gradients (and of AdamW's
    state, with it on the host) instead of all of them: the accounted peak falls by most of
    the gradients' bytes P (of P), and by most of 3P with the state (of 3P)."""
    from perf.trainer_memory import step_peak

    def peak(options: dict | None) -> int:
        device, _ = step_peak(
            tiny_gpt2(), lambda model, folder: trainer_for(model, folder), options
        )
        return device

    plain = peak(None)
    gradients = sum(p.numel() * p.element_size() for p in tiny_gpt2().parameters())
    fused = peak({"bucket_size_mb": 0.004})
    state = peak({"bucket_size_mb": 0.004, "offload_optimizer_state": True})
    restored = peak({"fused_step": False})
    assert (plain - fused) / gradients > 0.6
    assert (plain - state) / gradients > 2.0
    assert abs(plain - restored) < 0.05 * gradients  # the restore path: plain's peak


def test_trainer_logs_the_cache_summary_through_its_logging(tmp_path) -> None:
    trainer = trainer_for(tiny_gpt2(), tmp_path)
    hf.train(trainer, compression_ratio=100, codec="topk", min_compress_numel=1024)
    logged = [
        entry for entry in trainer.state.log_history if "gradient_cache/kept_fraction" in entry
    ]
    assert [entry["step"] for entry in logged] == [2, 4, 6]  # every logging step
    assert all(
        set(entry) >= {f"gradient_cache/{k}" for k in hf.TRAINER_LOGGED_FIELDS} for entry in logged
    )
    assert 0.005 < logged[-1]["gradient_cache/kept_fraction"] < 0.02
    assert not any(isinstance(c, hf._CacheCallback) for c in trainer.callback_handler.callbacks)


def test_trainer_at_ratio_100_trains(tmp_path) -> None:
    trainer = trainer_for(tiny_gpt2(), tmp_path, max_steps=40, learning_rate=1e-2)
    hf.train(trainer, compression_ratio=100, codec="topk", min_compress_numel=1024)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # It learns, more slowly than plain Trainer; what compression costs in accuracy is
    # measured at length in perf/RESULTS.md, not here.
    assert sum(losses[-3:]) < 0.95 * sum(losses[:3])


def test_a_run_resumed_from_a_trainer_checkpoint_ends_as_the_uninterrupted_one(tmp_path):
    """Ratio 100 with error feedback: the residuals travel in the checkpoint folder. With
    the state offloaded: the Trainer loads the optimizer's state onto the device before
    on_train_begin, where the cache's callback sends it to the host, so every resumed step
    starts with each state tensor a host copy."""
    options = dict(
        compression_ratio=100, codec="topk", min_compress_numel=1024, offload_optimizer_state=True
    )
    steps = dict(max_steps=8, save_strategy="steps", save_steps=4, learning_rate=1e-2)
    uninterrupted = tiny_gpt2()
    hf.train(trainer_for(uninterrupted, tmp_path / "a", **steps), **options)
    saved = torch.load(tmp_path / "a" / "checkpoint-4" / hf.STATE_FILE, weights_only=True)
    assert saved["residuals"] and saved["steps"] == 4
    # A run stopped after step 4: its output_dir holds checkpoint-4 only.
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    resumed = tiny_gpt2()
    trainer = trainer_for(resumed, tmp_path / "b", **steps)
    spy = StateOnTheHost()
    trainer.add_callback(spy)
    hf.train(trainer, resume_from_checkpoint=True, **options)  # the last checkpoint
    assert spy.seen == [True] * 4
    assert trainer.state.global_step == 8
    assert weight_gap(uninterrupted, resumed) == 0.0


def test_resuming_from_a_checkpoint_saved_without_the_cache_warns(tmp_path) -> None:
    steps = dict(max_steps=2, save_strategy="steps", save_steps=1)
    trainer_for(tiny_gpt2(), tmp_path, **steps).train()
    with pytest.warns(UserWarning, match="holds no gradient-cache state"):
        hf.train(
            trainer_for(tiny_gpt2(), tmp_path / "b", **steps),
            resume_from_checkpoint=str(tmp_path / "checkpoint-1"),
            compression_ratio=1,
        )


def test_the_clipping_readers_are_the_originals_again_after_training(tmp_path) -> None:
    originals = (torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.unscale_)
    hf.train(trainer_for(tiny_gpt2(), tmp_path, max_steps=1), compression_ratio=1)
    assert (torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.unscale_) == originals


def test_accelerate_loop_with_clipping_and_accumulation_matches_plain() -> None:
    """accelerator.backward, accelerator.clip_grad_norm_ and accelerator.accumulate."""

    def run(model: torch.nn.Module) -> list[float]:
        torch.manual_seed(0)  # the same dropout draws in both runs
        # accelerate keeps its state process-wide: earlier Trainer runs (bf16) leave theirs.
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate.state.GradientState._reset_state()
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        norms = []
        for batch in list(torch.utils.data.DataLoader(Tokens(), batch_size=4))[:8]:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
                optimizer.step()
                optimizer.zero_grad()
        return norms

    plain, cached = tiny_gpt2(), tiny_gpt2()
    plain_norms = run(plain)
    cached_norms = gradient_cache.optimize(compression_ratio=1)(run)(cached)
    assert len(plain_norms) == 4 and min(plain_norms) > 0.5  # clipped at every step
    assert cached_norms == plain_norms
    assert weight_gap(plain, cached) == 0.0


def lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def test_peft_lora_caches_only_the_adapters_and_matches_plain(tmp_path) -> None:
    plain = lora(tiny_gpt2())
    trainer_for(plain, tmp_path / "plain", learning_rate=1e-3).train()
    cached = lora(tiny_gpt2())
    hf.train(trainer_for(cached, tmp_path / "cached", learning_rate=1e-3), compression_ratio=1)
    assert weight_gap(plain, cached) == 0.0

    adapters = [n for n, p in cached.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    manager = gradient_cache.create_gradient_cache(cached, exclude_layers=["lora_B"])
    summary = manager.get_compression_summary()
    manager.remove_hooks()
    assert summary["num_offloaded_parameters"] == len([n for n in adapters if "lora_A" in n])
    assert summary["num_excluded_parameters"] == len([n for n in adapters if "lora_B" in n])


class StateOnTheHost(transformers.TrainerCallback):
    """At each step's start, whether every state tensor with a dimension of the trainer's
    optimizer is the cache's host copy."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch one
        engine = gradient_cache.manager_of(model).engine
        host = engine.optimizer_state.copies_of(inner)
        values = [
            value is host.get(param, {}).get(key)
            for param, held in inner.state.items()
            for key, value in held.items()
            if value.dim() > 0
        ]
        self.seen.append(all(values) and bool(values))


def test_save_pretrained_while_the_weights_are_on_the_host_writes_tied_weights_once(
    tmp_path,
) -> None:
    """With offload_parameters the state_dict holds compact copies of the masters; the
    head tied to the embedding stays one tensor, so safetensors writes it once (plain's
    file size) and from_pretrained loads it tied, equal to the trained weights."""
    model = tiny_gpt2()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    manager.step(optimizer)
    model.save_pretrained(tmp_path / "cached")
    tiny_gpt2().save_pretrained(tmp_path / "plain")
    size = (tmp_path / "cached" / "model.safetensors").stat().st_size
    assert size == (tmp_path / "plain" / "model.safetensors").stat().st_size
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "cached")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    for (name, a), b in zip(loaded.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    manager.remove_hooks()


def test_accelerates_grad_scaler_is_handed_to_the_cache(tmp_path, monkeypatch) -> None:
    """Under fp16 accelerate scales with a GradScaler of its own (on a GPU; set by hand
    here): the cache gets it (before, none: a skipped step was counted and its residuals
    kept), and at ratio 1 the run is plain Trainer's, bit for bit."""
    handed = []
    init = gradient_cache.GradientCacheHookManager.__init__

    def spying(self, *args, **kwargs):
        handed.append(kwargs.get("grad_scaler"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(gradient_cache.GradientCacheHookManager, "__init__", spying)
    models = []
    for cached in (False, True):
        trainer = trainer_for(tiny_gpt2(), tmp_path / str(cached))
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        hf.train(trainer, compression_ratio=1) if cached else trainer.train()
        models.append(trainer.model)
    assert handed and all(scaler is trainer.accelerator.scaler for scaler in handed)
    assert weight_gap(*models) == 0
