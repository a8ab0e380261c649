"""The BERT family on the optimization ladder (``python -m recipes.ladder bert``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from recipes.bert.model import BertForMaskedLM, bert_large, bert_small_cpu, bert_tiny, mlm_loss
from recipes.data import load_corpus
from recipes.data.mlm import MaskedLMBatches
from recipes.ladder import Family

FULL_BATCH, FULL_SEQ = 32, 512      # per rank: BERT-large pre-training's phase-2 shape


def family(tiny: bool = False) -> Family:
    """BERT-large at full size; ``tiny=True`` shrinks both sizes to test scale (same code paths)."""
    small_cfg = bert_tiny() if tiny else bert_small_cpu(max_position_embeddings=64)
    seq, batch_rows = (16, 4) if tiny else (64, 8)
    full_cfg = bert_tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=4) if tiny else bert_large()
    full_rows, full_seq = (4, 32) if tiny else (FULL_BATCH, FULL_SEQ)

    def full_model(layers):
        return BertForMaskedLM(dataclasses.replace(full_cfg, num_hidden_layers=layers) if layers else full_cfg)

    def full_batch():
        ids = torch.zeros(full_rows, full_seq, dtype=torch.long)
        return ids, ids

    return Family(
        name="bert", title="BERT",
        small_model=lambda: BertForMaskedLM(small_cfg),
        small_batches=lambda n: list(MaskedLMBatches(load_corpus(), batch_rows, seq, seed=0, num_batches=n)),
        loss_fn=mlm_loss, full_model=full_model, full_batch=full_batch,
        full_name=("tiny BERT" if tiny else "BERT-large") + f" (seq {full_seq}, batch {full_rows} per rank)",
        full_layers=full_cfg.num_hidden_layers, plans_dir=Path(__file__).with_name("plans"))
