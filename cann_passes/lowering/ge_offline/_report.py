"""GE lowering report of a dump directory: every final graph lowered offline, next to its FX dumps.

A dump directory (see ``cann_passes/dump.py``) holds ``NNN_<pass>.json`` for every pass; the
highest ``NNN`` is the graph that lowering receives. Graphs of one rank or pipeline stage live in
a subdirectory with the same layout. For each final graph this writes::

    DIR/ge/<graph>.ge.txt     the GE GraphDef (protobuf text format) torchair's converters build
    DIR/ge/report.json        per graph: source dump, GE-op histogram, unsupported ops
                              (FX node, aten op, module path, reason), notes

``write_ge_report`` is what the dump tool calls to add its GE page.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import torch

from graph_ir.analysis.collectives import group_size_of, is_collective, is_communication_op

_DUMP = re.compile(r"^(\d{3})_(.+)\.json$")


def _last_dump(directory: Path) -> Path | None:
    dumps = sorted((int(m.group(1)), p) for p in directory.glob("*.json") if (m := _DUMP.match(p.name)))
    return dumps[-1][1] if dumps else None


def final_graph_dumps(dump_dir) -> dict[str, Path]:
    """``{graph name: last NNN_*.json}`` of the program's graphs: those ``program.json`` names
    (a grad / apply split leaves the step's pre-split dumps in the top directory: not final), or,
    without it, the top-level graph ("step") and each subdirectory's."""
    root = Path(dump_dir)
    program = root / "program.json"
    if program.is_file():
        directories = json.loads(program.read_text()).get("directories") or {}
        found = {name: _last_dump(root / rel) for name, rel in directories.items()}
        if found and all(found.values()):
            return found
    found: dict[str, Path] = {}
    for directory in [root, *sorted(p for p in root.iterdir() if p.is_dir() and p.name != "ge")]:
        last = _last_dump(directory)
        if last is not None:
            found["step" if directory == root else directory.name] = last
    return found


def load_dumped_graph(path):
    """The TrainGraph of one ``NNN_*.json`` dump (fake values recomputed)."""
    from graph_ir.serialize import from_json

    return from_json(json.loads(Path(path).read_text()))


def _largest_group(gm: torch.fx.GraphModule) -> int:
    """The largest group size a collective of ``gm`` names (1 when none says)."""
    return max([group_size_of(n) or 1 for n in gm.graph.nodes if is_collective(n)], default=1)


@contextlib.contextmanager
def _process_group_for(gm: torch.fx.GraphModule, notes: list[str]):
    """torchair's collective converters look the group up: give a dumped graph one of the size its
    collectives name (a 1-rank gloo group, or torch's in-process "fake" group for more ranks:
    a ZeRO graph's reduce-scatter over 2 ranks cannot be converted against a 1-rank group)."""
    import torch.distributed as dist

    uses_collectives = any(is_communication_op(n) for n in gm.graph.nodes)
    if not uses_collectives or not dist.is_available() or dist.is_initialized():
        yield
        return
    size = _largest_group(gm)
    if size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        notes.append("collectives lowered against a 1-rank gloo group (rank lists are not the run's)")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
        notes.append(f"collectives lowered against an in-process {size}-rank group, as rank 0 "
                     "(rank lists are not the run's)")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _group_names_resolve(gm: torch.fx.GraphModule) -> None:
    """Rename dumped group names to the live default group's (dumps come from other processes)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    live = dist.group.WORLD.group_name
    for n in gm.graph.nodes:
        if is_communication_op(n):
            n.args = tuple(live if isinstance(a, str) and i == len(n.args) - 1 else a
                           for i, a in enumerate(n.args))


def report_entry(report, source) -> dict:
    return {"source": str(source), "ok": report.ok, "ge_ops": sum(report.op_histogram.values()),
            "op_histogram": dict(sorted(report.op_histogram.items())),
            "unsupported": [dataclasses.asdict(u) for u in report.unsupported], "notes": report.notes}


def lower_graph_to_files(gm: torch.fx.GraphModule, name: str, out_dir) -> "object":
    """Lower one graph, write ``<out_dir>/<name>.ge.txt``; return the GeLoweringReport."""
    from ._lower import lower_to_ge

    notes: list[str] = []
    with _process_group_for(gm, notes):
        if notes:
            _group_names_resolve(gm)
        report = lower_to_ge(gm, name=name)
    report.notes[:0] = notes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.ge.txt").write_text(report.graph_text)
    return report


def _legalized(tg):
    from ...pass_manager import PassContext, PassManager
    from graph_ir.mesh import MeshDesc
    from graph_ir.meta import GraphAttr
    mesh = tg.attrs.get(GraphAttr.MESH)
    return PassManager("npu_legalize,cleanup").run(tg, PassContext(mesh=MeshDesc.from_json(mesh) if mesh else None))


def write_ge_report(dump_dir, *, legalize: bool = True) -> str:
    """Lower every final graph of ``dump_dir``; write ``DIR/ge/*.ge.txt`` and ``DIR/ge/report.json``.

    A dump compiled for another backend (its pipeline has no ``npu_legalize``) is lowered after
    ``npu_legalize,cleanup``, as the torchair backend compiles it (``legalize=False``: as dumped).
    Returns the path of ``report.json``. Raises ``FileNotFoundError`` when the directory has no
    ``NNN_*.json`` dump and ``TorchairUnavailable`` when torchair cannot be loaded.
    """
    graphs = final_graph_dumps(dump_dir)
    if not graphs:
        raise FileNotFoundError(f"{dump_dir} holds no NNN_<pass>.json graph dump")
    out = Path(dump_dir) / "ge"
    pipeline_file = Path(dump_dir) / "pipeline.txt"
    pipeline = pipeline_file.read_text().strip() if pipeline_file.exists() else ""
    legalize = legalize and "npu_legalize" not in pipeline
    entries = {}
    for name, source in graphs.items():
        tg = load_dumped_graph(source)
        if legalize:
            tg = _legalized(tg)
        entry = report_entry(lower_graph_to_files(tg.gm, name, out), source.relative_to(dump_dir))
        if legalize:
            # Another backend's graph: what torchair would be given is this graph after the
            # torchair pipeline's own rewrite, so that is what is lowered (and said).
            entry["notes"].insert(0, f"the dump's pipeline ({pipeline or 'unknown'}) has no npu_legalize: "
                                     "lowered after npu_legalize,cleanup, as the torchair backend compiles it")
        entries[name] = entry
    total: dict[str, int] = {}
    for entry in entries.values():
        for op, n in entry["op_histogram"].items():
            total[op] = total.get(op, 0) + n
    data = {"ok": all(e["ok"] for e in entries.values()), "graphs": entries, "legalized": legalize,
            "op_histogram": dict(sorted(total.items())),
            "unsupported": [dict(u, graph=g) for g, e in entries.items() for u in e["unsupported"]]}
    path = out / "report.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return str(path)
