"""The pipeline split of a program, as one typed value: what ``pipeline_split`` decided and what the
runtime, the simulator, checkpoints and the dump tool read.

Stored as JSON in ``program.attrs["pipeline_parallel"]`` (``GraphAttr.PIPELINE_PARALLEL``), so a
Program stays serializable; :func:`pipeline_split_of` reads it back as a :class:`PipelineSplit`,
and nothing reads the keys by string.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .meta import GraphAttr


@dataclass
class PipelineSplit:
    stages: int                              # stage graphs in all: pp x stages per rank
    pp: int                                  # pipeline ranks
    schedule: str                            # the schedule the stages were cut for
    stage_to_rank: list[int]
    split: str                               # how the cuts were chosen ("cost", "layers", ...)
    units: int                               # cuttable units of the forward
    unit_starts: list[int]                   # the first unit of each stage
    unit_seconds: list[float]
    unit_static_bytes: list[float]
    unit_activation_bytes: list[float]
    stage_seconds: list[float]
    stage_bytes: list[float]
    imbalance: float                         # the largest stage's seconds over the mean
    boundary_tensors: list[int]              # activations each stage receives
    param_stage: dict[str, int]              # parameter -> the stage that holds (and updates) it
    microbatches: int
    shared_params: dict[str, list[int]] = field(default_factory=dict)   # tied across these stages
    stage_reductions: list[str] = field(default_factory=list)           # values all-reduced over stages
    pp_subgroups: dict[str, list[int]] = field(default_factory=dict)    # group name -> its pp ranks
    # the order each rank runs its stages' apply graphs in (one may hand step state to another)
    apply_order: list[int] = field(default_factory=list)
    dynamic: dict[str, Any] | None = None    # pipeline_schedule: dynamic, the choice and its table

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        if self.dynamic is None:
            del data["dynamic"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "PipelineSplit":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def pipeline_split_of(program) -> PipelineSplit | None:
    """The program's pipeline split; None for a program without stages."""
    data = program.attrs.get(GraphAttr.PIPELINE_PARALLEL)
    return None if data is None else PipelineSplit.from_json(data)


def set_pipeline_split(program, split: PipelineSplit) -> None:
    program.attrs[GraphAttr.PIPELINE_PARALLEL] = split.to_json()
