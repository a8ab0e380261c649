"""pipeline_split: cut the whole step into pipeline stages, each with forward, backward and apply graphs.

A program pass. It takes the accumulating whole step (``grad_accumulation`` ran:
the optimizer reads ``scale * acc``) and replaces it with, per stage ``s``:

- ``stage<s>.forward``: its parameters, the boundary activations from stage
  ``s-1`` (or only the batch, on the first stage) -> boundary activations for
  stage ``s+1`` (the loss on the last stage) and the values its backward reads;
- ``stage<s>.backward``: saved values + the backward boundary values from stage
  ``s+1`` -> the backward boundary values for stage ``s-1`` and the updated
  gradient accumulators (``acc = acc_in + weight * grad``, per microbatch);
- ``stage<s>.backward_input`` / ``stage<s>.backward_weight``: the same backward,
  split for zero-bubble schedules: the first computes only what stage ``s-1``
  waits for, the second the parameter gradients (from values the first hands it);
- ``stage<s>.apply``: the optimizer update of the stage's parameters, once per step.

Everything is decided from the graph: the forward region in node order is cut
only where few bytes cross (between blocks and between the halves of a block,
wherever the residual stream alone is live; where those leave the stages more
than 5% apart, also inside blocks, each cut priced by its transfer time), giving *units*; each unit is
priced with the cost model (its forward nodes, the backward nodes that belong
to it, its optimizer nodes) and weighed by memory (parameters, gradients,
optimizer state, saved activations); ``cann_passes.stage_balance.balance``
picks the cuts. ``layers=`` (counts per stage) cuts at block boundaries
instead, blocks found by :mod:`graph_ir.analysis.structure`.

Backward nodes belong to a stage by dependence, not by name: a backward node
goes to the lowest stage allowed by what it reads (a parameter pins it to the
parameter's stage, a forward value to a stage no earlier than the value's) and
by who reads it (values flow from later stages to earlier ones in backward);
a node reading only other backward values is placed as late as its inputs
allow, so a residual stream's gradient crosses once, already summed (views
excepted: they stay with their readers). Nodes that
depend only on the batch, hyperparameters, read-only buffers or constants
(masks, positions, rotary tables, ``lr`` arithmetic) are copied into every
graph that needs them instead of being sent. Random ops are never copied.

Where stages meet besides the boundary, the split rewrites the step so that
each stage computes its part and an all-reduce over the pipeline ranks (the
mesh's ``pp`` group, a functional collective in the apply graphs) combines them:

- a weight tied across stages (GPT-2's embedding and head), as Megatron does:
  every stage reading it holds it and accumulates its own part of the
  gradient (its own accumulator, ``<acc>@stage<s>`` off its home stage); each
  of those stages' apply graphs sums the parts and runs the same update;
- an optimizer value combining every stage's (global gradient-norm
  clipping's total norm, a sum or maximum; loss scaling's all-finite flag, a
  logical and): each stage reduces its own terms,
  the all-reduce combines the parts, and each stage computes what follows
  (the clip coefficient) itself.

Tensor parallelism inside stages needs nothing of the split: the stage graphs
keep the rank's tp collectives (never cut between a collective and its wait)
and the boundary values are that rank's pieces.

A tied weight whose stages are some of the pipeline ranks (GPT-2 at pp > 2: the
first and the last) is summed over a process group of just those ranks
(``pp_subgroup_name``, listed in ``attrs['pipeline_parallel']['pp_subgroups']``,
created by the runtime on its members); the ranks between take no part.

Refused, naming the rule: a value combined over every stage (the clip's norm,
loss scaling's overflow flag) when a rank holds several stages (interleaved,
DualPipeV), a tied weight two of whose stages are on one rank (DualPipeV's
first and last), an optimizer value combining stages otherwise than
by a sum, maximum, logical and, 2-norm or sum of squares (ZeRO's shard norms
are one), and more stages than units.

The stage graphs carry ``attrs['stage']`` (index, rank, first/last) and the
program ``attrs['pipeline']`` (stages, stage -> rank, units, cuts, costs); which
rank runs a stage is ``cann_passes.schedules.stage_to_rank`` for the schedule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.cost import node_cost
from graph_ir.analysis.memory import aliases_input
from graph_ir.analysis.structure import find_blocks
from graph_ir.build import add_node
from graph_ir.meta import (ACCUMULATOR_PREFIX, REGION, GraphAttr, GraphKind, Region, StageValue,
                           graph_kind, module_path_of, nbytes, region_of)
from graph_ir.program import EVERY_MICROBATCH, EVERY_STEP, Flow, Program, Run
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature, split_state_name

from ..cost_model import get_profile, node_time
from ..pass_manager import PassContext, register_pass
from ..plan import PlanError

# A position in the forward order is a unit boundary when at most this many times the fewest bytes
# anywhere in the forward cross it (the residual stream, plus small tensors such as a mask). The
# split first uses the residual-only cuts (RESIDUAL_SLACK: between blocks and between a block's
# attention and MLP halves); how many stages a step can have is counted there (about two per
# block). Where those leave the stages unbalanced, CROSSING_SLACK (option cut_slack) admits cuts
# inside an MLP (its 4x hidden beside the residual) and between attention's projections, not across
# attention scores (heads x seq^2); the balancer prices each cut by its transfer time (a message
# per tensor), so a finer cut is taken only where it balances the stages better than it costs.
CROSSING_SLACK = 6.0
RESIDUAL_SLACK = 1.5
REFINE_ABOVE = 1.05   # stage imbalance (max / mean) at residual-only cuts above which finer cuts are tried


class PipelineSplitError(ValueError):
    pass


# -- what each node is --------------------------------------------------------------------------

@dataclass
class _Nodes:
    graph: TrainGraph
    order: dict[torch.fx.Node, int]
    spec_of: dict[torch.fx.Node, Spec]                # placeholder -> its input spec
    owner: dict[torch.fx.Node, str]                   # staged placeholder -> parameter (or buffer) name
    free: set[torch.fx.Node]                          # copied wherever needed
    forward: list[torch.fx.Node]                      # non-free forward computation, in order
    backward: list[torch.fx.Node]
    optimizer: list[torch.fx.Node]
    outputs: list[tuple[Spec, object]] = field(default_factory=list)


def _is_collective(node: torch.fx.Node) -> bool:
    """A functional collective (tensor parallelism's): its result is not ready before its wait_tensor,
    so nothing may cut between the two."""
    return getattr(node.target, "namespace", None) == "_c10d_functional" and node.target.__name__ != "wait_tensor.default"


def _is_random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or node.is_impure()


def _classify(graph: TrainGraph) -> _Nodes:
    placeholders = graph.placeholders()
    spec_of = dict(zip(placeholders, graph.signature.inputs))
    updated_buffers = {s.name for s in graph.signature.outputs if s.kind == OutputKind.BUFFER}
    owner: dict[torch.fx.Node, str] = {}
    for node, spec in spec_of.items():
        if spec.kind == InputKind.PARAM or (spec.kind == InputKind.BUFFER and spec.name in updated_buffers):
            owner[node] = spec.name
        elif spec.kind == InputKind.OPT_STATE:
            owner[node] = split_state_name(spec.name)[0]
        elif spec.kind == InputKind.STEP_STATE and spec.name.startswith(ACCUMULATOR_PREFIX):
            owner[node] = spec.name[len(ACCUMULATOR_PREFIX):]
    free: set[torch.fx.Node] = set()
    forward, backward, optimizer = [], [], []
    order = {}
    for i, node in enumerate(graph.graph.nodes):
        order[node] = i
        if node.op == "get_attr":   # a constant (one the tensor_parallel rewrite traced): copied like one
            free.add(node)
            continue
        if node.op != "call_function":
            continue
        if not _is_random(node) and all(a in free or (a.op == "placeholder" and a not in owner)
                                        for a in node.all_input_nodes):
            free.add(node)
            continue
        {Region.FORWARD: forward, Region.BACKWARD: backward, Region.OPTIMIZER: optimizer}.get(
            region_of(node), forward).append(node)
    nodes = _Nodes(graph, order, spec_of, owner, free, forward, backward, optimizer)
    nodes.outputs = list(zip(graph.signature.outputs, graph.output_values()))
    return nodes


# -- units of the forward -----------------------------------------------------------------------

def _crossing_bytes(nodes: _Nodes, size=nbytes) -> list[int]:
    """crossing[i]: bytes of forward values made before forward position i and read at or after it
    (``size=lambda v: 1``: how many values)."""
    position = {n: i for i, n in enumerate(nodes.forward)}
    diff = [0] * (len(nodes.forward) + 2)
    for i, node in enumerate(nodes.forward):
        last = max((position[u] for u in node.users if u in position), default=i)
        if last > i and not aliases_input(node):
            diff[i + 1] += size(node.meta.get("val"))
            diff[last + 1] -= size(node.meta.get("val"))
    crossing, running = [], 0
    for i in range(len(nodes.forward)):
        running += diff[i]
        crossing.append(running)
    return crossing


def _unit_starts(nodes: _Nodes, slack: float = CROSSING_SLACK) -> list[int]:
    """Forward positions where a unit starts (0 first): where at most ``slack`` x the fewest bytes cross."""
    crossing = _crossing_bytes(nodes)
    # A view crossing a cut is sent as its own tensor (counting its base alone would hide that), and a
    # multi-output node cannot cross at all: only single tensors are sent or saved.
    position = {n: i for i, n in enumerate(nodes.forward)}
    marks = [0] * (len(nodes.forward) + 2)
    for i, node in enumerate(nodes.forward):
        if aliases_input(node) or not isinstance(node.meta.get("val"), torch.Tensor) or _is_collective(node):
            last = max((position[u] for u in node.users if u in position), default=i)
            if last > i:
                marks[i + 1] += 1
                marks[last + 1] -= 1
    view_cross, open_spans = [], 0
    for i in range(len(nodes.forward)):
        open_spans += marks[i]
        view_cross.append(open_spans > 0)
    # The floor is taken where real work lies on both sides (not after the loss's last reduction,
    # where only a scalar is left), and a unit must hold some arithmetic of its own.
    flops = [node_cost(n).flops for n in nodes.forward]
    total = sum(flops) or 1
    before, running = [], 0
    for f in flops:
        before.append(running)
        running += f
    interior = [crossing[i] for i in range(1, len(crossing))
                if crossing[i] > 0 and 0.02 * total <= before[i] <= 0.98 * total]
    if not interior:
        return [0]
    limit = slack * min(interior)
    starts = [0]
    for i in range(1, len(crossing)):
        if 0 < crossing[i] <= limit and not view_cross[i] and before[i] > before[starts[-1]]:
            starts.append(i)
    if len(starts) > 1 and before[starts[-1]] == total:   # the last unit would hold no arithmetic
        starts.pop()
    return starts


# -- stage of every node ------------------------------------------------------------------------

def _homes(nodes: _Nodes, fstage: dict[torch.fx.Node, int], last: int,
           strict: bool) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Parameter (and updated buffer) name -> the stage whose forward reads it first (its home), and
    the parameters read by the forward of several stages (tied weights) -> those stages."""
    readers: dict[str, set[int]] = {}
    for node, name in nodes.owner.items():
        stages = {fstage[u] for u in node.users if u in fstage}
        readers.setdefault(name, set()).update(stages)
    params = {spec.name for spec in nodes.spec_of.values() if spec.kind == InputKind.PARAM}
    homes, shared = {}, {}
    for name, stages in readers.items():
        if len(stages) > 1 and strict:
            if name not in params:
                raise PlanError("pp", f"buffer '{name}' is updated by the step and read by the forward of stages "
                                      f"{sorted(stages)} (rule: a buffer the step updates lives on one stage; cut "
                                      "so that its uses fall in one stage)")
            shared[name] = sorted(stages)
        homes[name] = min(stages) if stages else last
    return homes, shared


def _assign(nodes: _Nodes, fstage: dict[torch.fx.Node, int], n_stages: int,
            strict: bool = True) -> tuple[dict, dict, dict, list]:
    """The stage of every non-free node (forward given), each parameter's home, the parameters several
    stages read (tied weights: each of those stages holds them) and the optimizer nodes that combine
    values of several stages (placed on the last of them for now; ``_reduce_over_stages`` rewrites
    them). Not ``strict`` (pricing units): a parameter read by several units counts in the first."""
    homes, shared = _homes(nodes, fstage, n_stages - 1, strict)
    # A tied weight read in backward (the head's input gradient) says nothing about the stage: each
    # stage holding it reads its own copy.
    tied = {node for node, name in nodes.owner.items()
            if name in shared and nodes.spec_of[node].kind == InputKind.PARAM}
    stage = dict(fstage)
    out_home: dict[torch.fx.Node, set[int]] = {}
    for spec, value in nodes.outputs:
        if isinstance(value, torch.fx.Node) and spec.kind in (OutputKind.PARAM, OutputKind.OPT_STATE,
                                                               OutputKind.STEP_STATE, OutputKind.BUFFER):
            name = spec.name
            if spec.kind == OutputKind.OPT_STATE:
                name = split_state_name(name)[0]
            elif spec.kind == OutputKind.STEP_STATE:
                if not name.startswith(ACCUMULATOR_PREFIX):
                    continue
                name = name[len(ACCUMULATOR_PREFIX):]
            if name in homes:
                out_home.setdefault(value, set()).add(homes[name])
    # Optimizer nodes: the stage of the state they read and of the outputs they feed.
    opt = set(nodes.optimizer)
    up: dict[torch.fx.Node, set[int]] = {}
    for node in nodes.optimizer:
        s = set()
        for a in node.all_input_nodes:
            if a in nodes.owner:
                s.add(homes[nodes.owner[a]])
            elif a in opt:
                s |= up[a]
            elif a in out_home:   # an accumulated gradient: its parameter's stage
                s |= out_home[a]
        up[node] = s
    down: dict[torch.fx.Node, set[int]] = {}
    for node in reversed(nodes.optimizer):
        s = set(out_home.get(node, ()))
        for u in node.users:
            if u in opt:
                s |= down[u]
        down[node] = s
    mixed = []
    for node in nodes.optimizer:
        stages = up[node] | down[node]
        if len(stages) > 1:
            mixed.append(node)
        # What a node reads decides first: a gradient feeding a norm over every stage stays with its own.
        stage[node] = max(up[node] or down[node] or {n_stages - 1})
    # Backward, lower bounds from readers and reads (users first).
    back = set(nodes.backward)
    low: dict[torch.fx.Node, int] = {}
    pinned: set[torch.fx.Node] = set()
    for node in reversed(nodes.backward):
        bound = max(out_home.get(node, {0}))
        for u in node.users:
            if u in back:
                bound = max(bound, low[u])
            elif u in stage:
                bound = max(bound, stage[u])
        for a in node.all_input_nodes:
            if a in tied:
                continue
            if a in nodes.owner:
                bound = max(bound, homes[nodes.owner[a]])
                pinned.add(node)
            elif a in fstage:
                bound = max(bound, fstage[a])
                pinned.add(node)
        low[node] = bound
    for node in nodes.backward:
        preds = [stage[a] for a in node.all_input_nodes if a in back]
        # A view costs nothing and crossing it would send its base again: it stays with its readers.
        late = preds and node not in pinned and not aliases_input(node)
        stage[node] = max(low[node], min(preds)) if late else low[node]
    for node in nodes.backward if strict else ():
        for a in node.all_input_nodes:
            if a in nodes.owner and a not in tied and homes[nodes.owner[a]] != stage[node]:
                raise PipelineSplitError(
                    f"backward node {node.name} ({node.target}) reads '{nodes.owner[a]}' of stage "
                    f"{homes[nodes.owner[a]]} but its gradient flow puts it in stage {stage[node]}")
    return stage, homes, shared, mixed


# -- costs of units -----------------------------------------------------------------------------

@dataclass
class UnitCosts:
    seconds: list[float]          # forward + backward + optimizer, per unit
    forward_seconds: list[float]
    static_bytes: list[int]       # parameters, gradient accumulators, optimizer state
    activation_bytes: list[int]   # saved for backward, per microbatch in flight
    cut_seconds: list[float] | None = None   # a cut just before the unit: its transfers (stage_balance)


def _unit_costs(nodes: _Nodes, starts: list[int], profile) -> UnitCosts:
    n = len(starts)
    fstage = _forward_stages(nodes, starts)
    stage, homes, _, _ = _assign(nodes, fstage, n, strict=False)
    seconds, fwd = [0.0] * n, [0.0] * n
    for node in (*nodes.forward, *nodes.backward, *nodes.optimizer):
        t = node_time(node, profile)
        seconds[stage[node]] += t
        if node in fstage:
            fwd[stage[node]] += t
    static = [0] * n
    for node, name in nodes.owner.items():
        static[homes[name]] += nbytes(node.meta.get("val"))
    saved = [0] * n
    back = set(nodes.backward)
    for node in nodes.forward:
        readers = {stage[u] for u in node.users if u in back}
        if readers and not aliases_input(node):
            saved[max(readers)] += nbytes(node.meta.get("val"))
    return UnitCosts(seconds, fwd, static, saved)


def _forward_stages(nodes: _Nodes, starts: list[int]) -> dict[torch.fx.Node, int]:
    stage, s = {}, 0
    bounds = list(starts[1:]) + [len(nodes.forward)]
    for i, node in enumerate(nodes.forward):
        while i >= bounds[s]:
            s += 1
        stage[node] = s
    return stage


def _balance(costs: UnitCosts, n_stages: int, in_flight: list[int] | None, *, schedule: str, pp: int,
             microbatches: int, memory_limit: float | None):
    """The cuts: least largest stage cost, each stage's static bytes + in-flight activations within
    the device's memory (in flight: how many microbatches the schedule keeps alive on each stage)."""
    from .. import stage_balance
    if in_flight is None and schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "dualpipev"):
        try:
            in_flight = stage_balance.in_flight_for(schedule, pp, microbatches, n_stages // pp)[:n_stages]
        except ValueError:   # sizes the schedule refuses: the plan's own check names them
            in_flight = None
    if in_flight is not None and len(in_flight) != n_stages:
        in_flight = None
    return stage_balance.balance(costs.seconds, n_stages, unit_static_bytes=costs.static_bytes,
                                 unit_activation_bytes=costs.activation_bytes, in_flight=in_flight,
                                 memory_limit=memory_limit, cut_seconds=costs.cut_seconds)


def _layer_starts(nodes: _Nodes, units: list[int], layers: list[int]) -> list[int]:
    """Unit indices where each stage starts when stage ``s`` holds ``layers[s]`` blocks."""
    structure = find_blocks(nodes.graph.graph)
    blocks = structure.blocks
    if sum(layers) != len(blocks):
        raise PlanError("pipeline_split", f"the layer counts {layers} sum to {sum(layers)}, but the model has "
                                          f"{len(blocks)} blocks (rule: counts per stage that sum to the "
                                          "number of blocks)", layers)
    first_at: dict[str, int] = {}
    for i, node in enumerate(nodes.forward):
        block = structure.block_of(module_path_of(node))
        if block:
            first_at.setdefault(block, i)
    starts, taken = [0], 0
    for count in layers[:-1]:
        taken += count
        position = first_at[blocks[taken]]
        # The last unit boundary at or before the block's first node.
        unit = max(k for k, start in enumerate(units) if start <= position)
        if unit <= starts[-1]:
            raise PlanError("pipeline_split", f"stage {len(starts)} would be empty: no cut point between "
                                              f"blocks {blocks[taken - count]} and {blocks[taken]}", layers)
        starts.append(unit)
    return starts


# -- where stages meet besides the boundary: tied weights, values reduced over every stage ---------

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
TIED_SUFFIX = "@stage"   # accumulator of a tied weight's partial gradient on a stage other than its home
# "and": loss_scale's all-finite flag (a bool), all-reduced as 0/1 floats by their minimum.
_REDUCTIONS = {aten.add.Tensor: "sum", aten.maximum.default: "max", aten.logical_and.default: "and"}


class _Rewriter:
    """Adds nodes to the step being split, keeping the split's bookkeeping (stage, node lists) in step."""

    def __init__(self, nodes: _Nodes, stage: dict, group: str):
        self.nodes, self.stage, self.group = nodes, stage, group
        self.graph = nodes.graph.graph
        self.mode = nodes.graph.fake_mode()

    def emit(self, before: torch.fx.Node, s: int, region: Region, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(before):
            node = add_node(self.graph, target, args, kwargs, region=region, module_path="",
                            origin="pipeline_split", mode=self.mode)
        self.stage[node] = s
        (self.nodes.backward if region == Region.BACKWARD else self.nodes.optimizer).append(node)
        return node

    def all_reduce(self, before: torch.fx.Node, s: int, value: torch.fx.Node, op: str,
                   group: str | None = None) -> torch.fx.Node:
        reduced = self.emit(before, s, Region.OPTIMIZER, c10d.all_reduce.default, value, op, group or self.group)
        return self.emit(before, s, Region.OPTIMIZER, c10d.wait_tensor.default, reduced)

    def copy(self, node: torch.fx.Node, s: int, env: dict) -> torch.fx.Node:
        with self.graph.inserting_before(node):
            new = self.graph.node_copy(node, lambda a: env.get(a, a))
        self.stage[new] = s
        self.nodes.optimizer.append(new)
        return new

    def drop(self, dead: set[torch.fx.Node]) -> None:
        """Nodes no stage graph computes any more (left in the source graph, which is replaced)."""
        self.nodes.backward = [n for n in self.nodes.backward if n not in dead]
        self.nodes.optimizer = [n for n in self.nodes.optimizer if n not in dead]
        for node in dead:
            self.stage.pop(node, None)


def _sum_tree(root: torch.fx.Node, op) -> tuple[list, set]:
    """The terms of ``root`` as a tree of ``op`` (add / maximum) nodes, each read only by the tree."""
    leaves, tree, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        inner = (node.op == "call_function" and node.target == op and not node.kwargs and len(node.args) == 2
                 and all(isinstance(a, torch.fx.Node) for a in node.args)
                 and (node is root or len(node.users) == 1))
        if inner:
            tree.add(node)
            todo.extend(reversed(node.args))
        else:
            leaves.append(node)
    return leaves, tree


def _accumulation(acc: torch.fx.Node):
    """``acc = acc_in + grad * weight`` (grad_accumulation's update): (acc_in, the mul node, grad)."""
    if acc.target != aten.add.Tensor or len(acc.args) != 2:
        return None
    acc_in, scaled = acc.args
    if getattr(scaled, "op", None) == "placeholder":
        acc_in, scaled = scaled, acc_in
    if getattr(acc_in, "op", None) != "placeholder" or getattr(scaled, "target", None) != aten.mul.Tensor:
        return None
    grad = next((a for a in scaled.args if isinstance(a, torch.fx.Node) and a.op != "placeholder"), None)
    return (acc_in, scaled, grad) if grad is not None else None


def _state_owner(spec: Spec) -> str | None:
    if spec.kind == OutputKind.PARAM:
        return spec.name
    if spec.kind == OutputKind.OPT_STATE:
        return split_state_name(spec.name)[0]
    return None


def _split_tied_gradients(rw: _Rewriter, homes: dict, shared: dict, group_of) -> dict[str, dict]:
    """Megatron's tied weights: every stage reading a weight holds it and accumulates its own partial
    gradient (its own accumulator); each apply graph sums the partials with an all-reduce over the
    stages holding it (``group_of(name, holders)``: the pp group, or the group of just their pipeline
    ranks) and runs the same update. Returns parameter -> {holders, per-stage accumulators}."""
    nodes, stage = rw.nodes, rw.stage
    values = {(sp.kind, sp.name): v for sp, v in nodes.outputs}
    opt = set(nodes.optimizer)
    step_state = nodes.graph.attrs.setdefault(GraphAttr.STEP_STATE, {})
    tied = {}
    for name, readers in shared.items():
        home = homes[name]
        acc = values.get((OutputKind.STEP_STATE, ACCUMULATOR_PREFIX + name))
        if acc is None:   # frozen: read by each stage, updated by none
            tied[name] = {"holders": list(readers), "acc": {}}
            continue
        found = _accumulation(acc)
        if found is None:
            raise PipelineSplitError(f"tied parameter '{name}': its accumulator update {acc.name} is not "
                                     "acc + grad * weight (rule: run grad_accumulation before pipeline_split)")
        acc_in, scaled, grad = found
        if len(grad.users) != 1:
            raise PipelineSplitError(f"tied parameter '{name}': its gradient {grad.name} is read by more than its "
                                     "accumulator (rule: a tied weight's gradient is split into per-stage parts)")
        weight = next(a for a in scaled.args if a is not grad)
        leaves, tree = _sum_tree(grad, aten.add.Tensor)
        by_stage: dict[int, list] = {}
        for leaf in leaves:
            # A view of a term (the head's transposed weight gradient) was placed with its reader, the
            # sum: it goes back to the stage that made its base.
            views, base = [], leaf
            while aliases_input(base) and base.all_input_nodes and base.all_input_nodes[0] in stage:
                views.append(base)
                base = base.all_input_nodes[0]
            where = stage.get(base, home)
            for view in views:
                stage[view] = where
            by_stage.setdefault(where, []).append(leaf)
        holders = sorted(set(readers) | set(by_stage))
        if home not in by_stage:
            raise PipelineSplitError(f"tied parameter '{name}': no part of its gradient is computed by its "
                                     f"home stage {home}")
        accs = {home: (acc_in, acc)}
        for s in holders:
            terms = by_stage.get(s, [])
            partial = terms[0] if terms else None
            for term in terms[1:]:
                partial = rw.emit(scaled, s, Region.BACKWARD, aten.add.Tensor, partial, term)
            if s == home:
                scaled.replace_input_with(grad, partial)
                continue
            state = f"{ACCUMULATOR_PREFIX}{name}{TIED_SUFFIX}{s}"
            with rw.graph.inserting_after(acc_in):
                placeholder = rw.graph.placeholder(re.sub(r"\W", "_", f"step_state_{state}"))
            placeholder.meta = dict(acc_in.meta)
            nodes.spec_of[placeholder] = Spec(InputKind.STEP_STATE, state)
            nodes.owner[placeholder] = name
            step_state[state] = dict(step_state[ACCUMULATOR_PREFIX + name])
            if partial is None:   # nothing to add on this stage: the apply reads the zeros it starts from
                accs[s] = (placeholder, placeholder)
                continue
            new = rw.emit(scaled, s, Region.BACKWARD, aten.add.Tensor, placeholder,
                          rw.emit(scaled, s, Region.BACKWARD, aten.mul.Tensor, partial, weight))
            nodes.outputs.append((Spec(OutputKind.STEP_STATE, state), new))
            accs[s] = (placeholder, new)
        rw.drop(tree - set(leaves))
        readers_of_acc = [u for u in acc.users if u in opt]
        if not readers_of_acc:
            raise PipelineSplitError(f"tied parameter '{name}': its update reads no accumulated gradient")
        first = min(readers_of_acc, key=lambda u: nodes.order.get(u, 1 << 60))
        summed = rw.all_reduce(first, home, acc, "sum", group_of(name, holders))
        for user in readers_of_acc:
            user.replace_input_with(acc, summed)
        tied[name] = {"holders": holders, "acc": accs}
    return tied


def _copy_tied_updates(rw: _Rewriter, homes: dict, tied: dict, replica: dict) -> None:
    """Each stage holding a tied weight (besides its home) gets the home's update of it, reading its own
    accumulator (summed over the holders) and its own copies of values reduced over the stages."""
    nodes, stage = rw.nodes, rw.stage
    opt = set(nodes.optimizer)
    twin = {copy: (orig, s) for (orig, s), copy in replica.items()}
    for name, info in tied.items():
        home = homes[name]
        if not info["acc"]:
            continue
        acc = info["acc"][home][1]
        own_values = {acc} | {ph for ph, owner in nodes.owner.items() if owner == name}
        # The update of this weight alone: optimizer nodes of its home reading only its values, what
        # they make, free values and values reduced over the stages (which every stage has).
        update, mine = [], set()
        for node in rw.graph.nodes:
            if node not in opt or stage.get(node) != home or node in twin:
                continue
            reads = node.all_input_nodes
            if any(a in own_values or a in mine for a in reads) and all(
                    a in own_values or a in mine or a in twin or a in nodes.free
                    or (a.op in ("placeholder", "get_attr") and a not in nodes.owner) for a in reads):
                update.append(node)
                mine.add(node)
        for s in info["holders"]:
            if s == home:
                continue
            env = {acc: info["acc"][s][1]}
            for node in update:
                for a in node.all_input_nodes:
                    if a in twin:
                        env[a] = replica[(twin[a][0], s)]
                env[node] = rw.copy(node, s, env)
            nodes.outputs += [(spec, env[v]) for spec, v in list(nodes.outputs)
                              if v in mine and _state_owner(spec) == name]
        missed = [spec.name for spec, v in nodes.outputs if _state_owner(spec) == name and v in opt and v not in mine
                  and stage.get(v) == home]
        if missed:
            raise PipelineSplitError(f"tied parameter '{name}': the update of {missed[0]} reads values of its "
                                     f"stage {home} other than its own (rule: a tied weight's update is copied to "
                                     "every stage holding it)")


def _reduce_over_stages(rw: _Rewriter, homes: dict, n_stages: int) -> tuple[dict, list[str]]:
    """Optimizer values that combine every stage's (global gradient-norm clipping's total norm): each
    stage computes its part, an all-reduce over the pipeline ranks combines the parts, and every stage
    computes what follows from the total itself. Returns (original node, stage) -> that stage's copy."""
    nodes, stage = rw.nodes, rw.stage
    opt = set(nodes.optimizer)
    up: dict[torch.fx.Node, set] = {}
    for node in rw.graph.nodes:
        if node not in opt:
            continue
        s = set()
        for a in node.all_input_nodes:
            if a in nodes.owner:
                s.add(homes[nodes.owner[a]])
            elif a in opt:
                s |= up[a]
            elif a in stage:
                s.add(stage[a])
        up[node] = s
    mixed = [n for n in rw.graph.nodes if n in opt and len(up[n]) > 1]
    replica: dict = {}
    if not mixed:
        return replica, []
    mixed_set = set(mixed)
    reduced: list[str] = []
    done: set[torch.fx.Node] = set()
    replicated: set[torch.fx.Node] = set()
    own: dict[torch.fx.Node, int] = {}

    def refuse(node):
        raise PlanError("pp", f"optimizer node {node.name} ({node.target}) combines values of stages "
                              f"{sorted(up[node])} (rule: a value combining stages must be a sum, a maximum, "
                              "a logical and, a 2-norm or a sum of squares of values each stage has, such as "
                              "global gradient-norm clipping's total norm or loss scaling's overflow check)")

    for node in mixed:
        if node in done:
            continue
        if not any(a in mixed_set for a in node.all_input_nodes):
            # Where stages first meet: the combination itself.
            if node.target == aten.stack.default and len(node.users) == 1:
                (root,) = node.users
                leaves, tree = list(node.args[0]), {node}
                if root.target == aten.mul.Tensor and root.args == (node, node) and len(root.users) == 1 \
                        and next(iter(root.users)).target == aten.sum.default:
                    # Sum of squares (of sharded gradients' norms, all-reduced over their axis next).
                    tree.add(root)
                    root = next(iter(root.users))
                    kind = "sumsq"
                elif root.target == aten.linalg_vector_norm.default and list(root.args[1:2]) in ([], [2.0], [2]) \
                        and not root.args[2:] and not root.kwargs:
                    kind = "norm"
                elif root.target == aten.sum.default and not root.args[1:] and not root.kwargs:
                    kind = "stacked_sum"
                else:
                    refuse(node)
            elif node.target in _REDUCTIONS:
                root = node
                while (len(root.users) == 1 and next(iter(root.users)).target == node.target
                       and next(iter(root.users)) in mixed_set):
                    root = next(iter(root.users))
                kind = _REDUCTIONS[node.target]
                leaves, tree = _sum_tree(root, node.target)
            else:
                refuse(node)
            by_stage: dict[int, list] = {}
            for leaf in leaves:
                where = up.get(leaf) or ({stage[leaf]} if leaf in stage else {0})
                if len(where) > 1:
                    refuse(node)
                by_stage.setdefault(min(where), []).append(leaf)
            anchor = root   # after every term
            like = root.meta["val"]
            for s in range(n_stages):
                terms = by_stage.get(s, [])
                if kind in ("norm", "sumsq", "stacked_sum"):
                    if terms:
                        stacked = rw.emit(anchor, s, Region.OPTIMIZER, aten.stack.default, terms)
                        if kind != "stacked_sum":
                            stacked = rw.emit(anchor, s, Region.OPTIMIZER, aten.mul.Tensor, stacked, stacked)
                        part = rw.emit(anchor, s, Region.OPTIMIZER, aten.sum.default, stacked)
                    else:
                        part = rw.emit(anchor, s, Region.OPTIMIZER, aten.zeros.default, [], dtype=like.dtype,
                                       device=like.device)
                    total = rw.all_reduce(anchor, s, part, "sum")
                    if kind == "norm":
                        total = rw.emit(anchor, s, Region.OPTIMIZER, aten.sqrt.default, total)
                else:
                    part = terms[0] if terms else None
                    for term in terms[1:]:
                        part = rw.emit(anchor, s, Region.OPTIMIZER, root.target, part, term)
                    if kind == "and":
                        if part is None:
                            part = rw.emit(anchor, s, Region.OPTIMIZER, aten.ones.default, [], dtype=torch.float32,
                                           device=like.device)
                        else:
                            part = rw.emit(anchor, s, Region.OPTIMIZER, aten._to_copy.default, part,
                                           dtype=torch.float32)
                        total = rw.emit(anchor, s, Region.OPTIMIZER, aten.gt.Scalar,
                                        rw.all_reduce(anchor, s, part, "min"), 0.5)
                        replica[(root, s)] = total
                        continue
                    if part is None:
                        fill = 0.0 if kind == "sum" else float("-inf")
                        part = rw.emit(anchor, s, Region.OPTIMIZER, aten.full.default, [], fill, dtype=like.dtype,
                                       device=like.device)
                    total = rw.all_reduce(anchor, s, part, kind)
                replica[(root, s)] = total
            reduced.append(f"{root.name} ({kind})")
            replicated.add(root)
            done |= tree | {root}
            continue
        # After the combination: a value every stage computes from the total alone, or one stage's own
        # value (a parameter's clipped gradient) that reads the total.
        others = set()
        for a in node.all_input_nodes:
            if a in replicated:
                continue
            others |= {own[a]} if a in own else up.get(a) or ({stage[a]} if a in stage else set())
        if len(others) > 1:
            refuse(node)
        if others:
            (t,) = others
            for a in [a for a in node.all_input_nodes if a in replicated]:
                node.replace_input_with(a, replica[(a, t)])
            stage[node] = own[node] = t
        else:
            for s in range(n_stages):
                replica[(node, s)] = rw.copy(node, s, {a: replica[(a, s)] for a in node.all_input_nodes
                                                        if a in replicated})
            replicated.add(node)
        done.add(node)
    # Outputs of replicated values (the norm as a metric): every stage reports its own copy.
    outputs = []
    for spec, value in nodes.outputs:
        if value in replicated:
            outputs += [(spec, replica[(value, s)]) for s in range(n_stages)]
        else:
            outputs.append((spec, value))
    nodes.outputs = outputs
    rw.drop({n for n in done if n not in own})
    return replica, reduced


def _metrics_behind(nodes: _Nodes, node: torch.fx.Node) -> str:
    """' (behind metric 'loss_scale:found_inf')': the metrics computed from ``node``, to name what a
    user asked for (clipping's norm, loss scaling's overflow flag) rather than a node."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    names = sorted({spec.name for spec, value in nodes.outputs
                    if spec.kind == OutputKind.METRIC and value in seen})
    return f" (behind metric {', '.join(repr(n) for n in names)})" if names else ""


def pp_subgroup_name(pp_group: str, pp_ranks) -> str:
    """The name of the process group of the pipeline ranks ``pp_ranks`` within this rank's pp group
    (the runtime creates and registers it under this name: ``runtime.pipeline.make_pp_subgroups``)."""
    return f"{pp_group}.pp{'_'.join(str(r) for r in pp_ranks)}"


def _share_across_stages(nodes: _Nodes, stage: dict, homes: dict, shared: dict, mixed: list, ranks: list[int],
                         n_stages: int, pp: int, schedule: str, ctx, program) -> tuple[dict, list[str], dict]:
    """Tied weights and values combined over every stage, rewritten into per-stage parts whose
    all-reduce runs over the pipeline ranks (the mesh's ``pp`` group; a tied weight whose stages
    are some of them, over a group of just those: returned as name -> their pp ranks)."""
    if not shared and not mixed:
        return {}, [], {}
    what = (f"parameter '{next(iter(shared))}' (read by the forward of stages {next(iter(shared.values()))})"
            if shared else f"optimizer node {mixed[0].name}{_metrics_behind(nodes, mixed[0])}, which combines "
                           "values of several stages")
    field = "pipeline_schedule" if schedule in ("dualpipev", "zbv") else "pipeline_virtual_stages"
    value = schedule if field == "pipeline_schedule" else n_stages // pp
    if mixed and len(set(ranks)) != n_stages:
        # Each stage's apply graph would all-reduce its own part: a rank holding two stages would
        # join two all-reduces, each summing a different set of stages, neither the total.
        what = f"optimizer node {mixed[0].name}{_metrics_behind(nodes, mixed[0])}, which combines values of every stage,"
        raise PlanError(field, f"{what} needs an all-reduce over the stages, and schedule '{schedule}' puts "
                               f"several stages on one pipeline rank (rule: global gradient clipping and loss "
                               "scaling's overflow check need one stage per pipeline rank)", value)
    mesh = getattr(ctx, "mesh", None) or program.mesh
    if mesh is None or "pp" not in mesh.axes or mesh.size("pp") != pp:
        raise PipelineSplitError(f"{what} needs the mesh's pp axis of {pp} ranks to name its all-reduce's group")
    pp_group = mesh.group_name("pp")
    subgroups: dict[str, list[int]] = {}

    def group_of(name: str, holders) -> str:
        # GPT-2's embedding at pp > 2: the first and last ranks sum their parts; the ranks between
        # (which do not hold it) take no part, so the group is just the holders' (Megatron's
        # embedding group), made by the runtime under this name on every member. Interleaved
        # stages keep the first and the last stage on different ranks; DualPipeV puts both on rank 0.
        pp_ranks = sorted(ranks[s] for s in holders)
        if len(set(pp_ranks)) != len(pp_ranks):
            raise PlanError(field, f"parameter '{name}' is tied across stages {holders}, which schedule "
                                   f"'{schedule}' puts on pipeline ranks {[ranks[s] for s in holders]} (rule: the "
                                   "stages holding a tied weight are on different pipeline ranks, each summing "
                                   "its part once)", value)
        if pp_ranks == list(range(pp)):
            return pp_group
        name = pp_subgroup_name(pp_group, pp_ranks)
        subgroups[name] = pp_ranks
        return name
    rw = _Rewriter(nodes, stage, pp_group)
    tied = _split_tied_gradients(rw, homes, shared, group_of)
    replica, reduced = _reduce_over_stages(rw, homes, n_stages)
    _copy_tied_updates(rw, homes, tied, replica)
    return tied, reduced, subgroups


# -- building the stage graphs ------------------------------------------------------------------

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
    gm = torch.fx.GraphModule(source.gm, new)
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


def _build_stages(nodes: _Nodes, stage: dict, homes: dict, n: int, ranks: list[int],
                  base: dict) -> tuple[dict, list, list]:
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
            if a in fwd or (a in back and stage[a] != stage[node]):
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
    graphs: dict = {}
    flows: list[Flow] = []
    loss_spec = Spec(OutputKind.LOSS, "loss")
    for st in stages:
        s = st.index
        name = f"stage{s}"
        info = {"index": s, "stages": n, "rank": ranks[s], "first": s == 0, "last": s == n - 1}

        def attrs(kind: GraphKind, part: str):
            return dict(base, **{GraphAttr.NAME: f"{base.get(GraphAttr.NAME, 'step')}.{name}.{part}",
                                 GraphAttr.KIND: kind.value, GraphAttr.STAGE: dict(info)})
        own_out = [(sp, v) for sp, v in nodes.outputs if isinstance(v, torch.fx.Node) and stage.get(v) == s]
        acts_out = stages[s + 1].acts_in if s + 1 < n else []
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
        # Input-gradient part: what the previous stage waits for; the rest is the weight part.
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
        graphs[f"{name}.apply"] = _extract(nodes, st.optimizer, acc_cut, a_outputs,
                                           attrs(GraphKind.STAGE_APPLY, "apply"))
        if s == n - 1 and loss_spec not in graphs[f"{name}.forward"].signature.outputs:
            raise PipelineSplitError("the loss is not computed by the last stage's forward")
        # Flows: what each graph hands to another, per microbatch (accumulators: per step to apply).
        for v in acts_out:
            flows.append(Flow(f"{name}.forward", _act(v), f"stage{s + 1}.forward", _act(v)))
        for part in ("backward", "backward_input", "backward_weight"):
            target = graphs[f"{name}.{part}"]
            for v in st.saved:
                if _saved(v) in target.signature.inputs:
                    flows.append(Flow(f"{name}.forward", _saved(v), f"{name}.{part}", _saved(v)))
        for v in handed:
            flows.append(Flow(f"{name}.backward_input", _inter(v), f"{name}.backward_weight", _inter(v)))
        for spec, _ in acc_cut:
            out = Spec(OutputKind.STEP_STATE, spec.name)
            for part in ("backward", "backward_weight"):
                flows.append(Flow(f"{name}.{part}", out, f"{name}.apply", spec))
                flows.append(Flow(f"{name}.{part}", out, f"{name}.{part}", spec))
    for st in stages[:-1]:
        s = st.index
        for part, source in (("backward", "backward"), ("backward_input", "backward_input"),
                             ("backward_weight", "backward_input")):
            for v in st.grads_in:
                if _grad(v) in graphs[f"stage{s}.{part}"].signature.inputs:
                    flows.append(Flow(f"stage{s + 1}.{source}", _grad(v), f"stage{s}.{part}", _grad(v)))
    covered = {(sp.kind, sp.name) for g in graphs.values() for sp in g.signature.outputs}
    lost = [sp for sp, _ in nodes.outputs if (sp.kind, sp.name) not in covered]
    if lost:
        raise PipelineSplitError(f"no stage graph outputs {lost[0].kind} '{lost[0].name}'")
    return graphs, flows, stages


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


# -- the pass -----------------------------------------------------------------------------------

def _check_loss_scale_order(graph: TrainGraph) -> None:
    """loss_scale run before grad_accumulation checks each microbatch's gradients in backward, which
    no stage's apply graph can read; after it, the check reads the accumulated gradients."""
    for spec, value in zip(graph.signature.outputs, graph.output_values()):
        if spec.kind == OutputKind.METRIC and spec.name == "loss_scale:found_inf" \
                and isinstance(value, torch.fx.Node) and region_of(value) == Region.BACKWARD:
            raise PipelineSplitError("the loss-scale overflow check is in the backward region, per microbatch "
                                     "(rule: with pp > 1 loss_scale runs after grad_accumulation, so that it checks "
                                     "the accumulated gradients once per step; the plan's own pipeline does)")


def _default_ranks(n_stages: int, pp: int, schedule: str) -> list[int]:
    try:
        from .. import schedules
        return list(schedules.stage_to_rank(schedule, pp, n_stages // pp))
    except (ImportError, AttributeError):
        if schedule in ("dualpipev", "zbv"):
            return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
        return [s % pp for s in range(n_stages)]


def parse_layers(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.replace(";", " ").replace("-", " ").split()]
    except ValueError:
        raise PlanError("pipeline_split", f"layer counts {text!r} must be integers such as '2;1;1'", text) from None
    if any(c < 0 for c in counts):
        raise PlanError("pipeline_split", f"layer counts {counts} must be >= 0", text)
    return counts


@register_pass("pipeline_split", preserves=(), on="program")
def pipeline_split_pass(program: Program, ctx: PassContext, *, stages: int = 2, pp: int = 0,
                        schedule: str = "1f1b", layers: str = "", in_flight: str = "",
                        cut_slack: float = CROSSING_SLACK) -> Program:
    """Cut the accumulating whole step into ``stages`` pipeline stages (forward, backward, apply each)."""
    targets = [n for n, g in program.graphs.items()
               if graph_kind(g.attrs) == GraphKind.STEP and GraphAttr.GRAD_ACCUMULATION in g.attrs]
    if not targets:
        raise PipelineSplitError("pipeline_split: no whole-step graph accumulates gradients "
                                 "(rule: run grad_accumulation first; the stages accumulate per microbatch)")
    if stages < 1:
        raise PlanError("pp", f"pipeline_split needs stages >= 1 (got {stages})", stages)
    pp = pp or stages
    name = targets[0]
    graph = program.graphs[name]
    _check_loss_scale_order(graph)
    nodes = _classify(graph)
    if not nodes.forward:
        raise PipelineSplitError("pipeline_split: the step has no forward computation to cut")
    if cut_slack < 1.0:
        raise PipelineSplitError(f"pipeline_split option cut_slack={cut_slack} must be >= 1 (a multiple of the "
                                 "fewest bytes crossing anywhere)")
    units = _unit_starts(nodes, min(cut_slack, RESIDUAL_SLACK))
    if len(units) < stages:
        raise PlanError("pp", f"the step has {len(units)} cuttable unit(s) (cut points where only the residual "
                              f"stream crosses), fewer than the {stages} stages asked for (rule: at most one "
                              "stage per unit)", stages)
    plan = getattr(ctx, "plan", None)
    profile = get_profile(getattr(plan, "device_profile", "910b") if plan is not None else "910b")
    from .. import stage_balance
    crossing, tensors = _crossing_bytes(nodes), _crossing_bytes(nodes, size=lambda v: 1)

    def priced(starts):
        unit_costs = _unit_costs(nodes, starts, profile)
        unit_costs.cut_seconds = stage_balance.cut_transfer_seconds(
            [crossing[u] for u in starts], profile, pp, tensors=[tensors[u] for u in starts])
        return unit_costs
    costs = priced(units)
    flights = [int(x) for x in in_flight.split(";")] if in_flight else None
    if layers:
        unit_of_stage = _layer_starts(nodes, units, parse_layers(layers))
        if len(unit_of_stage) != stages:
            raise PlanError("pipeline_split", f"{len(unit_of_stage)} layer counts for {stages} stages "
                                              "(rule: one count per stage, pp x virtual stages)", layers)
        method = "layers"
        stage_bytes = None
    else:
        try:
            def balanced(unit_costs):
                return _balance(unit_costs, stages, flights, schedule=schedule, pp=pp,
                                microbatches=graph.attrs[GraphAttr.GRAD_ACCUMULATION]["microbatches"],
                                memory_limit=getattr(profile, "memory_capacity", None))
            split = balanced(costs)
            # Residual-only cuts send one tensor and are the simplest; finer ones (more sent) are
            # admitted only when those leave the stages more than REFINE_ABOVE apart, and kept only
            # when the largest stage, transfers included, comes out smaller.
            if split.imbalance > REFINE_ABOVE and cut_slack > RESIDUAL_SLACK:
                fine = _unit_starts(nodes, cut_slack)
                fine_costs = priced(fine)
                fine_split = balanced(fine_costs)
                if fine_split.largest_seconds < split.largest_seconds:
                    units, costs, split = fine, fine_costs, fine_split
        except ValueError as exc:
            raise PlanError("pp", f"no split of {len(units)} units into {stages} stages fits: {exc}", stages) from None
        unit_of_stage = list(split.boundaries)
        method = "cost"
        stage_bytes = [float(b) for b in split.stage_bytes]
    starts = [units[u] for u in unit_of_stage]
    fstage = _forward_stages(nodes, starts)
    stage, homes, shared, mixed = _assign(nodes, fstage, stages)
    ranks = _default_ranks(stages, pp, schedule)
    tied, reduced, subgroups = _share_across_stages(nodes, stage, homes, shared, mixed, ranks, stages, pp,
                                                    schedule, ctx, program)
    base = {k: v for k, v in graph.attrs.items() if k != GraphAttr.KIND}
    graphs, flows, built = _build_stages(nodes, stage, homes, stages, ranks, base)
    stage_cost = [0.0] * stages
    for u, t in enumerate(costs.seconds):
        stage_cost[max(s for s in range(stages) if unit_of_stage[s] <= u)] += t
    mean = sum(stage_cost) / stages
    schedule_runs = [Run(g, EVERY_MICROBATCH) for g in graphs if not g.endswith(".apply")]
    schedule_runs += [Run(g, EVERY_STEP) for g in graphs if g.endswith(".apply")]
    program.replace(name, graphs, schedule_runs, flows)
    program.attrs[GraphAttr.PIPELINE_PARALLEL] = {
        "stages": stages, "pp": pp, "schedule": schedule, "stage_to_rank": ranks, "split": method,
        "units": len(units), "unit_starts": unit_of_stage, "unit_seconds": costs.seconds,
        "unit_static_bytes": costs.static_bytes, "unit_activation_bytes": costs.activation_bytes,
        "stage_seconds": stage_cost, "stage_bytes": stage_bytes, "imbalance": max(stage_cost) / mean if mean else 1.0,
        "boundary_tensors": [len(st.acts_in) for st in built],
        "param_stage": homes, "microbatches": graph.attrs[GraphAttr.GRAD_ACCUMULATION]["microbatches"],
        "shared_params": {n: info["holders"] for n, info in tied.items()}, "stage_reductions": reduced,
        "pp_subgroups": subgroups}
    ctx.stat("stages", stages)
    ctx.stat("units", len(units))
    ctx.stat("imbalance", round(program.attrs[GraphAttr.PIPELINE_PARALLEL]["imbalance"], 4))
    return program
