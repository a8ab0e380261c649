"""The fine-tuning ladder: full fine-tuning vs LoRA vs LoRA + bf16 + recompute.

    python -m recipes.finetune.ladder                    # both parts, a few minutes on 2 cores
    python -m recipes.finetune.ladder --skip-estimate    # only the CPU measurements
    python -m recipes.finetune.ladder --json ladder.json

Measured on this CPU: the recipe's tiny LLaMA, each rung trained for the same
batches through ``compile_for_npu`` (eager backend): wall time per step, the
response-token loss, and the bytes the compiled step holds, read from its
graphs (parameters trainable and frozen, gradients, optimizer state, saved
activations) with the estimated peak.

Estimated for LLaMA-7B (d 4096, 32 layers, 32 heads, MLP 11008, vocab 32000)
on one and on eight Ascend 910B, never allocated: the model is built on the
``meta`` device (peft places its adapters there too), its step captured with
fake tensors, and compiled for rank 0 of the mesh (``MeshDesc.fake(dp=8)``:
the DP/ZeRO rewrites run without processes). From the final graphs:

- memory: the compiler's liveness analysis (resident inputs plus the peak of
  intermediates, buffers freed after their last use; no allocator
  fragmentation, workspaces or communication buffers — a lower bound);
- time: the cost model's roofline per node for the ``ascend_910b`` profile
  plus alpha-beta collectives, summed with no overlap (an upper bound on
  compute + communication, without host overheads).

Capturing all 32 layers takes minutes here, so the step is captured with 1
and 2 layers and every quantity extrapolated affinely to 32 (the blocks are
identical, so bytes, FLOPs and time grow by the same amount per block); the
report can check the extrapolation against a real capture of 3 layers (``--check``). Checked once
against a real 32-layer capture (LoRA, fp32, one device: 25,778 nodes, 4 minutes here): peak,
saved activations, parameter and gradient bytes and time all equal the extrapolation.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from cann_passes import Plan, compile_for_npu
from recipes.data.instructions import InstructionBatches, load_pairs, split_pairs

from .config import FinetuneConfig
from .memory import step_state_bytes
from .model import ResponseLoss, prepare_model

GiB = 2 ** 30


@dataclass(frozen=True)
class Rung:
    name: str
    method: str
    base_dtype: str = "fp32"
    plan: dict = field(default_factory=dict)


RECOMPUTE = {"recompute": "budget", "recompute_budget": 0.1}
RUNGS = (
    Rung("full fine-tuning", "full"),
    Rung("LoRA", "lora"),
    Rung("LoRA + bf16 + recompute", "lora", "bf16", {"precision": "bf16", **RECOMPUTE}),
)


# -- measured on CPU --------------------------------------------------------------------------------

def measure_cpu(rung: Rung, base: torch.nn.Module, batches: list, lora_r: int = 8) -> dict:
    cfg = FinetuneConfig(method=rung.method, base_dtype=rung.base_dtype, lora_r=lora_r, lora_alpha=2.0 * lora_r)
    torch.manual_seed(0)
    model = prepare_model(copy.deepcopy(base).to(torch.bfloat16 if rung.base_dtype == "bf16" else torch.float32),
                          cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3 if rung.method ==
                                  "full" else 3e-3)
    step = compile_for_npu(model, Plan.from_dict({"backend": "eager", **rung.plan}), optimizer=optimizer,
                           loss_fn=ResponseLoss())
    losses, seconds = [], []
    for batch in batches:
        t0 = time.perf_counter()
        losses.append(step(batch).item())
        seconds.append(time.perf_counter() - t0)
    state = step_state_bytes(step.last.program)
    return dict(rung=rung.name, trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                total_params=sum(p.numel() for p in model.parameters()), first_loss=losses[0],
                last_loss=statistics.mean(losses[-5:]), step_seconds=statistics.median(seconds[1:]),
                compile_seconds=seconds[0], peak_bytes=step.last.memory.peak_bytes, **state.to_json())


# -- estimated for LLaMA-7B on 910B -----------------------------------------------------------------

def llama7b_config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)


def _meta_model(rung: Rung, layers: int, lora_r: int, model_config=llama7b_config):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(layers))
    if rung.base_dtype == "bf16":
        model = model.to(torch.bfloat16)
    with torch.device("meta"):
        return prepare_model(model, FinetuneConfig(method=rung.method, base_dtype=rung.base_dtype,
                                                   lora_r=lora_r, lora_alpha=2.0 * lora_r))


def estimate_graph(rung: Rung, layers: int, devices: int, seq_len: int, micro_batch: int, lora_r: int,
                   model_config=llama7b_config) -> dict:
    """One capture + compile for rank 0 of ``devices`` ranks: per-rank bytes and seconds.

    ``model_config(layers)`` is the transformers config of the model (LLaMA-7B's by default).
    """
    from cann_passes.compile import compile_program
    from cann_passes.cost_model import get_profile, graph_time
    from graph_ir import capture_train_step
    from graph_ir.analysis.memory import memory_profile
    from graph_ir.mesh import MeshDesc

    model = _meta_model(rung, layers, lora_r, model_config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    shape = (micro_batch, seq_len)
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long, device="meta"),
             "attention_mask": torch.ones(shape, dtype=torch.long, device="meta"),
             "labels": torch.zeros(shape, dtype=torch.long, device="meta")}
    captured, _ = capture_train_step(model, optimizer, ResponseLoss(), batch)
    # Full fine-tuning needs its weights, gradients and AdamW state sharded to fit: ZeRO-3 over the ranks.
    zero = 3 if devices > 1 and rung.method == "full" else 0
    plan = Plan.from_dict({"device_profile": "ascend_910b", **rung.plan, "dp": devices, "zero_stage": zero})
    program = compile_program(captured, plan, MeshDesc.fake(dp=devices))
    profile = get_profile("ascend_910b")
    state = step_state_bytes(program)
    return dict(peak_bytes=max(memory_profile(g.graph).peak_bytes for g in program.graphs.values()),
                seconds=sum(graph_time(g.graph.nodes, profile, world_size=devices) for g in program.graphs.values()),
                nodes=program.num_nodes(), zero_stage=zero, **{k: v for k, v in state.to_json().items()
                                                               if isinstance(v, int)})


def _affine(at1: dict, at2: dict, layers: int) -> dict:
    return {k: at1[k] + (layers - 1) * (at2[k] - at1[k]) if isinstance(at1[k], (int, float)) and k != "zero_stage"
            else at1[k] for k in at1}


def estimate_7b(rung: Rung, devices: int, *, seq_len: int = 2048, micro_batch: int = 1, lora_r: int = 16,
                check_layers: int | None = 3) -> dict:
    from cann_passes.cost_model import get_profile
    at1, at2 = (estimate_graph(rung, n, devices, seq_len, micro_batch, lora_r) for n in (1, 2))
    est = _affine(at1, at2, 32)
    capacity = get_profile("ascend_910b").memory_capacity
    out = dict(rung=rung.name, devices=devices, seq_len=seq_len, micro_batch=micro_batch, **est,
               fits=est["peak_bytes"] <= capacity, capacity_bytes=capacity,
               tokens_per_second=devices * micro_batch * seq_len / est["seconds"])
    if check_layers:
        real = estimate_graph(rung, check_layers, devices, seq_len, micro_batch, lora_r)
        predicted = _affine(at1, at2, check_layers)
        out["affine_check"] = {k: dict(predicted=predicted[k], captured=real[k])
                               for k in ("peak_bytes", "seconds", "trainable_param_bytes", "gradient_bytes",
                                         "optimizer_state_bytes", "activation_bytes")}
    return out


# -- report -----------------------------------------------------------------------------------------

def _mib(b): return f"{b / 2**20:,.2f}"
def _gib(b): return f"{b / GiB:,.1f}"


def cpu_table(rows: list[dict]) -> str:
    head = ("| rung | trainable params | grads MiB | optimizer state MiB | frozen params MiB | saved activations MiB "
            "| est. peak MiB | s/step | loss first -> last 5 |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['rung']} | {r['trainable_params']:,} / {r['total_params']:,} | {_mib(r['gradient_bytes'])} "
                     f"| {_mib(r['optimizer_state_bytes'])} | {_mib(r['frozen_param_bytes'])} "
                     f"| {_mib(r['activation_bytes'])} | {_mib(r['peak_bytes'])} | {r['step_seconds']:.3f} "
                     f"| {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    return "\n".join(lines)


def estimate_table(rows: list[dict]) -> str:
    head = ("| rung | devices | ZeRO | params GiB (trainable + frozen) | grads GiB | optimizer GiB "
            "| saved activations GiB | peak GiB / rank | fits 64 GB | step s | tokens/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['rung']} | {r['devices']} | {r['zero_stage']} | {_gib(r['trainable_param_bytes'])} + "
                     f"{_gib(r['frozen_param_bytes'])} | {_gib(r['gradient_bytes'])} | {_gib(r['optimizer_state_bytes'])} "
                     f"| {_gib(r['activation_bytes'])} | {_gib(r['peak_bytes'])} | {'yes' if r['fits'] else 'no'} "
                     f"| {r['seconds']:.2f} | {r['tokens_per_second']:,.0f} |")
    return "\n".join(lines)


def check_table(rows: list[dict]) -> str:
    lines = ["| rung | devices | quantity | predicted from 1, 2 layers | captured at 3 layers |", "|---|---|---|---|---|"]
    for r in rows:
        for k, v in r.get("affine_check", {}).items():
            lines.append(f"| {r['rung']} | {r['devices']} | {k} | {v['predicted']:,.6g} | {v['captured']:,.6g} |")
    return "\n".join(lines)


def cpu_batches(steps: int, batch_size: int, seq_len: int) -> list:
    train, _ = split_pairs(load_pairs())
    return list(InstructionBatches(train, batch_size, seq_len, num_batches=steps))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=160)
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-estimate", action="store_true")
    p.add_argument("--check", action="store_true", help="also capture 3 layers to check the extrapolation")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for the measured part")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    report: dict = {"load_average": os.getloadavg()}
    if not args.skip_cpu:
        from transformers import LlamaForCausalLM

        from .model import tiny_llama_config
        torch.set_num_threads(args.threads)   # the tiny model's ops are too small to share across cores
        torch.manual_seed(0)
        base = LlamaForCausalLM(tiny_llama_config())
        batches = cpu_batches(args.steps, args.batch_size, args.seq_len)
        report["cpu"] = [measure_cpu(r, base, batches) for r in RUNGS]
        print(f"Measured on this CPU (tiny LLaMA d64 x 2 layers, batch {args.batch_size} x {args.seq_len}, "
              f"{args.steps} steps, eager backend, {args.threads} thread(s); load average {report['load_average'][0]:.1f}):\n")
        print(cpu_table(report["cpu"]) + "\n")
    if not args.skip_estimate:
        report["llama7b_910b"] = [estimate_7b(r, d, check_layers=3 if args.check else None)
                                  for d in (1, 8) for r in RUNGS]
        print("Estimated for LLaMA-7B on Ascend 910B (64 GB), micro-batch 1 x 2048 tokens per device, AdamW, "
              "LoRA r=16 on q/k/v/o and the MLP; meta-device capture, compiled for rank 0, affine in layers:\n")
        print(estimate_table(report["llama7b_910b"]) + "\n")
        if args.check:
            print("The extrapolation against a real 3-layer capture:\n")
            print(check_table(report["llama7b_910b"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    return report


if __name__ == "__main__":
    main()


# -- the shared optimization ladder (python -m recipes.ladder finetune) ------------------------------

def family(tiny: bool = False):
    """LoRA fine-tuning of LLaMA-7B on the shared ladder (fp32 -> bf16 -> recompute -> ZeRO-1 -> accumulation).

    The rungs there add compiler techniques to one model; this family's model is the LoRA-wrapped
    LLaMA (frozen base, adapters on q/k/v/o and the MLP), trained on the instruction batches with
    the response-only loss. ``tiny=True`` shrinks the full size to test scale.
    """
    from recipes.ladder import Family
    from transformers import LlamaForCausalLM

    from .model import tiny_llama_config

    lora = FinetuneConfig(method="lora", lora_r=8, lora_alpha=16.0)
    small_cfg = tiny_llama_config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2) if tiny else tiny_llama_config()
    full_cfg = (lambda n: tiny_llama_config(num_hidden_layers=n, hidden_size=64, intermediate_size=128)) if tiny \
        else llama7b_config
    full_layers, (rows, seq) = (4, (4, 96)) if tiny else (32, (4, 2048))
    train, _ = split_pairs(load_pairs())

    def small_model():
        return prepare_model(LlamaForCausalLM(small_cfg), lora)

    def full_model(layers):
        return prepare_model(LlamaForCausalLM(full_cfg(layers or full_layers)),
                             lora.replace(lora_r=16, lora_alpha=32.0))

    def full_batch():
        return {"input_ids": torch.zeros(rows, seq, dtype=torch.long),
                "attention_mask": torch.ones(rows, seq, dtype=torch.long),
                "labels": torch.zeros(rows, seq, dtype=torch.long)}

    return Family(
        name="finetune", title="LoRA fine-tuning (LLaMA + peft)", small_model=small_model,
        small_batches=lambda n: list(InstructionBatches(train, 8, 96 if tiny else 128, num_batches=n)),
        loss_fn=ResponseLoss(), full_model=full_model, full_batch=full_batch,
        full_name=f"LLaMA-7B + LoRA r=16 (seq {seq}, batch {rows} per rank)" if not tiny else "tiny LLaMA + LoRA",
        full_layers=full_layers,
        make_optimizer=lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=3e-3),
        recompute="full")
