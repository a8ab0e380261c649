"""The training-graph IR and its analyses. Knows torch and networkx, nothing of cann_passes."""
from .capture import CaptureError, StepLayout, capture_train_step, gather_inputs
from .optimizers import UnsupportedOptimizer, UpdateRule, register_update_rule
from .meta import COST, MODULE_PATH, RECOMPUTE, REGION, SHARDING, Region, module_path_of, region_of
from .signature import InputKind, OutputKind, Spec, StepSignature
from .train_graph import TrainGraph

__all__ = [
    "COST", "MODULE_PATH", "RECOMPUTE", "REGION", "SHARDING", "CaptureError", "InputKind",
    "OutputKind", "Region", "Spec", "StepLayout", "StepSignature", "TrainGraph",
    "UnsupportedOptimizer", "UpdateRule", "capture_train_step", "gather_inputs", "module_path_of",
    "region_of", "register_update_rule",
]
