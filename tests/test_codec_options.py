"""Codec options on the codec (issue 32, item 3): `EngineConfig` holds only options that act
whatever the codec; top-k's knobs are on `gradient_cache.TopK`; the old keywords are taken
where they act and refused, naming the fix, where they would not; one registry names the
codecs."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from helpers import batches, make_model, train

import gradient_cache
from gradient_cache import EngineConfig, Ladder, TopK, cli
from gradient_cache.codecs import CODEC_NAMES, CODECS, LADDER, Codecs
from gradient_cache.engine.config import TOPK_KEYWORDS
from gradient_cache.integrations import CacheOptions

ROOT = Path(__file__).resolve().parents[1]


def test_engine_config_has_none_of_the_top_k_only_fields() -> None:
    fields = [field.name for field in dataclasses.fields(EngineConfig)]
    assert fields == [
        "codec",
        "bucket_size_mb",
        "warmup_steps",
        "min_compress_numel",
        "host_memory_fraction",
        "backend",
        "staging_depth",
        "pin_memory",
        "host_pool_mb",
        "offload_optimizer_state",
        "offload_parameters",
        "compute_dtype",
        "parameter_blocks",
        "device",
        "memory_budget",
        "checkpoint_frequency",
    ]
    # Every top-k knob is TopK's, and the old keywords are exactly those.
    assert sorted(f.name for f in dataclasses.fields(TopK)) == sorted(TOPK_KEYWORDS)
    for name in TOPK_KEYWORDS:
        with pytest.raises(TypeError, match=name):
            EngineConfig(**{name: getattr(TopK(), name)})
    # Its docstring documents only its own fields.
    documented = re.findall(r"^        (\w+): ", EngineConfig.__doc__ or "", flags=re.MULTILINE)
    assert documented == fields


def test_options_objects_are_frozen_keyword_only_and_checked() -> None:
    with pytest.raises(TypeError):
        TopK(False)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TopK().error_feedback = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="Invalid residual_dtype: 'fp8'"):
        TopK(residual_dtype="fp8")
    with pytest.raises(TypeError, match="keep_previous_residual must be True or False"):
        TopK(keep_previous_residual=1)
    with pytest.raises(ValueError, match="Invalid selection: 'fast'"):
        Ladder(selection="fast")
    assert EngineConfig(codec="topk").topk == TopK()
    assert EngineConfig(codec=TopK(value_dtype="int8")).codec_name == "topk"
    assert EngineConfig().topk is None and EngineConfig(codec="q4").topk is None


# Every top-k knob off its default: each must reach the codec and the engine.
KNOBS = dict(
    residual_dtype="bfloat16",
    value_dtype="int8",
    keep_previous_residual=False,
    selection="exact",
    residual_location="device",
)


def trained(**options) -> list[torch.Tensor]:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=100, min_compress_numel=1, **options
    )
    train(model, batches(4), manager=manager, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    manager.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


def test_a_top_k_object_trains_as_the_old_keywords_did() -> None:
    """Bit for bit at ratio 100 with error feedback, every knob set; and the knobs act."""
    as_object = trained(codec=TopK(error_feedback=True, **KNOBS))
    as_keywords = trained(codec="topk", error_feedback=True, **KNOBS)
    defaults = trained(codec=TopK())
    assert all(torch.equal(a, b) for a, b in zip(as_object, as_keywords, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(as_object, defaults, strict=True))


@pytest.mark.parametrize(
    ("ratio", "options", "name", "fix"),
    [
        (3, dict(error_feedback=False), "error_feedback=False", "TopK(error_feedback=False)"),
        (100, dict(keep_previous_residual=False), "keep_previous_residual=False", "TopK("),
        (1, dict(selection="exact"), "selection='exact'", "TopK(selection='exact')"),
        (3, dict(value_dtype="int8"), "value_dtype='int8'", "codec='int8'"),
        (3, dict(codec="q4", residual_dtype="float32"), "residual_dtype='float32'", "TopK("),
        (1, dict(codec="lossless", residual_location="device"), "residual_location", "TopK("),
        (1, dict(value_dtype="int8", selection="exact"), "selection='exact'", "TopK("),
    ],
)
def test_a_top_k_option_without_top_k_is_refused_naming_it_and_the_fix(
    ratio: float, options: dict, name: str, fix: str
) -> None:
    pattern = f"{re.escape(name)}.*does nothing.*{re.escape(fix)}"
    with pytest.raises(ValueError, match=pattern):
        gradient_cache.create_gradient_cache(make_model(), compression_ratio=ratio, **options)
    with pytest.raises(ValueError, match=pattern):  # the integrations, at creation
        CacheOptions.from_arguments(
            compression_ratio=ratio, exclude_layers=None, verbose=False, options=options
        )


def test_a_top_k_option_beside_a_top_k_object_is_refused() -> None:
    with pytest.raises(TypeError, match=r"selection='exact' was passed beside codec=TopK\("):
        EngineConfig.from_options(dict(codec=TopK(), selection="exact"))


@pytest.mark.parametrize(
    ("ratio", "options", "codec"),
    [
        (100, dict(codec="topk", error_feedback=False), TopK(error_feedback=False)),
        (20, dict(codec="topk", **KNOBS), TopK(**KNOBS)),
        (100, dict(selection="exact"), Ladder(selection="exact")),  # the ladder's top-k
        (1, dict(value_dtype="int8"), "int8"),  # the seed's int8 option
    ],
)
def test_old_keywords_become_the_codec_they_mean(ratio: float, options: dict, codec) -> None:
    assert EngineConfig.from_options(options, compression_ratio=ratio).codec == codec


def test_the_registry_is_the_only_list_of_codec_names() -> None:
    assert tuple(CODECS) == CODEC_NAMES
    assert tuple(name for name in CODECS if CODECS[name].ladder) == LADDER
    # What EngineConfig accepts: every registry name, and nothing else.
    for name in CODEC_NAMES:
        assert EngineConfig(codec=name).codec_name == name
    with pytest.raises(ValueError, match=re.escape(f"expected one of {list(CODEC_NAMES)}")):
        EngineConfig(codec="q5")
    # The ladder the engine builds, and what `gradient-cache plan --codec` offers.
    ladder = Codecs.for_options(EngineConfig(), ratio=50, selection="exact")
    assert tuple(codec.name for codec in ladder.candidates) == LADDER
    _, _, plan = cli._parsers()
    (codec_option,) = [a for a in plan._actions if "--codec" in a.option_strings]
    assert tuple(codec_option.choices) == CODEC_NAMES


def codec_name_lists(path: Path) -> list[int]:
    """Lines of ``path`` with a tuple, list or set literal of two or more codec names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [
                e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in CODECS
            ]
            if len(names) >= 2:
                found.append(node.lineno)
    return found


def test_no_other_source_file_lists_codec_names() -> None:
    """Adding a codec touches one place: the library and perf/ derive their lists from it."""
    sources = [*(ROOT / "gradient_cache").rglob("*.py"), *(ROOT / "perf").rglob("*.py")]
    registry = ROOT / "gradient_cache" / "codecs" / "registry.py"
    listed = {
        str(path.relative_to(ROOT)): lines
        for path in sources
        if path != registry and (lines := codec_name_lists(path))
    }
    assert listed == {}


@pytest.mark.parametrize(
    ("ratio", "options", "recipe"),
    [
        (3, {}, dict(codec=None, error_feedback=True, residual_dtype="int8", value_dtype=None)),
        (
            100,
            dict(codec=TopK(error_feedback=False, residual_dtype="float32", value_dtype="int8")),
            dict(codec="topk", error_feedback=False, residual_dtype="float32", value_dtype="int8"),
        ),
        (
            100,
            dict(codec="topk", residual_dtype="bfloat16"),
            dict(codec="topk", error_feedback=True, residual_dtype="bfloat16", value_dtype=None),
        ),
        (1, dict(codec="q4"), dict(codec="q4", error_feedback=True, residual_dtype="int8")),
    ],
)
def test_a_checkpoints_recipe_is_the_dict_it_was(ratio: float, options: dict, recipe: dict) -> None:
    """The keys and values EngineConfig's own fields gave, so older checkpoints still load."""
    manager = gradient_cache.create_gradient_cache(make_model(), compression_ratio=ratio, **options)
    expected = {
        "compression_ratio": float(ratio),
        "value_dtype": None,
        "min_compress_numel": None,
        "warmup_steps": 0,
        **recipe,
    }
    saved = manager.state_dict()["recipe"]
    manager.remove_hooks()
    assert saved == expected
    assert list(saved) == [
        "compression_ratio",
        "codec",
        "error_feedback",
        "residual_dtype",
        "value_dtype",
        "min_compress_numel",
        "warmup_steps",
    ]


def test_a_bad_ratio_beside_an_old_keyword_is_named_first() -> None:
    with pytest.raises(TypeError, match="compression_ratio must be a real number"):
        gradient_cache.create_gradient_cache(
            make_model(), compression_ratio="high", selection="exact"
        )
