"""offload_parameters=True loses nothing and says what it cannot do: writes in forward, loads
and saves through any submodule, copies of the model, every container of blocks, and the
uses it refuses by name. Each against plain PyTorch on the same seed and data."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from helpers import assert_same_parameters
from test_parameters_offload import (
    STREAMED,
    all_on_the_host,
    batches,
    gpt,
    sgd_momentum,
    step,
    train,
)
from torch import nn

import gradient_cache
from gradient_cache.engine.weights.blocks import weight_units
from gradient_cache.engine.weights.masters import WeightAt


class WritingBlock(nn.Module):
    """A block that writes its frozen parameters in forward: a step counter and an EMA
    codebook (as a VQ layer does), under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.count = nn.Parameter(torch.zeros(()), requires_grad=False)
        self.code = nn.Parameter(torch.randn(4, 16), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.count.add_(1)
            self.code.mul_(0.9).add_(0.1 * hidden.detach().mean(0))
        return torch.tanh(self.lin(hidden)) + self.code.sum(0)


class WritingModel(nn.Module):
    """An embedding that renormalizes its rows in forward (``max_norm``), and writing blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16, max_norm=1.0)
        self.blocks = nn.ModuleList(WritingBlock() for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def run_writing(model: nn.Module, manager=None, *, steps: int = 3) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(32, (8,), generator=generator)
        nn.functional.cross_entropy(model(tokens), tokens).backward()
        if manager is None:
            optimizer.step()
        else:
            manager.step(optimizer)
        optimizer.zero_grad()


def writing_model() -> WritingModel:
    torch.manual_seed(0)
    return WritingModel()


def test_writes_into_weights_during_forward_reach_the_masters() -> None:
    """``nn.Embedding(max_norm=)``'s renorm (the rest) and a block's counter and codebook
    (frozen, updated under no_grad) write the weights in use: each write is kept, bit for
    bit with plain PyTorch."""
    plain, cached = writing_model(), writing_model()
    run_writing(plain)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    run_writing(cached, manager)
    assert cached.blocks[0].count.item() == 3.0
    assert_same_parameters(plain, cached)
    assert all_on_the_host(cached, manager)


def test_a_write_in_forward_under_a_compute_dtype_is_refused_naming_the_parameter() -> None:
    cached = writing_model()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, compute_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.count', 'blocks\.0\.code'.*compute dtype"):
        cached(torch.arange(8))
    manager.remove_hooks()


def test_a_dropped_forward_keeps_its_compute_copies_until_the_next_backward() -> None:
    """A validation outside torch.no_grad() under a compute_dtype (docs/options.md): the
    weights it used read as their bf16 copies until a state_dict() sends them home; a write
    into them is refused when the next backward ends, naming torch.no_grad()."""
    data = batches(2)
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, compute_dtype=torch.bfloat16)
    optimizer = sgd_momentum(cached)
    train(cached, optimizer, data[:1], manager=manager)
    masters = {name: p.detach().clone() for name, p in cached.named_parameters()}
    cached(*data[1])  # dropped: no backward
    head = cached.ln_f.weight
    assert head.dtype == torch.bfloat16 and torch.equal(
        head.float(), masters["ln_f.weight"].bfloat16().float()
    )
    assert all(torch.equal(masters[n], v) for n, v in cached.state_dict().items() if n in masters)
    assert head.dtype == torch.float32  # home
    cached(*data[1])  # dropped again
    with torch.no_grad():
        for param in cached.parameters():
            param.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"was dropped.*run it under torch\.no_grad\(\)"):
        cached(*data[0])[1].backward()
    manager.remove_hooks()


def test_a_load_into_a_submodule_after_a_dropped_forward_reaches_training() -> None:
    """A forward with gradients whose output is dropped leaves the rest on the device; a load
    into the head alone (its own load_state_dict) must reach the next use."""
    data = batches(2)

    def run(model, manager=None):
        optimizer = sgd_momentum(model)
        loaded = {k: v + 0.01 for k, v in model.lm_head.state_dict().items()}
        model(*data[0])  # dropped: no backward
        model.lm_head.load_state_dict(loaded)
        train(model, optimizer, data, manager=manager)

    plain, cached = gpt(), gpt()
    run(plain)
    run(cached, gradient_cache.create_gradient_cache(cached, **STREAMED))
    assert_same_parameters(plain, cached)


def test_a_blocks_own_state_dict_holds_compact_copies_and_saves_its_own_bytes() -> None:
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    train(model, sgd_momentum(model), batches(1), manager=manager)
    block = model.blocks[0]
    state = block.state_dict()
    assert all(v.untyped_storage().nbytes() == v.nbytes for v in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    own = sum(v.nbytes for v in state.values())
    assert len(buffer.getvalue()) < own + 16_384  # its bytes and pickle's framing, no slab
    for name, value in block.named_parameters():
        assert torch.equal(state[name], value)
    model(*batches(1)[0])  # dropped: the rest stays on the device until a backward
    weights = manager.engine.weights
    assert weights.where(model.ln_f.weight) is WeightAt.DEVICE
    saved = model.ln_f.state_dict()["weight"]
    assert weights.where(model.ln_f.weight) is WeightAt.HOST  # sent home first
    assert torch.equal(saved, model.ln_f.weight)


def test_a_tied_weight_is_saved_once_and_loads_tied() -> None:
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    state = model.state_dict()
    assert state["lm_head.weight"] is state["tok_emb.weight"]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    plain_buffer = io.BytesIO()
    torch.save(gpt().state_dict(), plain_buffer)
    assert len(buffer.getvalue()) <= len(plain_buffer.getvalue())
    manager.remove_hooks()


@pytest.mark.parametrize("options", [STREAMED, {"compression_ratio": 1}], ids=["weights", "grads"])
@pytest.mark.parametrize("copier", ["deepcopy", "averaged"])
def test_an_ema_copy_of_a_cached_model_computes_as_the_model_and_carries_no_live_hooks(
    options, copier
) -> None:
    data = batches(3)
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **options)
    train(model, sgd_momentum(model), data[:2], manager=manager)
    if copier == "deepcopy":
        ema = copy.deepcopy(model)
    else:
        ema = torch.optim.swa_utils.AveragedModel(model)
        ema.update_parameters(model)
    with torch.no_grad():
        expected = model(*data[2])[1]
        assert torch.equal(ema(*data[2])[1], expected)
    moved = manager.summary().parameters_moved_mb if options is STREAMED else None
    ema(*data[2])[1].backward()  # the copy trains on its own: the cache sees none of it
    assert all(p.grad is not None for p in ema.parameters() if p.requires_grad)
    if moved is not None:
        assert manager.summary().parameters_moved_mb == moved
    manager.remove_hooks()
    with torch.no_grad():
        assert torch.equal(ema(*data[2])[1], expected)


def test_torch_save_of_the_model_works_or_names_what_to_save() -> None:
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    tokens, targets = batches(1)[0]
    assert torch.equal(loaded(tokens, targets)[1], model(tokens, targets)[1])

    streamed = gpt()
    streaming = gradient_cache.create_gradient_cache(streamed, **STREAMED)
    with pytest.raises(TypeError, match=r"model\.state_dict\(\)"):
        torch.save(streamed, io.BytesIO())
    manager.remove_hooks()
    streaming.remove_hooks()


def test_a_gradient_penalty_is_refused_naming_create_graph() -> None:
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    tokens, targets = batches(1)[0]
    _, loss = model(tokens, targets)
    blocks = [p for p in model.blocks.parameters()]
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss, blocks, create_graph=True)
    manager.remove_hooks()


def test_autocast_is_refused_naming_compute_dtype_and_runs_without_its_weight_cache() -> None:
    data = batches(2)
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError) as refusal:
        model(*data[0])
    assert "compute_dtype" in str(refusal.value)
    assert "cache_enabled=False" in str(refusal.value)
    manager.remove_hooks()

    def run(model, manager=None):
        optimizer = sgd_momentum(model)
        for tokens, targets in data:
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                _, loss = model(tokens, targets)
            loss.backward()
            if manager is None:
                optimizer.step()
            else:
                manager.step(optimizer)
            optimizer.zero_grad()

    plain, cached = gpt(), gpt()
    run(plain)
    run(cached, gradient_cache.create_gradient_cache(cached, **STREAMED))
    assert_same_parameters(plain, cached)


def test_parameter_blocks_naming_a_module_that_is_not_the_list_is_refused() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = gpt()

    with pytest.raises(ValueError, match=r"'transformer'.*not the.*'transformer\.blocks'"):
        gradient_cache.create_gradient_cache(Outer(), **STREAMED, parameter_blocks="transformer")


class PassingLayer(nn.Module):
    """A T5 block: the first makes a position bias, every later one takes it and hands it
    on unchanged in its outputs."""

    def __init__(self, *, first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bias = nn.Parameter(torch.randn(16)) if first else None

    def forward(self, hidden, bias=None):
        if bias is None:
            bias = self.bias * 1.0
        return torch.tanh(self.lin(hidden) + bias), bias


class EncoderDecoder(nn.Module):
    def __init__(self, *, direct: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.encoder = nn.ModuleList(PassingLayer(first=i == 0) for i in range(4))
        self.decoder = nn.ModuleList(PassingLayer(first=i == 0) for i in range(4))
        self.head = nn.Linear(16, 32)
        self.direct = direct  # the encoder's blocks called through .forward

    def forward(self, tokens):
        hidden, bias = self.emb(tokens), None
        for layer in self.encoder:
            hidden, bias = layer.forward(hidden, bias) if self.direct else layer(hidden, bias)
        encoded, bias = hidden, None
        for layer in self.decoder:
            hidden, bias = layer(hidden + encoded, bias)
        return self.head(hidden)


def encoder_decoder(**kwargs) -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(**kwargs)


def test_an_encoder_and_a_decoder_both_stream_and_a_handed_on_tensor_brings_nothing_back() -> None:
    model = encoder_decoder()
    units = weight_units(model)
    assert units.blocks == [*model.encoder, *model.decoder]
    plain = encoder_decoder()
    run_writing(plain)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    weights = manager.engine.weights
    held = []
    for layer in [*model.encoder, *model.decoder]:
        layer.lin.weight.register_hook(
            lambda grad: held.append(sum(p.numel() for p in weights.present()))
        )
    run_writing(model, manager)
    assert_same_parameters(plain, model)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.decoder[1].parameters())
    rest = sum(p.numel() for p in units.rest)
    assert max(held) <= rest + 3 * block + 16  # not the model: the rest and a few blocks
    assert max(held) < 0.6 * total


class SharedAdapters(nn.Module):
    """Six layers, and two small adapters shared by them (each called three times a
    forward): a list of repeated modules, but not the model's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.adapters = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(2))
        self.head = nn.Linear(64, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        for index, layer in enumerate(self.layers):
            hidden = torch.tanh(layer(hidden)) + self.adapters[index % 2](hidden)
        return self.head(hidden)


def test_a_sequential_wrapping_the_list_of_blocks_is_not_taken_for_it() -> None:
    """nn.Sequential(embed, nn.Sequential(*blocks), head): the outer one's children hold
    the most bytes, but one of them is the list of blocks, which it wraps (taken for the
    blocks, the whole stack came to the device as one: a probe, 1.2x the weights)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6)]
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(*blocks), nn.Linear(16, 4))
    assert weight_units(model).blocks == blocks


def test_a_short_list_of_shared_modules_is_not_taken_for_blocks() -> None:
    """Taken for blocks, the adapters would run three times a forward and hold every block
    until backward ends (a review's probe: the whole model on the device)."""
    torch.manual_seed(0)
    model = SharedAdapters()
    assert weight_units(model).blocks == list(model.layers)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    weights = manager.engine.weights
    held = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: held.append(weights.device_bytes()))
    tokens = torch.randint(32, (8,))
    nn.functional.cross_entropy(model(tokens), tokens).backward()
    assert max(held) < 0.6 * sum(p.nbytes for p in model.parameters())
    manager.remove_hooks()


def test_blocks_run_through_forward_are_warned_of_by_name() -> None:
    model = encoder_decoder(direct=True)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_writing(model, manager, steps=1)
    ours = [w for w in caught if "block(x)" in str(w.message)]
    assert len(ours) == 1 and "'encoder." in str(ours[0].message)
    assert ours[0].filename == __file__  # run_writing's backward(), not the package's hook


def test_a_backward_that_raised_is_not_warned_of_again_at_the_next_forward() -> None:
    """Blocks run through ``.forward`` in a backward that then raises (a hook of the user's
    on the input): its error said it, and the next forward, which ends that backward, adds
    no warning (on a device, autograd's device thread made this the regularizer test's
    one failure in three)."""
    model = encoder_decoder(direct=True)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    tokens = torch.randint(0, 16, (2, 8))

    def refuse(grad: torch.Tensor) -> None:
        raise RuntimeError("the user's hook")

    embedded = model.emb.weight
    embedded.register_hook(refuse)
    with pytest.raises(RuntimeError, match="the user's hook"):
        model(tokens).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(tokens)
    assert not [w for w in caught if "block(x)" in str(w.message)]
    assert manager.engine.weights.present()  # the forward ran streamed: its rest is here


def test_hooks_of_a_backward_ended_as_failed_do_not_run() -> None:
    """A backward ended as failed (`BackwardEnd.after_a_failed_backward`): a stream's hooks
    that autograd's other thread still runs for it afterwards are skipped, those of the
    next backward run. Played on one thread: the end is called from inside the backward."""
    from gradient_cache.engine.weights.hooks import BackwardEnd, of_this_backward

    class Stream:
        def __init__(self) -> None:
            self.end = BackwardEnd(lambda: None, torch.device("cpu"))
            self.ran: list[str] = []

        @of_this_backward
        def hook(self, name: str) -> None:
            self.ran.append(name)

    stream = Stream()
    leaf = torch.ones(2, requires_grad=True)
    second = leaf * 3
    first = leaf * 2  # made later: autograd runs its node first

    def late(grad: torch.Tensor) -> None:
        stream.end.after_a_failed_backward()  # as the next forward would
        stream.hook("late")

    first.register_hook(lambda grad: (stream.end.queue(), stream.hook("early"))[0])
    second.register_hook(late)
    (first.sum() + second.sum()).backward()
    other = leaf * 4
    other.register_hook(lambda grad: stream.hook("next"))
    other.sum().backward()
    assert stream.ran == ["early", "next"]


def test_a_model_on_several_devices_is_refused_without_naming_exclude_layers() -> None:
    model = gpt()
    model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    with pytest.raises(ValueError, match="several devices") as refusal:
        gradient_cache.create_gradient_cache(model, **STREAMED)
    assert "exclude_layers" not in str(refusal.value)


def test_forward_issues_the_rests_and_the_first_blocks_copies_before_it_waits(
    monkeypatch,
) -> None:
    """The model's forward starts both copies, then waits for the rest alone: block 0's
    copy runs while the embeddings compute. The last block stays from its forward to its
    backward (not given up and brought again)."""
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    weights = manager.engine.weights
    backend = weights.backend
    calls: list[str] = []
    start, finish = backend.start_refill, backend.finish_to_device
    monkeypatch.setattr(
        backend, "start_refill", lambda *a, **k: calls.append("copy") or start(*a, **k)
    )
    monkeypatch.setattr(
        backend, "finish_to_device", lambda *a, **k: calls.append("wait") or finish(*a, **k)
    )
    last = list(model.blocks[-1].parameters())
    seen = []
    model.blocks[-1].register_forward_hook(lambda *_: seen.append("ran"))
    _, loss = model(*batches(1)[0])
    assert calls[:3] == ["copy", "copy", "wait"]
    assert seen and all(weights.where(p) is WeightAt.DEVICE for p in last)
    copies = calls.count("copy")
    loss.backward()
    assert all(weights.where(p) is WeightAt.HOST for p in last)
    assert calls.count("copy") == copies + len(model.blocks) - 1  # every block but the last
    manager.remove_hooks()


class SparseEmbedded(nn.Module):
    """A sparse embedding (its gradient stays out of the cache, in .grad) in the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16, sparse=True)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return self.head(hidden)


def test_a_sparse_embeddings_gradient_steps_with_its_weights_brought_bit_for_bit() -> None:
    """A sparse gradient stays in .grad (the cache takes none): the fused step steps it
    as a held gradient, its weights brought with it, as plain SGD does. (On a GPU that
    gradient is a device tensor beside a host master at rest; the emulated device has no
    sparse kernels, so that part waits for a GPU.)"""

    def run(cached: bool) -> nn.Module:
        torch.manual_seed(0)
        model = SparseEmbedded()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = gradient_cache.create_gradient_cache(model, **STREAMED) if cached else None
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(32, (4, 8), generator=generator)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            assert not cached or model.emb.weight.grad.is_sparse
            step(model, optimizer, manager)
        return model

    assert_same_parameters(run(False), run(True))


def test_a_parametrized_weights_assignment_is_refused_naming_the_in_place_write() -> None:
    """``module.weight = value`` under torch's parametrize rebinds the original (set_),
    refused; the write the refusal names trains as plain's assignment does."""

    def orthogonal_gpt() -> nn.Module:
        model = gpt()
        for block in model.blocks:
            nn.utils.parametrizations.orthogonal(block.mlp.fc)
        return model

    def run(model, manager=None, *, assign: bool) -> None:
        optimizer = sgd_momentum(model)
        train(model, optimizer, data[:2], manager=manager)
        fc = model.blocks[1].mlp.fc
        torch.manual_seed(5)  # the right inverse completes the matrix with torch.randn
        with torch.no_grad():
            if assign:
                fc.weight = value
            else:
                original = fc.parametrizations.weight.original
                original.copy_(fc.parametrizations.weight[0].right_inverse(value))
        train(model, optimizer, data[2:], manager=manager)

    data = batches(4)
    value = torch.linalg.qr(torch.randn(128, 32, generator=torch.Generator().manual_seed(3)))[0]
    plain, cached, refused = orthogonal_gpt(), orthogonal_gpt(), orthogonal_gpt()
    run(plain, assign=True)
    with (
        gradient_cache.create_gradient_cache(refused, **STREAMED) as manager,
        pytest.raises(RuntimeError, match="right_inverse"),
    ):
        run(refused, manager, assign=True)
    with gradient_cache.create_gradient_cache(cached, **STREAMED) as manager:
        run(cached, manager, assign=False)
    assert_same_parameters(plain, cached)


def test_a_functional_call_with_a_tensor_made_from_a_weight_at_rest_is_refused() -> None:
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    tokens, targets = batches(1)[0]
    override = {"blocks.0.mlp.fc.weight": model.blocks[0].mlp.fc.weight * 0.5}
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.mlp\.fc\.weight' is a plain tensor"):
        torch.func.functional_call(model, override, (tokens, targets))
    manager.remove_hooks()


@pytest.mark.parametrize(
    ("offload_parameters", "change"),
    [(True, "data"), (True, "cast"), (False, "cast")],
    ids=["weights-on-host-data", "weights-on-host-cast", "cache-cast"],
)
def test_a_change_between_backward_and_step_is_refused_at_the_step(
    offload_parameters, change
) -> None:
    """``p.data = t`` or ``model.to(dtype)`` after a backward: with the weights on the host
    the fused step put the host master back over the new data (silently), and a cast made
    it fail inside torch on the gradients' dtype. Refused before the step changes anything,
    naming the parameter (and, with the weights on the host, an in-place copy as the way).
    Without the weights on the host ``p.data = t`` is plain PyTorch's (the cache does not
    hold the weights)."""
    model = gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = STREAMED if offload_parameters else {"compression_ratio": 1}
    manager = gradient_cache.create_gradient_cache(model, **options)
    model(*batches(1)[0])[1].backward()
    if change == "data":
        weight = model.blocks[1].mlp.fc.weight
        weight.data = torch.full_like(weight, 0.01)
        first = "blocks.1.mlp.fc.weight"
    else:
        model.double()
        first = "tok_emb.weight"
    with pytest.raises(RuntimeError, match=f"'{first}' (moved|cast)") as refused:
        manager.step(optimizer)
    assert ("param.copy_(new)" in str(refused.value)) == offload_parameters
    manager.remove_hooks()


def test_a_rebound_weight_is_kept_by_the_close_and_a_new_cache_trains_as_plain() -> None:
    """With the weights on the host, the close puts the masters back on the model, except
    where the user rebound ``P.data`` (refused at the next forward or step, whose message
    says to close and create a new cache): those new values are the model's, as in plain
    PyTorch (the close put the stale master back over them). Then a new cache steps the
    gradients the first one held, bit for bit with plain PyTorch's step."""
    data = batches(2)

    def run(cached: bool) -> nn.Module:
        model = gpt()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        manager = gradient_cache.create_gradient_cache(model, **STREAMED) if cached else None
        model(*data[0])[1].backward()
        weight = model.blocks[1].mlp.fc.weight
        weight.data = torch.full_like(weight, 0.01)
        if manager is not None:
            with pytest.raises(RuntimeError, match="copy_"):
                manager.step(optimizer)
            manager.remove_hooks()
            assert torch.equal(weight, torch.full_like(weight, 0.01))
            manager = gradient_cache.create_gradient_cache(model, **STREAMED)
        step(model, optimizer, manager)
        train(model, optimizer, data[1:], manager=manager)
        return model

    assert_same_parameters(run(cached=False), run(cached=True))


def test_a_model_cast_with_the_weights_on_the_host_keeps_its_dtype_through_the_close() -> None:
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    model.double()
    manager.remove_hooks()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
