"""What every piece of the pass shares: its name, its error, the op namespaces it rewrites."""
from __future__ import annotations

import torch

from graph_ir.meta import GraphAttr

from ...pass_manager import PassOptionError

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# The pass's name: the graph attribute it writes and the ``origin_pass`` of the collectives it adds.
ATTR = GraphAttr.TENSOR_PARALLEL


class TensorParallelError(ValueError):
    pass


class TensorParallelRuleError(TensorParallelError, PassOptionError):
    """A split rule that cannot apply, named with the option it came from (``extra_rules``: the
    user's, which the compile driver reports as the plan's ``tp_rules``; ``rules``: built-in)."""

    def __init__(self, option: str, message: str, rule: str):
        PassOptionError.__init__(self, ATTR, option, message, rule)
