"""Step time of the compiled whole step against eager PyTorch and torch.compile, side by side.

    python -m bench.step_time [--rounds 6] [--steps 1] [--rows ...] [--models gpt llama] [--processes rows|one]

One 6-layer GPT-style model (d_model 256, 4 heads, seq 128, batch 8) trained
with AdamW, every row from the same initial weights:

- ``eager``: forward, backward, ``torch.optim.AdamW.step`` (torch's default
  implementation on CPU: the per-parameter loop) -- the 1.00x baseline;
- ``foreach`` / ``fused``: AdamW with ``foreach=True`` / ``fused=True``;
- ``compile``: ``torch.compile(model)``, eager AdamW;
- ``compile+opt``: ``torch.compile(model)`` and ``torch.compile(opt.step)``;
- ``ours-eager`` / ``ours-inductor``: the compiled whole step on each backend;
- ``ours-eager-unguarded``: ``ours-eager`` with its guards dropped after compiling, so the
  two rows side by side show what checking the guards costs per call;
- ``ours-eager-foreach`` / ``ours-inductor-unfused``: the update as ``_foreach_*`` ops on eager
  (``optimizer_kernel: foreach``; eager's default leaves it per parameter, in place) / per
  parameter on inductor (``none``; inductor's default fuses it);
- ``ours-eager-tensor-scalars``: ``ours-eager`` with the update's step-count arithmetic (bias
  corrections, step sizes) left as 0-dim tensor ops (``$CANN_PASSES_HOST_SCALARS=0``), as it ran
  before the eager lowering computed it as Python floats;
- ``ours-eager-unplanned``: ``ours-eager`` without its buffer plan (``$CANN_PASSES_BUFFER_PLAN=0``:
  no ``plan_buffers``, every intermediate allocated afresh each step, as before the plan);
  ``ours-inductor-unplanned`` the same switch on inductor (its intermediates not kept from one call
  to the next: ``cann_passes/lowering/inductor_buffers.py``);
- ``ours-eager-fused``: the update as torch's fused AdamW kernel on eager (``optimizer_kernel:
  fused``: one ``cann::fused_adam`` call, in place; bitwise the ``fused`` row's update);
  ``ours-inductor-fused`` / ``-foreach`` the fused kernel (inductor's default for Adam: it then
  generates no code for the update) / the ``_foreach_*`` update on inductor;
- ``ours-inductor-aten`` / ``ours-eager-onednn``: the float32 matmuls all on ATen's kernels (MKL) on
  inductor (``matmul_kernel: aten``; inductor's default moves each to oneDNN where a timing at compile
  finds oneDNN faster, ``linear_on_onednn``) / all on oneDNN on eager (``matmul_kernel: onednn``;
  eager's default stays on ATen's, bitwise eager PyTorch);
- ``ours-eager-masked`` / ``ours-inductor-masked``: the default pipeline without
  ``attention_masks_as_flags`` (a transformers model's causal mask, made from the sequence alone,
  built every step and handed to SDPA, as the step ran before that pass).

Rows run in interleaved rounds (every row once per round, in a rotating
order) so that load from other processes on the machine falls on all rows
alike. Each row is built and stepped in a process of its own (the others wait
while it steps), so rows share the load but not a heap, as a user's process
trains one model; ``--processes one`` runs every row in this process. Each row's time is the median over all its timed steps, and its ratio
is the median over rounds of (row / eager in the same round), with the
quartiles over rounds beside it. Two clocks: the process's CPU time (one
intra-op thread, so it is the step's work, and what load from other
processes changes least) and wall time. The matmul floor is eager's step
time times the matmul share of that step measured by ``torch.profiler``
(self time of mm / addmm / bmm / baddbmm / SDPA over the profiled window's
wall time, the profiler's own clock): the time left if everything but the
matmuls took nothing, with the same BLAS. Rows whose matmuls run on oneDNN (ours
inductor where it measured oneDNN faster, ``ours-eager-onednn``; ``bmm`` stays on
MKL) have their own matmul time, measured the same way on their steps and printed
beside the floor, below eager's. Every row's own
matmul time is printed so, with the rest of its step beside it: where the
matmuls are the same calls in every row, the rest is what a row can win.
Compilation happens before the timed rounds and is reported separately. ``--models llama`` (or another name from
``tests/zoo.py``) runs the table on a transformers model built from a config
at the same width.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.lowering.base import BUFFER_PLAN_ENV, HOST_SCALARS_ENV

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
ROWS = ("eager", "foreach", "fused", "compile", "compile+opt", "ours-eager", "ours-eager-unguarded",
        "ours-eager-foreach", "ours-eager-fused", "ours-eager-tensor-scalars", "ours-eager-unplanned", "ours-inductor", "ours-inductor-unplanned", "ours-inductor-unfused", "ours-inductor-foreach", "ours-inductor-fused",
        "ours-inductor-aten", "ours-eager-onednn", "ours-eager-masked", "ours-inductor-masked")
_KERNELS = {"-unfused": "none", "-foreach": "foreach", "-fused": "fused"}
_MATMULS = {"-aten": "aten", "-onednn": "onednn"}


@dataclass
class Case:
    """A model factory, its loss and a batch."""
    name: str
    make_model: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batch: Any
    tokens: int


@dataclass
class Row:
    name: str
    step: Callable[[Any], Any] | None
    compile_s: float = 0.0
    times: list[float] = field(default_factory=list)       # wall seconds per step
    cpu: list[float] = field(default_factory=list)         # process CPU seconds per step
    ratios: list[float] = field(default_factory=list)      # per round, wall vs eager's
    cpu_ratios: list[float] = field(default_factory=list)  # per round, CPU time vs eager's
    worker: Any = field(default=None, repr=False)          # the row's own process (``--processes rows``)

    def timed_steps(self, batch, steps: int) -> tuple[list[float], list[float]]:
        """Wall and process CPU seconds of ``steps`` steps, in the row's own process if it has one."""
        if self.worker is not None:
            reply = self.worker.ask({"cmd": "steps", "n": steps})
            return reply["times"], reply["cpu"]
        return _timed_steps(self.step, batch, steps)

    def matmul_share(self, batch) -> tuple[float, dict[str, float]]:
        if self.worker is not None:
            reply = self.worker.ask({"cmd": "share"})
            return reply["share"], reply["shares"]
        return matmul_share(self.step, batch)


def _timed_steps(step, batch, steps: int) -> tuple[list[float], list[float]]:
    ts, cs = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step(batch)
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return ts, cs


class Worker:
    """One row built and stepped in a process of its own, on command from this one: rows then share
    the machine's load (one process computes at a time, in the rounds' order) but not a heap, so
    one row's allocations (the page faults of a heap another model has fragmented) do not fall on
    another, as they do not for a user who trains one model per process."""

    def __init__(self, row: str, args):
        import subprocess
        import sys
        cmd = [sys.executable, "-m", "bench.step_time", "--worker", row, "--models", args.model,
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.built = self._read()

    def _read(self) -> dict:
        import json
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"the worker process of a row exited with {self.proc.wait()}")

    def ask(self, command: dict) -> dict:
        import json
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            self.ask({"cmd": "exit"})
            self.proc.wait()


def serve(row: str, case: Case) -> None:
    """``--worker``: build ``row``, then answer the coordinator's commands on stdin."""
    import json
    import sys

    def reply(payload: dict):
        sys.stdout.write("@@ " + json.dumps(payload) + "\n")
        sys.stdout.flush()
    built = make_row(row, case)
    reply({"compile_s": built.compile_s})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "steps":
            times, cpu = _timed_steps(built.step, case.batch, command["n"])
            reply({"times": times, "cpu": cpu})
        elif command["cmd"] == "share":
            share, shares = matmul_share(built.step, case.batch)
            reply({"share": share, "shares": shares})
        else:
            reply({})
            return


def gpt_case(batch_size: int, seq_len: int) -> Case:
    from recipes.models.gpt import GPT, GPTConfig, gpt_loss
    cfg = GPTConfig(vocab_size=256, n_layer=6, n_head=4, d_model=256, seq_len=seq_len, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=g)
    return Case("GPT 6L d256 (recipe model)", lambda: GPT(cfg), gpt_loss,
                (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()),
                batch_size * seq_len)


def zoo_case(name: str, batch_size: int, seq_len: int) -> Case:
    from tests.zoo import build, hf_loss
    width = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=seq_len)
    if name == "gpt2":
        width = dict(vocab_size=256, n_embd=256, n_inner=1024, n_head=4, n_positions=seq_len)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (batch_size, seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    model = lambda: build(name, layers=6, **width).model  # noqa: E731
    return Case(f"transformers {type(model()).__name__} 6L d256", model, hf_loss, batch, batch_size * seq_len)


def _adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **kw)


def make_row(name: str, case: Case) -> Row:
    torch.manual_seed(0)
    model = case.make_model()
    model.train()
    if name.startswith("ours-"):
        opt = _adamw(model)
        backend = name[len("ours-"):]
        masked = backend.endswith("-masked")
        backend = backend.removesuffix("-masked")
        tensor_scalars = backend.endswith("-tensor-scalars")
        unplanned = backend.endswith("-unplanned")
        backend = backend.removesuffix("-tensor-scalars").removesuffix("-unplanned")
        matmul = next((k for k in _MATMULS if backend.endswith(k)), "")
        backend = backend.removesuffix(matmul) if matmul else backend
        unguarded = backend.endswith("-unguarded")
        backend = backend.removesuffix("-unguarded")
        suffix = next((k for k in _KERNELS if backend.endswith(k)), "")
        plan = Plan(backend=backend.removesuffix(suffix) if suffix else backend,
                    optimizer_kernel=_KERNELS.get(suffix, "auto"), matmul_kernel=_MATMULS.get(matmul, "auto"))
        if masked:
            from cann_passes.pass_pipeline import build_pipeline
            default = str(build_pipeline(plan, plan.backend))
            plan = plan.replace(pipeline=default.replace("attention_masks_as_flags,", ""))
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=case.loss_fn)
        t0 = time.perf_counter()
        # The eager backend's passes and lowering read these when the step compiles, in compile().
        if tensor_scalars:
            os.environ[HOST_SCALARS_ENV] = "0"
        if unplanned:
            os.environ[BUFFER_PLAN_ENV] = "0"
        step.compile(case.batch)
        os.environ.pop(HOST_SCALARS_ENV, None)
        os.environ.pop(BUFFER_PLAN_ENV, None)
        if unguarded:
            # The same step with its guards dropped: what checking them costs per call.
            for compilation in step._compiled.values():
                compilation.guards = []
        step(case.batch)
        return Row(name, step, time.perf_counter() - t0)
    opt = _adamw(model, **({"foreach": True} if name == "foreach" else {"fused": True} if name == "fused"
                           else {"foreach": False}))
    fwd = torch.compile(model) if name.startswith("compile") else model
    opt_step = torch.compile(opt.step) if name == "compile+opt" else opt.step

    def step(batch):
        opt.zero_grad(set_to_none=True)
        case.loss_fn(fwd, batch).backward()
        opt_step()

    t0 = time.perf_counter()
    step(case.batch)
    return Row(name, step, time.perf_counter() - t0 if name.startswith("compile") else 0.0)


def matmul_share(step, batch, steps: int = 2) -> tuple[float, dict[str, float]]:
    """Share of the step's time spent in matmul kernels (the profiler's self time of the matmul ops over
    the profiled window's wall time: one clock for both)."""
    from torch.profiler import ProfilerActivity, profile
    step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(batch)
        wall = time.perf_counter() - t0
    by_op = {e.key: e.self_cpu_time_total * 1e-6 for e in prof.key_averages() if e.key in MATMUL_OPS}
    return sum(by_op.values()) / wall, {k: v / wall for k, v in by_op.items()}


def build_rows(case: Case, rows: list[str], args=None) -> list[Row]:
    """The rows, each in this process, or (``args.processes == "rows"``) each in a process of its own."""
    built = []
    for name in rows:
        t0 = time.perf_counter()
        if args is not None and args.processes == "rows":
            worker = Worker(name, args)
            built.append(Row(name, None, worker.built["compile_s"], worker=worker))
        else:
            built.append(make_row(name, case))
        print(f"  built {name:<14} in {time.perf_counter() - t0:6.1f} s", flush=True)
    return built


def run(case: Case, rows: list[str], rounds: int, steps: int, args=None) -> list[Row]:
    built = build_rows(case, rows, args)
    base = next(r for r in built if r.name == "eager")
    for k in range(rounds):
        order = built[k % len(built):] + built[:k % len(built)]
        wall, cpu = {}, {}
        for row in order:
            ts, cs = row.timed_steps(case.batch, steps)
            row.times += ts
            row.cpu += cs
            wall[row.name], cpu[row.name] = statistics.median(ts), statistics.median(cs)
        for row in built:
            row.ratios.append(wall[row.name] / wall[base.name])
            row.cpu_ratios.append(cpu[row.name] / cpu[base.name])
    return built


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[0]:.2f}-{q[2]:.2f}"


def report(case: Case, built: list[Row], share: float, shares: dict[str, float],
           own: dict[str, float] | None = None) -> str:
    base = next(r for r in built if r.name == "eager")
    torch_rows = [r for r in built if not r.name.startswith("ours-")]
    best_torch = min(torch_rows, key=lambda r: statistics.median(r.cpu_ratios))
    best_ratio = statistics.median(best_torch.cpu_ratios)
    lines = [f"{case.name}: batch {case.tokens} tokens, AdamW; {len(base.times)} steps per row; "
             "ratios are medians over rounds of (row / eager in the same round), quartiles beside",
             f"{'row':<15} {'cpu ms':>8} {'vs eager':>9} {'(quartiles)':>11} {'vs best torch':>13} | "
             f"{'wall ms':>8} {'vs eager':>9} {'(quartiles)':>11} | {'compile s':>9}"]
    for r in built:
        c, w = statistics.median(r.cpu_ratios), statistics.median(r.ratios)
        lines.append(f"{r.name:<15} {statistics.median(r.cpu) * 1e3:>8.1f} {c:>8.2f}x {_spread(r.cpu_ratios):>11} "
                     f"{c / best_ratio:>12.2f}x | {statistics.median(r.times) * 1e3:>8.1f} {w:>8.2f}x "
                     f"{_spread(r.ratios):>11} | {r.compile_s:>9.1f}")
    eager_ms = statistics.median(base.cpu) * 1e3
    lines.append(f"{'matmul floor':<15} {eager_ms * share:>8.1f} {share:>8.2f}x   "
                 f"(matmul share of eager's profiled step; the rest {eager_ms * (1 - share):.1f} ms: "
                 + ", ".join(f"{k.replace('aten::', '')} {v:.2f}" for k, v in sorted(shares.items())) + ")")
    for r in built:
        if own and r.name in own:
            ms = statistics.median(r.cpu) * 1e3
            lines.append(f"{'  ' + r.name + ' matmul':<15} {ms * own[r.name]:>8.1f} "
                         f"{statistics.median(r.cpu_ratios) * own[r.name]:>8.2f}x   (matmul share of its own "
                         f"profiled step, {own[r.name]:.2f}; the rest {ms * (1 - own[r.name]):.1f} ms)")
    lines.append(f"best torch row (CPU time): {best_torch.name} ({best_ratio:.2f}x)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=1, help="timed steps per row per round")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--models", nargs="+", default=["gpt"],
                   help="gpt (the recipe model) and/or transformers models from tests/zoo.py (llama, gpt2, ...)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: on a machine shared with other work, OpenMP barriers "
                        "waiting for a descheduled thread dominate two-thread timings)")
    p.add_argument("--processes", choices=("rows", "one"), default="rows",
                   help="rows: every row in a process of its own, stepped in turn (the default); one: every "
                        "row in this process, sharing its heap")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.worker:
        name = args.models[0]
        return serve(args.worker, gpt_case(args.batch_size, args.seq_len) if name == "gpt"
                     else zoo_case(name, args.batch_size, args.seq_len))
    if "eager" not in args.rows:
        args.rows.insert(0, "eager")
    cases = [gpt_case(args.batch_size, args.seq_len) if n == "gpt" else zoo_case(n, args.batch_size, args.seq_len)
             for n in args.models]
    tables = []
    load0 = os.getloadavg()
    for model, case in zip(args.models, cases):
        print(f"{case.name}: compiling {len(args.rows)} rows", flush=True)
        args.model = model
        built = run(case, args.rows, args.rounds, args.steps, args)
        try:
            share, shares = built[0].matmul_share(case.batch)
            own = {r.name: r.matmul_share(case.batch)[0] for r in built if r.name != "eager"}
        finally:
            for r in built:
                if r.worker is not None:
                    r.worker.close()
        tables.append(report(case, built, share, shares, own))
        print(tables[-1], flush=True)
    where = "each row in its own process" if args.processes == "rows" else "all rows in one process"
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}; rounds {args.rounds} x {args.steps} "
          f"steps, interleaved, {where}; load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} "
          f"at the end ({os.cpu_count()} CPUs)")
    return tables


if __name__ == "__main__":
    main()
