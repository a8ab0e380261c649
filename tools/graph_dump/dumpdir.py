"""Reading a dump directory (the layout ``cann_passes.dump`` writes) and the numbers the tool shows.

Everything here works from the files alone, so a dump from another machine,
or from ``CANN_PASSES_DUMP=DIR`` in someone's training run, can be inspected
without the model that produced it.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from graph_ir.analysis.collectives import kind_of_target_name

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
                "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


class DumpError(ValueError):
    pass


def value_bytes(value) -> int:
    """Bytes of a serialized node value: ``{"shape", "dtype"}`` or a list of them."""
    if isinstance(value, dict) and "shape" in value:
        return math.prod(value["shape"]) * _DTYPE_BYTES.get(value["dtype"], 4)
    if isinstance(value, list):
        return sum(value_bytes(v) for v in value)
    return 0


def collective_kind(node: dict) -> str | None:
    """``all_reduce`` / ``all_gather`` / ... for a serialized collective node, else None (recognised by
    graph_ir.analysis.collectives, like everywhere else; ``wait_tensor`` moves nothing)."""
    if node.get("op") != "call_function":
        return None
    return kind_of_target_name(node.get("target", ""))


def collective_bytes(node: dict, by_name: dict[str, dict]) -> int:
    """The larger of what a collective reads and writes (an all-gather's output, a reduce-scatter's input)."""
    inputs = [by_name[a["node"]] for a in _arg_nodes(node.get("args")) if a["node"] in by_name]
    read = value_bytes(inputs[0].get("value")) if inputs else 0
    return max(read, value_bytes(node.get("value")))


def _arg_nodes(arg):
    if isinstance(arg, dict):
        if "node" in arg:
            yield arg
        for key in ("list", "tuple"):
            for item in arg.get(key, ()):
                yield from _arg_nodes(item)
    elif isinstance(arg, list):
        for item in arg:
            yield from _arg_nodes(item)


def input_names(node: dict) -> list[str]:
    names = [a["node"] for a in _arg_nodes(node.get("args"))]
    for value in node.get("kwargs", {}).values():
        names.extend(a["node"] for a in _arg_nodes(value))
    return names


def short_target(target: str) -> str:
    """``aten.mm.default`` -> ``aten.mm``; other targets unchanged."""
    parts = target.split(".")
    if len(parts) == 3 and parts[2] == "default":
        return ".".join(parts[:2])
    return target


def op_counts(nodes: list[dict]) -> Counter:
    return Counter(n["target"] for n in nodes if n["op"] == "call_function")


@dataclass
class Collectives:
    count: int = 0
    bytes: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)      # kind -> [count, bytes]
    by_region: dict[str, list[int]] = field(default_factory=dict)    # region -> [count, bytes]

    @classmethod
    def of(cls, nodes: list[dict]) -> "Collectives":
        by_name = {n["name"]: n for n in nodes}
        kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        regions: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for node in nodes:
            kind = collective_kind(node)
            if kind is None:
                continue
            size = collective_bytes(node, by_name)
            for row in (kinds[kind], regions[node.get("region") or "io"]):
                row[0] += 1
                row[1] += size
        return cls(sum(c for c, _ in kinds.values()), sum(b for _, b in kinds.values()),
                   dict(kinds), dict(regions))


@dataclass
class PassDump:
    """One pass's files: ``NNN_<name>.py`` / ``.json`` and its record from passes.json."""

    directory: str
    record: dict

    @property
    def index(self) -> int:
        return self.record["index"]

    @property
    def name(self) -> str:
        return self.record["name"]

    @property
    def spec(self) -> str:
        return self.record.get("spec", self.name)

    @property
    def stem(self) -> str:
        return f"{self.index:03d}_{self.name}"

    def path(self, suffix: str) -> str:
        return os.path.join(self.directory, self.stem + suffix)

    @cached_property
    def data(self) -> dict:
        try:
            with open(self.path(".json"), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            raise DumpError(f"{self.path('.json')} is missing: the dump of pass '{self.spec}' is incomplete")

    @property
    def nodes(self) -> list[dict]:
        return self.data["nodes"]

    @cached_property
    def code(self) -> str:
        with open(self.path(".py"), encoding="utf-8") as f:
            return f.read()

    @cached_property
    def collectives(self) -> Collectives:
        return Collectives.of(self.nodes)

    @property
    def memory(self) -> dict:
        return self.data.get("memory") or {}

    def metrics(self) -> dict:
        """The numbers of the graph after this pass, as the pass table and ``diff`` show them."""
        memory = self.memory
        return {"nodes": len(self.nodes), "peak_bytes": memory.get("peak_bytes", 0),
                "saved_bytes": memory.get("saved_bytes", 0), "flops": self.data.get("flops", 0),
                "comm_bytes": self.collectives.bytes}

    def release(self) -> None:
        """Forget the loaded JSON (big graphs: keep one pass in memory at a time)."""
        for key in ("data", "code", "collectives"):
            self.__dict__.pop(key, None)


class DumpDir:
    def __init__(self, directory: str):
        self.directory = directory
        records_file = os.path.join(directory, "passes.json")
        if not os.path.isfile(records_file):
            raise DumpError(f"{directory} is not a dump directory: it has no passes.json "
                            "(dump with `cann-graph-dump run`, Plan(dump_dir=...) or $CANN_PASSES_DUMP)")
        with open(records_file, encoding="utf-8") as f:
            self.passes = [PassDump(directory, r) for r in json.load(f)]
        if not self.passes:
            raise DumpError(f"{records_file} lists no pass")

    @property
    def pipeline(self) -> str:
        path = os.path.join(self.directory, "pipeline.txt")
        return open(path, encoding="utf-8").read().strip() if os.path.exists(path) else ""

    def program(self) -> dict | None:
        """``program.json`` of the compiled program, where the dump has one."""
        path = os.path.join(self.directory, "program.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def graph_directories(self) -> list[str]:
        """The dump directories of the program's graphs other than the one dumped here."""
        program = self.program() or {}
        return [os.path.join(self.directory, d) for d in (program.get("directories") or {}).values()
                if d not in (".", "") and os.path.exists(os.path.join(self.directory, d, "passes.json"))]

    @property
    def last(self) -> PassDump:
        return self.passes[-1]

    def find(self, key: str | None) -> PassDump:
        """A pass by index (``2``), stem (``002_cleanup``), spec or name (the last of that name)."""
        if key is None:
            return self.last
        for p in reversed(self.passes):
            if key in (str(p.index), f"{p.index:03d}", p.stem, p.spec, p.name):
                return p
        known = ", ".join(p.stem for p in self.passes)
        raise DumpError(f"no pass '{key}' in {self.directory}; passes: {known}")

    def memory_pair(self) -> tuple[PassDump, PassDump]:
        """Which two graphs the memory plot compares: around recompute if it ran, else first and last."""
        for i, p in enumerate(self.passes):
            if p.name == "recompute" and i > 0:
                return self.passes[i - 1], p
        return self.passes[0], self.last
