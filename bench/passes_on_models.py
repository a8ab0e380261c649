"""autocast and recompute on the models users bring: deviation from eager autocast, saved bytes.

For each model of ``tests/zoo.py`` (tiny transformers configs, padded batches) and the recipe
GPT with SDPA attention:

- bf16 / fp16: the largest relative loss deviation, over 3 AdamW steps, of the compiled step
  (eager backend, CUDA op lists) from eager ``torch.autocast(device_type="cpu")`` on the same
  weights and batches (the fp16 reference has no GradScaler; at the plan's initial scale
  2**16 none of these models overflows, so the compiled step skips no step either);
- saved activation bytes (forward values the backward reads) of a 4-layer model for the
  recompute policies none / selective / full / every_n_layers (2), and full / none.

    .venv/bin/python -m bench.passes_on_models            # every model
    .venv/bin/python -m bench.passes_on_models llama t5   # some
"""
from __future__ import annotations

import sys

import torch

from cann_passes import Plan
from cann_passes.pass_manager import PassContext, PassManager
from graph_ir import capture_train_step
from graph_ir.analysis import memory_profile
from tests.zoo import MODELS, build, compare

VARIANTS = [(m, {}) for m in MODELS] + [("gpt", {"attention": "sdpa"})]
POLICIES = ("none", "selective", "full", "every_n_layers")


def precision_deviation(name: str, precision: str, config: dict) -> float:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    run = compare(name, Plan(backend="eager", precision=precision), steps=3, autocast=dtype, **config)
    return max(abs(a - b) / abs(b) for a, b in zip(run.compiled_losses, run.eager_losses))


def saved_bytes(name: str, config: dict) -> dict[str, int]:
    entry = build(name, layers=4, **config)
    opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    tg, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0))
    out = {}
    for policy in POLICIES:
        spec = f"cleanup,recompute{{policy={policy},every_n={2 if policy == 'every_n_layers' else 1}}},cleanup"
        graph = PassManager(spec).run(tg.copy(), PassContext())
        out[policy] = memory_profile(graph.graph).saved_bytes
    return out


def main(names: list[str]) -> None:
    print(f"{'model':<12} {'bf16 dev':>9} {'fp16 dev':>9} " + " ".join(f"{p:>14}" for p in POLICIES)
          + f" {'full/none':>9}")
    for name, config in VARIANTS:
        label = name + ("-sdpa" if config else "")
        if names and name not in names and label not in names:
            continue
        bf16, fp16 = (precision_deviation(name, p, config) for p in ("bf16", "fp16"))
        saved = saved_bytes(name, config)
        print(f"{label:<12} {bf16:>9.2e} {fp16:>9.2e} " + " ".join(f"{saved[p]:>14,}" for p in POLICIES)
              + f" {saved['full'] / saved['none']:>9.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
