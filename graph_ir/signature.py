"""What each input and output of a captured step means.

A captured step is a pure function::

    (params, buffers, optimizer state, hyperparameters, batch)
        -> (loss, new params, new buffers, new optimizer state)

The signature names every position so that the runtime can feed the graph
from a model and an optimizer and write the results back, and so that passes
can find "the gradient of ``layers.0.mlp.fc1.weight``" without guessing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class InputKind(str, enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    OPT_STATE = "opt_state"
    HPARAM = "hparam"
    BATCH = "batch"
    # State that passes add and the runtime carries from step to step
    # (a loss scale, a step counter): named ``<pass>:<key>``.
    STEP_STATE = "step_state"


class OutputKind(str, enum.Enum):
    LOSS = "loss"
    PARAM = "param"
    BUFFER = "buffer"
    OPT_STATE = "opt_state"
    STEP_STATE = "step_state"
    # Values a pass exposes for the runtime to read (e.g. ``autocast:found_inf``).
    METRIC = "metric"


@dataclass(frozen=True)
class Spec:
    """One position: its kind and its name.

    Names: a parameter or buffer by its ``named_parameters`` name; optimizer
    state as ``<param>:<key>`` (``fc1.weight:exp_avg``); hyperparameters as
    ``<key>:group<i>`` (``lr:group0``); batch leaves by their pytree path
    (``batch[0]``, ``batch['input_ids']``); the loss as ``loss``.
    """

    kind: str
    name: str

    def __post_init__(self):
        # Store the plain string so that specs built from enums and from JSON
        # compare and hash alike.
        object.__setattr__(self, "kind", getattr(self.kind, "value", self.kind))

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name}


def state_name(param: str, key: str) -> str:
    return f"{param}:{key}"


def split_state_name(name: str) -> tuple[str, str]:
    param, _, key = name.rpartition(":")
    return param, key


@dataclass
class StepSignature:
    inputs: list[Spec] = field(default_factory=list)
    outputs: list[Spec] = field(default_factory=list)

    def input_index(self, kind: str, name: str) -> int:
        return self.inputs.index(Spec(kind, name))

    def output_index(self, kind: str, name: str) -> int:
        return self.outputs.index(Spec(kind, name))

    def inputs_of(self, kind: str) -> list[tuple[int, Spec]]:
        return [(i, s) for i, s in enumerate(self.inputs) if s.kind == kind]

    def outputs_of(self, kind: str) -> list[tuple[int, Spec]]:
        return [(i, s) for i, s in enumerate(self.outputs) if s.kind == kind]

    def to_json(self) -> dict:
        return {"inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs]}

    @classmethod
    def from_json(cls, data: dict) -> "StepSignature":
        return cls([Spec(**s) for s in data["inputs"]], [Spec(**s) for s in data["outputs"]])

    def check(self, *, losses: int = 1) -> list[str]:
        """Rule violations of the signature on its own (no graph needed); ``losses``: how many loss
        outputs the graph's kind has (1 for a step or a microbatch's grad graph, 0 for an apply graph)."""
        problems = []
        for label, specs in (("input", self.inputs), ("output", self.outputs)):
            seen = set()
            for spec in specs:
                if spec in seen:
                    problems.append(f"{label} {spec.kind} '{spec.name}' appears twice")
                seen.add(spec)
        found = sum(s.kind == OutputKind.LOSS for s in self.outputs)
        if found != losses:
            problems.append("the outputs must hold exactly one loss" if losses == 1 else
                            f"the outputs hold {found} loss(es); this kind of graph has {losses}")
        params_in = {s.name for s in self.inputs if s.kind == InputKind.PARAM}
        for spec in self.outputs:
            if spec.kind == OutputKind.PARAM and spec.name not in params_in:
                problems.append(f"output param '{spec.name}' has no matching input")
        return problems
