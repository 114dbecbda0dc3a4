"""The weights on the host (``offload_parameters=True``) on the emulated device, where the
device and the host are two memories and two device types: bit for bit with plain PyTorch
on the device, the window read from the device's allocator, and the uses that only a second
device tells apart (a write in forward, a load after a dropped forward, autocast, a bf16
compute dtype), and a regularizer over every parameter, refused."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from test_parameters_nothing_lost import encoder_decoder, writing_model
from test_parameters_offload import STREAMED, adamw_two_groups, gpt, gpt_reusing_a_block
from test_parameters_offload import batches_on as on
from test_parameters_offload import step as step_and_zero
from torch import nn

import gradient_cache
from gradient_cache.engine.weights import at_rest
from perf.gradient_link import Copies


def train(model, data, manager=None, *, clip=0.5):
    optimizer = adamw_two_groups(model)
    for tokens, targets in data:
        _, loss = model(tokens, targets)
        loss.backward()
        if manager is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        else:
            manager.step(optimizer, max_grad_norm=clip)
        optimizer.zero_grad()


def same(plain: nn.Module, cached: nn.Module) -> None:
    for (name, a), b in zip(plain.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name


def trains_as_plain(device, backward) -> tuple[nn.Module, gradient_cache.GradientCacheHookManager]:
    """Three AdamW steps, each after ``backward(model, tokens, targets)``: plain PyTorch on
    the device, and the cache set up from the host with the fused step, bit for bit. Returns
    the cached model and its manager, still attached."""

    def run(model, manager=None) -> None:
        optimizer = adamw_two_groups(model)
        for tokens, targets in on(device):
            backward(model, tokens, targets)
            if manager is None:
                optimizer.step()
            else:
                manager.step(optimizer)
            optimizer.zero_grad()

    plain = gpt().to(device)
    run(plain)
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    run(cached, manager)
    same(plain, cached)
    return cached, manager


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_training_on_the_device_is_plain_bit_for_bit(device, checkpointing) -> None:
    data = on(device)
    plain = gpt(checkpointing=checkpointing).to(device)
    train(plain, data)
    cached = gpt(checkpointing=checkpointing).to(device)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    train(cached, data, manager)
    same(plain, cached)
    assert all(p.device.type == "cpu" for p in cached.parameters())  # the masters at rest


def test_a_clip_over_some_parameters_then_the_step_is_plain_bit_for_bit(device) -> None:
    """``clip_grad_norm_`` over the blocks' parameters alone: their cached gradients come
    back into ``.grad`` beside their weights at rest on the host, to be clipped in place,
    and the step takes each to where it brought the weight (it assigned a host gradient to
    a device weight and raised); the norms and weights are plain's on the device."""

    def run(model, manager=None) -> list[torch.Tensor]:
        optimizer = adamw_two_groups(model)
        norms = []
        for tokens, targets in on(device):
            model(tokens, targets)[1].backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.blocks.parameters(), 0.05))
            if manager is None:
                optimizer.step()
            else:
                manager.step(optimizer)
            optimizer.zero_grad()
        return norms

    plain = gpt().to(device)
    expected = run(plain)
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    assert [n.cpu() for n in run(cached, manager)] == [n.cpu() for n in expected]
    same(plain, cached)


@pytest.mark.parametrize("forwards", [1, 2], ids=["one-forward", "two-forwards"])
def test_a_backward_naming_the_block_weights_trains_them_as_plain(device, forwards) -> None:
    """``loss.backward(inputs=...)`` over the blocks' weights: each weight left the device
    after its block's forward, which made autograd start a new accumulation node, so the
    backward named nodes the graph never used and trained none of the streamed blocks;
    it is handed the nodes the forward used (two forwards before one backward: two each)."""

    def backward(model, tokens, targets) -> None:
        loss = sum(model(tokens, targets)[1] for _ in range(forwards))
        loss.backward(inputs=list(model.blocks.parameters()))

    cached, _ = trains_as_plain(device, backward)
    assert not torch.equal(cached.blocks[0].mlp.fc.weight, gpt().blocks[0].mlp.fc.weight)


def test_two_uses_of_a_block_under_accumulation_sum_as_plain(device) -> None:
    """Two forwards before each of two backwards a step: each block weight moved between its
    uses, so autograd accumulates it at two nodes; the cache takes their sum whole, as
    plain's one node gives it (``M + (b + a)``; taking each part had ``(M + b) + a``)."""

    def backward(model, tokens, targets) -> None:
        for rows in (slice(0, 2), slice(2, None)):
            sum(model(tokens[rows], targets[rows])[1] for _ in range(2)).backward()

    trains_as_plain(device, backward)


@pytest.mark.parametrize("when", ["between", "before"])
def test_a_second_loss_through_the_rest_called_alone_is_plain(device, when) -> None:
    """An auxiliary loss through the final norm and the head called on their own (between
    the model's forward and its backward, or before the forward), backwarded after the
    model's loss: that first backward's end gave the rest's weights up, and the second
    backward read them at rest (here a device mismatch in layer norm's backward, on the CPU
    a bare setStorage error: probe A). A submodule of the rest called alone now begins its
    backward as the model's output does, bringing the rest."""
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(5)).to(device)

    def backward(model, tokens, targets) -> None:
        auxiliary = None
        if when == "before":
            auxiliary = model.lm_head(model.ln_f(features)).square().mean()
        loss = model(tokens, targets)[1]
        if when == "between":
            auxiliary = model.lm_head(model.ln_f(features)).square().mean()
        loss.backward()
        auxiliary.backward()

    trains_as_plain(device, backward)


def test_a_submodule_of_the_rest_called_alone_takes_the_compute_dtype(device) -> None:
    """With compute_dtype=torch.bfloat16 the model's and each block's floating inputs are
    cast (FSDP2's ``cast_forward_inputs``); the final norm called on its own met its fp32
    input with bf16 weights and raised torch's "mixed dtype" (probe A). Its inputs are cast
    as the model's, by position or keyword, and in a checkpointed call's rerun: the bf16
    layer norm written out on the masters' casts, and a backward through it runs and steps."""
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(5))
    model = gpt()
    norm = model.ln_f
    expected = nn.functional.layer_norm(
        features.bfloat16(),
        norm.normalized_shape,
        norm.weight.detach().bfloat16(),
        norm.bias.detach().bfloat16(),
        norm.eps,
    )
    optimizer = adamw_two_groups(model)
    manager = gradient_cache.create_gradient_cache(
        model, **STREAMED, device=device, compute_dtype=torch.bfloat16
    )
    normed = model.ln_f(features.to(device))
    assert normed.dtype == torch.bfloat16 and torch.equal(normed.cpu(), expected)
    by_name = model.ln_f(input=features.to(device))  # a keyword input too (review R13)
    assert torch.equal(by_name.cpu(), expected)
    # Checkpointed: its rerun in backward casts alike (it recomputed in fp32: R13).
    rerun = torch.utils.checkpoint.checkpoint(model.ln_f, features.to(device), use_reentrant=False)
    (normed.float().square().mean() + rerun.float().square().mean()).backward()
    manager.step(optimizer)
    assert not torch.equal(norm.weight.detach().cpu(), torch.ones(32))  # stepped from its init


@pytest.mark.parametrize("forwards", [1, 2], ids=["one-forward", "two-forwards"])
def test_autograd_grad_of_every_weight_is_plain_bit_for_bit(device, forwards) -> None:
    """``torch.autograd.grad(loss, model.parameters())`` gives every weight's gradient as
    on plain PyTorch's device (it found no use of the streamed blocks' weights: an error,
    or None with ``allow_unused``), call after call (the first one's nodes forgotten:
    not used in the second's graph, they would fail it); two forwards before it give a
    block weight two nodes, whose gradients are summed."""

    def loss(model, tokens, targets) -> torch.Tensor:
        return sum(model(tokens, targets)[1] for _ in range(forwards))

    plain = gpt().to(device)
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    for tokens, targets in on(device, 2):
        expected = torch.autograd.grad(loss(plain, tokens, targets), list(plain.parameters()))
        grads = torch.autograd.grad(loss(cached, tokens, targets), list(cached.parameters()))
        for (name, _), a, b in zip(plain.named_parameters(), expected, grads, strict=True):
            assert b.device == device and torch.equal(a.cpu(), b.cpu()), name
    # The last call's uses only: each forward's nodes replace the last backward's (kept
    # till then for a retained graph), never pile up call after call.
    assert len(at_rest.USES[id(cached.blocks[0].attn.qkv.weight)]) == forwards
    assert manager.engine.weights is not None  # held, and attached, until here


def test_a_gradient_of_autograd_grad_assigned_to_a_weight_at_rest_is_refused_by_name(
    device,
) -> None:
    """``autograd.grad``'s gradients are the weights' compute tensors', on the device, while
    a weight at rest is its host master: ``p.grad = g`` raised torch's bare "assign a
    gradient with device type" (probe A). Refused naming the weight and the route that
    trains (the cache taking the gradients from a backward)."""
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    tokens, targets = on(device, 1)[0]
    weight = model.blocks[1].attn.qkv.weight
    (grad,) = torch.autograd.grad(model(tokens, targets)[1], [weight])
    assert grad.device == device
    with pytest.raises(RuntimeError, match=r"'blocks.1.attn.qkv.weight'.grad = .*inputs="):
        weight.grad = grad
    with pytest.raises(RuntimeError, match="same size") as wrong_shape:  # the user's own
        weight.grad = torch.zeros(3)
    assert "autograd.grad" not in str(wrong_shape.value)
    assert weight.grad is None and manager.engine is not None  # held, and attached, until here


@pytest.mark.parametrize("first", ["backward", "autograd.grad"])
def test_a_second_backward_through_a_retained_graph_is_plain(device, first) -> None:
    """A backward (or ``autograd.grad``) with ``retain_graph=True``, then a whole
    ``backward()`` through the same graph: the blocks' weights come back for the second as
    for the first, and their gradients add up as plain PyTorch's do (twice the loss's)."""

    def backward(model, tokens, targets) -> None:
        loss = model(tokens, targets)[1]
        if first == "backward":
            loss.backward(retain_graph=True)
        else:
            torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()

    trains_as_plain(device, backward)


def test_a_backward_over_a_retained_graph_naming_weights_is_plain(device) -> None:
    """After a backward with ``retain_graph=True`` ended, the weights went home and autograd
    started new accumulation nodes for them, so a second ``backward(inputs=...)`` or
    ``autograd.grad`` naming them found none of the graph's: no parameter got a gradient,
    the rest's neither (a probe; PCGrad's per-task gradients failed). The nodes the forward
    used stay recorded until the next forward, the weights at rest guarded meanwhile."""

    def halves(model) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        params = list(model.parameters())
        return params[::2], params[1::2]  # blocks' and the rest's in each

    def backward(model, tokens, targets) -> None:
        loss = model(tokens, targets)[1]
        first, second = halves(model)
        torch.autograd.grad(loss, first, retain_graph=True)
        loss.backward(inputs=second)

    trains_as_plain(device, backward)
    plain, cached = gpt().to(device), gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    tokens, targets = on(device, 1)[0]
    answers = []
    (other, other_targets) = on(device, 2)[1]
    for model in (plain, cached):
        params = list(model.parameters())
        grads = []
        logits, loss = model(tokens, targets)  # two tasks' gradients of one forward (PCGrad)
        grads += torch.autograd.grad(loss, params, retain_graph=True)
        with torch.no_grad():
            model(other)  # an eval between: the weights are guarded again after it
        grads += torch.autograd.grad(logits.square().mean(), params)
        first, second = model(tokens, targets)[1], model(other, other_targets)[1]
        grads += torch.autograd.grad(first, params)  # a weight's node of the other forward
        grads += torch.autograd.grad(second, params)  # is not in this graph: left out
        answers.append(grads)
    for a, b in zip(*answers, strict=True):
        assert b.device == device and torch.equal(a.cpu(), b.cpu())
    manager.remove_hooks()
    # The close forgets them: kept, they would keep the model alive.
    assert not any(id(param) in at_rest.USES for param in cached.parameters())


def test_a_forward_hook_registered_before_the_cache_reads_the_blocks_weights(device) -> None:
    """As options.md says: a block's forward hook that uses the block's weights runs with
    them on the device where registered before the cache, or after it with
    ``prepend=True``, and trains as plain; registered after without it, it meets the host
    masters, and its use of them is refused by name (or, where a device tensor meets them,
    by the device)."""

    def scale_by_weight(block, args, output):
        return output * block.mlp.fc.weight.mean()

    def hooked(model, *, before: bool, prepend: bool = False):
        manager = None
        if not before:
            manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
        model.blocks[1].register_forward_hook(scale_by_weight, prepend=prepend)
        if before:
            manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
        return manager

    plain = gpt().to(device)
    plain.blocks[1].register_forward_hook(scale_by_weight)
    train(plain, on(device))
    for options in ({"before": True}, {"before": False, "prepend": True}):
        cached = gpt()
        train(cached, on(device), hooked(cached, **options))
        same(plain, cached)
    late = gpt()
    manager = hooked(late, before=False)
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.mlp\.fc\.weight' received a gradient"):
        train(late, on(device), manager)


def test_a_model_moved_to_the_device_after_the_cache_is_refused_saying_to_leave_it(
    device,
) -> None:
    """Set up from the host, then ``model.to(device)`` as a plain loop does: the next
    forward refuses, naming the weights moved and the fix (the cache brings the blocks)."""
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    cached.to(device)
    tokens, targets = on(device, 1)[0]
    with pytest.raises(RuntimeError, match=r"moved to emu:0 .* leave model\.to\(device\) out"):
        cached(tokens, targets)
    manager.remove_hooks()


def held_at_each_block(model, data, manager=None) -> list[int]:
    """The device bytes allocated as each block's forward ends, in one step."""
    held: list[int] = []
    handles = [
        block.register_forward_hook(lambda *_: held.append(torch.accelerator.memory_allocated()))
        for block in model.blocks
    ]
    base = torch.accelerator.memory_allocated()
    train(model, data, manager)
    for handle in handles:
        handle.remove()
    return [bytes_ - base for bytes_ in held]


def test_the_allocator_sees_the_rest_and_two_blocks_not_the_model(device) -> None:
    """Against plain on the device, step for step: as each block's forward ends plain holds
    every weight, the cache the rest, that block and the next arriving (the activations
    alike); at rest the cache holds no weight."""
    data = on(device, 1)
    plain = gpt().to(device)
    plain_held = held_at_each_block(plain, data)
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    base = torch.accelerator.memory_allocated()
    cached_held = held_at_each_block(cached, data, manager)
    weights = sum(p.nbytes for p in cached.parameters())
    rest = sum(p.nbytes for p in manager.engine.weights.params()) - sum(
        p.nbytes for block in cached.blocks for p in block.parameters()
    )
    block = max(sum(p.nbytes for p in b.parameters()) for b in cached.blocks)
    window = rest + 2 * block
    # Plain's weights were on the device before its step (in its base): what it adds as a
    # block ends is the activations, which the cache adds too, with its window of weights.
    for activations, cached_bytes in zip(plain_held, cached_held, strict=True):
        assert cached_bytes - activations <= window
    assert max(cached_held) - max(plain_held) < weights - block  # never the whole model
    assert torch.accelerator.memory_allocated() - base < 4096  # at rest: no weight there


def test_writes_in_forward_and_a_load_after_a_dropped_forward_reach_the_masters(device) -> None:
    plain, cached = writing_model().to(device), writing_model().to(device)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    tokens = torch.arange(8, device=device)
    for model, cache in ((plain, None), (cached, manager)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            if step == 1:  # a dropped forward, then a load into the head alone
                model(tokens)
                loaded = {k: v + 0.01 for k, v in model.head.state_dict().items()}
                model.head.load_state_dict(loaded)
            nn.functional.cross_entropy(model(tokens), tokens).backward()
            if cache is None:
                optimizer.step()
            else:
                cache.step(optimizer)
            optimizer.zero_grad()
    same(plain, cached)


def test_autocast_on_the_device_is_refused_naming_compute_dtype(device) -> None:
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    tokens, targets = on(device, 1)[0]
    with torch.autocast("emu", dtype=torch.bfloat16), pytest.raises(RuntimeError) as refusal:
        cached(tokens, targets)
    assert "compute_dtype=torch.bfloat16" in str(refusal.value)
    manager.remove_hooks()


def test_a_bf16_compute_dtype_trains_on_the_device_as_on_the_cpu(device) -> None:
    options = {**STREAMED, "compute_dtype": torch.bfloat16}
    reference = gpt()
    train(
        reference,
        on(torch.device("cpu")),
        gradient_cache.create_gradient_cache(reference, **options),
    )
    cached = gpt()
    manager = gradient_cache.create_gradient_cache(cached, **options, device=device)
    train(cached, on(device), manager)
    same(reference, cached)


def test_a_block_reused_under_a_bf16_compute_dtype_trains_on_the_device_as_on_the_cpu(
    device,
) -> None:
    """A block run twice in each forward, two micro-batches a step: on a device each use
    has a node of its own (the weight's data moved between the uses), whose parts autograd
    sums in bf16 in .grad, as FSDP2's one bf16 parameter (the CPU run is FSDP2's mixed
    precision: test_parameters_offload)."""
    options = {**STREAMED, "compute_dtype": torch.bfloat16, "bucket_size_mb": 0.02}

    def run(where: torch.device) -> nn.Module:
        model = gpt_reusing_a_block()
        manager = gradient_cache.create_gradient_cache(
            model, **options, **({"device": where} if where.type != "cpu" else {})
        )
        optimizer = adamw_two_groups(model)
        for index, (tokens, targets) in enumerate(on(where, 4)):
            (model(tokens, targets)[1] / 2).backward()
            if index % 2:
                manager.step(optimizer, max_grad_norm=0.5)
                optimizer.zero_grad()
        return model

    same(run(torch.device("cpu")), run(device))


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_bf16_micro_batches_cross_as_bf16_beside_each_other(device, micro_batches) -> None:
    """compute_dtype=torch.bfloat16 with accumulation on the device: the first two
    micro-batches' gradients go out as bf16, the second's into the second half of the
    first's fp32 slot; only the clip's norm brings the first back before the step; a third
    joins their sum in fp32. Counted at the backend's copies in the second step's backwards
    (`perf.gradient_link.Copies`); bit for bit with the same run on the CPU (itself the
    written-out reference: test_parameters_offload)."""
    options = {**STREAMED, "compute_dtype": torch.bfloat16, "bucket_size_mb": 0.02}

    def run(where: torch.device, copies: Copies | None = None) -> nn.Module:
        model = gpt()
        manager = gradient_cache.create_gradient_cache(
            model, **options, **({} if copies is None else {"device": where})
        )
        optimizer = adamw_two_groups(model)
        for index, (tokens, targets) in enumerate(on(where, 2 * micro_batches)):
            _, loss = model(tokens, targets)
            counted = copies is not None and index >= micro_batches
            with copies.counting(manager) if counted else contextlib.nullcontext():
                (loss / micro_batches).backward()
                manager.compress_and_free_gradients()  # the last bucket too
            if (index + 1) % micro_batches == 0:
                manager.step(optimizer, max_grad_norm=0.5)
                optimizer.zero_grad()
        return model

    reference = run(torch.device("cpu"))
    copies = Copies()
    cached = run(device, copies)
    same(reference, cached)
    dense = sum(p.nbytes for p in cached.parameters())  # fp32 gradients
    assert copies.out == dense / 2 * 2 + dense * (micro_batches - 2)
    assert copies.back == dense / 2 + dense * (micro_batches - 2)


def test_a_bf16_fused_steps_peak_is_the_fp32_ones_within_its_parts(device) -> None:
    """The step restores two buckets' fp32 gradients beside their weights and AdamW state
    in both; with bf16 compute a bucket counted its gradients at 2 bytes and held twice the
    parameters (a probe: the step's peak twice fp32's on Llama and Mixtral shapes). Left:
    the bf16 parts widened at the restore (here 9% of the step's peak)."""

    def step_peaks(compute_dtype: torch.dtype | None) -> list[int]:
        model = gpt()
        manager = gradient_cache.create_gradient_cache(
            model, **STREAMED, device=device, compute_dtype=compute_dtype, bucket_size_mb=0.02
        )
        optimizer = adamw_two_groups(model)
        peaks = []
        data = on(device, 6)
        for first, second in zip(data[::2], data[1::2], strict=True):
            for tokens, targets in (first, second):
                (model(tokens, targets)[1] / 2).backward()
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
            before = torch.accelerator.memory_allocated()
            manager.step(optimizer, max_grad_norm=0.5)
            peaks.append(torch.accelerator.max_memory_allocated() - before)
            optimizer.zero_grad()
        manager.remove_hooks()
        return peaks

    fp32, bf16 = step_peaks(None), step_peaks(torch.bfloat16)
    assert all(b <= 1.25 * f for b, f in zip(bf16, fp32, strict=True)), (bf16, fp32)


def test_a_weight_at_rest_stays_a_parameter_for_every_use_no_backward_reaches(device) -> None:
    """From the model's forward end to its backward's begin a block weight at rest is
    guarded (`at_rest.GuardedAtRest`) yet a Parameter for everything else: a log of its norm
    with gradients on, a write under no_grad, a copy of the model (deepcopy: plain
    parameters, no guard), a pickle of the weight; a use a backward reaches is refused by
    name. Guarded again from its backward's end; between steps only watched
    (`at_rest.WatchedAtRest`: its P.data reads counted, a copy made on the device), and
    once the hooks are removed every weight is a plain Parameter."""
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    tokens, targets = on(device, 1)[0]
    weight = model.blocks[0].attn.qkv.weight
    assert type(weight) is at_rest.WatchedAtRest  # before a forward
    _, loss = model(tokens, targets)
    assert isinstance(weight, nn.Parameter) and type(weight) is not nn.Parameter
    assert weight.norm().item() > 0  # recorded, never backwarded: free
    with torch.no_grad():
        weight.mul_(1.0)
    copied = copy.deepcopy(model)
    assert all(type(p) is nn.Parameter for p in copied.parameters())
    buffer = io.BytesIO()
    torch.save(weight, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is nn.Parameter
    # The write moved the weight's version, which that forward's backward would refuse
    # (plain PyTorch's in-place error, raced against the refusal below on autograd's other
    # thread): a new forward, its graph made after the write.
    _, loss = model(tokens, targets)
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.attn\.qkv\.weight' were used outside"):
        (loss + weight.square().sum()).backward()
    _, loss = model(tokens, targets)
    during = []
    loss.register_hook(lambda grad: during.append(type(weight)))  # after the cache's own
    loss.backward()
    # Not guarded from the backward's begin (its hooks read the weights' fields): watched.
    assert during == [at_rest.WatchedAtRest]
    # At rest after it, guarded again: a backward over a retained graph may name them.
    assert not any(type(p) is nn.Parameter for p in model.parameters())
    manager.step(adamw_two_groups(model))
    assert all(type(p) is at_rest.WatchedAtRest for p in model.parameters())
    model(tokens, targets)
    manager.remove_hooks()
    assert all(type(p) is nn.Parameter for p in model.parameters())


@pytest.mark.parametrize("attempt", range(4))
def test_a_regularizer_over_every_parameter_raises_never_trains(device, attempt) -> None:
    """At rest a block's weights are its host masters: a penalty over model.parameters()
    computes their terms on the host, and autograd would run their backward on its CPU
    thread while its device thread brings the weights back for the blocks' own backward (a
    race: which thread came first decided between our error and autograd's device error).
    Each host term's node refuses as a backward reaches it, naming the weights, before it
    reads anything: every time, by name (four runs of three backwards)."""
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    tokens, targets = on(device, 1)[0]
    for _ in range(3):
        _, loss = model(tokens, targets)
        penalty = sum(p.square().sum() for p in model.parameters())
        with pytest.raises(RuntimeError, match=r"Parameter\(s\) 'blocks\.\d+\."):
            (loss + 1e-4 * penalty).backward()
        assert all(p.grad is None or p.grad.device == device for p in model.parameters())
    # The failed backwards' ends never ran: the next forward ends them, and a step trains
    # and leaves nothing on the device.
    optimizer = adamw_two_groups(model)
    optimizer.zero_grad()
    model(tokens, targets)[1].backward()
    assert manager.engine.weights.present() == []  # its end ran: nothing kept
    manager.step(optimizer)


@pytest.mark.parametrize("kind", ["capturable", "fused", "foreach"])
@pytest.mark.parametrize("attached", [True, False], ids=["offload_state_of", "first-step"])
@pytest.mark.parametrize("setup", ["model-on-device", "device="])
def test_an_adamw_keeping_its_step_on_the_device_resumes_as_plain(
    device, kind, attached, setup
) -> None:
    """A capturable or fused AdamW keeps ``step`` on the device. Its state_dict, read back
    with map_location="cpu" and loaded into a new optimizer (after ``offload_state_of`` or
    before the first step): torch's load puts ``step`` beside the parameter, at rest the
    host master, and the step then asserted; here two more steps equal plain's resumed run
    on the device bit for bit, weights and state, ``step`` on the device too (a foreach
    AdamW's on the host, as plain's)."""
    data = on(device, 4)
    step_on = torch.device("cpu") if kind == "foreach" else device

    def resumed_run(model, manager=None) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
        for number, (tokens, targets) in enumerate(data):
            if number == 2:
                buffer = io.BytesIO()
                torch.save(optimizer.state_dict(), buffer)
                buffer.seek(0)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
                if manager is not None and attached:
                    manager.offload_state_of(optimizer)
                optimizer.load_state_dict(torch.load(buffer, map_location="cpu"))
            model(tokens, targets)[1].backward()
            step_and_zero(model, optimizer, manager)
        return optimizer

    plain = gpt().to(device)
    plain_opt = resumed_run(plain)
    cached = gpt() if setup == "device=" else gpt().to(device)
    where = {"device": device} if setup == "device=" else {}
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, **where)
    cached_opt = resumed_run(cached, manager)
    same(plain, cached)
    for p, q in zip(plain.parameters(), cached.parameters(), strict=True):
        expected, got = plain_opt.state[p], cached_opt.state[q]
        assert expected["step"].device == got["step"].device == step_on
        for key in expected:
            assert torch.equal(expected[key].cpu(), got[key].cpu()), key


@pytest.mark.parametrize("copier", ["deepcopy", "averaged"])
def test_an_ema_copy_is_made_on_the_device_and_computes_as_plains(device, copier) -> None:
    """``copy.deepcopy`` or ``AveragedModel`` of a model whose weights rest on the host: the
    copy is whole on the device, its parameters beside its buffers, as plain PyTorch's copy
    of a model there (the masters copied on the host beside device buffers computed
    nowhere), and computes as plain's copy, before and after the close."""

    def copied(model):
        if copier == "deepcopy":
            return copy.deepcopy(model)
        ema = torch.optim.swa_utils.AveragedModel(model)
        ema.update_parameters(model)
        return ema

    data = on(device)
    plain = gpt().to(device)
    plain.register_buffer("scale", torch.ones(3, device=device))
    train(plain, data[:2])
    cached = gpt()
    cached.register_buffer("scale", torch.ones(3))
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, device=device)
    train(cached, data[:2], manager)
    plain_copy, cached_copy = copied(plain), copied(cached)
    module = cached_copy.module if copier == "averaged" else cached_copy
    assert {t.device for t in [*module.parameters(), *module.buffers()]} == {device}
    assert all(type(p) is nn.Parameter for p in module.parameters())
    tokens, targets = data[2]
    with torch.no_grad():
        expected = plain_copy(tokens, targets)[1]
        assert torch.equal(cached_copy(tokens, targets)[1], expected)
    manager.remove_hooks()
    with torch.no_grad():
        assert torch.equal(cached_copy(tokens, targets)[1], expected)


def test_blocks_run_through_forward_on_a_device_are_refused_by_name(device) -> None:
    """``layer.forward(x)`` skips the hooks that bring the block's weights: on the CPU it is
    warned of by name at backward; on a device its host weights meet device tensors in
    forward, where torch's device-mismatch error named no parameter. A weight at rest is
    watched there, and the error names it and the fix; then ``layer(x)`` trains."""
    model = encoder_decoder(direct=True)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, device=device)
    tokens = torch.randint(0, 16, (2, 8), device=device)
    refusal = r"'encoder\.0\.lin\.weight'.* block\.forward\(x\).*\(block\(x\)\)"
    with pytest.raises(RuntimeError, match=refusal):
        model(tokens)  # the weights as created
    model.direct = False
    model(tokens).sum().backward()  # a micro-batch: guarded at rest until the next forward
    model.direct = True
    with pytest.raises(RuntimeError, match=refusal):
        model(tokens)  # the guard lifted at the forward's begin: watched
    model.direct = False
    model(tokens).sum().backward()
    manager.step(torch.optim.SGD(model.parameters(), lr=0.1))
    manager.remove_hooks()
    assert {p.device for p in model.parameters()} == {device}
