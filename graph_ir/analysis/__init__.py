"""Analyses of a TrainGraph: cost per node, liveness and memory, a networkx view, the verifier."""
from .cost import GraphCost, NodeCost, graph_cost, is_view_op, node_cost
from .memory import MemoryProfile, memory_profile, saved_activations
from .nx_view import to_networkx

__all__ = ["GraphCost", "MemoryProfile", "NodeCost", "graph_cost", "is_view_op", "memory_profile",
           "node_cost", "saved_activations", "to_networkx"]
