"""torchair FX->GE converters for ops our training graphs hold and torchair has no converter for.

torchair converts aten ops and torch_npu's own ops. A transformers mixture-of-experts step also
holds transformers' grouped-matmul custom ops (its default experts on CPU), and an expert-parallel
step holds the row all-to-all ``cann.all_to_all_rows`` and the functional ``all_to_all_single`` of
the per-expert counts (torchair only decomposes the latter on its Dynamo path, which our graphs
do not take). :func:`register` adds converters for them through ``register_fx_node_ge_converter``,
the way torchair takes a custom op's converter. It runs wherever torchair is loaded: in the
offline lowering (``ge_offline``) and in the torchair backend.

- ``transformers.grouped_mm_fallback(x[M, K], w[E, K, N], offs[E])`` -> ``GroupedMatmul`` split on
  M (``group_type`` 0), ``offs`` as the cumulative ``group_list`` (``group_list_type`` 0), one
  output tensor (``split_item`` 3): what ``torch_npu.npu_grouped_matmul([x], [w], group_list=offs,
  split_item=3, group_type=0)`` builds, with torchair's empty bias/scale/offset lists.
- its backward ``(x, w, offs, dy) -> (dx, dw)``: ``dx = GroupedMatmul(dy, w^T)`` split on M, and
  ``dw = GroupedMatmul(x^T, dy)`` split on K (``group_type`` 2), one ``[K, N]`` block per expert.
- ``cann.all_to_all_rows(x, send_rows, recv_rows, group)`` -> ``HcomAllToAllV``. Its counts are
  data (the routing), so the element counts (rows x row width) and displacements (exclusive
  cumulative sums) are computed in the GE graph from the count tensors.
- ``_c10d_functional.all_to_all_single`` -> torchair's own ``all_to_all_single_npu`` converter
  (``HcomAllToAllV``, or ``HcomAllToAll`` for equal splits on CANN >= 8.2), with the counts from
  the split sizes as torchair's decomposition computes them.

What is not checked here: no device runs these GE graphs. The GE op argument conventions are
torch_npu's documented ones; the K-split weight gradient (``group_type`` 2) and the row all-to-all
with counts computed in the graph have only been lowered offline.
"""
from __future__ import annotations

import math

import torch

from graph_ir.analysis.expert_dispatch import grouped_mm_ops

from ..passes.expert_parallel import ALL_TO_ALL_ROWS

_REGISTERED: set[str] = set()


def register() -> set[str]:
    """Register the converters of the ops that exist now (transformers registers its ops when its
    MoE code is imported) and were not registered yet; returns every overload name covered."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair._ge_concrete_graph.fx2ge_converter import register_fx_node_ge_converter
    import torchair._ge_concrete_graph.ge_converter.experimental.hcom_alltoall  # noqa: F401  (defines the op)
    from torchair.ge._ge_graph import DataType

    # torchair's converter of its own all_to_all_single_npu (HcomAllToAllV / HcomAllToAll), unwrapped
    convert_all_to_all_single_npu = torch.ops.npu_define.all_to_all_single_npu.default._ge_converter.__wrapped__

    def empty_list(dtype):
        # torchair's fill_empty_tensorlist: GroupedMatmul's optional list inputs as one empty tensor
        return [ge.Fill([0], ge.Cast(0.0, dst_type=dtype))]

    def grouped_matmul(x, w, offs, group_type):
        bias_dtype = DataType.DT_FLOAT if x.dtype == DataType.DT_BF16 else x.dtype
        group_list = ge.Cast(offs, dst_type=DataType.DT_INT64)
        return ge.GroupedMatmul(
            [x], [w], empty_list(bias_dtype), empty_list(DataType.DT_UINT64), empty_list(DataType.DT_FLOAT),
            empty_list(DataType.DT_FLOAT16), empty_list(DataType.DT_FLOAT16), group_list, None,
            split_item=3, dtype=-1, transpose_weight=False, transpose_x=False, group_type=group_type,
            group_list_type=0, act_type=0, tuning_config=[0])[0]

    def group_of(group_name):
        from torch.distributed.distributed_c10d import _get_group_tag, _resolve_process_group
        import torch.distributed as dist
        group = _resolve_process_group(group_name)
        return _get_group_tag(group), dist.get_process_group_ranks(group)

    ops = grouped_mm_ops()
    if ops is not None and str(ops[0]) not in _REGISTERED:
        forward, backward = ops

        @register_fx_node_ge_converter(forward)
        def convert_grouped_mm(x, weight, offs, *, out=None, meta_outputs=None):
            return grouped_matmul(x, weight, offs, group_type=0)

        @register_fx_node_ge_converter(backward)
        def convert_grouped_mm_backward(x, weight, offs, grad_output, *, out=None, meta_outputs=None):
            grad_x = grouped_matmul(grad_output, ge.Transpose(weight, [0, 2, 1]), offs, group_type=0)
            grad_w = grouped_matmul(ge.Transpose(x, [1, 0]), grad_output, offs, group_type=2)
            return grad_x, grad_w

        _REGISTERED.update((str(forward), str(backward)))

    rows_op = ALL_TO_ALL_ROWS
    if str(rows_op) not in _REGISTERED:
        @register_fx_node_ge_converter(rows_op)
        def convert_all_to_all_rows(x, send_rows, recv_rows, group_name, *, out=None, meta_outputs=None):
            tag, ranks = group_of(group_name)
            width = math.prod(x.symsize[1:])

            def elements(rows):
                return ge.Mul(ge.Cast(rows, dst_type=DataType.DT_INT64), width)

            send, recv = elements(send_rows), elements(recv_rows)
            return convert_all_to_all_single_npu(
                x, send, ge.Cumsum(send, 0, exclusive=True), recv, ge.Cumsum(recv, 0, exclusive=True),
                tag, ranks, len(ranks))

        _REGISTERED.add(str(rows_op))

    all_to_all = torch.ops._c10d_functional.all_to_all_single.default
    if str(all_to_all) not in _REGISTERED:
        register_fx_node_ge_converter(all_to_all)(_all_to_all_single_converter(group_of, convert_all_to_all_single_npu))
        _REGISTERED.add(str(all_to_all))
    return set(_REGISTERED)


def _all_to_all_single_converter(group_of, convert_all_to_all_single_npu):
    def convert_all_to_all_single(x, output_split_sizes, input_split_sizes, group_name, *, out=None,
                                  meta_outputs=None):
        tag, ranks = group_of(group_name)
        n = len(ranks)
        rows, width = x.symsize[0], math.prod(x.symsize[1:])

        def counts(sizes):   # elements per rank; no sizes: equal splits (of as many rows as are sent)
            return [rows // n * width] * n if sizes is None else [s * width for s in sizes]

        send, recv = counts(input_split_sizes), counts(output_split_sizes)
        return convert_all_to_all_single_npu(x, send, _offsets(send), recv, _offsets(recv), tag, ranks, n)
    return convert_all_to_all_single


def _offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]

