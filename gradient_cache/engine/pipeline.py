"""The engine: hooks → buckets → encode → host memory → restore.

Backward's post-accumulate-grad hook takes each gradient as soon as it is complete,
frees it from the parameter and adds it to the open bucket; a full bucket is encoded by
each parameter's route and sent to host memory while backward goes on. `drain()` flushes
the partial bucket and waits; `apply()` and `fused_step.step()` restore. What is cached
lives in the `GradientStore`, residuals in the backend's `ResidualStore`.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..codecs.generators import RandomSource
from . import sharding
from .backend import Encoded
from .bucket import BucketAssembler, Item
from .config import EngineConfig
from .factory import BackendFactory, create_backend
from .layout import gradient_strides
from .norms import StepNorms, gradient_norm, norm_slots
from .optimizer_state import HostOptimizerState
from .route import Codecs, Route, RoutePlan
from .store import BucketPayloads, GradientStore

Param = torch.nn.Parameter


@dataclass
class LayerRecord:
    """What one parameter's gradient cost in the last completed step."""

    numel: int
    dense_bytes: int
    stored_bytes: int
    kept: int
    compressed: bool
    codec: str  # the name of the codec that encoded it


@dataclass
class GroupArrivals:
    """Gradients of one group (`Pipeline`'s ``groups``) arrived in this backward so far."""

    size: int
    count: int = 0


@dataclass
class CachedParam:
    """One cached parameter's facts, gathered once when the pipeline is made."""

    name: str
    param: Param
    route: Route  # at the current step: the pipeline moves it on where the warm-up ends
    group: GroupArrivals | None  # FSDP2: the gradients it arrives with, in one buffer
    sharded: bool  # a DTensor: its gradient is taken as this rank's shard and handed back


@dataclass(frozen=True)
class HeldTensors:
    """The tensors the engine holds at one moment, for memory accounting.

    ``host``: in host memory: the cached payloads, the error-feedback residuals kept on the
    host (``residual_location="host"``), the random states kept to undo the pending step and
    the optimizer state's host copies (``offload_optimizer_state``).
    ``scratch``: on the device: the codecs' reusable buffers (held within a backward) and
    their fixed tables. ``waiting``: on the device: gradients waiting in the open bucket.
    """

    host: tuple[torch.Tensor, ...] = ()
    scratch: tuple[torch.Tensor, ...] = ()
    waiting: tuple[torch.Tensor, ...] = ()


@dataclass
class StepRecord:
    layers: dict[str, LayerRecord] = field(default_factory=dict)


@dataclass
class ScaledStep:
    """A completed step a GradScaler may have skipped, and what it changed in the engine."""

    scale_version: int  # the scale tensor's in-place version when the step was delivered
    random_state: dict[str, torch.Tensor]  # the generators' states before its backward
    steps: int  # the step count before it
    stepped: bool = False  # an optimizer holding a cached parameter stepped since


class StepState(enum.Enum):
    """Where the pending step is in its life; `Pipeline` moves it, phase by phase."""

    IDLE = "idle"  # no step pending: nothing cached, waiting in a bucket or held back
    CAPTURING = "capturing"  # backward hands gradients over; buckets may be in flight
    CACHED = "cached"  # drained: host memory holds every gradient of the step
    STEPPING = "stepping"  # a restore delivered part of it (counted); the rest is cached
    INTERRUPTED = "interrupted"  # a fused step raised; its retry reuses the kept clip


IDLE, CAPTURING, CACHED, STEPPING, INTERRUPTED = StepState
# Each phase and the states it may start from (where it leads is the phase's to decide).
PHASES_FROM: dict[str, frozenset[StepState]] = {
    "capture": frozenset({IDLE, CAPTURING, CACHED, STEPPING}),
    "launch": frozenset({CAPTURING}),
    "drain": frozenset(StepState),
    "deliver": frozenset({CACHED, STEPPING}),
    "finish": frozenset({IDLE, CACHED, STEPPING}),
    "interrupt": frozenset({IDLE, CACHED, STEPPING}),
    "retry": frozenset({INTERRUPTED}),
    "discard": frozenset(StepState),
    "restart": frozenset({IDLE}),
    "resume": frozenset({IDLE}),
}
# Why a phase cannot start from a state, where a user's call order can get there.
_ADVICE = {
    INTERRUPTED: "a fused step(optimizer) raised and was neither retried nor discarded: call "
    "step(optimizer) again to finish that step, or discard_gradients(), first",
}

# A fused step's global gradient norm and clip factor (None, None without clipping).
Clip = tuple[torch.Tensor | None, torch.Tensor | None]


@dataclass
class HeldProgress:
    """A fused step's progress on its device gradients (`fused_step`), kept for the retry
    when it raises: those already multiplied in place by the step's factor (unscale and
    clip: not twice), and those already stepped (not twice either)."""

    scaled: set[torch.nn.Parameter] = field(default_factory=set)
    stepped: set[torch.nn.Parameter] = field(default_factory=set)


@dataclass
class PendingStep:
    """The pending step: from its first gradient until all it cached is restored or dropped."""

    # The engine's generators as it found them (None: unknown, a checkpoint made on another
    # kind of device); `discard` rewinds them.
    random_state: dict[str, torch.Tensor] | None
    # With an enabled GradScaler: whether any gradient it encoded was not finite (a device
    # bool, written by the encodes); None without a scaler, or unknown (a resumed step).
    found_inf: torch.Tensor | None = None
    # Each encoded gradient's norm of the type the last clipped fused step used, written
    # by its last encode (the accumulated gradient's); None: the encodes compute none.
    norms: StepNorms | None = None
    counted: bool = False  # delivered at least once, so counted in `Pipeline.steps`
    clip: Clip | None = None  # INTERRUPTED: what the fused step's retry reuses
    held: HeldProgress | None = None  # INTERRUPTED: and how far it got with device gradients
    # A clip_grad_norm_ answered from the cache (`defer_clip`): the factor every gradient
    # of the step still cached is multiplied by as it is restored, as plain PyTorch
    # multiplied it in place at the clip. None: no such clip.
    deferred_clip: torch.Tensor | None = None
    norm_read: bool = False  # a norm was read from the cache (`read_norms`) in this step


class StepStateError(RuntimeError):
    """A phase of a step started from a state it cannot start from."""


# Parameters whose gradients a live pipeline's hooks take. A second pipeline on one of them
# would take gradients the first counts on; identity keys, since tensors compare by value.
_cached_params: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Pipeline:
    """Offloads the gradients of ``named_params`` to the host and restores them.

    A step is pending from its first launch until every gradient it cached is restored:
    until then its new residuals stay pending and the random generators' states at its
    start are kept, so `discard` can undo it.
    """

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
        self._gradient_checked = False
        group_of: dict[Param, GroupArrivals] = {}
        for group in groups:
            members = [p for p in group if p in set(params)]
            arrivals = GroupArrivals(len(members))
            group_of.update(dict.fromkeys(members, arrivals))
        taken = [name for name, param in named_params if param in _cached_params]
        if taken:
            raise ValueError(
                f"{len(taken)} of these parameters ({', '.join(taken[:3])}"
                f"{', ...' if len(taken) > 3 else ''}) are already cached by another "
                "GradientCacheHookManager; one model takes one manager. Call remove_hooks() "
                "on the other one (or leave its with-block) before creating this one; a "
                "notebook cell run twice must reuse the first manager or rebuild the model."
            )
        shapes = {p: (tuple(sharding.local_shape(p)), p.dtype) for p in params}
        strides = {p: gradient_strides(sharding.local(p)) for p in params}
        plans: list[RoutePlan[Param]] = []

        def plan(selection: str) -> dict[Param, Route]:
            """The routes, planned on the first call (the backend's, for its budget check)."""
            if config.selection != "auto":
                selection = config.selection
            if not plans:
                codecs = Codecs.for_options(config, ratio=ratio, selection=selection)
                plans.append(
                    RoutePlan(
                        shapes, codecs=codecs, config=config, selection=selection, strides=strides
                    )
                )
            return plans[0].at(0)

        # Checks the host budget before it allocates anything; no hook exists yet either.
        self.backend = backend_factory(params, config, plan=plan)
        plan(self.backend.default_selection)  # a factory that did not ask plans here
        self.plan = plans[0]
        self.codecs = self.plan.codecs
        # The optimizer's state in host memory between fused steps (offload_optimizer_state).
        self.optimizer_state = (
            HostOptimizerState(self.backend, config.host_memory_fraction)
            if config.offload_optimizer_state
            else None
        )
        self.steps = 0
        self.records = {
            param: CachedParam(
                name=name,
                param=param,
                route=self.plan.at(0)[param],
                group=group_of.get(param),
                sharded=sharding.is_dtensor(param),
            )
            for name, param in named_params
        }
        self._planned_at = -1
        self._follow_plan()
        self.store = GradientStore()
        dense_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())
        self.assembler = BucketAssembler(config.bucket_bytes(dense_bytes))
        self.enabled = True  # `set_enabled`
        # Gradients a memory budget keeps on the device (`keep_on_device`), and those of
        # them whose ``.grad`` holds a part of a step not yet restored (`kept_stepped`
        # ends it): a checkpoint carries these, as it carries the cached ones.
        self.kept_on_device: set[Param] = set()
        self.kept_unstepped: set[Param] = set()
        # Error feedback keeps its residual unscaled by this GradScaler's current scale.
        self.grad_scaler = grad_scaler
        self.last_step = StepRecord()
        # The step's life: its state, and its record while one is pending (None in IDLE).
        self.state = IDLE
        self.pending: PendingStep | None = None
        # The last completed step until the engine has learnt whether the GradScaler
        # skipped it (`settle_scaled_step`); None without a scaler.
        self.unsettled: ScaledStep | None = None
        # The norm type the last fused step clipped by (`clip_with`).
        self.clip_norm_type: float | None = None
        # The cached gradients fused steps took in the pending step (or the last one, until
        # the next begins), each with the optimizer that stepped it (a weak reference).
        self.stepped_by: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._norm_slots = norm_slots(params)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        if grad_scaler is not None:
            # Whether an optimizer stepped after a step's restore: with the scaler's update,
            # the skip verdict, known on the host (`settle_scaled_step`). Every optimizer's
            # hook, so it holds the pipeline weakly.
            this = weakref.ref(self)

            def on_optimizer_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
                pipeline = this()
                if pipeline is not None:
                    pipeline._on_optimizer_step(optimizer)

            # It reads no optimizer state: the fused step need not wait on the host for it.
            on_optimizer_step.reads_no_state = True  # type: ignore[attr-defined]
            self._handles.append(register_optimizer_step_post_hook(on_optimizer_step))
        for param in params:
            _cached_params[param] = True

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

    # --- capture (runs inside backward) -------------------------------------------

    def _on_grad_ready(self, param: Param) -> None:
        grad = param.grad
        if grad is None or grad.is_sparse:
            return  # sparse (nn.Embedding(sparse=True)) gradients stay where they are
        if not self.enabled:
            return  # left on the device; what is cached joins it at the restore
        if param in self.kept_on_device:
            self.kept_unstepped.add(param)  # left on the device, part of the pending step
            return
        if self.deferred_clip is not None:
            # A backward after a clip answered from the cache: plain PyTorch adds to the
            # clipped gradients, so they come back clipped first (a restore, once).
            self._restore_clipped()
        if not self._gradient_checked:
            sharding.check_gradient_is_reduced(self.records[param].name, grad)
            self._gradient_checked = True
        self._capture()
        param.grad = None
        if self.assembler.holds(param) and param in self.store:
            # A third micro-batch while the second waits here and the first is cached:
            # the waiting bucket goes first, so the cached part joins the second gradient
            # before the third does ((a + b) + c, plain PyTorch's order).
            self._launch(self.assembler.flush() or [])
        group_complete = self._group_complete(param)
        items = self.assembler.add(param, sharding.local(grad))
        if items is None and group_complete:
            # The group's shared buffer is freed once its last gradient is offloaded: send
            # it now rather than when the next group's gradients fill the bucket.
            items = self.assembler.flush()
        if items is not None:
            self._launch(items)

    def _capture(self) -> None:
        """A gradient is handed over: the step begins at its first one (before any encode
        draws from the generators), or goes on."""
        self._enter("capture", CAPTURING)
        if self.pending is None:
            self.settle_scaled_step()
            found_inf = None
            if self._loss_scale() is not None:
                found_inf = torch.zeros((), dtype=torch.bool, device=self.backend.device)
            norms = None
            if self.clip_norm_type is not None:
                norms = StepNorms(self._norm_slots, self.clip_norm_type, self.backend.device)
            self.pending = PendingStep(self.random_state(), found_inf, norms)
            self.stepped_by = WeakIdKeyDictionary()  # a new step: its gradients are new

    def _enter(self, phase: str, state: StepState) -> None:
        """Move to ``state`` by ``phase``, or raise if ``phase`` cannot start from here."""
        if self.state not in PHASES_FROM[phase]:
            advice = _ADVICE.get(self.state, "this is a gradient-cache bug; please report it")
            raise StepStateError(
                f"The gradient cache cannot {phase} while its step is {self.state.value}: {advice}."
            )
        self.state = state

    def _group_complete(self, param: Param) -> bool:
        """Count ``param``'s arrival; whether it completes its group's arrivals."""
        arrivals = self.records[param].group
        if arrivals is None:
            return False
        arrivals.count += 1
        if arrivals.count < arrivals.size:
            return False
        arrivals.count = 0
        return True

    def _launch(self, items: list[Item]) -> None:
        """Encode ``items`` and send them to host memory, one parameter at a time.

        If encoding fails (out of memory, say), the parameters not yet encoded get their
        gradients back in ``param.grad`` and the error propagates: nothing is lost or
        counted twice, and the next restore adds the cached part to them.
        """
        self._enter("launch", CAPTURING)
        loss_scale = self._loss_scale()
        encoded: list[Encoded] = []
        try:
            with self.backend.encoding([param for param, _ in items]):
                for param, grad in items:
                    encoded.append(self._encode(param, grad, loss_scale))
        except BaseException:
            for param, grad in items[len(encoded) :]:
                param.grad = sharding.as_grad_of(param, grad)
            raise
        finally:
            self._keep(encoded, [grad for _, grad in items[: len(encoded)]])

    def _encode(self, param: Param, grad: torch.Tensor, loss_scale: torch.Tensor | None) -> Encoded:
        """Runs where the backend's `encoding` puts it; reads but never changes cached state."""
        route = self.records[param].route
        codec = route.codec
        flat = route.flatten(grad.detach())
        held = self.store.payload(param)
        if held is not None:  # gradient accumulation: the cached part joins this one
            flat = held.moved(self.backend.to_device).add_to(flat)
        residual = None if codec.residual is None else self.backend.residuals.read(param)
        found_inf = None if self.pending is None else self.pending.found_inf
        if found_inf is not None:  # the fused step skips on it, as scaler.step() would
            torch.logical_or(found_inf, ~torch.isfinite(flat).all(), out=found_inf)
        if self.pending is not None and self.pending.norms is not None:
            # The norm of what this encode compresses (under accumulation, the decoded
            # earlier micro-batches plus this one), read by the fused step's clip
            # (`fused_step._clip_factor`) with no pass over the payloads.
            self.pending.norms.write(param, flat)
        payload, new_residual = codec.encode(flat, residual, loss_scale=loss_scale)
        return Encoded(param, payload, new_residual, () if residual is None else (residual,))

    def _loss_scale(self) -> torch.Tensor | None:
        """The GradScaler's scale as a device tensor (no host sync), or None if unscaled."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        # GradScaler has no public sync-free getter; get_scale() would sync the host.
        return scaler._get_scale_async()

    def _keep(self, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        """Send ``encoded`` to host memory (the backend keeps their residuals) and store it."""
        if encoded:
            self.store.put(self.backend.store(encoded, grads))

    # --- drain and restore (runs between backward and the optimizer) --------------

    def drain(self) -> None:
        """Encode the partial bucket and wait until host memory holds every gradient."""
        items = self.assembler.flush()
        for record in self.records.values():
            if record.group is not None:  # a backward that stopped midway leaves partial counts
                record.group.count = 0
        if items is not None:
            self._launch(items)
        self.backend.drain()
        self.store.landed()
        self._enter("drain", CACHED if self.state is CAPTURING else self.state)
        for codec in self.codecs.all():
            codec.release_scratch()  # reused across one backward's tensors, not between steps

    def discard(self) -> None:
        """Wait for launched buckets, then drop every cached gradient and undo the step.

        The pending residuals are dropped and the random generators rewound, so the
        engine is as it was before the discarded backward.
        """
        self.settle_scaled_step()
        self.drain()
        self.store.clear()
        self.backend.residuals.drop_pending()
        if self.pending is not None and self.pending.random_state is not None:
            self.set_random_state(self.pending.random_state)
        self._enter("discard", IDLE)
        self.pending = None
        self.stepped_by = WeakIdKeyDictionary()

    def apply(self) -> None:
        """Drain, then put every cached gradient back into ``param.grad``.

        If a restore raises, what was restored stays in ``param.grad`` and the rest stays
        cached: calling `apply` again finishes the step, counted once.
        """
        self.drain()
        if self.state is INTERRUPTED:
            held = self.pending.held if self.pending is not None else None
            if held is not None and (held.scaled or held.stepped):
                raise RuntimeError(
                    "apply_gradients() after a fused step(optimizer) that raised once it had "
                    "scaled or stepped device gradients in place: restoring the rest whole "
                    "would clip or step those twice. Call step(optimizer) again to finish "
                    "that step."
                )
            self.retry()  # restored whole: the interrupted fused step's clip is not used
        self.deliver_and_restore(list(self.store))
        self.kept_unstepped.clear()  # restored beside them: the user's, as plain leaves them
        self.finish_step()

    def restore(self, params: Iterable[Param]) -> None:
        """Put the cached gradients of ``params`` into ``param.grad`` (added to any there),
        times the deferred clip's factor, if one is pending."""
        for part in self.store.parts(set(params)):
            restore = self.backend.start_restore(part, clip_factor=self.deferred_clip)
            for param, grad in self.backend.finish_restore(restore):
                grad = sharding.as_grad_of(param, grad)
                param.grad = grad if param.grad is None else param.grad.add_(grad)
            self.store.remove([param for param, _ in part])

    def deliver_and_restore(self, params: Iterable[Param]) -> None:
        """`deliver` then `restore` ``params``: their gradients back in ``param.grad``, the
        step counted."""
        params = list(params)
        self.deliver(params)
        self.restore(params)

    def parts(self, params: Iterable[Param]) -> list[BucketPayloads]:
        """The cached payloads of ``params``, bucket by bucket (`GradientStore.parts`)."""
        return self.store.parts(set(params))

    def deliver(self, params: Iterable[Param]) -> None:
        """The pending step delivers its gradients of ``params`` (before their restore):
        their figures become the last step's, the step is counted (once, however many
        restores deliver it), and their new residuals become the current ones."""
        params = list(params)
        if not params:
            return
        self._enter("deliver", STEPPING)
        assert self.pending is not None  # every state deliver starts from has one
        record = self.describe(params)
        if self.pending.counted:
            self.last_step.layers.update(record.layers)
        else:
            self.last_step = record
            scale = self._loss_scale()
            if scale is not None:
                self.unsettled = ScaledStep(
                    scale._version, self.pending.random_state or {}, self.steps
                )
            self.steps += 1
            self.pending.counted = True
        self.backend.residuals.promote(params, keep_replaced=self.unsettled is not None)

    def take_for(self, optimizer: torch.optim.Optimizer, params: Iterable[Param]) -> None:
        """A fused step of ``optimizer`` takes the cached gradients of ``params`` (they
        leave the cache once stepped, as if ``zero_grad()`` had run)."""
        for param in params:
            self.stepped_by[param] = weakref.ref(optimizer)

    def check_not_taken(self, optimizer: torch.optim.Optimizer, params: Iterable[Param]) -> None:
        """Refuse a fused step of ``optimizer`` over a parameter whose cached gradient
        another optimizer's fused step took in this step, and that has none now: plain
        PyTorch would step it again with that gradient, left in ``.grad``, unless a
        ``zero_grad()`` ran in between, which the cache cannot see. Raises before
        anything changes."""
        taken = [
            self.records[param].name
            for param in params
            if param.grad is None
            and param not in self.store
            and param in self.stepped_by
            and self.stepped_by[param]() is not optimizer
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

    def interrupt(self, clip: Clip, held: HeldProgress) -> None:
        """A fused step raised: keep its clip and its progress on the device gradients
        for the retry (`retry`)."""
        self._enter("interrupt", INTERRUPTED)
        if self.pending is None:  # it had only gradients that never left the device
            self.pending = PendingStep(random_state=None)
        self.pending.clip = clip
        self.pending.held = held

    def retry(self) -> tuple[Clip, HeldProgress]:
        """Take up an interrupted fused step again: the clip its first attempt computed,
        and how far it got with the device gradients."""
        assert self.pending is not None and self.pending.clip is not None
        clip, self.pending.clip = self.pending.clip, None
        held, self.pending.held = self.pending.held or HeldProgress(), None
        self._enter("retry", self._after_restores())
        if self.state is IDLE:
            self.pending = None
        return clip, held

    @property
    def interrupted(self) -> bool:
        """Whether a fused step raised and waits for its retry (or a discard)."""
        return self.state is INTERRUPTED

    @property
    def random_state_at_step_start(self) -> dict[str, torch.Tensor] | None:
        """The generators as the pending step found them (None: none pending, or unknown)."""
        return None if self.pending is None else self.pending.random_state

    def _after_restores(self) -> StepState:
        """The state once the restores so far are done: what is left cached decides."""
        if not self.store:
            return IDLE
        assert self.pending is not None
        return STEPPING if self.pending.counted else CACHED

    def settle_scaled_step(self) -> None:
        """Learn whether the GradScaler skipped the last completed step and, if it did,
        undo what that step did to the engine: its residuals replaced, its random draws,
        its count. Called before anything could build on that step (the next step's first
        launch, a discard, a checkpoint).

        Known on the host, with no device read (this runs in backward's first hook): the
        scaler's ``step(optimizer)`` calls ``optimizer.step()`` only if it found no inf or
        NaN, and its ``update()`` changes its scale tensor in place (its version counter
        moves). So the step was skipped if ``update()`` ran since its restore and no
        optimizer holding a cached parameter stepped. No update yet (micro-batches each
        restored with ``apply_gradients()``): not skipped. With several optimizers, one
        that stepped makes the step taken for all.
        """
        scaled, self.unsettled = self.unsettled, None
        if scaled is None:
            return
        scale = self._loss_scale()
        updated = scale is not None and scale._version != scaled.scale_version
        if scaled.stepped or not updated:
            self.backend.residuals.forget_replaced()
            return
        self.backend.residuals.bring_back_replaced()
        self.set_random_state(scaled.random_state)
        self.steps = scaled.steps

    @property
    def deferred_clip(self) -> torch.Tensor | None:
        """The pending step's deferred clip factor (`defer_clip`), if any."""
        return None if self.pending is None else self.pending.deferred_clip

    def _restore_clipped(self) -> None:
        """Every cached gradient back in ``param.grad``, times the deferred clip, which is
        then spent; the step goes on (not delivered, not counted: its gradients return to
        the cache as this backward hands them over, as under accumulation)."""
        self.drain()
        self.restore(list(self.store))
        assert self.pending is not None  # a deferred clip lives in the pending step
        self.pending.deferred_clip = None

    def defer_clip(self, factor: torch.Tensor) -> None:
        """Every gradient the step holds cached is clipped by ``factor`` (on the device):
        applied as each is restored. Only for a clip that covers all of them."""
        assert self.pending is not None and self.pending.deferred_clip is None
        self.pending.deferred_clip = factor

    def read_norms(
        self, parts: Iterable[BucketPayloads], norm_type: float
    ) -> dict[Param, torch.Tensor]:
        """The norms of the cached gradients in ``parts``, on the device, without restoring
        them: each one its last encode computed (`PendingStep.norms`), of the gradient it
        received before compressing it, or else read from its host payload (a sparse
        payload's norm is that of its values). Later steps' encodes compute norms of
        ``norm_type``."""
        pending = self.pending
        encoded = None if pending is None else pending.norms
        if encoded is not None and encoded.norm_type != norm_type:
            encoded = None
        if pending is not None:
            pending.norm_read = True
        self.clip_with(norm_type)
        device = self.backend.device
        norms = {}
        for part in parts:
            for param, payload in part:
                norm = None if encoded is None else encoded.get(param)
                if norm is None:
                    # Where no encode computed it (the first step that asks, a step resumed
                    # from a checkpoint): from the host payload, taken to the device, where
                    # clip_grad_norm_ returns its norm.
                    norm = gradient_norm(payload.kept_values(), norm_type).to(device)
                norms[param] = norm
        return norms

    def clip_with(self, norm_type: float | None) -> None:
        """A fused step clips by the norm of ``norm_type`` (None: it does not clip): the
        next steps' encodes compute each gradient's norm of that type (`PendingStep.norms`)."""
        self.clip_norm_type = norm_type

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After any optimizer's step: note a step of the cached parameters."""
        scaled = self.unsettled
        if scaled is None or scaled.stepped:
            return
        params = (p for group in optimizer.param_groups for p in group["params"])
        scaled.stepped = any(p in self.records for p in params)

    def finish_step(self) -> None:
        """After a restore: close the step once nothing of it is cached, and move the
        routes on where the step count changed them (the warm-up's end; never inside a
        backward hook: the CUDA backend re-lays its pinned pool, after a drain)."""
        self._enter("finish", self._after_restores())
        if self.state is IDLE:
            self.pending = None
        if self._planned_at < self.config.warmup_steps <= self.steps:
            self._follow_plan()

    @property
    def step_pending(self) -> bool:
        """Whether a step is pending: from the first gradient a backward hands over until
        all it cached is restored or discarded."""
        return self.state is not IDLE

    def resume(self, random_state: dict[str, torch.Tensor] | None) -> None:
        """Take up a pending step a checkpoint saved, with the generators' states at its
        start; its payloads follow (`put_back`), then `drain`."""
        self._enter("resume", CAPTURING)
        self.pending = PendingStep(random_state)

    def put_back(self, encoded: list[Encoded]) -> None:
        """Store payloads a checkpoint saved, as a launch stores a bucket."""
        self._enter("launch", CAPTURING)
        self._keep(encoded, [])

    def restart_at(self, steps: int) -> None:
        """Continue as if ``steps`` steps were done (a loaded checkpoint); nothing pending."""
        self._enter("restart", IDLE)
        self.unsettled = None
        self.backend.residuals.forget_replaced()
        self.steps = steps
        self._follow_plan()

    def cache_gradients(self, grads: Sequence[tuple[Param, torch.Tensor]]) -> None:
        """Cache ``grads`` (device tensors) as backward hands gradients over, bucket by
        bucket: a checkpoint's gradients that a memory budget kept on the device, taken
        before this manager's budget decided (until then everything is offloaded). After
        `resume`; `drain` follows."""
        for param, grad in grads:
            items = self.assembler.add(param, grad)
            if items is not None:
                self._launch(items)

    def kept_stepped(self, params: Iterable[Param]) -> None:
        """The kept gradients of ``params`` were stepped (and freed): no longer pending."""
        self.kept_unstepped.difference_update(params)

    def keep_on_device(self, params: Iterable[Param]) -> None:
        """Later backward passes leave ``params``' gradients on the device (a memory
        budget's decision), as ``exclude_layers`` would."""
        self.kept_on_device.update(params)

    def set_enabled(self, enabled: bool) -> None:
        """Whether later backward passes offload (False: their gradients stay put)."""
        self.enabled = enabled

    # --- bookkeeping --------------------------------------------------------------

    def random_sources(self) -> dict[str, RandomSource]:
        """The engine's own random generators, by the part that draws from them."""
        return {
            f"{codec.name}.{part}": generators
            for codec in self.codecs.all()
            for part, generators in codec.generators().items()
        }

    def random_state(self) -> dict[str, torch.Tensor]:
        """The engine's generators' states on its device (never the global RNG's)."""
        states = {
            name: generators.get_state(self.backend.device)
            for name, generators in self.random_sources().items()
        }
        return {name: state for name, state in states.items() if state is not None}

    def set_random_state(self, states: dict[str, torch.Tensor]) -> None:
        """Put back what `random_state` returned."""
        for name, generators in self.random_sources().items():
            generators.set_state(self.backend.device, states.get(name))

    def describe(self, params: Iterable[Param]) -> StepRecord:
        """The figures of the cached payloads of ``params`` (sizes only: no data is read)."""
        record = StepRecord()
        for param in params:
            payload = self.store[param]
            route = self.records[param].route
            record.layers[self.records[param].name] = LayerRecord(
                numel=route.numel,
                dense_bytes=route.numel * param.element_size(),
                stored_bytes=payload.nbytes,
                kept=payload.kept,
                compressed=route.compressed,
                codec=route.codec.name,
            )
        return record

    # --- inspection (memory accounting) -------------------------------------------

    def held_tensors(self) -> HeldTensors:
        """What the engine holds now (a read-only view; see `HeldTensors`)."""
        residuals = self.backend.residuals
        kept_residuals = [*residuals.current().values(), *residuals.pending().values()]
        on_host = self.config.residual_options.residual_location == "host"
        return HeldTensors(
            host=(
                *self.store.tensors(),
                *(self.random_state_at_step_start or {}).values(),
                *(kept_residuals if on_host else ()),
                *(() if self.optimizer_state is None else self.optimizer_state.host_tensors()),
            ),
            scratch=tuple(t for codec in self.codecs.all() for t in codec.scratch_tensors()),
            waiting=tuple(self.assembler.waiting()),
        )

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
            self.backend.close()
