"""The recipe's models: transformers' Mixtral from a config, and its dense twin.

The dense model is the same Mixtral code with one expert, chosen for every token with weight 1, and
that expert as wide as the MoE model's ``top_k`` experts together: attention, norms, embeddings and
the per-token FFN compute (active parameters) are the MoE model's, so the two differ only in
routing each token to 2 of 8 narrower experts. The load-balancing loss is part of the loss as
transformers adds it (``router_aux_loss_coef`` times ``aux_loss``); with one expert it is constant.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EXPERTS, TOP_K = 8, 2


def _config(**fields):
    from transformers import MixtralConfig
    base = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, tie_word_embeddings=False, output_router_logits=True,
                router_aux_loss_coef=0.01, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return MixtralConfig(**(base | fields))


def moe_small_cpu(**overrides):
    """8 experts of SwiGLU width 176, 2 per token (~2.5M parameters, ~0.9M active per token)."""
    return _config(**({"num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "intermediate_size": 176}
                      | overrides))


def dense_small_cpu(**overrides):
    """One expert as wide as two of the MoE model's (352), always chosen: the same active size."""
    return _config(**({"num_local_experts": 1, "num_experts_per_tok": 1, "intermediate_size": TOP_K * 176}
                      | overrides))


def build(kind: str, **overrides) -> torch.nn.Module:
    from transformers import MixtralForCausalLM
    return MixtralForCausalLM((moe_small_cpu if kind == "moe" else dense_small_cpu)(**overrides))


def moe_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy plus the router's load-balancing loss; ``batch`` is ``(input_ids, targets)``."""
    input_ids, targets = batch
    out = model(input_ids=input_ids, use_cache=False)
    loss = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), targets.reshape(-1))
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token's forward uses: all but the experts it is not routed to."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total - experts + experts * cfg.num_experts_per_tok // cfg.num_local_experts
