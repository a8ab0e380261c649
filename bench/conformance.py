"""The conformance matrix: models users bring × plan features, eager backend, printed side by side.

    python -m bench.conformance [--models gpt,llama] [--plans fp32,bf16] [--backend inductor]

With ``--backend inductor`` the defaults are the inductor matrix (GPT-2, LLaMA, BERT ×
fp32, bf16, selective; several minutes of compiling on a small CPU machine).

Each cell trains 3 steps with real padded batches from the same initial weights
as its reference (tests/conformance/matrix.py says what each cell checks):
``ok`` (recompute cells: saved activation bytes / no recompute; bf16/fp16: the
largest relative loss gap to eager torch.autocast), ``FAIL`` or ``refused``
with the reason. Then ``full`` recompute's saved bytes on 4-layer models.
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings

from tests.conformance.matrix import (INDUCTOR_MODELS, INDUCTOR_PLANS, MODEL_TITLES, MODELS, PLANS,
                                      ModelRuns, format_matrix, full_recompute_ratio, run_cell)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="default: every model (inductor: gpt2,llama,bert)")
    parser.add_argument("--plans", default=None, help="default: every plan (inductor: fp32,bf16,selective)")
    parser.add_argument("--no-full-4-layers", action="store_true")
    parser.add_argument("--backend", default="eager", help="eager (the matrix) or inductor")
    args = parser.parse_args(argv)
    inductor = args.backend == "inductor"
    args.models = args.models or ",".join(INDUCTOR_MODELS if inductor else MODELS)
    args.plans = args.plans or ",".join(INDUCTOR_PLANS if inductor else PLANS)
    args.no_full_4_layers = args.no_full_4_layers or inductor   # the 4-layer figure is the eager matrix's
    models = args.models.split(",")
    plans = [p if p in PLANS else p.replace("_", " ") for p in args.plans.split(",")]
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    start = time.perf_counter()
    cells = {}
    for m in models:
        runs = ModelRuns(m, backend=args.backend)
        for p in plans:
            cells[(m, p)] = run_cell(runs, p)
        print(f"{MODEL_TITLES[m]}: " + ", ".join(f"{p}: {cells[(m, p)]}" for p in plans), flush=True)
    print()
    print(format_matrix(cells, models, plans))
    if not args.no_full_4_layers:
        print("\nfull recompute, 4 layers: saved activation bytes / no recompute")
        for m in models:
            try:
                print(f"  {MODEL_TITLES[m]:<28} {full_recompute_ratio(m):.3f}")
            except Exception as exc:
                print(f"  {MODEL_TITLES[m]:<28} refused: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    print(f"\n{len(cells)} cells in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
