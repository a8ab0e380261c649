"""Per-rank memory of a Megatron-style plan by the published formulas, beside the simulator's.

Formulas (bytes per rank, first pipeline stage, which holds the most under 1F1B):

- Model state: 18 bytes per parameter, Megatron-LM's mixed precision with fp32 gradient
  accumulation (Megatron-LM ``docs/source/distrib_optimizer.md``, "fp16/bf16 param, fp32 grads":
  2 for the 16-bit weight, 4 for the fp32 main gradient, 12 for Adam's fp32 master weight and
  two moments). The ZeRO paper's 16 (2 + 2 + K=12) keeps 16-bit gradients. The program here
  keeps fp32 parameters (the master), fp32 gradients, Adam's two fp32 moments and, saved for
  backward, the bf16 cast of each weight: 4 + 4 + 8 + 2 = 18, the same bytes by other names.
  Parameters per rank: the stage's layers / tp, plus the vocabulary-split embedding on the
  first stage (and whatever the model keeps whole, e.g. learned positions).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Sec. 4: per layer and microbatch ``s b h (34 + 5 a s / h)`` bytes, ``34 s b h / t``
  with tensor + sequence parallelism and selective recomputation (the attention core
  recomputed). Sec. 4.2.3: under 1F1B the first stage holds ``p`` microbatches of its ``L / p``
  layers, so ``L`` layers' worth whatever ``p``; interleaving multiplies by ``1 + (p - 1) / (p v)``.
  The 34 counts two ``s b h`` dropout masks (1 byte each): with dropout 0 the same count is 32.
  For a LLaMA block (RMSNorm, GQA, SwiGLU, no dropout) the same count, tensor by tensor, is
  ``s b h (12 + 4 kv/a + 8 f/h) / t``: norm inputs 2+2, QKV input 2, Q 2, K and V 4 kv/a, output
  projection input 2, MLP input 2, gate and up outputs 4 f/h, SiLU output 2 f/h (the product's
  backward reads it), down-projection input 2 f/h (our derivation with Korthikanti's method; the
  paper has no LLaMA row).
"""
from __future__ import annotations

from dataclasses import dataclass

MEGATRON_BYTES_PER_PARAM = 18


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    kv_heads: int | None = None        # None: GPT block (4h MLP, biases, LayerNorm, learned positions)
    positions: int = 0                 # learned position embeddings kept whole on every tp rank

    @property
    def llama(self) -> bool:
        return self.kv_heads is not None

    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn
        if self.llama:
            kv = self.kv_heads * (h // self.heads)
            return h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def activation_per_layer(self, *, rows: int, tp: int, dropout_masks: bool = True) -> float:
        """Bytes one layer keeps for one microbatch (tp + sequence parallel, selective recompute)."""
        sbh = self.seq * rows * self.hidden
        if self.llama:
            return sbh * (12 + 4 * self.kv_heads / self.heads + 8 * self.ffn / self.hidden) / tp
        return sbh * (34 if dropout_masks else 32) / tp


@dataclass(frozen=True)
class MegatronPlan:
    tp: int
    pp: int
    dp: int
    rows: int = 1                      # microbatch size
    v: int = 1                         # interleaved stages per rank
    source: str = ""


def formula(shape: Shape, plan: MegatronPlan, *, dropout_masks: bool = True) -> dict[str, float]:
    """The first pipeline stage's per-rank bytes: model state, activations, total."""
    stage_params = shape.layers // plan.pp * shape.layer_params() / plan.tp
    stage_params += shape.vocab * shape.hidden / plan.tp + shape.positions * shape.hidden
    layers_held = shape.layers * (1 + (plan.pp - 1) / (plan.pp * plan.v) if plan.v > 1 else 1)
    act = layers_held * shape.activation_per_layer(rows=plan.rows, tp=plan.tp, dropout_masks=dropout_masks)
    state = MEGATRON_BYTES_PER_PARAM * stage_params
    return {"params": stage_params, "model_state": state, "activations": act, "total": state + act}


GPT3_175B = Shape("gpt3-175b", 96, 12288, 96, 2048, 50304, 4 * 12288, positions=2048)
LLAMA2_70B = Shape("llama-70b", 80, 8192, 64, 4096, 32000, 28672, kv_heads=8)

# Korthikanti et al. 2022, Table 3: GPT-3 175B trained with tp 8, pp 8 (64 GPUs per replica),
# microbatch 1, seq 2048, sequence parallelism + selective recomputation. The 1,024-device runs of
# the issue: dp 16 of that (or tp 8, pp 16, dp 8).
PLANS = {
    "gpt3-175b": [MegatronPlan(8, 8, 16, source="Korthikanti et al. 2022 Table 3 (tp 8, pp 8), dp 16 -> 1,024"),
                  MegatronPlan(8, 16, 8, source="tp 8, pp 16, dp 8 -> 1,024 (Narayanan et al. 2021 Sec. 5 style)")],
    "llama-70b": [MegatronPlan(8, 8, 1, source="tp 8 within a node, pp 8 across nodes -> 64 (Narayanan et al. "
                                                "2021 Sec. 3.3's rule: tp up to the node, then pp); no published "
                                                "70B table exists in either paper")],
}
