"""The verifier refuses graphs that break its rules, naming node and rule."""
from __future__ import annotations

import pytest
import torch

from graph_ir import capture_train_step
from graph_ir.meta import REGION
from graph_ir.verifier import VerificationError, verify
from tests.conftest import make_optimizer, tiny_mlp


@pytest.fixture
def graph():
    model, loss_fn = tiny_mlp()
    tg, _ = capture_train_step(model, make_optimizer("adamw", model.parameters()), loss_fn,
                               (torch.randn(4, 12), torch.randint(0, 5, (4,))))
    return tg


def test_captured_graph_passes_shallow_and_deep_verification(graph):
    verify(graph)
    verify(graph, deep=True)


def test_forward_node_reading_an_optimizer_value_breaks_region_flow(graph):
    fwd = next(graph.compute_nodes())
    opt = next(n for n in graph.compute_nodes() if n.meta[REGION] == "optimizer")
    fwd.meta[REGION] = "forward"
    opt.meta[REGION], fwd.meta[REGION] = "optimizer", "forward"
    user = next(iter(fwd.users))
    user.meta[REGION] = "forward"
    fwd.meta[REGION] = "optimizer"
    with pytest.raises(VerificationError, match="regions must flow"):
        verify(graph)


def test_stale_fake_value_is_caught_by_deep_verification(graph):
    node = next(n for n in graph.compute_nodes() if n.target == torch.ops.aten.addmm.default)
    node.meta["val"] = node.meta["val"].to(torch.float16)
    verify(graph)  # shallow does not re-propagate
    with pytest.raises(VerificationError, match=f"node {node.name}.*records f16"):
        verify(graph, deep=True)


def test_output_count_must_match_signature(graph):
    graph.set_outputs(graph.output_values()[:-1])
    with pytest.raises(VerificationError, match="outputs but the signature names"):
        verify(graph)


def test_update_that_changes_a_parameters_dtype_is_refused(graph):
    out = graph.output_values()[1]
    with graph.graph.inserting_before(graph.output_node()):
        cast = graph.graph.call_function(torch.ops.aten._to_copy.default, (out,), {"dtype": torch.float16})
    cast.meta.update(val=out.meta["val"].to(torch.float16), region="optimizer", module_path="")
    graph.set_outputs([graph.output_values()[0], cast] + graph.output_values()[2:])
    with pytest.raises(VerificationError, match="updates keep shape and dtype"):
        verify(graph)
