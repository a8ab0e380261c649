"""Step time of the compiled whole step against eager PyTorch, small GPT on this CPU.

    python -m bench.step_time [--steps 30] [--backends eager inductor]

Eager PyTorch (forward, backward, torch.optim.AdamW.step) is the baseline;
each compiled backend's median step time is printed beside it as a ratio.
Compilation time is reported separately and excluded from step time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from cann_passes import Plan, compile_for_npu
from recipes.data import TextBatches, load_corpus
from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu


def _median_step(fn, batches, warmup: int = 3) -> float:
    times = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        fn(b)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--backends", nargs="+", default=["eager", "inductor"])
    args = p.parse_args(argv)
    batches = [b for b, _ in zip(TextBatches(load_corpus(), args.batch_size, args.seq_len, seed=0),
                                 range(args.steps))]

    def fresh():
        torch.manual_seed(0)
        model = GPT(gpt_small_cpu(seq_len=args.seq_len))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    model, opt = fresh()

    def eager_step(batch):
        opt.zero_grad(set_to_none=True)
        gpt_loss(model, batch).backward()
        opt.step()

    rows = [("eager PyTorch", _median_step(eager_step, batches), 0.0)]
    for backend in args.backends:
        model_c, opt_c = fresh()
        step = compile_for_npu(model_c, Plan(backend=backend), optimizer=opt_c, loss_fn=gpt_loss)
        t0 = time.perf_counter()
        step.compile(batches[0])
        compile_s = time.perf_counter() - t0
        rows.append((f"compiled ({backend})", _median_step(step, batches), compile_s))
    base = rows[0][1]
    tokens = args.batch_size * args.seq_len
    print(f"{'step':<22} {'median ms':>10} {'tokens/s':>10} {'vs eager':>9} {'compile s':>10}")
    for name, t, c in rows:
        print(f"{name:<22} {t * 1e3:>10.1f} {tokens / t:>10,.0f} {base / t:>8.2f}x {c:>10.1f}")
    return rows


if __name__ == "__main__":
    main()
