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
  (``cost_model.node_time``); each collective starts on the communication
  stream once its inputs are ready and the stream is free, and costs the
  alpha-beta time of the profile's links; a value produced by a collective is
  ready when the collective ends, so compute waits only where it reads it
  (overlap exactly as far as the node order allows, no more). Graphs run as
  the program's schedule says (per microbatch or per step), one after another.
- MFU: the captured step's matmul/attention FLOPs (torch's flop counter,
  before recompute; divided by ``tp``) per rank and second, over the profile's
  matrix rate in the plan's compute dtype. tokens/s counts every rank's tokens.

What is not modelled
- Pipeline parallelism: ``pp > 1`` is refused (no stages, no bubbles yet).
- Communication buffers are not a separate term: they are inside the peak.
- Allocator fragmentation, workspace memory, framework/runtime reserve,
  host-device transfer, data loading, kernel fusion by the backend (the
  roofline is per aten node), contention between overlapping collectives and
  compute for memory bandwidth.
- Only the simulated rank (rank 0 unless asked): dp/tp ranks are symmetric in
  these plans except ZeRO's padding of the last shard.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx

from graph_ir.analysis import memory_profile
from graph_ir.analysis.cost import node_cost
from graph_ir.analysis.memory import aliases_input
from graph_ir.mesh import MeshDesc
from graph_ir.program import EVERY_MICROBATCH, Program
from graph_ir.train_graph import TrainGraph

from .compile import compile_program
from .cost_model import DeviceProfile, get_profile, node_time
from .cost_model.collectives import collective_kind, collective_node_time, is_collective
from .plan import Plan

GB = 1e9   # decimal, as device memory is sold (64 GB)
MEMORY_TERMS = ("params", "grads", "optimizer_state", "activations", "buffers", "step_state")
PERSISTENT = ("params", "optimizer_state", "buffers", "step_state")   # inputs that live across graphs

MODELLED = ("memory: per-graph state bytes read from the compiled program; peak = memory analysis "
            "under node order + persistent state that is not an input of that graph; "
            "time: compute roofline per aten node, collectives alpha-beta on the profile's links, "
            "a collective overlaps the compute that follows it in node order until its output is read")
NOT_MODELLED = ("pipeline parallelism and its bubbles (pp is not built), allocator fragmentation and "
                "runtime reserve, backend kernel fusion, data loading, bandwidth contention of "
                "overlapped communication")


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
        return max(MEMORY_TERMS, key=lambda k: self.memory[k])

    def to_json(self) -> dict:
        return {"plan": self.plan.to_dict(), "profile": self.profile, "rank": self.rank,
                "world_size": self.world_size, "memory": self.memory, "peak_bytes": self.peak_bytes,
                "peak_graph": self.peak_graph, "fits": self.fits, "headroom": self.headroom,
                "compute_seconds": self.compute_seconds, "comm_seconds": self.comm_seconds,
                "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "tokens_per_second_per_device": self.tokens_per_second_per_device, "mfu": self.mfu(),
                "model_flops": self.model_flops, "largest_term": self.largest_term,
                "modelled": MODELLED, "not_modelled": NOT_MODELLED}

    def breakdown(self) -> str:
        """Per-rank memory and time, one term a line, the largest memory term marked."""
        largest = self.largest_term
        lines = [f"rank {self.rank} of {self.world_size} on {self.profile} "
                 f"({self.capacity_bytes / GB:.1f} GB): peak {self.peak_bytes / GB:.2f} GB "
                 f"in graph '{self.peak_graph}', {'fits' if self.fits else 'DOES NOT FIT'}"]
        for term in MEMORY_TERMS:
            mark = "   <- largest" if term == largest else ""
            lines.append(f"  {term:<16}{self.memory[term] / GB:>10.3f} GB{mark}")
        lines.append(f"  step {self.step_seconds * 1e3:.1f} ms = compute {self.compute_seconds * 1e3:.1f} ms "
                     f"+ exposed comm {self.exposed_comm_seconds * 1e3:.1f} ms (comm total "
                     f"{self.comm_seconds * 1e3:.1f} ms); MFU {self.mfu():.1%}; "
                     f"{self.tokens_per_second_per_device:,.0f} tokens/s/device")
        return "\n".join(lines)


def _is_sync(node: torch.fx.Node) -> bool:
    """wait_tensor and friends: no time of their own, their output is ready with their input."""
    return is_collective(node) and collective_kind(node) is None


def graph_step_time(graph: torch.fx.Graph, profile: DeviceProfile, *, world_size: int,
                    allreduce_algo: str = "ring") -> tuple[float, float, float]:
    """(seconds with overlap, compute stream seconds, communication seconds) of one run of ``graph``."""
    ready: dict[torch.fx.Node, float] = {}
    compute_free = comm_free = 0.0
    compute_total = comm_total = 0.0
    for node in graph.nodes:
        start = max((ready[a] for a in node.all_input_nodes), default=0.0)
        if node.op != "call_function" or aliases_input(node) or _is_sync(node):
            ready[node] = start
        elif is_collective(node):
            seconds = profile.op_overhead + collective_node_time(node, profile, world_size=world_size,
                                                                 algorithm=allreduce_algo)
            comm_free = max(comm_free, start) + seconds
            comm_total += seconds
            ready[node] = comm_free
        else:
            seconds = node_time(node, profile, world_size=world_size)
            compute_free = max(compute_free, start) + seconds
            compute_total += seconds
            ready[node] = compute_free
    return max(compute_free, comm_free), compute_total, comm_total


def model_flops(captured: TrainGraph) -> float:
    """Matrix-unit FLOPs of one captured step (forward + backward + update, no recompute)."""
    total = 0.0
    for node in captured.graph.nodes:
        if node.op == "call_function" and not is_collective(node):
            cost = node_cost(node)
            if cost.matmul:
                total += cost.flops
    return total


def _algo(plan: Plan) -> str:
    return plan.allreduce_algo if plan.allreduce_algo in ("ring", "tree") else "ring"


def program_figures(program: Program, plan: Plan, profile: DeviceProfile) -> dict:
    """The raw per-rank numbers of a compiled program (linear in depth, see ``extrapolate``)."""
    states = {name: dataclasses.asdict(s) for name, s in program.state_bytes().items()}
    persistent = {k: max(s[k] for s in states.values()) for k in PERSISTENT}
    memory = {k: max(s[k] for s in states.values()) for k in MEMORY_TERMS}
    world = program.mesh.world_size
    peaks, compute, comm, step = {}, 0.0, 0.0, 0.0
    for run in program.schedule:
        graph = program[run.graph]
        times = plan.microbatches if run.every == EVERY_MICROBATCH else 1
        missing = sum(max(0, persistent[k] - states[run.graph][k]) for k in PERSISTENT)
        peaks[run.graph] = memory_profile(graph.graph).peak_bytes + missing
        seconds, busy, moved = graph_step_time(graph.graph, profile, world_size=world, allreduce_algo=_algo(plan))
        step += times * seconds
        compute += times * busy
        comm += times * moved
    return {"memory": memory, "peaks": peaks, "compute": compute, "comm": comm, "step": step,
            "per_graph": states}


def extrapolate(a, b, la: int, lb: int, target: int):
    """Every number of ``a`` (measured at ``la`` layers) and ``b`` (at ``lb``), continued linearly."""
    if isinstance(a, dict):
        return {k: extrapolate(a[k], b[k], la, lb, target) for k in a}
    return a + (b - a) * (target - la) / (lb - la)


def check_plan(plan: Plan) -> None:
    if plan.pp > 1:
        raise SimulationError(f"pp={plan.pp}: pipeline parallelism is not built yet, so neither its "
                              "stages nor its bubbles can be simulated (rule: pp must be 1)")


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
             tokens_per_microbatch: int, rank: int = 0, capacity_bytes: float | None = None) -> Simulation:
    """Compile ``captured`` (one microbatch of one dp rank) with ``plan`` for ``rank``; its memory and time.

    ``tokens_per_microbatch``: the tokens of the captured batch (rows x sequence).
    """
    check_plan(plan)
    profile = get_profile(profile) if isinstance(profile, str) else profile
    program = compile_program(captured, plan.replace(dump_dir=None), mesh_for(plan, rank))
    figures = program_figures(program, plan, profile)
    return _finish(figures, plan, profile, model_flops(captured), tokens_per_microbatch, rank, capacity_bytes)


def simulate_extrapolated(captures: dict[int, TrainGraph], layers: int, plan: Plan, *,
                          profile: str | DeviceProfile = "ascend_910b", tokens_per_microbatch: int,
                          rank: int = 0, capacity_bytes: float | None = None) -> Simulation:
    """:func:`simulate` at ``layers`` layers from two captures of the same model at smaller depths.

    ``captures`` maps depth -> captured step (exactly two depths). Every figure is continued
    linearly in depth; this is exact for per-layer terms (parameters, states, kept activations,
    per-layer compute and collectives) and holds for the peak as long as the peak's place in the
    step does not move with depth (tests/planner checks it against a full capture at small size).
    """
    check_plan(plan)
    if len(captures) != 2:
        raise SimulationError(f"extrapolation needs captures at two depths, got {sorted(captures)}")
    profile = get_profile(profile) if isinstance(profile, str) else profile
    (la, ca), (lb, cb) = sorted(captures.items())
    fa = program_figures(compile_program(ca, plan.replace(dump_dir=None), mesh_for(plan, rank)), plan, profile)
    fb = program_figures(compile_program(cb, plan.replace(dump_dir=None), mesh_for(plan, rank)), plan, profile)
    if set(fa["peaks"]) != set(fb["peaks"]):
        raise SimulationError("the two depths compiled to different programs; cannot extrapolate")
    figures = extrapolate(fa, fb, la, lb, layers)
    flops = extrapolate(model_flops(ca), model_flops(cb), la, lb, layers)
    return _finish(figures, plan, profile, flops, tokens_per_microbatch, rank, capacity_bytes)
