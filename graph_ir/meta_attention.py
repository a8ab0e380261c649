"""Attention traced on ``meta`` as the device runs it.

On ``meta`` tensors ``F.scaled_dot_product_attention`` takes its math form: the
``seq x seq`` scores and probabilities are materialized and saved for backward.
A step captured on meta is never run; it is compiled and priced (the planner,
the simulator, the benches at 7B-70B scale), and the device runs the fused
kernel. So while a step is captured on meta, each SDPA call for which CPU would
choose its fused flash kernel (``torch._fused_sdp_choice`` asked about small CPU
tensors of the same dtypes, heads, head size, mask kind, dropout and causality)
is traced as that kernel's aten op, ``_scaled_dot_product_flash_attention_for_cpu``,
the op a capture on CPU records and ``npu_legalize`` maps to Ascend's fused
attention; a boolean mask is passed as it is (as Ascend's kernel takes it; CPU's kernel
would need a float copy, and the meta graph is never run). Calls CPU would run in math form
(GQA through ``enable_gqa``, say) stay as they are.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _probe(t: torch.Tensor, keep_heads: bool = True) -> torch.Tensor:
    """A small CPU tensor standing for ``t``: batch 1, sequence dims 2, heads and head size kept."""
    shape = list(t.shape)
    if len(shape) >= 4:
        shape[-4] = 1
    if len(shape) >= 2:
        shape[-2] = min(shape[-2], 2)
    if not keep_heads:
        shape[-1] = min(shape[-1], 2)
    return torch.zeros(shape, dtype=t.dtype)


def _flash_on_cpu(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    if enable_gqa or query.dim() != 4:
        return False
    with _disable_current_modes():
        q, k, v = (_probe(t) for t in (query, key, value))
        mask = None if attn_mask is None else _probe(attn_mask, keep_heads=False)
        return int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale)) == _FLASH


class _FusedAttentionOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _fused(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if query.device.type != "meta" or not _flash_on_cpu(query, key, value, attn_mask, dropout_p, is_causal,
                                                         scale, enable_gqa):
        return None
    # A boolean mask stays boolean: CPU's kernel would take a float copy of it per call (saved for
    # backward, 4 bytes per score at every layer), Ascend's fused attention takes it as it is
    # (npu_legalize), and the meta graph is never run.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def fused_attention_on_meta(enabled: bool):
    """While ``enabled`` (the step is captured on meta), SDPA traces as CPU's fused kernel where CPU uses it."""
    return _FusedAttentionOnMeta() if enabled else contextlib.nullcontext()
