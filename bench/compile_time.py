"""First-step compile time, cold and warm, against torch.compile: 6-layer d256 GPT, seq 128, batch 8, AdamW.

    python -m bench.compile_time [--rounds 1] [--quick] [--model gpt|llama|gpt2|...]

Every measurement runs in a fresh interpreter (``python -m bench.compile_time --child ...``)
and times the first training step (compile + one step) minus the median of the three
steps after it:

- ``torch.compile(model)``: forward and backward compiled (Dynamo + AOTAutograd +
  inductor), ``torch.optim.AdamW.step`` eager;
- ``+ compiled optimizer``: the same with ``torch.compile`` over the optimizer step too;
- ours, backend inductor / eager: ``compile_for_npu`` (capture, passes, lowering); ``ours inductor
  fused`` with ``optimizer_kernel: fused`` (the update one multi-tensor kernel inductor calls).

**cold**: empty caches (a fresh ``TORCHINDUCTOR_CACHE_DIR`` and compile cache directory);
**warm**: a second fresh process with the same model and plan and the caches the cold one
left (inductor's FX graph and AOTAutograd caches; for ours also the compile cache, see
``cann_passes/compile_cache.py``). Rows are interleaved within each round; medians over
rounds. On a shared machine absolute seconds move with the load: compare the rows of one run;
the process's CPU time of the first step beside them is what load changes least (compile
workers inductor forks are not in it).

A second table splits each row's cold compile by phase (torch's own compile timers, and our
capture and pass times): capture (ours) or Dynamo (torch), passes, AOTAutograd, inductor's
lowering, fusion + code generation, the wait for the C++ compiles at module load, and the CPU
time of the g++ processes themselves (they run in inductor's compile pool, beside the rest).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = ("torch.compile(model)", "torch.compile(model) + compiled optimizer", "ours inductor", "ours inductor fused",
        "ours eager")


def _config(quick: bool):
    from recipes.models.gpt import GPTConfig
    if quick:
        return GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, seq_len=16), 2
    return GPTConfig(vocab_size=256, n_layer=6, n_head=4, d_model=256, seq_len=128), 8


def _model(name: str, quick: bool):
    """The model, its loss and four batches: the recipe GPT, or a transformers model of the same width
    built from a config (``tests/zoo.py``, as ``bench.step_time --models`` builds it)."""
    import torch
    cfg, batch_size = _config(quick)
    torch.manual_seed(0)
    if name == "gpt":
        from recipes.models.gpt import GPT, gpt_loss
        g = torch.Generator().manual_seed(1)
        return GPT(cfg), gpt_loss, [(torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g),) * 2
                                    for _ in range(4)]
    from bench.step_time import zoo_case
    case = zoo_case(name, batch_size, cfg.seq_len)
    torch.manual_seed(0)
    return case.make_model(), case.loss_fn, [case.batch] * 4


def child(row: str, quick: bool, model_name: str = "gpt") -> dict:
    """One measurement in this (fresh) process."""
    import torch
    model, loss_fn, batches = _model(model_name, quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if row.startswith("torch"):
        compiled = torch.compile(model)
        opt_step = torch.compile(opt.step) if "optimizer" in row else opt.step

        def step(batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(compiled, batch)
            loss.backward()
            opt_step()
            return loss
    else:
        from cann_passes import Plan, compile_for_npu
        # "fused": the optimizer as one multi-tensor kernel (optimizer_kernel: fused), which inductor
        # calls rather than generating and compiling the update's code
        backend = row.split()[1]
        kernel = {"optimizer_kernel": "fused"} if row.endswith("fused") else {}
        step = compile_for_npu(model, Plan(backend=backend, compile_cache=os.environ["BENCH_COMPILE_CACHE"], **kernel),
                               optimizer=opt, loss_fn=loss_fn)
    times, cpu = [], []
    children0 = _children_cpu()
    for batch in batches:
        t0, c0 = time.perf_counter(), time.process_time()
        step(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if len(times) == 1:
            cxx_cpu = _children_cpu() - children0
    steady = statistics.median(times[1:])
    out = {"first_s": times[0], "step_s": steady, "compile_s": times[0] - steady,
           "compile_cpu_s": cpu[0] - statistics.median(cpu[1:]), "cxx_cpu_s": cxx_cpu}
    ours = None
    if not row.startswith("torch"):
        out["cache_hit"] = step.last.program.attrs.get("compile_cache") == "hit"
        ours = (step.last.capture_seconds, sum(r.seconds for r in step.last.records))
    out["phases"] = phases(out["compile_s"], ours)
    return out


def _children_cpu() -> float:
    """CPU seconds of this process's finished child processes: inductor's g++ runs."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def phases(compile_s: float, ours: tuple[float, float] | None) -> dict:
    """Where the first step's compile went, in wall seconds of the main thread, from torch's own
    compile timers (``torch._dynamo.utils.compilation_time_metrics``) and, for ours, the step's
    capture and pass timings. ``front`` is capture for ours and Dynamo's tracing (with whatever no
    timer covers) for torch.compile; ``cxx_wait`` is the time spent waiting for inductor's C++
    compiles when the generated module is loaded (the compiles themselves run in its pool)."""
    from torch._dynamo.utils import compilation_time_metrics as timers

    def total(name: str) -> float:
        return sum(timers.get(name, ()))
    inner = total("compile_fx_inner")
    # AOTAutograd's own work: its dispatcher function less the forward compile inside it (the
    # backward compiles later, at the first backward, outside it).
    out = {"passes": ours[1] if ours else 0.0,
           "aot": max(0.0, total("create_aot_dispatcher_function") - total("compile_fx.<locals>.fw_compiler_base")),
           "lowering": total("GraphLowering.run") + total("_recursive_post_grad_passes")
           + total("additional_fake_tensor_prop"),
           "schedule_codegen": total("GraphLowering.codegen"),
           "cxx_wait": total("PyCodeCache.load_by_key_path")}
    out["inductor_other"] = max(0.0, inner - out["lowering"] - out["schedule_codegen"] - out["cxx_wait"])
    if ours:
        out["front"] = ours[0]
    else:
        out["front"] = max(0.0, compile_s - sum(out.values()))
    return out


def _spawn(row: str, quick: bool, inductor_dir: str, cache_dir: str, model: str = "gpt") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, BENCH_COMPILE_CACHE=cache_dir,
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("CANN_PASSES_DUMP", None)
    args = [sys.executable, "-m", "bench.compile_time", "--child", row, "--model", model] + (["--quick"] if quick else [])
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{row}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(rounds: int, quick: bool, rows=ROWS, model: str = "gpt") -> dict:
    results = {row: {"cold": [], "warm": []} for row in rows}
    for r in range(rounds):
        for row in (rows if r % 2 == 0 else rows[::-1]):
            work = tempfile.mkdtemp(prefix="compile_time_")
            try:
                dirs = (os.path.join(work, "inductor"), os.path.join(work, "cache"))
                for phase in ("cold", "warm"):
                    results[row][phase].append(_spawn(row, quick, *dirs, model=model))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return results


def report(results: dict) -> list[dict]:
    rows = []
    base_row = ROWS[1] if ROWS[1] in results else next(iter(results))
    base = statistics.median(r["compile_s"] for r in results[base_row]["cold"])
    print(f"{'':44} {'cold s':>7} {'warm s':>7} {'cold/torch+opt':>14} {'step s':>7}  {'CPU s cold':>10} "
          f"{'warm':>6}  cache hit (warm)")
    for row, phases in results.items():
        cold = statistics.median(r["compile_s"] for r in phases["cold"])
        warm = statistics.median(r["compile_s"] for r in phases["warm"])
        cpu_cold = statistics.median(r["compile_cpu_s"] for r in phases["cold"])
        cpu_warm = statistics.median(r["compile_cpu_s"] for r in phases["warm"])
        step = statistics.median(r["step_s"] for r in phases["cold"] + phases["warm"])
        hits = [r.get("cache_hit") for r in phases["warm"]]
        hit = "-" if hits[0] is None else f"{sum(hits)}/{len(hits)}"
        rows.append({"row": row, "cold_s": cold, "warm_s": warm, "step_s": step, "cache_hits": hit,
                     "cold_cpu_s": cpu_cold, "warm_cpu_s": cpu_warm})
        print(f"{row:44} {cold:>7.2f} {warm:>7.2f} {cold / base:>13.2f}x {step:>7.3f}  {cpu_cold:>10.2f} "
              f"{cpu_warm:>6.2f}  {hit}")
    print_breakdown(results)
    return rows


PHASES = (("front", "capture / Dynamo"), ("passes", "passes"), ("aot", "AOTAutograd"),
          ("lowering", "lowering"), ("schedule_codegen", "fusion+codegen"), ("inductor_other", "other"),
          ("cxx_wait", "C++ wait"))


def print_breakdown(results: dict) -> None:
    """The cold compile of each row by phase (medians over rounds), and the g++ CPU time."""
    print(f"\ncold compile by phase, s (main thread; {'front'!r} = capture for ours, Dynamo for torch):")
    print(f"{'':44} " + " ".join(f"{label:>16}" for _, label in PHASES) + f" {'g++ CPU':>8}")
    for row, phases in results.items():
        cold = [r for r in phases["cold"] if "phases" in r]
        if not cold:
            continue
        cells = [statistics.median(r["phases"][key] for r in cold) for key, _ in PHASES]
        cxx = statistics.median(r["cxx_cpu_s"] for r in cold)
        print(f"{row:44} " + " ".join(f"{c:>16.2f}" for c in cells) + f" {cxx:>8.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke test: a 1-layer d32 model")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS,
                   help="rows to measure (the cold ratio is against the compiled-optimizer row when it runs)")
    p.add_argument("--model", default="gpt",
                   help="gpt (the recipe model) or a transformers model from tests/zoo.py (llama, gpt2, ...) of "
                        "the same width")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.model)))
        return None
    cfg, batch = _config(args.quick)
    load0 = os.getloadavg()
    what = "GPT (recipe model)" if args.model == "gpt" else f"transformers {args.model}"
    print(f"{what} {cfg.n_layer} layers d{cfg.d_model} seq {cfg.seq_len} batch {batch}, AdamW; compile = first step "
          f"- median of the next three; {args.rounds} round(s), medians; each row in fresh processes")
    rows = report(run(args.rounds, args.quick, tuple(args.rows), args.model))
    print(f"load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)")
    return rows


if __name__ == "__main__":
    main()
