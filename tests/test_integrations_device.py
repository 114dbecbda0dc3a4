"""``device=`` (a model on the host, set up on the device by the cache) through the Lightning
callback and the Hugging Face wrapper, on the CPU: the keyword reaches the cache, the
framework does not move the model itself, and what cannot honour it is refused by name.
The runs on an accelerator are tests/emulated/test_integrations_on_device.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from integration_runs import fit, gpt2, hf_trainer, same_weights  # noqa: E402
from lightning.pytorch.accelerators import CPUAccelerator  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy  # noqa: E402

import gradient_cache  # noqa: E402
from gradient_cache.integrations import transformers as hf  # noqa: E402
from gradient_cache.integrations.lightning import GradientCacheCallback  # noqa: E402

# Lightning 2.6 on torch 2.13 warns about its own use of a deprecated pytree class.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`")
HOST = dict(
    compression_ratio=1,
    bucket_size_mb=0.004,
    offload_optimizer_state=True,
    offload_parameters=True,
)
NO_OFFLOAD = "acts only with offload_parameters=True"  # the engine's refusal, reused
SAMPLES = 48  # a Lightning fit's: three steps of two batches


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is the fastest (two threads on a busy two-core
    machine spun 40x slower), and the runs compared bit for bit share it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Stack(L.LightningModule):
    """Six 32x32 blocks (the cache's weight blocks) between two projections."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), *(nn.Linear(32, 32) for _ in range(6)))
        self.head = nn.Linear(32, 4)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.head(self.net(inputs)), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class CountingStrategy(SingleDeviceStrategy):
    """Lightning's one-device strategy, counting its moves of the whole model."""

    moves = 0

    def model_to_device(self) -> None:
        self.moves += 1
        super().model_to_device()


class CacheDevice(L.Callback):
    """Records the cache's configured device after each step."""

    def __init__(self, callback: GradientCacheCallback) -> None:
        self.callback = callback
        self.seen: list[torch.device | None] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        manager = self.callback._manager
        self.seen.append(None if manager is None else manager.config.device)


def test_lightning_device_reaches_the_cache_and_the_strategy_leaves_the_model_alone() -> None:
    """The strategy's move of the whole model is skipped for that fit only (given back
    afterwards), the cache gets the trainer's device, and the run is plain Lightning's."""
    plain, cached = Stack(), Stack()
    fit(plain, [], SAMPLES, accelerator="cpu", devices=1)
    callback = GradientCacheCallback(**HOST, device="cpu")
    probe = CacheDevice(callback)
    strategy = CountingStrategy(device=torch.device("cpu"), accelerator=CPUAccelerator())
    fit(cached, [callback, probe], SAMPLES, strategy=strategy)
    assert strategy.moves == 0
    assert "model_to_device" not in vars(strategy)  # the strategy's own method again
    assert probe.seen == [torch.device("cpu")] * 6
    assert same_weights(plain, cached) and not same_weights(plain, Stack())

    again = CountingStrategy(device=torch.device("cpu"), accelerator=CPUAccelerator())
    fit(Stack(), [GradientCacheCallback(**HOST)], SAMPLES, strategy=again)
    assert again.moves == 1  # without device= Lightning places the model as usual


def test_lightning_refuses_a_device_the_trainer_does_not_run_on() -> None:
    model = Stack()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = CountingStrategy(device=torch.device("cpu"), accelerator=CPUAccelerator())
    callback = GradientCacheCallback(**HOST, device="cuda:1")
    with pytest.raises(
        ValueError, match=r"device='cuda:1'.*runs on cpu.*accelerator='cuda', devices=\[1\]"
    ):
        fit(model, [callback], SAMPLES, strategy=strategy)
    assert "model_to_device" not in vars(strategy)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_lightning_refuses_device_under_model_parallel_strategy() -> None:
    """ModelParallelStrategy puts the shards on each rank's device itself: refused in setup,
    before configure_model (checked without starting processes)."""
    callback = GradientCacheCallback(**HOST, device="cuda")
    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    with pytest.raises(ValueError, match=r"device='cuda'.*strategy ModelParallelStrategy"):
        callback.setup(trainer, Stack(), "fit")  # type: ignore[arg-type]


def test_device_without_offload_parameters_is_the_engines_refusal(tmp_path) -> None:
    with pytest.raises(ValueError, match=NO_OFFLOAD):
        GradientCacheCallback(compression_ratio=1, device="cpu")
    trainer = trainer_for(tiny_gpt2(), tmp_path)
    with pytest.raises(ValueError, match=NO_OFFLOAD):
        hf.train(trainer, compression_ratio=1, device="cpu")
    assert trainer.state.global_step == 0


VOCAB = 64


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    return gpt2(layers=2, width=32, vocab=VOCAB)


def trainer_for(model: nn.Module, folder, **arguments) -> transformers.Trainer:
    ids = torch.randint(VOCAB, (16, 16), generator=torch.Generator().manual_seed(0))
    arguments = dict(max_steps=2, per_device_train_batch_size=4, use_cpu=True, **arguments)
    return hf_trainer(model, folder, ids, **arguments)


class Placement(transformers.TrainerCallback):
    """Records, at each step, accelerate's device_placement and the cache's device."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer
        self.seen: list[tuple[bool, torch.device | None]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        manager = gradient_cache.manager_of(model)
        self.seen.append((self.trainer.accelerator.device_placement, manager.config.device))


def test_trainer_device_reaches_the_cache_and_accelerate_leaves_the_model_alone(tmp_path) -> None:
    """While train runs, accelerate's prepare does not place the model (device_placement
    off; on again afterwards), and the cache gets the trainer's device. (Bit for bit with
    plain Trainer: tests/emulated/test_integrations_on_device.py.)"""
    cached = tiny_gpt2()
    trainer = trainer_for(cached, tmp_path)
    probe = Placement(trainer)
    trainer.add_callback(probe)
    hf.train(trainer, **HOST, device="cpu")
    assert probe.seen == [(False, torch.device("cpu"))] * 2
    assert trainer.accelerator.device_placement is True
    assert not same_weights(cached, tiny_gpt2())  # it trained


def test_trainer_refuses_a_device_it_does_not_run_on(tmp_path) -> None:
    model = tiny_gpt2()
    trainer = trainer_for(model, tmp_path)
    with pytest.raises(
        ValueError, match=r"device='cuda'.*this Trainer runs on cpu \(TrainingArguments.device"
    ):
        hf.train(trainer, **HOST, device="cuda")
    assert trainer.state.global_step == 0
    assert trainer.accelerator.device_placement is True
