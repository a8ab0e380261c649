"""The BERT family on the optimization ladder (``python -m recipes.ladder bert``)."""
from __future__ import annotations

from pathlib import Path

from recipes.bert.model import BertForMaskedLM, bert_large, mlm_loss, bert_small_cpu, bert_tiny
from recipes.data.mlm import MaskedLMBatches
from recipes.ladder import Family, token_family

FULL_BATCH, FULL_SEQ = 32, 512      # per rank: BERT-large pre-training's phase-2 shape


def family(tiny: bool = False) -> Family:
    """BERT-large at full size; ``tiny=True`` shrinks both sizes to test scale (same code paths)."""
    return token_family(
        "bert", "BERT", model=BertForMaskedLM, loss_fn=mlm_loss, batches=MaskedLMBatches,
        # the CPU rungs keep the 4-layer, FFN 512 shape the committed report measured
        small_cfg=bert_tiny() if tiny else bert_small_cpu(num_hidden_layers=4, intermediate_size=512,
                                                          max_position_embeddings=64),
        full_cfg=bert_tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=4) if tiny else bert_large(),
        small_shape=(4, 16) if tiny else (8, 64), full_shape=(4, 32) if tiny else (FULL_BATCH, FULL_SEQ),
        full_name="tiny BERT" if tiny else "BERT-large", plans_dir=Path(__file__).with_name("plans"))
