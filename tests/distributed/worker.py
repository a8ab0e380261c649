"""One rank of a distributed test run: ``python -m tests.distributed.worker SCENARIO OUTDIR [ARGS]``.

Launched by the tests with cann_passes.runtime.distributed.launch_local (torchrun's
environment); each rank writes what it saw to OUTDIR/<scenario>.rank<R>.pt.
"""
from __future__ import annotations

import sys

import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.runtime import checkpoint
from cann_passes.runtime.distributed import init_distributed, shard_batch
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny

STEPS, GLOBAL_BATCH, SEQ = 10, 8, 16
STRATEGIES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def global_batch(i: int, rows: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + i)
    idx = torch.randint(0, 256, (rows, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def make_model(kind: str = "adamw"):
    torch.manual_seed(0)
    # No biases: the key bias of attention has a gradient that is zero in exact arithmetic, and
    # Adam turns its rounding noise into lr-sized updates that depend on summation order.
    model = GPT(gpt_tiny(bias=False))
    if kind == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def probe_batch():
    return global_batch(99, rows=2)[0]


def user_state(world_size: int, out: str, phase: str, kind: str, stage: str, ckpt: str):
    """The user's own objects under a ZeRO plan: state dicts and evaluation, no project function called."""
    plan = Plan(backend="eager", dp=world_size, zero_stage=int(stage))
    with init_distributed(plan) as world:
        model, opt = make_model(kind)
        if phase == "load":
            saved = torch.load(ckpt, weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
        first = 5 if phase == "load" else 0
        losses = [float(step(shard_batch(global_batch(i), world.dp_rank, world.dp_size)))
                  for i in range(first, first + 5)]
        model_state = model.state_dict()               # a collective under ZeRO-3, like FSDP's full state
        optim_state = opt.state_dict()                 # full, parameter-shaped state (a collective)
        model.eval()
        with torch.no_grad():
            evaluated = model(probe_batch())
        model.train()
        if world.rank == 0:
            torch.save({"model": {k: v.clone() for k, v in model_state.items()}, "optim": optim_state,
                        "eval": evaluated, "losses": losses},
                       f"{out}/user_state_{phase}_{kind}_{stage}_{world_size}.pt")


def full_params(step, model):
    step.sync_model()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(world, plan, steps=range(STEPS), model=None, opt=None, step=None):
    if step is None:
        model, opt = make_model()
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
    losses = [float(step(shard_batch(global_batch(i), world.dp_rank, world.dp_size))) for i in steps]
    return step, model, losses


def parity(world_size: int, out: str, strategies: str, verify: str, backend: str = "eager"):
    # Small buckets, so that every strategy splits the model into several.
    base = Plan(backend=backend, verify=verify, dp=world_size, bucket_mb=0.02)
    with init_distributed(base) as world:
        result = {}
        for name in strategies.split(","):
            plan = base.replace(zero_stage=STRATEGIES[name])
            step, model, losses = train(world, plan)
            result[name] = {"losses": losses, "params": full_params(step, model),
                            "state_bytes": step.optimizer_state_bytes(),
                            "zero": step.last.graph.attrs.get("zero")}
        torch.save(result, f"{out}/parity.rank{world.rank}.pt")


ZOO_STEPS = 3


def zoo_batch(i: int):
    """A padded global batch for a transformers causal LM (rows of different lengths)."""
    from tests import zoo
    return zoo.causal_lm_batch(1000 + i, pad=True)


def zoo_parity(world_size: int, out: str, name: str, strategies: str, backend: str):
    """A transformers model built from a config (one layer), AdamW, padded batches, per strategy."""
    from tests import zoo
    base = Plan(backend=backend, dp=world_size, bucket_mb=0.02, compile_cache="off")
    with init_distributed(base) as world:
        result = {}
        for strategy in strategies.split(","):
            entry = zoo.build(name, layers=1)
            opt = zoo.default_optimizer(entry.model.parameters())
            step = compile_for_npu(entry.model, base.replace(zero_stage=STRATEGIES[strategy]), optimizer=opt,
                                   loss_fn=entry.loss_fn)
            losses = [float(step(shard_batch(zoo_batch(i), world.dp_rank, world.dp_size)))
                      for i in range(ZOO_STEPS)]
            result[strategy] = {"losses": losses, "params": full_params(step, entry.model)}
        torch.save(result, f"{out}/zoo_parity.rank{world.rank}.pt")


MASTER_RUNS = {"dp": (0, "whole"), "zero1": (1, "sharded"), "zero2": (2, "sharded"), "zero2_whole": (2, "whole"),
               "zero3": (3, "sharded")}


def master(world_size: int, out: str, precision: str, runs: str):
    """ZeRO-1/2 with the fp32 master sharded: what the user's model, optimizer and graph show."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    base = Plan(backend="eager", verify="shallow", dp=world_size, bucket_mb=0.02, precision=precision)
    with init_distributed(base) as world:
        result = {}
        for name in runs.split(","):
            stage, how = MASTER_RUNS[name]
            plan = base.replace(zero_stage=stage, **({"zero_master": how} if stage in (1, 2) else {}))
            model, opt = make_model()
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
            losses = [float(step(shard_batch(global_batch(i), world.dp_rank, world.dp_size))) for i in range(5)]
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}   # no project call
            model.eval()
            with torch.no_grad():
                evaluated = model(probe_batch())
            model.train()
            full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            graph = step.last.graph
            nodes = [(str(n.target), str(n.meta.get("region")), str(n.meta["val"].dtype))
                     for n in graph.graph.nodes if "c10d" in str(n.target) and "wait" not in str(n.target)]
            inputs = {s.name: tuple(n.meta["val"].shape) for s, n in zip(graph.signature.inputs, graph.placeholders())
                      if s.kind == "param"}
            result[name] = {"losses": losses, "state": state, "eval": evaluated,
                            "optim": {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in full["state"].items()},
                            "collectives": nodes, "param_inputs": inputs, "zero": graph.attrs.get("zero"),
                            "shards": sorted(step.param_shards)}
            if precision == "fp32" and name == "zero2":
                # a checkpoint of the sharded master resumes into itself and into the whole layout
                ckpt = f"{out}/ckpt_master"
                checkpoint.save(step, ckpt)
                resumed = {}
                for into in ("sharded", "whole"):
                    fresh, fresh_opt = make_model()
                    with torch.no_grad():      # resumed values must come from the checkpoint
                        for p in fresh.parameters():
                            p.add_(1.0)
                    again = compile_for_npu(fresh, base.replace(zero_stage=1 if into == "whole" else 2,
                                                                zero_master=into), optimizer=fresh_opt,
                                            loss_fn=gpt_loss)
                    checkpoint.load(again, ckpt, shard_batch(global_batch(0), world.dp_rank, world.dp_size))
                    again(shard_batch(global_batch(5), world.dp_rank, world.dp_size))
                    resumed[into] = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
                step(shard_batch(global_batch(5), world.dp_rank, world.dp_size))
                resumed["uninterrupted"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                result["resumed"] = resumed
        torch.save(result, f"{out}/master_{precision}.rank{world.rank}.pt")


def weighted_loss(model, batch):
    idx, targets, weight = batch
    return gpt_loss(model, (idx, targets)) * weight.mean()


def overflow(world_size: int, out: str, stages: str):
    """fp16 loss scaling when only the last rank's gradients overflow: every rank must skip the step."""
    result = {}
    base = Plan(backend="eager", dp=world_size, precision="fp16", bucket_mb=0.02)
    with init_distributed(base) as world:
        for stage in map(int, stages.split(",")):
            model, opt = make_model()
            step = compile_for_npu(model, base.replace(zero_stage=stage), optimizer=opt, loss_fn=weighted_loss)
            seen = []
            for i, big in enumerate((1e8, 1.0)):
                idx, targets = global_batch(i)
                weight = torch.ones(len(idx))
                weight[-len(idx) // world_size:] = big          # the last rank's rows only (first step)
                step(shard_batch((idx, targets, weight), world.dp_rank, world.dp_size))
                seen.append({"found_inf": bool(step.metrics["loss_scale:found_inf"]),
                             "scale": float(step.metrics["loss_scale:scale"]),
                             "params": {k: v.detach().clone() for k, v in model.state_dict().items()}})
            result[stage] = seen
    torch.save(result, f"{out}/overflow.rank{world.rank}.pt")


def resume(world_size: int, out: str, stage: str, ckpt: str, phase: str):
    plan = Plan(backend="eager", dp=world_size, zero_stage=int(stage))
    with init_distributed(plan) as world:
        if phase == "save":
            step, model, first = train(world, plan, range(5))
            checkpoint.save(step, ckpt)
            _, _, rest = train(world, plan, range(5, STEPS), step=step)
            losses = first + rest
        else:
            model, opt = make_model()
            with torch.no_grad():  # resumed values must come from the checkpoint, not the seed
                for p in model.parameters():
                    p.add_(1.0)
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
            checkpoint.load(step, ckpt, shard_batch(global_batch(0), world.dp_rank, world.dp_size))
            _, _, losses = train(world, plan, range(step.steps_run, STEPS), step=step)
        torch.save({"losses": losses, "params": full_params(step, model)},
                   f"{out}/resume_{phase}_{world_size}.rank{world.rank}.pt")


# The passes whose collectives reduce gradients (on gloo ZeRO's reduce-scatters become all-reduces).
REDUCING_PASSES = ("data_parallel", "optimizer_shard", "gloo_reduce_scatter_as_all_reduce")


def bf16_reduce(world_size: int, out: str):
    """Gradients reduced in bf16 (``grad_reduce_dtype: bf16``) by DP and ZeRO-2, beside torch DDP with
    its ``bf16_compress_hook`` (the same cast, divide, sum, cast back) and fp32 DP, SGD from the
    same weights on the same shards."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel
    base = Plan(backend="eager", dp=world_size, bucket_mb=0.02)
    with init_distributed(base) as world:
        result = {}
        for name, plan in (("dp_bf16", base.replace(grad_reduce_dtype="bf16")),
                           ("zero2_bf16", base.replace(grad_reduce_dtype="bf16", zero_stage=2)),
                           ("dp_fp32", base)):
            model, opt = make_model("sgd")
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
            losses = [float(step(shard_batch(global_batch(i), world.dp_rank, world.dp_size))) for i in range(STEPS)]
            result[name] = {"losses": losses, "params": full_params(step, model),
                            "wire": sorted({str(n.args[0].meta["val"].dtype) for n in step.last.graph.graph.nodes
                                            if "reduce" in str(n.target) and "wait" not in str(n.target)
                                            and n.meta.get("origin_pass") in REDUCING_PASSES
                                            and n.args[0].meta["val"].ndim})}
        def bf16_hook(state, bucket):
            # DDP refuses its own hook by name unless NCCL >= 2.10 is there; gloo sums bf16 itself.
            return bf16_compress_hook(state, bucket)
        # (real annotations, as DDP checks them; this module's are strings)
        bf16_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

        model, opt = make_model("sgd")
        ddp = DistributedDataParallel(model, process_group=world.group("dp"))
        ddp.register_comm_hook(world.group("dp"), bf16_hook)
        losses = []
        for i in range(STEPS):
            opt.zero_grad()
            loss = gpt_loss(ddp, shard_batch(global_batch(i), world.dp_rank, world.dp_size))
            loss.backward()
            opt.step()
            mean = loss.detach().clone()          # the compiled step reports the mean over ranks
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=world.group("dp"))
            losses.append(mean.item())
        result["ddp_bf16_hook"] = {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        if world.rank == 0:
            torch.save(result, f"{out}/bf16_reduce.pt")


def fault(world_size: int, out: str):
    plan = Plan(backend="eager", dp=world_size, zero_stage=1)
    with init_distributed(plan, fault_timeout_s=20) as world:
        model, opt = make_model()
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=gpt_loss)
        for i in range(STEPS):
            if world.rank == 1 and i == 3:
                raise RuntimeError("injected failure at step 3")
            step(shard_batch(global_batch(i), world.dp_rank, world.dp_size))
        print(f"rank {world.rank} finished", flush=True)


if __name__ == "__main__":
    scenario, out, *args = sys.argv[1:]
    import os
    world_size = int(os.environ["WORLD_SIZE"])
    {"parity": parity, "zoo_parity": zoo_parity, "resume": resume, "fault": fault, "user_state": user_state,
     "master": master, "overflow": overflow,
     "bf16_reduce": bf16_reduce}[scenario](world_size, out, *args)
