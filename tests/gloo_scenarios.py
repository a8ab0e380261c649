"""What the gloo scenario tests share: a zoo model with its optimizer, and a launch of a worker's
scenarios on local ranks whose results come back as ``OUT/<scenario>.<mesh>.pt``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests import zoo

REPO = Path(__file__).resolve().parents[1]
RANK_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
# What every rank imports: ranks fork from a server that imported these once (``launch_local``'s
# ``preload``), where a fresh interpreter spends seconds of a 2-core machine on them per rank.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "cann_passes", "graph_ir", "tests.zoo",
           "recipes.models.gpt")


def make(name: str, opt: str):
    """``tests.zoo`` model ``name`` (2 layers, seed 0) and ``sgd`` (momentum 0.9) or AdamW.
    ``name+key=value`` overrides one config field (``gpt+attention=sdpa``)."""
    name, *overrides = name.split("+")
    config = dict(o.split("=", 1) for o in overrides)
    entry = zoo.build(name, layers=2, seed=0, **config)
    if opt == "sgd":
        optimizer = torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(entry.model.parameters(), lr=1e-3, weight_decay=0.01)
    return entry, optimizer


def verify_level(scenarios, scenario: str) -> str:
    """``deep`` for a launch's first scenario, ``shallow`` for the others. Deep verification
    re-propagates fake values through every graph after every pass: about half of a rank's compile
    on a cp x pp mesh. Every launch's mesh and passes are still deep-checked once, and every
    scenario's graphs are checked structurally after every pass."""
    return "deep" if scenario == scenarios[0] else "shallow"


def launch(worker: str, tmp_path, world: int, mesh: str, scenarios: list[str]) -> dict[str, dict]:
    """Run ``worker OUT MESH SCENARIO...`` on ``world`` local ranks; each scenario's saved result."""
    from cann_passes.runtime.distributed import launch_local, rank_failures
    results = launch_local([worker, str(tmp_path), mesh, *scenarios], world, env=RANK_ENV, timeout_s=900,
                           cwd=str(REPO), preload=PRELOAD)
    report = rank_failures(results)
    assert not report, report
    return {s: torch.load(Path(tmp_path) / f"{s}.{mesh}.pt", weights_only=False) for s in scenarios}


def eager_training(entry, optimizer, batches, loss_of, clip: bool = False, before=None):
    """Plain PyTorch over ``batches`` (``loss_of(batch)`` the step's loss, optionally clipped at 1.0;
    ``before(entry, i)`` run before step i): (the losses, the parameters after the last step)."""
    losses = []
    for i, batch in enumerate(batches):
        if before is not None:
            before(entry, i)
        optimizer.zero_grad()
        loss = loss_of(batch)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(entry.model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in entry.model.named_parameters()}
