"""The stage graphs: per stage a forward, a backward (and its input / weight halves) and an apply
graph extracted from the whole step, and the flows that hand values between them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.train_graph import lazy_graph_module
from graph_ir.meta import ACCUMULATOR_PREFIX, REGION, GraphAttr, GraphKind, Region, StageValue, region_of
from graph_ir.program import Flow
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature, split_state_name

from .errors import PipelineSplitError
from .nodes import _Nodes


def _free_closure(nodes: _Nodes, wanted) -> set[torch.fx.Node]:
    out, todo = set(), [a for n in wanted for a in n.all_input_nodes if a in nodes.free]
    while todo:
        node = todo.pop()
        if node not in out:
            out.add(node)
            todo.extend(a for a in node.all_input_nodes if a in nodes.free)
    return out


def _extract(nodes: _Nodes, compute: list[torch.fx.Node], cut: list[tuple[Spec, torch.fx.Node]],
             outputs: list[tuple[Spec, object]], attrs: dict) -> TrainGraph:
    """A graph of ``compute`` (plus the free nodes it needs); ``cut`` values become inputs by their spec."""
    source = nodes.graph
    body = set(compute) | _free_closure(nodes, [*compute, *(v for _, v in outputs if isinstance(v, torch.fx.Node))])
    body |= {v for _, v in outputs if isinstance(v, torch.fx.Node) and v in nodes.free}
    cut_of = {node: spec for spec, node in cut}
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[Spec] = []
    needed = {a for n in body for a in n.all_input_nodes} | {v for _, v in outputs if isinstance(v, torch.fx.Node)}
    for node in source.placeholders():
        if node in needed and node not in cut_of:
            env[node] = new.node_copy(node)
            inputs.append(nodes.spec_of[node])
    for spec, node in cut:
        if node in env or node not in needed:
            continue
        placeholder = new.placeholder(f"{spec.kind}_{node.name}")
        placeholder.meta = {"val": node.meta.get("val"), REGION: Region.IO.value}
        env[node] = placeholder
        inputs.append(spec)
    for node in source.graph.nodes:
        if node in body and node not in env:
            missing = [a for a in node.all_input_nodes if a not in env]
            if missing:
                raise PipelineSplitError(f"{attrs[GraphAttr.NAME]}: node {node.name} reads {missing[0].name}, "
                                         "which this stage graph neither computes nor receives")
            env[node] = new.node_copy(node, env.__getitem__)
    new.output([env[v] if isinstance(v, torch.fx.Node) else v for _, v in outputs])
    gm = lazy_graph_module(source.gm, new)
    return TrainGraph(gm, StepSignature(inputs, [s for s, _ in outputs]), attrs)


@dataclass
class _Stage:
    index: int
    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)
    optimizer: list = field(default_factory=list)
    acts_in: list = field(default_factory=list)      # forward values from earlier stages, in order
    grads_in: list = field(default_factory=list)     # backward values from later stages, in order
    saved: list = field(default_factory=list)


def _act(node):
    return Spec(StageValue.ACTIVATION, node.name)


def _grad(node):
    return Spec(StageValue.GRADIENT, node.name)


def _saved(node):
    return Spec(StageValue.SAVED, node.name)


def _inter(node):
    return Spec(StageValue.INTERMEDIATE, node.name)


def _acts_out(stages: list[_Stage], s: int) -> list:
    """The forward values stage ``s`` sends the next stage."""
    return stages[s + 1].acts_in if s + 1 < len(stages) else []


def _stage_nodes(nodes: _Nodes, stage: dict, n: int, imported: frozenset = frozenset()) -> list[_Stage]:
    """Every stage's nodes, the values crossing into it and those its forward saves for its backward.
    ``imported``: (stage, accumulator) pairs of another stage's accumulator that stage's apply reads."""
    stages = [_Stage(i) for i in range(n)]
    fwd, back = set(nodes.forward), set(nodes.backward)
    for node in nodes.forward:
        stages[stage[node]].forward.append(node)
    for node in nodes.backward:
        stages[stage[node]].backward.append(node)
    for node in nodes.optimizer:
        stages[stage[node]].optimizer.append(node)
    for node in nodes.optimizer:
        for a in node.all_input_nodes:
            if a in fwd or (a in back and stage[a] != stage[node] and (stage[node], a) not in imported):
                raise PipelineSplitError(f"optimizer node {node.name} reads {a.name} ({region_of(a).value}, "
                                         f"stage {stage[a]}) (rule: an update reads only accumulated gradients)")
    # Boundaries: a value crosses every cut between where it is made and its last reader.
    opt = set(nodes.optimizer)
    for node in nodes.forward:
        readers = [stage[u] for u in node.users if u in stage and u not in opt]
        for s in range(stage[node] + 1, max(readers, default=stage[node]) + 1):
            stages[s].acts_in.append(node)
    for node in nodes.backward:
        readers = [stage[u] for u in node.users if u in back]
        for s in range(min(readers, default=stage[node]), stage[node]):
            stages[s].grads_in.append(node)
    for st in stages:
        have = set(st.forward) | set(st.acts_in)
        st.saved = [v for v in nodes.forward if v in have and any(u in back and stage[u] == st.index for u in v.users)]
    return stages


def _split_backward(nodes: _Nodes, stage: dict, st: _Stage, grads_out: list) -> tuple[list, list, list]:
    """The stage's backward as (input part, weight part, values the first hands the second): the input
    part computes only what the previous stage waits for."""
    back = set(nodes.backward)
    s = st.index
    mine = set(st.backward)
    needed, todo = set(), [v for v in grads_out if v in mine]
    while todo:
        v = todo.pop()
        if v not in needed:
            needed.add(v)
            todo.extend(a for a in v.all_input_nodes if a in back and stage[a] == s)
    # A multi-output node's parts stay with it: only single tensors are handed on.
    needed |= {u for v in needed if not isinstance(v.meta.get("val"), torch.Tensor) for u in v.users
               if u in back and stage[u] == s}
    b_input = [v for v in st.backward if v in needed]
    b_weight = [v for v in st.backward if v not in needed]
    weight_part = set(b_weight)
    handed = [v for v in b_input if any(u in weight_part for u in v.users)]
    return b_input, b_weight, handed


def _placeholder_outputs(nodes: _Nodes, stage: dict, homes: dict, s: int, n: int) -> list:
    """Outputs that are inputs passed through or free values (a frozen parameter's 'update')."""
    out = []
    for spec, value in nodes.outputs:
        if not isinstance(value, torch.fx.Node) or value in stage:
            continue
        name = spec.name if spec.kind != OutputKind.OPT_STATE else split_state_name(spec.name)[0]
        owner_stage = homes.get(name, n - 1)
        if owner_stage == s:
            out.append((spec, value))
    return out


def _stage_graphs(nodes: _Nodes, stage: dict, homes: dict, stages: list[_Stage], st: _Stage, ranks: list[int],
                  base: dict, extra_cut: list) -> tuple[dict, list, list]:
    """Stage ``st``'s graphs, the values its backward_input hands its backward_weight, and its
    accumulators (as the apply graph reads them)."""
    s, n = st.index, len(stages)
    name = f"stage{s}"
    info = {"index": s, "stages": n, "rank": ranks[s], "first": s == 0, "last": s == n - 1}

    def attrs(kind: GraphKind, part: str):
        return dict(base, **{GraphAttr.NAME: f"{base.get(GraphAttr.NAME, 'step')}.{name}.{part}",
                             GraphAttr.KIND: kind.value, GraphAttr.STAGE: dict(info)})
    fwd, back = set(nodes.forward), set(nodes.backward)
    graphs = {}
    own_out = [(sp, v) for sp, v in nodes.outputs if isinstance(v, torch.fx.Node) and stage.get(v) == s]
    acts_out = _acts_out(stages, s)
    f_outputs = [(_act(v), v) for v in acts_out]
    f_outputs += [(sp, v) for sp, v in own_out if v in fwd]
    f_outputs += [(_saved(v), v) for v in st.saved]
    graphs[f"{name}.forward"] = _extract(nodes, st.forward, [(_act(v), v) for v in st.acts_in], f_outputs,
                                         attrs(GraphKind.STAGE_FORWARD, "forward"))
    grads_out = stages[s - 1].grads_in if s > 0 else []
    b_cut = [(_saved(v), v) for v in st.saved] + [(_grad(v), v) for v in st.grads_in]
    b_state = [(sp, v) for sp, v in own_out if v in back]
    graphs[f"{name}.backward"] = _extract(nodes, st.backward, b_cut,
                                          [(_grad(v), v) for v in grads_out] + b_state,
                                          attrs(GraphKind.STAGE_BACKWARD, "backward"))
    b_input, b_weight, handed = _split_backward(nodes, stage, st, grads_out)
    graphs[f"{name}.backward_input"] = _extract(
        nodes, b_input, b_cut, [(_grad(v), v) for v in grads_out] + [(_inter(v), v) for v in handed],
        attrs(GraphKind.STAGE_BACKWARD_INPUT, "backward_input"))
    graphs[f"{name}.backward_weight"] = _extract(
        nodes, b_weight, b_cut + [(_inter(v), v) for v in handed], b_state,
        attrs(GraphKind.STAGE_BACKWARD_WEIGHT, "backward_weight"))
    acc_cut = [(Spec(InputKind.STEP_STATE, sp.name), v) for sp, v in b_state
               if sp.kind == OutputKind.STEP_STATE and sp.name.startswith(ACCUMULATOR_PREFIX)]
    updates = set(st.optimizer)
    a_outputs = [(sp, v) for sp, v in own_out if v in updates]
    a_outputs += _placeholder_outputs(nodes, stage, homes, s, n)
    graphs[f"{name}.apply"] = _extract(nodes, st.optimizer, acc_cut + extra_cut, a_outputs,
                                       attrs(GraphKind.STAGE_APPLY, "apply"))
    return graphs, handed, acc_cut


def _stage_flows(stages: list[_Stage], st: _Stage, handed: list, acc_cut: list, graphs: dict) -> list[Flow]:
    """What stage ``st``'s graphs hand on, per microbatch (accumulators: per step to apply), except the
    backward gradients to the previous stage (``_gradient_flows``)."""
    s = st.index
    name = f"stage{s}"
    flows = []
    for v in _acts_out(stages, s):
        flows.append(Flow(f"{name}.forward", _act(v), f"stage{s + 1}.forward", _act(v)))
    for part in ("backward", "backward_input", "backward_weight"):
        target = graphs[f"{name}.{part}"]
        for v in st.saved:
            if _saved(v) in target.signature.inputs:
                flows.append(Flow(f"{name}.forward", _saved(v), f"{name}.{part}", _saved(v)))
    for v in handed:
        flows.append(Flow(f"{name}.backward_input", _inter(v), f"{name}.backward_weight", _inter(v)))
    applies = graphs[f"{name}.apply"].signature.inputs
    for spec, _ in acc_cut:
        if spec in applies:   # a tied weight's part another local stage's apply sums is not read here
            flows += _accumulator_flows(s, spec, s)
        out = Spec(OutputKind.STEP_STATE, spec.name)
        for part in ("backward", "backward_weight"):
            flows.append(Flow(f"{name}.{part}", out, f"{name}.{part}", spec))
    return flows


def _accumulator_flows(source: int, spec: Spec, target: int) -> list[Flow]:
    """Stage ``source``'s accumulator ``spec``, written by its backward graphs, to stage ``target``'s apply."""
    out = Spec(OutputKind.STEP_STATE, spec.name)
    return [Flow(f"stage{source}.{part}", out, f"stage{target}.apply", spec) for part in ("backward", "backward_weight")]


def _gradient_flows(stages: list[_Stage], graphs: dict) -> list[Flow]:
    """The backward values each stage sends the one before it (to each of its backward graphs that
    reads them; backward_weight gets them from backward_input's sender)."""
    flows = []
    for st in stages[:-1]:
        s = st.index
        for part, source in (("backward", "backward"), ("backward_input", "backward_input"),
                             ("backward_weight", "backward_input")):
            for v in st.grads_in:
                if _grad(v) in graphs[f"stage{s}.{part}"].signature.inputs:
                    flows.append(Flow(f"stage{s + 1}.{source}", _grad(v), f"stage{s}.{part}", _grad(v)))
    return flows


def _build_stages(nodes: _Nodes, stage: dict, homes: dict, n: int, ranks: list[int],
                  base: dict, extra_cuts: dict | None = None) -> tuple[dict, list, list]:
    """Every stage's graphs and flows; ``extra_cuts``: per stage, the other stages' accumulators its
    apply graph reads (a combination over the stages of one rank)."""
    extra_cuts = extra_cuts or {}
    stages = _stage_nodes(nodes, stage, n, frozenset((s, v) for s, cuts in extra_cuts.items() for _, v in cuts))
    graphs: dict = {}
    flows: list[Flow] = []
    loss_spec = Spec(OutputKind.LOSS, "loss")
    for st in stages:
        own, handed, acc_cut = _stage_graphs(nodes, stage, homes, stages, st, ranks, base,
                                             extra_cuts.get(st.index, []))
        graphs.update(own)
        if st.index == n - 1 and loss_spec not in graphs[f"stage{st.index}.forward"].signature.outputs:
            raise PipelineSplitError("the loss is not computed by the last stage's forward")
        flows += _stage_flows(stages, st, handed, acc_cut, graphs)
    for s, cuts in extra_cuts.items():
        for spec, value in cuts:
            if region_of(value) == Region.OPTIMIZER:   # a tied weight's summed gradient, from its updater
                flows.append(Flow(f"stage{stage[value]}.apply", Spec(OutputKind.STEP_STATE, spec.name),
                                  f"stage{s}.apply", spec))
            else:
                flows += _accumulator_flows(stage[value], spec, s)
    flows += _gradient_flows(stages, graphs)
    covered = {(sp.kind, sp.name) for g in graphs.values() for sp in g.signature.outputs}
    lost = [sp for sp, _ in nodes.outputs if (sp.kind, sp.name) not in covered]
    if lost:
        raise PipelineSplitError(f"no stage graph outputs {lost[0].kind} '{lost[0].name}'")
    return graphs, flows, stages
