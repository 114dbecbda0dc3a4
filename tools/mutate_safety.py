# ruff: noqa: E501 - the mutants are exact source snippets
"""Mutation check of the engine's safety mechanisms other than stream waits.

    python tools/mutate_safety.py [PYTHON] [-k TEXT]     (from the project root)

``-k TEXT`` runs only the mutants whose description contains TEXT (repeatable).

Each mutant deletes or reorders one mechanism (a rollback, a give-back, a release, a budget
check, an accumulation) in a copy of the checkout and runs the tests that guard it; every
mutant must be killed. The stream waits have their own tool: ../shared/tools/mutate_waits.py.
"""

import argparse
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path.cwd()
MUTANTS = [
    (
        "fused step: device gradients put back on failure",
        "gradient_cache/engine/fused_step.py",
        "        put_back(steps.held)  # as the retry finds them: `progress` says what was done to them\n",
        "",
        "tests/test_stream_order.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        # Was: the interrupted_clip assignment deleted. The clip is now kept by
        # pipeline.interrupt(clip) and handed back by pipeline.retry(); the retry still
        # happens (OptimizerStep._fused: the state moves on) but its clip is dropped, so it
        # is recomputed.
        "fused step: clip factor kept for the retry",
        "gradient_cache/engine/step.py",
        "        clip, progress = pipeline.retry() if pipeline.interrupted else (None, HeldProgress())\n",
        "        progress = pipeline.retry()[1] if pipeline.interrupted else HeldProgress()\n        clip = None\n",
        "tests/test_training.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "fused step: wait for the prefetched restore before freeing",
        "gradient_cache/engine/pipeline.py",
        "                self.backend.finish_restore(restore)  # before its blocks are freed",
        "                pass",
        "tests/test_stream_order.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        # Issue 42: a bucket's payloads leave the store in the one restore path
        # (Pipeline.restoring), when the next bucket is asked for, i.e. after its step.
        "fused step: payloads leave only after their step (remove before step)",
        "gradient_cache/engine/pipeline.py",
        "                yield self.backend.finish_restore(ahead.popleft())\n                self._spend(params)",
        "                grads = self.backend.finish_restore(ahead.popleft())\n                self._spend(params)\n                yield grads",
        "tests/test_training.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "routing: the device gradients a fused step stepped are hidden from the call's own step",
        "gradient_cache/engine/fused_step.py",
        "        param.grad = None if kept or hidden else grad\n",
        "        param.grad = None if kept else grad\n",
        "tests/test_fused_routing.py::test_the_decorated_step_is_the_fused_step_with_plain_bits",
    ),
    (
        "routing: no step hook fires inside a bucket's step (a subclass's super().step())",
        "gradient_cache/engine/step_hooks.py",
        "        for table in tables:\n            table.clear()\n",
        "",
        "tests/test_fused_routing.py::test_a_step_that_raises_is_finished_by_calling_step_again",
    ),
    (
        "routing: the hidden device gradients come back after the step",
        "gradient_cache/engine/step.py",
        "        for param, grad in self._hidden.pop(optimizer, {}).items():\n            param.grad = grad",
        "        self._hidden.pop(optimizer, {})",
        "tests/test_fused_routing.py::test_the_decorated_step_is_the_fused_step_with_plain_bits",
    ),
    (
        "routing: the buckets are stepped without the optimizer's step hooks",
        "gradient_cache/engine/step.py",
        "            step_once=step_hooks.unhooked_step,",
        "            step_once=optimizer.step,",
        "tests/test_fused_routing.py::test_the_optimizers_step_hooks_fire_once_per_step",
    ),
    (
        "pipeline: a backward after a deferred clip restores the clipped gradients first",
        "gradient_cache/engine/capture.py",
        "            self._restore_clipped()",
        "            pass",
        "tests/test_fused_routing.py::test_a_backward_after_the_clip_adds_to_the_clipped_gradients",
    ),
    (
        "pipeline: restores apply the deferred clip",
        "gradient_cache/engine/pipeline.py",
        "self.restoring(buckets, clip_factor=self.deferred_clip)",
        "self.restoring(buckets, clip_factor=None)",
        "tests/test_fused_routing.py::test_gradient_readers_after_the_clip_see_clipped_gradients",
    ),
    (
        "fused step: device gradients clipped once under a deferred clip",
        "gradient_cache/engine/step.py",
        "        held_factor = None if deferred is not None else factor",
        "        held_factor = factor",
        "tests/test_fused_routing.py::test_the_decorated_step_is_the_fused_step_with_plain_bits",
    ),
    (
        "checkpoint: the encodes' norm type travels with the state",
        "gradient_cache/engine/checkpoint.py",
        '    pipeline.compute_norms(state.get("clip_norm_type"))',
        "    pass",
        "tests/test_fused_routing.py::test_a_resumed_run_clips_by_the_norms_the_uninterrupted_one_would",
    ),
    (
        "manager: a clip over part of the cached gradients restores and clips that part",
        "gradient_cache/engine/step.py",
        "        if cached and not set(pipeline.store) <= set(params):",
        "        if False:",
        "tests/test_fused_routing.py::test_the_managers_norm_and_clip_in_a_loop_of_your_own",
    ),
    (
        # Issue 42: the kept gradients are those whose record says keep_on_device
        # (fused_step.free_kept), no longer a pipeline set.
        "budget: a kept gradient is freed after the fused step, as a cached one",
        "gradient_cache/engine/fused_step.py",
        "        kept = record is not None and record.keep_on_device\n",
        "        kept = False\n",
        "tests/test_memory_budget.py::test_a_decision_midway_trains_bit_for_bit_as_plain",
    ),
    (
        "budget: the kept gradients stay on the device",
        "gradient_cache/engine/budget.py",
        "            pipeline.records[by_name[name]].keep_on_device = True",
        "            pass",
        "tests/test_memory_budget.py::test_room_to_spare_keeps_everything_on_the_device",
    ),
    (
        "budget: the kept state is not sent back",
        "gradient_cache/engine/optimizer_state.py",
        "            if param in self.on_device:\n                continue\n",
        "",
        "tests/test_memory_budget.py::test_room_to_spare_keeps_everything_on_the_device",
    ),
    (
        "budget: the peak counts from the manager's creation",
        "gradient_cache/engine/budget.py",
        "            memory.reset_peak()",
        "            pass",
        "tests/test_memory_budget.py::test_room_to_spare_keeps_everything_on_the_device",
    ),
    (
        "budget: the state stays before a gradient that frees as much",
        "gradient_cache/engine/budget.py",
        '        return c.device_bytes / max(c.link_bytes, 1), c.kind == "gradient"',
        '        return c.device_bytes / max(c.link_bytes, 1), c.kind != "gradient"',
        "tests/test_memory_budget.py::test_tighter_takes_compressed_gradients_off_first_then_the_state",
    ),
    (
        "launch: give gradients back on an encode failure",
        "gradient_cache/engine/capture.py",
        "            for param, grad in items[len(encoded) :]:\n                param.grad = sharding.as_grad_of(param, grad)\n                pipeline.records[param].gradient = self._cached_part_at(param)\n",
        "",
        "tests/test_pipeline.py",
    ),
    (
        "launch: keep what was encoded before the failure",
        "gradient_cache/engine/capture.py",
        "        finally:\n            self.store_encoded(encoded, [grad for _, grad in items[: len(encoded)]])",
        "        else:\n            self.store_encoded(encoded, [grad for _, grad in items[: len(encoded)]])",
        "tests/test_pipeline.py",
    ),
    (
        # Killed only where the encode allocates (top-k at ratio 100): lossless, the
        # retired bucket's tensors went at the end of `encoding` just the same.
        "cuda: drop the retired bucket's device tensors (memory bound)",
        "gradient_cache/engine/cuda.py",
        "            retired.tensors.clear()  # safe now",
        "            pass  # safe now",
        "tests/test_stream_order.py::test_device_memory_in_flight_is_bounded_by_the_staging_depth",
    ),
    (
        "budget checked before the pool is allocated",
        "gradient_cache/engine/factory.py",
        '    check_host_budget(\n        needed, fraction=config.host_memory_fraction, what="the host pool of payload slots"\n    )\n    pool = HostPool(layout, allocate_pinned=allocate if config.pin_memory else None)',
        '    pool = HostPool(layout, allocate_pinned=allocate if config.pin_memory else None)\n    check_host_budget(\n        needed, fraction=config.host_memory_fraction, what="the host pool of payload slots"\n    )',
        "tests/test_stream_order.py::test_refused_construction_leaves_no_pinned_memory_or_hook",
    ),
    (
        # Issue 33, item 7: new smaller slabs cannot reuse the warm-up's cached pinned block.
        "pool: the warm-up's end cuts the steady slots from the slabs already pinned",
        "gradient_cache/engine/pool.py",
        "        if all(key in rooms and _fits(spec, rooms[key]) for key, spec in layout.items()):",
        "        if False:",
        "tests/test_stream_order.py::test_the_warmups_end_pins_nothing_beyond_what_the_host_check_approved",
    ),
    (
        "cgroup: ancestors' limits count",
        "gradient_cache/engine/hostmem.py",
        "        directory = directory.parent",
        "        return found",
        "tests/test_hostmem.py",
    ),
    (
        "accumulation: a waiting gradient is added, not replaced",
        "gradient_cache/engine/bucket.py",
        "            self._items[param] = grad.add_(waiting)",
        "            self._items[param] = grad",
        "tests/test_training.py",
    ),
    (
        "accumulation: the cached payload joins the next gradient",
        "gradient_cache/engine/capture.py",
        "            flat = cached.moved(pipeline.backend.to_device).add_to(flat)",
        "            pass",
        "tests/test_training.py tests/test_stream_order.py",
    ),
    (
        "discard: a pending step's residuals are dropped",
        "gradient_cache/engine/pipeline.py",
        "        self.backend.residuals.drop_pending()\n",
        "",
        "tests/test_checkpoint.py::test_a_discard_after_resuming_mid_step_rewinds_to_the_step_start",
    ),
    (
        "discard: the engine's generators are rewound",
        "gradient_cache/engine/pipeline.py",
        "            self.codecs.set_random_state(self.backend.device, self.pending.random_state)",
        "            pass",
        "tests/test_checkpoint.py::test_a_discard_after_resuming_mid_step_rewinds_to_the_step_start",
    ),
    (
        "host residuals: a pending step's residual goes to the spare slot",
        "gradient_cache/engine/residuals.py",
        "        return self._current(param) if slot.spare_residual is None else slot.spare_residual",
        "        return self._current(param)",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "checkpoint: residuals loaded",
        "gradient_cache/engine/residuals.py",
        "        self._current = {p: r.to(self.device, copy=True) for p, r in current.items()}",
        "        pass",
        "tests/test_checkpoint.py",
    ),
    (
        "checkpoint: host residuals loaded into their slots",
        "gradient_cache/engine/residuals.py",
        "            self._current(param).copy_(saved)  # nothing in flight",
        "            pass  # nothing in flight",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "checkpoint: cached payloads stored under the encode stream's ordering",
        "gradient_cache/engine/checkpoint.py",
        "        with pipeline.backend.encoding(params):",
        "        if True:",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "checkpoint: generators loaded",
        "gradient_cache/engine/checkpoint.py",
        '    pipeline.codecs.set_random_state(\n        pipeline.backend.device, state["random_state"] if same_kind else {}\n    )',
        "    pass",
        "tests/test_checkpoint.py",
    ),
    (
        "fsdp: the clip norm is all-reduced over the shards",
        "gradient_cache/engine/sharding.py",
        "        dist.all_reduce(value, op=op, group=mesh.get_group(dim))",
        "        pass",
        "tests/test_distributed.py::test_fused_clipping_matches_clip_grad_norm",
    ),
    (
        "fsdp: a bucket closes when its group is complete",
        "gradient_cache/engine/capture.py",
        "        if group_complete:\n",
        "        if False:\n",
        "tests/test_distributed.py::test_a_bucket_closes_when_its_fsdp_group_is_complete",
    ),
    (
        "fsdp: the parameter watch accepts FSDP2's unsharded stand-ins",
        "gradient_cache/model_watch.py",
        " and not _unsharded_of(param, ref())",
        "",
        "tests/test_distributed.py::test_ratio_1_is_bit_identical_to_plain_fsdp2",
    ),
    (
        "ddp: a plain gradient across processes is refused at the first hook",
        "gradient_cache/engine/capture.py",
        "            sharding.check_gradient_is_reduced(record.name, grad)",
        "            pass",
        "tests/test_distributed.py::test_refused_on_every_rank_with_the_reason",
    ),
    (
        "fsdp: a checkpoint of another rank or world size is refused",
        "gradient_cache/engine/checkpoint.py",
        "        if tuple(saved_shards) != here_shards:",
        "        if False:",
        "tests/test_distributed.py::test_checkpoint_per_rank_resumes_bit_for_bit",
    ),
    (
        "lightning: a state restored after on_fit_start is loaded at once",
        "gradient_cache/integrations/lightning.py",
        "        if self._manager is not None and self._state_to_load is not None:",
        "        if False:",
        "tests/test_lightning.py::test_fsdp2_through_model_parallel_strategy_on_two_processes",
    ),
    (
        "lightning: every rank's state is gathered for rank 0's checkpoint",
        "gradient_cache/integrations/lightning.py",
        "        if not self._per_rank_state:",
        "        if True:",
        "tests/test_lightning.py::test_fsdp2_through_model_parallel_strategy_on_two_processes",
    ),
    (
        "readers: clip_grad_value_ and unscale_ restore the cached gradients first",
        "gradient_cache/gradient_readers.py",
        "        reads.restore(reader.__qualname__, parameters)",
        "        pass",
        "tests/test_decorator.py tests/test_fused_routing.py tests/test_custom_loop_readers.py",
    ),
    (
        "readers: clip_grad_norm_ answered from the cache (else restored first)",
        "gradient_cache/manager.py",
        "        if len(holders) != 1:\n            return None",
        "        return None",
        "tests/test_fused_routing.py::test_the_decorated_step_is_the_fused_step_with_plain_bits",
    ),
    (
        "transformers: the trainer's own log of a step is kept",
        "gradient_cache/integrations/transformers.py",
        "            control.should_log = True",
        "            pass",
        "tests/test_transformers.py::test_trainer_at_ratio_100_trains",
    ),
    (
        "transformers: a resumed run loads the cache's state",
        "gradient_cache/integrations/transformers.py",
        "        manager_of(model).load_state_dict(torch.load(path, weights_only=True))",
        "        pass",
        "tests/test_transformers.py::test_a_run_resumed_from_a_trainer_checkpoint_ends_as_the_uninterrupted_one",
    ),
    (
        "route: the pool's spare residual slots are counted (engine and planner)",
        "gradient_cache/engine/route.py",
        "        spare_residual=residuals.keep_previous_residual,",
        "        spare_residual=False,",
        "tests/test_pool.py::test_host_pool_sizes_residual_and_warmup_slots",
    ),
    (
        "planner: Adam's per-tensor step counters are counted",
        "gradient_cache/planner.py",
        " + inputs.optimizer_tensor_bytes * len(tensors)",
        "",
        "tests/test_demo_default_scenario.py::test_the_planner_matches_the_demos_measured_components",
    ),
    (
        "fsdp: plain parameters beside sharded ones are refused",
        "gradient_cache/engine/sharding.py",
        "    if len(sharded) != len(named_params) and dist.get_world_size() > 1:",
        "    if False:",
        "tests/test_distributed.py::test_refused_on_every_rank_with_the_reason",
    ),
    # --- the gradient store (engine/store.py) ---
    (
        "store: a re-cached parameter leaves its old bucket",
        "gradient_cache/engine/store.py",
        "            if previous is not None:\n                del previous.payloads[param]",
        "            if previous is not None:\n                pass",
        "tests/test_training.py::test_gradient_accumulation_sums_exactly_when_lossless",
    ),
    (
        "store: remove drops empty buckets",
        "gradient_cache/engine/store.py",
        "            del self._where.pop(param).payloads[param]\n        self._buckets = [b for b in self._buckets if len(b)]",
        "            del self._where.pop(param).payloads[param]",
        "tests/test_checkpoint.py",
    ),
    (
        "store: parts refuses a bucket that has not landed",
        "gradient_cache/engine/store.py",
        '            if bucket.state is not BucketState.CACHED:\n                raise RuntimeError("gradient-cache internal error: a restore before the drain")\n',
        "",
        "tests/test_store.py",
    ),
    (
        "store: a spent payload's parameter is forgotten (a discard, a restore)",
        "gradient_cache/engine/store.py",
        "            del self._where.pop(param).payloads[param]",
        "            del self._where[param].payloads[param]",
        "tests/test_api.py::test_a_discarded_batch_leaves_no_trace",
    ),
    # --- the residual stores (engine/residuals.py) ---
    (
        "residuals: promote makes a delivered step's residuals current",
        "gradient_cache/engine/residuals.py",
        "                self._current[param] = self._pending.pop(param)",
        "                pass",
        "tests/test_checkpoint.py::test_the_state_holds_residuals_and_the_cached_gradients_by_name tests/test_checkpoint.py::test_a_discard_after_resuming_mid_step_rewinds_to_the_step_start",
    ),
    (
        "host residuals: promote swaps the slot and its spare",
        "gradient_cache/engine/residuals.py",
        # Since the scaler-skip work promote swaps through _swap (shared with
        # bring_back_replaced): the call in promote is the one deleted.
        "                self._pending.discard(param)\n                self._swap(param)\n",
        "                self._pending.discard(param)\n",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "residuals: drop_pending drops the pending residuals",
        "gradient_cache/engine/residuals.py",
        "    def drop_pending(self) -> None:\n        self._pending = {}",
        "    def drop_pending(self) -> None:\n        pass",
        "tests/test_checkpoint.py::test_a_discard_after_resuming_mid_step_rewinds_to_the_step_start",
    ),
    (
        "host residuals: drop_pending drops the pending residuals",
        "gradient_cache/engine/residuals.py",
        "    def drop_pending(self) -> None:\n        self._pending = set()",
        "    def drop_pending(self) -> None:\n        pass",
        "tests/test_stream_order.py::test_a_discarded_step_leaves_the_host_residual_as_it_was",
    ),
    (
        "residuals: read gives the pending residual, not the current one",
        "gradient_cache/engine/residuals.py",
        "        return self._pending.get(param, self._current.get(param))",
        "        return self._current.get(param)",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "host residuals: read gives the pending residual, not the current one",
        "gradient_cache/engine/residuals.py",
        "        stored = self._target(param) if param in self._pending else slot.residual",
        "        stored = slot.residual",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    # --- the block codecs (codecs/block_kernels.py, codecs/dither.py) ---
    (
        "block_kernels: stochastic rounding adds the dither (not a deterministic floor)",
        "gradient_cache/codecs/block_kernels.py",
        "            level.add_(noise.uniform(level.numel(), flat.device).view_as(level)).floor_()",
        "            level.floor_()",
        "tests/test_codecs.py::test_stochastic_rounding_is_unbiased",
    ),
    (
        # One of EQUIVALENT_ON_X86: without the mask nothing changes on this CPU.
        "block_kernels: codes masked to their bits (a NaN's byte)",
        "gradient_cache/codecs/block_kernels.py",
        "            codes = level.clamp_(0, top).to(torch.uint8).bitwise_and_(top)",
        "            codes = level.clamp_(0, top).to(torch.uint8)",
        "tests/test_codecs.py",
    ),
    (
        "block_kernels: zeros pad the last chunk's last block",
        "gradient_cache/codecs/block_kernels.py",
        "            part = torch.nn.functional.pad(part, (0, blocks * ROTATION_BLOCK - part.numel()))",
        "            part = torch.nn.functional.pad(part, (0, blocks * ROTATION_BLOCK - part.numel()), value=1.0)",
        "tests/test_codecs.py::test_each_blocks_error_is_within_its_bound",
    ),
    (
        "dither: each window starts at a random offset",
        "gradient_cache/codecs/dither.py",
        # The offsets come from a counter-based hash of (seed, draw) since the codec
        # frontier work (no generator any more); the window still starts at it (the table
        # or its complement, then the offset in it).
        "    return (x >> 63) * 2 * WINDOW + x % WINDOW",
        "    return (x >> 63) * 2 * WINDOW",
        "tests/test_codecs.py::test_stochastic_rounding_is_unbiased",
    ),
    # --- a step the GradScaler skipped (engine/pipeline.py, engine/residuals.py) ---
    (
        "scaler skip: the replaced residuals come back",
        "gradient_cache/engine/pipeline.py",
        "        self.backend.residuals.bring_back_replaced()\n",
        "",
        "tests/test_scaler_skip.py",
    ),
    (
        "scaler skip: the random draws are rewound",
        "gradient_cache/engine/pipeline.py",
        "        self.codecs.set_random_state(self.backend.device, skipped.random_state)\n",
        "",
        "tests/test_scaler_skip.py",
    ),
    (
        "scaler skip: the step is not counted",
        "gradient_cache/engine/pipeline.py",
        "        self.steps = skipped.steps\n",
        "",
        "tests/test_scaler_skip.py",
    ),
    (
        # Issue 42: the skip verdict moved from the pipeline to scaling.SkipWatch.settle.
        "scaler skip: an optimizer's step since the restore means the step was taken",
        "gradient_cache/engine/scaling.py",
        "        if scaled is None or scaled.stepped:\n            return None",
        "        if scaled is None:\n            return None",
        "tests/test_scaler_skip.py",
    ),
    (
        # Issue 42: the skip verdict moved from the pipeline to scaling.SkipWatch.settle.
        "scaler skip: no update() since the restore is no skip (micro-batches restored one by one)",
        "gradient_cache/engine/scaling.py",
        "        return scaled if updated else None",
        "        return scaled",
        "tests/test_scaler_skip.py",
    ),
    (
        "fused step under a scaler: a non-finite gradient skips the step",
        "gradient_cache/engine/step.py",
        "    skip = scaling.found_inf(flag, parts, held, pipeline.backend.device)",
        "    skip = False",
        "tests/test_scaler_skip.py",
    ),
    (
        "fused step under a scaler: the encodes flag non-finite gradients",
        "gradient_cache/engine/capture.py",
        "            torch.logical_or(pending.found_inf, ~torch.isfinite(flat).all(), out=pending.found_inf)",
        "            pass",
        "tests/test_scaler_skip.py",
    ),
    (
        "scaler skip: the next step's first launch settles the verdict",
        "gradient_cache/engine/pipeline.py",
        "            self.settle_scaled_step()\n",
        "",
        "tests/test_scaler_skip.py",
    ),
    (
        "scaler skip: host slots swap the replaced residual back",
        "gradient_cache/engine/residuals.py",
        "        for param in self._replaced:\n            self._swap(param)\n",
        "",
        "tests/test_scaler_skip.py",
    ),
    (
        "int8: the scale's margin keeps codes within [-127, 127] (128 would flip the largest entry's sign)",
        "gradient_cache/codecs/int8_kernels.py",
        "SCALE_MARGIN = 2**-20",
        "SCALE_MARGIN = 0",
        "tests/test_codecs.py::test_int8_never_flips_the_sign_of_a_blocks_largest_entry",
    ),
    (
        "dither: half the draws read the complement table (exact mean 1/2 everywhere)",
        "gradient_cache/codecs/dither.py",
        "    table[2 * WINDOW :].copy_(table[: 2 * WINDOW]).neg_().add_(1)",
        "    table[2 * WINDOW :].copy_(table[: 2 * WINDOW])",
        "tests/test_codecs.py::test_rounding_is_unbiased_at_every_position_over_many_steps",
    ),
    # --- the step's state machine (engine/pipeline.py: StepState, PendingStep) ---
    (
        "drain: a capturing step becomes cached",
        "gradient_cache/engine/pipeline.py",
        '        self._enter("drain", CACHED if self.state is CAPTURING else self.state)',
        '        self._enter("drain", self.state)',
        "tests/test_pipeline.py::test_a_step_goes_idle_capturing_cached_idle_and_is_pending_exactly_when_not_idle tests/test_call_orders.py",
    ),
    (
        "interrupt: a backward after an interrupted fused step is refused",
        "gradient_cache/engine/step_state.py",
        '    "capture": frozenset({IDLE, CAPTURING, CACHED, STEPPING}),',
        '    "capture": frozenset({IDLE, CAPTURING, CACHED, STEPPING, INTERRUPTED}),',
        "tests/test_pipeline.py::test_a_backward_after_a_fused_step_raised_is_refused_naming_the_state_and_the_fix",
    ),
    (
        "interrupt: the fused step's clip is kept on the pending step",
        "gradient_cache/engine/pipeline.py",
        "        self.pending.clip = clip\n",
        "        self.pending.clip = (None, None)\n",
        "tests/test_training.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "retry: the kept clip comes back",
        "gradient_cache/engine/pipeline.py",
        "        if self.state is IDLE:\n            self.pending = None\n        return clip",
        "        if self.state is IDLE:\n            self.pending = None\n        return None",
        "tests/test_training.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "capture: the generators' states at the step's start are kept (for discard)",
        "gradient_cache/engine/pipeline.py",
        "                self.codecs.random_state(self.backend.device), found_inf, norms",
        "                None, found_inf, norms",
        "tests/test_checkpoint.py::test_a_discard_after_resuming_mid_step_rewinds_to_the_step_start tests/test_api.py::test_a_discarded_batch_leaves_no_trace",
    ),
    (
        "deliver: a step is counted once, however many restores deliver it",
        "gradient_cache/engine/pipeline.py",
        "            self.steps += 1\n            self.pending.counted = True",
        "            self.steps += 1",
        "tests/test_pipeline.py::test_a_fused_step_of_one_optimizer_of_two_leaves_the_step_stepping",
    ),
    (
        "finish: a finished step's record is dropped (the next step keeps its own)",
        "gradient_cache/engine/pipeline.py",
        '        self._enter("finish", self._after_restores())\n        if self.state is IDLE:\n            self.pending = None',
        '        self._enter("finish", self._after_restores())',
        "tests/test_training.py tests/test_call_orders.py",
    ),
    (
        "finish: the routes move on where the warm-up ends",
        "gradient_cache/engine/pipeline.py",
        "        if self._planned_at < self.config.warmup_steps <= self.steps:\n            self._follow_plan()",
        "        if False:\n            self._follow_plan()",
        "tests/test_recipes.py::test_warmup_steps_are_plain_then_compressed",
    ),
    (
        "route plan: planned once, not again where the warm-up ends",
        "gradient_cache/engine/pipeline.py",
        "        if self._planned_at < self.config.warmup_steps <= self.steps:\n            self._follow_plan()",
        "        if self._planned_at < self.config.warmup_steps <= self.steps:\n"
        "            shapes = {p: (tuple(sharding.local_shape(p)), p.dtype) for p in self.records}\n"
        "            self.plan = RoutePlan(shapes, codecs=self.codecs, config=self.config, selection=self.plan.selection)\n"
        "            self._follow_plan()",
        "tests/test_route.py::test_routes_are_planned_once_per_manager_through_warm_up_and_a_checkpoint",
    ),
    (
        "clip norm: the encodes compute each gradient's norm",
        "gradient_cache/engine/capture.py",
        "            pending.norms.write(param, flat)",
        "            pass",
        "tests/test_training.py::test_the_encodes_compute_the_clip_norms_once_a_clipped_step_asked",
    ),
    (
        "clip norm: encode-time norms used only for the norm type they are of",
        "gradient_cache/engine/step.py",
        "    return norms if norms is not None and norms.norm_type == norm_type else None",
        "    return norms",
        "tests/test_training.py::test_the_encodes_compute_the_clip_norms_once_a_clipped_step_asked",
    ),
    (
        "clip norm: encode-time norms are of the gradient before encoding",
        "gradient_cache/engine/capture.py",
        "        payload, new_residual = codec.encode(flat, residual, loss_scale=scale)\n",
        "        payload, new_residual = codec.encode(flat, residual, loss_scale=scale)\n        if pending is not None and pending.norms is not None:\n            pending.norms.write(param, payload.kept_values())\n",
        "tests/test_training.py::test_fused_step_clipping_matches_clip_grad_norm",
    ),
    (
        "int8: CUDA tensors take the fused operations",
        "gradient_cache/codecs/int8_kernels.py",
        "    if isinstance(noise, Dither) and x.device.type in FUSED_DEVICE_TYPES and x.is_contiguous():",
        "    if False:",
        "tests/test_stream_order.py::test_the_cuda_codec_paths_dispatch_a_bounded_number_of_operations",
    ),
    (
        "int8: the fused encode counts its dither draws",
        "gradient_cache/codecs/int8_kernels.py",
        "    return -(-numel // CODEC_CHUNK)",
        "    return 0",
        "tests/test_stream_order.py::test_the_default_codec_runs_its_cuda_int8_path_under_the_checker",
    ),
    (
        "optimizer state: a half-made state dropped when its step raised",
        "gradient_cache/engine/optimizer_state.py",
        "                    self.state.pop(param, None)",
        "                    pass",
        "tests/test_optimizer_state.py::test_an_allocation_failing_while_the_state_is_created_is_retried_as_plain",
    ),
    (
        "optimizer state: the host copies put back when a step raised",
        "gradient_cache/engine/optimizer_state.py",
        "            for param, key, host in arrival.keys:\n                self.state[param][key] = host\n",
        "",
        "tests/test_optimizer_state.py::test_a_raising_optimizer_step_retried_gives_plains_result",
    ),
    (
        "optimizer state: the step runs on device copies",
        "gradient_cache/engine/optimizer_state.py",
        "            self.state[param][key] = rebuilt(host, device)\n",
        "            rebuilt(host, device)\n",
        "tests/test_optimizer_state.py::test_only_the_bucket_being_stepped_has_its_state_off_the_host",
    ),
    (
        "optimizer state: a load puts the state on the host",
        "gradient_cache/engine/optimizer_state.py",
        "            optimizer.register_load_state_dict_pre_hook(hooks.take_tensors),\n            optimizer.register_load_state_dict_post_hook(hooks.place_on_host),\n",
        "",
        "tests/test_optimizer_state.py::test_the_state_dict_round_trip_resumes_bit_for_bit",
    ),
    (
        "fused kernels: a kernel that has run raises its errors",
        "gradient_cache/codecs/int8_kernels.py",
        "    _BUILT.add(kernel)\n",
        "",
        "tests/test_triton_kernels.py::test_a_kernel_triton_cannot_build_falls_back_to_the_eager_path_with_a_warning",
    ),
    (
        "fused kernels: subnormals kept (no flush-to-zero libdevice)",
        "gradient_cache/codecs/int8_triton.py",
        '"enable_reflect_ftz": False',
        '"enable_reflect_ftz": True',
        "tests/test_triton_kernels.py::test_the_triton_kernels_compile_for_hopper_with_the_eager_paths_rounding",
    ),
    (
        "block codes: CUDA tensors take the fused operations",
        "gradient_cache/codecs/block_kernels.py",
        "    if fused and bits in FUSED_BITS:",
        "    if False:",
        "tests/test_stream_order.py::test_the_cuda_codec_paths_dispatch_a_bounded_number_of_operations",
    ),
    (
        "sign: the block mean summed in the fused kernel's order",
        "gradient_cache/codecs/block_kernels.py",
        "            scales = mean_magnitude(part)",
        "            scales = part.abs().mean(dim=1)",
        "tests/test_triton_kernels.py::test_the_triton_kernels_give_the_eager_paths_bytes",
    ),
    (
        "payloads: a bf16 gradient's payload rounds to bf16 before an fp32 output",
        "gradient_cache/codecs/payloads.py",
        "    return dtype == out.dtype == torch.float32 and out.is_contiguous()",
        "    return out.dtype == torch.float32 and out.is_contiguous()",
        "tests/test_codecs.py::test_a_bf16_gradients_payload_decodes_to_its_bf16_values_whatever_the_output",
    ),
    (
        # Issue 42: a step's bring and send_back use the copies bound once per step
        # (HostOptimizerState.begin_step -> StateJourney.owned): another optimizer's here.
        "optimizer state: host copies are each optimizer's own",
        "gradient_cache/engine/optimizer_state.py",
        "        return StateJourney(self, optimizer.state, self.state_copies(optimizer), self.weights)",
        "        return StateJourney(self, optimizer.state, next(iter(self.host.values()), self.state_copies(optimizer)), self.weights)",
        "tests/test_state_ownership.py::test_two_optimizers_over_a_shared_trunk_keep_their_own_state",
    ),
    (
        "optimizer state: a closed cache hands the state back on the device",
        "gradient_cache/engine/optimizer_state.py",
        "            self._bring_home(optimizer, owned.copies)\n",
        "            pass\n",
        "tests/test_state_ownership.py::test_remove_hooks_hands_the_state_back_to_the_optimizer",
    ),
    (
        "optimizer state: a closed cache removes its load hooks",
        "gradient_cache/engine/optimizer_state.py",
        "            for handle in handles:\n                handle.remove()\n",
        "            for handle in handles:\n                pass\n",
        "tests/test_state_ownership.py::test_remove_hooks_hands_the_state_back_to_the_optimizer",
    ),
    (
        "optimizer state: a fused step begins by sending device state to the host",
        "gradient_cache/engine/optimizer_state.py",
        "        self.attach(optimizer)\n        self.send_to_host(optimizer)\n",
        "        self.attach(optimizer)\n",
        "tests/test_state_ownership.py::test_a_state_loaded_before_offload_state_of_goes_to_the_host_when_the_step_begins",
    ),
    (
        "optimizer state: Lightning's resumed state goes to the host at train start",
        "gradient_cache/integrations/lightning.py",
        "            step.offload_loaded_state(trainer.optimizers)",
        "            pass",
        "tests/test_lightning.py::test_a_run_resumed_from_a_checkpoint_continues_as_the_uninterrupted_one",
    ),
    (
        "optimizer state: the Trainer's resumed state goes to the host at train begin",
        "gradient_cache/integrations/transformers.py",
        "                step.offload_loaded_state([_unwrapped(optimizer)])",
        "                pass",
        "tests/test_transformers.py::test_a_run_resumed_from_a_trainer_checkpoint_ends_as_the_uninterrupted_one",
    ),
    (
        "fused step: a shared gradient another optimizer's step took is refused",
        "gradient_cache/engine/step.py",
        "        _check_not_taken(self.pipeline, optimizer, stepped)\n",
        "",
        "tests/test_state_ownership.py::test_a_shared_gradient_another_optimizers_step_took_is_refused_with_the_fix",
    ),
    (
        "optimizer state: the load hooks hold the cache weakly",
        "gradient_cache/engine/optimizer_state.py",
        "        hooks = _OptimizerHooks(weakref.ref(self))\n",
        "        hooks = _OptimizerHooks(lambda: self)  # type: ignore[arg-type]\n",
        "tests/test_state_ownership.py::test_the_load_hooks_hold_the_cache_weakly",
    ),
    (
        "optimizer state: a state with no room on the device at close stays on the host",
        "gradient_cache/engine/optimizer_state.py",
        "            except torch.OutOfMemoryError:\n                size = ",
        "            except ZeroDivisionError:\n                size = ",
        "tests/test_state_ownership.py::test_a_state_the_device_has_no_room_for_at_close_stays_on_the_host",
    ),
    (
        "budget: measured from training start under the integrations",
        "gradient_cache/engine/step.py",
        "            self.budget.measure_from_now()",
        "            pass",
        "tests/test_state_ownership.py::test_a_budget_measures_from_training_start_not_from_the_loaded_state",
    ),
    (
        "optimizer state: offload_state_of waits before the host reads",
        "gradient_cache/engine/step.py",
        "        states.wait_on_host()  # the host may read them next (a checkpoint)\n",
        "",
        "tests/test_stream_order.py::test_a_state_loaded_onto_the_device_goes_to_the_host_in_order",
    ),
    # --- issue 41 items 10, 11: the state's layout, its state_dict, the host waits ---
    (
        "optimizer state: state_dict() waits for the copies back",
        "gradient_cache/engine/optimizer_state.py",
        '        self.wait_on_host()\n        state_dict["state"] = {',
        '        state_dict["state"] = {',
        "tests/test_stream_order.py::test_the_steps_end_leaves_the_host_free_and_state_dict_waits_and_is_compact",
    ),
    (
        "optimizer state: a load waits before it overwrites host copies",
        "gradient_cache/engine/optimizer_state.py",
        "        self.wait_on_host()  # before the host overwrites",
        "        pass  # before the host overwrites",
        "tests/test_stream_order.py::test_the_steps_end_leaves_the_host_free_and_state_dict_waits_and_is_compact",
    ),
    (
        "optimizer state: state_dict() hands out compact copies of the host views",
        "gradient_cache/engine/optimizer_state.py",
        "        return rebuilt(value, iter([leaf.clone() for leaf in leaves(value)]))",
        "        return value",
        "tests/test_optimizer_state.py::test_a_saved_state_dict_holds_the_states_bytes_not_its_slabs",
    ),
    (
        "state slabs: a request's regions go into the slabs' room before a new slab",
        "gradient_cache/engine/state_slabs.py",
        "            index = next((k for k, (used, end) in enumerate(rooms) if end - used >= need), None)",
        "            index = next((k for k, (used, end) in enumerate(rooms[existing:], existing) if end - used >= need), None)",
        "tests/test_optimizer_state.py::test_gpt2_124m_adamw_state_pins_within_ten_percent_of_its_bytes",
    ),
    (
        "state slabs: the host budget checked before a new slab",
        "gradient_cache/engine/state_slabs.py",
        "        if new:\n            check_host_budget(",
        "        if not new:\n            check_host_budget(",
        "tests/test_optimizer_state.py::test_gpt2_124m_adamw_state_pins_within_ten_percent_of_its_bytes",
    ),
    (
        "pool: a refused pin makes only its own slab pageable",
        "gradient_cache/engine/pool.py",
        "                self._warn_once(error)",
        "                self._warn_once(error)\n                self._allocate_pinned = None",
        "tests/test_pool.py::test_a_failed_pin_makes_only_its_slab_pageable",
    ),
    (
        "cuda: a copy into a pinned slab is non-blocking beside a pageable one",
        "gradient_cache/engine/cuda.py",
        "        return host.copy_(device, non_blocking=self.pool.is_pinned(host))",
        "        return host.copy_(device, non_blocking=self.pool.pinned)",
        "tests/test_stream_order.py::test_a_slab_that_could_not_be_pinned_blocks_only_its_own_copies",
    ),
    (
        "cuda: the host's wait for the state covers the copies to the device (a failed step's)",
        "gradient_cache/engine/cuda.py",
        '        self._unwaited_state["to the device"] = done\n',
        "",
        "tests/test_stream_order.py::test_a_load_after_a_failed_step_waits_for_the_state_brought_ahead",
    ),
    (
        "issue 41 (h5): a nonsense peak from the budget's reader is refused",
        "gradient_cache/engine/budget.py",
        "            self.peak = max(self.peak, checked_peak(self.memory) + self.memory.outside_bytes())",
        "            self.peak = max(self.peak, self.memory.peak_bytes() + self.memory.outside_bytes())",
        "tests/test_memory_budget.py::test_a_reader_giving_a_nonsense_peak_is_named",
    ),
    (
        "issue 41 (h5): a checkpoint's group sizes checked before the state is taken",
        "gradient_cache/engine/optimizer_state.py",
        "        if saved_sizes != sizes:",
        "        if False:",
        "tests/test_optimizer_state.py::test_a_checkpoint_whose_group_sizes_differ_is_refused_as_torch_refuses_it",
    ),
    (
        "issue 41 (h5): SGD momentum on a sparse gradient refused before the step",
        "gradient_cache/engine/step.py",
        "            _refuse_sparse_momentum(pipeline, optimizer)",
        "            pass",
        "tests/test_optimizer_state.py::test_sgd_momentum_on_a_sparse_gradient_is_refused_before_anything_steps",
    ),
    (
        "issue 41 (h5): LBFGS refused with the state offloaded",
        "gradient_cache/engine/step.py",
        "            if pipeline.optimizer_state is not None:\n                raise RuntimeError(_LBFGS_REFUSAL)\n",
        "",
        "tests/test_decorator.py::test_lbfgs_with_the_state_offloaded_is_refused_and_loses_nothing",
    ),
    (
        "issue 41 (h5): a cast parameter refused at the forward",
        "gradient_cache/model_watch.py",
        "    if cached is None or cached.dtype == dtype:",
        "    if True:",
        "tests/test_bad_inputs.py::test_bad_input_is_refused_with_its_message",
    ),
    (
        "issue 41 (h5): fp16 autocast without grad_scaler= warned at the step",
        "gradient_cache/manager.py",
        "        self._warn_of_a_missing_grad_scaler()\n",
        "",
        "tests/test_scaler_skip.py::test_an_fp16_loop_that_forgets_grad_scaler_is_told_so",
    ),
    (
        "issue 41 (h5): buckets sized from the model",
        "gradient_cache/engine/pipeline.py",
        "        self.assembler = BucketAssembler(config.bucket_bytes(dense_bytes))",
        "        self.assembler = BucketAssembler(config.bucket_size_bytes)",
        "tests/test_optimizer_state.py::test_the_default_buckets_save_device_memory_at_the_step_of_a_small_model",
    ),
    (
        "issue 41 (h5): Trainer fp16 refused with the state offloaded",
        "gradient_cache/integrations/transformers.py",
        "    if offload_optimizer_state and args.fp16:",
        "    if False:",
        "tests/test_transformers.py::test_fp16_with_the_state_offloaded_is_refused_before_any_step",
    ),
    (
        "unkept manager: its finalizer detaches it (hooks removed, gradients back in .grad)",
        "gradient_cache/manager.py",
        "        stand_in.remove_hooks()",
        "        pass",
        "tests/test_unkept_manager.py",
    ),
    (
        "readers: the swap ends when the last manager is detached",
        "gradient_cache/manager.py",
        "        self._watch.remove()\n        _detached()\n",
        "        self._watch.remove()\n",
        "tests/test_custom_loop_readers.py::test_the_readers_are_swapped_while_a_manager_is_attached_and_only_then",
    ),
    (
        "readers: only the managers caching the parameters read restore or answer",
        "gradient_cache/manager.py",
        "            if step is not None and (parameters is None or step.caches(parameters))",
        "            if step is not None",
        "tests/test_custom_loop_readers.py::test_readers_over_another_models_parameters_leave_the_cache_alone",
    ),
    (
        "readers: a disabled GradScaler's unscale_ restores nothing",
        "gradient_cache/gradient_readers.py",
        "        if scaler.is_enabled():  # a disabled scaler's unscale_ reads nothing (bf16 loops)",
        "        if True:",
        "tests/test_custom_loop_readers.py::test_nanogpts_bf16_loop_with_its_step_replaced_equals_plain",
    ),
    (
        "readers: with the state on the host a reader of every gradient is refused",
        "gradient_cache/engine/step.py",
        "            if pipeline.optimizer_state is not None and pipeline.store:",
        "            if False:",
        "tests/test_custom_loop_readers.py tests/test_fused_routing.py::test_readers_of_every_gradient_are_refused_with_the_state_on_the_host",
    ),
    (
        "memory_budget: a checkpoint carries only the pending step's kept gradients",
        "gradient_cache/engine/checkpoint.py",
        "            if record.gradient is GradientAt.KEPT_ON_DEVICE and p.grad is not None",
        "            if record.keep_on_device and p.grad is not None",
        "tests/test_memory_budget.py::test_a_checkpoint_after_a_restore_carries_no_kept_gradient",
    ),
    (
        "memory_budget: a checkpoint's kept gradients are cached on load",
        "gradient_cache/engine/checkpoint.py",
        "    for name, grad in kept.items():\n        pipeline.capture.add(by_name[name], to_device(grad))\n",
        "",
        "tests/test_memory_budget.py::test_a_checkpoint_mid_accumulation_carries_the_gradients_the_budget_kept",
    ),
    (
        "fused step: device gradients scaled in place are marked (a retry does not scale twice)",
        "gradient_cache/engine/fused_step.py",
        "            progress.scaled.add(param)\n",
        "",
        "tests/test_memory_budget.py::test_a_failed_step_of_the_kept_gradients_retried_gives_plain_bits",
    ),
    (
        "fused step: device gradients already stepped are not stepped again by the retry",
        "gradient_cache/engine/fused_step.py",
        "        progress.stepped.update(chunk)\n",
        "",
        "tests/test_memory_budget.py::test_a_failed_step_of_the_kept_gradients_retried_gives_plain_bits",
    ),
    (
        "fused step: device gradients step a bucket at a time with their own state",
        "gradient_cache/engine/fused_step.py",
        "[p for p in held if p not in progress.stepped], pipeline.assembler.capacity_bytes",
        "[p for p in held if p not in progress.stepped], 2**62",
        "tests/test_memory_budget.py::test_device_gradients_step_with_their_offloaded_state_a_bucket_at_a_time",
    ),
    (
        "memory_budget: a kept gradient counts its offloaded state",
        "gradient_cache/engine/budget.py",
        "            cost += state_bytes.get(candidate.name, 0)\n",
        "            pass\n",
        "tests/test_memory_budget.py::test_a_kept_gradient_counts_the_offloaded_state_its_step_brings",
    ),
    (
        "budget: the cache's own running maximum of its samples",
        "gradient_cache/engine/budget.py",
        "            self.peak = max(self.peak, checked_peak(self.memory) + self.memory.outside_bytes())",
        "            self.peak = checked_peak(self.memory) + self.memory.outside_bytes()",
        "tests/test_memory_budget.py::test_an_outside_reset_between_samples_does_not_lower_the_measure",
    ),
    (
        "budget: the bytes outside the allocator are counted",
        "gradient_cache/engine/budget.py",
        "            self.peak = max(self.peak, checked_peak(self.memory) + self.memory.outside_bytes())",
        "            self.peak = max(self.peak, checked_peak(self.memory))",
        "tests/test_memory_budget.py::test_the_measure_counts_the_allocators_reserve_and_what_lies_outside_it",
    ),
    (
        "budget: a per-process fraction lowers the usable memory",
        "gradient_cache/engine/budget.py",
        "        usable = int(self.memory.total_bytes() * self.memory.process_fraction())",
        "        usable = self.memory.total_bytes()",
        "tests/test_memory_budget.py::test_a_per_process_fraction_lowers_the_budget",
    ),
    (
        "budget: the decision waits for the first step after the warm-up",
        "gradient_cache/engine/budget.py",
        "        self.measured_steps = warmup_steps + 1",
        "        self.measured_steps = 1",
        "tests/test_memory_budget.py::test_the_decision_waits_for_the_first_step_after_the_warm_up",
    ),
    (
        "budget: sampled at each step's end",
        "gradient_cache/engine/step.py",
        "        if self.budget is not None:\n            self.budget.sample()\n",
        "",
        "tests/test_memory_budget.py::test_the_measurement_holds_the_first_optimizer_step_on_every_path",
    ),
    (
        "step hooks: fire once around hook_manager.step, not per bucket",
        "gradient_cache/engine/step.py",
        "            step_once=step_hooks.unhooked_step,",
        "            step_once=optimizer.step if hooks else step_hooks.unhooked_step,",
        "tests/test_optimizer_state.py::test_step_hooks_fire_once_around_the_fused_step_and_read_the_complete_state",
    ),
    (
        "step hooks: the bucket steps go through the optimizer's own step (an LR scheduler's wrapper)",
        "gradient_cache/engine/step_hooks.py",
        "        self._step = optimizer.step if through_instance else functools.partial(unwrapped, optimizer)",
        "        self._step = functools.partial(unwrapped, optimizer)",
        "tests/test_optimizer_state.py::test_a_learning_rate_scheduler_sees_the_fused_step",
    ),
    (
        "step hooks: none on a step a GradScaler skips",
        "gradient_cache/engine/step.py",
        "        if skip:\n            assert scaler is not None\n",
        "        if skip:\n            assert scaler is not None\n            if before_steps is not None:\n                before_steps()\n",
        "tests/test_scaler_skip.py::test_a_skipped_fused_step_fires_no_step_hook",
    ),
    (
        "buckets sized from the model only with the state offloaded",
        "gradient_cache/engine/config.py",
        "        if gradient_bytes is None or not self.offload_optimizer_state:",
        "        if gradient_bytes is None:",
        "tests/test_demo.py::test_cpu_memory_figures_follow_from_the_accounting",
    ),
    (
        "step hooks: the host waits for the state only where a post-hook may read it",
        "gradient_cache/engine/step_hooks.py",
        '        if wait_for_state is not None and any(\n            not getattr(hook, "reads_no_state", False) for hook in post_hooks\n        ):',
        "        if wait_for_state is not None:",
        "tests/test_stream_order.py::test_the_steps_end_leaves_the_host_free_and_state_dict_waits_and_is_compact",
    ),
    # Issue 42: where a gradient and a state are is a field each phase sets.
    (
        "location: a drain marks what it waited for as stored",
        "gradient_cache/engine/pipeline.py",
        "        for param in self.store:\n            self.records[param].gradient = STORED\n",
        "",
        "tests/test_call_orders.py",
    ),
    (
        "location: a launch marks its gradients in flight",
        "gradient_cache/engine/capture.py",
        "                pipeline.records[each.param].gradient = GradientAt.IN_FLIGHT\n",
        "                pass\n",
        "tests/test_call_orders.py",
    ),
    (
        "location: an installed state is on the device",
        "gradient_cache/engine/optimizer_state.py",
        "            self.owned.at[param] = StateAt.DEVICE\n",
        "",
        "tests/test_optimizer_state.py::test_where_each_parameters_state_is_is_a_field_each_phase_sets",
    ),
    (
        "location: a state sent home is on the host",
        "gradient_cache/engine/optimizer_state.py",
        "            state[param][key] = owned.copies[param][key]\n            owned.at[param] = StateAt.HOST\n",
        "            state[param][key] = owned.copies[param][key]\n",
        "tests/test_optimizer_state.py",
    ),
    (
        "the capture holds its pipeline weakly (no cycle keeps the model alive)",
        "gradient_cache/engine/capture.py",
        '        self.pipeline = cast("Pipeline", weakref.proxy(pipeline))',
        "        self.pipeline = pipeline",
        "tests/test_api.py::test_a_closed_manager_lets_the_model_go_without_a_gc_pass",
    ),
    (
        "routing: a second fused step inside the call (a subclass's super().step()) keeps what the first hid",
        "gradient_cache/engine/step.py",
        "            self._hidden.setdefault(optimizer, {}).update(left)",
        "            self._hidden[optimizer] = left",
        "tests/test_fused_routing.py::test_the_decorated_step_is_the_fused_step_with_plain_bits",
    ),
    (
        "optimizer state: a bucket's state goes back only once its payloads are spent (a failed send does not step it twice)",
        "gradient_cache/engine/pipeline.py",
        "                self._spend(params)  # before `spent`: a failure there must not step it again\n                if spent is not None:\n                    spent()\n",
        "                if spent is not None:\n                    spent()\n                self._spend(params)\n",
        "tests/test_optimizer_state.py::test_a_failed_send_back_of_new_state_is_not_stepped_twice_by_the_retry",
    ),
    (
        "optimizer state: a state is in transit only once its copy started (a failed bring leaves it home)",
        "gradient_cache/engine/optimizer_state.py",
        "        try:\n            transfer = self.states.backend.start_to_device(hosts)\n",
        "        for param, _, _ in keys:\n            self.owned.at[param] = StateAt.IN_TRANSIT\n        try:\n            transfer = self.states.backend.start_to_device(hosts)\n",
        "tests/test_optimizer_state.py::test_a_failed_bring_leaves_the_state_home_and_the_retry_brings_it",
    ),
    (
        "restore: the plain restore has no bucket ahead (the apply path's device peak)",
        "gradient_cache/engine/pipeline.py",
        "        with contextlib.closing(self.restoring(buckets, clip_factor=self.deferred_clip)) as each:",
        "        with contextlib.closing(self.restoring(buckets, clip_factor=self.deferred_clip, depth=self.backend.restore_ahead)) as each:",
        "tests/test_stream_order.py::test_only_the_fused_step_restores_ahead",
    ),
    (
        "weights: an arriving weight's memory goes only after its copy (the compute stream waits)",
        "gradient_cache/engine/host_weights.py",
        "                self._arrived(weight)  # before its memory can be handed on\n",
        "                pass\n",
        "tests/test_parameters_offload.py::test_a_forward_that_raises_gives_back_the_block_arriving_after_its_copy",
    ),
    (
        "weights: after the step, the device memory goes only after the copy back read it",
        "gradient_cache/engine/host_weights.py",
        "        self.backend.release(transfer)\n        self.free(present)\n",
        "        self.free(present)\n",
        "tests/test_parameters_offload.py::test_every_weight_copy_is_ordered_on_the_stand_in_streams",
    ),
    (
        "weights: model.state_dict() waits for the copies back into the masters",
        "gradient_cache/engine/weight_stream.py",
        "        self.weights.free(self.weights.present())\n        self.weights.wait_on_host()\n\n    def _compact_state_dict",
        "        self.weights.free(self.weights.present())\n\n    def _compact_state_dict",
        "tests/test_parameters_offload.py::test_every_weight_copy_is_ordered_on_the_stand_in_streams",
    ),
    (
        "weights: a checkpointed block's recomputation in backward frees nothing",
        "gradient_cache/engine/weight_stream.py",
        "        if _in_backward():\n            return  # a recomputation: its backward reads these weights next\n",
        "",
        "tests/test_parameters_offload.py::test_views_of_a_weight_saved_for_backward_read_its_refilled_storage",
    ),
    (
        "weights: a weight goes once its gradient is accumulated (the backward window)",
        "gradient_cache/engine/weight_stream.py",
        "            self.weights.free([param])\n",
        "            pass\n",
        "tests/test_parameters_offload.py::test_the_device_holds_the_rest_and_two_blocks_and_each_step_moves_what_it_says",
    ),
    (
        "weights: a bucket's weights are on the device for its step",
        "gradient_cache/engine/optimizer_state.py",
        "        if self.weights is not None:\n            self.weights.ensure(arrival.params, step=True)\n",
        "",
        "tests/test_parameters_offload.py::test_training_with_the_weights_on_the_host_is_plain_pytorch_bit_for_bit",
    ),
    (
        "weights: the refill's copy waits for the compute stream's earlier use of the block",
        "gradient_cache/engine/cuda.py",
        "        self.restore_stream.wait_stream(compute)\n        with self.cuda.stream(self.restore_stream):\n            for out, host in pairs:\n",
        "        with self.cuda.stream(self.restore_stream):\n            for out, host in pairs:\n",
        "tests/test_parameters_offload.py::test_every_weight_copy_is_ordered_on_the_stand_in_streams",
    ),
    (
        "weights, compute dtype: a gradient is accumulated in the master's dtype",
        "gradient_cache/engine/capture.py",
        "        self.add(param, sharding.local(grad).to(record.route.dtype))\n",
        "        self.add(param, sharding.local(grad))\n",
        "tests/test_parameters_offload.py::test_a_compute_dtype_is_fsdp2_mixed_precision_on_one_process_bit_for_bit",
    ),
    (
        "weights, compute dtype: floating inputs cast to it",
        "gradient_cache/engine/weight_stream.py",
        "        dtype = self.weights.compute_dtype\n        if dtype is None:\n",
        "        dtype = self.weights.compute_dtype\n        if True:\n",
        "tests/test_parameters_offload.py::test_a_compute_dtype_casts_the_models_floating_inputs",
    ),
    (
        "weights: the parameter watch takes a streamed weight where the cache put it (not its device or dtype at creation)",
        "gradient_cache/manager.py",
        "            in_place=None if self._weight_stream is None else self._weight_stream.weights.in_place,\n",
        "            in_place=None,\n",
        "tests/test_parameters_offload.py::test_a_compute_dtype_is_fsdp2_mixed_precision_on_one_process_bit_for_bit",
    ),
    (
        "demo accounting: a resized weight counts at its storage's size now",
        "gradient_cache/demo/accounting.py",
        "        self._follow_resized_weights()\n",
        "",
        "tests/test_accounting.py::test_weights_on_the_host_count_only_while_they_are_on_the_device",
    ),
    (
        "demo accounting: the weights' masters are host memory",
        "gradient_cache/engine/figures.py",
        "            *(() if weights is None else weights.masters()),\n",
        "",
        "tests/test_accounting.py::test_weights_on_the_host_count_only_while_they_are_on_the_device",
    ),
    (
        "demo accounting: the tracker holds a device cap",
        "gradient_cache/demo/accounting.py",
        "            self._hold_cap(self._sample(host_ids))\n",
        "            self._sample(host_ids)\n",
        "tests/test_accounting.py::test_a_cap_raises_out_of_memory_at_the_operator_that_passes_it",
    ),
    (
        "weights: a block used twice in a forward keeps its weights past the first accumulation",
        "gradient_cache/engine/weight_stream.py",
        "        if self._forwards <= 1 and not self._reused:\n            self.weights.free([param])\n",
        "        if self._forwards <= 1:\n            self.weights.free([param])\n",
        "tests/test_parameters_offload.py::test_a_block_reused_at_every_depth_keeps_its_weights_until_backward_ends",
    ),
    (
        "weights: two forwards before one backward keep the weights past the first accumulation",
        "gradient_cache/engine/weight_stream.py",
        "        if self._forwards <= 1 and not self._reused:\n            self.weights.free([param])\n",
        "        if not self._reused:\n            self.weights.free([param])\n",
        "tests/test_parameters_offload.py::test_two_forwards_before_one_backward_keep_the_weights_until_its_end",
    ),
    (
        "weights: a failed step's buckets give their device weights up unchanged (the masters as before)",
        "gradient_cache/engine/optimizer_state.py",
        "            if self.weights is not None:  # their masters are as before the step\n                self.weights.forget(arrival.params)\n",
        "",
        "tests/test_parameters_offload.py::test_every_weight_copy_is_ordered_on_the_stand_in_streams",
    ),
    (
        "weights, compute dtype: the master is cast into the compute tensor on the device",
        "gradient_cache/engine/backend.py",
        "        for device, copied in casts:\n            device.copy_(copied)\n",
        "",
        "tests/test_parameters_offload.py::test_a_compute_dtype_is_fsdp2_mixed_precision_on_one_process_bit_for_bit",
    ),
    (
        "weights: a dirty weight (stepped, not copied back) is copied back before it is freed",
        "gradient_cache/engine/host_weights.py",
        "        if dirty:\n            self.store(dirty)\n",
        "",
        "tests/test_parameters_offload.py::test_a_stepped_weight_whose_copy_back_failed_reaches_its_master_when_freed",
    ),
    (
        "weights: the step ends once the copies back into the masters are complete",
        "gradient_cache/engine/host_weights.py",
        "        self.wait_on_host()\n        if steps != self._counted_step:\n",
        "        if steps != self._counted_step:\n",
        "tests/test_parameters_offload.py::test_the_steps_end_leaves_the_masters_complete_for_the_host",
    ),
    (
        "weights: a bucket's weights come before its state moves (a failed bring leaves the state home)",
        "gradient_cache/engine/optimizer_state.py",
        "        if self.weights is not None:  # first: if it raises, the state has not moved\n            self.weights.bring(params, step=True)\n        keys: list[tuple[Param, str, torch.Tensor]] = []\n        for param in params:\n            if self.owned.at.get(param) is not StateAt.HOST:\n                continue  # none yet (the step creates it), or kept on the device\n            copies = self.owned.copies[param]\n            values = self.state.get(param, {})\n            keys += [(param, key, copies[key]) for key in values if key in copies]\n        hosts = [leaf for _, _, host in keys for leaf in leaves(host)]\n        try:\n            transfer = self.states.backend.start_to_device(hosts)\n        except BaseException:\n            if self.weights is not None:  # the bucket's weights go home too (dirty: copied)\n                self.weights.free(params)\n            raise\n        self.states.moved_bytes += nbytes(hosts)\n        for param, _, _ in keys:  # only once started: a failed start leaves them home\n            self.owned.at[param] = StateAt.IN_TRANSIT\n        had_state = [bool(self.state.get(param)) for param in params]\n",
        "        keys: list[tuple[Param, str, torch.Tensor]] = []\n        for param in params:\n            if self.owned.at.get(param) is not StateAt.HOST:\n                continue  # none yet (the step creates it), or kept on the device\n            copies = self.owned.copies[param]\n            values = self.state.get(param, {})\n            keys += [(param, key, copies[key]) for key in values if key in copies]\n        hosts = [leaf for _, _, host in keys for leaf in leaves(host)]\n        try:\n            transfer = self.states.backend.start_to_device(hosts)\n        except BaseException:\n            if self.weights is not None:  # the bucket's weights go home too (dirty: copied)\n                self.weights.free(params)\n            raise\n        self.states.moved_bytes += nbytes(hosts)\n        for param, _, _ in keys:  # only once started: a failed start leaves them home\n            self.owned.at[param] = StateAt.IN_TRANSIT\n        had_state = [bool(self.state.get(param)) for param in params]\n        if self.weights is not None:\n            self.weights.bring(params, step=True)\n",
        "tests/test_parameters_offload.py::test_a_failed_bring_in_the_step_leaves_weights_and_state_home",
    ),
    (
        "weights: a failed bring gives its device memory back",
        "gradient_cache/engine/host_weights.py",
        "            for _, device in chosen:  # nothing started: they stay home\n                self.backend.resize_storage(device, 0)\n",
        "            pass\n",
        "tests/test_parameters_offload.py::test_a_failed_bring_in_the_step_leaves_weights_and_state_home",
    ),
    (
        "weights: a parameter the weights do not hold is left alone",
        "gradient_cache/engine/host_weights.py",
        "        return [(p, self._weights[p]) for p in params if p in self._weights]\n",
        "        return [(p, self._weights[p]) for p in params]\n",
        "tests/test_parameters_offload.py::test_a_parameter_of_no_module_steps_with_the_others",
    ),
    (
        "weights: a backward brings the rest again (a retained graph's second)",
        "gradient_cache/engine/weight_stream.py",
        "        self._queue_end_of_backward()\n        self.weights.ensure(self.units.rest)\n",
        "        self._queue_end_of_backward()\n",
        "tests/test_parameters_offload.py::test_an_eval_between_forward_and_backward_and_a_retained_graph_keep_what_backward_reads",
    ),
    (
        "weights: a failed forward is not counted as pending",
        "gradient_cache/engine/weight_stream.py",
        "                self._forwards -= 1  # counted at its begin, and no graph to come back to\n",
        "                pass\n",
        "tests/test_parameters_offload.py::test_a_failed_forward_or_an_eval_leaves_the_window_as_it_was",
    ),
    (
        "weights: frozen weights go when their block's backward is done",
        "gradient_cache/engine/weight_stream.py",
        "        self._free_frozen(index)\n",
        "        pass\n",
        "tests/test_parameters_offload.py::test_frozen_block_weights_go_when_their_blocks_backward_is_done",
    ),
    (
        "weights: several optimizers' steps count together in the step's moved bytes",
        "gradient_cache/engine/host_weights.py",
        "        if steps != self._counted_step:\n            self.moved_last_step, self._counted_step = 0, steps\n",
        "        if True:\n            self.moved_last_step, self._counted_step = 0, steps\n",
        "tests/test_parameters_offload.py::test_two_optimizers_report_the_steps_weight_bytes_together",
    ),
    (
        "weights: disable() is refused (a gradient would outlive its weights)",
        "gradient_cache/manager.py",
        '        if self._weight_stream is not None:\n            raise RuntimeError(\n                "disable() cannot run',
        '        if False:\n            raise RuntimeError(\n                "disable() cannot run',
        "tests/test_parameters_offload.py::test_disable_is_refused_with_the_weights_on_the_host",
    ),
    (
        "weights: the rest's own modules bring their weights (a submodule called alone)",
        "gradient_cache/engine/weight_stream.py",
        "            if own and module is not model:\n",
        "            if False:\n",
        "tests/test_parameters_offload.py::test_a_submodule_called_alone_brings_the_rest_it_uses",
    ),
    (
        "weights: a block output's gradient frees its consumers' frozen weights before the block that made it arrives",
        "gradient_cache/engine/weight_stream.py",
        "        for consumer in consumers:  # their backward is done: this output's gradient is whole\n            self._free_frozen(consumer)\n",
        "",
        "tests/test_parameters_offload.py::test_frozen_block_weights_go_when_their_blocks_backward_is_done",
    ),
    (
        "weights: a retry's end copies back the weights whose copy back raised",
        "gradient_cache/engine/host_weights.py",
        "        if dirty:  # a bucket whose copy back raised, stepped by a retry's end: home now\n            self.store(dirty)\n",
        "",
        "tests/test_parameters_offload.py::test_a_failed_copy_back_loses_no_update",
    ),
    (
        "weights: the close copies dirty weights back before the masters go to the device",
        "gradient_cache/engine/host_weights.py",
        "        self.free(params)  # a dirty weight's copy back first: the masters are the newest\n",
        "",
        "tests/test_parameters_offload.py::test_a_stepped_weight_whose_copy_back_failed_reaches_its_master_when_freed",
    ),
    (
        "weights: a load sends every device copy home first (none outlives the write)",
        "gradient_cache/engine/weight_stream.py",
        "        self.weights.free(self.weights.present())\n        self.weights.wait_on_host()\n\n    def _compact_state_dict",
        "        self.weights.wait_on_host()\n\n    def _compact_state_dict",
        "tests/test_parameters_offload.py::test_a_load_while_weights_are_on_the_device_reaches_the_next_use",
    ),
    (
        "weights: a rest module's eval outside the model's forward frees its weights",
        "gradient_cache/engine/weight_stream.py",
        "        if not self._in_model and not _in_backward() and not torch.is_grad_enabled():\n            self.weights.free(params)\n",
        "",
        "tests/test_parameters_offload.py::test_through_a_submodule_an_eval_then_a_load_reaches_training_and_the_window_holds",
    ),
    (
        "weights: the blocks a forward ran are forgotten at the end of backward (a submodule's loop)",
        "gradient_cache/engine/weight_stream.py",
        "        self._called = set()  # a framework calling a submodule never begins the model\n",
        "",
        "tests/test_parameters_offload.py::test_through_a_submodule_an_eval_then_a_load_reaches_training_and_the_window_holds",
    ),
    (
        "weights: a failed copy of the state sends the bucket's weights home",
        "gradient_cache/engine/optimizer_state.py",
        "            if self.weights is not None:  # the bucket's weights go home too (dirty: copied)\n                self.weights.free(params)\n",
        "            pass\n",
        "tests/test_parameters_offload.py::test_a_failed_copy_of_the_state_sends_the_buckets_weights_home",
    ),
]

# Mutants no test can kill on an x86 CPU, because there the mutant computes the same bytes:
# NaN cast to uint8 gives 0, a valid code, so the mask only matters where a cast of NaN
# gives another byte (C leaves it undefined). Run and reported; a kill is reported too.
EQUIVALENT_ON_X86 = {"block_kernels: codes masked to their bits (a NaN's byte)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("python", nargs="?", default=sys.executable)
    parser.add_argument("-k", dest="only", action="append", default=[], metavar="TEXT")
    args = parser.parse_args()
    py = os.path.abspath(args.python)
    mutants = [m for m in MUTANTS if not args.only or any(t in m[0] for t in args.only)]
    survived = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp) / "w"
        shutil.copytree(
            ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "*.pyc", "__pycache__")
        )
        for label, rel, old, new, tests in mutants:
            target = work / rel
            original = target.read_text()
            if old not in original:
                print(f"NOT FOUND: {label}")
                survived += 1
                continue
            target.write_text(original.replace(old, new, 1))
            r = subprocess.run(
                [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()],
                cwd=work,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(work)},
            )
            target.write_text(original)
            lines = r.stdout.strip().splitlines() or ["?"]
            # The first failing test (pytest's short summary), else the result line.
            by = next((x for x in lines if x.startswith(("FAILED ", "ERROR "))), lines[-1])
            equivalent = label in EQUIVALENT_ON_X86 and platform.machine() in ("x86_64", "AMD64")
            survived += r.returncode == 0 and not equivalent
            verdict = "killed" if r.returncode else "equivalent here" if equivalent else "SURVIVED"
            print(f"{verdict}: {label} [{tests}] -> {by[:200]}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
