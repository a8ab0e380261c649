"""The mixture-of-experts recipe: a byte-level Mixtral (transformers' ``MixtralForCausalLM`` from a
config, 8 experts, top-2, its load-balancing loss) trained on the shipped text, and the dense model
with the same active parameters per token to compare it with.

    python -m recipes.moe                                    # fp32, progress bar, loss figure
    python -m recipes.moe --model dense                      # the dense baseline, same active size
    torchrun --standalone --nproc-per-node 2 -m recipes.moe --plan recipes/moe/plans/ep2.yaml
"""
from recipes.moe.model import dense_small_cpu, moe_loss, moe_small_cpu

__all__ = ["dense_small_cpu", "moe_loss", "moe_small_cpu"]
