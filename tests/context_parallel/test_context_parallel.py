"""context_parallel on a fake mesh (one process): what it traces, what it refuses, the plan field."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from cann_passes.compile import compile_program
from cann_passes.pass_manager import PassContext, PassFailure, PassManager, Pipeline
from cann_passes.pass_pipeline import build_pipeline
from cann_passes.plan import PlanError
from cann_passes.passes.context_parallel import ContextParallelError
from cann_passes.runtime.distributed import check_world
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from graph_ir.meta import GraphAttr
from tests import zoo

c10d = torch.ops._c10d_functional


def _capture(name="llama", loss_fn=None, batch=None, **config):
    entry = zoo.build(name, layers=1, seed=0, **config)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    graph, _ = capture_train_step(entry.model, opt, loss_fn or entry.loss_fn,
                                  batch if batch is not None else entry.make_batch(0, pad=True))
    return graph


@pytest.fixture(scope="module")
def llama():
    return _capture()


def _run(graph, cp=2, rank=0, pipeline="context_parallel", **mesh):
    ctx = PassContext(mesh=MeshDesc.fake(cp=cp, rank=rank, **mesh))
    return PassManager(Pipeline.parse(pipeline), verify_level="deep").run(graph.copy(), ctx), ctx


def _collectives(graph, origin=GraphAttr.CONTEXT_PARALLEL):
    return [n for n in graph.graph.nodes if n.meta.get("origin_pass") == origin
            and n.target is not c10d.wait_tensor.default]


def test_attention_gathers_kv_and_the_gradients_are_reduced(llama):
    out, ctx = _run(llama, rank=1)
    assert out.attrs[GraphAttr.CONTEXT_PARALLEL] == {"cp": 2, "rank": 1, "seq": 12, "local_seq": 6,
                                                       "chunks": [[3, 6], [6, 9]], "partial_gradients": False}
    gathers = [n for n in _collectives(out) if n.target is c10d.all_gather_into_tensor.default]
    scatters = [n for n in _collectives(out) if n.target is c10d.reduce_scatter_tensor.default]
    # K and V gathered before the layer's attention (and again in backward), dK and dV scattered
    attention = [n for n in out.graph.nodes if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert len(attention) == 1 and len(scatters) == 2 and len(gathers) >= 2
    q, k, v = attention[0].args[:3]
    assert q.meta["val"].shape[2] == 6 and k.meta["val"].shape[2] == 12 and v.meta["val"].shape[2] == 12
    # GQA: K and V cross ranks at their own head count, before the repeat to the query's, and
    # their gradients once its backward has summed them back
    assert zoo.KV_HEADS < zoo.HEADS
    assert q.meta["val"].shape[1] == zoo.HEADS
    kv = [n for n in gathers + scatters if n.args[0].meta["val"].is_floating_point()]
    assert len(kv) >= 4
    # gathered again for the backward (and repeated again there), not kept whole from forward
    assert len([n for n in kv if n in gathers and n.meta.get("region") == "backward"]) == 2
    for n in kv:
        moved = n.args[0].meta["val"]
        assert moved.numel() == zoo.BATCH * zoo.KV_HEADS * 6 * (zoo.HIDDEN // zoo.HEADS) * (2 if n in scatters else 1), n
    # every collective names the mesh description's cp group
    assert {n.args[-1] for n in _collectives(out)} == {MeshDesc.fake(cp=2, rank=1).group_name("cp")}


def test_one_chunk_of_tokens_per_rank(llama):
    """The residual stream, the projections and the logits hold seq / cp tokens."""
    out, _ = _run(llama)
    vocab = zoo.VOCAB
    logits = [n for n in out.graph.nodes if n.target is torch.ops.aten._log_softmax.default]
    assert logits and all(tuple(n.meta["val"].shape) == (zoo.BATCH * 6, vocab) for n in logits)


def _attention_work(graph, region):
    """(query rows, keys) of each attention kernel of one region."""
    kernel = {"forward": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              "backward": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}[region]
    q_at = 0 if region == "forward" else 1
    return [(n.args[q_at].meta["val"].shape[2], n.args[q_at + 1].meta["val"].shape[2])
            for n in graph.graph.nodes if n.target is kernel]


def test_causal_attention_is_balanced_over_the_ranks_and_skips_the_masked_keys():
    """is_causal (the recipe GPT's SDPA), seq 12 at cp=2: rank 0 holds positions 0-2 and 9-11,
    rank 1 3-5 and 6-8, and each chunk attends to the keys up to its own end only, forward and
    backward, without a mask: the keys before it in one kernel call, its own under is_causal in
    another, merged by their log-sum-exps. 3x3 + 3x12 = 3x6 + 3x9 query-key pairs per rank (of
    12x12). One contiguous chunk each (balance=false) gives rank 1 twice rank 0's work."""
    graph = _capture("gpt", attention="sdpa")
    work = {}
    for balance in (True, False):
        for rank in range(2):
            out, _ = _run(graph, rank=rank, pipeline=f"context_parallel{{balance={str(balance).lower()}}}")
            chunks = out.attrs[GraphAttr.CONTEXT_PARALLEL]["chunks"]
            forward, backward = _attention_work(out, "forward"), _attention_work(out, "backward")
            assert forward == backward
            assert not [n for n in out.graph.nodes if "flash_attention" in str(n.target) and n.kwargs.get("attn_mask") is not None]
            work[balance, rank] = sum(q * k for q, k in forward)
            if balance:
                assert chunks == ([[0, 3], [9, 12]] if rank == 0 else [[3, 6], [6, 9]])
                # keys before the chunk in one block, its own (causal) in another, none after it
                assert forward == ([(3, 3), (3, 9), (3, 3)] if rank == 0 else [(3, 3), (3, 3), (3, 6), (3, 3)])
            else:
                assert chunks == [[6 * rank, 6 * rank + 6]] and forward == ([(6, 6)] if rank == 0 else [(6, 6), (6, 6)])
    assert work[True, 0] == work[True, 1] == 45
    assert work[False, 1] == 2 * work[False, 0]


def test_ring_attention_passes_k_and_v_round_the_ranks_and_computes_the_same_blocks():
    """cp_attention=ring at cp=3 (six chunks of two): no K/V all-gather; per layer 2 x (cp - 1)
    passes of K and V in forward, and in backward K and V again plus dK and dV, which go one step
    further, home; every rank computes as many blocks, each a pair of two-token chunks; the next
    K and V travel while the blocks of those held run."""
    graph = _capture("gpt", attention="sdpa")
    blocks = []
    for rank in range(3):
        program = compile_program(graph.copy(), Plan(cp=3, cp_attention="ring", backend="eager"),
                                  MeshDesc.fake(cp=3, rank=rank))
        out = next(iter(program.graphs.values()))
        moves = [n for n in out.graph.nodes if n.target is c10d.all_to_all_single.default]
        assert not [n for n in out.graph.nodes if n.target is c10d.all_gather_into_tensor.default
                    and n.args[0].meta["val"].ndim == 4]
        assert len([n for n in moves if n.meta["region"] == "forward"]) == 2 * 2
        assert len([n for n in moves if n.meta["region"] == "backward"]) == 2 * 2 + 2 * 3
        work = _attention_work(out, "forward")
        assert work == _attention_work(out, "backward") and set(work) == {(2, 2)}
        blocks.append(len(work))
        # each pass of K and V is issued before the blocks of the K and V held, waited for after them
        nodes = list(out.graph.nodes)
        for move in moves:
            wait = next(iter(move.users))
            between = nodes[nodes.index(move):nodes.index(wait)]
            assert any("flash_attention" in str(n.target) for n in between) or move.meta["region"] == "backward"
        assert any(any("flash_attention" in str(n.target) for n in nodes[nodes.index(m):nodes.index(next(iter(m.users)))])
                   for m in moves if m.meta["region"] == "backward")
    assert blocks == [7, 7, 7]   # (of 36 chunk pairs, 21 causal: 6 diagonal + 15 below it)
    # SDPA's math path (Falcon's multi-query attention under its mask: matmuls and a softmax) has
    # no kernel to pass K and V round: gathered, and said so
    with pytest.warns(UserWarning, match="attention=ring: this step has no fused attention kernel"):
        compile_program(_capture("falcon"), Plan(cp=2, cp_attention="ring", backend="eager"), MeshDesc.fake(cp=2))
    with pytest.raises(PlanError, match="cp_attention"):
        Plan(cp=2, cp_attention="ulysses")
    assert "context_parallel{attention=ring}" in str(build_pipeline(Plan(cp=2, cp_attention="ring"), "eager"))


def test_refusals(llama):
    with pytest.raises(PassFailure, match=r"sequence length 12 \(dim 1 of the batch inputs .*input_ids.*\) is not divisible by cp=5"):
        _run(llama, cp=5)
    with pytest.raises(PassFailure, match="context_parallel must run before data_parallel"):
        _run(llama, pipeline="data_parallel,context_parallel", dp=2)
    with pytest.raises(PassFailure, match="needs ctx.mesh"):
        PassManager(Pipeline.parse("context_parallel")).run(llama.copy(), PassContext())


def test_token_rows_read_out_of_order_are_refused():
    """A loss that reads the flattened tokens in position order (a cumulative sum over them)
    cannot run on rank-major rows: refused naming the move, not traced wrong."""
    def loss_fn(model, batch):
        logits = model(input_ids=batch["input_ids"]).logits
        return logits.flatten(0, 1).cumsum(0).mean()
    graph = _capture(loss_fn=loss_fn)
    with pytest.raises(PassFailure, match="token rows of the split sequence, which are rank-major"):
        _run(graph)


def test_attention_dropout_is_refused():
    graph = _capture(attention_dropout=0.1)
    with pytest.raises(PassFailure, match=r"random draw \(aten.bernoulli.p\) on a value split over the sequence"):
        _run(graph)


def test_plan_field():
    plan = Plan(cp=2, tp=2)
    text = str(build_pipeline(plan, "eager"))
    assert text.index("tensor_parallel") < text.index("context_parallel")
    # cp splits the sequence of the whole step; pipeline_split then cuts the per-rank step in stages
    staged = str(build_pipeline(Plan(cp=2, pp=2, microbatches=2), "eager"))
    assert staged.index("context_parallel") < staged.index("pipeline_split")
    with pytest.raises(PlanError, match="plan field 'cp' = 2: context parallelism with sequence_parallel"):
        Plan(cp=2, tp=2, sequence_parallel=True)
    with pytest.raises(PlanError, match="plan field 'cp' = 0"):
        Plan(cp=0)
    with pytest.raises(PlanError, match=r"dp x cp x tp x pp = 1 x 2 x 1 x 1 = 2 must equal the number of processes \(4\)"):
        check_world(Plan(cp=2), 4)
    with pytest.raises(PlanError, match="plan field 'cp'"):
        compile_program(_capture(), Plan(cp=2), MeshDesc.fake())


def test_with_dp_each_gradient_is_all_reduced_once_over_dp_and_cp(llama):
    """dp=2 x cp=2: context_parallel leaves each rank's part of a gradient, and data_parallel's
    buckets sum the parts over the four ranks of dp x cp at once (divided by dp): no all-reduce
    over cp per gradient, then one over dp per bucket."""
    params = len(dict(zoo.build("llama", layers=1).model.named_parameters()))
    for rank in (0, 3):   # (a dp x cp corner each)
        mesh = MeshDesc.fake(dp=2, cp=2, rank=rank)
        program = compile_program(llama.copy(), Plan(cp=2, dp=2), mesh)
        graph = next(iter(program.graphs.values()))
        assert graph.attrs[GraphAttr.CONTEXT_PARALLEL]["partial_gradients"]
        assert graph.attrs[GraphAttr.DATA_PARALLEL]["over"] == "dp_cp"
        reduces = [n for n in graph.graph.nodes if n.target is c10d.all_reduce.default]
        by_group = {}
        for n in reduces:
            by_group.setdefault(n.args[-1], []).append(n)
        assert mesh.size("dp_cp") == 4 and mesh.local_rank("dp_cp") == rank
        buckets = graph.attrs[GraphAttr.DATA_PARALLEL]["buckets"]
        assert len(by_group[mesh.group_name("dp_cp")]) == buckets
        # over cp: the loss' sum and token count only (forward), none per gradient
        assert len([n for n in by_group[mesh.group_name("cp")] if n.meta["region"] == "backward"]) == 0
        assert params > buckets
    unsplit = compile_program(llama.copy(), Plan(cp=2), MeshDesc.fake(cp=2))
    assert not next(iter(unsplit.graphs.values())).attrs[GraphAttr.CONTEXT_PARALLEL]["partial_gradients"]


def test_dump_shows_its_collectives(llama, tmp_path):
    compile_program(llama.copy(), Plan(cp=2), MeshDesc.fake(cp=2), dump_dir=str(tmp_path))
    text = next(tmp_path.glob("*_context_parallel.py")).read_text()
    assert "all_gather_into_tensor" in text and "reduce_scatter_tensor" in text
    assert "origin_pass=context_parallel" in text


def test_the_retraced_graphs_of_tp_and_cp_generate_their_code_only_when_run(llama):
    # tensor_parallel and context_parallel retrace the step with make_fx; a GraphModule that
    # generated and compiled its code there did it again after every later pass.
    from torch.fx._lazy_graph_module import _LazyGraphModule
    for plan, mesh in ((Plan(cp=2, backend="eager"), MeshDesc.fake(cp=2)),
                       (Plan(tp=2, backend="eager"), MeshDesc.fake(tp=2))):
        program = compile_program(llama.copy(), plan, mesh)
        for name, graph in program.graphs.items():
            assert isinstance(graph.gm, _LazyGraphModule) and graph.gm._needs_recompile(), (plan, name)
