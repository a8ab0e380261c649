"""Plain-PyTorch reference models."""

from recipes.models.gpt import (
    GPT,
    Block,
    CausalSelfAttention,
    FeedForward,
    GPTConfig,
    count_parameters_analytic,
    gpt3_175b_layer,
    gpt_7b,
    gpt_loss,
    gpt_small_cpu,
    gpt_tiny,
)
from recipes.models.mlp import MLP, mlp_loss

__all__ = [
    "GPT",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "GPTConfig",
    "MLP",
    "count_parameters_analytic",
    "gpt3_175b_layer",
    "gpt_7b",
    "gpt_loss",
    "gpt_small_cpu",
    "gpt_tiny",
    "mlp_loss",
]
