"""FSDP2 with the cache, and classic DDP refused: real 2-process gloo runs on the CPU.

One module-scoped fixture starts one pair of processes (tests/distributed_runs.py) that
runs every scenario; each test here checks one scenario's result on both ranks.
Bit-for-bit means weights equal to plain FSDP2's on the same seed and data.
"""

from __future__ import annotations

import socket
from typing import Any

import distributed_runs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pairs(pairs: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("pairs")
    mp.spawn(
        distributed_runs.run_pair,
        args=(pairs, _free_port(), str(out_dir)),
        nprocs=distributed_runs.WORLD,
    )
    return [
        torch.load(out_dir / f"results_{rank}.pt", weights_only=False)
        for rank in range(distributed_runs.WORLD)
    ]


@pytest.fixture(scope="module")
def all_results(tmp_path_factory):
    """Every scenario in one pair of processes: two processes that start, import torch
    and join a process group once, not once for each group of scenarios."""
    return _run_pairs(list(distributed_runs.PAIRS), tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp_results(all_results):
    return all_results


@pytest.fixture(scope="module")
def weights_results(all_results):
    return all_results


@pytest.fixture(scope="module")
def replica_results(all_results):
    return all_results


def each_rank(results: list[dict], scenario: str) -> list:
    values = [ranks[scenario] for ranks in results]
    for rank, value in enumerate(values):
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"{scenario} raised on rank {rank}:\n{value['error']}")
    return values


@pytest.mark.parametrize(
    "scenario",
    [
        "apply_matches_plain",
        "fused_matches_plain",
        "accumulation_matches_plain",
        "no_sync_accumulation_matches_plain",
        "mixed_precision_matches_plain",
        "apply_then_clip_matches_plain",
        "eval_between_steps_matches_plain",
        "decorator_matches_plain",
    ],
)
def test_ratio_1_is_bit_identical_to_plain_fsdp2(fsdp_results, scenario):
    assert each_rank(fsdp_results, scenario) == [0.0, 0.0]


def test_the_optimizer_state_on_the_host_matches_plain_fsdp2(fsdp_results):
    expected = {"difference": 0.0, "on host": True, "compact state_dict": True}
    assert each_rank(fsdp_results, "state_on_host_matches_plain") == [expected, expected]


def test_fused_clipping_matches_clip_grad_norm(fsdp_results):
    for result in each_rank(fsdp_results, "fused_clip_against_clip_grad_norm"):
        assert result["clipped"], "the clip threshold must be below the norm to test anything"
        assert result["norms"] == 0.0
        assert result["weights"] == 0.0


def test_fused_inf_norm_is_the_largest_entry_over_ranks(fsdp_results):
    assert each_rank(fsdp_results, "fused_inf_norm_against_clip_grad_norm") == [0.0, 0.0]


def test_ratio_100_trains_on_each_rank_s_shards(fsdp_results):
    first, second = each_rank(fsdp_results, "ratio_100_trains")
    for result in (first, second):
        assert result["last"] < 0.5 * result["first"]
        assert 0.005 < result["kept_fraction"] < 0.02
    # The head's 5 x 128 weight splits 3 + 2 rows: each rank caches its own shard.
    assert (first["head_numel"], second["head_numel"]) == (3 * 128, 2 * 128)


def test_checkpoint_per_rank_resumes_bit_for_bit(fsdp_results):
    for result in each_rank(fsdp_results, "checkpoint_resumes_bit_for_bit"):
        assert result["residuals"] > 0  # error feedback had state to carry
        assert result["difference"] == 0.0
        assert "saved by rank" in result["world_size_refusal"]
        assert "of 4" in result["world_size_refusal"]


def test_a_clipped_checkpoint_mid_accumulation_resumes_bit_for_bit(fsdp_results):
    """int8, clipping: the resumed step's clip norms are its encodes', as in the run that
    saved it (they were read from the quantized payloads)."""
    assert each_rank(fsdp_results, "clipped_checkpoint_mid_accumulation_resumes") == [0.0, 0.0]


def test_a_refused_forward_leaves_the_model_sharded_and_the_recovery_trains(fsdp_results):
    """The parameters replaced after the cache was created: the forward is refused before
    FSDP2's pre-hook all-gathers, so a new cache (the recovery the refusal names) accepts
    the model, and trains as plain FSDP2 does after the same load."""
    for result in each_rank(fsdp_results, "refused_forward_leaves_the_model_sharded"):
        assert "'embed.weight' replaced by a new Parameter" in result["refusal"]
        assert result["difference"] == 0.0


def test_a_bucket_closes_when_its_fsdp_group_is_complete(fsdp_results):
    groups = [
        ["blocks.1.0.bias", "blocks.1.0.weight"],
        ["blocks.0.0.bias", "blocks.0.0.weight"],
        ["embed.bias", "embed.weight", "head.bias", "head.weight"],
    ]
    assert each_rank(fsdp_results, "buckets_follow_groups") == [groups, groups]


def test_excluding_part_of_a_group_warns_that_it_saves_nothing(fsdp_results):
    for messages in each_rank(fsdp_results, "split_group_warns"):
        assert len(messages) == 1  # blocks.0 is a whole group: no warning
        assert "keeps 2 gradients of an FSDP2 group" in messages[0]
        assert "head.weight" in messages[0]


def test_hsdp_matches_plain_and_replicas_agree(replica_results):
    for result in each_rank(replica_results, "hsdp_matches_plain"):
        assert result["placements"] == "(Replicate(), Shard(dim=0))"
        assert result["difference"] == 0.0
        assert result["replica_gap"] == 0.0


def test_replicate_with_fsdp_matches_plain_and_replicas_agree(replica_results):
    for result in each_rank(replica_results, "replicate_with_fsdp_matches_plain"):
        assert result["difference"] == 0.0
        assert result["replica_gap"] == 0.0


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("ddp_refused", "TypeError: The gradient cache cannot run under classic"),
        ("ddp_replicate_refused", "TypeError: The gradient cache cannot run under classic"),
        ("decorator_refuses_ddp", "TypeError: The gradient cache cannot run under classic"),
        ("ddp_inner_module_refused_at_first_hook", "RuntimeError: Parameter"),
        ("cpu_offload_refused", "ValueError: "),
        ("tensor_parallel_placement_refused", "ValueError: Parameter 'weight' is a DTensor"),
        ("partly_sharded_refused", "ValueError: 4 cached parameters (embed.weight"),
        ("two_meshes_refused", "ValueError: The cached parameters live on 2 device meshes"),
    ],
)
def test_refused_on_every_rank_with_the_reason(replica_results, scenario, expected):
    for message in each_rank(replica_results, scenario):
        assert message.startswith(expected), message
        assert "fully_shard" in message or "CPUOffloadPolicy" in message


def test_a_cache_created_after_an_eval_is_told_to_reshard_first(replica_results):
    for result in each_rank(replica_results, "created_after_an_eval"):
        assert "call model.reshard() before creating the cache" in result["refusal"]
        assert result["after reshard"] == "no error"


def test_norms_are_reduced_on_the_parameters_device_not_the_current_one():
    """nccl on ``cuda:1`` reduces there: ``"cuda"`` alone is the current device (``cuda:0``
    in a process that never called ``set_device``). A gloo mesh keeps the CPU."""
    from gradient_cache.engine.sharding import collective_device

    assert collective_device(torch.device("cuda", 1), "cuda") == torch.device("cuda", 1)
    assert collective_device(torch.device("cpu"), "cpu") == torch.device("cpu")
    # Parameters on the device, a gloo mesh on the CPU: the collective runs on the CPU.
    assert collective_device(torch.device("cuda", 1), "cpu") == torch.device("cpu")


# --- offload_parameters: each rank's shards on the host -----------------------------


def test_shards_on_the_host_train_bit_for_bit_with_plain_fsdp2(weights_results):
    """AdamW with two param groups, two micro-batches and clipping."""
    for result in each_rank(weights_results, "weights_on_host_match_plain"):
        assert result["weights"] == 0.0
        assert result["losses"] and result["norms"]
        assert result["closed weights"] == 0.0  # the cache closed: every shard back as it was
        assert result["warnings"] == []  # the parameters' check sees them in place
        # On CUDA: each bring orders FSDP2's copy-in stream (one root: one stream) after
        # the refill, and giving up what FSDP2 may not have waited for joins it first.
        assert result["let_read"] and len(set(result["let_read"])) == 1
        assert set(result["join"]) == set(result["let_read"])


def test_shards_on_the_host_under_mixed_precision_bring_the_bf16_casts(weights_results):
    """Bit for bit with plain FSDP2 under MixedPrecisionPolicy(param_dtype=bf16), forward and
    backward moving each shard's bf16 cast (2 bytes, not the fp32 shard's 4): the weights'
    bytes per step at most 0.8 of the same run without the policy."""
    for result in each_rank(weights_results, "weights_on_host_mixed_precision"):
        assert result["difference"] == 0.0
        assert result["moved"] <= 0.8 * result["moved fp32"]
        assert result["loaded"] == 0.0 and result["closed"] == 0.0  # the masters, not casts


@pytest.mark.parametrize(
    "scenario",
    [
        "weights_on_host_one_rank_mesh",
        "weights_on_host_named_prefetch",
        "weights_on_host_decorated",
    ],
)
def test_shards_on_the_host_with_fsdp2_options_and_the_decorator(weights_results, scenario):
    assert each_rank(weights_results, scenario) == [0.0, 0.0]


def test_shards_on_the_host_with_activation_checkpointing_and_sgd(weights_results):
    for by_reshard in each_rank(weights_results, "weights_on_host_sgd_checkpointed"):
        for reshard, result in by_reshard.items():
            assert result["difference"] == 0.0
            # A block's forward rerun in backward brings nothing: FSDP2 all-gathered it
            # before (resharded after forward: in its backward hook; else it kept the
            # weights). Backward brings the blocks again only where FSDP2 resharded them.
            sizes = result["shard bytes"]
            everything, again = sum(sizes), sum(sizes[1:]) if reshard else 0
            assert result["moved MiB"] * 2**20 == everything + again + 2 * everything


def test_shards_are_on_the_device_only_around_their_all_gathers_and_steps(weights_results):
    for result in each_rank(weights_results, "weights_on_host_match_plain"):
        in_use = result["in use"]
        blocks = 4
        # The first forward starts with every shard (FSDP2's lazy init reads them all),
        # and each goes once its module's all-gather is done.
        assert in_use[:blocks] == [3, 2, 1, 0]
        # Then, as each block begins its forward or backward: the next one arriving, or
        # the one FSDP2 prefetches; never more than two modules' shards of the five.
        assert max(in_use[blocks:]) == 2 and min(in_use[blocks:]) == 0
        assert result["at rest"] == result["after backward"] == result["after eval"] == []
        assert result["closed"] == 5  # close brings every shard back
        sizes = result["shard bytes"]
        assert result["host MiB"] * 2**20 >= sum(sizes)
        # The last step: each module's shards come once in forward, the blocks' again in
        # backward (the root keeps its all-gathered weights: FSDP2's root does not reshard
        # after forward), and every shard comes and goes in the step.
        everything, blocks_only = sum(sizes), sum(sizes[1:])
        assert result["moved MiB"] * 2**20 == everything + blocks_only + 2 * everything


def test_shards_on_the_host_beside_the_loop(weights_results):
    """Submodules' state_dict loaded back, FSDP2's own unshard(), evals through a block
    and through the model."""
    for result in each_rank(weights_results, "weights_on_host_beside_the_loop"):
        assert result["difference"] == 0.0
        assert result["after a block's eval"] == result["after the model's eval"] == []
        assert result["after an early exit"] == []  # a block brought ahead, never run
        # A state_dict taken while a block's shards were on the device: host copies, as
        # they were then, saved after the step gave the shards up.
        assert result["saved"] == 0.0


def test_shards_on_the_host_of_two_roots_called_as_a_framework_does(weights_results):
    for result in each_rank(weights_results, "weights_on_host_two_roots_through_a_framework"):
        assert result["difference"] == 0.0
        in_use = result["in use"]  # the root called directly: its blocks, 4 steps
        # The second step's forward: each block begins with the next one arriving.
        assert in_use[8:12] == [1, 1, 1, 0] and max(in_use[4:]) == 2


def test_a_close_without_room_for_the_shards_keeps_the_cache(weights_results):
    for result in each_rank(weights_results, "weights_on_host_close_without_room"):
        assert "did not fit back on the device" in result["refusal"]
        assert "The cache stays attached" in result["refusal"]
        assert result["difference"] == 0.0  # it trained on, and closed later
        assert result["closed"] == 5


def test_shards_on_the_host_resume_from_a_checkpoint_bit_for_bit(weights_results):
    for result in each_rank(weights_results, "weights_on_host_resume"):
        assert result["difference"] == 0.0
        assert result["compact"]  # state_dict: copies of their own, not slab views
        assert result["loaded at rest"] == []  # the loaded shards went to their masters


def test_what_the_shards_on_the_host_cannot_be_combined_with_is_refused(weights_results):
    for errors in each_rank(weights_results, "weights_on_host_refusals"):
        dtype, blocks, grouped, frozen, taken, inside = errors
        assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in dtype
        assert "Drop parameter_blocks" in blocks
        assert "fully_shard([...])" in grouped and "Call fully_shard on each module" in grouped
        assert "'embed.weight': it is not one of FSDP2's shards" in frozen
        # FSDP2 re-reading a shard at rest takes other memory for it: the next forward
        # refuses to train on it.
        assert "'blocks.0.0.weight' moved or cast off the host master" in taken
        assert "root is FSDPNet, not a Sequential inside it" in inside
        assert "Create the cache on the root module" in inside


def fsdp2_objects(*, plural: bool = True, drop: str | None = None) -> Any:
    """Stand-ins for FSDP2's objects holding every private name the shard stream reads
    (the groups under torch 2.13's plural name or 2.6's singular one), less ``drop``."""
    from types import SimpleNamespace

    def holder(**names: Any) -> SimpleNamespace:
        return SimpleNamespace(**{k: v for k, v in names.items() if k != drop})

    comm = holder(post_forward_order=[], all_gather_copy_in_stream=None)
    param = holder(
        sharded_param=holder(_local_tensor=None), _sharded_param_data=None, param_dtype=None
    )
    group = holder(fsdp_params=[param], comm_ctx=comm, _post_forward_indices=[], is_unsharded=False)
    groups = {"_fsdp_param_groups": [group]} if plural else {"_fsdp_param_group": group}
    state = holder(
        **groups,
        _modules=(),
        _lazy_init=None,
        _comm_ctx=comm,
        _states_to_forward_prefetch=[],
        _states_to_backward_prefetch=[],
    )
    return holder(_get_fsdp_state=lambda: state)


@pytest.mark.parametrize("plural", [True, False], ids=["torch 2.13", "torch 2.6"])
def test_fsdp2s_private_names_are_checked_once_naming_the_missing_one(plural: bool) -> None:
    from gradient_cache.engine.fsdp_privates import check_fsdp_privates, param_groups

    check_fsdp_privates(fsdp2_objects(plural=plural), initialized=True)
    assert len(param_groups(fsdp2_objects(plural=plural)._get_fsdp_state())) == 1
    for missing in (
        "_post_forward_indices",
        "_sharded_param_data",
        "all_gather_copy_in_stream",
        "_local_tensor",
        "param_dtype",
    ):
        with pytest.raises(RuntimeError, match=f"no '{missing}'") as refusal:
            check_fsdp_privates(fsdp2_objects(plural=plural, drop=missing), initialized=True)
        assert f"torch {torch.__version__}" in str(refusal.value)
