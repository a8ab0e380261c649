"""The LLaMA recipe: a byte-level LLaMA (RMSNorm, RoPE, SwiGLU, GQA) trained on the shipped text.

    python -m recipes.llama                                  # fp32, progress bar, loss figure
    python -m recipes.llama --plan recipes/llama/plans/bf16.yaml
    python -m recipes.llama --model transformers             # transformers' LlamaForCausalLM, same config
"""
from recipes.llama.model import (LlamaConfig, LlamaForCausalLM, count_parameters, llama_7b, llama_loss,
                                 llama_small_cpu, llama_tiny, logits_of)

__all__ = ["LlamaConfig", "LlamaForCausalLM", "count_parameters", "llama_7b", "llama_loss",
           "llama_small_cpu", "llama_tiny", "logits_of"]
