"""Simulate one training step of a plan at any scale, in one process: memory and time per rank.

The captured step (usually of a model built on ``meta`` and captured with fake
tensors) is compiled by the plan's own pipeline (:func:`cann_passes.compile.compile_program`)
for one rank of a fake mesh (:meth:`graph_ir.mesh.MeshDesc.fake`, no process
group); :mod:`cann_passes.figures` reads the memory and time of every graph of the program
that rank would run (what is modelled and what is not is said there), and this module puts
them together: per-rank memory and step time, MFU and tokens/s, and pipelines.

Pipeline parallelism: see the section at the end (two paths: the real stage programs of
``pipeline_split``, or stages composed from the pp = 1 program's blocks at any depth).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from graph_ir.analysis.structure import find_blocks
from graph_ir.mesh import MeshDesc
from graph_ir.pipeline_info import pipeline_split_of
from graph_ir.train_graph import TrainGraph

from . import schedules as sched
from .compile import compile_program
from .cost_model import DeviceProfile, get_profile
from .figures import (_FIG_KEYS, GB, MODELLED, NOT_MODELLED, POST, PRE, Segments,  # noqa: F401  (re-exported)
                      SimulationError, graph_step_time, model_flops, program_figures, segment_figures,
                      stage_program_figures, write_simulation)
from .pass_manager import is_registered
from .plan import Plan
from .stage_balance import balance

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
    return MeshDesc.fake(dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep, rank=rank)


def _finish(figures: dict, plan: Plan, profile: DeviceProfile, flops: float, tokens_per_microbatch: int,
            rank: int, capacity_bytes: float | None = None) -> Simulation:
    memory = {k: int(round(v)) for k, v in figures["memory"].items()}
    peak_graph = max(figures["peaks"], key=figures["peaks"].get)
    # cp ranks split each dp rank's sequences: the same tokens, their FLOPs shared out like tp's
    world = plan.dp * plan.cp * plan.tp
    tokens = tokens_per_microbatch * plan.microbatches * plan.dp
    return Simulation(plan, profile.name, rank, world, memory, int(round(figures["peaks"][peak_graph])),
                      peak_graph, figures["compute"], figures["comm"], figures["step"],
                      flops * plan.microbatches / (plan.tp * plan.cp), tokens, capacity_bytes or profile.memory_capacity,
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

_SCHEDULE_ALIASES = {"zero_bubble": "zb1p"}
def _pp_link(profile: DeviceProfile, plan: Plan) -> tuple[float, float]:
    """Latency and bandwidth between neighbouring stages: ranks dp x cp x tp apart in the (pp, dp, cp, tp) mesh."""
    if plan.dp * plan.cp * plan.tp < profile.devices_per_node:
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
    world = plan.dp * plan.cp * plan.tp * pp
    sim = Simulation(plan, profile.name, worst["rank"] * plan.dp * plan.cp * plan.tp, world, worst["memory"],
                     worst["peak_bytes"], f"pipeline rank {worst['rank']}", compute,
                     max(x["dp_comm_s"] for x in ranks), step, flops * m / (plan.tp * plan.cp * pp),
                     tokens_per_microbatch * m * plan.dp, capacity_bytes or profile.memory_capacity)
    sim.pp, sim.schedule, sim.virtual_stages = pp, name, v_eff
    sim.bubble_fraction = timeline.bubble_fraction
    sim.stages = ranks
    sim.pipeline_path = path
    sim.timeline = timeline
    return sim


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
    mesh = MeshDesc.fake(dp=plan.dp, cp=plan.cp, tp=plan.tp, pp=plan.pp, ep=plan.ep, rank=rank)
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
