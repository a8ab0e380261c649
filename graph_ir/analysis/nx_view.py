"""A networkx view of a graph, for the algorithms networkx does well (cuts, paths, dominators)."""
from __future__ import annotations

import networkx as nx
import torch.fx

from ..meta import describe_value, module_path_of, region_of
from .cost import node_cost


def to_networkx(graph: torch.fx.Graph, *, with_cost: bool = True) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        attrs = {"op": node.op, "target": str(node.target), "region": str(region_of(node)),
                 "module_path": module_path_of(node), "value": describe_value(node.meta.get("val"))}
        if with_cost:
            cost = node_cost(node)
            attrs.update(flops=cost.flops, bytes=cost.bytes)
        g.add_node(node.name, **attrs)
        for arg in node.all_input_nodes:
            g.add_edge(arg.name, node.name)
    return g
