"""Recompute selection: this project's ``recompute`` pass against torch's min-cut partitioner.

One 4-layer GPT (d_model 256, 4 heads, seq 128, batch 4, dropout 0.1). Torch's
``min_cut_rematerialization_partition`` runs on AOTAutograd's joint graph at
``activation_memory_budget`` 0.75 / 0.5 / 0.25 / 0.1; its saved bytes are the
backward graph's inputs that are neither tangents nor primals (parameters and
the batch). The pass then runs on this project's captured step with an
absolute budget equal to torch's achieved saved bytes. Recompute cost for
torch is its backward graph minus the backward of torch's no-recompute
partition (``default_partition``); for the pass it is the nodes it tagged
``recompute``. Times come from the ``ascend_910b`` roofline, the profile the
pass optimises for here. Peaks are this project's memory analysis run on each
graph (torch: max of forward peak and saved + backward peak).

    python bench/recompute_vs_torch.py
"""
from __future__ import annotations

import functools
import sys

import torch
import torch._functorch.config as functorch_config
from torch._functorch.aot_autograd import aot_function, make_boxed_compiler
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

sys.path.insert(0, ".")
from cann_passes.cost_model import get_profile, node_time  # noqa: E402
from cann_passes.pass_manager import PassContext, PassManager  # noqa: E402
from graph_ir import capture_train_step  # noqa: E402
from graph_ir.analysis import memory_profile  # noqa: E402
from graph_ir.analysis.cost import node_cost  # noqa: E402
from graph_ir.meta import RECOMPUTE  # noqa: E402
from recipes.models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

CFG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256, seq_len=128, dropout=0.1)
BATCH = 4
BUDGETS = (0.75, 0.5, 0.25, 0.1)
PROFILE = get_profile("ascend_910b")


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _work(nodes):
    flops = sum(node_cost(n).flops for n in nodes)
    written = sum(node_cost(n).bytes_written for n in nodes)
    return flops, written, sum(node_time(n, PROFILE) for n in nodes)


def torch_joint():
    """AOTAutograd's joint graph of the model's loss, captured once."""
    torch.manual_seed(0)
    model = GPT(CFG)
    params = dict(model.named_parameters())
    idx = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len))
    tgt = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len))
    names = list(params)
    held = {}

    def loss_fn(*flat):
        p = dict(zip(names, flat[:len(names)]))
        return torch.func.functional_call(model, p, (flat[-2],)).reshape(-1, CFG.vocab_size), flat[-1]

    def f(*flat):
        logits, t = loss_fn(*flat)
        return torch.nn.functional.cross_entropy(logits, t.reshape(-1))

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kw):
        held.update(joint=joint, inputs=joint_inputs, num_fwd_outputs=num_fwd_outputs)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)

    compiled = aot_function(f, fw_compiler=make_boxed_compiler(lambda g, _: g), partition_fn=partition)
    compiled(*[p.detach().requires_grad_(True) for p in params.values()], idx, tgt)
    return held


def torch_partition(held, budget):
    if budget is None:
        return default_partition(held["joint"], held["inputs"], num_fwd_outputs=held["num_fwd_outputs"])
    with functorch_config.patch(activation_memory_budget=budget):
        return min_cut_rematerialization_partition(held["joint"], held["inputs"],
                                                   num_fwd_outputs=held["num_fwd_outputs"])


def torch_saved_bytes(bw) -> int:
    from graph_ir.meta import nbytes
    return sum(nbytes(n.meta.get("val")) for n in bw.graph.nodes if n.op == "placeholder"
               and not n.name.startswith(("tangents_", "primals_")))


def torch_peak(fw, bw, saved) -> int:
    return max(memory_profile(fw.graph).peak_bytes, saved + memory_profile(bw.graph).peak_bytes
               - memory_profile(bw.graph).resident_bytes)


def ours(budget_bytes):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len)),) * 2
    tg, _ = capture_train_step(model, opt, gpt_loss, batch)
    ctx = PassContext(device_profile=PROFILE)
    out = PassManager(f"cleanup,recompute{{policy=budget,budget={budget_bytes}}}",
                      verify_level="off").run(tg, ctx)
    mp = memory_profile(out.graph)
    rec = [n for n in out.graph.nodes if n.meta.get(RECOMPUTE)]
    # Peak of forward + backward only: the optimizer update is not in torch's graphs.
    peak = max(v for r, v in mp.peak_by_region.items() if r in ("forward", "backward"))
    return mp.saved_bytes, _work(rec), peak


def main():
    held = torch_joint()
    fw0, bw0 = torch_partition(held, None)
    base = _work(_calls(bw0))
    print(f"{'budget':>6} | {'who':<6} {'saved MiB':>9} {'recompute GFLOP':>15} {'written MiB':>11} "
          f"{'time us (910B)':>14} {'peak MiB':>8} | ours/torch: saved, time")
    for budget in BUDGETS:
        fw, bw = torch_partition(held, budget)
        t_saved = torch_saved_bytes(bw)
        work = _work(_calls(bw))
        t_rec = tuple(max(0, a - b) for a, b in zip(work, base))
        t_peak = torch_peak(fw, bw, t_saved)
        o_saved, o_rec, o_peak = ours(t_saved)
        for who, saved, rec, peak in (("torch", t_saved, t_rec, t_peak), ("ours", o_saved, o_rec, o_peak)):
            tail = ""
            if who == "ours":
                tail = f"| {o_saved / max(1, t_saved):.3f}, {o_rec[2] / max(1e-12, t_rec[2]):.3f}"
            print(f"{budget:>6} | {who:<6} {saved / 2**20:>9.2f} {rec[0] / 1e9:>15.3f} {rec[1] / 2**20:>11.2f} "
                  f"{rec[2] * 1e6:>14.1f} {peak / 2**20:>8.1f} {tail}")


if __name__ == "__main__":
    main()
