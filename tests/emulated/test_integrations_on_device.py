"""``device=`` through the Lightning callback and the Hugging Face wrapper on the emulated
device, capped below the model's fp32 weights: a model built on the host trains with only
its weights' window on the device, bit for bit with plain Lightning / plain ``Trainer`` on
the CPU. Neither framework moves the model whole to the device (plain placement cannot: the
cap refuses it), and the batches go there.

Lightning knows cpu, cuda, mps and xla by name; another device runs through an
``Accelerator`` given to ``SingleDeviceStrategy``. transformers takes a device it does not
know from ``ACCELERATE_TORCH_DEVICE`` (TrainingArguments.device), and accelerate finds the
emulated device through ``torch.accelerator``."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from integration_runs import fit, gpt2, hf_trainer, same_weights  # noqa: E402
from lightning.pytorch.accelerators import Accelerator  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

import gradient_cache  # noqa: E402
from gradient_cache.integrations import transformers as hf  # noqa: E402
from gradient_cache.integrations.lightning import GradientCacheCallback  # noqa: E402
from gradient_cache.testing import emulated_device  # noqa: E402

# Lightning 2.6 on torch 2.13 warns about its own use of a deprecated pytree class.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`")
HOST = dict(
    compression_ratio=1,
    bucket_size_mb=0.03,
    offload_optimizer_state=True,
    offload_parameters=True,
)

# At the end the cache puts the weights and AdamW's state back on the device, where they
# do not fit under the cap: they stay on the host, with these warnings.
DID_NOT_FIT = "did not fit on the device"
SAMPLES = 32  # a Lightning fit's: two steps of two batches


class _SetThreads(torch.autograd.Function):
    """The identity, whose backward sets the intra-op threads of the thread running it and
    keeps the count it replaced in ``previous``."""

    previous = 0

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, threads: int) -> torch.Tensor:
        ctx.threads = threads
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _SetThreads.previous = torch.get_num_threads()
        torch.set_num_threads(ctx.threads)
        return grad, None


def set_backward_threads(device: torch.device, threads: int) -> int:
    """Set the intra-op threads of autograd's worker thread for ``device``; returns the
    count it had. A backward through the device's tensors runs there, not on the calling
    thread, and OpenMP's count is per thread: that thread takes the process's count when
    autograd starts it (in an earlier test, maybe), and ``torch.set_num_threads`` on the
    main thread never reaches it after."""
    leaf = torch.zeros(1, device=device, requires_grad=True)
    _SetThreads.apply(leaf, threads).sum().backward()
    return _SetThreads.previous


@pytest.fixture(autouse=True)
def one_thread(installed: torch.device) -> Iterator[None]:
    """Tiny matrices: one intra-op thread is the fastest (two threads on a busy two-core
    machine spun 40x slower), and the runs compared bit for bit share it: the plain run's
    backward on the main thread, the cached run's on autograd's thread for the device. Its
    count decides bits (LayerNorm's backward sums the weight and bias gradients in one
    partial sum per thread), and that thread may have started under another count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device_threads = set_backward_threads(installed, 1)
    yield
    set_backward_threads(installed, device_threads)
    torch.set_num_threads(threads)


def weight_bytes(model: nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters())


def held_on_device() -> int:
    """What the device holds before a test's run: what earlier tests (other files too, in
    the same process) keep alive there, once their garbage is collected (a model and its
    cache in a reference cycle stay on the device until the collector runs). The cap and
    the checks are relative to it: the test's share of the device comes on top."""
    gc.collect()
    return torch.accelerator.memory_allocated()


# --- Lightning --------------------------------------------------------------------------


class EmulatedAccelerator(Accelerator):
    """Lightning's accelerator for the emulated device (one device)."""

    def setup_device(self, device: torch.device) -> None:
        pass

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return 1

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("emu", 0)]

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def name() -> str:
        return "emu"


class Stack(L.LightningModule):
    """Twelve 128x128 blocks (0.8 MB of fp32 weights): the cache's window is a few."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 128), *(nn.Linear(128, 128) for _ in range(12)))
        self.head = nn.Linear(128, 4)
        self.seen: set[tuple[str, ...]] = set()  # (batch, LightningModule.device)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        self.seen.add((str(inputs.device), str(self.device)))
        return nn.functional.mse_loss(self.head(self.net(inputs)), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Probe(L.Callback):
    """Where the model is when fitting starts, before the cache (listed after) takes it;
    then the device the cache was given, at each step."""

    def __init__(self, callback: GradientCacheCallback) -> None:
        self.callback = callback
        self.devices: set[str] = set()
        self.allocated = -1
        self.cache_devices: set[str] = set()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.devices = {str(p.device) for p in pl_module.parameters()}
        self.allocated = torch.accelerator.memory_allocated()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        manager = self.callback._manager
        self.cache_devices.add(str(None if manager is None else manager.config.device))


def test_lightning_trains_a_model_larger_than_the_device_from_the_host(device) -> None:
    plain = Stack()
    fit(plain, [], SAMPLES, accelerator="cpu", devices=1)
    base = held_on_device()
    share = weight_bytes(plain) * 9 // 10  # the cache's peak: three quarters of it
    cap = base + share
    emulated_device(capacity_bytes=cap)
    with pytest.raises(torch.OutOfMemoryError):
        Stack().to(device)  # what the strategy's placement would do
    torch.accelerator.reset_peak_memory_stats()
    cached = Stack()
    strategy = SingleDeviceStrategy(device=device, accelerator=EmulatedAccelerator())
    callback = GradientCacheCallback(**HOST, device="emu")  # no index: the trainer's
    probe = Probe(callback)
    with pytest.warns(UserWarning, match=DID_NOT_FIT):
        fit(cached, [probe, callback], SAMPLES, strategy=strategy)
    assert probe.devices == {"cpu"} and probe.allocated - base < share // 8  # not placed
    assert probe.cache_devices == {"emu:0"}
    assert cached.seen == {("emu:0", "emu:0")}  # the batches, and self.device
    assert torch.accelerator.max_memory_allocated() - base <= share  # never over the cap
    assert same_weights(plain, cached) and not same_weights(plain, Stack())
    assert "model_to_device" not in vars(strategy)


# --- Hugging Face Trainer ---------------------------------------------------------------

VOCAB = 128


def small_gpt2() -> transformers.GPT2LMHeadModel:
    """Eight 128-wide blocks (6.4 MB of fp32 weights), few tokens: weights over activations."""
    return gpt2(layers=8, width=128, vocab=VOCAB)


class HostArguments(transformers.TrainingArguments):
    """TrainingArguments that leave the model on the host in ``Trainer.__init__``."""

    @property
    def place_model_on_device(self) -> bool:
        return False


def trainer_for(model: nn.Module, folder, arguments=transformers.TrainingArguments, **extra):
    generator = torch.Generator().manual_seed(0)
    ids = (torch.randint(VOCAB, (8, 1), generator=generator) + torch.arange(16)) % VOCAB
    extra = dict(max_steps=3, per_device_train_batch_size=1, logging_steps=1, **extra)
    return hf_trainer(model, folder, ids, arguments=arguments, **extra)


class TrainerProbe(transformers.TrainerCallback):
    """Where the model is once accelerate has prepared it, before the first forward; then
    the device the cache was given, at each step."""

    def __init__(self) -> None:
        self.devices: set[str] = set()
        self.allocated = -1
        self.cache_devices: set[str] = set()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.devices = {str(p.device) for p in model.parameters()}
        self.allocated = torch.accelerator.memory_allocated()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.cache_devices.add(str(gradient_cache.manager_of(model).config.device))


def grad_norms(trainer: transformers.Trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def test_trainer_trains_a_model_larger_than_the_device_from_the_host(
    device, tmp_path, monkeypatch
) -> None:
    plain = small_gpt2()
    plain_trainer = trainer_for(plain, tmp_path / "plain", use_cpu=True)
    plain_trainer.train()
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "emu:0")
    base = held_on_device()
    share = weight_bytes(plain) * 17 // 20  # the cache's peak: about 70% of it
    cap = base + share
    emulated_device(capacity_bytes=cap)
    with pytest.raises(torch.OutOfMemoryError):
        small_gpt2().to(device)  # what the Trainer's placement, or accelerate's, would do
    cached = small_gpt2()
    trainer = trainer_for(cached, tmp_path / "cached", HostArguments)
    assert trainer.args.device == device
    probe = TrainerProbe()
    trainer.add_callback(probe)
    inputs: set[str] = set()
    cached.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.add(str(kwargs["input_ids"].device)),
        with_kwargs=True,
    )
    torch.accelerator.reset_peak_memory_stats()
    with pytest.warns(UserWarning, match=DID_NOT_FIT):
        hf.train(trainer, **HOST, device="emu")
    assert probe.devices == {"cpu"} and probe.allocated - base < share // 8  # not placed
    assert probe.cache_devices == {"emu:0"} and inputs == {"emu:0"}
    assert torch.accelerator.max_memory_allocated() - base <= share  # never over the cap
    assert same_weights(plain, cached) and not same_weights(plain, small_gpt2())
    assert grad_norms(trainer) == grad_norms(plain_trainer) and len(grad_norms(trainer)) == 3
    assert trainer.accelerator.device_placement is True


def test_trainer_refuses_what_would_move_the_whole_model(device, tmp_path, monkeypatch) -> None:
    """A Trainer built with the default arguments moved the model in its __init__; with
    fp16_full_eval it would move it when training starts, and eval_on_start would evaluate
    the model still on the host: each refused before any step."""
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "emu:0")
    moved = trainer_for(small_gpt2(), tmp_path / "moved")
    assert next(moved.model.parameters()).device == device
    with pytest.raises(ValueError, match=r"already moved the whole model.*place_model_on_device"):
        hf.train(moved, **HOST, device="emu")
    model = small_gpt2()
    full_eval = trainer_for(model, tmp_path / "full", HostArguments, fp16_full_eval=True)
    with pytest.raises(ValueError, match=r"TrainingArguments\(fp16_full_eval=True\)"):
        hf.train(full_eval, **HOST, device="emu")
    # An evaluation before the first step would run on the model still on the host.
    early = trainer_for(small_gpt2(), tmp_path / "early", HostArguments, eval_on_start=True)
    with pytest.raises(ValueError, match=r"TrainingArguments\(eval_on_start=True\)"):
        hf.train(early, **HOST, device="emu")
    assert moved.state.global_step == full_eval.state.global_step == 0
    assert {str(p.device) for p in model.parameters()} == {"cpu"}


def test_generate_with_the_weights_on_the_host_gives_plains_tokens(device) -> None:
    """At rest the parameters are host tensors, so Hugging Face's ``model.device`` is the
    host and generate() made its position tensors there, which met the device's weights
    (a device mismatch). The model's host inputs go to the device as its forward begins:
    the greedy tokens are plain PyTorch's on the device, with the model set up from the
    host and with it on the device first."""
    tokens = torch.randint(64, (1, 4), generator=torch.Generator().manual_seed(1)).to(device)

    def generated(model: nn.Module) -> list[list[int]]:
        model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers: input_ids not on model.device
            return model.generate(tokens, max_new_tokens=4, do_sample=False).tolist()

    expected = generated(small_gpt2().to(device))
    for on_device in (False, True):
        model = small_gpt2()
        where = {} if on_device else {"device": device}
        if on_device:
            model = model.to(device)
        manager = gradient_cache.create_gradient_cache(
            model,
            compression_ratio=1,
            offload_optimizer_state=True,
            offload_parameters=True,
            **where,
        )
        assert generated(model) == expected
        manager.remove_hooks()
