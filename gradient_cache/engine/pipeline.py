"""The pipeline: hooks → buckets → encode → host memory → restore.

Backward's post-accumulate-grad hook takes each gradient as soon as it is complete,
frees it from the parameter and adds it to the open bucket; a full bucket is encoded by
each parameter's route and sent to host memory while backward goes on. `drain()` flushes
the partial bucket and waits; `restoring` is the one path that takes payloads out of the
store. The pipeline owns the step's state machine (`step_state`); what a step does with
the restored gradients is the step's (`engine/step.py`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from ..codecs.generators import RandomSource
from . import sharding
from .backend import Encoded, Restore
from .bucket import BucketAssembler, BucketState, Item
from .config import EngineConfig
from .factory import BackendFactory, create_backend
from .figures import CacheTensors, LayerFigures, StepFigures
from .layout import gradient_strides
from .norms import StepNorms, norm_slots
from .optimizer_state import HostOptimizerState
from .records import CachedParam, GradientAt, GroupArrivals
from .route import Codecs, Route, RoutePlan
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
from .store import BucketPayloads, GradientStore

Param = torch.nn.Parameter
NONE, OPEN_BUCKET, IN_FLIGHT, STORED, KEPT_ON_DEVICE, HELD_FOR_STEP = GradientAt

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
        _refuse_cached_twice(named_params)
        self._gradient_checked = False
        shapes = {p: (tuple(sharding.local_shape(p)), p.dtype) for p in params}
        planner = _Planner(
            shapes, {p: gradient_strides(sharding.local(p)) for p in params}, config, ratio
        )
        # Checks the host budget before it allocates anything; no hook exists yet either.
        self.backend = backend_factory(params, config, plan=planner)
        self.plan = planner.plan_for(self.backend.default_selection)
        self.codecs = self.plan.codecs
        # The optimizer's state in host memory between fused steps (offload_optimizer_state).
        self.optimizer_state = (
            HostOptimizerState(self.backend, config.host_memory_fraction)
            if config.offload_optimizer_state
            else None
        )
        self.steps = 0
        group_of = _arrival_groups(groups, params)
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
        # Error feedback keeps its residual unscaled by this GradScaler's current scale.
        self.grad_scaler = grad_scaler
        self.last_step = StepFigures()
        # The step's life: its state, and its record while one is pending (None in IDLE).
        self.state = IDLE
        self.pending: PendingStep | None = None
        # The norm type the fused steps clip by (`compute_norms`): the encodes compute it.
        self.clip_norm_type: float | None = None
        self._norm_slots = norm_slots(params)
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params
        ]
        # Whether the GradScaler skipped the last completed step (`settle_scaled_step`).
        self.skips = None if grad_scaler is None else SkipWatch(grad_scaler, self.records)
        if self.skips is not None:
            self._handles.append(self.skips.handle)
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
        record = self.records[param]
        if record.keep_on_device:
            record.gradient = KEPT_ON_DEVICE  # left in .grad, part of the pending step
            return
        if self.deferred_clip is not None:
            # A backward after a clip answered from the cache: plain PyTorch adds to the
            # clipped gradients, so they come back clipped first (a restore, once).
            self._restore_clipped()
        if not self._gradient_checked:
            sharding.check_gradient_is_reduced(record.name, grad)
            self._gradient_checked = True
        self._capture()
        param.grad = None
        if self.assembler.holds(param) and param in self.store:
            # A third micro-batch while the second waits here and the first is cached:
            # the waiting bucket goes first, so the cached part joins the second gradient
            # before the third does ((a + b) + c, plain PyTorch's order).
            self._launch(self.assembler.flush() or [])
        group_complete = self._group_complete(record.group)
        items = self.assembler.add(param, sharding.local(grad))
        record.gradient = OPEN_BUCKET
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
            if loss_scale(self.grad_scaler) is not None:
                found_inf = torch.zeros((), dtype=torch.bool, device=self.backend.device)
            norms = None
            if self.clip_norm_type is not None:
                norms = StepNorms(self._norm_slots, self.clip_norm_type, self.backend.device)
            self.pending = PendingStep(self.random_state(), found_inf, norms)
            self._forget_takers()  # a new step: its gradients are new

    def _enter(self, phase: str, state: StepState) -> None:
        """Move to ``state`` by ``phase``, or raise if ``phase`` cannot start from here."""
        if self.state not in PHASES_FROM[phase]:
            advice = ADVICE.get(self.state, "this is a gradient-cache bug; please report it")
            raise StepStateError(
                f"The gradient cache cannot {phase} while its step is {self.state.value}: {advice}."
            )
        self.state = state

    @staticmethod
    def _group_complete(arrivals: GroupArrivals | None) -> bool:
        """Count an arrival in ``arrivals``; whether it completes the group."""
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
        scale = loss_scale(self.grad_scaler)
        encoded: list[Encoded] = []
        try:
            with self.backend.encoding([param for param, _ in items]):
                for param, grad in items:
                    encoded.append(self._encode(param, grad, scale))
        except BaseException:
            for param, grad in items[len(encoded) :]:
                param.grad = sharding.as_grad_of(param, grad)
                self.records[param].gradient = self._cached_part_at(param)
            raise
        finally:
            self._keep(encoded, [grad for _, grad in items[: len(encoded)]])

    def _encode(self, param: Param, grad: torch.Tensor, scale: torch.Tensor | None) -> Encoded:
        """Runs where the backend's `encoding` puts it; reads but never changes cached state."""
        route = self.records[param].route
        codec = route.codec
        flat = route.flatten(grad.detach())
        cached = self.store.payload(param)
        if cached is not None:  # gradient accumulation: the cached part joins this one
            flat = cached.moved(self.backend.to_device).add_to(flat)
        residual = None if codec.residual is None else self.backend.residuals.read(param)
        found_inf = None if self.pending is None else self.pending.found_inf
        if found_inf is not None:  # the fused step skips on it, as scaler.step() would
            torch.logical_or(found_inf, ~torch.isfinite(flat).all(), out=found_inf)
        if self.pending is not None and self.pending.norms is not None:
            # The norm of what this encode compresses (under accumulation, the decoded
            # earlier micro-batches plus this one), read by the fused step's clip with no
            # pass over the payloads.
            self.pending.norms.write(param, flat)
        payload, new_residual = codec.encode(flat, residual, loss_scale=scale)
        return Encoded(param, payload, new_residual, () if residual is None else (residual,))

    def _keep(self, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        """Send ``encoded`` to host memory (the backend keeps their residuals) and store it."""
        if encoded:
            self.store.put(self.backend.store(encoded, grads))
            for each in encoded:
                self.records[each.param].gradient = IN_FLIGHT

    def _cached_part_at(self, param: Param) -> GradientAt:
        """Where the store's part of ``param``'s gradient is (NONE: it has none)."""
        state = self.store.bucket_state(param)
        if state is None:
            return NONE
        return IN_FLIGHT if state is BucketState.LANDING else STORED

    # --- drain, discard and the restore path (between backward and the optimizer) ---

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
        for param in self.store:
            self.records[param].gradient = STORED
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
        self._spend(list(self.store))
        self.backend.residuals.drop_pending()
        if self.pending is not None and self.pending.random_state is not None:
            self.set_random_state(self.pending.random_state)
        self._enter("discard", IDLE)
        self.pending = None
        self._forget_takers()

    def restoring(
        self,
        buckets: Sequence[Sequence[Param]],
        *,
        clip_factor: torch.Tensor | None,
        alongside: Callable[[Sequence[Param]], object] | None = None,
    ) -> Generator[list[tuple[Param, torch.Tensor]], None, None]:
        """The one restore path: each bucket's cached gradients as device tensors (times
        ``clip_factor``), bucket by bucket, the backend's ``restore_ahead`` buckets
        restoring ahead; ``alongside`` is called as a bucket's restore starts (its
        optimizer state's journey). A bucket's payloads leave the store once the consumer
        asks for the next bucket (for the fused step: once the bucket stepped); closed
        early (an error), the restores ahead complete before their blocks are freed and
        what was not spent stays cached."""
        ahead: deque[Restore] = deque()
        try:
            for i, params in enumerate(buckets):
                while len(ahead) <= self.backend.restore_ahead and i + len(ahead) < len(buckets):
                    later = buckets[i + len(ahead)]
                    items = [(param, self.store[param]) for param in later]
                    ahead.append(self.backend.start_restore(items, clip_factor=clip_factor))
                    if alongside is not None:
                        alongside(later)
                yield self.backend.finish_restore(ahead.popleft())
                self._spend(params)
        finally:
            for restore in ahead:
                self.backend.finish_restore(restore)  # before its blocks are freed

    def restore(self, params: Iterable[Param]) -> None:
        """Put the cached gradients of ``params`` into ``param.grad`` (added to any there),
        times the deferred clip's factor, if one is pending."""
        buckets = [[param for param, _ in part] for part in self.store.parts(set(params))]
        with contextlib.closing(self.restoring(buckets, clip_factor=self.deferred_clip)) as each:
            for grads in each:
                for param, grad in grads:
                    grad = sharding.as_grad_of(param, grad)
                    param.grad = grad if param.grad is None else param.grad.add_(grad)

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
        for record in self.records.values():
            if record.gradient is KEPT_ON_DEVICE:
                record.gradient = NONE  # restored beside them: the user's, as plain leaves them
        self.finish_step()

    def deliver_and_restore(self, params: Iterable[Param]) -> None:
        """`deliver` then `restore` ``params``: their gradients back in ``param.grad``, the
        step counted."""
        params = list(params)
        self.deliver(params)
        self.restore(params)

    def skip(self, params: Iterable[Param]) -> None:
        """A step the GradScaler skips: the cached gradients of ``params`` are delivered and
        spent unrestored, as ``scaler.step()`` leaves a skipped step's gradients unused."""
        params = [param for param in params if param in self.store]
        self.deliver(params)
        self._spend(params)

    def hold_for_step(self, held: Iterable[Param]) -> dict[Param, GradientAt]:
        """The device gradients of ``held`` out of ``param.grad`` while the fused step's
        buckets step (`GradientAt.HELD_FOR_STEP`: stepped last); where each cached one was
        before, for `release_held` if the step raises."""
        before = {}
        for param in held:
            param.grad = None
            record = self.records.get(param)
            if record is not None:
                before[param] = record.gradient
                record.gradient = HELD_FOR_STEP
        return before

    def release_held(self, before: dict[Param, GradientAt]) -> None:
        """A fused step raised: the held gradients are where they were before it."""
        for param, at in before.items():
            self.records[param].gradient = at

    def held_stepped(self, held: Iterable[Param]) -> list[Param]:
        """The held gradients were stepped: no longer part of the pending step. Returns
        those a memory budget keeps on the device, which the step frees."""
        kept = []
        for param in held:
            record = self.records.get(param)
            if record is not None:
                record.gradient = NONE
                if record.keep_on_device:
                    kept.append(param)
        return kept

    def _spend(self, params: Iterable[Param]) -> None:
        """The payloads of ``params`` leave the store: restored, skipped or discarded."""
        params = list(params)
        self.store.remove(params)
        for param in params:
            self.records[param].gradient = NONE

    def parts(self, params: Iterable[Param]) -> list[BucketPayloads]:
        """The cached payloads of ``params``, bucket by bucket (`GradientStore.parts`)."""
        return self.store.parts(set(params))

    # --- the step's phases ------------------------------------------------------------

    def deliver(self, params: Iterable[Param]) -> None:
        """The pending step delivers its gradients of ``params`` (before their restore):
        their figures become the last step's, the step is counted (once, however many
        restores deliver it), and their new residuals become the current ones."""
        params = list(params)
        if not params:
            return
        self._enter("deliver", STEPPING)
        assert self.pending is not None  # every state deliver starts from has one
        figures = self.describe(params)
        if self.pending.counted:
            self.last_step.layers.update(figures.layers)
        else:
            self.last_step = figures
            if self.skips is not None:
                self.skips.delivered(self.pending.random_state, self.steps)
            self.steps += 1
            self.pending.counted = True
        unsettled = self.skips is not None and self.skips.unsettled is not None
        self.backend.residuals.promote(params, keep_replaced=unsettled)

    def interrupt(self, clip: Clip, held: HeldProgress) -> None:
        """A fused step raised: keep its clip and its progress on the held gradients for
        the retry (`retry`)."""
        self._enter("interrupt", INTERRUPTED)
        if self.pending is None:  # it had only gradients that never left the device
            self.pending = PendingStep(random_state=None)
        self.pending.clip = clip
        self.pending.held = held

    def retry(self) -> tuple[Clip, HeldProgress]:
        """Take up an interrupted fused step again: the clip its first attempt computed,
        and how far it got with the held gradients."""
        assert self.pending is not None and self.pending.clip is not None
        clip, self.pending.clip = self.pending.clip, None
        held, self.pending.held = self.pending.held or HeldProgress(), None
        self._enter("retry", self._after_restores())
        if self.state is IDLE:
            self.pending = None
        return clip, held

    def finish_step(self) -> None:
        """After a restore: close the step once nothing of it is cached, and move the
        routes on where the step count changed them (the warm-up's end; never inside a
        backward hook: the CUDA backend re-lays its pinned pool, after a drain)."""
        self._enter("finish", self._after_restores())
        if self.state is IDLE:
            self.pending = None
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
        """Whether a step is pending: from the first gradient a backward hands over until
        all it cached is restored or discarded."""
        return self.state is not IDLE

    @property
    def random_state_at_step_start(self) -> dict[str, torch.Tensor] | None:
        """The generators as the pending step found them (None: none pending, or unknown)."""
        return None if self.pending is None else self.pending.random_state

    def settle_scaled_step(self) -> None:
        """Learn whether the GradScaler skipped the last completed step (`SkipWatch`) and,
        if it did, undo what that step did to the engine: its residuals replaced, its
        random draws, its count. Called before anything could build on that step (the
        next step's first launch, a discard, a checkpoint); no device read."""
        if self.skips is None or self.skips.unsettled is None:
            return
        skipped = self.skips.settle()
        if skipped is None:
            self.backend.residuals.forget_replaced()
            return
        self.backend.residuals.bring_back_replaced()
        self.set_random_state(skipped.random_state)
        self.steps = skipped.steps

    def take_for(self, optimizer: torch.optim.Optimizer, params: Iterable[Param]) -> None:
        """A fused step of ``optimizer`` takes the cached gradients of ``params`` (they
        leave the cache once stepped, as if ``zero_grad()`` had run)."""
        for param in params:
            self.records[param].taken_by = weakref.ref(optimizer)

    def _forget_takers(self) -> None:
        for record in self.records.values():
            record.taken_by = None

    # --- the clip's and the norms' part of the pending step ---------------------------

    @property
    def deferred_clip(self) -> torch.Tensor | None:
        """The pending step's deferred clip factor (`defer_clip`), if any."""
        return None if self.pending is None else self.pending.deferred_clip

    def defer_clip(self, factor: torch.Tensor) -> None:
        """Every gradient the step holds cached is clipped by ``factor`` (on the device):
        applied as each is restored. Only for a clip that covers all of them."""
        assert self.pending is not None and self.pending.deferred_clip is None
        self.pending.deferred_clip = factor

    def _restore_clipped(self) -> None:
        """Every cached gradient back in ``param.grad``, times the deferred clip, which is
        then spent; the step goes on (not delivered, not counted: its gradients return to
        the cache as this backward hands them over, as under accumulation)."""
        self.drain()
        self.restore(list(self.store))
        assert self.pending is not None  # a deferred clip lives in the pending step
        self.pending.deferred_clip = None

    def compute_norms(self, norm_type: float | None) -> None:
        """The next steps' encodes compute each gradient's norm of ``norm_type`` (None:
        none), for the fused step's clip (`PendingStep.norms`)."""
        self.clip_norm_type = norm_type

    def encoded_norms(self, norm_type: float) -> StepNorms | None:
        """The pending step's encoded norms if they are of ``norm_type`` (a norm is read
        from the cache: the later steps' encodes compute that type)."""
        pending = self.pending
        if pending is not None:
            pending.norm_read = True
        self.compute_norms(norm_type)
        norms = None if pending is None else pending.norms
        return norms if norms is not None and norms.norm_type == norm_type else None

    # --- checkpoints and a memory budget ------------------------------------------------

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
        if self.skips is not None:
            self.skips.unsettled = None
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
            self.records[param].gradient = OPEN_BUCKET
            if items is not None:
                self._launch(items)

    def keep_on_device(self, params: Iterable[Param]) -> None:
        """Later backward passes leave ``params``' gradients on the device (a memory
        budget's decision), as ``exclude_layers`` would."""
        for param in params:
            self.records[param].keep_on_device = True

    def set_enabled(self, enabled: bool) -> None:
        """Whether later backward passes offload (False: their gradients stay put)."""
        self.enabled = enabled

    # --- random generators, figures, tensors ----------------------------------------

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

    def describe(self, params: Iterable[Param]) -> StepFigures:
        """The figures of the cached payloads of ``params`` (sizes only: no data is read)."""
        figures = StepFigures()
        for param in params:
            payload = self.store[param]
            route = self.records[param].route
            figures.layers[self.records[param].name] = LayerFigures(
                numel=route.numel,
                dense_bytes=route.numel * param.element_size(),
                stored_bytes=payload.nbytes,
                kept=payload.kept,
                compressed=route.compressed,
                codec=route.codec.name,
            )
        return figures

    def cache_tensors(self) -> CacheTensors:
        """What the cache has now (a read-only view; see `CacheTensors`)."""
        residuals = self.backend.residuals
        residual_tensors = [*residuals.current().values(), *residuals.pending().values()]
        on_host = self.config.residual_options.residual_location == "host"
        return CacheTensors(
            host=(
                *self.store.tensors(),
                *(self.random_state_at_step_start or {}).values(),
                *(residual_tensors if on_host else ()),
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


class _Planner:
    """The routes, planned on the first call (the backend factory's, for its budget check;
    else the pipeline's, with the backend's default selection)."""

    def __init__(
        self,
        shapes: dict[Param, tuple[tuple[int, ...], torch.dtype]],
        strides: dict[Param, tuple[int, ...]],
        config: EngineConfig,
        ratio: float,
    ) -> None:
        self._shapes, self._strides, self._config, self._ratio = shapes, strides, config, ratio
        self._plan: RoutePlan[Param] | None = None

    def __call__(self, selection: str) -> dict[Param, Route]:
        return self.plan_for(selection).at(0)

    def plan_for(self, selection: str) -> RoutePlan[Param]:
        if self._plan is None:
            config = self._config
            if config.selection != "auto":
                selection = config.selection
            codecs = Codecs.for_options(config, ratio=self._ratio, selection=selection)
            self._plan = RoutePlan(
                self._shapes,
                codecs=codecs,
                config=config,
                selection=selection,
                strides=self._strides,
            )
        return self._plan


def _arrival_groups(
    groups: Sequence[Sequence[Param]], params: list[Param]
) -> dict[Param, GroupArrivals]:
    """Each cached parameter of an FSDP2 group, with its group's shared arrival count."""
    cached = set(params)
    group_of: dict[Param, GroupArrivals] = {}
    for group in groups:
        members = [p for p in group if p in cached]
        arrivals = GroupArrivals(len(members))
        group_of.update(dict.fromkeys(members, arrivals))
    return group_of


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
