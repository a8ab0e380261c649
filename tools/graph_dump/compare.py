"""``cann-graph-dump diff DIR_A DIR_B``: two runs of one model (two plans), pass by pass."""
from __future__ import annotations

import difflib

from .dumpdir import DumpDir, op_counts, short_target
from .html import fmt_bytes, fmt_flops

_COLUMNS = (("nodes", "nodes", str), ("peak_bytes", "peak memory", fmt_bytes),
            ("saved_bytes", "saved", fmt_bytes), ("flops", "FLOPs", fmt_flops),
            ("comm_bytes", "comm bytes", fmt_bytes))


def aligned_passes(a: DumpDir, b: DumpDir) -> list[tuple]:
    """Pairs (pass in A or None, pass in B or None), matched by name in pipeline order."""
    names_a, names_b = [p.name for p in a.passes], [p.name for p in b.passes]
    pairs = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=names_a, b=names_b, autojunk=False).get_opcodes():
        if tag == "equal":
            pairs += list(zip(a.passes[i1:i2], b.passes[j1:j2]))
        else:
            pairs += [(p, None) for p in a.passes[i1:i2]] + [(None, p) for p in b.passes[j1:j2]]
    return pairs


def _cell(metrics: dict | None, key: str, fmt) -> str:
    return "-" if metrics is None else fmt(metrics[key])


def pass_table(a: DumpDir, b: DumpDir) -> list[str]:
    head = ["pass (A | B)"] + [f"{label} A | B" for _, label, _ in _COLUMNS]
    rows = []
    for pa, pb in aligned_passes(a, b):
        ma, mb = (pa.metrics() if pa else None), (pb.metrics() if pb else None)
        name = pa.spec if pa and pb and pa.spec == pb.spec else f"{pa.spec if pa else '-'} | {pb.spec if pb else '-'}"
        rows.append([name] + [f"{_cell(ma, k, f)} | {_cell(mb, k, f)}" for k, _, f in _COLUMNS])
        for p in (pa, pb):
            if p is not None and p is not a.last and p is not b.last:
                p.release()
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt_row = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt_row(head), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows]


def op_count_differences(a: DumpDir, b: DumpDir) -> list[str]:
    ca, cb = op_counts(a.last.nodes), op_counts(b.last.nodes)
    changed = sorted((op for op in set(ca) | set(cb) if ca[op] != cb[op]), key=lambda op: -abs(cb[op] - ca[op]))
    if not changed:
        return ["final graphs: the same op counts"]
    width = max(len(short_target(op)) for op in changed)
    lines = [f"final graphs ({a.last.stem} | {b.last.stem}): op counts that differ", f"{'op'.ljust(width)}      A      B      B-A"]
    lines += [f"{short_target(op).ljust(width)}  {ca[op]:5d}  {cb[op]:5d}  {cb[op] - ca[op]:+7d}" for op in changed]
    return lines


def compare(dir_a: str, dir_b: str) -> str:
    a, b = DumpDir(dir_a), DumpDir(dir_b)
    lines = [f"A: {dir_a}  ({a.pipeline})", f"B: {dir_b}  ({b.pipeline})", ""]
    lines += pass_table(a, b) + [""] + op_count_differences(a, b)
    return "\n".join(lines) + "\n"
