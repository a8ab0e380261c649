"""What a compiled Program costs one rank: memory by term and step time, read from its graphs.

Pure analysis of a :class:`~graph_ir.program.Program` on a device profile (no compiling: the
planning layer compiles, :mod:`cann_passes.simulate` composes these figures into a
:class:`~cann_passes.simulate.Simulation`, the dump writes :func:`write_simulation`).
What is modelled
- Memory per rank: ``Program.state_bytes()`` of each graph (parameters, gradients,
  optimizer state, activations kept for backward, buffers, step state such as
  gradient accumulators; shards count as shards). The peak is, per graph, the
  memory analysis' peak under node order (``graph_ir.analysis.memory_profile``:
  the graph's inputs resident plus live intermediates, ZeRO-3's gathered
  parameters and other collective outputs included) plus the persistent state
  that is *not* an input of that graph (e.g. optimizer state during the grad
  graph of accumulation), the maximum over graphs.
- Time per rank: per graph, two streams in node order. Compute nodes run one
  after another on the compute stream at the device profile's roofline
  (``cost_model.node_time``: one launch cost per op, a view's cost where the
  runtime dispatches views, or the op's measured time where a calibrated
  profile has timed its signature, ``cost_model.calibrate``); each collective starts on the communication
  stream once its inputs are ready and the stream is free, and costs the
  alpha-beta time of the profile's links (a group whose ranks span more than a node's
  devices in the (pp, dp, cp, tp) mesh crosses nodes); a value produced by a collective is
  ready when the collective ends, so compute waits only where it reads it
  (overlap exactly as far as the node order allows, no more). Graphs run as
  the program's schedule says (per microbatch or per step), one after another.
- MFU: the captured step's matmul/attention FLOPs (torch's flop counter,
  before recompute; divided by ``tp`` x ``cp``) per rank and second, over the profile's
  matrix rate in the plan's compute dtype. tokens/s counts every rank's tokens.

What is not modelled
- Communication buffers are not a separate term: they are inside the peak.
- Allocator fragmentation, workspace memory, framework/runtime reserve,
  host-device transfer, data loading, the runtime's binding of a graph's inputs
  and write-back of its outputs (outside the graph), kernel fusion by the backend (the
  roofline is per aten node), contention between overlapping collectives and
  compute for memory bandwidth.
- Only the simulated rank (rank 0 unless asked): dp/tp ranks are symmetric in
  these plans except ZeRO's padding of the last shard.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch
import torch.fx

from graph_ir.analysis import memory_profile
from graph_ir.analysis.collectives import collective_kind, group_name_of, is_communication_op
from graph_ir.analysis.cost import ATTENTION_OPS, attention_flops, node_cost
from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.analysis.memory import aliases_input, saved_activations
from graph_ir.analysis.structure import find_blocks
from graph_ir.meta import ACCUMULATOR_PREFIX, GRADIENT_OF, Region, module_path_of, nbytes, region_of
from graph_ir.mesh import MeshDesc
from graph_ir.pipeline_info import pipeline_split_of
from graph_ir.program import EVERY_MICROBATCH, Program
from graph_ir.train_graph import TrainGraph

from . import schedules as sched
from .cost_model import DeviceProfile, get_profile, node_time
from .cost_model.collectives import collective_node_time
from .plan import Plan

class SimulationError(ValueError):
    pass


GB = 1e9   # decimal, as device memory is sold (64 GB)
MEMORY_TERMS = ("params", "param_copies", "grads", "optimizer_state", "activations", "buffers", "step_state")
PERSISTENT = ("params", "optimizer_state", "buffers", "step_state")   # inputs that live across graphs

MODELLED = ("memory: per-graph state bytes read from the compiled program; peak = memory analysis "
            "under node order + persistent state that is not an input of that graph; "
            "time: compute roofline per aten node, collectives alpha-beta on the profile's links, "
            "a collective overlaps the compute that follows it in node order until its output is read")
NOT_MODELLED = ("allocator fragmentation and runtime reserve, backend kernel fusion, data loading, bandwidth "
                "contention of overlapped communication; pp: the per-stage peak is its terms summed (an upper "
                "bound of the node-order peak), link contention between stages")


def _is_sync(node: torch.fx.Node) -> bool:
    """wait_tensor and friends: no time of their own, their output is ready with their input."""
    return is_communication_op(node) and collective_kind(node) is None


def graph_step_time(graph: torch.fx.Graph, profile: DeviceProfile, *, world_size: int,
                    allreduce_algo: str = "ring", mesh: MeshDesc | None = None) -> tuple[float, float, float]:
    """(seconds with overlap, compute stream seconds, communication seconds) of one run of ``graph``."""
    ready: dict[torch.fx.Node, float] = {}
    compute_free = comm_free = 0.0
    compute_total = comm_total = 0.0
    for node in graph.nodes:
        start = max((ready[a] for a in node.all_input_nodes), default=0.0)
        if node.op != "call_function" or _is_sync(node):
            ready[node] = start
        elif is_communication_op(node):
            axis = _axis_of_collective(node, mesh) if mesh is not None else None
            group = mesh.size(axis) if axis else world_size   # an all-reduce names its group, not its size
            seconds = profile.op_overhead + collective_node_time(node, profile, world_size=group,
                                                                 algorithm=allreduce_algo,
                                                                 span=mesh.span(axis) if axis else None)
            comm_free = max(comm_free, start) + seconds
            comm_total += seconds
            ready[node] = comm_free
        else:
            seconds = node_time(node, profile, world_size=world_size)
            if seconds == 0.0:        # a view where views are free, getitem: no place on the stream
                ready[node] = start
                continue
            compute_free = max(compute_free, start) + seconds
            compute_total += seconds
            ready[node] = compute_free
    return max(compute_free, comm_free), compute_total, comm_total


def param_copy_bytes(tg: TrainGraph) -> int:
    """Saved-for-backward bytes that are dtype casts of a parameter (autocast's bf16 weights)."""
    params = {n.target for s, n in zip(tg.signature.inputs, tg.placeholders()) if s.kind == "param"}
    by_name = {n.name: n for n in tg.graph.nodes}
    return sum(size for name, size in saved_activations(tg.graph).items()
               if _cast_of_param(by_name[name]) in params)


def model_flops(captured: TrainGraph) -> float:
    """Matrix-unit FLOPs of one captured step (forward + backward + update, no recompute), causal
    attention counted over its full scores as Megatron's MFU counts it (the time model prices the
    tiles a kernel skips under ``is_causal`` as skipped)."""
    total = 0.0
    for node in captured.graph.nodes:
        if node.op == "call_function" and not is_communication_op(node):
            if node.target in ATTENTION_OPS:
                total += attention_flops(node, causal_skips=False)
                continue
            cost = node_cost(node)
            if cost.matmul:
                total += cost.flops
    return total


def _algo(plan: Plan) -> str:
    return plan.allreduce_algo if plan.allreduce_algo in ("ring", "tree") else "ring"


def program_figures(program: Program, plan: Plan, profile: DeviceProfile) -> dict:
    """The raw per-rank numbers of a compiled program (linear in depth, see ``extrapolate``)."""
    states = {name: dataclasses.asdict(s) for name, s in program.state_bytes().items()}
    for name, s in states.items():
        # a low-precision copy of a weight kept for backward is the weight's, not an activation:
        # the ZeRO paper's "fp16 parameters" (2 bytes each), separated here
        s["param_copies"] = param_copy_bytes(program[name])
        s["activations"] -= s["param_copies"]
    persistent = {k: max(s[k] for s in states.values()) for k in PERSISTENT}
    memory = {k: max(s[k] for s in states.values()) for k in MEMORY_TERMS}
    world = program.mesh.world_size
    peaks, compute, comm, step = {}, 0.0, 0.0, 0.0
    for run in program.schedule:
        graph = program[run.graph]
        times = plan.microbatches if run.every == EVERY_MICROBATCH else 1
        missing = sum(max(0, persistent[k] - states[run.graph][k]) for k in PERSISTENT)
        peaks[run.graph] = memory_profile(graph.graph).peak_bytes + missing
        seconds, busy, moved = graph_step_time(graph.graph, profile, world_size=world, allreduce_algo=_algo(plan),
                                               mesh=program.mesh)
        step += times * seconds
        compute += times * busy
        comm += times * moved
    return {"memory": memory, "peaks": peaks, "compute": compute, "comm": comm, "step": step,
            "per_graph": states}


def write_simulation(directory: str, program: Program, plan: Plan) -> None:
    """``DIR/simulation.json`` of a dump: this rank's memory by term and step time on the plan's
    device profile, for the dump page's planner section. A program the simulator cannot read gets
    the reason instead, so a dump never fails for it."""
    try:
        profile = get_profile(plan.device_profile)
        fig = program_figures(program, plan, profile)
        peak_graph = max(fig["peaks"], key=fig["peaks"].get)
        data = {"profile": profile.name, "capacity_bytes": profile.memory_capacity, "rank": program.mesh.rank,
                "world_size": program.mesh.world_size, "memory": fig["memory"], "peaks": fig["peaks"],
                "peak_graph": peak_graph, "compute_s": fig["compute"], "comm_s": fig["comm"],
                "step_s": fig["step"], "modelled": MODELLED, "not_modelled": NOT_MODELLED}
    except Exception as exc:   # the dump is a debugging aid: say why, keep dumping
        data = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(directory, "simulation.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)


PRE, POST = "pre", "post"
PIPELINE_TERMS = MEMORY_TERMS + ("param_copies", "workspace")
_CASTS = {"_to_copy", "convert_element_type", "to"}


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]


def _axis_of_collective(node: torch.fx.Node, mesh: MeshDesc) -> str | None:
    name = group_name_of(node)
    for axis in mesh.all_axes:
        if mesh.group_name(axis) == name:
            return axis
    return None


def _segment_map(tg: TrainGraph) -> dict[torch.fx.Node, str]:
    """Node -> segment: a block path, ``pre`` or ``post`` (forward and backward nodes only).

    A node inside a block (its module path) belongs to it; a node outside every block belongs to
    the block region it lies in by node order: forward before the first block node is ``pre``,
    after the last ``post``, between two blocks the earlier one; backward mirrored (it runs the
    other way). Backward nodes carry the module path of the forward op they differentiate.
    """
    structure = find_blocks(tg.graph)
    seg: dict[torch.fx.Node, str] = {}
    for region, before, after in ((Region.FORWARD, PRE, POST), (Region.BACKWARD, POST, PRE)):
        nodes = [n for n in tg.graph.nodes if n.op == "call_function" and region_of(n) == region]
        inside = [structure.block_of(module_path_of(n)) for n in nodes]
        marked = [i for i, b in enumerate(inside) if b]
        if not marked:
            seg.update({n: before for n in nodes})
            continue
        first, last = marked[0], marked[-1]
        current = before
        for i, (n, b) in enumerate(zip(nodes, inside)):
            if b:
                current = b
            seg[n] = b or (before if i < first else after if i > last else current)
    return seg


def _param_segments(tg: TrainGraph, seg: dict) -> dict[str, tuple[str, ...]]:
    """Parameter (and buffer) name -> the segments whose forward reads it (a tied weight: two)."""
    out: dict[str, tuple[str, ...]] = {}
    for spec, node in zip(tg.signature.inputs, tg.placeholders()):
        if spec.kind not in ("param", "buffer"):
            continue
        found: list[str] = []
        stack, seen = list(node.users), set()
        while stack:
            user = stack.pop()
            if user in seen:
                continue
            seen.add(user)
            if region_of(user) == Region.FORWARD and user in seg:
                if aliases_input(user) and seg[user] in (PRE, POST):
                    stack.extend(user.users)   # a view outside any module: follow it to its reader
                if seg[user] not in found:
                    found.append(seg[user])
        in_blocks = [x for x in found if x not in (PRE, POST)]
        found = in_blocks[:1] if in_blocks else sorted(found, key=(PRE, POST).index)
        out[spec.name] = tuple(found) or (PRE,)
    return out


def _owner(name: str, params: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """The segments of the parameter a state input belongs to (``<param>:<key>``, accumulators)."""
    if name.startswith(ACCUMULATOR_PREFIX):
        name = name[len(ACCUMULATOR_PREFIX):]
    if name in params:
        return params[name]
    base = name.rpartition(":")[0]
    return params.get(base)


def _cast_of_param(node: torch.fx.Node) -> str | None:
    """The placeholder a saved buffer is a dtype cast of (through views), or None."""
    if node.op != "call_function" or _op_name(node) not in _CASTS:
        return None
    src = node.all_input_nodes[0] if node.all_input_nodes else None
    while src is not None and src.op == "call_function" and aliases_input(src):
        src = src.all_input_nodes[0]
    return src.target if src is not None and src.op == "placeholder" else None


@dataclass
class Segments:
    """Per-segment figures of a compiled pp = 1 program (per rank of its dp x tp mesh).

    ``figures[segment]``: bytes (``params``, ``grads``, ``optimizer_state``, ``buffers``,
    ``step_state``, ``param_copies`` — low-precision weight copies kept for backward —,
    ``activations`` per microbatch) and seconds per microbatch (``forward_s``, ``backward_s``,
    tensor-parallel collectives inside included), ``send_bytes`` (the activation a stage ending
    at this segment sends on). Per step: ``optimizer_s`` and ``dp_comm_s`` (the data-parallel
    collectives) are split over segments by their parameter bytes. ``blocks`` in model order.
    """
    figures: dict[str, dict[str, float]]
    blocks: list[str]
    workspace: float              # peak - resident - saved - gradients of the pp = 1 program (>= 0)
    dp_exposed_fraction: float    # share of the dp collectives the pp = 1 step does not hide
    notes: list[str] = field(default_factory=list)

    def layer(self) -> dict[str, float]:
        """The mean block (the blocks of a transformer stack are alike)."""
        rows = [self.figures[b] for b in self.blocks]
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


_FIG_KEYS = ("params", "grads", "optimizer_state", "buffers", "step_state", "param_copies", "activations",
             "forward_s", "backward_s", "optimizer_s", "dp_comm_s", "send_bytes", "accumulate_s")


def segment_figures(program: Program, plan: Plan, profile: DeviceProfile) -> Segments:
    """Attribute the compiled pp = 1 program's memory and time to pre / block / post segments."""
    mesh = program.mesh
    with_forward = [n for n, g in program if any(region_of(x) == Region.FORWARD and x.op == "call_function"
                                                 for x in g.graph.nodes)]
    if not with_forward:
        raise SimulationError("pipeline model: no graph of the program runs a forward")
    main = program[with_forward[0]]
    seg = _segment_map(main)
    blocks = list(dict.fromkeys(s for s in seg.values() if s not in (PRE, POST)))
    if len(blocks) < 2:
        raise SimulationError("pipeline model: fewer than two repeated blocks found in the model "
                              "(graph_ir.analysis.structure); stages are made of blocks")
    params = _param_segments(main, seg)
    figures = {s: dict.fromkeys(_FIG_KEYS, 0.0) for s in (PRE, *blocks, POST)}
    notes: list[str] = []

    def add(segs, key, value):
        for s in segs:            # a tied weight lives on both its stages (as Megatron keeps it)
            figures[s][key] += value

    # state inputs, as resident on this rank (shards count as shards); the largest graph's inputs
    seen_inputs: set[str] = set()
    for _, tg in program:
        for spec, node in zip(tg.signature.inputs, tg.placeholders()):
            key = {"param": "params", "opt_state": "optimizer_state", "buffer": "buffers",
                   "step_state": "step_state"}.get(spec.kind)
            if key is None or (spec.kind, spec.name) in seen_inputs:
                continue
            seen_inputs.add((spec.kind, spec.name))
            owner = (params.get(spec.name) if spec.kind in ("param", "buffer") else _owner(spec.name, params))
            add(owner or (PRE,), key, nbytes(node.meta.get("val")))
    # gradients: the value each update reads; a gathered gradient (where tensor_parallel's update
    # reads the whole gradient of a split weight) counts at the parameter's local size here,
    # the gathered copy is transient (it is in the peak of the pp = 1 program)
    for _, tg in program:
        locals_ = {s.name: n.meta["val"].numel() for s, n in zip(tg.signature.inputs, tg.placeholders())
                   if s.kind == "param" and isinstance(n.meta.get("val"), torch.Tensor)}
        try:     # the marks the update still reads, and the analysis for the rest
            marked = find_gradients(tg, mark=False)
        except GradientNotFound:
            continue
        if not marked:
            continue
        for name, node in marked.items():
            if name not in locals_:
                continue
            val = node.meta.get("val")
            size = nbytes(val)
            if isinstance(val, torch.Tensor):
                size = min(size, locals_[name] * val.element_size())
            add(params.get(name, (PRE,)), "grads", size)
            # with microbatches each gradient is added into its accumulator (acc + weight * grad: two
            # elementwise ops reading and writing gradient-sized buffers), as grad_accumulation does
            add(params.get(name, (PRE,)), "accumulate_s", 2 * profile.op_overhead + 5 * size / profile.memory_bandwidth)
        break   # one graph holds the update
    # saved activations and low-precision weight copies, per microbatch
    by_name = {n.name: n for n in main.graph.nodes}
    for name, size in saved_activations(main.graph).items():
        node = by_name[name]
        src = _cast_of_param(node)
        s = seg.get(node, PRE)
        if src is not None and _owner_of_placeholder(main, src, params):
            add(_owner_of_placeholder(main, src, params), "param_copies", size)
        else:
            figures[s]["activations"] += size
    # time: per microbatch (graphs run every microbatch) or per step
    total_param = sum(f["params"] for f in figures.values()) or 1.0
    dp_total = opt_total = 0.0
    for run in program.schedule:
        tg = program[run.graph]
        times = plan.microbatches if run.every == EVERY_MICROBATCH else 1
        gseg = seg if tg is main else _segment_map(tg)
        for node in tg.graph.nodes:
            if node.op != "call_function" or _is_sync(node):
                continue
            region = region_of(node)
            if is_communication_op(node):
                axis = _axis_of_collective(node, mesh)
                seconds = profile.op_overhead + collective_node_time(
                    node, profile, world_size=mesh.size(axis) if axis else mesh.world_size,
                    algorithm=_algo(plan), span=mesh.span(axis) if axis else None)
                if axis == "tp" and node in gseg:
                    figures[gseg[node]]["forward_s" if region == Region.FORWARD else "backward_s"] += seconds
                else:
                    dp_total += seconds * times
                continue
            seconds = node_time(node, profile, world_size=mesh.world_size)
            if region in (Region.FORWARD, Region.BACKWARD) and node in gseg:
                figures[gseg[node]]["forward_s" if region == Region.FORWARD else "backward_s"] += seconds
            else:
                opt_total += seconds * times
    for f in figures.values():
        share = f["params"] / total_param
        f["optimizer_s"] = opt_total * share
        f["dp_comm_s"] = dp_total * share
    # what a stage ending at a segment sends on: forward values of that segment (or before)
    # read by the next segment's forward
    order = [PRE, *blocks, POST]
    rank_of = {s: i for i, s in enumerate(order)}
    for node in main.graph.nodes:
        s = seg.get(node)
        if s is None or region_of(node) != Region.FORWARD:
            continue
        for arg in node.all_input_nodes:
            a = seg.get(arg)
            if a is not None and region_of(arg) == Region.FORWARD and rank_of[a] == rank_of[s] - 1:
                figures[a]["send_bytes"] = max(figures[a]["send_bytes"], nbytes(arg.meta.get("val")))
    # the pp = 1 step's working memory beyond what persists, and how much dp traffic it hides
    fig = program_figures(program, plan, profile)
    resident = sum(fig["memory"][k] for k in PERSISTENT)
    saved = sum(f["activations"] + f["param_copies"] for f in figures.values())
    grads = sum(f["grads"] for f in figures.values())
    workspace = max(0.0, max(fig["peaks"].values()) - resident - saved - grads)
    exposed = max(0.0, fig["step"] - fig["compute"])
    dp_exposed = min(1.0, exposed / fig["comm"]) if fig["comm"] > 0 else 0.0
    return Segments(figures, blocks, workspace, dp_exposed, notes)


def _owner_of_placeholder(tg: TrainGraph, target: str, params: dict) -> tuple[str, ...] | None:
    for spec, node in zip(tg.signature.inputs, tg.placeholders()):
        if node.target == target:
            return params.get(spec.name) if spec.kind == "param" else None
    return None


def _graph_seconds(tg: TrainGraph, plan: Plan, profile: DeviceProfile, mesh: MeshDesc) -> tuple[float, float]:
    """(seconds, of which data-parallel collectives) of one run of a stage graph."""
    seconds, _, _ = graph_step_time(tg.graph, profile, world_size=mesh.world_size, allreduce_algo=_algo(plan),
                                    mesh=mesh)
    dp = sum(collective_node_time(n, profile, world_size=plan.dp, algorithm=_algo(plan), span=mesh.span("dp"))
             for n in tg.graph.nodes if is_communication_op(n) and _axis_of_collective(n, mesh) == "dp")
    return seconds, dp


def stage_program_figures(program: Program, plan: Plan, profile: DeviceProfile) -> tuple[list[dict], list]:
    """Per stage of a ``pipeline_split`` program: its bytes by term and its per-microbatch seconds."""
    info = pipeline_split_of(program)
    mesh = program.mesh
    figs, costs = [], []
    for s in range(info.stages):
        g = {part: program[f"stage{s}.{part}"] for part in ("forward", "backward", "backward_input",
                                                           "backward_weight", "apply")
             if f"stage{s}.{part}" in program.graphs}
        f = dict.fromkeys(_FIG_KEYS, 0.0)
        fwd = g["forward"]
        params = {n.target for sp, n in zip(fwd.signature.inputs, fwd.placeholders()) if sp.kind == "param"}
        for sp, node in zip(g["apply"].signature.inputs, g["apply"].placeholders()):
            size = nbytes(node.meta.get("val"))
            if sp.kind == "param":
                f["params"] += size
            elif sp.kind == "opt_state":
                f["optimizer_state"] += size
            elif sp.kind == "buffer":
                f["buffers"] += size
            elif sp.kind == "step_state":
                f["grads" if sp.name.startswith(ACCUMULATOR_PREFIX) else "step_state"] += size
        outs = fwd.output_values()
        bases: set[torch.fx.Node] = set()
        for sp, node in zip(fwd.signature.outputs, outs):
            if sp.kind == "saved":
                base = node          # several saved views of one buffer hold it once
                while base.op == "call_function" and aliases_input(base):
                    base = base.all_input_nodes[0]
                if base.op == "placeholder" or base in bases:
                    continue         # a view of an input (a weight's transpose) holds nothing of its own
                bases.add(base)
                f["param_copies" if _cast_of_param(base) in params else "activations"] += nbytes(base.meta.get("val"))
            elif sp.kind == "activation":
                f["send_bytes"] += nbytes(node.meta.get("val"))
        f["forward_s"], _ = _graph_seconds(fwd, plan, profile, mesh)
        f["backward_s"], _ = _graph_seconds(g["backward"], plan, profile, mesh)
        split = "backward_input" in g and "backward_weight" in g
        bi = _graph_seconds(g["backward_input"], plan, profile, mesh)[0] if split else f["backward_s"] / 2
        bw = _graph_seconds(g["backward_weight"], plan, profile, mesh)[0] if split else f["backward_s"] / 2
        apply_s, dp_s = _graph_seconds(g["apply"], plan, profile, mesh)
        f["optimizer_s"], f["dp_comm_s"] = apply_s - dp_s, dp_s
        f["workspace"] = max(max(0.0, memory_profile(t.graph).peak_bytes - memory_profile(t.graph).resident_bytes)
                             for t in g.values())
        f["layers"] = None
        figs.append(f)
        # a schedule that runs the whole backward uses B; split ones use I and W (their sum may differ)
        costs.append(sched.StageCost(f["forward_s"], bi, bw, int(f["send_bytes"])))
    return figs, costs
