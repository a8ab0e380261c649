"""One rank of the in-place update tests: ``python tests/distributed/inplace_worker.py SCENARIO OUTDIR``.

``parity``: a transformers GPT-2 built from a config, under data parallelism and ZeRO-1/2/3 with SGD
(momentum) and AdamW; before every step this rank's inputs are bound and fed, cloned, to the
functional variant of the same graph, and after the step what the in-place step left (parameters,
parameter shards, optimizer state, loss) is compared with its outputs, bitwise.
Then, under ZeRO-1 (the stage with collectives after the writes), rank 1 gets labels out of the
vocabulary at the third step; each rank saves its parameters, shards and state from before the step
and from after the failed call. One launch runs both, as the process groups cannot be used after a
rank skipped a collective.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.runtime.binding import bind_inputs  # noqa: E402
from cann_passes.runtime.distributed import init_distributed, shard_batch  # noqa: E402
from graph_ir.multi_tensor_ops import FUSED_ADAM  # noqa: E402
from graph_ir.signature import OutputKind, split_state_name  # noqa: E402
from tests import zoo  # noqa: E402

STEPS = 3
STAGES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
# Runs: (strategy, optimizer, gradient clipping norm); every strategy with both optimizers, ZeRO-2's
# AdamW with clipping, which adds a collective of the optimizer's own (the norm's all-reduce).
# ``adamw_fused``: AdamW with ``optimizer_kernel: fused`` (torch's fused kernel, written in place),
# against torch.optim's ``fused=True``.
RUNS = [(strategy, kind, 0.5 if (strategy, kind) == ("zero2", "adamw") else None)
        for strategy in STAGES for kind in ("sgd", "adamw")] + [
    (strategy, "adamw_fused", None) for strategy in ("dp", "zero1", "zero3")]
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


def make(kind: str, reference: bool = False):
    """The model and optimizer of a run; ``reference``: the optimizer torch.optim runs it with."""
    entry = zoo.build("gpt2", layers=2)
    if reference and kind == "adamw_fused":
        return entry, torch.optim.AdamW(entry.model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    return entry, OPTIMIZERS[kind](entry.model.parameters())


def global_batch(i: int):
    return zoo.causal_lm_batch(1000 + i, pad=False)


def run_name(strategy: str, kind: str, clip) -> str:
    return f"{strategy}/{kind}" + ("" if clip is None else f"/clip{clip}")


def _held(step, graph, spec, params, opt):
    """What the step holds after the call for output ``spec`` (a parameter, its shard or a state entry)."""
    key = f"{spec.kind}:{spec.name}"
    if spec.kind == OutputKind.PARAM:
        return step.shards.local[key] if key in step.shards.local else params[spec.name].detach()
    name, entry = split_state_name(spec.name)
    return opt.state[params[name]][entry]


def parity(world_size: int, out: str):
    # Every buffer plan_buffers may hold is held (no size floor): a slot handed on too early, or an
    # all-gather's held output read late, shows as a mismatch with the functional step.
    base = Plan(backend="eager", dp=world_size, bucket_mb=0.005, compile_cache="off",
                extra_passes=("plan_buffers{min_bytes=0}",))
    result = {}
    with init_distributed(base) as world:
        for strategy, kind, clip in RUNS:
            entry, opt = make(kind)
            model = entry.model
            kernel = "fused" if kind.endswith("_fused") else "auto"
            step = compile_for_npu(model, base.replace(zero_stage=STAGES[strategy], grad_clip_norm=clip,
                                                       optimizer_kernel=kernel),
                                   optimizer=opt, loss_fn=entry.loss_fn)
            params = dict(model.named_parameters())
            losses, mismatches, storage = [], [], None
            for i in range(STEPS):
                batch = shard_batch(global_batch(i), world.dp_rank, world.dp_size)
                comp = step.compile(batch)
                graph, runner = comp.program["step"], comp.runners["step"]
                inputs = bind_inputs(graph, model, opt, batch, step.step_state, step.shards, step._init_state)
                if runner._functional is None:
                    runner._functional = runner._make_functional()
                functional = runner._functional(*[t.clone() for t in inputs])
                losses.append(float(step(batch)))
                for spec, want in zip(graph.signature.outputs, functional):
                    if spec.kind == OutputKind.LOSS:
                        got = torch.tensor(losses[-1], dtype=want.dtype)
                    elif spec.kind in (OutputKind.PARAM, OutputKind.OPT_STATE):
                        got = _held(step, graph, spec, params, opt)
                    else:
                        continue
                    if not torch.equal(got, want.detach()):
                        mismatches.append(f"step {i} {spec.kind}:{spec.name}")
                held = [_held(step, graph, s, params, opt).data_ptr() for s in graph.signature.outputs
                        if s.kind in (OutputKind.PARAM, OutputKind.OPT_STATE)]
                if i == 1:
                    storage = held
                if i == 2:
                    kept = sum(a == b for a, b in zip(storage, held))
            result[run_name(strategy, kind, clip)] = {
                "losses": losses, "mismatches": mismatches, "written": list(runner.written_inputs),
                "storage_kept": kept,
                "fused_calls": sum(n.target is FUSED_ADAM for n in graph.graph.nodes),
                "held": sum(n.op == "get_attr" and n.target.startswith("_held_") for n in runner.run.graph.nodes),
                "held_all_gathers": sum(n.target is torch.ops._c10d_functional.all_gather_into_tensor_out.default
                                        for n in runner.run.graph.nodes),
                "params": {n: p.detach().clone() for n, p in model.state_dict().items()}}
        torch.save(result, f"{out}/parity.rank{world.rank}.pt")
        failure(world, base.replace(zero_stage=1), out)


def _snapshot(step, model, opt):
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "shards": {k: v.clone() for k, v in step.shards.local.items()},
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}}


def failure(world, plan: Plan, out: str):
    entry, opt = make("adamw")
    model = entry.model
    step = compile_for_npu(model, plan, optimizer=opt, loss_fn=entry.loss_fn)
    for i in range(2):
        step(shard_batch(global_batch(i), world.dp_rank, world.dp_size))
    written = list(step.last.runners["step"].written_inputs)
    before = _snapshot(step, model, opt)
    batch = shard_batch(global_batch(2), world.dp_rank, world.dp_size)
    if world.rank == 1:
        batch["labels"] = batch["labels"] + 10 * zoo.VOCAB        # out of the vocabulary: the loss fails
    try:
        step(batch)
        error = None
    except Exception as exc:    # rank 1: the loss's bounds check; rank 0: its peer is gone
        error = f"{type(exc).__name__}: {exc}"
    torch.save({"before": before, "after": _snapshot(step, model, opt), "error": error, "written": written},
               f"{out}/failure.rank{world.rank}.pt")
    sys.stdout.flush()
    # Not leaving through the runtime's shutdown: its barrier needs the process groups, which
    # cannot be used after a rank skipped a collective.
    os._exit(0)


if __name__ == "__main__":
    scenario, out, *args = sys.argv[1:]
    {"parity": parity}[scenario](int(os.environ["WORLD_SIZE"]), out, *args)
