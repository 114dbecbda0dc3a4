"""perf/weight_streamers.py on a tiny model: the facts its evaluation of FSDP2's
CPUOffloadPolicy on one process rests on (torch 2.13, CPU), each established by running.

One fresh process (the script's own) runs every check once; each test reads one check.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gradient_cache.demo.models import GPTConfig
from perf import weight_streamers as ws

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

TINY = ws.Config(
    GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2),
    batch_size=2,
    steps=2,
)
FSDP2 = "FSDP2 CPUOffloadPolicy"


@pytest.fixture(scope="module")
def fsdp2() -> dict:
    return ws.evaluate_in_fresh_process(FSDP2, TINY)


def check(results: dict, name: str) -> dict:
    facts = results["checks"][name]
    assert "error" not in facts, facts["error"]
    return facts


def test_fsdp2_offload_trains_bit_for_bit_with_plain(fsdp2):
    assert fsdp2["timed"]["bit_for_bit"] is True
    assert all(
        fsdp2["timed"][f"{run}_{part}_ms"] > 0 for run in ("plain", "streamer") for part in ws.PARTS
    )


def test_fsdp2_needs_a_process_group_and_the_glue_leaves_one(fsdp2):
    facts = check(fsdp2, "1 process group")
    assert facts["group_before"] is False
    assert facts["bare"].startswith("ValueError: Error initializing torch.distributed using env://")
    assert facts["group_after_glue"] is True
    assert facts["user_init_after"].startswith("ValueError: trying to initialize the default")


def test_fsdp2_parameters_become_dtensors_and_an_earlier_optimizer_trains_nothing(fsdp2):
    facts = check(fsdp2, "2 parameters, optimizer built before")
    assert facts["types"] == ["DTensor"]
    assert facts["optimizer_holds_model_parameters"] is False
    assert facts["early_optimizer_trains"] is False


def test_fsdp2_state_dict_holds_dtensors_a_plain_model_cannot_load(fsdp2):
    facts = check(fsdp2, "3 state_dict")
    assert facts["types"] == ["DTensor"]
    assert "got mixed torch.Tensor and DTensor" in facts["plain_load"]
    assert facts["plain_load_full_tensors"] == "runs"
    assert facts["loaded_bit_for_bit"] is True


def test_fsdp2_with_activation_checkpointing_is_bit_for_bit(fsdp2):
    assert check(fsdp2, "4 activation checkpointing")["bit_for_bit"] is True


def test_fsdp2_under_compile_runs_eager_outside_the_blocks(fsdp2):
    facts = check(fsdp2, "5 torch.compile (eager)")
    assert facts["bit_for_bit"] is True
    assert facts["plain"]["breaks"] == [] and facts["plain"]["runs"] == ws.CHECK_STEPS
    # FSDP2's hooks are dynamo-disabled: the model's loop over its blocks is skipped (run
    # eager) and only each block's own forward is captured, one graph run per block.
    assert any("skipped, run eager" in reason for reason in facts["graph_breaks"])
    assert facts["graph_runs_per_forward"] == TINY.model.n_layers


def test_fsdp2_steps_where_its_parameters_and_state_are(fsdp2):
    facts = check(fsdp2, "7 optimizer step's device")
    assert facts["parameters"] == ["cpu"] and facts["state"] == ["cpu"]


def test_fsdp2_clip_grad_norm_is_bit_for_bit(fsdp2):
    facts = check(fsdp2, "8 clip_grad_norm_")
    assert facts == {**facts, "norms_equal": True, "clipped": True, "bit_for_bit": True}
    assert facts["returns"] == "DTensor"  # plain's loop must call full_tensor() to read it


def test_fsdp2_accumulation_is_bit_for_bit(fsdp2):
    assert check(fsdp2, "9 accumulation (2 micro-batches)")["bit_for_bit"] is True


def test_fsdp2_resumes_from_its_state_dicts_bit_for_bit(fsdp2):
    assert check(fsdp2, "10 resume from state_dicts")["bit_for_bit"] is True


def test_fsdp2_on_one_process_trains_after_its_group_is_destroyed(fsdp2):
    facts = check(fsdp2, "6 destroy_process_group")
    assert (facts["destroy"], facts["train_step_after"], facts["eval_after"]) == ("runs",) * 3


def test_the_table_has_a_row_per_check(fsdp2):
    table = ws.to_markdown(TINY, {FSDP2: fsdp2})
    for name in ws.CHECKS:
        assert f"| {name} |" in table


def test_glue_lines_count_code_only():
    def glue(model):
        """A docstring

        of three lines."""
        # a comment

        return model

    assert ws.glue_lines(glue) == 2


def test_the_group_check_leaves_no_group_for_a_streamer_that_makes_none():
    """The next streamer (module hooks) needs no group: its later checks must run without
    the one the first check's init_process_group makes."""
    try:
        facts = ws.check_process_group(ws.Streamer(ws.plain), TINY)
        assert (facts["bare"], facts["group_after_glue"]) == ("not applicable", False)
        assert facts["user_init_after"] == "runs"
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


HOOKS = "gradient-cache offload_parameters"


@pytest.fixture(scope="module")
def hooks() -> dict:
    return ws.evaluate_in_fresh_process(HOOKS, TINY)


def test_the_module_hooks_train_bit_for_bit_in_every_check_with_nothing_changed(hooks):
    """gradient-cache's own streamer, in the same checks: plain's bits everywhere, no
    process group, the user's Parameters and optimizer, plain tensors in state_dict."""
    assert hooks["timed"]["bit_for_bit"] is True
    assert check(hooks, "1 process group")["group_after_glue"] is False
    facts = check(hooks, "2 parameters, optimizer built before")
    assert facts["types"] == ["Parameter"] and facts["early_optimizer_trains"] is True
    facts = check(hooks, "3 state_dict")
    assert facts["types"] == ["Tensor"] and facts["plain_load"] == "runs"
    for name in (
        "4 activation checkpointing",
        "9 accumulation (2 micro-batches)",
        "10 resume from state_dicts",
    ):
        assert check(hooks, name)["bit_for_bit"] is True
    facts = check(hooks, "8 clip_grad_norm_")
    assert facts["norms_equal"] is True and facts["bit_for_bit"] is True
