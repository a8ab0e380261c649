"""The page's "GE lowering (offline)" section, from ``DIR/ge/report.json``.

``report.json`` is written by ``cann_passes.lowering.ge_offline.write_ge_report``: by
``cann-graph-dump run|report --ge`` or earlier by ``cann-lower-check DIR``. It lowers each final
graph of the dump with torchair's own FX->GE converters on this machine; no NPU compiles or runs
anything, so GE's own graph optimisation and kernel selection are not part of it.
"""
from __future__ import annotations

import html
import json
import os

REPORT = os.path.join("ge", "report.json")
_GE_FILES = ("report.json",)
_GE_SUFFIX = ".ge.txt"


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def clear_ge(directory: str) -> None:
    """Remove a GE report of an earlier dump into ``directory``: it describes graphs no longer there."""
    ge_dir = os.path.join(directory, "ge")
    if not os.path.isdir(ge_dir):
        return
    for name in os.listdir(ge_dir):
        if name in _GE_FILES or name.endswith(_GE_SUFFIX):
            os.remove(os.path.join(ge_dir, name))


def lower(directory: str, *, legalize: bool = True) -> str | None:
    """Write ``DIR/ge/``; on failure say why in one line and return None (the page has no GE section)."""
    from cann_passes.lowering.ge_offline import write_ge_report
    try:
        path = write_ge_report(directory, legalize=legalize)
    except (RuntimeError, FileNotFoundError) as exc:    # TorchairUnavailable is a RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"cann-graph-dump: no GE lowering section: {first}")
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    bad = len(data["unsupported"])
    how = " after npu_legalize (the dump's pipeline has none)" if data.get("legalized") else ""
    print(f"GE lowering (offline, torchair converters{how}): {'ok' if not bad else f'{bad} unsupported'}, "
          f"{sum(data['op_histogram'].values())} GE ops -> {path}")
    return path


def load_report(directory: str) -> dict | None:
    path = os.path.join(directory, REPORT)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _stale(directory: str, entry: dict, last_stem: str | None) -> str | None:
    """Why a graph's lowering may not describe the dump beside it, or None."""
    source = entry.get("source", "")
    if last_stem is not None and os.path.dirname(source) == "" and source != f"{last_stem}.json":
        return f"lowered from {source}, but the dump's final graph is {last_stem}.json"
    src_path = os.path.join(directory, source)
    lowered_at = os.path.getmtime(os.path.join(directory, REPORT))
    if os.path.exists(src_path) and os.path.getmtime(src_path) > lowered_at:
        return f"{source} was rewritten after the lowering: run report --ge again"
    return None


def _histogram(ops: dict[str, int]) -> str:
    rows = "".join(f'<tr><td>{_esc(op)}</td><td class="num">{n}</td></tr>'
                   for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
    return ('<div class="ge-ops-box"><table class="small ge-ops"><thead><tr><th>GE op</th><th>count</th></tr>'
            f'</thead><tbody>{rows}</tbody><tfoot><tr><td>all ({len(ops)} types)</td>'
            f'<td class="num">{sum(ops.values())}</td></tr></tfoot></table></div>')


def _node_link(u: dict) -> str:
    name = f"<code>{_esc(u['node'])}</code>"
    path = u.get("module_path")
    if not path:
        return name
    return f'<a class="module-link" href="#module={_esc(path)}" data-node="{_esc(u["node"])}">{name}</a>'


def _unsupported(items: list[dict]) -> str:
    if not items:
        return ""
    rows = "".join(f'<tr><td><code>{_esc(u["target"])}</code></td><td>{_node_link(u)}</td>'
                   f'<td>{_esc(u.get("module_path") or "")}</td><td>{_esc(u["reason"])}</td></tr>' for u in items)
    return ('<table class="ge-unsupported"><thead><tr><th>op</th><th>FX node</th><th>module</th><th>reason</th>'
            f'</tr></thead><tbody>{rows}</tbody></table>')


def _graph_block(directory: str, name: str, entry: dict, last_stem: str | None) -> str:
    bad = entry.get("unsupported", [])
    verdict = ('<b class="ge-ok">ok: every node lowered, 0 unsupported</b>' if not bad else
               f'<b class="ge-bad">{len(bad)} unsupported</b> (each replaced by a placeholder op in the GE graph)')
    ge_file = f"ge/{name}{_GE_SUFFIX}"
    link = (f'<a href="{_esc(ge_file)}">{_esc(ge_file)}</a>' if os.path.exists(os.path.join(directory, ge_file))
            else f'<span class="muted">{_esc(ge_file)} (missing)</span>')
    stale = _stale(directory, entry, last_stem if name == "step" else None)
    notes = "".join(f"<li>{_esc(n)}</li>" for n in entry.get("notes", []))
    return (f'<div class="ge-graph" data-graph="{_esc(name)}"><h3>graph <code>{_esc(name)}</code> from '
            f'<code>{_esc(entry.get("source", "?"))}</code>: {entry.get("ge_ops", 0)} GE ops · {verdict}</h3>'
            + (f'<p class="ge-stale">Possibly stale: {_esc(stale)}.</p>' if stale else "")
            + f"<p>GE GraphDef (protobuf text): {link}</p>"
            + (f"<ul class=\"muted\">{notes}</ul>" if notes else "")
            + _unsupported(bad) + _histogram(entry.get("op_histogram", {})) + "</div>")


def ge_section(directory: str, last_stem: str | None) -> str:
    """The section's HTML; a one-line hint when the dump has no GE report."""
    data = load_report(directory)
    if data is None:
        return ('<p class="muted" id="no-ge">Not lowered: <code>cann-graph-dump report DIR --ge</code> '
                '(or <code>cann-lower-check DIR</code>) adds this section.</p>')
    graphs = data.get("graphs", {})
    bad = sum(len(e.get("unsupported", [])) for e in graphs.values())
    head = (f'<p id="ge-summary">{len(graphs)} graph{"s" * (len(graphs) != 1)} lowered: '
            + ("<b>ok</b>, 0 unsupported" if not bad else f"<b>{bad} unsupported</b>") + "</p>")
    return ('<p class="ge-offline">This is torchair\'s own FX&rarr;GE converters run <b>offline</b> on this '
            'machine, not a compile on an NPU: it shows which GE ops each node becomes and which nodes have no '
            'converter; GE\'s graph optimisation, kernel selection and runtime are not part of it.</p>'
            + head + "".join(_graph_block(directory, name, entry, last_stem) for name, entry in graphs.items()))


def ge_headline(directory: str) -> str:
    """One clause for the page's summary: the lowering verdict, linking to the section."""
    data = load_report(directory)
    if data is None:
        return ""
    bad = len(data.get("unsupported", []))
    verdict = "ok" if not bad else f"{bad} unsupported"
    return f' · <a href="#ge-section">GE lowering (offline): {verdict}</a>'
