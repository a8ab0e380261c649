"""The BERT recipe: a byte-level BERT masked-LM trained on the shipped text, judged by masked-token accuracy.

    python -m recipes.bert                                   # fp32, progress bar, loss figure
    python -m recipes.bert --plan recipes/bert/plans/bf16.yaml
    python -m recipes.bert --model transformers              # transformers' BertForMaskedLM, same config
"""
from recipes.bert.model import (BertConfig, BertForMaskedLM, bert_large, bert_small_cpu, bert_tiny,
                                count_parameters, masked_accuracy, mlm_loss)

__all__ = ["BertConfig", "BertForMaskedLM", "bert_large", "bert_small_cpu", "bert_tiny", "count_parameters",
           "masked_accuracy", "mlm_loss"]
