"""cann_passes: compile whole training steps into graphs, rewrite them with passes, lower them.

    model + optimizer --capture--> TrainGraph --passes--> TrainGraph --lower--> torchair | inductor | eager
"""
from graph_ir import TrainGraph

from .api import backend, compile_for_npu
from .compile import compile_program
from .pass_manager import (PassContext, PassFailure, PassManager, PassRecord, Pipeline, PipelineError,
                           register_pass, registered_passes, spec)
from .plan import Plan, PlanError
from .step import CompiledStep

__all__ = ["CompiledStep", "PassContext", "PassFailure", "PassManager", "PassRecord", "Pipeline",
           "PipelineError", "Plan", "PlanError", "TrainGraph", "backend", "compile_for_npu", "compile_program",
           "register_pass", "registered_passes", "spec"]
