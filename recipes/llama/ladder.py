"""The LLaMA family on the optimization ladder (``python -m recipes.ladder llama``)."""
from __future__ import annotations

from pathlib import Path

from recipes.llama.model import LlamaForCausalLM, llama_7b, llama_loss, llama_small_cpu, llama_tiny
from recipes.data import TextBatches
from recipes.ladder import Family, token_family

FULL_BATCH, FULL_SEQ = 4, 4096      # per rank: 4 sequences of LLaMA-2's 4096 tokens


def family(tiny: bool = False) -> Family:
    """LLaMA-2-7B at full size; ``tiny=True`` shrinks both sizes to test scale (same code paths)."""
    return token_family(
        "llama", "LLaMA", model=LlamaForCausalLM, loss_fn=llama_loss, batches=TextBatches,
        small_cfg=llama_tiny() if tiny else llama_small_cpu(max_position_embeddings=64),
        full_cfg=llama_tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=4) if tiny else llama_7b(),
        small_shape=(4, 16) if tiny else (8, 64), full_shape=(4, 32) if tiny else (FULL_BATCH, FULL_SEQ),
        full_name="tiny LLaMA" if tiny else "LLaMA-2-7B", plans_dir=Path(__file__).with_name("plans"))
