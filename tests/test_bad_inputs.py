"""Bad input, refused clearly: one row per case, the same rows as docs/bad-inputs.md.

Each case is the code a user would write, run in a fresh namespace (see `namespace`), the
exception it must raise and an excerpt of its message. `test_the_docs_table_matches` keeps
docs/bad-inputs.md in step: ``python tests/test_bad_inputs.py`` prints the table.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import gradient_cache
from gradient_cache import EngineConfig, GradientCacheHookManager, create_gradient_cache

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"

# (what is wrong, the code, the exception, an excerpt of its message)
CASES = [
    # --- the model
    ("parameters instead of a model", "create_gradient_cache(model().parameters())", TypeError,
     "model must be a torch.nn.Module, got generator"),
    ("no trainable parameters", "create_gradient_cache(model().requires_grad_(False))", ValueError,
     "has no trainable parameters"),
    ("meta tensors", 'create_gradient_cache(torch.nn.Linear(4, 4, device="meta"))', ValueError,
     "on the meta device"),
    ("a model already managed", "create_gradient_cache(cached_model)", ValueError,
     "already cached by another GradientCacheHookManager"),
    ("a parameter replaced after creation",
     "cached_model.weight = torch.nn.Parameter(torch.zeros(4, 4)); cached_model(torch.zeros(1, 4))",
     RuntimeError, "'weight' replaced by a new Parameter"),
    ("a model cast after creation",
     "cached_model.to(torch.bfloat16); cached_model(torch.zeros(1, 4, dtype=torch.bfloat16))",
     RuntimeError, "'weight' cast from torch.float32 to torch.bfloat16"),
    # --- compression_ratio
    ("ratio zero", "create_gradient_cache(model(), compression_ratio=0)", ValueError,
     "Invalid compression_ratio: 0; expected a finite number >= 1"),
    ("ratio below 1", "create_gradient_cache(model(), compression_ratio=0.5)", ValueError,
     "Invalid compression_ratio: 0.5"),
    ("ratio NaN", "create_gradient_cache(model(), compression_ratio=math.nan)", ValueError,
     "Invalid compression_ratio: nan"),
    ("ratio inf", "create_gradient_cache(model(), compression_ratio=math.inf)", ValueError,
     "Invalid compression_ratio: inf"),
    ("ratio as a string", 'create_gradient_cache(model(), compression_ratio="100")', TypeError,
     "compression_ratio must be a real number >= 1 (1 = lossless, r = at most 1/r of "
     "lossless bytes), got str '100'"),
    ("ratio as a bool", "create_gradient_cache(model(), compression_ratio=True)", TypeError,
     "got bool True"),
    # --- other arguments
    ("exclude_layers as one string", 'create_gradient_cache(model(), exclude_layers="weight")',
     TypeError, "exclude_layers must be a list of name substrings, e.g. ['lm_head'], got 'weight'"),
    ("exclude_layers excluding everything",
     'create_gradient_cache(model(), exclude_layers=["weight", "bias"])', ValueError,
     "excludes every trainable parameter"),
    ("verbose not a bool", 'create_gradient_cache(model(), verbose="yes")', TypeError,
     "verbose must be True or False, got 'yes'"),
    ("a misspelt option", "create_gradient_cache(model(), bucket_sise_mb=8)", TypeError,
     "Unknown engine option(s) ['bucket_sise_mb']"),
    ("config and options together",
     "create_gradient_cache(model(), config=EngineConfig(), bucket_size_mb=8)", ValueError,
     "either as config= or as keywords, not both"),
    ("config not an EngineConfig", "GradientCacheHookManager(model(), config={})", TypeError,
     "config must be a gradient_cache.EngineConfig, got {}"),
    ("grad_scaler of another kind", "create_gradient_cache(model(), grad_scaler=object())",
     TypeError, "grad_scaler must be a torch.amp.GradScaler"),
    # --- EngineConfig fields
    ("bucket size zero", "create_gradient_cache(model(), bucket_size_mb=0)", ValueError,
     "Invalid bucket_size_mb: 0; expected a finite number > 0"),
    ("bucket size NaN", "create_gradient_cache(model(), bucket_size_mb=math.nan)", ValueError,
     "Invalid bucket_size_mb: nan"),
    ("unknown selection", 'create_gradient_cache(model(), selection="random")', ValueError,
     "Invalid selection: 'random'; expected one of ['auto', 'threshold', 'exact']"),
    ("unsupported residual dtype", 'create_gradient_cache(model(), residual_dtype="float16")',
     ValueError, "Invalid residual_dtype: 'float16'"),
    ("unsupported value dtype", 'create_gradient_cache(model(), value_dtype="int4")',
     ValueError, "Invalid value_dtype: 'int4'; expected one of ['int8']"),
    ("unknown codec", 'create_gradient_cache(model(), codec="q5")', ValueError,
     "Invalid codec: 'q5'; expected one of ['lossless', 'int8', 'q4', 'q3', 'q2', 'q1', "
     "'sign', 'topk']"),
    ("negative warm-up", "create_gradient_cache(model(), warmup_steps=-1)", ValueError,
     "Invalid warmup_steps: -1; expected an integer >= 0"),
    ("fractional warm-up", "create_gradient_cache(model(), warmup_steps=1.5)", ValueError,
     "Invalid warmup_steps: 1.5"),
    ("min_compress_numel zero", "create_gradient_cache(model(), min_compress_numel=0)",
     ValueError, "Invalid min_compress_numel: 0; expected an integer >= 1"),
    ("host share above 1", "create_gradient_cache(model(), host_memory_fraction=1.5)",
     ValueError, "Invalid host_memory_fraction: 1.5; expected a share of available RAM in (0, 1]"),
    ("host share NaN", "create_gradient_cache(model(), host_memory_fraction=math.nan)",
     ValueError, "Invalid host_memory_fraction: nan"),
    ("staging depth zero", "create_gradient_cache(model(), staging_depth=0)", ValueError,
     "Invalid staging_depth: 0; expected an integer >= 1"),
    ("residual on disk", 'create_gradient_cache(model(), residual_location="disk")', ValueError,
     "Invalid residual_location: 'disk'; expected one of ['host', 'device']"),
    ("unknown backend", 'create_gradient_cache(model(), backend="tpu")', ValueError,
     "Invalid backend: 'tpu'"),
    ("CUDA backend for CPU parameters", 'create_gradient_cache(model(), backend="cuda")',
     ValueError, "backend='cuda' does not match the parameters' device cpu"),
    ("keep_previous_residual not a bool",
     'create_gradient_cache(model(), keep_previous_residual="no")', TypeError,
     "keep_previous_residual must be True or False, got 'no'"),
    ("pin_memory not a bool", 'create_gradient_cache(model(), pin_memory="yes")', TypeError,
     "pin_memory must be True or False, got 'yes'"),
    ("negative pool size", "create_gradient_cache(model(), host_pool_mb=-1)", ValueError,
     "Invalid host_pool_mb: -1"),
    ("memory budget above the device", 'create_gradient_cache(model(), memory_budget="120%")',
     ValueError, "Invalid memory_budget: '120%'; expected a share of the device's memory"),
    ("memory budget without a unit", "create_gradient_cache(model(), memory_budget=20)",
     ValueError, "a number is a share, so at most 1: write bytes with a unit, or a percentage: "
     "'20%' or '20GiB'"),
    ("memory budget as a string without a unit",
     'create_gradient_cache(model(), memory_budget="80")', ValueError,
     "Invalid memory_budget: '80'; expected a share of the device's memory"),
    ("checkpoint_frequency zero", "create_gradient_cache(model(), checkpoint_frequency=0)",
     ValueError, "Invalid checkpoint_frequency: 0; expected an integer >= 1"),
    ("the state offloaded without the fused step",
     "gradient_cache.optimize(offload_optimizer_state=True, fused_step=False)", ValueError,
     "offload_optimizer_state=True needs fused_step=True"),
    # --- codec options (gradient_cache.TopK)
    ("a top-k option without top-k", "create_gradient_cache(model(), error_feedback=False)",
     ValueError, "error_feedback=False does nothing with codec=None at compression_ratio=3: "
     "the codecs it chooses keep no residual. It is an option of the top-k codec: pass "
     "codec=gradient_cache.TopK(error_feedback=False)"),
    ("a top-k option with another codec",
     'create_gradient_cache(model(), codec="q4", residual_dtype="bfloat16")', ValueError,
     "residual_dtype='bfloat16' does nothing with codec='q4': that codec is not top-k"),
    ("a top-k option beside the codec's options",
     'create_gradient_cache(model(), codec=gradient_cache.TopK(), selection="exact")',
     TypeError, "selection='exact' was passed beside codec=TopK("),
    ("a top-k option given to EngineConfig", "EngineConfig(error_feedback=False)", TypeError,
     "it is an option of the top-k codec now, not of EngineConfig. Pass "
     "EngineConfig(codec=gradient_cache.TopK(error_feedback=False))"),
    ("the options class instead of an instance", "EngineConfig(codec=gradient_cache.TopK)",
     TypeError, "codec=TopK is the class; pass an instance: codec=TopK()"),
    ("an unknown top-k option", "gradient_cache.TopK(error_feedbak=False)", TypeError,
     "unexpected keyword argument 'error_feedbak'"),
    # --- the fused step
    ("a model instead of its optimizer", "cache.step(cached_model)", TypeError,
     "optimizer must be a torch.optim.Optimizer"),
    ("optimizer.step() over gradients the cache holds", "sgd.step()", RuntimeError,
     "Call hook_manager.step(optimizer) in place of optimizer.step()"),
    ("optimizer.step() with the state on the host: apply_gradients() is refused there",
     "m = model(); c = create_gradient_cache(m, offload_optimizer_state=True); "
     "m(torch.randn(2, 4)).sum().backward(); torch.optim.SGD(m.parameters(), lr=0.1).step()",
     RuntimeError, "in place of optimizer.step() (the fused step)."),
    ("a second optimizer's step over gradients another step took",
     "cache.step(sgd); cache.step(torch.optim.SGD(cached_model.parameters(), lr=0.1))",
     RuntimeError, "another optimizer's step already stepped in this step and freed"),
    ("LBFGS in the fused step", "cache.step(torch.optim.LBFGS(cached_model.parameters()))",
     TypeError, "cannot step LBFGS"),
    ("LBFGS in the fused step with the state on the host",
     "m = model(); c = create_gradient_cache(m, offload_optimizer_state=True); "
     "c.step(torch.optim.LBFGS(m.parameters()))",
     TypeError, "With offload_optimizer_state=True it cannot run"),
    ("a parameter frozen at creation unfrozen after it (progressive unfreezing)",
     "m = model(); m.bias.requires_grad_(False); c = create_gradient_cache(m); "
     "m.bias.requires_grad_(True); m(torch.randn(2, 4)).sum().backward()",
     RuntimeError, "('bias' added or unfrozen)"),
    ("LBFGS's own step over gradients the cache holds, the state on the host",
     "m = model(); c = create_gradient_cache(m, offload_optimizer_state=True); "
     "o = torch.optim.LBFGS(m.parameters()); "
     "o.step(lambda: m(torch.randn(2, 4)).sum().backward())",
     RuntimeError, "With offload_optimizer_state=True it cannot run: create the cache without"),
    ("clip norm NaN", "cache.step(sgd, max_grad_norm=math.nan)", ValueError,
     "Invalid max_grad_norm: nan; expected a number > 0"),
    ("clip norm negative", "cache.step(sgd, max_grad_norm=-1)", ValueError,
     "Invalid max_grad_norm: -1"),
    ("norm type zero", "cache.step(sgd, norm_type=0)", ValueError,
     "Invalid norm_type: 0; expected a number > 0 or inf"),
    ("clip norm a tensor of two elements", "cache.step(sgd, max_grad_norm=torch.ones(2))",
     ValueError, "Invalid max_grad_norm: tensor"),
    ("norm type -inf", "cache.step(sgd, norm_type=-math.inf)", ValueError,
     "Invalid norm_type: -inf"),
    ("clipping twice: clip_grads_with_norm_, then step(max_grad_norm=)",
     "cache.clip_grads_with_norm_(cached_model.parameters(), 1.0, "
     "cache.gradient_norm(cached_model.parameters())); cache.step(sgd, max_grad_norm=1.0)",
     ValueError, "clip once, with one or the other"),
    ("a reader of every gradient with the state on the host",
     "m = model(); c = create_gradient_cache(m, offload_optimizer_state=True); "
     "m(torch.randn(2, 4)).sum().backward(); torch.nn.utils.clip_grad_value_(m.parameters(), 1)",
     RuntimeError, "Clip with hook_manager.step(optimizer, max_grad_norm=...)"),
    # --- order of calls and lifetime
    ("a closed manager", "closed.apply_gradients()", RuntimeError,
     "was closed by remove_hooks()"),
    ("loading a model's state_dict into the cache",
     "cache.load_state_dict(cached_model.state_dict())", TypeError,
     "expects the dict that GradientCacheHookManager.state_dict() returned"),
    ("loading with a step pending", "cache.load_state_dict(cache.state_dict())", RuntimeError,
     "needs a manager with no step pending"),
    ("a checkpoint saved by a newer version",
     'fresh.load_state_dict({**fresh.state_dict(), "format_version": 99})', ValueError,
     "it was saved by a newer gradient-cache, upgrade to load it"),
    ("a checkpoint with an edited step count",
     'fresh.load_state_dict({**fresh.state_dict(), "steps": -1})', ValueError,
     "state['steps'] is -1; expected a whole number >= 0"),
    ("a checkpoint made with other settings",
     "fresh.load_state_dict(create_gradient_cache(model(), compression_ratio=1).state_dict())",
     ValueError, "(compression_ratio: checkpoint 1.0, this manager 3.0)"),
    ("manager_of outside a decorated function", "gradient_cache.manager_of(model())",
     RuntimeError, "works only while a function decorated with gradient_cache.optimize runs"),
    ("the decorator without parentheses", "gradient_cache.optimize(lambda: None)", TypeError,
     "write @gradient_cache.optimize() or"),
    # --- offload_parameters (the weights on the host)
    ("the weights without the state", "EngineConfig(offload_parameters=True)", ValueError,
     "offload_parameters=True needs offload_optimizer_state=True"),
    ("the weights without the fused step",
     "gradient_cache.optimize(offload_optimizer_state=True, offload_parameters=True, "
     "fused_step=False)", ValueError, "offload_optimizer_state=True needs fused_step=True"),
    ("a model without blocks",
     "create_gradient_cache(model(), offload_optimizer_state=True, offload_parameters=True)",
     ValueError, "found no blocks in Linear"),
    ("blocks named wrong",
     "create_gradient_cache(torch.nn.Sequential(model(), model()), offload_optimizer_state=True, "
     "offload_parameters=True, parameter_blocks='layers')", ValueError,
     "parameter_blocks='layers' names no module of Sequential"),
    ("one block repeated at every depth (ALBERT)",
     "b = model(); m = torch.nn.Sequential(b, b, b); "
     "create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True)",
     ValueError, "Here Sequential holds one module 3 times"),
    ("the weights with exclude_layers",
     "create_gradient_cache(torch.nn.Sequential(model(), model()), exclude_layers=['0.'], "
     "offload_optimizer_state=True, offload_parameters=True)", ValueError,
     "cannot be combined with offload_parameters=True"),
    ("a parameter viewing a larger tensor",
     "m = torch.nn.Sequential(model(), model()); "
     "m[0].bias = torch.nn.Parameter(torch.zeros(8)[:4]); "
     "create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True)",
     ValueError, "'0.bias': it is a view of a larger tensor"),
    ("a compute dtype without the weights", "EngineConfig(compute_dtype=torch.bfloat16)",
     ValueError, "acts only with offload_parameters=True"),
    ("a compute dtype over a sparse embedding",
     "m = torch.nn.Sequential(torch.nn.Embedding(8, 4, sparse=True), model()); "
     "create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True, "
     "compute_dtype=torch.bfloat16)",
     ValueError, "module '0' (nn.Embedding(sparse=True)) gives one in the compute dtype"),
    ("blocks named by a module, not its list",
     "m = torch.nn.Module(); m.body = torch.nn.Module(); "
     "m.body.layers = torch.nn.ModuleList([model(), model()]); "
     "create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True, "
     "parameter_blocks='body')", ValueError,
     "parameter_blocks='body' names a Module, not the nn.ModuleList or nn.Sequential"),
    ("the weights of a model on several devices",
     "m = torch.nn.Sequential(model(), model()); "
     "m[1].weight = torch.nn.Parameter(torch.empty(4, 4, device='meta')); "
     "create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True)",
     ValueError, "Put the whole model on one device"),
    ("autocast around the weights on the host",
     "m = torch.nn.Sequential(model(), model()); "
     "c = create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True); "
     "torch.autocast('cpu', dtype=torch.bfloat16)(m)(torch.randn(2, 4))",
     RuntimeError, "Pass compute_dtype=torch.bfloat16 to the cache instead"),
    ("a gradient penalty with the weights on the host",
     "m = torch.nn.Sequential(model(), model()); "
     "c = create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True); "
     "torch.autograd.grad(m(torch.randn(2, 4)).sum(), list(m.parameters()), "
     "create_graph=True)", RuntimeError, "A backward with create_graph=True"),
    ("pickling a model whose weights are on the host",
     "import io; m = torch.nn.Sequential(model(), model()); "
     "c = create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True); "
     "torch.save(m, io.BytesIO())", TypeError, "Save model.state_dict() instead"),
    ("a backward onto gradients a step left",
     "m = torch.nn.Sequential(model(), model()); c = create_gradient_cache(m); "
     "a = torch.optim.SGD(m[0].parameters(), lr=0.1); "
     "b = torch.optim.SGD(m[1].parameters(), lr=0.1); m(torch.randn(2, 4)).sum().backward(); "
     "c.step(a); m(torch.randn(2, 4)).sum().backward()", RuntimeError,
     "call hook_manager.discard_gradients() to drop them"),
    ("a clip between micro-batches with the weights on the host",
     "m = torch.nn.Sequential(model(), model()); "
     "c = create_gradient_cache(m, offload_optimizer_state=True, offload_parameters=True); "
     "m(torch.randn(2, 4)).sum().backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); "
     "m(torch.randn(2, 4)).sum().backward()", RuntimeError,
     "Clip once, after the step's last backward"),
    ("a weight tied to another after creation",
     "m = torch.nn.Sequential(model(), model()); c = create_gradient_cache(m); "
     "m[1].weight = m[0].weight; m(torch.randn(2, 4))", RuntimeError,
     "'1.weight' removed (or tied to another parameter)"),
    ("a GradScaler that scaled no loss",
     "m = model(); s = torch.amp.GradScaler('cpu'); c = create_gradient_cache(m, grad_scaler=s); "
     "m(torch.randn(2, 4)).sum().backward(); c.step(torch.optim.SGD(m.parameters(), lr=0.1))",
     RuntimeError, "backpropagate scaler.scale(loss), not the loss"),
    ("fp16 parameters with a GradScaler",
     "m = model().half(); s = torch.amp.GradScaler('cpu'); "
     "c = create_gradient_cache(m, grad_scaler=s); "
     "s.scale(m(torch.randn(2, 4).half()).sum()).backward(); "
     "c.step(torch.optim.SGD(m.parameters(), lr=0.1))",
     ValueError, "Attempting to unscale FP16 gradients."),
    ("state_dict() between a skipped step and scaler.update()",
     "m = model(); s = torch.amp.GradScaler('cpu'); c = create_gradient_cache(m, grad_scaler=s); "
     "s.scale(m(torch.randn(2, 4)).sum() * math.inf).backward(); "
     "c.step(torch.optim.SGD(m.parameters(), lr=0.1)); c.state_dict()",
     RuntimeError, "call state_dict() after scaler.update()"),
]  # fmt: skip


def namespace() -> dict:
    """What a case's code can use: ``model()`` builds a fresh Linear; ``cached_model`` has
    a live manager ``cache`` and a backward done; ``sgd`` steps it; ``closed`` is removed;
    ``fresh`` manages a Linear with the default settings and has nothing pending."""
    torch.manual_seed(0)
    cached_model = torch.nn.Linear(4, 4)
    cache = create_gradient_cache(cached_model, compression_ratio=1)
    cached_model(torch.randn(2, 4)).sum().backward()
    closed = create_gradient_cache(torch.nn.Linear(4, 4))
    closed.remove_hooks()
    fresh = create_gradient_cache(torch.nn.Linear(4, 4))
    return dict(
        torch=torch,
        math=math,
        gradient_cache=gradient_cache,
        create_gradient_cache=create_gradient_cache,
        GradientCacheHookManager=GradientCacheHookManager,
        EngineConfig=EngineConfig,
        model=lambda: torch.nn.Linear(4, 4),
        cached_model=cached_model,
        cache=cache,
        sgd=torch.optim.SGD(cached_model.parameters(), lr=0.1),
        closed=closed,
        fresh=fresh,
    )


@pytest.mark.parametrize(("wrong", "code", "error", "excerpt"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_its_message(wrong, code, error, excerpt) -> None:
    with pytest.raises(error, match=re.escape(excerpt)):
        exec(code, namespace())


def table() -> str:
    lines = ["| # | what is wrong | code | raises | message (excerpt) |", "|---:|---|---|---|---|"]
    for number, (wrong, code, error, excerpt) in enumerate(CASES, 1):
        lines.append(f"| {number} | {wrong} | `{code}` | `{error.__name__}` | {excerpt} |")
    return "\n".join(lines)


def test_the_docs_table_matches() -> None:
    assert len(CASES) >= 25
    assert table() in DOCS.read_text(), (
        "docs/bad-inputs.md is stale: python tests/test_bad_inputs.py"
    )


if __name__ == "__main__":
    print(table())


def test_gradients_cached_before_a_cast_come_back_in_the_models_new_dtype() -> None:
    """A model cast after its cache was created (refused at its next forward) gets its
    cached gradients back at remove_hooks in its new dtype, as model.to() casts a plain
    model's .grad (assigned as they were cached, they raised, inside the finalizer of a
    dropped manager too)."""
    models = []
    for cached in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        cache = create_gradient_cache(net, compression_ratio=1) if cached else None
        net(torch.randn(2, 4)).sum().backward()
        net.to(torch.bfloat16)
        if cache is not None:
            cache.remove_hooks()
        models.append(net)
    for plain, restored in zip(*(m.parameters() for m in models), strict=True):
        assert restored.grad.dtype == torch.bfloat16 and torch.equal(plain.grad, restored.grad)
