"""torchair's CompilerConfig, built from the plan's ``torchair`` options.

The plan speaks in a few named options; each maps onto one attribute of
torchair's ``CompilerConfig`` (torch_npu 2.13's ``torchair/configs``). The
mapping is pure data so that it is checked here, where no NPU exists, and
applied unchanged where it does; the tests apply it to the real
``CompilerConfig`` class, loaded offline.

| plan.torchair key   | CompilerConfig attribute                        | values                          |
|---------------------|-------------------------------------------------|---------------------------------|
| mode                | mode                                            | ge -> max-autotune (GE graph), aclgraph -> reduce-overhead (captured ACL graph of eager kernels) |
| graph_dump          | debug.graph_dump.type                           | txt, pbtxt, py                  |
| graph_dump_dir      | debug.graph_dump.path                           | a directory (made absolute)     |
| frozen_parameter    | experimental_config.frozen_parameter            | true/false (parameter addresses fixed: inference; keep false when training, the step writes new parameters) |
| memory_efficiency   | experimental_config.memory_efficiency           | true/false (ge.featureBaseRefreshable) |
| topology_sorting    | experimental_config.topology_sorting_strategy   | BFS, DFS, RDFS, StableRDFS (memory vs. parallelism of GE's order) |
| ge_opt_level        | ge_config.oo_level                              | O1, O3 (GE graph optimization level) |
| single_stream       | ge_config.enable_single_stream                  | true/false                      |

Options GE-graph mode only (torchair ignores or rejects them in aclgraph mode:
its ``unsupport_aclgraphconfig_list``): ``ge_opt_level=O1``, ``single_stream``,
``topology_sorting`` other than DFS, ``memory_efficiency``. Asking for them with
``mode: aclgraph`` is an error here rather than a warning on the NPU.
"""
from __future__ import annotations

from typing import Any

_MODES = {"ge": "max-autotune", "aclgraph": "reduce-overhead"}
_ANY = None  # any value of the right type

# key -> (attribute path, allowed values or _ANY, translation)
OPTIONS: dict[str, tuple[str, tuple | None, dict]] = {
    "mode": ("mode", tuple(_MODES), _MODES),
    "graph_dump": ("debug.graph_dump.type", ("txt", "pbtxt", "py"), {}),
    "graph_dump_dir": ("debug.graph_dump.path", _ANY, {}),
    "frozen_parameter": ("experimental_config.frozen_parameter", (True, False), {}),
    "memory_efficiency": ("experimental_config.memory_efficiency", (True, False), {}),
    "topology_sorting": ("experimental_config.topology_sorting_strategy",
                         ("BFS", "DFS", "RDFS", "StableRDFS"), {}),
    "ge_opt_level": ("ge_config.oo_level", ("O1", "O3"), {}),
    "single_stream": ("ge_config.enable_single_stream", (True, False), {}),
}

# key -> values that only GE-graph mode honours
_GE_MODE_ONLY = {"ge_opt_level": ("O1",), "single_stream": (True,),
                 "topology_sorting": ("BFS", "RDFS", "StableRDFS"), "memory_efficiency": (True,)}


def _check_value(key: str, value: Any) -> None:
    _, allowed, _ = OPTIONS[key]
    if allowed is _ANY:
        if not isinstance(value, str) or not value:
            raise ValueError(f"torchair.{key}: {value!r} must be a non-empty path")
        return
    if value not in allowed or (isinstance(value, bool) != isinstance(allowed[0], bool)):
        raise ValueError(f"torchair.{key}: {value!r} is not one of {list(allowed)}")


def config_assignments(options: dict[str, Any]) -> dict[str, Any]:
    """``{attribute path: value}`` for CompilerConfig; ValueError names a bad key or value."""
    out = {}
    for key, value in options.items():
        if key not in OPTIONS:
            raise ValueError(f"torchair.{key}: unknown option; known: {', '.join(OPTIONS)}")
        _check_value(key, value)
        path, _, translate = OPTIONS[key]
        out[path] = translate.get(value, value)
    if options.get("mode") == "aclgraph":
        for key, values in _GE_MODE_ONLY.items():
            if options.get(key, object()) in values:
                raise ValueError(f"torchair.{key}: {options[key]!r} applies to mode 'ge' only "
                                 "(torchair ignores it for aclgraph)")
    if "graph_dump_dir" in options and "graph_dump" not in options:
        raise ValueError("torchair.graph_dump_dir: needs torchair.graph_dump (the dump format)")
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
