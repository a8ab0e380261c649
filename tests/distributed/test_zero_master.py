"""What each ZeRO stage holds, read from the rewritten graph, and the sharded fp32 master on gloo.

- stage 1: optimizer state sharded; every full gradient lives until backward ends (one
  reduce-scatter per bucket after it); parameters whole.
- stage 2: each bucket is reduce-scattered as soon as backward completes it: only shards and the
  buckets in flight live at backward's end.
- stage 3: the parameter inputs are shards as well.
- ``zero_master: sharded`` (``optimizer_shard{master=sharded}``) at stage 1/2 (the paper's
  mixed-precision layout): the fp32
  parameters are this rank's shard, like the optimizer state; a weight that mixed precision reads
  only as bf16 is gathered whole in bf16 once per step (the cast of the shard), anything else in
  fp32. On 2 gloo ranks it trains exactly like plain data parallelism in bf16 and like one process
  in fp32 (1e-5), and the user's ``model.state_dict()``, evaluation and full optimizer state are the
  trained ones without calling any project function; a DCP checkpoint resumes into either layout;
  over tensor parallelism the dp x tp program compiles and verifies.
- stage 3 under bf16 keeps no weight (nor its cast) from forward to backward.
- fp16 loss scaling: the overflow flag is all-reduced, so one rank's overflow skips the step on every
  rank (under DP and ZeRO).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402
from test_distributed import assert_all_ok, run_ranks  # noqa: E402

from cann_passes import PassContext, PassManager  # noqa: E402
from cann_passes.pass_manager import PassFailure  # noqa: E402
from graph_ir import capture_train_step  # noqa: E402
from graph_ir.analysis import memory_profile  # noqa: E402
from graph_ir.mesh import MeshDesc  # noqa: E402
from graph_ir.meta import ORIGIN_PASS, Region, nbytes, region_of  # noqa: E402
from graph_ir.signature import InputKind  # noqa: E402

DP = 2


@pytest.fixture(scope="module")
def captured():
    model, opt = worker.make_model()
    graph, _ = capture_train_step(model, opt, worker.gpt_loss, worker.global_batch(0, rows=2))
    return graph, {n: p.numel() for n, p in model.named_parameters()}


def _rewrite(captured, passes: str, rank: int = DP - 1):
    graph, _ = captured
    return PassManager(f"cleanup,{passes},cleanup", verify_level="deep").run(
        graph.copy(), PassContext(mesh=MeshDesc.fake(dp=DP, rank=rank)))


def _collectives(graph, kind: str):
    return [n for n in graph.graph.nodes if n.op == "call_function" and kind in str(n.target)]


def _param_input_bytes(graph) -> int:
    return sum(nbytes(n.meta["val"]) for s, n in zip(graph.signature.inputs, graph.placeholders())
               if s.kind == InputKind.PARAM)


def _backward_end(graph) -> int:
    """Position of the model's own last backward node (before any synchronization placed after it)."""
    nodes = list(graph.graph.nodes)
    return max(i for i, n in enumerate(nodes) if region_of(n) == Region.BACKWARD and ORIGIN_PASS not in n.meta)


def _live_at_backward_end(graph) -> int:
    return memory_profile(graph.graph).live_bytes[_backward_end(graph)]


def _reduce_scatters_after_backward(graph) -> list[bool]:
    end, nodes = _backward_end(graph), list(graph.graph.nodes)
    return [nodes.index(n) > end for n in _collectives(graph, "reduce_scatter")]


def test_each_stage_holds_what_its_name_says(captured):
    _, numel = captured
    psi = sum(numel.values())
    graphs = {s: _rewrite(captured, f"optimizer_shard{{stage={s},bucket_mb=0.02}}") for s in (1, 2, 3)}
    dp = _rewrite(captured, "data_parallel{bucket_mb=0.02}")
    # stage 1: the reduce-scatters wait for backward to end; the full gradients are all live then
    assert all(_reduce_scatters_after_backward(graphs[1]))
    assert _live_at_backward_end(graphs[1]) >= 4 * psi
    # stage 2: reduce-scattered during backward; what is live at its end is far below the gradients
    assert not all(_reduce_scatters_after_backward(graphs[2]))
    assert _live_at_backward_end(graphs[2]) < 0.8 * _live_at_backward_end(graphs[1])
    # parameters: whole at stages 1 and 2 (as with data parallelism), a shard at 3
    assert _param_input_bytes(graphs[1]) == _param_input_bytes(graphs[2]) == _param_input_bytes(dp) == 4 * psi
    shards = sum(-(-n // DP) for n in numel.values())
    assert _param_input_bytes(graphs[3]) == 4 * shards
    for s in (1, 2):
        assert graphs[s].attrs["zero"]["master"] == "whole"
        assert {region_of(n) for n in _collectives(graphs[s], "all_gather")} == {Region.OPTIMIZER}
    assert graphs[3].attrs["zero"]["master"] == "sharded"


@pytest.mark.parametrize("stage,low", [(1, "bf16"), (2, "bf16"), (2, "fp16")])
def test_sharded_master_gathers_bf16_weights_once_and_holds_fp32_shards(captured, stage, low):
    _, numel = captured
    scaling = "loss_scale{mode=dynamic}," if low == "fp16" else ""
    graph = _rewrite(captured, f"autocast{{dtype={low},policy=cuda}},{scaling}"
                               f"optimizer_shard{{stage={stage},bucket_mb=0.02,master=sharded}}")
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[low]
    shards = sum(-(-n // DP) for n in numel.values())
    assert _param_input_bytes(graph) == 4 * shards          # the fp32 master: this rank's shard only
    gathers = _collectives(graph, "all_gather")
    # gathered for forward, before its first use; never again in backward; nothing after the update
    assert {region_of(n) for n in gathers} == {Region.FORWARD}
    dtypes = {n.meta["val"].dtype for n in gathers}
    assert dtypes == {low, torch.float32}
    zero = graph.attrs["zero"]
    assert zero["master"] == "sharded"
    # the matmul weights travel in 16 bits; the tied embedding / lm_head (read in fp32 by the
    # embedding) and the norms in fp32; every parameter once
    moved = zero["gathered_for_step"]
    name = str(low).removeprefix("torch.")
    assert moved[name] > moved["float32"] > 0
    assert moved[name] + moved["float32"] == DP * shards
    # no fp32 copy of a bf16-only weight: its only cast reads the shard
    casts = [n for n in graph.graph.nodes if n.target is torch.ops.aten._to_copy.default
             and n.args[0].op == "placeholder" and region_of(n) != Region.OPTIMIZER]
    assert casts and all(n.args[0].meta["val"].dim() == 1 for n in casts)
    after = _reduce_scatters_after_backward(graph)
    if scaling:
        # fp16 loss scaling unscales every gradient after backward ends (loss_scale), and the
        # update reads the unscaled one: its reduce-scatter cannot start earlier, even at stage 2
        assert all(after)
    else:
        assert all(after) if stage == 1 else not all(after)


def test_stage3_in_bf16_keeps_no_weight_from_forward_to_backward(captured):
    from graph_ir.analysis.memory import saved_activations
    graph = _rewrite(captured, "autocast{dtype=bf16,policy=cuda},optimizer_shard{stage=3,bucket_mb=0.02}")
    by_name = {n.name: n for n in graph.graph.nodes}

    def from_gather(node) -> bool:          # a value computed only from gathered parameters by views/casts
        while node.op == "call_function" and "all_gather" not in str(node.target) and node.all_input_nodes:
            if len(node.all_input_nodes) != 1:
                return False
            node = node.all_input_nodes[0]
        return "all_gather" in str(node.target)

    kept = [name for name in saved_activations(graph.graph) if from_gather(by_name[name])]
    assert not kept, f"forward copies of gathered weights read by backward: {kept}"
    # backward gathers its own copies (and casts them again)
    assert any(region_of(n) == Region.BACKWARD for n in _collectives(graph, "all_gather"))


def test_sharded_master_composes_with_tensor_parallelism(captured):
    """dp=2 x tp=2: each rank's tp shard of a weight is flat-sharded over dp, and gathered back over dp only."""
    from cann_passes import Plan
    from cann_passes.compile import compile_program
    from graph_ir.placement import placement_of
    graph, _ = captured
    plan = Plan(dp=2, tp=2, zero_stage=2, zero_master="sharded", precision="bf16", backend="eager",
                verify="deep", bucket_mb=0.02)
    (tg,) = compile_program(graph, plan, MeshDesc.fake(dp=2, tp=2, rank=3)).graphs.values()
    assert tg.attrs["zero"]["master"] == "sharded"
    placements = {s.name: str(placement_of(tg, InputKind.PARAM, s.name)) for s in tg.signature.inputs
                  if s.kind == InputKind.PARAM}
    both = [n for n, p in placements.items() if "tp" in p and "dp" in p]
    assert both and all("dp" in p for p in placements.values()), placements
    assert {n.meta["val"].dtype for n in _collectives(tg, "all_gather") if region_of(n) == Region.FORWARD} >= \
        {torch.bfloat16}


def test_sharded_master_refuses_what_it_does_not_build(captured):
    from cann_passes.pass_manager import PipelineError
    with pytest.raises(PipelineError, match="option 'master' = 'fp16': must be one of 'whole', 'sharded'"):
        _rewrite(captured, "optimizer_shard{stage=1,master=fp16}")
    with pytest.raises(PassFailure, match="master='sharded' with gradient accumulation"):
        _rewrite(captured, "grad_accumulation{microbatches=2},optimizer_shard{stage=2,master=sharded}")


def test_zero_master_plan_field_builds_the_option_and_refuses_what_is_not_built():
    from cann_passes import Plan
    from cann_passes.pass_pipeline import build_pipeline
    from cann_passes.plan import PlanError
    text = str(build_pipeline(Plan(dp=2, zero_stage=2, precision="bf16", zero_master="sharded"), "eager"))
    assert "master=sharded" in text
    assert "master" not in str(build_pipeline(Plan(dp=2, zero_stage=2), "eager"))
    for bad, rule in [({"zero_stage": 3}, "applies only to zero_stage 1 or 2"),
                      ({"zero_stage": 1, "microbatches": 2}, "not built with gradient accumulation"),
                      ({"zero_stage": 1, "zero_master": "half"}, "must be one of")]:
        with pytest.raises(PlanError, match=rule) as info:
            Plan(dp=2, **({"zero_master": "sharded"} | bad))
        assert info.value.field == "zero_master"


def _eager(steps: int):
    model, opt = worker.make_model()
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = worker.gpt_loss(model, worker.global_batch(i))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = model(worker.probe_batch())
    return losses, model.state_dict(), evaluated


def _close(got, want, what: str, tol: float = 1e-5):
    if isinstance(got, dict):
        assert set(got) == set(want), what
        for k in want:
            _close(got[k], want[k], f"{what}[{k}]", tol)
    elif isinstance(got, list):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what} step {i}: {a} vs {b}"
    else:
        assert got.shape == want.shape, what
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol, f"{what} differs by {err:.2e}"


@pytest.mark.slow
def test_sharded_master_fp32_matches_one_process_the_users_objects_are_trained_and_checkpoints_resume(tmp_path):
    assert_all_ok(run_ranks(DP, "master", str(tmp_path), "fp32", "zero1,zero2"))
    losses, state, evaluated = _eager(5)
    for rank in range(DP):
        got = torch.load(tmp_path / f"master_fp32.rank{rank}.pt", weights_only=False)
        for name in ("zero1", "zero2"):
            run, what = got[name], f"{name} master=sharded fp32, rank {rank}"
            assert run["zero"]["master"] == "sharded" and run["shards"], what
            _close(run["losses"], losses, f"{what}: losses")
            _close(run["state"], dict(state), f"{what}: model.state_dict()")
            _close(run["eval"], evaluated, f"{what}: evaluation")
        # DCP checkpoint after 5 steps, resumed for a 6th into the sharded and into the whole layout
        resumed = got["resumed"]
        for into in ("sharded", "whole"):
            _close(resumed[into], resumed["uninterrupted"], f"resumed into master={into}, rank {rank}")


@pytest.mark.slow
def test_sharded_master_and_stage3_in_bf16_train_exactly_like_data_parallel(tmp_path):
    assert_all_ok(run_ranks(DP, "master", str(tmp_path), "bf16", "dp,zero1,zero2,zero2_whole,zero3"))
    for rank in range(DP):
        got = torch.load(tmp_path / f"master_bf16.rank{rank}.pt", weights_only=False)
        ref = got["dp"]
        for name in ("zero1", "zero2", "zero2_whole", "zero3"):
            run, what = got[name], f"{name} bf16, rank {rank}"
            _close(run["losses"], ref["losses"], f"{what}: losses")
            _close(run["state"], ref["state"], f"{what}: model.state_dict()")
            _close(run["eval"], ref["eval"], f"{what}: evaluation")
            _close(run["optim"], ref["optim"], f"{what}: full optimizer state")
        for name in ("zero1", "zero2"):
            run = got[name]
            gathers = [c for c in run["collectives"] if "all_gather" in c[0]]
            assert {c[1] for c in gathers} == {"forward"}, name
            assert {c[2] for c in gathers} == {"torch.bfloat16", "torch.float32"}, name
            assert all(len(shape) == 1 for shape in run["param_inputs"].values()), name
        whole = got["zero2_whole"]
        assert whole["zero"]["master"] == "whole" and not whole["shards"]
        assert {c[1] for c in whole["collectives"] if "all_gather" in c[0]} == {"optimizer"}


def test_fp16_overflow_flag_is_all_reduced_before_any_update_reads_it(captured):
    for sync in ("data_parallel{bucket_mb=0.02}", "optimizer_shard{stage=2,bucket_mb=0.02}"):
        graph = _rewrite(captured, f"autocast{{dtype=fp16,policy=cuda}},loss_scale{{mode=dynamic}},{sync}")
        index = graph.signature.output_index("metric", "loss_scale:found_inf")
        flag = graph.output_values()[index]
        source = flag.args[0].args[0]                    # gt(wait(all_reduce(float(local flag))))
        assert "all_reduce" in str(source.target) and source.args[1] == "max", sync
        # where(found_inf, old, new) for every parameter and state output: the skipped step
        skips = [n for n in graph.graph.nodes if n.target is torch.ops.aten.where.self
                 and region_of(n) == Region.OPTIMIZER and n.args[1].op == "placeholder"]
        assert skips and all(n.args[0] is flag for n in skips), sync


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    assert_all_ok(run_ranks(DP, "overflow", str(tmp_path), "0,2"))
    model, _ = worker.make_model()
    initial = model.state_dict()
    ranks = [torch.load(tmp_path / f"overflow.rank{r}.pt", weights_only=False) for r in range(DP)]
    for stage in (0, 2):
        first, second = (list(x) for x in zip(*(r[stage] for r in ranks)))
        what = f"zero_stage {stage}"
        assert all(s["found_inf"] for s in first), f"{what}: every rank skips the overflowing step"
        for s in first:
            _close(s["params"], dict(initial), f"{what}: parameters after the skipped step", tol=0.0)
        assert first[0]["scale"] == first[1]["scale"]
        assert not any(s["found_inf"] for s in second), what
        for s in second:
            assert all(torch.isfinite(v).all() for v in s["params"].values()), what
            _close(s["params"], second[0]["params"], f"{what}: ranks agree after the next step", tol=0.0)
