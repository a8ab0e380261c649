"""One rank of a pipeline test run: ``python tests/pipeline/pp_worker.py OUTDIR MODEL PP DP TP CONFIG...``.

Each CONFIG is ``[model/]schedule:optimizer[:option...]`` (``1f1b:sgd``, ``interleaved_1f1b:adamw:2``,
``llama/gpipe:adamw``: another model than MODEL); an option is the number of virtual stages per rank,
``clip=X`` (``plan.grad_clip_norm``), ``zeroN`` (ZeRO stage N over dp), ``fp16`` (fp16 autocast with
dynamic loss scaling; ``scale=X`` its initial scale, ``grow=N`` its growth interval; such a config
runs ``FP16_STEPS`` steps), ``inductor`` (the backend), ``onednn`` (``plan.matmul_kernel``: every
float32 matmul on oneDNN) or ``background`` (``plan.background_lowering``, waited for after the second step). All configs run in this process one after the other under
one ``(pp, dp, tp)`` mesh, each from the same initial weights.
Each rank writes OUTDIR/rank<R>.pt: per config the losses, the full parameters of the stages this
rank holds (gathered over tp by ``model.state_dict()``), the measured per-action events of the
last step and, with loss scaling, per step the overflow flag and the scale this rank holds after it.

MODEL is a recipe GPT (``gpt4``, ``heavy_head``) or a ``tests.zoo`` model built from its
``transformers`` config (``llama``, ``gpt2``: GPT2LMHeadModel with its embedding tied to the head).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cann_passes import Plan, compile_for_npu  # noqa: E402
from cann_passes.runtime.distributed import init_distributed, shard_batch  # noqa: E402
from cann_passes.runtime.pipeline_parallel import NotRunHere  # noqa: E402
from graph_ir.meta import GraphAttr  # noqa: E402
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ = 10, 8, 16
FP16_STEPS = 4
MODELS = {"gpt4": dict(n_layer=4), "heavy_head": dict(n_layer=4, vocab_size=2048)}
ZOO = {name: dict(layers=2) for name in ("llama", "gpt2", "gpt_neox", "gemma", "bart", "whisper", "swin", "bloom")}


def global_batch(name: str, i: int):
    if name in ZOO:   # two zoo batches of 4 rows, unpadded: every row has the same token count
        from tests import zoo
        entry = _zoo(name)
        halves = [entry.make_batch(1000 + 2 * i + h, pad=False) for h in range(2)]
        return {k: torch.cat([h[k] for h in halves]) for k in halves[0]}
    vocab = MODELS[name].get("vocab_size", 256)
    g = torch.Generator().manual_seed(1000 + i)
    idx = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _zoo(name: str):
    from tests import zoo
    return zoo.build(name, seed=0, **ZOO[name])


def loss_fn(name: str):
    return _zoo(name).loss_fn if name in ZOO else gpt_loss


def make_model(name: str, optimizer: str):
    if name in ZOO:
        model = _zoo(name).model
    else:
        torch.manual_seed(0)
        model = GPT(gpt_tiny(tie_weights=False, bias=False, **MODELS[name]))
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def steps_for(plan: Plan) -> int:
    return FP16_STEPS if plan.precision == "fp16" else STEPS


def microbatches_for(schedule: str, pp: int) -> int:
    return 2 * pp if schedule == "dualpipev" else max(4, pp)


def parse_config(config: str, default_model: str) -> tuple[str, str]:
    """(model, schedule:optimizer[:options]) of a CONFIG."""
    model, _, rest = config.rpartition("/")
    return model or default_model, rest


def plan_for(config: str, pp: int, dp: int, tp: int) -> Plan:
    schedule, _, *options = config.split(":")
    fields = dict(backend="eager", pp=pp, dp=dp, tp=tp, microbatches=microbatches_for(schedule, pp),
                  pipeline_schedule=schedule)
    for option in options:
        if option.isdigit():
            fields["pipeline_virtual_stages"] = int(option)
        elif option.startswith("clip="):
            fields["grad_clip_norm"] = float(option.removeprefix("clip="))
        elif option == "fp16":
            fields["precision"] = "fp16"
        elif option.startswith("scale="):
            fields["loss_scale_init"] = float(option.removeprefix("scale="))
        elif option.startswith("grow="):
            fields["loss_scale_growth_interval"] = int(option.removeprefix("grow="))
        elif option.startswith("target="):
            fields["accumulate_target"] = int(option.removeprefix("target="))
        elif option.startswith("zero"):
            fields["zero_stage"] = int(option.removeprefix("zero"))
        elif option == "inductor":
            fields["backend"] = "inductor"
        elif option == "background":
            fields["background_lowering"] = True
        elif option == "onednn":
            fields["matmul_kernel"] = "onednn"
        else:
            raise ValueError(f"unknown config option {option!r}")
    return Plan(**fields)


def main(out: str, model_name: str, pp: int, dp: int, tp: int, configs: list[str]) -> None:
    results = {}
    with init_distributed(Plan(backend="eager", pp=pp, dp=dp, tp=tp, microbatches=max(4, pp))) as world:
        for config in configs:
            name, what = parse_config(config, model_name)
            plan = plan_for(what, pp, dp, tp)
            model, opt = make_model(name, what.split(":")[1])
            step = compile_for_npu(model, plan, optimizer=opt, loss_fn=loss_fn(name))
            losses, scaling = [], []
            for i in range(steps_for(plan)):
                losses.append(float(step(shard_batch(global_batch(name, i), world.dp_rank, world.dp_size))))
                if i == 1 and plan.background_lowering:   # the backend's runners take over from the third step
                    step.wait_for_lowering()
                    from torch._dynamo.utils import counters
                    hits_before = counters["aot_autograd"]["autograd_cache_hit"]
                if plan.effective_loss_scale != "none":
                    scaling.append((bool(step.metrics["loss_scale:found_inf"]),
                                    float(step.step_state.values["loss_scale:scale"])))
            # pp = 1 (data parallel with accumulation): one stage holding every parameter.
            info = step.last.program.attrs.get(GraphAttr.PIPELINE_PARALLEL) or {
                "stage_to_rank": [0], "param_stage": dict.fromkeys(dict(model.named_parameters()), 0),
                "stage_seconds": [], "stages": 1}
            pp_rank = step.mesh.local_rank("pp") if pp > 1 else 0
            mine = {s for s, r in enumerate(info["stage_to_rank"]) if r == pp_rank}
            state = model.state_dict()   # gathers tensor-parallel shards (a collective over tp)
            params = {n: state[n].detach().clone() for n, _ in model.named_parameters()
                      if set(_stages_of(info, n)) & mine}
            events = ([(e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s)
                       for e in step.pipeline_timeline().events] if pp > 1 else [])
            # every parameter, as this rank's model holds it (each broadcast from its owning stage)
            every = {n: state[n].detach().clone() for n, _ in model.named_parameters()}
            # ZeRO-3: the parameter shards this rank keeps between steps (its stages' parameters over dp)
            shard_numel = sum(t.numel() for t in step.param_shards.values())
            comp = step.last
            lowering = {"lowered": sorted(n for n, r in comp.runners.items() if not isinstance(r, NotRunHere)),
                        "onednn": sum(r.stats.get("rewritten", 0) for r in step.records if r.name == "linear_on_onednn")}
            if comp.background is not None:
                from torch._dynamo.utils import counters
                runtime = comp.pipeline_runtime
                lowering.update(switched_at=comp.background.switched_at, error=comp.background.error,
                                runs_background=all(ex.runners[p] is comp.background.runners[f"stage{s}.{p}"]
                                                    for s, ex in runtime.executors.items() for p in ex.graphs
                                                    if f"stage{s}.{p}" in lowering["lowered"]),
                                take_over_hits=counters["aot_autograd"]["autograd_cache_hit"] - hits_before)
            results[config] = {"losses": losses, "params": params, "every": every, "events": events,
                               "lowering": lowering, "stage_to_rank": info["stage_to_rank"],
                               "shard_numel": shard_numel,
                               "stage_seconds": info["stage_seconds"], "stages": info["stages"],
                               "shared": info.get("shared_params", {}), "scaling": scaling}
    torch.save(results, Path(out) / f"rank{world.rank}.pt")


def _stages_of(info: dict, name: str) -> list[int]:
    """The stages holding parameter ``name``: its home, and every stage sharing it (tied weights)."""
    return list(info.get("shared_params", {}).get(name, [info["param_stage"][name]]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
