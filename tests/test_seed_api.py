"""What the seed's users wrote still works or says what replaced it: its example's decorator
call, its names, and a warning where its README's ratios cost accuracy."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path

import pytest
import torch
from helpers import batches, loss_of, make_model
from torch import nn

import gradient_cache
from gradient_cache.stats import CompressionSummary

SEED_EXAMPLE = dict(
    compression_ratio=10, memory_budget="80%", warmup_steps=5, verbose=True, checkpoint_frequency=5
)


def test_the_seed_examples_decorator_call_trains_a_function(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its arguments as the seed wrote them; on a CPU the budget has nothing to budget, and
    verbose logs the summary every checkpoint_frequency steps."""

    @gradient_cache.optimize(**SEED_EXAMPLE)
    def train(model: nn.Module) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens, targets = batches(1)[0]
        losses = []
        for _ in range(12):
            loss = loss_of(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    with caplog.at_level(logging.INFO, logger="gradient_cache"):
        losses = train(make_model())
    assert losses[-1] < 0.8 * losses[0]
    (summary,) = train.last_summaries
    assert summary["steps"] == 12
    assert "nothing to budget" in summary["memory_budget"]
    logged_steps = [
        r.getMessage().split()[2] for r in caplog.records if "MiB of gradients" in r.getMessage()
    ]
    assert logged_steps == ["5:", "10:"]


def test_the_seed_example_trains_with_its_own_decorated_function() -> None:
    """examples/train_gpt2_example.py's decorated train(), in this process (a subprocess
    costs seconds of imports), on a smaller GPT-2 and a few batches."""
    transformers = pytest.importorskip("transformers")
    path = Path(__file__).parent.parent / "examples" / "train_gpt2_example.py"
    spec = importlib.util.spec_from_file_location("train_gpt2_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    data = [
        torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    losses = example.train(model, data * 3)
    assert len(losses) == 9 and losses[-1] < losses[0]
    (summary,) = example.train.last_summaries
    assert "nothing to budget" in summary["memory_budget"]


def test_the_seeds_names_resolve_or_say_what_replaced_them() -> None:
    assert gradient_cache.MemoryStats is CompressionSummary
    decorator = gradient_cache.optimize(compression_ratio=1)
    assert isinstance(decorator, gradient_cache.GradientCacheDecorator)
    direct = gradient_cache.GradientCacheDecorator(compression_ratio=1)
    assert callable(direct(lambda: None))
    for name, replacement in [
        ("AdaptiveGradientCompressor", "docs/compression.md"),
        ("GPUMemoryManager", "memory_budget"),
    ]:
        with pytest.raises(AttributeError, match=f"{name} was the seed's.*{replacement}"):
            getattr(gradient_cache, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        gradient_cache.no_such_name  # noqa: B018


def wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))  # 65,536 entries: top-k's


def test_a_ratio_no_dense_codec_fits_warns_once_with_the_cost() -> None:
    with pytest.warns(UserWarning, match=r"compression_ratio=100: .*19\.2% \(AdamW\)") as caught:
        gradient_cache.create_gradient_cache(wide(), compression_ratio=100).remove_hooks()
    assert len([w for w in caught if "compression_ratio=100" in str(w.message)]) == 1
    assert "codec='sign'" in str(caught[0].message)


@pytest.mark.parametrize(
    "options", [{"codec": "topk"}, {"codec": "sign"}, {"compression_ratio": 10}], ids=str
)
def test_a_named_codec_or_a_ratio_a_dense_codec_fits_does_not_warn(options: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradient_cache.create_gradient_cache(
            wide(), **{"compression_ratio": 100, **options}
        ).remove_hooks()
