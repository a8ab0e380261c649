"""Fine-tuning recipe: a transformers causal LM from a local checkpoint, full / LoRA (peft) / frozen by pattern.

    python -m recipes.finetune            # LoRA on a tiny LLaMA over the shipped instruction pairs
"""
from .config import ConfigError, FinetuneConfig
from .memory import StepStateBytes, step_state_bytes
from .model import (PretrainedTokenizer, ResponseLoss, add_lora, causal_padding_mask, freeze_by_pattern, load_base,
                    load_tokenizer,
                    make_base_checkpoint, prepare_model, save_finetuned, tiny_llama_config)
from .train import FinetuneResult, build, finetune, warmup_cosine

__all__ = ["ConfigError", "FinetuneConfig", "FinetuneResult", "ResponseLoss", "StepStateBytes", "add_lora",
           "PretrainedTokenizer", "build", "causal_padding_mask", "finetune", "freeze_by_pattern", "load_base",
           "load_tokenizer",
           "make_base_checkpoint", "prepare_model", "save_finetuned", "step_state_bytes", "tiny_llama_config",
           "warmup_cosine"]
