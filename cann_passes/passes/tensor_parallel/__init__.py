"""tensor_parallel: Megatron tensor parallelism, by rewriting the whole captured step per rank.

Which parameters are split comes from rules on parameter paths (built in for
the recipe GPT, transformers' GPT-2, LLaMA / Mistral / Qwen2 and BERT, or the
user's own): *column* splits a projection's output features (q/k/v, fc1,
gate/up), *row* its input features (out-proj, fc2, down), *vocab* an
embedding's rows; a fused projection (GPT-2's ``c_attn``, the recipe's
``qkv``) is split per part (``column:3``: each rank holds its heads of q, k
and v). Which dimension of a weight holds the output features is read from
the graph, not from the module's type: a weight the forward transposes
before a matmul (``nn.Linear``) has them in dim 0, one used as it is (GPT-2's
``Conv1D``) in dim 1.

The rewrite re-traces the captured step with every input as a ``DTensor`` on
the tensor-parallel mesh axis: torch's own sharding propagation (the op
strategy registry of ``torch.distributed.tensor``) gives every value's
placement op by op, through forward, backward and the optimizer; a
collective is traced only where an op needs a layout its input does not
have (a partial sum read as a whole: all-reduce; a shard read whole:
all-gather); view and reshape sizes become the local ones (heads, and GQA's
kv heads, split across ranks); the optimizer updates each rank's shard. The
result is an ordinary per-rank aten graph with functional collectives. A few
rules are added where DTensor's are missing or too eager (see
:mod:`.rewriter` and :mod:`.op_rules`): fused projections' per-part shards, elementwise ops on
identically placed operands, attention on head-sharded inputs, one
collective per value and layout (a value read in forward and again in
backward is reduced once), and Megatron's layout for a projection's products
where DTensor's cheapest strategy differs: a weight shard never moves (the
activation is gathered, so GQA's small K and V projections keep their kv
heads) and a weight's gradient is computed as its shard, never as a partial
sum of the whole weight. A vocab-parallel embedding's gradient is computed for
the rank's rows only.

With ``sequence_parallel`` the residual stream between the tensor-parallel
regions is sharded on the sequence dimension (norms and dropout run on
``1/tp`` of the tokens): a partial sum becomes a reduce-scatter and a
column-parallel input an all-gather. With ``vocab_parallel_loss`` the
cross-entropy runs on vocabulary-sharded logits (DTensor's loss-parallel
rules): the logits are never gathered.

Tracing needs a ``DeviceMesh``: in a process with live process groups it is
the tensor-parallel group named by ``ctx.mesh``; otherwise a private "fake"
process group of the same size and rank (nothing is communicated while
tracing). The collectives in the result name the mesh description's group.
"""
from __future__ import annotations

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import is_collective
from graph_ir.meta import region_of
from graph_ir.signature import InputKind

from ...pass_manager import PassContext, register_pass
from .cleanup import finish
from .common import ATTR, TensorParallelError, aten, c10d
from .layouts import ParamLayout, assign_layouts, check_heads
from .marks import mark_local_gradients, record_placements
from .model_rules import BUILTIN_RULES, builtin_rules
from .op_rules import _HEAD_LOCAL_OPS  # noqa: F401  (tests pick the attention kernels out by it)
from .retrace import retrace
from .rules import STYLES, Rule, format_rules, parse_rules
from .tracing_mesh import tracing_mesh

__all__ = ["ATTR", "BUILTIN_RULES", "STYLES", "ParamLayout", "Rule", "TensorParallelError", "aten",
           "assign_layouts", "builtin_rules", "c10d", "count_collectives", "format_rules", "parse_rules",
           "tensor_parallel_pass"]


@register_pass("tensor_parallel", preserves=())
def tensor_parallel_pass(graph: TrainGraph, ctx: PassContext, *, rules: str = "auto", extra_rules: str = "",
                         sequence_parallel: bool = False, vocab_parallel_loss: bool = False) -> TrainGraph:
    """Split parameters over the mesh's ``tp`` axis by path rules; one per-rank graph with collectives.

    ``rules``: ``auto`` (the built-in rules of the model family the parameter names show) or
    ``pattern=style[:parts];...``; ``extra_rules`` are the user's, tried first.
    """
    mesh = getattr(ctx, "mesh", None)
    if mesh is None:
        raise TensorParallelError("pass 'tensor_parallel' needs ctx.mesh (a mesh description with a 'tp' axis)")
    tp = int(mesh.size("tp"))
    if "zero" in graph.attrs or "data_parallel" in graph.attrs:
        raise TensorParallelError("tensor_parallel must run before data_parallel / optimizer_shard "
                                  "(rule: the data-parallel rewrites see the tensor-parallel shards)")
    family, all_rules, user_rules = _choose_rules(graph, rules, extra_rules)
    layouts = assign_layouts(graph, all_rules, tp, user_rules=user_rules)
    if tp == 1:
        return graph
    layouts = check_heads(graph, layouts, tp)
    group_name = mesh.group_name("tp")
    coord = int(mesh.local_rank("tp"))
    with tracing_mesh(group_name, tp, coord, getattr(mesh, "device_type", "cpu")) as device_mesh:
        traced_group = device_mesh.get_group(0).group_name
        gm = retrace(graph, layouts, device_mesh, sequence_parallel=sequence_parallel,
                     vocab_parallel_loss=vocab_parallel_loss)
    finish(gm, graph, traced_group, group_name)
    out = TrainGraph(gm, graph.signature, graph.attrs)
    record_placements(out, graph, layouts)
    mark_local_gradients(out, layouts)
    out.attrs[ATTR] = {
        "tp": tp, "rank": coord, "family": family, "rules": format_rules(all_rules),
        "sequence_parallel": sequence_parallel, "vocab_parallel_loss": vocab_parallel_loss,
        "params": {n: l.to_json() for n, l in layouts.items() if l.dim is not None},
        "replicated_kv_heads": sorted({n.rpartition(".")[0] for n, l in layouts.items() if "replicated" in l.rule})}
    counts = count_collectives(out)
    for (region, name), n in counts.items():
        ctx.stat(f"{region}.{name}", n)
    return out


def _choose_rules(graph: TrainGraph, rules: str, extra_rules: str) -> tuple[str, list[Rule], list[Rule]]:
    """(model family, every rule in the order tried, the rules that must each match a parameter):
    the user's extra rules first, then the built-in family's or the given ones. A rule of a
    built-in table may match nothing (a model without an ``lm_head``); one the user wrote must match."""
    user = parse_rules(extra_rules)
    family, builtin = builtin_rules(s.name for _, s in graph.signature.inputs_of(InputKind.PARAM)) \
        if rules == "auto" else ("user", parse_rules(rules))
    all_rules = user + builtin
    if not all_rules:
        raise TensorParallelError("tensor_parallel: no rule applies (the parameter names match no built-in "
                                  "model family); give rules as pattern=column|row|vocab[:parts]")
    return family, all_rules, user + (builtin if rules != "auto" else [])


def count_collectives(graph: TrainGraph) -> dict[tuple[str, str], int]:
    """(region, collective) -> count, from the graph (wait_tensor not counted)."""
    counts: dict[tuple[str, str], int] = {}
    for node in graph.graph.nodes:
        if is_collective(node):
            key = (str(region_of(node)), node.target._overloadpacket.__name__)
            counts[key] = counts.get(key, 0) + 1
    return counts
