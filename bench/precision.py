"""Mixed precision on the GPT recipe model: bf16 and fp16 against fp32 from the same weights.

    python -m bench.precision [--steps 20] [--backend eager]

Prints each report (loss curves' largest deviation, casts, saved activations,
fp16 loss-scale history) and the step time of each precision relative to fp32
on this machine, whatever it is: a CPU has no fast bf16 matmul units, so
there the ratio says what the casts cost, not what an NPU would gain.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from cann_passes import Plan
from cann_passes.reports import precision_report
from recipes.data.text import TextBatches, load_corpus
from recipes.models.gpt import GPT, gpt_loss, gpt_small_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--backend", default="eager")
    args = parser.parse_args()

    def model():
        torch.manual_seed(0)
        return GPT(gpt_small_cpu())

    batches = list(itertools.islice(TextBatches(load_corpus(), args.batch, args.seq, seed=0), args.steps))
    print(f"GPT gpt_small_cpu, batch {args.batch}x{args.seq}, {args.steps} steps, backend {args.backend}")
    for precision in ("bf16", "fp16"):
        report = precision_report(model, Plan(precision=precision, backend=args.backend), batches,
                                  args.steps, loss_fn=gpt_loss)
        print(report.to_text())
        print(f"  step time {precision}/fp32 = {report.seconds_per_step / report.seconds_per_step_fp32:.2f}x "
              f"({report.seconds_per_step * 1e3:.0f} ms vs {report.seconds_per_step_fp32 * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
