"""The pipeline: hooks → buckets → encode → host memory → restore.

The hooks hand gradients over (`capture.py`); `drain()` flushes the partial bucket and
waits; `restoring` is the one path that takes payloads out of the store. The pipeline owns
the step's state machine (`step_state`); what a step does with the gradients is `step.py`'s.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Collection, Generator, Iterable, Sequence

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from . import sharding
from .backend import Restore
from .bucket import BucketAssembler
from .capture import Capture
from .config import EngineConfig
from .factory import BackendFactory, create_backend
from .figures import StepFigures
from .norms import StepNorms, norm_slots
from .optimizer_state import HostOptimizerState
from .records import GradientAt, make_records
from .route import Route, RoutePlan, plan_of_params
from .scaling import SkipWatch, loss_scale
from .step_state import (
    ADVICE,
    CACHED,
    CAPTURING,
    IDLE,
    INTERRUPTED,
    PHASES_FROM,
    STEPPING,
    Clip,
    HeldProgress,
    PendingStep,
    StepState,
    StepStateError,
)
from .store import GradientStore
from .weights.hooks import in_backward
from .weights.masters import HostWeights

Param = torch.nn.Parameter
NONE, STORED, KEPT_ON_DEVICE = GradientAt.NONE, GradientAt.STORED, GradientAt.KEPT_ON_DEVICE

# Parameters whose gradients a live pipeline's hooks take. A second pipeline on one of them
# would take gradients the first counts on; identity keys, since tensors compare by value.
_cached_params: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Pipeline:
    """Offloads the gradients of ``named_params`` to the host and restores them. Until
    a step's gradients are all restored, its residuals stay pending and the generators'
    states at its start are kept, so `discard` can undo it."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, Param]],
        *,
        ratio: float,
        config: EngineConfig,
        grad_scaler: torch.amp.GradScaler | None = None,
        groups: Sequence[Sequence[Param]] = (),
        backend_factory: BackendFactory = create_backend,
    ) -> None:
        """``groups``: parameters whose gradients arrive together and share one buffer
        (FSDP2's reduce-scatter output); a bucket closes when a group is complete.
        ``backend_factory``: builds the backend (`factory.create_backend` picks by device)."""
        self.config = config
        self.ratio = ratio
        params = [param for _, param in named_params]
        sharding.check_placements(named_params)
        _refuse_cached_twice(named_params)
        plan_for = _plan_once(params, config, ratio)
        # Checks the host budget before it allocates anything; no hook exists yet either.
        self.backend = backend_factory(params, config, plan=lambda s: plan_for(s).at(0))
        self.plan = plan_for(self.backend.default_selection)
        self.codecs = self.plan.codecs
        # The optimizer's state in host memory between fused steps (offload_optimizer_state).
        self.optimizer_state: HostOptimizerState | None = None
        if config.offload_optimizer_state:
            self.optimizer_state = HostOptimizerState(self.backend, config.host_memory_fraction)
        self.weights: HostWeights | None = None  # offload_parameters: `carry_weights`
        self.steps = 0
        self.records = make_records(named_params, self.plan.at(0), groups)
        self._follow_plan()
        self.store = GradientStore()
        dense_bytes = sum(route.numel * route.dtype.itemsize for route in self.routes.values())
        self.assembler = BucketAssembler(config.bucket_bytes(dense_bytes))
        self.enabled = True  # `set_enabled`
        self.grad_scaler = grad_scaler  # error feedback keeps its residual unscaled by it
        self.last_step = StepFigures()
        # The step's life: its state, and its PendingStep while one is pending (None in IDLE).
        self.state = IDLE
        self.pending: PendingStep | None = None
        # The norm type the fused steps clip by (`compute_norms`): the encodes compute it.
        self.clip_norm_type: float | None = None
        self._norm_slots = norm_slots(params)
        self.capture = Capture(self)
        # Whether the GradScaler skipped the last completed step (`settle_scaled_step`).
        self.skips = None if grad_scaler is None else SkipWatch(grad_scaler, self.records)
        self._handles = _attach(params, self.capture, self.skips)

    def _follow_plan(self) -> None:
        """Take every parameter's route for the current step count, backend included."""
        routes = self.plan.at(self.steps)
        for param, record in self.records.items():
            record.route = routes[param]
        self._planned_at = self.steps
        self.backend.follow_routes(routes)

    def params_by_name(self) -> dict[str, Param]:
        """The cached parameters by name (checkpoints key by name)."""
        return {record.name: param for param, record in self.records.items()}

    @property
    def routes(self) -> dict[Param, Route]:
        """Each parameter's route at the current step (a copy)."""
        return {param: record.route for param, record in self.records.items()}

    # --- capture (the hooks: `capture.Capture`) -------------------------------------

    def begin_capture(self) -> None:
        """A gradient is handed over: the step begins at the first (before any encode draws)."""
        self._enter("capture", CAPTURING)
        if self.pending is None:
            self.settle_scaled_step()
            self.pending = _new_pending(self, self.codecs.random_state(self.backend.device))
            for record in self.records.values():  # a new step: its gradients are new
                record.taken_by = None

    def _enter(self, phase: str, state: StepState) -> None:
        """Move to ``state`` by ``phase`` (IDLE: no step pending), or raise if it cannot."""
        if self.state not in PHASES_FROM[phase]:
            advice = ADVICE.get(self.state, "this is a gradient-cache bug; please report it")
            raise StepStateError(
                f"The gradient cache cannot {phase} while its step is {self.state.value}: {advice}."
            )
        self.state = state
        if state is IDLE:
            self.pending = None

    def launching(self) -> None:
        """A bucket launches (`Capture.launch`): only while capturing."""
        self._enter("launch", CAPTURING)

    # --- drain, discard and the restore path (between backward and the optimizer) ---

    def drain(self) -> None:
        """Encode the partial bucket and wait until host memory holds every gradient."""
        for record in self.records.values():
            if record.group is not None:  # a backward that stopped midway leaves partial counts
                record.group.count = 0
        self.capture.launch(self.assembler.flush())
        self.backend.drain()
        self.store.landed()
        for param in self.store:
            self.records[param].gradient = STORED
        self._enter("drain", CACHED if self.state is CAPTURING else self.state)
        for codec in self.codecs.all():
            codec.release_scratch()  # reused across one backward's tensors, not between steps

    def discard(self) -> None:
        """Drop every cached gradient (after a drain) and undo the step (its residuals, its
        draws, the norm type a clip in it set), as before the discarded backward."""
        self.settle_scaled_step()
        self.drain()
        self._spend(list(self.store))
        self.backend.residuals.drop_pending()
        if (pending := self.pending) is not None:
            self.clip_norm_type = None if pending.norms is None else pending.norms.norm_type
            if pending.random_state is not None:
                self.codecs.set_random_state(self.backend.device, pending.random_state)
        self._enter("discard", IDLE)
        for record in self.records.values():
            record.taken_by = None

    def restoring(
        self,
        buckets: Sequence[Sequence[Param]],
        *,
        clip_factor: torch.Tensor | None,
        alongside: Callable[[Sequence[Param]], object] | None = None,
        spent: Callable[[], object] | None = None,
        depth: int = 0,
    ) -> Generator[list[tuple[Param, torch.Tensor]], None, None]:
        """The one restore path: each bucket's gradients on the device (times ``clip_factor``,
        ``depth`` more restoring ahead), leaving the store when the next is asked for;
        ``alongside`` and ``spent`` bracket its state's trip. Closed early, the rest stays."""
        ahead: deque[Restore] = deque()
        try:
            for i, params in enumerate(buckets):
                while len(ahead) <= depth and i + len(ahead) < len(buckets):
                    later = buckets[i + len(ahead)]
                    items = [(param, self.store[param]) for param in later]
                    ahead.append(self.backend.start_restore(items, clip_factor=clip_factor))
                    if alongside is not None:
                        alongside(later)
                yield self.backend.finish_restore(ahead.popleft())
                self._spend(params)  # before `spent`: a failure there must not step it again
                if spent is not None:
                    spent()
        finally:
            for restore in ahead:
                self.backend.finish_restore(restore)  # before its blocks are freed

    def restore(self, params: Iterable[Param]) -> None:
        """The cached gradients of ``params`` added into ``param.grad``, times the pending
        step's clip factor; a bucket at a time (none restores ahead: the device's peak)."""
        buckets = [[param for param, _ in part] for part in self.store.parts(set(params))]
        factor = None if self.pending is None else self.pending.restore_factor()
        with contextlib.closing(self.restoring(buckets, clip_factor=factor)) as each:
            for grads in each:
                for param, grad in grads:  # beside host weights; cast as .to() casts .grad
                    grad = sharding.as_grad_of(param, grad).to(param.device, param.dtype)
                    param.grad = grad if param.grad is None else param.grad.add_(grad)

    def apply(self) -> None:
        """Drain, then every cached gradient back in ``param.grad``. If a restore raises,
        the rest stays cached: `apply` again finishes the step, counted once."""
        self.drain()
        if self.state is INTERRUPTED:
            self.retry()  # restored whole: the interrupted fused step's clip is not used
        self.deliver_and_restore(list(self.store))
        for record in self.records.values():
            if record.gradient is KEPT_ON_DEVICE:
                record.gradient = NONE  # restored beside them: the user's, as plain leaves them
        self.finish_step()

    def deliver_and_restore(self, params: Iterable[Param]) -> None:
        """`deliver` then `restore` ``params``: back in ``param.grad``, the step counted."""
        params = list(params)
        self.deliver(params)
        self.restore(params)

    def skip(self, params: Iterable[Param]) -> None:
        """A step the GradScaler skips: the cached gradients of ``params`` are delivered and
        spent unrestored, as ``scaler.step()`` leaves a skipped step's gradients unused. Also
        a fused step's bucket stepped before an interrupt, still cached (`fused_step.run`)."""
        params = [param for param in params if param in self.store]
        self.deliver(params)
        self._spend(params)

    def _spend(self, params: Collection[Param]) -> None:
        """The payloads of ``params`` leave the store: restored, skipped or discarded."""
        self.store.remove(params)
        for param in params:
            self.records[param].gradient = NONE

    # --- the step's phases ------------------------------------------------------------

    def deliver(self, params: Collection[Param]) -> None:
        """Before their restore: the figures of ``params`` become the last step's, the step
        is counted (once), and their new residuals become the current ones."""
        if not params:
            return
        self._enter("deliver", STEPPING)
        assert self.pending is not None  # every state deliver starts from has one
        self.pending.taken()
        figures = self.store.figures(self.records, params)
        if self.pending.counted:
            self.last_step.layers.update(figures.layers)
        else:
            self.last_step = figures
            if self.skips is not None:
                self.skips.delivered(self.pending.random_state, self.steps)
            self.steps += 1
            self.pending.counted = True
        if self.backend.residuals.any_pending():
            unsettled = self.skips is not None and self.skips.unsettled is not None
            self.backend.residuals.promote(params, keep_replaced=unsettled)

    def interrupt(self, clip: Clip, held: HeldProgress) -> None:
        """A fused step raised: its clip and progress kept for the `retry`."""
        self._enter("interrupt", INTERRUPTED)
        if self.pending is None:  # it had only gradients that never left the device
            self.pending = PendingStep(random_state=None)
        self.pending.clip = clip
        self.pending.held = held

    def retry(self) -> tuple[Clip, HeldProgress]:
        """An interrupted fused step again: its first attempt's clip and progress."""
        assert self.pending is not None and self.pending.clip is not None
        clip, self.pending.clip = self.pending.clip, None
        held, self.pending.held = self.pending.held or HeldProgress(), None
        self._enter("retry", self._after_restores())
        return clip, held

    def finish_step(self) -> None:
        """After a restore: close the step once nothing of it is cached; at the warm-up's
        end the routes move on (never in a hook: the CUDA pool is re-laid)."""
        self._enter("finish", self._after_restores())
        if self._planned_at < self.config.warmup_steps <= self.steps:
            self._follow_plan()

    def _after_restores(self) -> StepState:
        """The state once the restores so far are done: what is left cached decides."""
        if not self.store:
            return IDLE
        assert self.pending is not None
        return STEPPING if self.pending.counted else CACHED

    @property
    def interrupted(self) -> bool:
        """Whether a fused step raised and waits for its retry (or a discard)."""
        return self.state is INTERRUPTED

    @property
    def step_pending(self) -> bool:
        """From the first gradient handed over until all is restored or discarded."""
        return self.state is not IDLE

    def settle_scaled_step(self, *, known_only: bool = False) -> None:
        """If the GradScaler skipped the last completed step (`SkipWatch`), undo its residuals,
        draws and count before anything builds on it (a forward: only a ``known_only``
        verdict). Back in the warm-up, its routes again only outside a hook (pool re-laid)."""
        if self.skips is None or self.skips.unsettled is None:
            return
        if known_only and not self.skips.decided():
            return
        skipped = self.skips.settle()
        if skipped is None:
            self.backend.residuals.forget_replaced()
            return
        self.backend.residuals.bring_back_replaced()
        self.codecs.set_random_state(self.backend.device, skipped.random_state)
        self.steps = skipped.steps
        if self._planned_at > self.steps and not in_backward():
            self._follow_plan()

    # --- the clip's and the norms' part of the pending step ---------------------------

    @property
    def deferred_clip(self) -> torch.Tensor | None:
        """The pending step's deferred clip factor (`OptimizerStep.clip`), if any."""
        return None if self.pending is None else self.pending.deferred_clip

    def compute_norms(self, norm_type: float | None) -> None:
        """Later encodes compute each gradient's ``norm_type`` norm (`PendingStep.norms`)."""
        self.clip_norm_type = norm_type

    # --- checkpoints and a memory budget ------------------------------------------------

    def resume(self, random_state: dict[str, torch.Tensor] | None) -> None:
        """Take up a pending step a checkpoint saved (its payloads follow, then `drain`)."""
        self._enter("resume", CAPTURING)
        # As a step begun here: later encodes write their norms and non-finite flag (a clip
        # read from the payloads would have other bits).
        self.pending = _new_pending(self, random_state)

    def restart_at(self, steps: int) -> None:
        """Continue as if ``steps`` steps were done (a loaded checkpoint); nothing pending."""
        self._enter("restart", IDLE)
        if self.skips is not None:
            self.skips.unsettled = None
        self.backend.residuals.forget_replaced()
        self.steps = steps
        self._follow_plan()

    def set_enabled(self, enabled: bool) -> None:
        """Whether later backward passes offload (False: their gradients stay put)."""
        self.enabled = enabled

    def carry_weights(self, weights: HostWeights) -> None:
        """The weights on the host travel with the fused step's buckets (`StepJourney`)."""
        self.weights = weights
        if self.optimizer_state is not None:
            self.optimizer_state.rests_on_host = weights.rests_on_host

    def close(self) -> None:
        """Detach: the hooks removed, the parameters free for another cache, the optimizer
        state back where plain PyTorch keeps it (`HostOptimizerState.close`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for param in self.records:
            _cached_params.pop(param, None)
        try:
            if self.optimizer_state is not None:
                self.optimizer_state.close()
        finally:
            self.backend.drain()  # work in flight done: the backend is not used afterwards


def _plan_once(
    params: list[Param], config: EngineConfig, ratio: float
) -> Callable[[str], RoutePlan[Param]]:
    """The routes, planned on the first call and kept (the backend factory's, for its budget
    check; else the pipeline's, with the backend's default selection)."""
    plans: list[RoutePlan[Param]] = []

    def plan_for(selection: str) -> RoutePlan[Param]:
        if not plans:
            chosen = selection if config.selection == "auto" else config.selection
            plans.append(plan_of_params(params, config, ratio=ratio, selection=chosen))
        return plans[0]

    return plan_for


def _attach(
    params: list[Param], capture: Capture, skips: SkipWatch | None
) -> list[RemovableHandle]:
    """The hooks: each parameter's post-accumulate-grad hook (`Capture.on_grad_ready`)
    and the skip watch's; the parameters marked as cached."""
    handles = [p.register_post_accumulate_grad_hook(capture.on_grad_ready) for p in params]
    if skips is not None:
        handles.append(skips.handle)
    _cached_params.update(dict.fromkeys(params, True))
    return handles


def _refuse_cached_twice(named_params: Sequence[tuple[str, Param]]) -> None:
    """Raise where another live pipeline caches one of these parameters."""
    taken = [name for name, param in named_params if param in _cached_params]
    if taken:
        raise ValueError(
            f"{len(taken)} of these parameters ({', '.join(taken[:3])}"
            f"{', ...' if len(taken) > 3 else ''}) are already cached by another "
            "GradientCacheHookManager; one model takes one manager. Call remove_hooks() "
            "on the other one (or leave its with-block) before creating this one; a "
            "notebook cell run twice must reuse the first manager or rebuild the model."
        )


def refuse_taken(
    pipeline: Pipeline, optimizer: torch.optim.Optimizer, params: Iterable[Param]
) -> None:
    """Refuse a fused step of ``optimizer`` over a parameter another optimizer's fused step
    took in this step, with no gradient now (the message says why), before anything changes."""
    taken = [
        record.name
        for record in map(pipeline.records.get, params)
        if record is not None
        and record.param.grad is None
        and record.gradient is GradientAt.NONE
        and record.taken_by is not None
        and record.taken_by() is not optimizer
    ]
    if taken:
        raise RuntimeError(
            f"step({type(optimizer).__name__}) steps {len(taken)} parameters "
            f"({', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''}) whose cached "
            "gradients another optimizer's step already stepped in this step and freed "
            "(the fused step frees what it restores, as zero_grad() would). Plain PyTorch "
            "leaves them in .grad, so this optimizer would step them again, unless "
            "zero_grad() ran in between: the cache cannot tell which you meant. Give each "
            "parameter to one optimizer; or run a backward before each optimizer's step; "
            "or keep the shared parameters' gradients on the device (exclude_layers=[...]: "
            "both steps then find them in .grad, as in plain PyTorch)."
        )


def _new_pending(pipeline: Pipeline, random_state: dict[str, torch.Tensor] | None) -> PendingStep:
    """A step's pending state: with a GradScaler, the flag its encodes raise on a
    non-finite gradient; with a clip, the norms they write."""
    device, norm_type = pipeline.backend.device, pipeline.clip_norm_type
    scaled = loss_scale(pipeline.grad_scaler) is not None
    found_inf = torch.zeros((), dtype=torch.bool, device=device) if scaled else None
    norms = None if norm_type is None else StepNorms(pipeline._norm_slots, norm_type, device)
    return PendingStep(random_state, found_inf, norms)
