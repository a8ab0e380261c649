"""The LLaMA family on the optimization ladder (``python -m recipes.ladder llama``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from recipes.data import TextBatches, load_corpus
from recipes.ladder import Family
from recipes.llama.model import LlamaForCausalLM, llama_7b, llama_loss, llama_small_cpu, llama_tiny

FULL_BATCH, FULL_SEQ = 4, 4096      # per rank: 4 sequences of LLaMA-2's 4096 tokens


def family(tiny: bool = False) -> Family:
    """LLaMA-2-7B at full size; ``tiny=True`` shrinks both sizes to test scale (same code paths)."""
    small_cfg = llama_tiny() if tiny else llama_small_cpu(max_position_embeddings=64)
    seq, batch_rows = (16, 4) if tiny else (64, 8)
    full_cfg = llama_tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=4) if tiny else llama_7b()
    full_rows, full_seq = (4, 32) if tiny else (FULL_BATCH, FULL_SEQ)

    def full_model(layers):
        return LlamaForCausalLM(dataclasses.replace(full_cfg, num_hidden_layers=layers) if layers else full_cfg)

    def full_batch():
        idx = torch.zeros(full_rows, full_seq, dtype=torch.long)
        return idx, idx

    return Family(
        name="llama", title="LLaMA",
        small_model=lambda: LlamaForCausalLM(small_cfg),
        small_batches=lambda n: list(TextBatches(load_corpus(), batch_rows, seq, seed=0, num_batches=n)),
        loss_fn=llama_loss, full_model=full_model, full_batch=full_batch,
        full_name=("tiny LLaMA" if tiny else "LLaMA-2-7B") + f" (seq {full_seq}, batch {full_rows} per rank)",
        full_layers=full_cfg.num_hidden_layers, plans_dir=Path(__file__).with_name("plans"))
