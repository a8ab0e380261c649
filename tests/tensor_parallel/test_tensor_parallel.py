"""tensor_parallel on a fake mesh, in one process: layouts, local shapes, collectives, bad plans.

Models are the ones users bring (``tests.zoo``: the recipe GPT with its fused qkv and tied
head, transformers' LLaMA with GQA and SDPA, GPT-2 with Conv1D); numerics against
single-process training are in ``test_tp_gloo.py``.
"""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan, PlanError
from cann_passes.pass_manager import PassContext
from cann_passes.passes import tensor_parallel as tpp
from cann_passes.pass_pipeline import build_pipeline
from graph_ir import capture_train_step
from graph_ir.placement import FlatShard, Placement, Shard, placement_of
from graph_ir.verifier import verify
from tests import zoo

LAYERS = 2


class FakeMesh:
    """The mesh description a pass reads: one tp axis of ``size`` ranks, seen from ``rank``."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self, axis):
        return self._size

    def local_rank(self, axis):
        return self._rank

    def group_name(self, axis):
        return "fake:tp"


def _capture(name: str, **config):
    entry = zoo.build(name, layers=LAYERS, **config)
    optimizer = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    graph, _ = capture_train_step(entry.model, optimizer, entry.loss_fn, entry.make_batch(1))
    return entry, graph


@pytest.fixture(scope="module")
def gpt():
    return _capture("gpt")


@pytest.fixture(scope="module")
def llama():
    return _capture("llama")


@pytest.fixture(scope="module")
def gpt_tp2(gpt):
    return _run(gpt[1])


@pytest.fixture(scope="module")
def llama_tp2(llama):
    return _run(llama[1], rank=1)


def _run(graph, tp=2, rank=0, **options):
    ctx = PassContext(mesh=FakeMesh(tp, rank))
    out = tpp.tensor_parallel_pass(graph.copy(), ctx, **options)
    verify(out, deep=True)
    return out


def _collectives(graph):
    """(region, collective, input elements) of every collective, in graph order."""
    return [(str(n.meta["region"]), n.target._overloadpacket.__name__, n.args[0].meta["val"].numel())
            for n in graph.graph.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"
            and n.target is not tpp.c10d.wait_tensor.default]


def _placeholder_shape(graph, kind, name):
    return tuple(graph.input_node(kind, name).meta["val"].shape)


class TestRules:
    def test_rule_text_round_trips_and_bad_styles_are_refused(self):
        rules = tpp.parse_rules("*.attn.qkv=column:3;*.attn.proj=row;wte=vocab")
        assert tpp.format_rules(rules) == "*.attn.qkv=column:3;*.attn.proj=row;wte=vocab"
        with pytest.raises(tpp.TensorParallelError, match="'x=diagonal'.*style one of"):
            tpp.parse_rules("x=diagonal")

    @pytest.mark.parametrize("names,family", [
        (["layers.0.attn.qkv.weight"], "recipe-gpt"),
        (["transformer.h.0.attn.c_attn.weight"], "gpt2"),
        (["model.layers.0.self_attn.q_proj.weight"], "llama"),
        (["bert.encoder.layer.0.attention.self.query.weight"], "bert"),
        (["fc1.weight"], "none")])
    def test_built_in_rules_are_chosen_by_the_parameter_names(self, names, family):
        assert tpp.builtin_rules(names)[0] == family

    def test_gpt2_conv1d_weights_split_on_their_output_dim_read_from_the_graph(self):
        _, graph = _capture("gpt2")
        layouts = tpp.assign_layouts(graph, tpp.builtin_rules(
            s.name for _, s in graph.signature.inputs_of("param"))[1], 2)
        # Conv1D keeps weights [in, out]: column-parallel c_attn splits dim 1 in 3 parts, row c_proj dim 0.
        assert layouts["transformer.h.0.attn.c_attn.weight"] == tpp.ParamLayout(
            "transformer.h.0.attn.c_attn.weight", 1, 3, "*.h.*.attn.c_attn=column:3")
        assert layouts["transformer.h.0.attn.c_proj.weight"].dim == 0
        assert layouts["transformer.h.0.attn.c_proj.bias"].dim is None
        assert layouts["transformer.wte.weight"].dim == 0


class TestRewrite:
    def test_phi3_fused_projections_sliced_apart_split_per_part(self):
        # Phi-3's qkv_proj (column:3) and gate_up_proj (column:2) are sliced, not split: each slice of
        # a part is that part's shard, its gradient the part's place in the fused gradient
        _, graph = _capture("phi3")
        out = _run(graph, tp=2)
        info = out.attrs["tensor_parallel"]
        assert info["family"] == "phi3"
        assert info["params"]["model.layers.0.self_attn.qkv_proj.weight"] == {
            "dim": 0, "parts": 3, "rule": "*.self_attn.qkv_proj=column:3"}
        assert info["params"]["model.layers.0.mlp.gate_up_proj.weight"]["parts"] == 2
        found = _collectives(out)
        assert [c[1] for c in found if c[0] == "forward"].count("all_reduce") == 2 * LAYERS + 1
        assert [c[1] for c in found if c[0] == "backward"] == ["all_reduce"] * (2 * LAYERS + 1)

    def test_a_norm_over_split_features_reduces_its_mean_before_rsqrt_and_a_custom_op_runs_whole(self):
        # OLMoE normalises q and k over the column-parallel projection's split features: the mean of
        # squares is a partial sum, reduced before the rsqrt that is not linear in it. Its experts'
        # transformers grouped matmul has no DTensor rule and runs whole on every rank.
        _, graph = _capture("olmoe")
        out = _run(graph, tp=2)
        for node in out.graph.nodes:
            if node.target is torch.ops.aten.rsqrt.default and "q_norm" in node.meta.get("module_path", ""):
                source = node.args[0]
                while source.target is torch.ops.aten.add.Tensor:
                    source = source.args[0]
                assert source.target is tpp.c10d.wait_tensor.default, f"{node.name} reads a partial sum"
        assert "model.layers.0.mlp.experts.gate_up_proj" not in out.attrs["tensor_parallel"]["params"]

    def test_two_kv_heads_at_tp4_are_replicated_and_their_query_heads_cut_locally(self, llama):
        # LLaMA with 4 query and 2 kv heads at tp=4: k_proj and v_proj stay whole on every rank,
        # q_proj keeps one query head; in backward each rank's query-head share of dK and dV is
        # all-gathered before the head repeat's sum, so the kv weights' gradients are whole
        out = _run(llama[1], tp=4, rank=3)
        assert out.attrs["tensor_parallel"]["replicated_kv_heads"] == [
            f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("k_proj", "v_proj")]
        head_dim = zoo.HIDDEN // zoo.HEADS
        assert _placeholder_shape(out, "param", "model.layers.0.self_attn.k_proj.weight") == (
            zoo.KV_HEADS * head_dim, zoo.HIDDEN)
        assert _placeholder_shape(out, "param", "model.layers.0.self_attn.q_proj.weight") == (head_dim, zoo.HIDDEN)
        found = _collectives(out)
        gathers = [c for c in found if c[:2] == ("backward", "all_gather_into_tensor")]
        assert gathers == [("backward", "all_gather_into_tensor", zoo.BATCH * zoo.SEQ * head_dim)] * (2 * LAYERS)
        assert [c[1] for c in found if c[0] == "backward"].count("all_reduce") == 2 * LAYERS + 1

    def test_megatron_two_all_reduces_forward_and_two_backward_per_layer(self, gpt_tp2, llama_tp2):
        for out in (gpt_tp2, llama_tp2):
            found = _collectives(out)
            forward = [c for c in found if c[0] == "forward"]
            backward = [c for c in found if c[0] == "backward"]
            # per layer: attention out-proj and MLP down-proj (forward), their column-parallel
            # inputs' gradients (backward); plus the vocab-parallel embedding (forward), the
            # head's input gradient (backward) and the logits gathered for the loss.
            assert [c[1] for c in forward].count("all_reduce") == 2 * LAYERS + 1
            assert [c[1] for c in backward] == ["all_reduce"] * (2 * LAYERS + 1)
            assert [c[1] for c in forward].count("all_gather_into_tensor") == 1
            assert not [c for c in found if c[0] == "optimizer"]

    def test_parameters_state_and_views_become_local_with_gqa_kv_heads_split(self, llama_tp2):
        out = llama_tp2
        q = "model.layers.0.self_attn.q_proj.weight"
        k = "model.layers.0.self_attn.k_proj.weight"
        down = "model.layers.0.mlp.down_proj.weight"
        assert _placeholder_shape(out, "param", q) == (zoo.HIDDEN // 2, zoo.HIDDEN)
        assert _placeholder_shape(out, "param", k) == (zoo.HIDDEN // zoo.HEADS * zoo.KV_HEADS // 2, zoo.HIDDEN)
        assert _placeholder_shape(out, "param", down) == (zoo.HIDDEN, zoo.FFN // 2)
        assert _placeholder_shape(out, "opt_state", f"{q}:exp_avg") == (zoo.HIDDEN // 2, zoo.HIDDEN)
        assert _placeholder_shape(out, "param", "model.norm.weight") == (zoo.HIDDEN,)
        head_dim = zoo.HIDDEN // zoo.HEADS
        views = {tuple(n.meta["val"].shape) for n in out.graph.nodes
                 if n.target is torch.ops.aten.view.default and n.meta.get("module_path", "").endswith("self_attn")}
        assert (zoo.BATCH, zoo.SEQ, zoo.HEADS // 2, head_dim) in views          # query heads
        assert (zoo.BATCH, zoo.SEQ, zoo.KV_HEADS // 2, head_dim) in views       # kv heads
        assert out.attrs["tensor_parallel"]["params"][k] == {"dim": 0, "parts": 1,
                                                             "rule": "*.self_attn.k_proj=column"}
        # the runtime's binding and checkpoints cut and gather by these placements
        assert placement_of(out, "param", q) == Placement.sharded((zoo.HIDDEN, zoo.HIDDEN), 0, "tp")
        assert placement_of(out, "opt_state", f"{down}:exp_avg_sq") == \
            Placement.sharded((zoo.HIDDEN, zoo.FFN), 1, "tp")
        assert placement_of(out, "param", "model.norm.weight") is None

    def test_fused_qkv_and_tied_head_of_the_recipe_gpt(self, gpt_tp2):
        out = gpt_tp2
        qkv = "layers.0.attn.qkv.weight"
        assert _placeholder_shape(out, "param", qkv) == (3 * zoo.HIDDEN // 2, zoo.HIDDEN)
        assert out.attrs["tensor_parallel"]["params"][qkv]["parts"] == 3
        # wte is the embedding and (tied) the head: one vocab-split parameter
        assert _placeholder_shape(out, "param", "wte.weight") == (zoo.VOCAB // 2, zoo.HIDDEN)

    def test_vocab_parallel_loss_never_gathers_the_logits(self, gpt):
        _, graph = gpt
        out = _run(graph, vocab_parallel_loss=True)
        gathers = [c for c in _collectives(out) if c[1] == "all_gather_into_tensor"]
        assert gathers == []
        # the loss' reductions are over [tokens, 1] statistics, not over logits
        small = [c for c in _collectives(out) if c[:2] == ("forward", "all_reduce")
                 and c[2] == zoo.BATCH * zoo.SEQ]
        assert len(small) >= 2

    def test_sequence_parallel_replaces_each_all_reduce_by_a_pair_moving_the_same_bytes(self, gpt, gpt_tp2):
        _, graph = gpt
        n = zoo.BATCH * zoo.SEQ * zoo.HIDDEN           # one residual-stream activation
        plain = _collectives(gpt_tp2)
        seq = _collectives(_run(graph, sequence_parallel=True, vocab_parallel_loss=True))
        for region in ("forward", "backward"):
            assert not [c for c in seq if c[:2] == (region, "all_reduce") and c[2] == n]
        reduces = [c for c in plain if c[:2] == ("forward", "all_reduce") and c[2] == n]
        scatters = [c for c in seq if c[:2] == ("forward", "reduce_scatter_tensor") and c[2] == n]
        gathers = [c for c in seq if c[:2] == ("forward", "all_gather_into_tensor") and c[2] == n // 2]
        assert len(reduces) == len(scatters) == len(gathers) == 2 * LAYERS + 1
        # ring accounting: an all-reduce moves 2x its size, a reduce-scatter its input, an
        # all-gather its output: the pairs move what the all-reduces did
        assert sum(2 * c[2] for c in reduces) == sum(c[2] for c in scatters) + sum(2 * c[2] for c in gathers)


    def test_autocast_before_and_recompute_after_compose_without_duplicating_a_collective(self, llama):
        from cann_passes.pass_manager import PassManager
        _, graph = llama
        split = PassManager("cleanup,autocast{dtype=bf16,policy=cuda},tensor_parallel",
                            verify_level="deep").run(graph.copy(), PassContext(mesh=FakeMesh(2)))
        recomputed = PassManager("recompute{policy=full},cleanup", verify_level="deep").run(
            split.copy(), PassContext(mesh=FakeMesh(2)))
        assert any(n.meta.get("recompute") for n in recomputed.graph.nodes)
        assert tpp.count_collectives(recomputed) == tpp.count_collectives(split) == {
            ("forward", "all_reduce"): 2 * LAYERS + 1, ("forward", "all_gather_into_tensor"): 1,
            ("backward", "all_reduce"): 2 * LAYERS + 1}


class TestBadPlans:
    def test_heads_not_divisible_by_tp_name_the_parameter_and_rule(self, gpt):
        _, graph = gpt
        with pytest.raises(tpp.TensorParallelError,
                           match=r"parameter 'layers.0.attn.qkv.weight' \(rule '\*layers.\*.attn.qkv=column:3'\): "
                                 r"4 heads .* not divisible by tp=8"):
            _run(graph, tp=8)

    def test_kv_heads_neither_dividing_nor_divided_by_tp_name_k_proj(self):
        # 24 query heads split whole over tp=8; 3 kv heads can be neither split nor replicated
        _, graph = _capture("llama", hidden_size=192, num_attention_heads=24, num_key_value_heads=3)
        with pytest.raises(tpp.TensorParallelError,
                           match=r"parameter 'model.layers.0.self_attn.k_proj.weight' .*3 kv heads .*tp=8 "
                                 r"\(rule: kv heads fewer than tp are replicated when tp is a multiple of them\)"):
            _run(graph, tp=8)

    def test_a_fused_projection_sliced_into_unequal_parts_names_the_slice(self):
        # Phi-3 with 1 kv head: qkv_proj is 32 + 8 + 8 features, sliced apart; 'column:3' means 3 equal parts
        _, graph = _capture("phi3", num_key_value_heads=1)
        with pytest.raises(tpp.TensorParallelError,
                           match=r"sliced \[0:32\] along dim 2; its rule says 3 equal parts of 16 at node slice_\d+ "
                                 r".*from parameter model.layers.0.self_attn.qkv_proj.weight"):
            _run(graph, tp=2)

    def test_vocabulary_not_divisible_by_tp(self, llama):
        _, graph = llama
        with pytest.raises(tpp.TensorParallelError,
                           match=r"parameter 'model.embed_tokens.weight' \(rule '\*embed_tokens=vocab'\): "
                                 r"its vocabulary 96 along dim 0 is not divisible by tp=5"):
            _run(graph, tp=5)

    def test_a_user_rule_matching_nothing_is_refused(self, gpt):
        _, graph = gpt
        with pytest.raises(tpp.TensorParallelError, match=r"rule '\*.attention.wq=column' matches no parameter"):
            _run(graph, extra_rules="*.attention.wq=column")

    def test_a_fused_rule_that_does_not_cut_whole_heads_is_refused_at_attention(self):
        # GPT-NeoX interleaves q, k, v per head in query_key_value: 'column:3' (three contiguous
        # parts) leaves the value split across its head features. DTensor's decomposition search on
        # such operands does not end; the pass refuses at the attention op, naming the parameter.
        _, graph = _capture("gpt_neox", attn_implementation="sdpa")
        with pytest.raises(tpp.TensorParallelError,
                           match=r"module 'gpt_neox.layers.0.attention'.*parameter "
                                 r"'gpt_neox.layers.0.attention.query_key_value.(weight|bias)'.*whole heads"):
            _run(graph, extra_rules="*.attention.query_key_value=column:3;*.attention.dense=row")
        _run(graph, extra_rules="*.attention.query_key_value=column;*.attention.dense=row;"
                                "*.mlp.dense_h_to_4h=column;*.mlp.dense_4h_to_h=row")   # whole heads: places

    def test_plan_fields_and_world_size(self):
        from cann_passes.runtime.distributed import check_world
        with pytest.raises(PlanError, match=r"dp x cp x tp x pp = 1 x 1 x 2 x 1 = 2 must equal the number of processes \(4\)"):
            check_world(Plan(tp=2), 4)
        with pytest.raises(PlanError, match=r"tp_rules.\*.wq' = 'diagonal'"):
            Plan(tp=2, tp_rules={"*.wq": "diagonal"})
        with pytest.raises(PlanError, match="sequence_parallel.*applies only to tensor parallelism"):
            Plan(sequence_parallel=True)
        text = str(build_pipeline(Plan(tp=2, tp_rules={"*.wq": "column"}, vocab_parallel_loss=True), "eager"))
        assert 'tensor_parallel{extra_rules="*.wq=column",sequence_parallel=false,vocab_parallel_loss=true}' in text


def test_each_rank_keeps_its_piece_of_the_dropout_masks_korthikanti_bytes():
    # A GPT-3-shaped layer, small: the saved activations of layers.0 per rank against
    # Korthikanti et al.; the dropout masks (drawn whole, cut to the rank's shard) are kept as
    # the rank's bool piece, exactly the formula's 1-byte masks
    from bench.tp_activation_memory import capture, korthikanti, mask_formula, measure
    cfg, graph = capture(1, vocab_size=512, n_head=8, d_model=256, seq_len=128)
    s, b, h, a = cfg.seq_len, 1, cfg.d_model, cfg.n_head
    for sp in (False, True):
        got, masks = measure(graph, 2, sp)
        assert masks == mask_formula(s, b, h, a, 2, sp)
        assert abs(got / korthikanti(s, b, h, a, 2, sp) - 1) < 0.05


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_over_tp_state_is_each_rank_s_tp_shard_flat_sharded_over_dp(llama, stage):
    # dp=2 x tp=2, rank 3 (dp 1, tp 1): the row-parallel o_proj [32, 32] is [32, 16] on this tp
    # rank, and its Adam moments this rank's half of those 512 elements
    from cann_passes import compile_program
    from graph_ir.mesh import MeshDesc
    _, graph = llama
    program = compile_program(graph.copy(), Plan(backend="eager", dp=2, tp=2, zero_stage=stage, verify="deep"),
                              MeshDesc.fake(dp=2, tp=2, rank=3))
    main = program.main
    name = "model.layers.0.self_attn.o_proj.weight"
    composed = Placement((zoo.HIDDEN, zoo.HIDDEN), (("tp", Shard(1)), ("dp", FlatShard())))
    assert placement_of(main, "opt_state", f"{name}:exp_avg") == composed
    assert _placeholder_shape(main, "opt_state", f"{name}:exp_avg") == (zoo.HIDDEN * zoo.HIDDEN // 4,)
    assert placement_of(main, "param", name) == (composed if stage == 3 else
                                                 Placement.sharded((zoo.HIDDEN, zoo.HIDDEN), 1, "tp"))
    # a replicated norm weight is only flat-sharded over dp
    norm = "model.layers.0.input_layernorm.weight"
    assert placement_of(main, "opt_state", f"{norm}:exp_avg") == Placement.flat_shard((zoo.HIDDEN,), "dp")



@pytest.mark.parametrize("rows", [1, zoo.BATCH])
def test_gqa_k_and_v_projections_stay_kv_head_shards_under_sequence_parallelism(rows):
    # transformers' LLaMA (8 query heads, 4 kv heads: repeat_kv's expand + reshape) at tp=2 with
    # sequence parallelism. One unmasked row (the planner's shape) is where DTensor's cheapest
    # strategy would gather the small K/V weights and lay K and V out as sequence shards over
    # every kv head: the weights must stay put and the activations move (Megatron's layout)
    entry = zoo.build("llama", layers=LAYERS, num_attention_heads=8, num_key_value_heads=4)
    optimizer = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    ids = torch.randint(3, zoo.VOCAB, (rows, zoo.SEQ), generator=torch.Generator().manual_seed(0))
    graph, _ = capture_train_step(entry.model, optimizer, zoo.hf_loss, {"input_ids": ids, "labels": ids})
    out = _run(graph, sequence_parallel=True, vocab_parallel_loss=True)
    head_dim = zoo.HIDDEN // 8
    for layer in range(LAYERS):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert _placeholder_shape(out, "param", name) == (4 // 2 * head_dim, zoo.HIDDEN)
            assert placement_of(out, "param", name) == Placement.sharded((4 * head_dim, zoo.HIDDEN), 0, "tp")
    # the local kv heads, repeated for the local query heads, feed the attention kernel
    kernels = [n for n in out.graph.nodes if n.target in tpp._HEAD_LOCAL_OPS and n.meta["region"] == "forward"]
    assert len(kernels) == LAYERS
    for kernel in kernels:
        q, k, v = (a.meta["val"].shape for a in kernel.args[:3])
        assert q[1] == k[1] == v[1] == 8 // 2
    # every collective moves a residual-stream activation (its sequence shard gathered before
    # a column-parallel projection, a partial sum reduce-scattered after a row-parallel one),
    # loss statistics, or a norm weight's gradient: never a weight, K or V, or a whole
    # weight gradient (the vocab-parallel embedding's included)
    shard = rows * zoo.SEQ * zoo.HIDDEN // 2
    found = _collectives(out)
    forward = [c for c in found if c[0] == "forward"]
    assert [c for c in forward if c[1] == "all_gather_into_tensor"] == \
        [("forward", "all_gather_into_tensor", shard)] * (2 * LAYERS + 1)
    assert [c for c in forward if c[1] == "reduce_scatter_tensor"] == \
        [("forward", "reduce_scatter_tensor", 2 * shard)] * (2 * LAYERS + 1)
    assert all(c[2] <= rows * zoo.SEQ for c in forward if c[1] == "all_reduce")
    for region, name, numel in (c for c in found if c[0] == "backward"):
        assert (name, numel) in {("all_gather_into_tensor", shard), ("reduce_scatter_tensor", 2 * shard),
                                 ("all_reduce", zoo.HIDDEN)}, (region, name, numel)


def test_vocab_parallel_embedding_gradient_is_computed_for_the_rank_s_rows_only(gpt_tp2, llama_tp2):
    # Megatron's: the dense embedding backward runs over vocab / tp rows (ids of other ranks'
    # rows masked out), not over the whole vocabulary to be cut after; the recipe GPT's wte
    # is also its (tied) head, whose gradient adds to it shard to shard
    for out in (gpt_tp2, llama_tp2):
        rows = [n.args[2] for n in out.graph.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
        # (the recipe's learned positions, replicated, have a backward of their own)
        assert [r for r in rows if r in (zoo.VOCAB, zoo.VOCAB // 2)] == [zoo.VOCAB // 2], rows
        assert all(numel < zoo.VOCAB * zoo.HIDDEN for *_, numel in _collectives(out))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_selective_recompute_keeps_gqa_kv_heads_not_their_repeats(attention):
    # Megatron's selective recomputation recomputes the core attention, GQA's repeat of K and V
    # over the query heads included: what stays saved is Q, the kv heads of K and V and the
    # output (Korthikanti's 2 + 4 kv/a + 2 per s b h, the count bench/planner_megatron_memory.py
    # compares with), not one copy of K and V per query head
    from cann_passes.pass_manager import PassManager
    from graph_ir.analysis.memory import saved_activations
    entry = zoo.build("llama", layers=1, num_attention_heads=8, num_key_value_heads=2, attn_implementation=attention)
    optimizer = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    ids = torch.randint(3, zoo.VOCAB, (1, zoo.SEQ), generator=torch.Generator().manual_seed(0))
    graph, _ = capture_train_step(entry.model, optimizer, zoo.hf_loss, {"input_ids": ids, "labels": ids})
    out = PassManager("cleanup,recompute{policy=selective},cleanup", verify_level="deep").run(graph.copy(), PassContext())
    nodes = {n.name: n for n in out.graph.nodes}
    head_dim = zoo.HIDDEN // 8
    kept = sorted(nodes[name].meta["val"].numel() // (zoo.SEQ * head_dim)
                  for name in saved_activations(out.graph)
                  if nodes[name].meta.get("module_path") == "model.layers.0.self_attn")
    # K and V (2 kv heads each), Q and (unless the fused kernel's backward recomputes it) the
    # output (8 heads each); repeated K / V would be two more of 8
    assert kept.count(2) == 2 and kept.count(8) in (1, 2) and len(kept) <= 4, kept


def test_an_attention_no_rule_splits_runs_whole_and_a_whole_gradient_beside_head_shards_is_cut():
    # Rules for the self-attention only: BART's cross-attention runs on whole q, k and v on every
    # rank (a pure op DTensor has no strategy for, all operands replicated); the self-attention's
    # output projection left whole hands its backward a whole gradient, cut to the rank's heads.
    _, graph = _capture("bart")
    out = _run(graph, rules="*.self_attn.q_proj=column;*.self_attn.k_proj=column;*.self_attn.v_proj=column")
    heads = {n.meta.get("module_path"): n.meta["val"][0].shape[1] for n in out.graph.nodes
             if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    assert heads["model.decoder.layers.0.encoder_attn"] == 4 and heads["model.decoder.layers.0.self_attn"] == 2
