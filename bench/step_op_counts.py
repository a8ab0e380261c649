"""What one training step dispatches: eager PyTorch against the compiled step, op by op.

    python -m bench.step_op_counts [--layers 6] [--d-model 16] [--steps 50]

A GPT-style model trained with AdamW at a width where each op's dispatch, not its arithmetic, is
the step's time: the aten ops one step runs (counted under a ``TorchDispatchMode``), how many
of them return a 0-dim tensor, the ops each side runs most, and the median wall time per step
over ``--steps`` steps, the two sides interleaved. The compiled step runs on the eager backend,
so the difference in ops is the difference in dispatches. A third row keeps the update's
step-count arithmetic as 0-dim tensor ops (``$CANN_PASSES_HOST_SCALARS=0``), as the eager
lowering ran it before it computed that arithmetic as Python floats.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cann_passes import Plan, compile_for_npu
from cann_passes.lowering.base import HOST_SCALARS_ENV
from recipes.models.gpt import GPT, GPTConfig, gpt_loss


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.zero_dim = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        self.zero_dim += isinstance(out, torch.Tensor) and out.dim() == 0
        return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=args.d_model, n_layer=args.layers, n_head=2)
    eager_model, ours_model, tensor_model = GPT(cfg), GPT(cfg), GPT(cfg)
    ours_model.load_state_dict(eager_model.state_dict())
    tensor_model.load_state_dict(eager_model.state_dict())
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)

    def compiled_step(model, host_scalars: bool):
        step = compile_for_npu(model, Plan(backend="eager"),
                               optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=gpt_loss)
        os.environ[HOST_SCALARS_ENV] = "1" if host_scalars else "0"   # read when the step is lowered
        step.compile(batch)
        os.environ.pop(HOST_SCALARS_ENV)
        return step

    compiled, tensor_scalars = compiled_step(ours_model, True), compiled_step(tensor_model, False)

    def eager():
        gpt_loss(eager_model, batch).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)

    rows = {"eager": eager, "ours eager": lambda: compiled(batch),
            "ours eager, 0-dim tensor scalars": lambda: tensor_scalars(batch)}
    for fn in rows.values():
        fn(), fn()   # the optimizer state exists, the compiled step is built
    times = {name: [] for name in rows}
    for _ in range(args.steps):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    n_params = sum(1 for _ in eager_model.parameters())
    print(f"{args.layers}-layer GPT, d_model {args.d_model}, {n_params} parameters, AdamW, 1 thread; "
          f"median of {args.steps} steps")
    print(f"{'row':>32} {'ms/step':>8} {'ratio':>6} {'ops':>6} {'0-dim':>6}  most run")
    base = statistics.median(times["eager"])
    for name, fn in rows.items():
        count = _Count()
        with count:
            fn()
        ms = statistics.median(times[name])
        top = ", ".join(f"{op} {n}" for op, n in count.ops.most_common(4))
        print(f"{name:>32} {ms * 1e3:>8.2f} {ms / base:>5.2f}x {sum(count.ops.values()):>6} "
              f"{count.zero_dim:>6}  {top}")


if __name__ == "__main__":
    main()
