"""Compile time of a 7B-shaped GPT step as layers grow, against raw ``make_fx`` of the same step.

    python -m bench.capture_scaling [--layers 4 8 16 32] [--rounds 3] [--with-70b] [--quick]

Both sides trace one whole step (forward, backward, SGD) of the recipe GPT built on
``meta`` (d_model 4096, 32 heads, seq 2048; ``--with-70b`` adds an 80-layer d_model 8192
shape) on fake tensors, so nothing is computed:

- **raw**: ``make_fx(step, tracing_mode="fake")`` of ``torch.func.grad_and_value`` over
  ``functional_call`` plus ``p - lr * g`` — torch's own tracer and nothing else;
- **ours**: ``capture_train_step`` (module paths, regions, signature, functionalization)
  plus ``compile_program`` with the plan's pipeline ``cleanup, autocast{bf16}, recompute{budget
  0.25}, cleanup`` (shallow verifier after each pass, as a plan runs by default). The eager
  backend's own passes, which ``compile_program`` appends (``cann_passes.compile.required``:
  marks for the eager lowering), run too and are timed apart: ``ours/raw`` is capture and the
  plan's passes, ``+backend`` adds them.

Depths are interleaved within each round and the raw/ours order alternates between rounds;
medians over rounds are printed with ms per node, capture alone over raw (how far capture is
from torch's own tracer, its floor) and ours over raw, then where ours spends its time:
capture, each pass (the pass manager's Timing instrument), inside recompute its floor (the
fewest bytes any choice saves) and its solver, the shallow verifier after every pass, and
the pass manager's own work around the passes (the copy of the captured graph the pipeline
starts from, one graph state per pass). The load average is printed before and after: the
machine may be shared, the ratio within one run is the figure, absolute seconds move.
scipy (the recompute solver's MILP) is imported before timing, as any second compile finds it.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes import Plan
from cann_passes.compile import compile_program, required
from graph_ir import capture_train_step
from recipes.models.gpt import GPT, gpt_7b, gpt_loss

LR = 1e-4
PLAN = Plan(precision="bf16", recompute="budget", recompute_budget=0.25, backend="eager")
BACKEND_PASSES = {p.name for p in required(PLAN.backend).passes}


def config(n_layer: int, wide: bool = False, seq: int = 2048):
    if wide:   # 70B-shaped width on the recipe GPT (d_model 8192, 64 heads)
        return gpt_7b(n_layer=n_layer, d_model=8192, n_head=64, seq_len=seq)
    return gpt_7b(n_layer=n_layer, seq_len=seq)


def _model(cfg):
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    return model, idx


def time_raw(cfg) -> dict:
    model, idx = _model(cfg)
    params = dict(model.named_parameters())

    def step(p, idx, targets):
        def loss_of(p):
            logits = torch.func.functional_call(model, p, (idx,))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        grads, loss = torch.func.grad_and_value(loss_of)(p)
        return loss, {k: v - LR * grads[k] for k, v in p.items()}

    t0 = time.perf_counter()
    gm = make_fx(step, tracing_mode="fake")(params, idx, idx)
    seconds = time.perf_counter() - t0
    return {"nodes": len(gm.graph.nodes), "seconds": seconds}


def time_ours(cfg) -> dict:
    model, idx = _model(cfg)
    with torch.device("meta"):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    t0 = time.perf_counter()
    captured, _ = capture_train_step(model, opt, gpt_loss, (idx, idx))
    t1 = time.perf_counter()
    program = compile_program(captured, PLAN)
    t2 = time.perf_counter()
    parts: dict[str, float] = {}
    for r in program.records:
        parts[f"{r.index}:{r.name}"] = parts.get(f"{r.index}:{r.name}", 0.0) + r.seconds
        for key, label in (("floor_seconds", "of which floor"), ("solve_seconds", "of which solver")):
            if key in r.stats:
                parts[label] = parts.get(label, 0.0) + r.stats[key]
    parts["verify (shallow)"] = sum(r.verify_seconds for r in program.records)
    # What the pass manager does around the passes: the copy of the captured graph the pipeline
    # starts from (the captured one stays unchanged) and one graph state per pass.
    parts["copy + graph states"] = (t2 - t1) - sum(r.seconds + r.verify_seconds for r in program.records)
    backend = sum(r.seconds + r.verify_seconds for r in program.records if r.name in BACKEND_PASSES)
    return {"nodes": captured.num_nodes(), "final_nodes": program.num_nodes(), "capture": t1 - t0,
            "passes": t2 - t1 - backend, "backend": backend, "seconds": t2 - t0 - backend,
            "with_backend": t2 - t0, "parts": parts}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run(depths: list[tuple[str, int, bool]], rounds: int, seq: int) -> dict:
    import scipy.optimize  # noqa: F401  (imported once per process; not a cost of any one compile)
    time_raw(config(1, seq=seq)), time_ours(config(1, seq=seq))          # warm both tracers
    results = {label: {"raw": [], "ours": []} for label, _, _ in depths}
    for r in range(rounds):
        for label, n_layer, wide in depths:
            cfg = config(n_layer, wide, seq)
            order = (("raw", time_raw), ("ours", time_ours))
            for side, fn in order if r % 2 == 0 else order[::-1]:
                gc.collect()
                results[label][side].append(fn(cfg))
                print(f"  round {r + 1} {label} {side}: {results[label][side][-1]['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
    return results


def report(results: dict) -> list[dict]:
    rows = []
    print(f"{'shape':>10} {'nodes':>6} {'raw s':>7} {'ms/node':>7} | {'capture s':>9} {'passes s':>8} "
          f"{'ours s':>7} {'ms/node':>7} {'backend s':>9} | {'capture/raw':>11} {'ours/raw':>8} {'+backend':>8}")
    for label, sides in results.items():
        raw, ours = sides["raw"], sides["ours"]
        raw_s, nodes = _median(raw, "seconds"), raw[0]["nodes"]
        cap, passes, total = _median(ours, "capture"), _median(ours, "passes"), _median(ours, "seconds")
        backend, whole = _median(ours, "backend"), _median(ours, "with_backend")
        row = {"shape": label, "raw_nodes": nodes, "nodes": ours[0]["nodes"], "raw_s": raw_s, "capture_s": cap,
               "passes_s": passes, "ours_s": total, "ratio": total / raw_s, "capture_ratio": cap / raw_s,
               "backend_s": backend, "ratio_with_backend": whole / raw_s}
        rows.append(row)
        print(f"{label:>10} {nodes:>6} {raw_s:>7.2f} {raw_s / nodes * 1e3:>7.3f} | {cap:>9.2f} {passes:>8.2f} "
              f"{total:>7.2f} {total / ours[0]['nodes'] * 1e3:>7.3f} {backend:>9.2f} | {cap / raw_s:>10.2f}x "
              f"{total / raw_s:>7.2f}x {whole / raw_s:>7.2f}x")
    print("\nbreakdown of ours, median seconds (pass manager Timing; the recompute rows are inside it)")
    names = ["capture"] + list(next(iter(results.values()))["ours"][0]["parts"])
    print(f"{'part':>22} " + " ".join(f"{label:>10}" for label in results))
    for name in names:
        key = (lambda o: o["capture"]) if name == "capture" else (lambda o, n=name: o["parts"].get(n, 0.0))
        cells = [statistics.median(key(o) for o in sides["ours"]) for sides in results.values()]
        print(f"{name:>22} " + " ".join(f"{c:>10.2f}" for c in cells))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--with-70b", action="store_true", help="add the 80-layer d_model 8192 shape")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 and 2 layers, seq 64, one round")
    args = p.parse_args(argv)
    seq = 2048
    depths = [(f"{n}L", n, False) for n in args.layers]
    if args.with_70b:
        depths.append(("70B 80L", 80, True))
    if args.quick:
        depths, seq, args.rounds = [("1L", 1, False), ("2L", 2, False)], 64, 1
    print(f"pipeline: capture + {PLAN.precision} autocast + recompute budget {PLAN.recompute_budget}; "
          f"seq {seq}; {args.rounds} round(s), medians; load average {_load()}")
    rows = report(run(depths, args.rounds, seq))
    print(f"\nload average after: {_load()} ({os.cpu_count()} cores)")
    return rows


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
