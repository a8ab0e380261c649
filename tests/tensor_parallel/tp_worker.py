"""One rank of tensor-parallel runs: ``python tests/tensor_parallel/tp_worker.py OUT SCENARIO...``.

A scenario is ``model:optimizer[:option...]`` (``llama:adamw:sequence_parallel``), model a
``tests.zoo`` name, optimizer sgd or adamw, options boolean options of the pass (the shards
bound here); ``step:model:optimizer[:zeroN][:ckpt]`` compiles with ``compile_for_npu`` (the
runtime binds the shards); ``resume:model:optimizer`` resumes the checkpoint a ``ckpt`` run
saved, on this launch's mesh.

Launched by the tests with ``launch_local`` (torchrun's environment). Every rank
captures the whole step of a full model, runs the ``tensor_parallel`` pass for
its own coordinate, and trains 10 steps on the same batches, holding only its
shards; at the end the shards are gathered and rank 0 writes the losses and
the full parameters to OUT/<scenario>.pt.

The shard binding here follows the layout the pass records in
``graph.attrs["tensor_parallel"]["params"]`` (dim and parts per parameter).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from graph_ir import capture_train_step, gather_inputs  # noqa: E402
from graph_ir.signature import InputKind, OutputKind, split_state_name  # noqa: E402
from cann_passes.pass_manager import PassContext, PassManager, Pipeline  # noqa: E402
from cann_passes.passes.tensor_parallel import count_collectives  # noqa: E402
from tests import zoo  # noqa: E402
from tests.gloo_scenarios import verify_level  # noqa: E402

STEPS = 10


# tp=4 needs 4 kv heads: the tp=4 LLaMA keeps GQA with 8 query heads.
CONFIGS = {"llama8": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4})}


def make(name: str, opt: str):
    name, config = CONFIGS.get(name, (name, {}))
    entry = zoo.build(name, layers=2, seed=0, **config)
    if opt == "sgd":
        optimizer = torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(entry.model.parameters(), lr=1e-3, weight_decay=0.01)
    return entry, optimizer


def batches(entry, pad: bool = True, row: bool = False):
    """``row``: one unpadded row without an attention mask (the planner's shape: the model makes
    its causal mask itself, and a [1, seq] batch flattens to a plain sequence shard)."""
    if row:
        return [{k: v[:1] for k, v in entry.make_batch(1000 + i, pad=False).items() if k != "attention_mask"}
                for i in range(STEPS)]
    return [entry.make_batch(1000 + i, pad=pad) for i in range(STEPS)]


def microbatches_of(options) -> int:
    return next((int(o.removeprefix("mb")) for o in options if o.startswith("mb")), 1)


class Mesh:
    """A one-axis mesh description over the world: what the pass reads."""

    def __init__(self, group):
        self.group = group

    def size(self, axis):
        return dist.get_world_size(self.group)

    def local_rank(self, axis):
        return dist.get_rank(self.group)

    def group_name(self, axis):
        return self.group.group_name


def layout_of(graph, spec):
    params = graph.attrs["tensor_parallel"]["params"]
    if spec.kind == InputKind.PARAM:
        return params.get(spec.name)
    if spec.kind == InputKind.OPT_STATE:
        name, key = split_state_name(spec.name)
        return params.get(name) if key != "step" else None
    return None


def shard(full: torch.Tensor, layout, rank: int, n: int) -> torch.Tensor:
    if layout is None:
        return full.detach().clone()
    dim, parts = layout["dim"], layout["parts"]
    blocks = full.detach().chunk(parts, dim)
    return torch.cat([b.chunk(n, dim)[rank] for b in blocks], dim).clone()


def unshard(pieces: list[torch.Tensor], layout) -> torch.Tensor:
    if layout is None:
        return pieces[0]
    dim, parts = layout["dim"], layout["parts"]
    per_rank = [p.chunk(parts, dim) for p in pieces]
    return torch.cat([torch.cat([pr[b] for pr in per_rank], dim) for b in range(parts)], dim)


def main(out: str, *scenarios: str):
    """``scenarios`` may start with ``tp=N``: a (dp = world / N) x tp mesh for the step scenarios."""
    from cann_passes import Plan
    from cann_passes.runtime.distributed import init_distributed
    world_size = int(os.environ["WORLD_SIZE"])
    tp = int(scenarios[0].removeprefix("tp=")) if scenarios[0].startswith("tp=") else world_size
    scenarios = scenarios[1:] if scenarios[0].startswith("tp=") else scenarios
    with init_distributed(Plan(backend="eager", tp=tp, dp=world_size // tp)) as world:
        for scenario in scenarios:
            if scenario.startswith("step:"):
                run_compiled_step(out, scenario, world, verify_level(scenarios, scenario))
            elif scenario.startswith("resume:"):
                run_resume(out, scenario, world)
            else:
                run(out, scenario)


def padded(dp: int, options) -> bool:
    """Data parallel: each dp rank its rows of the global batch, unpadded (equal token counts,
    so the mean over ranks is the global mean); a run saving a checkpoint unpadded too, so that
    a resumed run on any mesh trains on the same batches."""
    return dp == 1 and "ckpt" not in options


def ckpt_path(out: str, name: str, opt: str) -> str:
    return os.path.join(out, f"ckpt.{name}.{opt}")


def run_compiled_step(out: str, scenario: str, world, verify: str = "deep"):
    """The user's path: compile_for_npu with Plan(tp=N); the runtime binds the shards by placement.

    Options: ``zeroN`` (ZeRO stage N over dp), ``ckpt`` (save a checkpoint after step 5 and go on),
    ``mbN`` (N microbatches accumulated per step), ``sp`` (sequence parallelism and the
    vocab-parallel loss), ``row`` (one-row batches, see ``batches``), ``inductor`` (the backend), ``onednn``
    (``plan.matmul_kernel``: every float32 matmul on oneDNN).
    """
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime import checkpoint
    from cann_passes.runtime.distributed import shard_batch
    _, name, opt, *options = scenario.split(":")
    entry, optimizer = make(name, opt)
    tp, dp = world.info.size("tp"), world.info.size("dp")
    zero = next((int(o.removeprefix("zero")) for o in options if o.startswith("zero")), 0)
    sp = "sp" in options
    plan = Plan(backend="inductor" if "inductor" in options else "eager", tp=tp, dp=dp, zero_stage=zero,
                verify=verify, microbatches=microbatches_of(options), sequence_parallel=sp, vocab_parallel_loss=sp,
                matmul_kernel="onednn" if "onednn" in options else "auto")
    step = compile_for_npu(entry.model, plan, optimizer=optimizer, loss_fn=entry.loss_fn)
    data = batches(entry, pad=padded(dp, options), row="row" in options)
    losses = []
    for i, batch in enumerate(data):
        losses.append(float(step(shard_batch(batch, world.dp_rank, dp))))
        if i == 4 and "ckpt" in options:
            checkpoint.save(step, ckpt_path(out, name, opt))
    # The user's view: model.state_dict() gathers every rank's shards (tp, and dp under ZeRO-3),
    # optimizer.state_dict() the optimizer state's (tp, and dp under ZeRO): full tensors
    state = entry.model.state_dict()
    params = {pname: state[pname].detach().clone() for pname, _ in entry.model.named_parameters()}
    names = [pname for pname, _ in entry.model.named_parameters()]
    # (sharded entries are parameter-shaped DTensors, torch's distributed convention)
    full = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()  # noqa: E731
    optim = {names[i]: {k: full(v) for k, v in entries.items() if isinstance(v, torch.Tensor) and v.dim()}
             for i, entries in optimizer.state_dict()["state"].items()}
    graph = step.last.graph
    collectives = {f"{r}.{c}": n for (r, c), n in count_collectives(graph).items()}
    if world.rank == 0:
        torch.save({"losses": losses, "params": params, "collectives": collectives, "optim": optim,
                    "attrs": graph.attrs["tensor_parallel"], "zero": graph.attrs.get("zero"),
                    "onednn": sum(r.stats.get("rewritten", 0) for r in step.records if r.name == "linear_on_onednn")},
                   os.path.join(out, f"{scenario}.tp{tp}{f'.dp{dp}' if dp > 1 else ''}.pt"))


def resume(out: str, name: str, opt: str, world=None) -> dict:
    """Resume the run ``ckpt_path(out, name, opt)`` holds (saved after 5 steps, on any mesh) on this
    process' mesh (one process without ``world``) and train its last 5 steps."""
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime import checkpoint
    from cann_passes.runtime.distributed import shard_batch
    tp, dp = (world.info.size("tp"), world.info.size("dp")) if world is not None else (1, 1)
    rank = world.dp_rank if world is not None else 0
    entry, optimizer = make(name, opt)
    with torch.no_grad():    # resumed values must come from the checkpoint, not the seed
        for p in entry.model.parameters():
            p.add_(1.0)
    step = compile_for_npu(entry.model, Plan(backend="eager", tp=tp, dp=dp, verify="deep"), optimizer=optimizer,
                           loss_fn=entry.loss_fn)
    data = batches(entry, pad=False)
    checkpoint.load(step, ckpt_path(out, name, opt), shard_batch(data[5], rank, dp))
    assert step.steps_run == 5, step.steps_run
    losses = [float(step(shard_batch(batch, rank, dp))) for batch in data[5:]]
    state = entry.model.state_dict()
    return {"losses": losses, "params": {n: state[n].detach().clone() for n, _ in entry.model.named_parameters()}}


def run_resume(out: str, scenario: str, world):
    _, name, opt = scenario.split(":")
    result = resume(out, name, opt, world)
    if world.rank == 0:
        torch.save(result, os.path.join(out, f"{scenario}.tp{world.info.size('tp')}.pt"))


def run(out: str, scenario: str):
    name, opt, *flags = scenario.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    entry, optimizer = make(name, opt)
    data = batches(entry)
    captured, layout = capture_train_step(entry.model, optimizer, entry.loss_fn, data[0])
    options = ",".join(f"{f}=true" for f in flags)
    pipeline = Pipeline.parse("tensor_parallel" + (f"{{{options}}}" if options else "") + ",cleanup")
    graph = PassManager(pipeline, verify_level="deep").run(captured.copy(), PassContext(mesh=Mesh(dist.group.WORLD)))
    full = gather_inputs(entry.model, optimizer, layout, data[0])
    sig = graph.signature
    values = {spec: shard(v, layout_of(graph, spec), rank, world) if isinstance(v, torch.Tensor) else v
              for spec, v in zip(sig.inputs, full)}
    loop_back = {o: i for o in sig.outputs for i in sig.inputs
                 if (o.kind, o.name) == (i.kind, i.name) or (o.kind == OutputKind.PARAM and i.kind == "param"
                                                              and o.name == i.name)}
    batch_specs = [s for s in sig.inputs if s.kind == InputKind.BATCH]
    losses = []
    for batch in data:
        flat_batch = gather_inputs(entry.model, optimizer, layout, batch)[-len(batch_specs):]
        values.update(zip(batch_specs, flat_batch))
        outputs = graph.gm(*[values[s] for s in sig.inputs])
        for spec, value in zip(sig.outputs, outputs):
            if spec.kind == OutputKind.LOSS:
                losses.append(float(value))
            elif spec in loop_back:
                values[loop_back[spec]] = value
    params = {}
    for spec in sig.inputs:
        if spec.kind == InputKind.PARAM:
            local = values[spec].contiguous()
            pieces = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(pieces, local)
            params[spec.name] = unshard(pieces, layout_of(graph, spec))
    collectives = {f"{r}.{c}": n for (r, c), n in count_collectives(graph).items()}
    if rank == 0:
        torch.save({"losses": losses, "params": params, "collectives": collectives,
                    "attrs": graph.attrs["tensor_parallel"]}, os.path.join(out, f"{scenario}.tp{world}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
