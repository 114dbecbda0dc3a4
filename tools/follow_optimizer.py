"""Follow ``optimizer`` through the step at run time: which files does a reader go through?

    python tools/follow_optimizer.py [--max-comebacks N] [--max-entries M] [--first-pass]
                                                                          (project root)

Issue 42 ("House v5") measures how hard the step is to follow as "following `optimizer`
from the manager's `step` through the calls that pass it on". This tool replays that walk
on a real CPU step, so the figure is measured, not counted by hand:

* a *followed frame* is a Python frame whose code lives in the gradient_cache package and
  that holds the optimizer object itself (``is``) among its arguments (the named ones, and
  the contents of ``*args`` / ``**kwargs``): those are the calls that pass it on;
* the *current file* is the file of the innermost followed frame on the stack; frames in
  between that do not hold it (torch's own, a closure, a helper given something else) are
  passed through, as a reader skips them; so are the frames of `engine/compiled.py`'s
  decorator (``@outside_graphs``, a pass-through as ``torch.compiler.disable``'s was);
* after every call and return of a followed frame the current file is noted; consecutive
  repeats collapse, so the sequence is the order in which a reader's eyes change file;
* *entries* of a file are its runs in that sequence; *comebacks* are entries into a file
  that already appeared earlier (the sum over files of entries - 1).

Two figures per scenario: *every call* (the rule above, as the issue's bounds are checked)
counts the fused step's per-bucket loop once per bucket, so it grows with the bucket
count (here 3); *first pass* reads each function once (a later call of a function already
followed is passed through), which is what a reading of the code counts.

Scenarios: the manager's ``step`` (the main one, the issue's bounds apply to it), the same
with an enabled GradScaler given to the cache, and the integrations' path (a train step
decorated with ``@gradient_cache.optimize`` calling ``optimizer.step()``). Each traces the
second step, after a warm one, so that one-time set-up (allocating the optimizer's state,
first-step norms from the host copies) does not count.

``--max-comebacks`` / ``--max-entries`` make it a check: exit status 1 when any scenario
exceeds either bound (the every-call figures; the first-pass ones with ``--first-pass``).
Only the calling thread is traced: the step passes the optimizer to no other thread.
"""

from __future__ import annotations

import argparse
import collections
import gc
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

import gradient_cache

PACKAGE_DIR = pathlib.Path(gradient_cache.__file__).resolve().parent
# A layer's weight and bias (32 x 32 + 32 floats, 4224 bytes) fill a bucket of 4194 bytes:
# three buckets, so the fused step's loop runs more than once, as in a real model.
BUCKET_SIZE_MB = 0.004
# co_flags bits marking *args and **kwargs (inspect.CO_VARARGS / CO_VARKEYWORDS).
CO_VARARGS, CO_VARKEYWORDS = 0x04, 0x08


@dataclass
class Entry:
    """One run of the collapsed sequence: the file, and the event that made it current."""

    file: str
    how: str  # "call OptimizerStep.step" or "back from StepHooks.__init__", for the report


@dataclass
class Walk:
    """The collapsed file sequence of one traced call under one rule, and its figures.

    ``first_pass=False`` (the issue's rule, as briefed): every call counts, so the fused
    step's per-bucket loop is walked once per bucket. ``first_pass=True``: a reader reads
    a function once; a later call of a function already followed (the loop's next
    buckets) is passed through, like a frame that does not hold the optimizer. That is
    the figure a reading of the code (the issue's manual review) gives."""

    first_pass: bool
    sequence: list[Entry] = field(default_factory=list)
    followed: list[tuple[FrameType, str]] = field(default_factory=list)  # outermost first
    seen: set[CodeType] = field(default_factory=set)

    def enter(self, frame: FrameType, file: str) -> None:
        if self.first_pass and frame.f_code in self.seen:
            return
        self.seen.add(frame.f_code)
        self.followed.append((frame, file))
        self._note(file, f"call {_name(frame.f_code)}")

    def leave(self, frame: FrameType) -> None:
        # A return (or an exception leaving the frame: also a "return" event) hands the
        # reader back to the caller that held the optimizer, wherever that lives.
        if not self.followed or self.followed[-1][0] is not frame:
            return  # not a followed frame (passed through)
        self.followed.pop()
        if self.followed:
            self._note(self.followed[-1][1], f"back from {_name(frame.f_code)}")

    def _note(self, file: str, how: str) -> None:
        # Consecutive repeats collapse: a reader who stays in one file has not moved.
        if not self.sequence or self.sequence[-1].file != file:
            self.sequence.append(Entry(file, how))

    def entries(self) -> dict[str, int]:
        """Per file, how many times it was entered (its runs), in order of first entry."""
        return dict(collections.Counter(entry.file for entry in self.sequence))

    def comebacks(self) -> int:
        return sum(count - 1 for count in self.entries().values())

    def most_entered(self) -> tuple[str, int]:
        entries = self.entries()
        file = max(entries, key=lambda f: entries[f], default="-")
        return file, entries.get(file, 0)


@dataclass
class Trace:
    """One traced call: its walk under each rule, and notes for the report."""

    name: str
    every: Walk = field(default_factory=lambda: Walk(first_pass=False))
    first: Walk = field(default_factory=lambda: Walk(first_pass=True))
    notes: list[str] = field(default_factory=list)


def _name(code: CodeType) -> str:
    """The function's qualified name (``OptimizerStep.step``); its plain name before 3.11."""
    return str(getattr(code, "co_qualname", code.co_name))


def _package_file(frame: FrameType) -> str | None:
    """The frame's file relative to the package (``engine/pipeline.py``), None outside it
    or in a pass-through decorator's file."""
    path = pathlib.Path(frame.f_code.co_filename)
    if not path.is_absolute():
        return None
    try:
        file = path.resolve().relative_to(PACKAGE_DIR).as_posix()
    except ValueError:
        return None
    return None if file in PASS_THROUGH else file


PASS_THROUGH = {"engine/compiled.py"}


def _holds(frame: FrameType, target: object) -> bool:
    """Whether ``target`` is among the frame's arguments (identity, not equality: an
    optimizer wrapper or a copy is another object). Locals that are not arguments do not
    count: a function that looks the optimizer up is not one it was passed to."""
    code, local = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    if any(local.get(name) is target for name in names):
        return True
    if code.co_flags & CO_VARARGS:
        args = local.get(code.co_varnames[count], ())
        if any(value is target for value in args):
            return True
        count += 1
    if code.co_flags & CO_VARKEYWORDS:
        kwargs = local.get(code.co_varnames[count], {})
        if any(value is target for value in kwargs.values()):
            return True
    return False


def trace(name: str, target: object, call: Callable[[], object]) -> Trace:
    """Run ``call()`` under a profiler that follows ``target`` through the package."""
    # A manager earlier code in this process (a test) left unreferenced still answers
    # torch's global hooks (zero_grad, a step's pre-hook) until collected: not counted here.
    gc.collect()
    result = Trace(name)
    files: dict[CodeType, str | None] = {}  # code -> package file (memo: the hook is hot)

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        # Python calls only: c_call/c_return/c_exception are C functions, which hold no
        # file a reader would open. A generator's resume is a "call" and its yield a
        # "return", as a reader also goes back into it.
        if event == "call":
            code = frame.f_code
            if code not in files:
                files[code] = _package_file(frame)
            file = files[code]
            if file is not None and _holds(frame, target):
                result.every.enter(frame, file)
                result.first.enter(frame, file)
        elif event == "return":
            result.every.leave(frame)
            result.first.leave(frame)

    previous = sys.getprofile()  # a profiler already running (a debugger's) gets it back
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return result


# --- the scenarios -------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)
    )


class CountingAdamW(torch.optim.AdamW):
    """AdamW that counts its steps: the fused step calls it once per bucket, so the count
    during the traced step says how many buckets it went through (the scenario needs
    several, so that the per-bucket loop repeats as in a real model)."""

    calls = 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        return super().step(closure)


def _optimizer(model: nn.Module) -> CountingAdamW:
    """AdamW with two groups (weights decayed, biases not), as a real recipe has them: a
    step goes through every group."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return CountingAdamW(
        [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
        lr=1e-2,
    )


def _backward(model: nn.Module, seed: int, scaler: torch.amp.GradScaler | None = None) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(8, 32, generator=generator)
    targets = torch.randn(8, 32, generator=generator)
    loss = nn.functional.mse_loss(model(inputs), targets)
    # scaler.scale() also creates the scaler's scale tensor (lazily, on the first call).
    (loss if scaler is None else scaler.scale(loss)).backward()


def _traced_step(
    name: str, optimizer: CountingAdamW, call: Callable[[], object], *, own_calls: int = 0
) -> Trace:
    """``trace`` with a note of how many buckets were stepped (``own_calls``: the user's
    own ``optimizer.step()``, which counts too but steps no bucket)."""
    before = optimizer.calls
    result = trace(name, optimizer, call)
    result.notes.append(f"buckets stepped: {optimizer.calls - before - own_calls}")
    return result


def manager_step(*, scaled: bool = False) -> Trace:
    """The manager's ``step(optimizer, max_grad_norm=1.0)``, optionally with a GradScaler."""
    model = _model()
    optimizer = _optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=1,
        offload_optimizer_state=True,
        bucket_size_mb=BUCKET_SIZE_MB,
        grad_scaler=scaler,
    )
    name = "manager.step" + (" + GradScaler" if scaled else "")
    try:
        _backward(model, 0, scaler)
        manager.step(optimizer, max_grad_norm=1.0)  # the warm step: state allocated
        if scaler is not None:
            scaler.update()
        _backward(model, 1, scaler)
        return _traced_step(name, optimizer, lambda: manager.step(optimizer, max_grad_norm=1.0))
    finally:
        manager.remove_hooks()


def integrations_step() -> Trace:
    """A train step decorated with ``@gradient_cache.optimize``: the user's own
    ``optimizer.step()`` reaches the cache through its step hook (integrations/routing.py)."""
    model = _model()
    optimizer = _optimizer(model)
    traces: list[Trace] = []

    @gradient_cache.optimize(
        compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=BUCKET_SIZE_MB
    )
    def train(model: nn.Module) -> None:
        _backward(model, 0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # the warm step
        optimizer.zero_grad()
        _backward(model, 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        traced = _traced_step(
            "@optimize + optimizer.step()", optimizer, optimizer.step, own_calls=1
        )
        traces.append(traced)
        optimizer.zero_grad()

    train(model)
    return traces[0]


def scenarios() -> list[Trace]:
    return [manager_step(), manager_step(scaled=True), integrations_step()]


def main_scenario() -> Trace:
    """The one the issue's bounds name: the manager's step, no GradScaler."""
    return manager_step()


# --- report --------------------------------------------------------------------------------


def report(result: Trace) -> str:
    """The every-call sequence (what happened, in order), then per file its entries under
    both rules, then the figures the bounds apply to."""
    every, first = result.every, result.first
    lines = [f"== {result.name}", *(f"   {note}" for note in result.notes)]
    width = max((len(entry.file) for entry in every.sequence), default=4)
    lines.append("   sequence (every call):")
    for number, entry in enumerate(every.sequence, 1):
        lines.append(f"   {number:3d}  {entry.file:<{width}}  ({entry.how})")
    lines.append(f"   {'file':<{width}}  entries  first-pass entries")
    first_entries = first.entries()
    for file, count in every.entries().items():
        lines.append(f"   {file:<{width}}  {count:7d}  {first_entries.get(file, 0):18d}")
    for label, walk in (("every call", every), ("first pass", first)):
        file, most = walk.most_entered()
        lines.append(
            f"   {label}: files {len(walk.entries())}, comebacks {walk.comebacks()}, "
            f"most entered {file} ({most})"
        )
    return "\n".join(lines)


def breaches(
    results: list[Trace],
    *,
    max_comebacks: int | None,
    max_entries: int | None,
    first_pass: bool = False,
) -> list[str]:
    """A line per bound a scenario exceeds (none: within bounds)."""
    found = []
    for result in results:
        walk = result.first if first_pass else result.every
        if max_comebacks is not None and walk.comebacks() > max_comebacks:
            found.append(f"{result.name}: {walk.comebacks()} comebacks > {max_comebacks}")
        file, most = walk.most_entered()
        if max_entries is not None and most > max_entries:
            found.append(f"{result.name}: {file} entered {most} times > {max_entries}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-comebacks", type=int, default=None, metavar="N")
    parser.add_argument("--max-entries", type=int, default=None, metavar="M")
    parser.add_argument(
        "--first-pass",
        action="store_true",
        help="apply the bounds to the first-pass figures (each function read once)",
    )
    options = parser.parse_args(argv)
    results = scenarios()
    print("\n\n".join(report(result) for result in results))
    found = breaches(
        results,
        max_comebacks=options.max_comebacks,
        max_entries=options.max_entries,
        first_pass=options.first_pass,
    )
    for line in found:
        print(f"BREACH {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
