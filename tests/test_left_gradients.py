"""Gradients a step leaves cached beside those it took from the same backward (a GAN's
generator step leaves the critic's gradients from the generator's loss): plain PyTorch
keeps them in ``.grad``, where the user's ``zero_grad()`` clears them or not. A
``zero_grad()`` over them drops them from the cache too; a backward adding to them with
none between is refused, naming the two fixes, each bit for bit with plain PyTorch's loop."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_parameters, batches, loss_of, make_model
from torch import nn

import gradient_cache

LOSSLESS = dict(compression_ratio=1)


def models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(5)
    return make_model(), nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))


def gan_loop(generator, critic, *, step, critics_left=None, zero_critic=True) -> None:
    """The DCGAN tutorial's loop: the critic's step on real and fake, then the generator's,
    whose loss leaves gradients on the critic too (``critic.zero_grad()`` clears them;
    ``zero_critic`` False leaves that call out)."""
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-2)
    c_opt = torch.optim.Adam(critic.parameters(), lr=1e-2)
    for tokens, _ in batches(4):
        fake = generator(tokens).softmax(-1)
        if zero_critic:
            critic.zero_grad()
        critic(fake.detach()).mean().backward()
        step(c_opt)
        generator.zero_grad()
        (-critic(fake).mean()).backward()
        step(g_opt)
        if critics_left is not None:
            critics_left()


def cached_gan(shared: bool):
    """A generator and a critic with a cache each, or one cache over both."""
    generator, critic = models()
    if shared:
        manager = gradient_cache.create_gradient_cache(
            nn.ModuleDict({"generator": generator, "critic": critic}), **LOSSLESS
        )
        return generator, critic, manager, manager
    return (
        generator,
        critic,
        gradient_cache.create_gradient_cache(generator, **LOSSLESS),
        gradient_cache.create_gradient_cache(critic, **LOSSLESS),
    )


def stepper(generator_manager, critic_manager, critic):
    """Each optimizer's fused step, through the cache that holds its gradients."""
    critic_params = set(critic.parameters())

    def step(optimizer) -> None:
        owns_critic = optimizer.param_groups[0]["params"][0] in critic_params
        (critic_manager if owns_critic else generator_manager).step(optimizer)

    return step


@pytest.mark.parametrize("shared", [False, True], ids=["a-cache-each", "one-cache"])
def test_the_tutorials_loop_trains_as_plain_its_critic_zero_grad_dropping_them(shared) -> None:
    """``critic.zero_grad()`` drops the critic's left gradients from the cache as from
    ``.grad`` (the cache once added them to the critic's next step: 4.7e-2 off plain)."""
    plain = models()
    gan_loop(*plain, step=lambda optimizer: optimizer.step())
    generator, critic, g_manager, c_manager = cached_gan(shared)
    gan_loop(generator, critic, step=stepper(g_manager, c_manager, critic))
    for a, b in zip(plain, (generator, critic), strict=True):
        assert_same_parameters(a, b)
    for manager in {g_manager, c_manager}:
        manager.remove_hooks()  # the last generator step's critic gradients go to .grad


@pytest.mark.parametrize("shared", [False, True], ids=["a-cache-each", "one-cache"])
def test_a_backward_onto_the_critics_left_gradients_is_refused(shared) -> None:
    """With no zero_grad() between, plain adds them; whether that was meant the cache
    cannot tell: the next backward is refused, naming both fixes."""
    generator, critic, g_manager, c_manager = cached_gan(shared)
    with pytest.raises(RuntimeError, match=r"discard_gradients.*keep_gradients") as refused:
        gan_loop(generator, critic, step=stepper(g_manager, c_manager, critic), zero_critic=False)
    assert ("critic.0.weight" if shared else "0.weight") in str(refused.value)
    for manager in {g_manager, c_manager}:
        manager.remove_hooks()


@pytest.mark.parametrize("shared", [False, True], ids=["a-cache-each", "one-cache"])
def test_discarding_the_critics_left_gradients_trains_as_plain(shared) -> None:
    plain = models()
    gan_loop(*plain, step=lambda optimizer: optimizer.step())
    generator, critic, g_manager, c_manager = cached_gan(shared)
    step = stepper(g_manager, c_manager, critic)
    gan_loop(generator, critic, step=step, critics_left=c_manager.discard_gradients)
    for a, b in zip(plain, (generator, critic), strict=True):
        assert_same_parameters(a, b)


def test_keeping_what_a_step_left_adds_to_it_as_plain_without_zero_grad() -> None:
    """Two optimizers over two parts of one model, the second stepping every other
    backward with no zero_grad() in between: plain PyTorch adds the two backwards' gradients
    in .grad; with ``keep_gradients()`` after the first's step, the cache does too."""

    def run(model, manager=None) -> None:
        first = torch.optim.AdamW(model.mlp.parameters(), lr=1e-2)
        rest = [*model.embed.parameters(), *model.norm.parameters()]
        second = torch.optim.SGD(rest, lr=0.05)
        for i, (tokens, targets) in enumerate(batches(4)):
            loss_of(model, tokens, targets).backward()
            for optimizer in (first, second) if i % 2 else (first,):
                optimizer.step() if manager is None else manager.step(optimizer)
                optimizer.zero_grad()
            if manager is not None and not i % 2:
                manager.keep_gradients()

    plain, cached = make_model(), make_model()
    run(plain)
    run(cached, gradient_cache.create_gradient_cache(cached, **LOSSLESS))
    assert_same_parameters(plain, cached)


@pytest.mark.parametrize("fix", ["keep_gradients", "discard_gradients"])
def test_the_refused_backward_leaves_nothing_so_its_fix_then_the_backward_is_plain(fix) -> None:
    """The refused backward's first gradient was already accumulated into ``.grad`` when
    the cache's hook refused it, and stayed there: the fix the refusal names, then the
    backward again, counted it twice (a probe). The refusal now takes it out of ``.grad``."""

    def run(model, manager=None) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(model.mlp.parameters(), lr=0.1)  # over a part only
        first, second = batches(2)
        loss_of(model, *first).backward()
        manager.step(optimizer) if manager else optimizer.step()
        optimizer.zero_grad()  # the mlp's; the rest's gradients stay
        if manager is None:
            if fix == "discard_gradients":
                model.zero_grad()
        else:
            with pytest.raises(RuntimeError, match="keep_gradients"):
                loss_of(model, *second).backward()
            getattr(manager, fix)()
        loss_of(model, *second).backward()
        if manager is not None:
            manager.apply_gradients()
        return [p.grad for p in model.parameters()]

    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    for a, b in zip(run(plain), run(cached, manager), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    manager.remove_hooks()
