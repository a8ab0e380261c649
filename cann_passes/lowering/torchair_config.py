"""torchair's CompilerConfig, built from the plan's ``torchair`` options.

The plan speaks in a few named options; each maps onto one attribute of
torchair's ``CompilerConfig`` (torch_npu 2.13's ``torchair/configs``). The
mapping is pure data so that it is checked here, where no torchair exists,
and applied unchanged where it does.

| plan.torchair key   | CompilerConfig attribute                        | values                          |
|---------------------|-------------------------------------------------|---------------------------------|
| mode                | mode                                            | ge -> max-autotune (GE graph), aclgraph -> reduce-overhead |
| graph_dump          | debug.graph_dump.type                           | txt, pbtxt, py                  |
| frozen_parameter    | experimental_config.frozen_parameter            | true/false (weights as constants in inference; keep false for training) |
| memory_efficiency   | experimental_config.memory_efficiency           | true/false                      |
| topology_sorting    | experimental_config.topology_sorting_strategy   | BFS, DFS, RDFS, StableRDFS      |
| ge_opt_level        | ge_config.oo_level                              | O1, O3                          |
| single_stream       | ge_config.enable_single_stream                  | true/false                      |
"""
from __future__ import annotations

from typing import Any

_MODES = {"ge": "max-autotune", "aclgraph": "reduce-overhead"}

# key -> (attribute path, allowed values, translation)
OPTIONS: dict[str, tuple[str, tuple, dict]] = {
    "mode": ("mode", tuple(_MODES), _MODES),
    "graph_dump": ("debug.graph_dump.type", ("txt", "pbtxt", "py"), {}),
    "frozen_parameter": ("experimental_config.frozen_parameter", (True, False), {}),
    "memory_efficiency": ("experimental_config.memory_efficiency", (True, False), {}),
    "topology_sorting": ("experimental_config.topology_sorting_strategy",
                         ("BFS", "DFS", "RDFS", "StableRDFS"), {}),
    "ge_opt_level": ("ge_config.oo_level", ("O1", "O3"), {}),
    "single_stream": ("ge_config.enable_single_stream", (True, False), {}),
}


def config_assignments(options: dict[str, Any]) -> dict[str, Any]:
    """``{attribute path: value}`` for CompilerConfig; ValueError names a bad key or value."""
    out = {}
    for key, value in options.items():
        if key not in OPTIONS:
            raise ValueError(f"torchair.{key}: unknown option; known: {', '.join(OPTIONS)}")
        path, allowed, translate = OPTIONS[key]
        if value not in allowed or (isinstance(value, bool) != isinstance(allowed[0], bool)):
            raise ValueError(f"torchair.{key}: {value!r} is not one of {list(allowed)}")
        out[path] = translate.get(value, value)
    return out


def apply_assignments(config: Any, assignments: dict[str, Any]) -> Any:
    """Set each dotted attribute on a torchair CompilerConfig (its setters validate again)."""
    for path, value in assignments.items():
        *parents, leaf = path.split(".")
        target = config
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return config
