"""Simulate one training step of a plan at any scale, in one process: memory and time per rank.

The captured step (usually of a model built on ``meta`` and captured with fake
tensors) is compiled by the plan's own pipeline (:func:`cann_passes.compile.compile_program`)
for one rank of a fake mesh (:meth:`graph_ir.mesh.MeshDesc.fake`, no process
group). Everything below is read from the program that rank would run.

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
  alpha-beta time of the profile's links; a value produced by a collective is
  ready when the collective ends, so compute waits only where it reads it
  (overlap exactly as far as the node order allows, no more). Graphs run as
  the program's schedule says (per microbatch or per step), one after another.
- MFU: the captured step's matmul/attention FLOPs (torch's flop counter,
  before recompute; divided by ``tp``) per rank and second, over the profile's
  matrix rate in the plan's compute dtype. tokens/s counts every rank's tokens.

Pipeline parallelism: see the section at the end (two paths: the real stage programs of
``pipeline_split``, or stages composed from the pp = 1 program's blocks at any depth).

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
from graph_ir.analysis.cost import node_cost
from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.analysis.memory import aliases_input, saved_activations
from graph_ir.analysis.structure import find_blocks
from graph_ir.meta import ACCUMULATOR_PREFIX, GRADIENT_OF, Region, module_path_of, nbytes, region_of
from graph_ir.mesh import MeshDesc
from graph_ir.pipeline_info import pipeline_split_of
from graph_ir.program import EVERY_MICROBATCH, Program
from graph_ir.train_graph import TrainGraph

from . import schedules as sched
from .compile import compile_program
from .cost_model import DeviceProfile, get_profile, node_time
from .cost_model.collectives import collective_node_time
from .pass_manager import is_registered
from .plan import Plan
from .stage_balance import balance

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


class SimulationError(ValueError):
    pass


@dataclass
class Simulation:
    plan: Plan
    profile: str
    rank: int
    world_size: int
    memory: dict[str, int]          # MEMORY_TERMS -> bytes per rank (max over the program's graphs)
    peak_bytes: int
    peak_graph: str
    compute_seconds: float          # compute stream busy time per step
    comm_seconds: float             # collective time per step (before overlap)
    step_seconds: float             # with overlap
    model_flops: float              # per rank per step (captured graph, no recompute)
    tokens_per_step: int            # all ranks
    capacity_bytes: float
    per_graph: dict[str, dict] = field(default_factory=dict)
    pp: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    bubble_fraction: float = 0.0
    stages: list = field(default_factory=list)       # pp > 1: every pipeline rank's figures
    pipeline_path: str = ""                          # pp > 1: which model of the stages ran
    timeline: object = None                          # pp > 1: the schedule's replay

    @property
    def exposed_comm_seconds(self) -> float:
        return max(0.0, self.step_seconds - self.compute_seconds)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def headroom(self) -> float:
        return 1.0 - self.peak_bytes / self.capacity_bytes

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_second / self.world_size

    def mfu(self, profile: DeviceProfile | None = None) -> float:
        profile = profile or get_profile(self.profile)
        dtype = torch.float32 if self.plan.precision == "fp32" else getattr(torch, {"bf16": "bfloat16",
                                                                                   "fp16": "float16"}[self.plan.precision])
        return self.model_flops / self.step_seconds / profile.matrix_rate(dtype)

    @property
    def largest_term(self) -> str:
        return max(self.memory, key=self.memory.get)

    def to_json(self) -> dict:
        return {"plan": self.plan.to_dict(), "profile": self.profile, "rank": self.rank,
                "world_size": self.world_size, "memory": self.memory, "peak_bytes": self.peak_bytes,
                "peak_graph": self.peak_graph, "fits": self.fits, "headroom": self.headroom,
                "compute_seconds": self.compute_seconds, "comm_seconds": self.comm_seconds,
                "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "tokens_per_second_per_device": self.tokens_per_second_per_device, "mfu": self.mfu(),
                "model_flops": self.model_flops, "largest_term": self.largest_term,
                "pp": self.pp, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "bubble_fraction": self.bubble_fraction, "stages": self.stages,
                "pipeline_path": self.pipeline_path, "modelled": MODELLED, "not_modelled": NOT_MODELLED}

    def breakdown(self) -> str:
        """Per-rank memory and time, one term a line, the largest memory term marked."""
        largest = self.largest_term
        lines = [f"rank {self.rank} of {self.world_size} on {self.profile} "
                 f"({self.capacity_bytes / GB:.1f} GB): peak {self.peak_bytes / GB:.2f} GB "
                 f"in graph '{self.peak_graph}', {'fits' if self.fits else 'DOES NOT FIT'}"]
        for term in self.memory:
            mark = "   <- largest" if term == largest else ""
            lines.append(f"  {term:<16}{self.memory[term] / GB:>10.3f} GB{mark}")
        lines.append(f"  step {self.step_seconds * 1e3:.1f} ms = compute {self.compute_seconds * 1e3:.1f} ms "
                     f"+ exposed comm {self.exposed_comm_seconds * 1e3:.1f} ms (comm total "
                     f"{self.comm_seconds * 1e3:.1f} ms); MFU {self.mfu():.1%}; "
                     f"{self.tokens_per_second_per_device:,.0f} tokens/s/device")
        if self.pp > 1:
            lines.append(f"  pipeline: pp={self.pp} {self.schedule} v={self.virtual_stages}, bubble "
                         f"{self.bubble_fraction:.1%}; {self.pipeline_path}")
            for st in self.stages:
                lines.append(f"    pp rank {st['rank']}: layers {st['layers']}, in flight {st['in_flight']}, "
                             f"peak {st['peak_bytes'] / GB:.2f} GB")
        return "\n".join(lines)


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
                                                                 algorithm=allreduce_algo)
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
    """Matrix-unit FLOPs of one captured step (forward + backward + update, no recompute)."""
    total = 0.0
    for node in captured.graph.nodes:
        if node.op == "call_function" and not is_communication_op(node):
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


def extrapolate(a, b, la: int, lb: int, target: int):
    """Every number of ``a`` (measured at ``la`` layers) and ``b`` (at ``lb``), continued linearly."""
    if isinstance(a, dict):
        return {k: extrapolate(a[k], b[k], la, lb, target) for k in a}
    return a + (b - a) * (target - la) / (lb - la)


def _pp_args(plan: Plan, pp: int | None, schedule: str | None, v: int | None) -> tuple[int, str, int, Plan]:
    """(pp, schedule, v, the plan at pp = 1) — pp from the argument or the plan (a Plan can carry
    pp > 1 only once a pipeline_split pass is registered; the simulator takes it either way)."""
    pp = pp or plan.pp
    schedule = schedule or (plan.pipeline_schedule if plan.pp > 1 else "1f1b")
    v = v or getattr(plan, "pipeline_virtual_stages", 1)
    if schedule == "dynamic":
        raise SimulationError("pipeline_schedule 'dynamic': simulate each schedule and compare "
                              "(cann_passes.schedules.choose_schedule); the simulator takes a named one")
    if plan.pp > 1:
        defaults = {f.name: f.default for f in dataclasses.fields(plan)}
        plan = plan.replace(**{k: defaults[k] for k in ("pp", "pipeline_schedule", "pipeline_virtual_stages",
                                                         "pipeline_split") if k in defaults})
    return pp, schedule, v, plan


def mesh_for(plan: Plan, rank: int = 0) -> MeshDesc:
    return MeshDesc.fake(dp=plan.dp, tp=plan.tp, rank=rank)


def _finish(figures: dict, plan: Plan, profile: DeviceProfile, flops: float, tokens_per_microbatch: int,
            rank: int, capacity_bytes: float | None = None) -> Simulation:
    memory = {k: int(round(v)) for k, v in figures["memory"].items()}
    peak_graph = max(figures["peaks"], key=figures["peaks"].get)
    world = plan.dp * plan.tp
    tokens = tokens_per_microbatch * plan.microbatches * plan.dp
    return Simulation(plan, profile.name, rank, world, memory, int(round(figures["peaks"][peak_graph])),
                      peak_graph, figures["compute"], figures["comm"], figures["step"],
                      flops * plan.microbatches / plan.tp, tokens, capacity_bytes or profile.memory_capacity,
                      figures["per_graph"])


def simulate(captured: TrainGraph, plan: Plan, *, profile: str | DeviceProfile = "ascend_910b",
             tokens_per_microbatch: int, rank: int = 0, capacity_bytes: float | None = None,
             pp: int | None = None, schedule: str | None = None, v: int | None = None,
             layers: int | None = None, pipeline_path: str = "auto") -> Simulation:
    """Compile ``captured`` (one microbatch of one dp rank) with ``plan`` for ``rank``; its memory and time.

    ``tokens_per_microbatch``: the tokens of the captured batch (rows x sequence).
    ``pp`` / ``schedule`` / ``v`` (or the plan's pipeline fields): a pipelined plan, simulated from
    the pp = 1 program (:func:`simulate_pipeline`); ``layers`` then is the real depth (default: the
    captured one). ``pipeline_path``: ``stages`` compiles the real stage programs (``pipeline_split``,
    at the captured depth), ``analytic`` composes stages from the pp = 1 program's blocks (any
    depth), ``auto`` tries the stage programs first and says in ``Simulation.pipeline_path`` which ran.
    """
    profile = get_profile(profile) if isinstance(profile, str) else profile
    pp, schedule, v, flat = _pp_args(plan, pp, schedule, v)
    refused = ""
    if pp > 1 and pipeline_path in ("auto", "stages"):
        try:
            staged = _pp_plan(flat, pp, schedule, v, plan.pipeline_split if plan.pp > 1 else "cost")
            return simulate_stage_programs(captured, staged, profile=profile, rank=rank,
                                           tokens_per_microbatch=tokens_per_microbatch,
                                           capacity_bytes=capacity_bytes, layers=layers)
        except Exception as exc:   # refused by the split or the plan: the analytic path says why
            if pipeline_path == "stages":
                raise
            refused = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    if pp > 1:
        # one microbatch's program: the pipeline replays microbatches itself
        one = flat.replace(dump_dir=None, microbatches=1)
        segments = segment_figures(compile_program(captured, one, mesh_for(one, rank)), one, profile)
        sim = simulate_pipeline(segments, flat, pp=pp, layers=layers or len(segments.blocks), profile=profile,
                                schedule=schedule, v=v, model_flops_per_microbatch=model_flops(captured)
                                * (layers or len(segments.blocks)) / len(segments.blocks),
                                tokens_per_microbatch=tokens_per_microbatch, capacity_bytes=capacity_bytes)
        if refused:
            sim.pipeline_path += f" (the stage programs were not used: {refused})"
        return sim
    program = compile_program(captured, flat.replace(dump_dir=None), mesh_for(flat, rank))
    figures = program_figures(program, plan, profile)
    return _finish(figures, plan, profile, model_flops(captured), tokens_per_microbatch, rank, capacity_bytes)


def simulate_extrapolated(captures: dict[int, TrainGraph], layers: int, plan: Plan, *,
                          profile: str | DeviceProfile = "ascend_910b", tokens_per_microbatch: int,
                          rank: int = 0, capacity_bytes: float | None = None, pp: int | None = None,
                          schedule: str | None = None, v: int | None = None) -> Simulation:
    """:func:`simulate` at ``layers`` layers from two captures of the same model at smaller depths.

    ``captures`` maps depth -> captured step (exactly two depths). Every figure is continued
    linearly in depth; this is exact for per-layer terms (parameters, states, kept activations,
    per-layer compute and collectives) and holds for the peak as long as the peak's place in the
    step does not move with depth (tests/planner checks it against a full capture at small size).
    With pp > 1 the deeper capture's program gives the per-block figures (its mean block) and
    stages are composed at ``layers`` (:func:`simulate_pipeline`).
    """
    if len(captures) != 2:
        raise SimulationError(f"extrapolation needs captures at two depths, got {sorted(captures)}")
    profile = get_profile(profile) if isinstance(profile, str) else profile
    pp, schedule, v, flat = _pp_args(plan, pp, schedule, v)
    (la, ca), (lb, cb) = sorted(captures.items())
    if pp > 1:
        one = flat.replace(dump_dir=None, microbatches=1)
        segments = segment_figures(compile_program(cb, one, mesh_for(one, rank)), one, profile)
        flops = extrapolate(model_flops(ca), model_flops(cb), la, lb, layers)
        return simulate_pipeline(segments, flat, pp=pp, layers=layers, profile=profile, schedule=schedule, v=v,
                                 model_flops_per_microbatch=flops, tokens_per_microbatch=tokens_per_microbatch,
                                 capacity_bytes=capacity_bytes)
    fa = program_figures(compile_program(ca, plan.replace(dump_dir=None), mesh_for(plan, rank)), plan, profile)
    fb = program_figures(compile_program(cb, plan.replace(dump_dir=None), mesh_for(plan, rank)), plan, profile)
    if set(fa["peaks"]) != set(fb["peaks"]):
        raise SimulationError("the two depths compiled to different programs; cannot extrapolate")
    figures = extrapolate(fa, fb, la, lb, layers)
    flops = extrapolate(model_flops(ca), model_flops(cb), la, lb, layers)
    return _finish(figures, plan, profile, flops, tokens_per_microbatch, rank, capacity_bytes)


# -- pipeline parallelism --------------------------------------------------------------------------
#
# A pp > 1 plan is simulated from the compiled pp = 1 program of the same plan (same dp, tp, ZeRO,
# recompute, precision): every byte and second of it is attributed to a segment of the model —
# ``pre`` (before the first block: embeddings), one segment per block, ``post`` (after the last:
# final norm, head, loss) — and stages are made of segments: a stage's model state is its
# segments', its activations its segments' saved bytes times the microbatches the schedule keeps
# in flight on it (``cann_passes.schedules``' replay of torch's action lists), its per-microbatch
# forward and backward times its segments' node times; the schedule's replay with those costs and
# the stage-to-stage transfer gives the makespan and the bubble. This is the analytic path; when a
# ``pipeline_split`` pass is registered and compiles, the real stage programs are the other path
# (``Simulation.pipeline_path`` says which ran).

PRE, POST = "pre", "post"
PIPELINE_TERMS = MEMORY_TERMS + ("param_copies", "workspace")
_SCHEDULE_ALIASES = {"zero_bubble": "zb1p"}
_CASTS = {"_to_copy", "convert_element_type", "to"}


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]


def _axis_of_collective(node: torch.fx.Node, mesh: MeshDesc) -> str | None:
    name = group_name_of(node)
    for axis in mesh.axes:
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
        marked = {n.meta[GRADIENT_OF]: n for n in tg.graph.nodes if GRADIENT_OF in n.meta}
        if not marked:
            try:
                marked = find_gradients(tg, mark=False)
            except GradientNotFound:
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
                    algorithm=_algo(plan))
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


def _pp_link(profile: DeviceProfile, plan: Plan) -> tuple[float, float]:
    """Latency and bandwidth between neighbouring stages: ranks dp x tp apart in the (pp, dp, tp) mesh."""
    if plan.dp * plan.tp < profile.devices_per_node:
        return profile.intra_node_latency, profile.intra_node_bandwidth
    return profile.inter_node_latency, profile.inter_node_bandwidth


def _layers_per_stage(layers: int, n_stages: int, unit_costs: list[float]) -> list[int]:
    """Megatron's even split where it divides; else the balancer's cost-optimal contiguous split."""
    if layers < n_stages:
        raise SimulationError(f"pp x virtual stages = {n_stages} stages for {layers} layers "
                              "(rule: at least one layer per stage)")
    if layers % n_stages == 0:
        return [layers // n_stages] * n_stages
    return [len(r) for r in balance(unit_costs, n_stages).ranges()]


def simulate_pipeline(segments: Segments, plan: Plan, *, pp: int, layers: int, profile: DeviceProfile,
                      schedule: str = "1f1b", v: int = 1, model_flops_per_microbatch: float,
                      tokens_per_microbatch: int, capacity_bytes: float | None = None,
                      layers_per_stage: list[int] | None = None) -> "Simulation":
    """A pp-stage plan from the per-segment figures of its pp = 1 program (see the section comment).

    ``layers``: the model's real depth (the per-block figures are the mean block's, so a program
    compiled at two or three layers stands for any depth: exact for identical blocks).
    ``plan.microbatches`` is the pipeline's microbatch count. Returns the Simulation of the rank
    with the largest peak; ``Simulation.stages`` has every pipeline rank.
    """
    name = _SCHEDULE_ALIASES.get(schedule, schedule)
    m = plan.microbatches
    try:
        sched.check(name, pp, m, v)
    except sched.ScheduleError as exc:
        raise SimulationError(str(exc)) from None
    v_eff = sched.stages_per_rank(name, v)
    n_stages = pp * v_eff
    layer, pre, post = segments.layer(), segments.figures[PRE], segments.figures[POST]
    unit_costs = [layer["forward_s"] + layer["backward_s"]] * layers
    unit_costs[0] += pre["forward_s"] + pre["backward_s"]
    unit_costs[-1] += post["forward_s"] + post["backward_s"]
    counts = layers_per_stage or _layers_per_stage(layers, n_stages, unit_costs)
    if sum(counts) != layers or len(counts) != n_stages:
        raise SimulationError(f"layers per stage {counts}: must be {n_stages} counts summing to {layers}")
    stage_figs = []
    for s, k in enumerate(counts):
        f = {key: k * layer[key] for key in _FIG_KEYS}
        for extra, here in ((pre, s == 0), (post, s == n_stages - 1)):
            if here:
                for key in _FIG_KEYS:
                    f[key] += extra[key]
        f["send_bytes"] = layer["send_bytes"] if s < n_stages - 1 else 0.0
        if m > 1:
            f["backward_s"] += f["accumulate_s"]
        stage_figs.append(f)
    costs = [sched.StageCost(f["forward_s"], f["backward_s"] / 2, f["backward_s"] / 2, int(f["send_bytes"]))
             for f in stage_figs]
    for f, k in zip(stage_figs, counts):
        f["workspace"] = segments.workspace
        f["layers"] = k
    return _pipeline_result(stage_figs, costs, plan, pp=pp, name=name, v_eff=v_eff, profile=profile,
                            dp_exposed=segments.dp_exposed_fraction, flops=model_flops_per_microbatch,
                            tokens_per_microbatch=tokens_per_microbatch, capacity_bytes=capacity_bytes,
                            path="analytic: stages composed from the compiled pp = 1 program's per-block "
                                 f"figures, schedule {name} replayed by cann_passes.schedules")


def _pipeline_result(stage_figs: list[dict], costs: list, plan: Plan, *, pp: int, name: str, v_eff: int,
                     profile: DeviceProfile, dp_exposed: float, flops: float, tokens_per_microbatch: int,
                     capacity_bytes: float | None, path: str) -> "Simulation":
    """Replay the schedule with per-stage costs; per pipeline rank its memory (static + held activations)."""
    m = plan.microbatches
    timeline = sched.simulate(name, pp, m, costs, v_eff, link=_pp_link(profile, plan))
    held = timeline.peak_activation_bytes([f["activations"] for f in stage_figs])
    in_flight = timeline.in_flight()
    owner = sched.rank_stages(name, pp, v_eff)
    ranks = []
    for r in range(pp):
        mine = [stage_figs[s] for s in owner[r]]
        mem = {key: sum(f[key] for f in mine) for key in ("params", "grads", "optimizer_state", "buffers",
                                                          "step_state", "param_copies")}
        mem["activations"] = held.get(r, 0.0)
        mem["workspace"] = max(f["workspace"] for f in mine)
        per_step = sum(f["optimizer_s"] + f["dp_comm_s"] * dp_exposed for f in mine)
        ranks.append({"rank": r, "stages": owner[r], "layers": [f.get("layers") for f in mine],
                      "in_flight": [in_flight.get(s, 0) for s in owner[r]],
                      "memory": {k: int(round(x)) for k, x in mem.items()},
                      "peak_bytes": int(round(sum(mem.values()))),
                      "busy_s": timeline.busy_s(r), "per_step_s": per_step,
                      "dp_comm_s": sum(f["dp_comm_s"] for f in mine)})
    worst = max(ranks, key=lambda x: x["peak_bytes"])
    step = timeline.makespan + max(x["per_step_s"] for x in ranks)
    compute = max(x["busy_s"] for x in ranks)
    world = plan.dp * plan.tp * pp
    sim = Simulation(plan, profile.name, worst["rank"] * plan.dp * plan.tp, world, worst["memory"],
                     worst["peak_bytes"], f"pipeline rank {worst['rank']}", compute,
                     max(x["dp_comm_s"] for x in ranks), step, flops * m / (plan.tp * pp),
                     tokens_per_microbatch * m * plan.dp, capacity_bytes or profile.memory_capacity)
    sim.pp, sim.schedule, sim.virtual_stages = pp, name, v_eff
    sim.bubble_fraction = timeline.bubble_fraction
    sim.stages = ranks
    sim.pipeline_path = path
    sim.timeline = timeline
    return sim


def _graph_seconds(tg: TrainGraph, plan: Plan, profile: DeviceProfile, mesh: MeshDesc) -> tuple[float, float]:
    """(seconds, of which data-parallel collectives) of one run of a stage graph."""
    seconds, _, _ = graph_step_time(tg.graph, profile, world_size=mesh.world_size, allreduce_algo=_algo(plan),
                                    mesh=mesh)
    dp = sum(collective_node_time(n, profile, world_size=plan.dp, algorithm=_algo(plan))
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


def _pp_plan(flat: Plan, pp: int, schedule: str, v: int, split="cost") -> Plan:
    if not is_registered("pipeline_split"):
        raise SimulationError("no pipeline_split pass is registered")
    extra = {"pipeline_virtual_stages": v} if v > 1 else {}
    if split != "cost":
        extra["pipeline_split"] = split
    return flat.replace(pp=pp, pipeline_schedule=schedule, **extra)


def simulate_stage_programs(captured: TrainGraph, plan: Plan, *, profile: DeviceProfile, rank: int = 0,
                            tokens_per_microbatch: int, capacity_bytes: float | None = None,
                            layers: int | None = None) -> "Simulation":
    """A pp > 1 plan from the real stage programs ``pipeline_split`` compiles (the captured depth)."""
    depth = len(find_blocks(captured.graph).blocks)
    if layers is not None and layers != depth:
        raise SimulationError(f"the stage programs are compiled at the captured depth ({depth} blocks), "
                              f"not {layers}")
    mesh = MeshDesc.fake(dp=plan.dp, tp=plan.tp, pp=plan.pp, rank=rank)
    program = compile_program(captured, plan.replace(dump_dir=None), mesh)
    figs, costs = stage_program_figures(program, plan, profile)
    name = _SCHEDULE_ALIASES.get(plan.pipeline_schedule, plan.pipeline_schedule)
    v_eff = sched.stages_per_rank(name, plan.pipeline_virtual_stages)
    split = pipeline_split_of(program)
    return _pipeline_result(figs, costs, plan, pp=plan.pp, name=name, v_eff=v_eff, profile=profile, dp_exposed=1.0,
                            flops=model_flops(captured), tokens_per_microbatch=tokens_per_microbatch,
                            capacity_bytes=capacity_bytes,
                            path=f"stage programs: pipeline_split compiled {split.stages} stages "
                                 f"({split.split} split, imbalance {split.imbalance:.2f}), "
                                 f"schedule {name} replayed by cann_passes.schedules")
