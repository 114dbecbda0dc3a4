"""Weight streamers on one process, run on this machine: what each costs and what breaks.

    python -m perf.weight_streamers                     # TinyGPT "small", 10 timed steps
    python -m perf.weight_streamers --model tiny --steps 3 --json perf/results/streamers.json

A weight streamer keeps a model's weights off the device and brings each block's weights
to it around the block's compute. Evaluated here, each in a fresh process of its own:

* ``FSDP2 CPUOffloadPolicy``: PyTorch's own, ``fully_shard(block, offload_policy=
  CPUOffloadPolicy(pin_memory=False))`` on every block and the root, on a one-process gloo
  group (``dist.HashStore()``: no address, port or environment variable). Pinning needs an
  accelerator; on a GPU the glue would pin and use ``"cpu:gloo,cuda:nccl"`` (not run here).

* ``gradient-cache offload_parameters``: this project's module hooks,
  ``create_gradient_cache(model, compression_ratio=1, offload_optimizer_state=True,
  offload_parameters=True)`` and ``hook_manager.step(optimizer)``: the weights, the
  gradients and the optimizer state on the host, the step on the device.

A streamer is one function (`Streamer`): the glue a library would run on the user's model,
returning the model to call and how the optimizer steps (`Streaming`). Adding one is one
function and one entry in `STREAMERS`, e.g. ``STREAMERS["module hooks"] =
Streamer(hooks_glue)``; it gets its own fresh process and its column in the table.

Each is compared with plain PyTorch on the same seed and batches (TinyGPT, tied
embeddings, AdamW), in the same process, step by step:

* the median step time of each, paired round by round (on a CPU the "device" is the host:
  a copy of the weights is a copy within RAM, not over a link);
* whether the final weights equal plain's bit for bit (``torch.equal`` on full tensors);
* the checks, each run (not read from the source) and isolated: an exception is recorded
  (its type and first line) and the next check runs. `CHECKS` lists them in order.

No device peak is reported: on a CPU the "device" and the host are the same memory.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import os
import re
import statistics
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import gradient_cache
from gradient_cache.demo.models import GPT_SIZES, GPTConfig, TinyGPT, make_batches

LR = 1e-3
CLIP = 0.05  # below the gradients' norm on every model here, so clipping changes the step
CHECK_STEPS = 2  # steps each check trains: enough for AdamW's state to matter
# The variables env:// rendezvous reads; removed in the worker, as in a user's process.
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")

Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[torch.optim.Optimizer, "float | None"], "torch.Tensor | None"]


@dataclass
class Streaming:
    """A model a streamer set up: what the user calls, and how its optimizer steps.

    ``step(optimizer, max_grad_norm)`` clips when ``max_grad_norm`` is given (returning the
    total norm as a plain tensor), steps and zeroes the gradients.
    """

    model: nn.Module
    step: Step


@dataclass(frozen=True)
class Streamer:
    """``setup``: the library's glue, run on the user's model.

    ``bare``: the streamer's own call without the glue's process group, for the first
    check (None when the streamer needs no group).
    """

    setup: Callable[[TinyGPT], Streaming]
    bare: Callable[[TinyGPT], object] | None = None
    #: Where the glue's lines are, when ``setup`` hands the work to another function.
    glue: Callable[..., Any] | None = None


@dataclass(frozen=True)
class Config:
    model: GPTConfig
    batch_size: int
    steps: int  # timed steps, after one warm-up step


# --- the streamers -------------------------------------------------------------


def plain_step(model: nn.Module) -> Step:
    """PyTorch's loop: ``clip_grad_norm_`` (a DTensor norm made whole), then the step."""

    def step(optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> torch.Tensor | None:
        norm = None
        if max_grad_norm is not None:
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        optimizer.step()
        optimizer.zero_grad()
        return norm

    return step


def plain(model: TinyGPT) -> Streaming:
    return Streaming(model, plain_step(model))


def fsdp2_cpu_offload(model: TinyGPT) -> Streaming:
    """FSDP2 with its weights on the host, on one process, with no group of the user's."""
    if not dist.is_initialized():
        # FSDP2 needs a default group; one process and an in-memory store need no rendezvous.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning raises without an accelerator
    for block in model.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return Streaming(model, plain_step(model))


def fsdp2_without_group(model: TinyGPT) -> object:
    return fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))


def module_hooks(model: TinyGPT) -> Streaming:
    """gradient-cache's own streamer: the weights, gradients and state on the host."""
    return fused_step(model, offload_parameters=True)


def state_only(model: TinyGPT) -> Streaming:
    """gradient-cache without the weights (the reference for what streaming them costs):
    the gradients and the state on the host."""
    return fused_step(model, offload_parameters=False)


def fused_step(model: TinyGPT, *, offload_parameters: bool) -> Streaming:
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=1,
        offload_optimizer_state=True,
        offload_parameters=offload_parameters,
    )

    def step(optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> torch.Tensor | None:
        norm = manager.step(optimizer, max_grad_norm=max_grad_norm)
        optimizer.zero_grad()
        return norm

    return Streaming(model, step)


STREAMERS = {
    "FSDP2 CPUOffloadPolicy": Streamer(fsdp2_cpu_offload, bare=fsdp2_without_group),
    "gradient-cache offload_parameters": Streamer(module_hooks, glue=fused_step),
    "gradient-cache, state only": Streamer(state_only, glue=fused_step),
}


def glue_lines(function: Callable[..., Any]) -> int:
    """Lines of code in ``function``: its signature and body, no docstring, comment or blank."""
    source = textwrap.dedent(inspect.getsource(function))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    skipped: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        skipped = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines = source.splitlines()
    return sum(
        1
        for number, line in enumerate(lines, start=1)
        if number not in skipped and line.strip() and not line.strip().startswith("#")
    )


# --- training --------------------------------------------------------------------


def make_model(config: Config, *, activation_checkpointing: bool = False, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(config.model, activation_checkpointing=activation_checkpointing)


def batches(config: Config, count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.model.vocab_size, (20_000,), generator=generator)
    return [
        make_batches(
            tokens, batch_size=config.batch_size, seq_len=config.model.seq_len, generator=generator
        )
        for _ in range(count)
    ]


def train_step(
    streaming: Streaming,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    max_grad_norm: float | None = None,
) -> torch.Tensor | None:
    _, loss = streaming.model(*batch)
    loss.backward()
    return streaming.step(optimizer, max_grad_norm)


def train(
    streaming: Streaming,
    data: list[Batch],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    max_grad_norm: float | None = None,
) -> list[torch.Tensor | None]:
    """AdamW over ``data`` (built on the streamed model unless given); the norms."""
    optimizer = optimizer or torch.optim.AdamW(streaming.model.parameters(), lr=LR)
    return [train_step(streaming, optimizer, batch, max_grad_norm) for batch in data]


def full_weights(model: nn.Module) -> list[torch.Tensor]:
    """The whole of each parameter, in ``parameters()`` order, as plain tensors."""
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def bit_for_bit(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(
        torch.equal(a, b) for a, b in zip(left, right, strict=True)
    )


def plain_weights(config: Config, data: list[Batch], **options: Any) -> list[torch.Tensor]:
    """Plain PyTorch's weights after training on ``data``; options as in `train`."""
    checkpointing = options.pop("activation_checkpointing", False)
    streaming = plain(make_model(config, activation_checkpointing=checkpointing))
    train(streaming, data, **options)
    return full_weights(streaming.model)


def timed_comparison(streamer: Streamer, config: Config) -> dict[str, Any]:
    """Plain and the streamer, a step each per round (alternating which goes first): the
    median times of the whole step and of its two parts (forward and backward; the
    optimizer's step), the whole step's paired ratio, and whether the final weights are
    equal."""
    data = batches(config, config.steps + 1)
    runs = {"plain": plain(make_model(config)), "streamer": streamer.setup(make_model(config))}
    optimizers = {
        name: torch.optim.AdamW(run.model.parameters(), lr=LR) for name, run in runs.items()
    }
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "streamer": []}
    for index, batch in enumerate(data):
        order = ["plain", "streamer"] if index % 2 == 0 else ["streamer", "plain"]
        for name in order:
            start = time.perf_counter()
            _, loss = runs[name].model(*batch)
            loss.backward()
            middle = time.perf_counter()
            runs[name].step(optimizers[name], None)
            if index > 0:  # the first step allocates the state and runs lazy inits
                times[name].append((middle - start, time.perf_counter() - middle))
    ratios = [
        sum(ours) / sum(theirs)
        for ours, theirs in zip(times["streamer"], times["plain"], strict=True)
    ]
    medians = {
        f"{name}_{part}_ms": 1000 * statistics.median(pick(t) for t in times[name])
        for name in times
        for part, pick in (
            ("step", sum),
            ("backward", lambda t: t[0]),
            ("optimizer", lambda t: t[1]),
        )
    }
    return medians | {
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "bit_for_bit": bit_for_bit(
            full_weights(runs["plain"].model), full_weights(runs["streamer"].model)
        ),
    }


# --- the checks, in the order they run ---------------------------------------------
# Each takes the streamer and the config and returns its facts, "summary" among them.


def check_process_group(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(1) Run first, in a process with no group: the bare call, then the glue."""
    facts: dict[str, Any] = {"group_before": dist.is_initialized()}
    bare = streamer.bare
    facts["bare"] = "not applicable" if bare is None else outcome(lambda: bare(make_model(config)))
    streamer.setup(make_model(config))
    facts["group_after_glue"] = dist.is_initialized()
    facts["user_init_after"] = outcome(
        lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    )
    if facts["user_init_after"] == "runs":  # a glue without a group: the next checks neither
        dist.destroy_process_group()
    facts["summary"] = (
        f"without a group: {facts['bare']}; the glue leaves a global group: "
        f"{facts['group_after_glue']}; the user's own init_process_group then: "
        f"{facts['user_init_after']}"
    )
    return facts


def check_parameters(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(2) The parameters' type, and an optimizer built before the glue."""
    model = make_model(config)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    streaming = streamer.setup(model)
    types = sorted({type(p).__name__ for p in streaming.model.parameters()})
    train(streaming, batches(config, CHECK_STEPS), optimizer=optimizer)
    after = full_weights(streaming.model)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    facts = {
        "types": types,
        "optimizer_holds_model_parameters": all(id(p) in held for p in model.parameters()),
        "early_optimizer_trains": not bit_for_bit(before, after),
    }
    facts["summary"] = (
        f"parameters are {'/'.join(types)}; an optimizer built before the glue "
        f"{'trains the model' if facts['early_optimizer_trains'] else 'leaves the model untrained'}"
        f" (holds the model's parameters: {facts['optimizer_holds_model_parameters']})"
    )
    return facts


def check_state_dict(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(3) ``model.state_dict()``'s values, and a plain model loading them."""
    streaming = streamer.setup(make_model(config))
    train(streaming, batches(config, CHECK_STEPS))
    state = streaming.model.state_dict()
    facts: dict[str, Any] = {
        "types": sorted({type(v).__name__ for v in state.values()}),
        "devices": sorted({str(v.device) for v in state.values()}),
    }
    target = make_model(config)
    facts["plain_load"] = outcome(lambda: target.load_state_dict(state))
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    facts["plain_load_full_tensors"] = outcome(lambda: target.load_state_dict(whole))
    facts["loaded_bit_for_bit"] = bit_for_bit(full_weights(target), full_weights(streaming.model))
    facts["summary"] = (
        f"values are {'/'.join(facts['types'])} on {'/'.join(facts['devices'])}; "
        f"a plain model's load_state_dict: {facts['plain_load']}; of full_tensor()s: "
        f"{facts['plain_load_full_tensors']}, bit for bit: {facts['loaded_bit_for_bit']}"
    )
    return facts


def check_activation_checkpointing(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(4) Non-reentrant ``torch.utils.checkpoint`` on each block, against plain with it."""
    data = batches(config, CHECK_STEPS)
    streaming = streamer.setup(make_model(config, activation_checkpointing=True))
    train(streaming, data)
    equal = bit_for_bit(
        full_weights(streaming.model), plain_weights(config, data, activation_checkpointing=True)
    )
    return {"bit_for_bit": equal, "summary": f"runs; bit for bit with plain: {equal}"}


def check_compile(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(5) ``torch.compile`` of the whole model with the "eager" backend (each captured
    graph runs as is): weights against plain eager; the graphs Dynamo captured, how often
    they ran, and why it broke the graph (Dynamo's own counters), against plain's."""
    data = batches(config, CHECK_STEPS)
    graphs: dict[str, dict[str, Any]] = {}
    for name, setup in (("plain", plain), ("streamer", streamer.setup)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        graphs[name] = {"nodes": [], "runs": 0}
        streaming = setup(make_model(config))
        compiled = cast(
            nn.Module, torch.compile(streaming.model, backend=eager_counting(graphs[name]))
        )
        train(Streaming(compiled, streaming.step), data)
        graphs[name]["breaks"] = [_break_reason(text) for text in _graph_breaks()]
        graphs[name]["weights"] = full_weights(streaming.model)
    ours, theirs = graphs["streamer"], graphs["plain"]
    facts = {
        "bit_for_bit": bit_for_bit(ours["weights"], plain_weights(config, data)),
        "graph_nodes": ours["nodes"],
        "graph_runs_per_forward": ours["runs"] / CHECK_STEPS,
        "graph_breaks": ours["breaks"],
        "plain": {key: theirs[key] for key in ("nodes", "runs", "breaks")},
    }
    facts["summary"] = (
        f"runs; bit for bit with plain eager: {facts['bit_for_bit']}; captured graphs' nodes "
        f"{ours['nodes']}, run {ours['runs'] // CHECK_STEPS}x a forward (plain: "
        f"{theirs['nodes']}, {theirs['runs'] // CHECK_STEPS}x); graph breaks: "
        + ("; ".join(ours["breaks"]) or "none")
    )
    return facts


def eager_counting(record: dict[str, Any]) -> Callable[..., Any]:
    """A backend that runs each graph as is (as backend="eager"), counting graphs and runs."""

    def backend(graph: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        record["nodes"].append(len(graph.graph.nodes))

        def run(*args: Any) -> Any:
            record["runs"] += 1
            return graph.forward(*args)

        return run

    return backend


def _graph_breaks() -> list[str]:
    """Dynamo's reasons for the graph breaks since its counters were cleared."""
    return list(torch._dynamo.utils.counters["unimplemented"])


def _break_reason(text: str) -> str:
    """A reason's first line, the function it would not trace, and the frame it skipped."""
    parts = [text.strip().splitlines()[0]]
    function = re.search(r"qualname: ([\w.]+)", text)
    if function:
        parts.append(f"({function.group(1)})")
    skipped = re.search(r"frame skipped: (\w+) \((?:.*/)?([^/]+ line \d+)\)", text)
    if skipped:
        parts.append(f"-> frame {skipped.group(1)} ({skipped.group(2)}) skipped, run eager")
    return " ".join(parts)


def check_step_device(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(7) Where the user's optimizer steps: its parameters' and state's devices then."""
    streaming = streamer.setup(make_model(config))
    seen: dict[str, set[str]] = {"parameters": set(), "state": set()}

    class Recorded(torch.optim.AdamW):
        """Records in its own ``step``, which a fused step runs once a bucket (its step
        hooks fire once, before the first bucket, where nothing is on the device yet)."""

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:  # not in the bucket this update steps
                        continue
                    seen["parameters"].add(str(local(p).device))
                    for value in self.state[p].values():
                        seen["state"].add(str(local(value).device))
            return super().step(closure)

    optimizer = Recorded(streaming.model.parameters(), lr=LR)
    train(streaming, batches(config, CHECK_STEPS), optimizer=optimizer)
    facts: dict[str, Any] = {name: sorted(devices) for name, devices in seen.items()}
    facts["summary"] = (
        f"parameters on {'/'.join(facts['parameters'])}, state on {'/'.join(facts['state'])}"
        " (this machine's compute device is the CPU too)"
    )
    return facts


def check_clipping(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(8) ``clip_grad_norm_`` at a norm that clips: the norms and weights against plain's,
    and the type it returns on the streamed model's parameters."""
    data = batches(config, CHECK_STEPS)
    streaming = streamer.setup(make_model(config))
    norms = [n for n in train(streaming, data, max_grad_norm=CLIP) if n is not None]
    reference = plain(make_model(config))
    plain_norms = [n for n in train(reference, data, max_grad_norm=CLIP) if n is not None]
    facts: dict[str, Any] = {
        "norms_equal": all(torch.equal(a, b) for a, b in zip(norms, plain_norms, strict=True)),
        "clipped": min(float(n) for n in plain_norms) > CLIP,
        "bit_for_bit": bit_for_bit(full_weights(streaming.model), full_weights(reference.model)),
    }
    _, loss = streaming.model(*data[0])
    loss.backward()
    returned = nn.utils.clip_grad_norm_(streaming.model.parameters(), CLIP)
    facts["returns"] = type(returned).__name__
    facts["summary"] = (
        f"returns a {facts['returns']}; norms (made whole) bit for bit with plain's: "
        f"{facts['norms_equal']}; weights bit for bit: {facts['bit_for_bit']}"
    )
    return facts


def check_accumulation(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(9) Two micro-batches a step, each loss halved: the weights against plain's."""
    data = batches(config, 2 * CHECK_STEPS)

    def accumulate(streaming: Streaming) -> list[torch.Tensor]:
        optimizer = torch.optim.AdamW(streaming.model.parameters(), lr=LR)
        for step in range(CHECK_STEPS):
            for batch in data[2 * step : 2 * step + 2]:
                _, loss = streaming.model(*batch)
                (loss / 2).backward()
            streaming.step(optimizer, None)
        return full_weights(streaming.model)

    equal = bit_for_bit(
        accumulate(streamer.setup(make_model(config))), accumulate(plain(make_model(config)))
    )
    return {"bit_for_bit": equal, "summary": f"runs; bit for bit with plain: {equal}"}


def check_resume(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(10) The model's and the optimizer's state_dicts after 2 steps, through torch.save,
    loaded into a new streamed model (another seed) and optimizer, 2 more steps: against
    4 uninterrupted ones."""
    data = batches(config, 2 * CHECK_STEPS)
    streaming = streamer.setup(make_model(config))
    optimizer = torch.optim.AdamW(streaming.model.parameters(), lr=LR)
    train(streaming, data[:CHECK_STEPS], optimizer=optimizer)
    saved = io.BytesIO()
    torch.save({"model": streaming.model.state_dict(), "optim": optimizer.state_dict()}, saved)
    train(streaming, data[CHECK_STEPS:], optimizer=optimizer)
    saved.seek(0)
    state = torch.load(saved, weights_only=False)  # our own bytes: DTensors among them
    resumed = streamer.setup(make_model(config, seed=1))
    resumed.model.load_state_dict(state["model"])
    resumed_optimizer = torch.optim.AdamW(resumed.model.parameters(), lr=LR)
    resumed_optimizer.load_state_dict(state["optim"])
    train(resumed, data[CHECK_STEPS:], optimizer=resumed_optimizer)
    equal = bit_for_bit(full_weights(resumed.model), full_weights(streaming.model))
    return {"bit_for_bit": equal, "summary": f"runs; bit for bit with uninterrupted: {equal}"}


def check_destroy_group(streamer: Streamer, config: Config) -> dict[str, Any]:
    """(6) Run last: ``dist.destroy_process_group()``, then a clipped step and an eval."""
    streaming = streamer.setup(make_model(config))
    optimizer = torch.optim.AdamW(streaming.model.parameters(), lr=LR)
    first, second = batches(config, 2)
    train_step(streaming, optimizer, first)
    facts: dict[str, Any] = {"destroy": outcome(dist.destroy_process_group)}

    def evaluate() -> None:
        with torch.no_grad():
            streaming.model(*second)

    facts["train_step_after"] = outcome(lambda: train_step(streaming, optimizer, second, CLIP))
    facts["eval_after"] = outcome(evaluate)
    facts["summary"] = (
        f"destroy: {facts['destroy']}; then a clipped training step: "
        f"{facts['train_step_after']}; an eval forward: {facts['eval_after']}"
    )
    return facts


CHECKS: dict[str, Callable[[Streamer, Config], dict[str, Any]]] = {
    "1 process group": check_process_group,
    "2 parameters, optimizer built before": check_parameters,
    "3 state_dict": check_state_dict,
    "4 activation checkpointing": check_activation_checkpointing,
    "5 torch.compile (eager)": check_compile,
    "7 optimizer step's device": check_step_device,
    "8 clip_grad_norm_": check_clipping,
    "9 accumulation (2 micro-batches)": check_accumulation,
    "10 resume from state_dicts": check_resume,
    "6 destroy_process_group": check_destroy_group,  # last: it ends the group
}


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def outcome(action: Callable[[], object]) -> str:
    """Whether ``action`` runs: "runs", or the exception's type and first line."""
    try:
        action()
    except Exception as error:  # recorded: what breaks is the finding
        return headline(error)
    return "runs"


def headline(error: Exception) -> str:
    """The type and the first line; for ``load_state_dict``'s list, its first cause."""
    message = str(error).strip()
    cause = re.search(r"an exception occurred : \('(.*?)',\)", message)
    first_line = (message.splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}" + (f" {cause.group(1)}" if cause else "")


def run_check(check: Callable[[Streamer, Config], dict[str, Any]], *args: Any) -> dict[str, Any]:
    """One check, isolated: an unexpected exception becomes its finding."""
    try:
        return check(*args)
    except Exception as error:
        return {"error": traceback.format_exc(), "summary": f"raises {headline(error)}"}


# --- one fresh process per streamer -----------------------------------------------


def evaluate(name: str, config: Config) -> dict[str, Any]:
    """The first check, the timed comparison (after the glue set its group up), the rest.

    Run in a fresh process: the checks start with no process group and end by destroying
    it.
    """
    streamer = STREAMERS[name]
    first, *rest = CHECKS
    checks = {first: run_check(CHECKS[first], streamer, config)}
    timed = run_check(timed_comparison, streamer, config)
    checks |= {check: run_check(CHECKS[check], streamer, config) for check in rest}
    return {
        "glue_lines": glue_lines(streamer.glue or streamer.setup),
        "timed": timed,
        "checks": checks,
    }


def _worker(_: int, name: str, config: Config, out: str) -> None:
    for variable in RENDEZVOUS_VARIABLES:
        os.environ.pop(variable, None)
    torch.set_num_threads(1)  # the machine's cores are shared; one thread is one bit pattern
    results = evaluate(name, config)
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.save(results, Path(out) / "results.pt")


def evaluate_in_fresh_process(name: str, config: Config) -> dict[str, Any]:
    """`evaluate` in a new interpreter: no process group, no compile cache, no env vars."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(name, config, out), nprocs=1)
        return torch.load(Path(out) / "results.pt", weights_only=False)


PARTS = {"step": "step", "backward": "forward + backward", "optimizer": "optimizer step"}


def milliseconds(part: str) -> Callable[[dict[str, Any]], str]:
    """A cell of the timed comparison: the streamer's median ``part``, plain's in brackets."""
    return lambda t: f"{t[f'streamer_{part}_ms']:.1f} ({t[f'plain_{part}_ms']:.1f})"


def to_markdown(config: Config, results: dict[str, dict[str, Any]]) -> str:
    """One column per streamer: the timed comparison's rows, the glue, then each check."""

    def timed_row(label: str, cell: Callable[[dict[str, Any]], str]) -> str:
        cells = [
            r["timed"]["summary"] if "error" in r["timed"] else cell(r["timed"])
            for r in results.values()
        ]
        return f"| {label} | {' | '.join(cells)} |"

    lines = [
        f"| | {' | '.join(results)} |",
        f"|---|{'---|' * len(results)}",
        *(
            timed_row(f"median {label}, ms (plain's)", milliseconds(part))
            for part, label in PARTS.items()
        ),
        timed_row(
            "step time / plain's, paired median (range)",
            lambda t: f"{t['ratio']:.2f}x ({t['ratio_range'][0]:.2f}-{t['ratio_range'][1]:.2f})",
        ),
        timed_row(
            f"weights after {config.steps + 1} AdamW steps bit for bit with plain's",
            lambda t: str(t["bit_for_bit"]),
        ),
        "| lines of glue | " + " | ".join(str(r["glue_lines"]) for r in results.values()) + " |",
    ]
    for check in CHECKS:
        cells = [r["checks"][check]["summary"] for r in results.values()]
        lines.append(f"| {check} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(GPT_SIZES), default="small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after one warm-up")
    parser.add_argument(
        "--streamers", nargs="+", choices=sorted(STREAMERS), default=list(STREAMERS)
    )
    parser.add_argument("--json", type=Path, help="also write every fact here")
    args = parser.parse_args()
    config = Config(GPT_SIZES[args.model], args.batch_size, args.steps)
    results = {name: evaluate_in_fresh_process(name, config) for name in args.streamers}
    print(
        f"TinyGPT {args.model} ({sum(p.numel() for p in make_model(config).parameters()):,} "
        f"parameters), batch {args.batch_size} x {config.model.seq_len}, AdamW lr {LR}, "
        f"one thread, torch {torch.__version__}; CPU: copies within RAM"
    )
    print(to_markdown(config, results))
    for name, result in results.items():
        for check, facts in {"timed": result["timed"], **result["checks"]}.items():
            if "error" in facts:
                print(f"\n{name}, {check}:\n{facts['error']}")
    if args.json:
        serial = {"config": dataclasses.asdict(config), "results": results}
        args.json.write_text(json.dumps(serial, indent=1, default=str))


if __name__ == "__main__":
    main()
