"""Recompute selection against torch's min-cut partitioner, measured in wall time at equal saved bytes.

    python -m bench.recompute_vs_torch [--rounds 9] [--threads 1]

One 4-layer GPT (d_model 256, 4 heads, seq 128, batch 4, dropout 0.1).

torch: AOTAutograd's joint graph of the loss, partitioned by
``min_cut_rematerialization_partition`` at ``activation_memory_budget`` 1.0
(its baseline) and 0.75 / 0.5 / 0.25 / 0.1; the forward and backward graphs
run as plain FX code on real tensors. Its saved bytes are the backward
graph's inputs that are neither tangents nor primals; its recomputed FLOPs
are its backward's FLOPs minus those of ``default_partition``'s backward (no
recompute at all).

ours: the captured whole step (forward, backward, SGD), ``cleanup`` then
``recompute{policy=budget}`` with an absolute budget equal to torch's saved
bytes at that budget, priced with the ``cpu`` profile calibrated on this
machine (the profile the pass uses when it runs here); the baseline is the
step without recompute, and the graphs run on the eager backend.

Overhead = (variant - own baseline), each measured (wall time, or with
``--clock cpu`` the process's CPU time) in interleaved rounds
(every variant once per round, rotating order) and taken as the median over
rounds; "goal" holds when ours <= torch's + 1% of our baseline step. The
Pareto check: ours is dominated when torch's (recomputed FLOPs, saved bytes)
is no larger in both and smaller in one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._functorch.config as functorch_config
from torch._functorch.aot_autograd import aot_function, make_boxed_compiler
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from cann_passes.cost_model import get_profile
from cann_passes.lowering.eager import EagerLowering
from cann_passes.pass_manager import PassContext, PassManager
from graph_ir import capture_train_step, gather_inputs
from graph_ir.analysis import memory_profile
from graph_ir.analysis.cost import node_cost
from graph_ir.meta import RECOMPUTE, nbytes
from recipes.models.gpt import GPT, GPTConfig, gpt_loss

CFG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256, seq_len=128, dropout=0.1)
BATCH = 4
BUDGETS = (0.75, 0.5, 0.25, 0.1)


def _flops(gm) -> int:
    return sum(node_cost(n).flops for n in gm.graph.nodes if n.op == "call_function")


def _batch():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


class TorchSide:
    """AOTAutograd's joint graph of the model's loss, captured once, partitioned per budget."""

    def __init__(self):
        torch.manual_seed(0)
        model = GPT(CFG)
        params = dict(model.named_parameters())
        names = list(params)
        idx, tgt = _batch()
        held = {}

        def f(*flat):
            p = dict(zip(names, flat[:len(names)]))
            logits = torch.func.functional_call(model, p, (flat[-2],))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), flat[-1].reshape(-1))

        def partition(joint, joint_inputs, *, num_fwd_outputs, **kw):
            held.update(joint=joint, inputs=joint_inputs, num_fwd_outputs=num_fwd_outputs)
            return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)

        compiled = aot_function(f, fw_compiler=make_boxed_compiler(lambda g, _: g), partition_fn=partition)
        self.primals = [p.detach().requires_grad_(True) for p in params.values()] + [idx, tgt]
        compiled(*self.primals)
        self.held = held
        self.primals = [p.detach() for p in self.primals]
        self.base_bw_flops = _flops(self.partition(None)[1])

    def partition(self, budget):
        h = self.held
        if budget is None:
            return default_partition(h["joint"], h["inputs"], num_fwd_outputs=h["num_fwd_outputs"])
        with functorch_config.patch(activation_memory_budget=budget):
            return min_cut_rematerialization_partition(h["joint"], h["inputs"],
                                                       num_fwd_outputs=h["num_fwd_outputs"])

    def variant(self, budget):
        fw, bw = self.partition(budget)
        saved = sum(nbytes(n.meta.get("val")) for n in bw.graph.nodes if n.op == "placeholder"
                    and not n.name.startswith(("tangents_", "primals_")))
        n_out = self.held["num_fwd_outputs"]
        primals = self.primals
        tangents = [torch.ones(())]

        def run():
            with torch.no_grad():
                outs = fw(*primals)
                bw(*outs[n_out:], *tangents)

        return run, saved, max(0, _flops(bw) - self.base_bw_flops)


class OurSide:
    def __init__(self, profile):
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.batch = _batch()
        self.captured, self.layout = capture_train_step(self.model, self.opt, gpt_loss, self.batch)
        self.inputs = gather_inputs(self.model, self.opt, self.layout, self.batch)
        self.profile = profile

    def variant(self, budget_bytes):
        pipeline = "cleanup" if budget_bytes is None else \
            f"cleanup,recompute{{policy=budget,budget={budget_bytes},profile={self.profile}}}"
        ctx = PassContext()
        out = PassManager(pipeline, verify_level="off").run(self.captured.copy(), ctx)
        gm = EagerLowering().compile(out, self.inputs, None)
        rec = [n for n in out.graph.nodes if n.meta.get(RECOMPUTE)]
        inputs = self.inputs

        def run():
            with torch.no_grad():
                gm(*inputs)

        return run, memory_profile(out.graph).saved_bytes, sum(node_cost(n).flops for n in rec)


def measure(variants: dict, rounds: int, calls: int, clock) -> dict[str, list[float]]:
    names = list(variants)
    per_round = {n: [] for n in names}
    for fn in variants.values():
        fn()
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            ts = []
            for _ in range(calls):
                t0 = clock()
                variants[name]()
                ts.append(clock() - t0)
            per_round[name].append(statistics.median(ts))
    return per_round


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=2, help="timed calls per variant per round")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: on a shared machine two-thread timings are "
                        "dominated by OpenMP barriers waiting for a descheduled thread)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (what load from other processes changes least)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    profile = get_profile("cpu")
    torch_side, ours = TorchSide(), OurSide("cpu")
    variants, info = {}, {}
    variants["torch@1.0"], t_base_saved, _ = torch_side.variant(1.0)
    variants["ours@none"], o_base_saved, _ = ours.variant(None)
    for b in BUDGETS:
        run, saved, flops = torch_side.variant(b)
        variants[f"torch@{b}"], info[("torch", b)] = run, (saved, flops)
        t0 = time.perf_counter()
        run, o_saved, o_flops = ours.variant(saved)
        variants[f"ours@{b}"], info[("ours", b)] = run, (o_saved, o_flops, time.perf_counter() - t0)
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    clock = clocks[args.clock]
    times = measure(variants, args.rounds, args.calls, clock)
    step = statistics.median(times["ours@none"])

    def overhead(name, base):
        return statistics.median(a - b for a, b in zip(times[name], times[base]))

    def spread(name, base):
        q = statistics.quantiles([a - b for a, b in zip(times[name], times[base])], n=4)
        return f"{q[0] * 1e3:.1f}..{q[2] * 1e3:.1f}"

    print(f"4-layer GPT d256 s128 b4 dropout 0.1, {args.threads} thread(s), {args.clock} time, {args.rounds} "
          f"interleaved rounds x {args.calls} calls")
    print(f"baselines: torch min-cut@1.0 fwd+bwd {statistics.median(times['torch@1.0']) * 1e3:.1f} ms "
          f"(saved {t_base_saved / 2**20:.2f} MiB); ours fwd+bwd+SGD, no recompute {step * 1e3:.1f} ms "
          f"(saved {o_base_saved / 2**20:.2f} MiB)")
    print(f"cpu profile: matmul {profile.matrix_flops['fp32'] / 1e9:.1f} GFLOP/s, "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in profile.class_bandwidth.items())
          + f", {profile.op_overhead * 1e6:.1f} us/op")
    print(f"{'budget':>6} | {'who':<5} {'saved MiB':>9} {'recompute GFLOP':>15} {'overhead ms':>11} "
          f"{'(quartiles)':>13} {'% of step':>9} | {'goal':>4} {'dominated':>9}")
    results = []
    for b in BUDGETS:
        t_saved, t_flops = info[("torch", b)]
        o_saved, o_flops, solve_s = info[("ours", b)]
        t_over = overhead(f"torch@{b}", "torch@1.0")
        o_over = overhead(f"ours@{b}", "ours@none")
        goal = o_over <= t_over + 0.01 * step
        dominated = (t_flops <= o_flops and t_saved <= o_saved) and (t_flops < o_flops or t_saved < o_saved)
        results.append((b, goal, dominated))
        print(f"{b:>6} | {'torch':<5} {t_saved / 2**20:>9.2f} {t_flops / 1e9:>15.3f} {t_over * 1e3:>11.1f} "
              f"{spread(f'torch@{b}', 'torch@1.0'):>13} {t_over / step * 100:>8.1f}% |")
        print(f"{'':>6} | {'ours':<5} {o_saved / 2**20:>9.2f} {o_flops / 1e9:>15.3f} {o_over * 1e3:>11.1f} "
              f"{spread(f'ours@{b}', 'ours@none'):>13} {o_over / step * 100:>8.1f}% | {'yes' if goal else 'NO':>4} {'YES' if dominated else 'no':>9}"
              f"   (pass {solve_s:.1f} s)")
    return results


if __name__ == "__main__":
    main()
