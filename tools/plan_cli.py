"""cann-plan: choose a training plan for a model on N devices, by simulating each candidate.

    cann-plan llama-7b --devices 8 --device-profile ascend_910b --memory-gb 64 --seq 4096

MODEL is a named shape (``cann-plan --list``) or ``pkg.module:factory``, a
callable ``factory(rows, seq)`` returning ``(model, loss_fn, batch)``; it is
called under ``torch.device("meta")`` and captured at its own depth.

Search: dp (= devices / (tp x cp x pp)) x ZeRO stage x recompute (none, selective, full,
budget) x microbatches x precision (x tp, cp and pp where asked: ``--tp 1,2 --cp 1,2 --pp 1,2``;
tp must divide the heads, cp the sequence; a
pipelined plan runs 1F1B over its microbatches, simulated from its pp = 1
program's per-block figures, see :func:`cann_passes.simulate.simulate_pipeline`). A cp plan is
compiled with its context_parallel pass like any other, so its K/V all-gathers, dK/dV
reduce-scatters and gradient all-reduces over cp are priced from its graph. ``--ep 1,2,4,8`` searches
expert parallelism for a mixture of experts (``mixtral-8x7b``): ep divides dp and is not combined
with cp, and must divide a named shape's experts (with tp the experts stay whole on every tp rank); an ep plan compiles for the eager backend, the only one
that runs it, and its all-to-alls are priced at the balanced row count. Before anything is compiled, a candidate whose model state
alone cannot fit is dropped (the bound: fp32 master parameters, one gradient
shard and the optimizer state, as the captured graph holds them, divided as
the ZeRO stage divides them), and so is one whose bound plus the activations a
simulated ZeRO 0-2 sibling keeps (same recompute, microbatch and parallelism:
ZeRO 0-2 do not change activations) cannot fit. The rest are compiled, cheapest first, by the
plan's pipeline for rank 0 of a fake mesh and simulated
(:mod:`cann_passes.simulate`). Two monotonicity assumptions skip more (said in
the output): a candidate that saves no more memory on any axis than one that
does not fit does not fit either; one that saves at least as much on every
axis as one that fits is not faster.

Output: the candidates ranked (the criterion is printed above the table), every candidate not
simulated with why, the best plan's breakdown, and the best plan as a plan file, by default
``out/cann-plan/best_plan.yaml`` (``out/`` is gitignored); the last line says where it went.

Named shapes are captured once per batch shape at two small depths (2 and 3
layers; one layer is not enough: with full recompute its kept activations do not
scale like the rest) and every figure is continued linearly to the real depth (tests check
this against a full-depth capture at small size); ``--full-depth`` captures
the real depth instead (minutes per capture for 32 layers on a loaded CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

from cann_passes.cost_model import get_profile, profile_names
from cann_passes.plan import Plan, PlanError
from cann_passes.simulate import GB, MODELLED, NOT_MODELLED, Simulation, SimulationError, extrapolate, simulate, \
    simulate_extrapolated
from graph_ir import capture_train_step
from graph_ir.analysis.memory import state_bytes

RECOMPUTE_ORDER = ("none", "selective", "budget", "full")   # by memory saved (assumed order)
EXTRAPOLATE_FROM = (2, 3)
# Published reference throughput printed beside a prediction (tokens/s per device).
REFERENCES = {"llama-7b": ("MindSpeed-LLM LLaMA2-7B on Atlas 900 A2 (910B), seq 4096", 2730.0)}
DEFAULT_OUT = str(Path("out") / "cann-plan" / "best_plan.yaml")
NOT_SIMULATED = ("pruned-bound", "skipped-dominated", "failed")


class UsageError(ValueError):
    pass


# -- models ------------------------------------------------------------------------------------------

def _hf_loss(model, batch):
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def _llama(hidden, ffn, layers, heads, kv_heads, vocab=32000):
    def build(rows, seq, depth=None):
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=depth or layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                          max_position_embeddings=max(seq, 64), tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg), _hf_loss, torch.zeros(rows, seq, dtype=torch.long)
    return build


def _mixtral(hidden, ffn, layers, heads, kv_heads, experts, top_k, vocab=32000):
    def build(rows, seq, depth=None):
        from transformers import MixtralConfig, MixtralForCausalLM
        cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=depth or layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                            num_local_experts=experts, num_experts_per_tok=top_k,
                            max_position_embeddings=max(seq, 64), tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        return MixtralForCausalLM(cfg), _hf_loss, torch.zeros(rows, seq, dtype=torch.long)
    return build


def _gpt(**overrides):
    def build(rows, seq, depth=None):
        from recipes.models.gpt import GPT, gpt_7b, gpt_loss
        fields = dict(overrides, seq_len=seq)
        if depth:
            fields["n_layer"] = depth
        cfg = gpt_7b(**fields)
        idx = torch.zeros(rows, seq, dtype=torch.long)
        return GPT(cfg), gpt_loss, (idx, torch.zeros_like(idx))
    return build


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable      # (rows, seq, depth=None) -> (model, loss_fn, batch), called on meta
    layers: int | None   # the real depth; None: captured as built (no extrapolation)
    seq: int
    heads: int = 0
    experts: int = 0     # experts per MoE layer (ep must divide them); 0: dense or unknown


MODELS = {
    "llama-tiny": ModelSpec("llama-tiny", _llama(64, 176, 4, 4, 4, vocab=256), 4, 32, 4),
    "llama-7b": ModelSpec("llama-7b", _llama(4096, 11008, 32, 32, 32), 32, 4096, 32),
    "llama-13b": ModelSpec("llama-13b", _llama(5120, 13824, 40, 40, 40), 40, 4096, 40),
    "llama-70b": ModelSpec("llama-70b", _llama(8192, 28672, 80, 64, 8), 80, 4096, 64),
    "mixtral-tiny": ModelSpec("mixtral-tiny", _mixtral(64, 128, 4, 4, 2, 4, 2, vocab=256), 4, 32, 4, 4),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", _mixtral(4096, 14336, 32, 32, 8, 8, 2), 32, 4096, 32, 8),
    "gpt-7b": ModelSpec("gpt-7b", _gpt(), 32, 2048, 32),
    "gpt3-175b": ModelSpec("gpt3-175b", _gpt(n_layer=96, n_head=96, d_model=12288), 96, 2048, 96),
}


def resolve_model(text: str) -> ModelSpec:
    if text in MODELS:
        return MODELS[text]
    if ":" not in text:
        raise UsageError(f"MODEL '{text}': not a named shape ({', '.join(MODELS)}) nor pkg.module:factory")
    module_name, _, attr = text.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"MODEL '{text}': cannot load the factory ({type(exc).__name__}: {exc})") from None
    if not callable(factory):
        raise UsageError(f"MODEL '{text}': {attr} is not callable (rule: factory(rows, seq) -> (model, loss_fn, batch))")
    return ModelSpec(text, lambda rows, seq, depth=None: factory(rows, seq), None, 0)


class Captures:
    """One capture per (depth, rows, seq): every candidate with that batch shape reuses it."""

    def __init__(self, spec: ModelSpec, seq: int, full_depth: bool = False):
        self.spec, self.seq = spec, seq
        self.depths = (None,) if spec.layers is None or full_depth else EXTRAPOLATE_FROM
        self._cache: dict[tuple, object] = {}
        self.seconds = 0.0

    def get(self, rows: int, depth: int | None):
        key = (depth, rows)
        if key not in self._cache:
            t0 = time.perf_counter()
            with torch.device("meta"):
                model, loss_fn, batch = self.spec.build(rows, self.seq, depth)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
            self._cache[key] = capture_train_step(model, optimizer, loss_fn, batch)[0]
            self.seconds += time.perf_counter() - t0
        return self._cache[key]

    def simulate(self, plan: Plan, rows: int, profile: str, capacity: float, pp: int = 1,
                 schedule: str = "1f1b") -> Simulation:
        tokens = rows * self.seq
        if self.depths == (None,):
            return simulate(self.get(rows, None), plan, profile=profile, tokens_per_microbatch=tokens,
                            capacity_bytes=capacity, pp=pp, schedule=schedule)
        captures = {d: self.get(rows, d) for d in self.depths}
        return simulate_extrapolated(captures, self.spec.layers, plan, profile=profile,
                                     tokens_per_microbatch=tokens, capacity_bytes=capacity, pp=pp,
                                     schedule=schedule)

    def model_state(self, rows: int) -> dict[str, float]:
        """Parameter and optimizer-state bytes of the whole model (dp=1), from the captured graphs."""
        if self.depths == (None,):
            s = state_bytes(self.get(rows, None))
            return {"params": s.params, "optimizer_state": s.optimizer_state}
        (la, lb) = self.depths
        a, b = (dataclasses.asdict(state_bytes(self.get(rows, d))) for d in (la, lb))
        return extrapolate({k: a[k] for k in ("params", "optimizer_state")},
                           {k: b[k] for k in ("params", "optimizer_state")}, la, lb, self.spec.layers)

    @property
    def method(self) -> str:
        if self.depths == (None,):
            return "captured at the model's own depth"
        la, lb = self.depths
        return f"captured at {la} and {lb} layers, every figure continued linearly to {self.spec.layers}"


# -- search ------------------------------------------------------------------------------------------

@dataclass
class Candidate:
    plan: Plan
    rows: int                      # rows per microbatch on one dp rank
    status: str = "pending"        # simulated | pruned-bound | skipped-dominated | failed
    bound_bytes: float = 0.0
    bound_terms: dict = dataclasses.field(default_factory=dict)
    sim: Simulation | None = None
    reason: str = ""
    pp: int = 1                    # a Plan carries pp > 1 only once pipeline_split is registered

    @property
    def axes(self) -> tuple[int, int, int]:
        return (self.plan.zero_stage, RECOMPUTE_ORDER.index(self.plan.recompute),
                self.plan.microbatches)

    def label(self) -> str:
        p = self.plan
        rc = f"budget {p.recompute_budget:g}" if p.recompute == "budget" else p.recompute
        return (f"dp={p.dp}{f' ep={p.ep}' if p.ep > 1 else ''}{f' cp={p.cp}' if p.cp > 1 else ''} tp={p.tp}{f' pp={self.pp}' if self.pp > 1 else ''} "
                f"zero={p.zero_stage} "
                f"recompute={rc} mb={p.microbatches} {p.precision}")


def model_state_terms(state: dict[str, float], plan: Plan, pp: int = 1) -> dict[str, float]:
    """Per-rank bytes no plan of this shape goes below: master params, a gradient shard, optimizer state.
    Under ep a rank holds its dense parameters whole and 1/ep of the experts, never less than 1/ep
    of all (the state under ZeRO: dense over dp, experts over edp x ep = dp)."""
    params = state["params"] / plan.tp / pp
    opt = state["optimizer_state"] / plan.tp / pp
    return {"params": params / (plan.dp if plan.zero_stage >= 3 else plan.ep), "grads": params / plan.dp,
            "optimizer_state": opt / (plan.dp if plan.zero_stage >= 1 else plan.ep)}


def model_state_bound(state: dict[str, float], plan: Plan) -> float:
    return sum(model_state_terms(state, plan).values())


def candidates(devices: int, global_batch: int, *, tps, stages, recomputes, microbatches, precisions,
               budget: float, heads: int, backend: str = "eager", pps=(1,), cps=(1,), seq: int = 0,
               eps=(1,), experts: int = 0) -> list[Candidate]:
    out = []
    for tp, cp, pp, ep, z, rc, m, prec in itertools.product(tps, cps, pps, eps, stages, recomputes, microbatches,
                                                            precisions):
        if devices % (tp * cp * pp) or (heads and heads % tp) or (pp > 1 and m < pp):
            continue
        if cp > 1 and seq and seq % cp:
            continue
        dp = devices // (tp * cp * pp)
        if global_batch % dp or (global_batch // dp) % m:
            continue
        if z and dp == 1:
            continue
        # What expert parallelism composes with (Plan._check_expert_parallel); it runs on eager only.
        if ep > 1 and (dp % ep or cp > 1 or (experts and experts % ep)):
            continue
        extra = {"recompute_budget": budget} if rc == "budget" else {}
        plan = Plan(dp=dp, ep=ep, tp=tp, cp=cp, zero_stage=z, recompute=rc, microbatches=m, precision=prec,
                    backend="eager" if ep > 1 else backend, verify="off", **extra)
        out.append(Candidate(plan, global_batch // dp // m, pp=pp))
    out.sort(key=lambda c: (sum(c.axes[:2]) + c.axes[2].bit_length(), c.plan.tp, c.plan.cp, c.pp,
                            c.plan.precision != "bf16"))
    return out


def _group(c: Candidate):
    return (c.plan.tp, c.plan.cp, c.plan.ep, c.pp, c.plan.precision)


def _activation_key(c: Candidate):
    """Plans whose kept activations are the same: ZeRO 0-2 shard only optimizer state and gradients,
    so they keep what their siblings keep (stage 3 gathers parameters and is keyed apart: None)."""
    p = c.plan
    if p.zero_stage >= 3:
        return None
    return (p.tp, p.cp, p.ep, c.pp, p.precision, p.recompute, p.recompute_budget if p.recompute == "budget" else None,
            p.microbatches, c.rows)


def search(spec: ModelSpec, captures: Captures, cands: list[Candidate], *, profile: str, capacity: float,
           progress: bool = True) -> list[Candidate]:
    from tqdm import tqdm
    state_by_rows: dict[int, dict] = {}
    fits: list[Candidate] = []
    misses: list[Candidate] = []
    activations_seen: dict[tuple, float] = {}
    bar = tqdm(cands, desc="simulating plans", unit="plan", disable=not progress, file=sys.stderr)
    for c in bar:
        bar.set_postfix_str(c.label(), refresh=False)
        if c.rows not in state_by_rows:
            state_by_rows[c.rows] = captures.model_state(c.rows)
        c.bound_terms = model_state_terms(state_by_rows[c.rows], c.plan, c.pp)
        c.bound_bytes = sum(c.bound_terms.values())
        if c.bound_bytes > capacity:
            c.status, c.reason = "pruned-bound", f"model state alone >= {c.bound_bytes / GB:.1f} GB"
            continue
        acts = activations_seen.get(_activation_key(c))
        if acts is not None and c.bound_bytes + acts > capacity:
            c.status, c.reason = ("pruned-bound", f"model state + the activations a ZeRO 0-2 sibling keeps "
                                  f">= {(c.bound_bytes + acts) / GB:.1f} GB")
            continue
        if any(_group(d) == _group(c) and all(x <= y for x, y in zip(c.axes, d.axes)) for d in misses):
            c.status, c.reason = "skipped-dominated", "saves no more memory than a plan that does not fit"
            continue
        if any(_group(d) == _group(c) and all(x >= y for x, y in zip(c.axes, d.axes)) for d in fits):
            c.status, c.reason = "skipped-dominated", "saves more memory than a plan that already fits (slower)"
            continue
        try:
            c.sim = captures.simulate(c.plan, c.rows, profile, capacity, pp=c.pp)
        except Exception as exc:   # a pass refusing a plan is a result of the search, not a crash
            first = (str(exc).splitlines() or [""])[0]
            c.status, c.reason = "failed", f"{type(exc).__name__}: {first}"
            continue
        c.status = "simulated"
        (fits if c.sim.fits else misses).append(c)
        key = _activation_key(c)
        if key is not None:
            activations_seen[key] = min(activations_seen.get(key, float("inf")), c.sim.memory["activations"])
    return cands


def ranked(cands: list[Candidate]) -> list[Candidate]:
    """What :func:`ranking_criterion` says: fitting plans by throughput, then the rest by peak."""
    done = [c for c in cands if c.sim is not None]
    return sorted(done, key=lambda c: (not c.sim.fits, -c.sim.tokens_per_second if c.sim.fits else c.sim.peak_bytes))


def ranking_criterion(capacity: float) -> str:
    return (f"ranked by predicted tokens/s, highest first (every plan runs the same global batch, so this is the "
            f"shortest predicted step), among plans whose predicted peak fits in {capacity / GB:.3g} GB per "
            f"device; plans that do not fit follow, lowest peak first")


def shown_summary(rows: list[Candidate], top: int, not_simulated: int) -> str:
    """How much of the ranking the table shows, and where the candidates it cannot rank are."""
    if not rows:
        text = "no candidate was simulated"
    elif len(rows) > top:
        text = f"showing {top} of {len(rows)} simulated plans (--top {top})"
    elif len(rows) < top:
        text = f"all {len(rows)} simulated plans shown (--top {top} asks for more than were simulated)"
    else:
        text = f"all {len(rows)} simulated plans shown"
    if not_simulated:
        some = f"{'the other ' if rows else ''}{_count(not_simulated, 'candidate')}"
        text += f"; {some} {'was' if not_simulated == 1 else 'were'} not simulated: listed below, with why"
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def not_simulated_table(cands: list[Candidate], top: int) -> list[str]:
    """Candidates the search did not simulate, refusals first: each with its status and reason."""
    skipped = sorted((c for c in cands if c.status in NOT_SIMULATED), key=lambda c: NOT_SIMULATED[::-1].index(c.status))
    if not skipped:
        return []
    shown = skipped[:top]
    lines = [f"not simulated: {_count(len(skipped), 'candidate')}"
             + (f" ({len(shown)} shown, --top {top})" if len(shown) < len(skipped) else "")]
    lines += [f"  {c.status:<18} {c.label():<52} {c.reason}" for c in shown]
    if len(shown) < len(skipped):
        lines.append(f"  ... and {len(skipped) - len(shown)} more (raise --top to list them)")
    return lines


def plan_yaml(plan: Plan, pp: int = 1) -> str:
    """The plan's fields that differ from the defaults, as a plan file ``Plan.load`` reads back
    (a pp > 1 plan loads once a pipeline_split pass is registered)."""
    default = Plan().to_dict()
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in plan.to_dict().items() if default[k] != v}
    if pp > 1:
        fields["pp"] = pp
    return yaml.safe_dump(fields, sort_keys=False)


def table(rows: list[Candidate], top: int, memory: float) -> str:
    """Ranked plans, in :func:`ranked`'s order; headroom is the share of the device's whole memory left
    free at the peak."""
    head = f"{'#':>3}  {'plan':<52}{'fits':>5}{'peak GB':>9}{'headroom':>9}{'step ms':>10}{'tok/s/dev':>11}{'MFU':>7}"
    lines = [head]
    for i, c in enumerate(rows[:top], 1):
        s = c.sim
        lines.append(f"{i:>3}  {c.label():<52}{'yes' if s.fits else 'no':>5}{s.peak_bytes / GB:>9.2f}"
                     f"{1 - s.peak_bytes / memory:>9.1%}{s.step_seconds * 1e3:>10.1f}{s.tokens_per_second_per_device:>11,.0f}"
                     f"{s.mfu():>7.1%}")
    return "\n".join(lines)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--{name} '{text}': must be comma-separated integers") from None
    if any(v < 0 for v in values):
        raise UsageError(f"--{name} '{text}': values must be >= 0")
    return values


def _words(text: str, name: str, allowed) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(","))
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UsageError(f"--{name} '{bad[0]}': must be one of {', '.join(allowed)}")
    return values


def parse(argv):
    p = argparse.ArgumentParser(prog="cann-plan", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="named shape or pkg.module:factory")
    p.add_argument("--list", action="store_true", help="list the named shapes")
    p.add_argument("--devices", type=int, default=8, help="devices in the cluster (default: %(default)s)")
    p.add_argument("--device-profile", default="ascend_910b",
                   help=f"device cost profile: {', '.join(profile_names())} (default: %(default)s)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory per device in GB (default: the profile's)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: the named shape's; a factory model needs it)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default: devices)")
    p.add_argument("--zero", default="0,1,2,3", help="comma list of ZeRO stages to try (default: %(default)s)")
    p.add_argument("--recompute", default=",".join(RECOMPUTE_ORDER),
                   help="comma list of recompute policies to try (default: %(default)s)")
    p.add_argument("--budget", type=float, default=0.5, help="recompute budget: fraction of saved activations kept")
    p.add_argument("--microbatches", default="1,2,4",
                   help="comma list of microbatch counts per optimizer step to try (default: %(default)s)")
    p.add_argument("--precision", default="bf16", help="comma list of fp32,bf16 (fp32 doubles the search)")
    p.add_argument("--tp", default="1", help="comma list of tensor-parallel degrees to try")
    p.add_argument("--cp", default="1", help="comma list of context-parallel degrees to try (cp must divide --seq)")
    p.add_argument("--ep", default="1", help="comma list of expert-parallel degrees to try (MoE models; ep "
                   "divides dp and the experts, not with tp, cp or pp)")
    p.add_argument("--pp", default="1", help="comma list of pipeline degrees to try (1F1B, microbatches >= pp)")
    p.add_argument("--breakdown", default=None, metavar="PNG",
                   help="write the best (or, when none fits, the closest) plan's per-rank memory and time picture")
    p.add_argument("--full-depth", action="store_true", help="capture the real depth (slow) instead of extrapolating")
    p.add_argument("--no-baseline", action="store_true", help="skip the fp32 single-device comparison")
    p.add_argument("--min-headroom", type=float, default=0.10,
                   help="fraction of device memory a plan must leave free to count as fitting (fragmentation, "
                        "workspaces and the runtime are not modelled)")
    p.add_argument("--top", type=int, default=12,
                   help="rows of the ranked table, and of the list of candidates not simulated (default: %(default)s)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="plan file to write the best plan to, its directory made if missing (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def _check_writable(path: str, flag: str) -> None:
    from recipes.common import unwritable
    problem = unwritable(Path(path).parent)
    if problem is not None:
        raise UsageError(f"{flag} {path!r}: {problem}")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path!r}: is a directory; give a file name")


def check(args) -> ModelSpec:
    if args.list:
        return None
    if not args.model:
        raise UsageError("MODEL is required (a named shape or pkg.module:factory; --list names them)")
    if args.devices < 1:
        raise UsageError(f"--devices {args.devices}: must be >= 1")
    if args.device_profile not in profile_names():
        raise UsageError(f"--device-profile '{args.device_profile}': must be one of {', '.join(profile_names())}")
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise UsageError(f"--memory-gb {args.memory_gb}: must be > 0")
    if args.seq is not None and args.seq < 1:
        raise UsageError(f"--seq {args.seq}: must be >= 1")
    if args.global_batch is not None and args.global_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch}: must be >= 1")
    if not 0 <= args.min_headroom < 1:
        raise UsageError(f"--min-headroom {args.min_headroom}: must be a fraction in [0, 1)")
    if not 0 < args.budget <= 1:
        raise UsageError(f"--budget {args.budget}: must be a fraction in (0, 1]")
    if args.top < 1:
        raise UsageError(f"--top {args.top}: must be >= 1")
    if args.breakdown is not None:
        suffix = Path(args.breakdown).suffix.lower().lstrip(".")
        if suffix not in ("png", "svg", "pdf"):
            raise UsageError(f"--breakdown {args.breakdown!r}: the picture is written as .png, .svg or .pdf "
                             f"(got {'.' + suffix if suffix else 'no suffix'})")
    args.zero_stages = _ints(args.zero, "zero")
    if any(z > 3 for z in args.zero_stages):
        raise UsageError(f"--zero '{args.zero}': ZeRO stages are 0..3")
    args.microbatch_counts = _ints(args.microbatches, "microbatches")
    args.tps = _ints(args.tp, "tp")
    args.pps = _ints(args.pp, "pp")
    args.cps = _ints(args.cp, "cp")
    args.eps = _ints(args.ep, "ep")
    if 0 in args.microbatch_counts or 0 in args.tps or 0 in args.pps or 0 in args.cps or 0 in args.eps:
        raise UsageError("--microbatches, --tp, --cp, --ep and --pp values must be >= 1")
    args.recomputes = _words(args.recompute, "recompute", RECOMPUTE_ORDER)
    args.precisions = _words(args.precision, "precision", ("bf16", "fp32"))
    spec = resolve_model(args.model)
    args.seq = args.seq or spec.seq
    if not args.seq:
        raise UsageError(f"MODEL '{args.model}': a factory model needs --seq")
    args.global_batch = args.global_batch or args.devices
    plan_candidates(args, spec)
    # Outputs are checked before the search, so a result is never lost to an unwritable path, and
    # last, because the check makes the directory: a refused command leaves nothing behind.
    if args.breakdown is not None:
        _check_writable(args.breakdown, "--breakdown")
    _check_writable(args.out, "--out")
    return spec


def backend_for(profile: str) -> str:
    """Ascend profiles compile through the torchair pipeline (its legalization passes included)."""
    return "torchair" if profile.startswith("ascend") else "eager"


def plan_candidates(args, spec: ModelSpec) -> list[Candidate]:
    cands = candidates(args.devices, args.global_batch, tps=args.tps, stages=args.zero_stages,
                       recomputes=args.recomputes, microbatches=args.microbatch_counts,
                       precisions=args.precisions, budget=args.budget, heads=spec.heads,
                       backend=backend_for(get_profile(args.device_profile).name), pps=args.pps,
                       cps=args.cps, seq=args.seq, eps=args.eps, experts=spec.experts)
    if not cands:
        raise UsageError(f"no plan divides --global-batch {args.global_batch} over {args.devices} devices with "
                         f"microbatches {args.microbatches}, tp {args.tp}, cp {args.cp} and pp {args.pp}"
                         + (" (cp must divide --seq)" if args.cp != "1" else ""))
    return cands


def run(args, spec: ModelSpec, out=print, captures: Captures | None = None) -> int:
    profile = get_profile(args.device_profile)
    memory = args.memory_gb * GB if args.memory_gb else profile.memory_capacity
    capacity = memory * (1 - args.min_headroom)   # what a fitting plan may use
    captures = captures or Captures(spec, args.seq, args.full_depth)
    cands = plan_candidates(args, spec)
    t0 = time.perf_counter()
    search(spec, captures, cands, profile=profile.name, capacity=capacity, progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    rows = ranked(cands)
    counts = {s: sum(c.status == s for c in cands) for s in ("simulated", "pruned-bound", "skipped-dominated", "failed")}
    out(f"{spec.name}: seq {args.seq}, global batch {args.global_batch} sequences, {args.devices} x "
        f"{profile.name} with {memory / GB:g} GB, of which a plan may use {capacity / GB:.3g} GB "
        f"(--min-headroom {args.min_headroom:.0%}); {captures.method}")
    out(f"{len(cands)} candidates: " + ", ".join(f"{v} {k}" for k, v in counts.items())
        + f" in {seconds:.0f}s (captures {captures.seconds:.0f}s)")
    out(f"modelled: {MODELLED}")
    out(f"not modelled: {NOT_MODELLED}")
    out("")
    out(ranking_criterion(capacity))
    if rows:
        out(table(rows, args.top, memory))
    out(shown_summary(rows, args.top, len(cands) - len(rows)))
    skipped = not_simulated_table(cands, args.top)
    if skipped:
        out("")
        out("\n".join(skipped))
    fitting = [c for c in rows if c.sim.fits]
    out("")
    if not fitting:
        closest = rows[0] if rows else min(cands, key=lambda c: c.bound_bytes)
        out(f"no plan fits in {capacity / GB:.3g} GB per device.")
        if closest.sim is not None:
            out(f"closest: {closest.label()}")
            out(closest.sim.breakdown())
            _picture(args, closest, out)
            out(f"largest term: {closest.sim.largest_term} "
                f"({closest.sim.memory[closest.sim.largest_term] / GB:.2f} GB per rank)")
        elif any(c.status == "failed" for c in cands):
            out("no candidate was simulated: the pipeline refused every one that passed the bound (the failed ones above say why)")
        else:
            terms = closest.bound_terms
            largest = max(terms, key=terms.get)
            out(f"every candidate's model state alone exceeds the memory; smallest bound "
                f"{closest.bound_bytes / GB:.3g} GB ({closest.label()}): "
                + ", ".join(f"{k} {v / GB:.3g} GB" for k, v in terms.items())
                + f"; largest term: {largest} ({terms[largest] / GB:.3g} GB per rank)")
        out(f"no plan written to {os.path.abspath(args.out)}")
        return 1
    best = fitting[0]
    out(f"best: {best.label()}: headroom {1 - best.sim.peak_bytes / memory:.1%} of {memory / GB:g} GB")
    out(best.sim.breakdown())
    _picture(args, best, out)
    ref = REFERENCES.get(spec.name)
    if ref:
        out(f"reference: {ref[0]}: {ref[1]:,.0f} tokens/s/device; predicted "
            f"{best.sim.tokens_per_second_per_device:,.0f} ({best.sim.tokens_per_second_per_device / ref[1]:.2f}x)")
    if not args.no_baseline:
        base = Plan(precision="fp32", backend=backend_for(profile.name), verify="off")
        try:
            b = captures.simulate(base, args.global_batch // best.plan.dp // best.plan.microbatches,
                                  profile.name, capacity)
            out(f"fp32 single-device baseline (same microbatch, no ZeRO/recompute): peak {b.peak_bytes / GB:.1f} GB"
                f" -> best plan {best.sim.peak_bytes / GB:.1f} GB per device "
                f"({best.sim.peak_bytes / b.peak_bytes - 1:+.0%})")
        except (SimulationError, PlanError, RuntimeError, ValueError) as exc:
            out(f"fp32 single-device baseline not simulated: {exc}")
    path = Path(args.out).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan_yaml(best.plan.replace(verify="shallow", backend="auto"), best.pp))
    out(f"wrote the best plan to {path}")
    return 0


def _picture(args, cand: Candidate, out) -> None:
    if args.breakdown:
        from cann_passes.reports.breakdown import plot_breakdown
        out(f"wrote {plot_breakdown(cand.sim, args.breakdown, title=f'{args.model}: {cand.label()}')}")


def main(argv=None) -> int:
    try:
        args = parse(argv)
        spec = check(args)
        if args.list:
            for name, s in MODELS.items():
                print(f"{name:<12} {s.layers} layers, seq {s.seq}")
            return 0
        return run(args, spec)
    except (UsageError, PlanError, SimulationError) as exc:
        print(f"cann-plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
