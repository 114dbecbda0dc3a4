# ruff: noqa: E501 - the mutants are exact source snippets
"""Mutation check of the engine's safety mechanisms other than stream waits.

    python tools/mutate_safety.py [PYTHON]     (from the project root)

Each mutant deletes or reorders one mechanism (a rollback, a give-back, a release, a budget
check, an accumulation) in a copy of the checkout and runs the tests that guard it; every
mutant must be killed. The stream waits have their own tool: ../shared/tools/mutate_waits.py.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path.cwd()
PY = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else sys.executable
MUTANTS = [
    (
        "fused step: device gradients put back on failure",
        "gradient_cache/engine/fused_step.py",
        "        for param, grad in held.items():\n            param.grad = grad\n        pipeline.interrupted_clip",
        "        pipeline.interrupted_clip",
        "tests/test_stream_order.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "fused step: clip factor kept for the retry",
        "gradient_cache/engine/fused_step.py",
        "        pipeline.interrupted_clip = (total_norm, scale)\n",
        "",
        "tests/test_training.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "fused step: wait for the prefetched restore before freeing",
        "gradient_cache/engine/fused_step.py",
        "            pipeline.backend.finish_restore(restore)  # before its blocks are freed",
        "            pass",
        "tests/test_stream_order.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "fused step: payloads leave only after their step (take before step)",
        "gradient_cache/engine/fused_step.py",
        "            grads = pipeline.backend.finish_restore(ahead.popleft())\n            _step_with(optimizer, grads)\n            bucket.take(params)  # stepped: the payloads are spent",
        "            grads = pipeline.backend.finish_restore(ahead.popleft())\n            bucket.take(params)\n            _step_with(optimizer, grads)",
        "tests/test_training.py::test_a_failed_fused_step_retried_gives_the_plain_result",
    ),
    (
        "launch: give gradients back on an encode failure",
        "gradient_cache/engine/pipeline.py",
        "            for param, grad in items[len(encoded) :]:\n                param.grad = sharding.as_grad_of(param, grad)\n",
        "",
        "tests/test_engine.py",
    ),
    (
        "launch: commit what was encoded before the failure",
        "gradient_cache/engine/pipeline.py",
        "        finally:\n            self.commit(bucket, encoded, [grad for _, grad in items[: len(encoded)]])",
        "        else:\n            self.commit(bucket, encoded, [grad for _, grad in items[: len(encoded)]])",
        "tests/test_engine.py",
    ),
    (
        "cuda: drop the retired bucket's device tensors (memory bound)",
        "gradient_cache/engine/cuda.py",
        "            retired.device_tensors = []  # safe now",
        "            pass  # safe now",
        "tests/test_stream_order.py::test_device_memory_in_flight_is_bounded_by_the_staging_depth",
    ),
    (
        "budget checked before the pool is allocated",
        "gradient_cache/engine/pipeline.py",
        '    check_host_budget(\n        needed, fraction=config.host_memory_fraction, what="the host pool of payload slots"\n    )\n    pool = HostPool(layout, allocate_pinned=allocate if config.pin_memory else None)',
        '    pool = HostPool(layout, allocate_pinned=allocate if config.pin_memory else None)\n    check_host_budget(\n        needed, fraction=config.host_memory_fraction, what="the host pool of payload slots"\n    )',
        "tests/test_stream_order.py::test_refused_construction_leaves_no_pinned_memory_or_hook",
    ),
    (
        "cgroup: ancestors' limits count",
        "gradient_cache/engine/hostmem.py",
        "        directory = directory.parent",
        "        return found",
        "tests/test_engine.py",
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
        "gradient_cache/engine/pipeline.py",
        "            flat = add_into(flat, moved(held.payloads[param], self.backend.to_device))",
        "            pass",
        "tests/test_training.py tests/test_stream_order.py",
    ),
    (
        "discard: a pending step's residuals are dropped",
        "gradient_cache/engine/pipeline.py",
        "        self.cached = {}\n        self.pending_residuals = {}\n",
        "        self.cached = {}\n",
        "tests/test_api.py::test_a_discarded_batch_leaves_no_trace",
    ),
    (
        "discard: the engine's generators are rewound",
        "gradient_cache/engine/pipeline.py",
        "            self.set_random_state(self.random_state_at_step_start)",
        "            pass",
        "tests/test_api.py::test_a_discarded_batch_leaves_no_trace",
    ),
    (
        "cuda: a pending step's residual goes to the spare slot",
        "gradient_cache/engine/cuda.py",
        "                    target = self.pending_host_residual(item.param)",
        "                    target = slot.residual",
        "tests/test_stream_order.py::test_a_discarded_step_leaves_the_host_residual_as_it_was",
    ),
    (
        "checkpoint: residuals loaded",
        "gradient_cache/engine/checkpoint.py",
        "            pipeline.residuals[param] = saved.to(device)",
        "            pass",
        "tests/test_checkpoint.py",
    ),
    (
        "checkpoint: host residuals loaded into their slots",
        "gradient_cache/engine/checkpoint.py",
        "            pipeline.residuals[param].copy_(saved)",
        "            pass",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "checkpoint: cached payloads stored under the encode stream's ordering",
        "gradient_cache/engine/checkpoint.py",
        "        with pipeline.backend.encoding([]):",
        "        if True:",
        "tests/test_stream_order.py::test_a_resumed_run_continues_bit_for_bit",
    ),
    (
        "checkpoint: generators loaded",
        "gradient_cache/engine/checkpoint.py",
        '    pipeline.set_random_state(state["random_state"] if same_kind else {})',
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
        "gradient_cache/engine/pipeline.py",
        "        if items is None and group_complete:",
        "        if False:",
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
        "gradient_cache/engine/pipeline.py",
        "            check_gradient_is_reduced(self.names[param], grad)",
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
        "decorator: clipping and unscaling restore the cached gradients first",
        "gradient_cache/integrations/decorator.py",
        "        self._readers.__enter__()",
        "        pass",
        "tests/test_decorator.py tests/test_transformers.py::test_trainer_at_ratio_1_ends_bit_for_bit_as_plain_trainer",
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
        "planner: the pool's spare residual slots are counted",
        "gradient_cache/planner.py",
        "            spare_residual=config.keep_previous_residual,",
        "            spare_residual=False,",
        "tests/test_planner.py",
    ),
    (
        "planner: Adam's per-tensor step counters are counted",
        "gradient_cache/planner.py",
        " + inputs.optimizer_tensor_bytes * len(tensors)",
        "",
        "tests/test_demo.py::test_the_planner_matches_the_demos_measured_components",
    ),
    (
        "fsdp: plain parameters beside sharded ones are refused",
        "gradient_cache/engine/sharding.py",
        "    if len(sharded) != len(named_params) and dist.get_world_size() > 1:",
        "    if False:",
        "tests/test_distributed.py::test_refused_on_every_rank_with_the_reason",
    ),
]


def main() -> int:
    survived = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp) / "w"
        shutil.copytree(
            ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "*.pyc", "__pycache__")
        )
        for label, rel, old, new, tests in MUTANTS:
            target = work / rel
            original = target.read_text()
            if old not in original:
                print(f"NOT FOUND: {label}")
                survived += 1
                continue
            target.write_text(original.replace(old, new, 1))
            r = subprocess.run(
                [PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()],
                cwd=work,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(work)},
            )
            target.write_text(original)
            last = (r.stdout.strip().splitlines() or ["?"])[-1]
            survived += r.returncode == 0
            print(f"{'killed' if r.returncode else 'SURVIVED'}: {label} [{tests}] -> {last}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
