"""Which ops compute in low precision, which stay fp32: the autocast op lists.

Two built-in policies for training:

- ``cuda``: the op lists of ``torch.autocast(device_type="cuda")`` (ATen's
  ``autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
  ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``).
- ``npu``: the lists torch_npu registers for ``AutocastPrivateUse1``
  (``torch_npu/csrc/aten/AutoCastOps.cpp``, compiled into ``libtorch_npu.so``):
  the CUDA lists plus ``cudnn_convolution``/``cudnn_convolution_transpose`` in
  low precision, without the ``upsample_*`` ops in fp32 and without ``vdot``
  in promote.

The lists name the ops a user calls (``linear``, ``softmax``, ``layer_norm``).
A captured step holds what they decompose to and their backward ops
(``addmm``, ``_softmax``, ``_softmax_backward_data``, ``native_layer_norm_backward``),
so :data:`ATEN_SPELLINGS` maps each listed name to those spellings; the
backward op of a listed op computes in the same precision as the op, which is
what autocast produces too (the gradient of a bf16 matmul is a bf16 matmul).

A third policy, ``cpu``, has ``torch.autocast(device_type="cpu")``'s lists as
they are, to compare a graph with eager CPU autocast op for op.

Two additions beyond the CUDA and NPU lists, because a training step needs them fp32:
``rms_norm`` (a normalization, like ``layer_norm``) and ``mean`` (a reduction,
like ``sum``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOWER, FP32, PROMOTE = "lower", "fp32", "promote"

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {"fp32": torch.float32, **LOW_DTYPES}

_CUDA_LOWER = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
_UPSAMPLE = (
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp",
)
# fp32 by passing dtype=float32 to the op rather than casting its input.
_FP32_SET_OPT_DTYPE = (
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
    "sum", "norm",
)
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
            "index_put", "tensordot", "scatter_add")
_TRAINING_FP32 = ("rms_norm", "mean")

# torch.autocast(device_type="cpu") (ATen autocast_mode.cpp, AutocastCPU): fewer ops in
# fp32 than on CUDA; softmax and layer_norm follow their input. Kept so that a graph
# can be compared cast for cast with eager CPU autocast.
_CPU_LOWER = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear",
    "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
)
_CPU_FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile",
    "stft", "cdist", "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve",
    "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
    "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss",
    "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "ctc_loss", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
)

# A listed op -> the aten ops a captured step holds for it (forward decomposition and backward).
ATEN_SPELLINGS: dict[str, tuple[str, ...]] = {
    "linear": ("addmm", "mm"),
    "matmul": ("mm", "bmm"),
    "einsum": ("bmm", "mm"),
    "convolution": ("convolution", "convolution_backward"),
    "_convolution": ("convolution", "convolution_backward"),
    "conv1d": ("convolution", "convolution_backward"),
    "conv2d": ("convolution", "convolution_backward"),
    "conv3d": ("convolution", "convolution_backward"),
    "cudnn_convolution": ("convolution", "convolution_backward"),
    "_scaled_dot_product_flash_attention": (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    "scaled_dot_product_attention": (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward"),
    "softmax": ("_softmax", "_softmax_backward_data"),
    "log_softmax": ("_log_softmax", "_log_softmax_backward_data"),
    "layer_norm": ("native_layer_norm", "native_layer_norm_backward"),
    "native_layer_norm": ("native_layer_norm", "native_layer_norm_backward"),
    "group_norm": ("native_group_norm", "native_group_norm_backward"),
    "rms_norm": ("rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward"),
    "nll_loss": ("nll_loss_forward", "nll_loss_backward"),
    "nll_loss2d": ("nll_loss2d_forward", "nll_loss2d_backward"),
    "mse_loss": ("mse_loss", "mse_loss_backward"),
    "l1_loss": ("l1_loss",),
    "smooth_l1_loss": ("smooth_l1_loss", "smooth_l1_loss_backward"),
    "huber_loss": ("huber_loss", "huber_loss_backward"),
    "kl_div": ("kl_div",),
    "binary_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
    "logsumexp": ("logsumexp",),
    "softplus": ("softplus", "softplus_backward"),
    "cumsum": ("cumsum",),
    "prod": ("prod",),
    "sum": ("sum",),
    "mean": ("mean",),
    "cross_entropy_loss": ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward",
                           "nll_loss_backward"),
}


def _spell(names) -> frozenset[str]:
    out: set[str] = set()
    for name in names:
        out.add(name)
        out.update(ATEN_SPELLINGS.get(name, ()))
    return frozenset(out)


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    lower: frozenset[str]        # compute in the low-precision dtype
    fp32: frozenset[str]         # compute in fp32
    set_opt_dtype: frozenset[str]  # fp32 via the op's own ``dtype`` argument where it has one
    promote: frozenset[str]      # inputs cast to the widest input dtype

    def category(self, op_name: str) -> str:
        """``lower``, ``fp32`` or ``promote`` for an aten op packet name (``mm``, ``_softmax``)."""
        if op_name in self.lower:
            return LOWER
        if op_name in self.fp32:
            return FP32
        return PROMOTE


def _policy(name: str, lower, fp32, set_opt_dtype, promote, training_fp32=_TRAINING_FP32) -> PrecisionPolicy:
    set_opt = _spell(set_opt_dtype)
    return PrecisionPolicy(name, _spell(lower), _spell(fp32) | set_opt | _spell(training_fp32),
                           set_opt, _spell(promote))


POLICIES: dict[str, PrecisionPolicy] = {
    "cuda": _policy("cuda", _CUDA_LOWER, _FP32 + _UPSAMPLE, _FP32_SET_OPT_DTYPE, _PROMOTE),
    "npu": _policy("npu", _CUDA_LOWER + ("cudnn_convolution", "cudnn_convolution_transpose"),
                   _FP32, _FP32_SET_OPT_DTYPE, tuple(p for p in _PROMOTE if p != "vdot")),
    # torch's own CPU lists, without additions: the reference for eager CPU autocast.
    "cpu": _policy("cpu", _CPU_LOWER, _CPU_FP32, (), ("stack", "cat", "index_copy"), training_fp32=()),
}


def get_policy(name: str) -> PrecisionPolicy:
    if name not in POLICIES:
        raise ValueError(f"autocast option policy={name!r}: must be one of {', '.join(POLICIES)}")
    return POLICIES[name]


def op_packet_name(target) -> str | None:
    """``mm`` for ``aten.mm.default``; None for targets that are not aten ops."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target._schema.name.split("::")[-1]
    return None
