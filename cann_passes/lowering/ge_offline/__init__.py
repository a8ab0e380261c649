"""Offline FX -> GE GraphDef lowering with torchair's own converters (no NPU, no torch_npu import).

See ``_loader.py`` for how torchair is obtained (extracted from the torch_npu wheel into a cache,
imported without executing torch_npu or torchair's top-level ``__init__``) and
``_standin_torchair.py`` for the graph-construction-only stand-in of the native
``torchair.core._torchair`` module (used only when the real one cannot load).
"""

from ._loader import TorchairUnavailable, load_torchair, loader_info
from ._lower import GeLoweringReport, UnsupportedOp, lower_to_ge, supported_ops
from ._report import final_graph_dumps, load_dumped_graph, lower_graph_to_files, write_ge_report

__all__ = [
    "TorchairUnavailable",
    "load_torchair", "loader_info", "lower_to_ge", "supported_ops", "GeLoweringReport", "UnsupportedOp",
    "final_graph_dumps", "load_dumped_graph", "lower_graph_to_files", "write_ge_report"]
