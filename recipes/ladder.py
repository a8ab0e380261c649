"""The optimization ladder of a recipe: each technique added in turn, measured here and estimated at full size.

    python -m recipes.ladder llama                 # writes out/ladder/llama/{ladder.md,ladder.png,ladder.json}
    python -m recipes.ladder bert --steps 12 --no-gloo
    python -m recipes.ladder --list

Rungs, cumulative: baseline fp32 -> + bf16 -> + recompute -> + ZeRO-1 -> + gradient accumulation.
For every rung the report gives

- **measured on this CPU** (the family's small config, eager backend): the median step time, the
  peak bytes of live tensor storage during one step (every aten op's outputs tracked to their
  release; the model's parameters, optimizer state and batch included) and the loss curve over
  ``--steps`` steps from the same initial weights and batches. The ZeRO rungs need dp > 1: they run
  as 2 gloo processes on this machine (``--no-gloo``: estimated only, and the table says so).
- **estimated on the device profile** (``ascend_910b`` unless ``--profile``) at the family's full
  size (LLaMA-2-7B, BERT-large, GPT 7B, ...), for rank 0 of ``--dp`` data-parallel ranks: the
  step is captured on the meta device with fake tensors (nothing is allocated or run), compiled by
  the plan's torchair pipeline (``cann_passes.compile.compile_program`` with a fake mesh), and read
  by the project's analyses: per-rank peak memory (``graph_ir.analysis.memory_profile`` of every
  graph of the program) and the step time (``cann_passes.cost_model``: roofline per op,
  alpha-beta per collective, summed over the program's schedule, microbatches included).
  Compiling a 32-layer graph takes minutes on 2 shared cores, so by default the full-width model
  is captured at 2 and 4 layers and every figure is extrapolated linearly in depth
  (``--full-layers N`` captures N layers directly; ``0`` captures the real depth).
- **precision against the fp32 rung**: the largest and the final absolute deviation of the loss
  curve from the fp32 run's.

Adapter interface: how a recipe plugs in
----------------------------------------
A recipe ``recipes/<name>/`` joins the ladder by providing ``recipes/<name>/ladder.py`` with a
function ``family() -> Family`` (nothing here needs editing: ``python -m recipes.ladder <name>``
imports it). A :class:`Family` says, in plain callables:

``name``, ``title``                 the family's key and display name
``small_model()``                   the CPU-sized model (called after ``torch.manual_seed``)
``small_batches(n)``                ``n`` real global batches for it (rows divisible by 2 for dp=2)
``loss_fn(model, batch)``           a scalar loss, as for ``compile_for_npu``
``full_model(layers)``              the full-size model with ``layers`` blocks (``None``: the real
                                    depth); called under ``torch.device("meta")``
``full_batch()``                    one rank's batch at full size, also called under meta (its rows
                                    must divide by the accumulation rung's microbatches)
``full_name``, ``full_layers``      e.g. "LLaMA-2-7B", 32
``make_optimizer(params)``          default: AdamW(lr=1e-3, weight_decay=0.1)
``recompute``                       the recompute rung's policy (default "selective")
``plans_dir``                       the recipe's ``plans/`` (for :func:`compile_plans`)

GPT is built in below (its recipe predates this layout).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from cann_passes import Plan, compile_for_npu
from cann_passes.compile import compile_program
from cann_passes.cost_model import get_profile, graph_time
from graph_ir import capture_train_step
from graph_ir.analysis import memory_profile
from graph_ir.mesh import MeshDesc
from graph_ir.program import EVERY_MICROBATCH

GiB, MiB = 2**30, 2**20
GLOO_DP = 2            # the ZeRO rungs measured here: 2 local processes
EXTRAPOLATE_FROM = (2, 4)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


@dataclass
class Family:
    name: str
    title: str
    small_model: Callable[[], torch.nn.Module]
    small_batches: Callable[[int], list]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    full_model: Callable[[int | None], torch.nn.Module]
    full_batch: Callable[[], Any]
    full_name: str
    full_layers: int
    make_optimizer: Callable[[Any], torch.optim.Optimizer] = _adamw
    recompute: str = "selective"
    plans_dir: Path | None = None


@dataclass(frozen=True)
class Rung:
    key: str
    label: str
    changes: dict


def rungs(family: Family, dp: int) -> list[tuple[Rung, dict]]:
    """Each rung with its cumulative plan fields (``dp`` is the data-parallel degree of the ZeRO rungs)."""
    ladder = [Rung("fp32", "baseline fp32", {}),
              Rung("bf16", "+ bf16", {"precision": "bf16"}),
              Rung("recompute", f"+ recompute ({family.recompute})", {"recompute": family.recompute}),
              Rung("zero", "+ ZeRO-1", {"dp": dp, "zero_stage": 1}),
              Rung("accumulation", "+ accumulation x4", {"microbatches": 4})]
    fields, out = {}, []
    for rung in ladder:
        fields = {**fields, **rung.changes}
        out.append((rung, dict(fields)))
    return out


# -- families --------------------------------------------------------------------------------------

def adamw(lr: float = 1e-3, weight_decay: float = 0.1, *, trainable_only: bool = False):
    """A ``make_optimizer`` for :class:`Family`: AdamW over the parameters (only the trainable ones
    with ``trainable_only``: a frozen tower is not the optimizer's)."""
    def make(params):
        params = [p for p in params if p.requires_grad] if trainable_only else params
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return make


def token_family(name: str, title: str, *, model, small_cfg, full_cfg, loss_fn, batches, small_shape: tuple,
                 full_shape: tuple, full_name: str, plans_dir: Path, layers_field: str = "num_hidden_layers"
                 ) -> Family:
    """A family whose batch is a pair of (rows, seq) token tensors (causal or masked LM).

    ``model(cfg)`` builds it from a dataclass config whose depth is ``layers_field``;
    ``batches(tokens, rows, seq, seed=, num_batches=)`` draws the small batches from the shipped corpus.
    """
    from recipes.data import load_corpus
    (small_rows, small_seq), (full_rows, full_seq) = small_shape, full_shape

    def full_model(layers):
        return model(dataclasses.replace(full_cfg, **{layers_field: layers}) if layers else full_cfg)

    def full_batch():
        ids = torch.zeros(full_rows, full_seq, dtype=torch.long)
        return ids, ids

    return Family(name=name, title=title, small_model=lambda: model(small_cfg),
                  small_batches=lambda n: list(batches(load_corpus(), small_rows, small_seq, seed=0, num_batches=n)),
                  loss_fn=loss_fn, full_model=full_model, full_batch=full_batch,
                  full_name=f"{full_name} (seq {full_seq}, batch {full_rows} per rank)",
                  full_layers=getattr(full_cfg, layers_field), plans_dir=plans_dir)


def _gpt_family() -> Family:
    from recipes.data import TextBatches
    from recipes.models.gpt import GPT, gpt_7b, gpt_loss, gpt_small_cpu
    return token_family("gpt", "GPT", model=GPT, small_cfg=gpt_small_cpu(seq_len=64), full_cfg=gpt_7b(),
                        loss_fn=gpt_loss, batches=TextBatches, small_shape=(8, 64), full_shape=(4, 2048),
                        full_name="GPT 7B (32 x 4096)", plans_dir=Path(__file__).with_name("plans"),
                        layers_field="n_layer")


def family(name: str) -> Family:
    """The registered family ``name``: built in (gpt) or ``recipes.<name>.ladder.family()``."""
    if name == "gpt":
        return _gpt_family()
    try:
        module = importlib.import_module(f"recipes.{name}.ladder")
    except ModuleNotFoundError as exc:
        if exc.name not in (f"recipes.{name}", f"recipes.{name}.ladder"):
            raise
        raise SystemExit(f"ladder: no family '{name}': expected recipes/{name}/ladder.py with a family() "
                         f"function; known: {', '.join(known_families())}") from None
    return module.family()


def known_families() -> list[str]:
    here = Path(__file__).parent
    return ["gpt"] + sorted(p.parent.name for p in here.glob("*/ladder.py"))


# -- measuring on this CPU -------------------------------------------------------------------------

class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storage alive while it is active: the outputs of every aten op, each
    counted until its storage is released, on top of ``resident`` (storages that existed before).

    Why not the process RSS: it includes the Python heap and freed pages the allocator keeps, and
    cannot be reset between rungs; storage lifetimes are what a graph's memory plan controls.
    """

    def __init__(self, resident: int = 0):
        super().__init__()
        self.resident, self.current, self.peak = resident, 0, 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._preexisting: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage._cdata not in self._live and storage._cdata not in self._preexisting:
                    self._live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out

    def track(self, preexisting: list[torch.Tensor]) -> "PeakTensorMemory":
        self._preexisting = {t.untyped_storage()._cdata for t in preexisting}
        self.resident = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                             for t in preexisting}.values())
        return self

    @property
    def peak_bytes(self) -> int:
        return self.resident + self.peak


def _resident_tensors(model, optimizer, batch) -> list[torch.Tensor]:
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    batch_leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *state, *batch_leaves]


def measure_rung(fam: Family, plan: Plan, batches: list, *, seed: int = 0, world=None) -> dict:
    """Train ``len(batches)`` steps of the small model with ``plan``; time, memory and losses."""
    from cann_passes.runtime.distributed import shard_batch
    torch.manual_seed(seed)
    model = fam.small_model()
    optimizer = fam.make_optimizer(model.parameters())
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=fam.loss_fn)
    losses, seconds, cpu_seconds, peak = [], [], [], None
    for i, batch in enumerate(batches):
        if world is not None:
            batch = shard_batch(batch, world.dp_rank, world.dp_size)
        if i == 1:      # after the first step: compiled, optimizer state allocated
            with PeakTensorMemory().track(_resident_tensors(model, optimizer, batch)) as tracker:
                loss = step(batch)
            peak = tracker.peak_bytes
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(batch)
            seconds.append(time.perf_counter() - t0)
            cpu_seconds.append(time.process_time() - c0)
        losses.append(float(loss))
    memory = step.last.memory
    return {"losses": losses, "compile_seconds": seconds[0], "step_seconds": statistics.median(seconds[1:]),
            "step_cpu_seconds": statistics.median(cpu_seconds[1:]),
            "peak_bytes": peak, "graph_peak_bytes": memory.peak_bytes, "where": "this CPU"}


def _measure_distributed(fam: Family, plans: dict[str, dict], steps: int, seed: int,
                         timeout_s: float) -> dict[str, dict]:
    """The dp rungs on ``GLOO_DP`` local gloo processes; rank 0's figures."""
    from cann_passes.runtime.distributed import launch_local
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"family": fam.name, "plans": plans, "steps": steps, "seed": seed,
                                    "result": str(Path(tmp) / "result.json")}))
        results = launch_local(["-m", "recipes.ladder", "--worker", str(spec)], GLOO_DP, timeout_s=timeout_s,
                               cwd=str(Path(__file__).resolve().parents[1]))
        failed = [r for r in results if r.returncode != 0]
        if failed:
            tail = (failed[0].stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(f"gloo ranks failed (return codes {[r.returncode for r in results]}): "
                               + " | ".join(tail))
        return json.loads((Path(tmp) / "result.json").read_text())


def _worker(spec_path: str) -> None:
    from cann_passes.runtime.distributed import init_distributed
    spec = json.loads(Path(spec_path).read_text())
    # The ranks share this machine's cores: more threads than cores only adds spin-waits.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // GLOO_DP))
    fam = family(spec["family"])
    batches = fam.small_batches(spec["steps"])
    out = {}
    plans = {key: Plan.from_dict(fields) for key, fields in spec["plans"].items()}
    with init_distributed(next(iter(plans.values()))) as world:
        for key, plan in plans.items():
            out[key] = measure_rung(fam, plan, batches, seed=spec["seed"], world=world)
            out[key]["where"] = f"this CPU, {world.dp_size} gloo processes"
        if world.rank == 0:
            Path(spec["result"]).write_text(json.dumps(out))


# -- estimating at full size -----------------------------------------------------------------------

def _rows(batch) -> int:
    return next(t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)).shape[0]


def _microbatch(batch, n: int):
    rows = _rows(batch)
    if rows % n:
        raise ValueError(f"the full-size batch has {rows} rows, which do not split into {n} microbatches")
    return pytree.tree_map(lambda t: t[: rows // n] if isinstance(t, torch.Tensor) else t, batch)


def _capture_full(fam: Family, layers: int | None, microbatches: int):
    with torch.device("meta"):
        model = fam.full_model(layers)
        batch = fam.full_batch()
    optimizer = fam.make_optimizer(model.parameters())
    if microbatches > 1:
        batch = _microbatch(batch, microbatches)
    captured, _ = capture_train_step(model, optimizer, fam.loss_fn, batch)
    return captured


def _program_figures(captured, plan: Plan, dp: int, profile) -> dict:
    plan = plan.replace(dp=dp, verify="off", backend="torchair", dump_dir=None)
    mesh = MeshDesc.fake(dp=dp)
    program = compile_program(captured, plan, mesh, backend="torchair")
    peak, seconds = 0, 0.0
    per_graph = {}
    for run in program.schedule:
        graph = program[run.graph]
        times = plan.microbatches if run.every == EVERY_MICROBATCH else 1
        seconds += times * graph_time(graph.graph.nodes, profile, world_size=dp)
        peak = max(peak, memory_profile(graph.graph).peak_bytes)
    for name, state in program.state_bytes().items():
        per_graph[name] = dataclasses.asdict(state)
    return {"peak_bytes": peak, "step_seconds": seconds, "state_bytes": per_graph}


def _extrapolate(a: dict, b: dict, la: int, lb: int, target: int) -> dict:
    """Every number of ``a`` (at ``la`` layers) and ``b`` (at ``lb``), continued linearly to ``target``."""
    if isinstance(a, dict):
        return {k: _extrapolate(a[k], b[k], la, lb, target) for k in a}
    return a + (b - a) * (target - la) / (lb - la)


class FullSizeEstimator:
    """Captures the full-size model once per batch shape and depth, compiles per rung."""

    def __init__(self, fam: Family, *, dp: int, profile: str, layers: int | None, captures: dict | None = None):
        self.fam, self.dp, self.profile = fam, dp, get_profile(profile)
        self.layers = layers   # None: extrapolate from EXTRAPOLATE_FROM; 0: real depth; N: N layers
        # (layers, microbatches) -> captured step; estimators of one family may share it.
        self._captures: dict[tuple, Any] = {} if captures is None else captures

    def _captured(self, layers, microbatches):
        key = (layers, microbatches)
        if key not in self._captures:
            self._captures[key] = _capture_full(self.fam, layers, microbatches)
        return self._captures[key]

    @property
    def method(self) -> str:
        if self.layers is None:
            la, lb = EXTRAPOLATE_FROM
            return f"captured at {la} and {lb} layers, extrapolated linearly to {self.fam.full_layers}"
        depth = self.layers or self.fam.full_layers
        return f"captured at {depth} layers" + ("" if depth == self.fam.full_layers else
                                                 f" (the full model has {self.fam.full_layers})")

    def estimate(self, fields: dict) -> dict:
        plan = _plan(fields)
        dp = self.dp if plan.dp > 1 else 1
        mb = plan.microbatches
        if self.layers is None:
            la, lb = EXTRAPOLATE_FROM
            a = _program_figures(self._captured(la, mb), plan, dp, self.profile)
            b = _program_figures(self._captured(lb, mb), plan, dp, self.profile)
            out = _extrapolate(a, b, la, lb, self.fam.full_layers)
        else:
            out = _program_figures(self._captured(self.layers or None, mb), plan, dp, self.profile)
        out.update(dp=dp, profile=self.profile.name, capacity_bytes=self.profile.memory_capacity)
        return out


def _plan(fields: dict, **extra) -> Plan:
    return Plan.from_dict({**fields, **extra})


# -- the ladder ------------------------------------------------------------------------------------

def run_ladder(fam: Family, *, steps: int = 16, dp: int = 8, profile: str = "ascend_910b",
               full_layers: int | None = None, gloo: bool = True, seed: int = 0,
               gloo_timeout_s: float = 900.0, log=print, captures: dict | None = None) -> dict:
    """Measure and estimate every rung; returns the report's data (see :func:`write_report`).

    ``captures``: the full-size captures to reuse and fill (see :class:`FullSizeEstimator`)."""
    if steps < 4:
        raise ValueError(f"steps={steps}: the ladder needs at least 4 steps (compile, memory, timing)")
    batches = fam.small_batches(steps)
    estimator = FullSizeEstimator(fam, dp=dp, profile=profile, layers=full_layers, captures=captures)
    results, dist_rungs = [], {}
    for rung, fields in rungs(fam, GLOO_DP):
        entry = {"key": rung.key, "label": rung.label, "plan": fields, "measured": None}
        if fields.get("dp", 1) > 1:
            dist_rungs[rung.key] = {**fields, "backend": "eager"}
        else:
            log(f"[{fam.name}] {rung.label}: measuring on this CPU ({steps} steps)")
            entry["measured"] = measure_rung(fam, _plan(fields, backend="eager"), batches, seed=seed)
        results.append(entry)
    if dist_rungs:
        if gloo:
            log(f"[{fam.name}] {', '.join(dist_rungs)}: measuring on {GLOO_DP} gloo processes")
            try:
                measured = _measure_distributed(fam, dist_rungs, steps, seed, gloo_timeout_s)
                for entry in results:
                    entry["measured"] = measured.get(entry["key"], entry["measured"])
            except RuntimeError as exc:
                log(f"[{fam.name}] gloo measurement failed, estimates only: {exc}")
                for entry in results:
                    if entry["key"] in dist_rungs:
                        entry["measured_error"] = str(exc)
        else:
            for entry in results:
                if entry["key"] in dist_rungs:
                    entry["measured_error"] = "not measured (--no-gloo): dp > 1 needs several processes"
    for entry, (rung, fields) in zip(results, rungs(fam, dp)):
        log(f"[{fam.name}] {rung.label}: estimating at full size ({estimator.method})")
        t0 = time.perf_counter()
        try:
            entry["estimated"] = estimator.estimate(fields)
        except Exception as exc:      # a compiler failure is a finding of the ladder, not its end
            entry["estimated"] = None
            entry["estimated_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
            log(f"[{fam.name}]   failed: {entry['estimated_error']}")
        entry["estimate_seconds"] = time.perf_counter() - t0
    base = results[0]["measured"]["losses"]
    for entry in results:
        m = entry["measured"]
        if m:
            dev = [abs(a - b) for a, b in zip(m["losses"], base)]
            m["max_loss_deviation"], m["final_loss_deviation"] = max(dev), dev[-1]
    return {"family": fam.name, "title": fam.title, "full_name": fam.full_name, "steps": steps,
            "dp_full": dp, "dp_measured": GLOO_DP, "profile": profile, "estimate_method": estimator.method,
            "rungs": results}


# -- the report ------------------------------------------------------------------------------------

def _fmt(value, scale=1.0, digits=1, unit=""):
    return "—" if value is None else f"{value / scale:,.{digits}f}{unit}"


def markdown(report: dict) -> str:
    lines = [f"# {report['title']} optimization ladder", "",
             f"Measured on this CPU: the recipe's small config, {report['steps']} steps from the same "
             f"weights and batches (eager backend; dp rungs on {report['dp_measured']} gloo processes). "
             f"Estimated: {report['full_name']} on `{report['profile']}`, rank 0 of dp={report['dp_full']} "
             f"for the ZeRO rungs, fake-tensor capture on meta ({report['estimate_method']}), memory "
             "analysis + cost model of the compiled (torchair-pipeline) graphs.", "",
             "| rung | CPU step wall / process time (ms) | CPU peak (MiB) | CPU graph est. (MiB) | loss dev. vs fp32 max / final | "
             f"{report['profile']} per-rank peak (GiB) | params / grads / opt state / saved act. (GiB) | "
             f"{report['profile']} step (ms) |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    notes = []
    for r in report["rungs"]:
        m, e = r["measured"], r.get("estimated")
        if m:
            cpu = (f"{_fmt(m['step_seconds'], 1e-3, 0)} / {_fmt(m['step_cpu_seconds'], 1e-3, 0)} | "
                   f"{_fmt(m['peak_bytes'], MiB)} | "
                   f"{_fmt(m['graph_peak_bytes'], MiB)} | {m['max_loss_deviation']:.2e} / "
                   f"{m['final_loss_deviation']:.2e}")
            if m["where"] != "this CPU":
                notes.append(f"{r['label']}: measured on {m['where']}, rank 0's figures (each rank steps "
                             "on its half of the global batch; the loss is the global one).")
        else:
            cpu = "not measured | — | — | —"
            notes.append(f"{r['label']}: {r.get('measured_error', 'not measured')}; estimate only.")
        if e:
            state = e["state_bytes"].get("step") or e["state_bytes"].get("grad") or {}
            apply_state = e["state_bytes"].get("apply") or state
            parts = (state.get("params", 0), state.get("grads", 0), apply_state.get("optimizer_state", 0),
                     state.get("activations", 0))
            fits = "" if e["peak_bytes"] <= e["capacity_bytes"] else " (over capacity)"
            est = (f"{_fmt(e['peak_bytes'], GiB)}{fits} | {' / '.join(_fmt(p, GiB) for p in parts)} | "
                   f"{_fmt(e['step_seconds'], 1e-3, 0)}")
        else:
            est = "failed | — | —"
            notes.append(f"{r['label']}: full-size compile failed: {r.get('estimated_error')}")
        lines.append(f"| {r['label']} | {cpu} | {est} |")
    lines += ["", "Plans (cumulative): " + "; ".join(
        f"{r['label']}: `{json.dumps(r['plan'], sort_keys=True)}`" for r in report["rungs"])]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines += ["", "CPU step: median wall-clock and process CPU time of a step (the machine is shared: the "
              "process time is the steadier figure). CPU peak: live tensor storage during one step (parameters, optimizer state and batch "
              "included). CPU graph est.: the memory analysis of the same compiled graph. On the device "
              "profile, time is the roofline/alpha-beta estimate of the final graphs, not a measurement.", "",
              f"![{report['title']} ladder](ladder.png)", ""]
    return "\n".join(lines)


def chart(report: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = report["rungs"]
    labels = [r["label"].replace(" (", "\n(") for r in rs]
    x = range(len(rs))

    def bars(ax, values, title, ylabel, color, capacity=None):
        ax.bar(x, [v if v is not None else 0 for v in values], color=color)
        for i, v in enumerate(values):
            if v is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=7)
        if capacity:
            ax.axhline(capacity, color="red", ls="--", lw=1, label="device memory")
            ax.legend(fontsize=7)
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
        ax.set(title=title, ylabel=ylabel)

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    m = [r["measured"] for r in rs]
    e = [r.get("estimated") for r in rs]
    bars(axes[0, 0], [v and v["step_cpu_seconds"] * 1e3 for v in m], "CPU step, process time (small config)",
         "ms", "C0")
    bars(axes[0, 1], [v and v["peak_bytes"] / MiB for v in m], "CPU peak tensor memory (measured)", "MiB", "C0")
    ax = axes[0, 2]
    for r in rs:
        if r["measured"]:
            ax.plot(r["measured"]["losses"], lw=1, label=r["label"])
    ax.set(title="loss curves (CPU)", xlabel="step", ylabel="loss")
    ax.legend(fontsize=7)
    cap = e[0]["capacity_bytes"] / GiB if e[0] else None
    bars(axes[1, 0], [v and v["step_seconds"] * 1e3 for v in e], f"{report['profile']} step time (estimated)",
         "ms", "C1")
    bars(axes[1, 1], [v and v["peak_bytes"] / GiB for v in e], f"{report['profile']} per-rank peak (estimated)",
         "GiB", "C1", capacity=cap)
    bars(axes[1, 2], [v and max(v["max_loss_deviation"], 1e-9) for v in m], "loss deviation vs fp32 (max)",
         "|loss - loss_fp32|", "C2")
    axes[1, 2].set_yscale("log")
    fig.suptitle(f"{report['title']} ladder — CPU small config (top), {report['full_name']} estimate (bottom)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "ladder.json", "markdown": out / "ladder.md", "chart": out / "ladder.png"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["markdown"].write_text(markdown(report))
    chart(report, paths["chart"])
    return paths


# -- every plan of a recipe compiles ----------------------------------------------------------------

def compile_plan(fam: Family, plan: Plan, *, run: bool = True):
    """Compile the small model's step with ``plan``; run one step when it needs no other process.

    Plans with dp > 1 are compiled for rank 0 of a fake mesh (what each rank of a torchrun launch
    compiles; nothing runs). Returns the loss of the step run, or the compiled program.
    """
    torch.manual_seed(0)
    model = fam.small_model()
    optimizer = fam.make_optimizer(model.parameters())
    batch = fam.small_batches(1)[0]
    if plan.dp > 1:
        from cann_passes.runtime.distributed import shard_batch
        captured, _ = capture_train_step(model, optimizer, fam.loss_fn, shard_batch(batch, 0, plan.dp))
        return compile_program(captured, plan, MeshDesc.fake(dp=plan.dp))
    step = compile_for_npu(model, plan, optimizer=optimizer, loss_fn=fam.loss_fn)
    return step(batch) if run else step.compile(batch)


# -- command line ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return 0
    p = argparse.ArgumentParser(prog="python -m recipes.ladder", description=__doc__.splitlines()[0])
    p.add_argument("family", nargs="?", help="gpt, llama, bert, ... (--list)")
    p.add_argument("--list", action="store_true", help="list the registered families")
    p.add_argument("--out", default=None, help="output directory (default out/ladder/<family>)")
    p.add_argument("--steps", type=int, default=16, help="steps per rung on this CPU")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks of the full-size ZeRO rungs")
    p.add_argument("--profile", default="ascend_910b", help="device profile of the estimates")
    p.add_argument("--full-layers", type=int, default=None,
                   help="capture N layers at full width (0: the real depth); default: extrapolate from 2 and 4")
    p.add_argument("--no-gloo", action="store_true", help="do not launch gloo processes for the dp rungs")
    args = p.parse_args(argv)
    if args.list or not args.family:
        print("\n".join(known_families()))
        return 0
    fam = family(args.family)
    out = Path(args.out or os.path.join("out", "ladder", fam.name))
    t0 = time.perf_counter()
    report = run_ladder(fam, steps=args.steps, dp=args.dp, profile=args.profile, full_layers=args.full_layers,
                        gloo=not args.no_gloo)
    paths = write_report(report, out)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
