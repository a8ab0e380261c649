"""torchair: lowering to Ascend's GE graph engine through torch_npu's torchair.

Needs an Ascend NPU, the CANN toolkit and torch_npu (the ``[npu]`` extra).
None of them exists on a machine without Ascend hardware, so this module
imports torchair only when asked to compile and says what is missing. The
final graph is handed to torchair's own backend, which converts each aten
node with its FX->GE converters and compiles the GE graph. The offline check
(``cann-lower-check``) runs the same converters without an NPU.

Not yet run on Ascend hardware: the call below follows torchair's documented
entry point (``get_npu_backend(compiler_config=...)``) but has not executed on
an NPU.
"""
from __future__ import annotations

from graph_ir import TrainGraph

from .base import BackendUnavailable, npu_available
from .torchair_config import apply_assignments, config_assignments


def import_torchair():
    ok, why = npu_available()
    if not ok:
        raise BackendUnavailable(f"backend 'torchair' needs an Ascend NPU with CANN and torch_npu: {why}")
    from torch_npu.dynamo import torchair  # noqa: WPS433  (lazy: needs CANN)
    return torchair


def build_compiler_config(torchair, plan):
    return apply_assignments(torchair.CompilerConfig(), config_assignments(plan.torchair if plan else {}))


class TorchairLowering:
    name = "torchair"

    def available(self) -> tuple[bool, str]:
        return npu_available()

    def compile(self, graph: TrainGraph, example_inputs, plan):
        torchair = import_torchair()
        from .ge_converters import register
        register()   # the converters torchair lacks for our graphs' custom ops
        backend = torchair.get_npu_backend(compiler_config=build_compiler_config(torchair, plan))
        graph.recompile()
        return backend(graph.gm, list(example_inputs))
