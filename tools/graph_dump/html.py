"""``index.html``: one standalone page over a dump directory.

No network and no libraries: CSS, JavaScript and the SVG plot are inline, and
the data the page needs is embedded as JSON. The pass table, the memory plot
and the collectives summary are plain HTML written here; what can be big
(diffs, the final graph's node list) stays as JSON text until asked for, and
is rendered a page of rows at a time, so a 32-layer model's dump opens at
once.
"""
from __future__ import annotations

import html
import json
import os
from collections import Counter

from .dumpdir import DumpDir, PassDump, short_target
from .ge import ge_headline, ge_section

MAX_DIFF_LINES = 20000       # embedded per pass; the .diff file beside the page has all of it
MAX_EXPLAIN_CHARS = 20000
PLOT_WIDTH, PLOT_HEIGHT = 960, 280
_REGION_ABBR = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "io": "io"}
_REGION_FILL = {"forward": "#eff6ff", "backward": "#fffbeb", "optimizer": "#ecfdf5"}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _json_script(element_id: str, value) -> str:
    # "<" escaped so that no "</script>" inside the data can end the element.
    text = json.dumps(value, separators=(",", ":")).replace("<", "\\u003c")
    return f'<script type="application/json" id="{_esc(element_id)}">{text}</script>'


# -- the pass table ------------------------------------------------------------------------------

def _ops_summary(ops: dict[str, int]) -> str:
    if not ops:
        return ""
    top = sorted(ops.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{n}× {short_target(op)}" for op, n in top[:3])
    more = f", … ({sum(ops.values())} in all)" if len(top) > 3 else ""
    return _esc(text + more)


def pass_rows(dump: DumpDir) -> tuple[str, list[dict]]:
    rows, infos = [], []
    for p in dump.passes:
        r, m = p.record, p.metrics()
        changed = bool(r.get("changed"))
        delta = r.get("nodes_after", 0) - r.get("nodes_before", 0)
        rows.append(
            f'<tr class="pass {"changed" if changed else "same"}" data-stem="{_esc(p.stem)}" tabindex="0">'
            f'<td class="num">{p.index}</td><td class="spec">{_esc(p.spec)}</td>'
            f'<td class="num">{r.get("seconds", 0) * 1e3:.1f}</td>'
            f'<td>{"changed" if changed else "—"}</td>'
            f'<td class="num">{m["nodes"]}</td><td class="num">{delta:+d}</td>'
            f'<td class="ops add">{_ops_summary(r.get("ops_added", {}))}</td>'
            f'<td class="ops del">{_ops_summary(r.get("ops_removed", {}))}</td>'
            f'<td class="num">{fmt_bytes(m["peak_bytes"])}</td><td class="num">{fmt_bytes(m["saved_bytes"])}</td>'
            f'<td class="num">{fmt_flops(m["flops"])}</td><td class="num">{fmt_bytes(m["comm_bytes"])}</td></tr>')
        infos.append(_pass_info(p, m))
        if p is not dump.last:
            p.release()
    return "\n".join(rows), infos


def _pass_info(p: PassDump, metrics: dict) -> dict:
    explain = p.data.get("explain")
    explain_text = None
    if explain is not None:
        explain_text = json.dumps(explain, indent=1, default=str)
        if len(explain_text) > MAX_EXPLAIN_CHARS:
            explain_text = explain_text[:MAX_EXPLAIN_CHARS] + f"\n… (cut; all of it is in {p.stem}.json)"
    r = p.record
    return {"stem": p.stem, "index": p.index, "spec": p.spec, "changed": bool(r.get("changed")),
            "seconds": r.get("seconds", 0), "verify_seconds": r.get("verify_seconds", 0),
            "ops_added": r.get("ops_added", {}), "ops_removed": r.get("ops_removed", {}),
            "stats": r.get("stats", {}), "explain": explain_text, "metrics": metrics}


def diff_scripts(diffs: dict[str, str]) -> str:
    out = []
    for stem, text in diffs.items():
        lines = text.splitlines()
        cut = len(lines) > MAX_DIFF_LINES
        out.append(_json_script(f"diff-{stem}", {"text": "\n".join(lines[:MAX_DIFF_LINES]),
                                                 "lines": len(lines), "cut": cut}))
    return "\n".join(out)


# -- the memory plot -----------------------------------------------------------------------------

def _downsample(values: list[int], buckets: int) -> list[tuple[int, int]]:
    """(index, value) points, at most 2 per bucket (its min and max), so peaks survive."""
    if len(values) <= 2 * buckets:
        return list(enumerate(values))
    size = len(values) / buckets
    points = []
    for b in range(buckets):
        lo, hi = int(b * size), max(int((b + 1) * size), int(b * size) + 1)
        chunk = values[lo:hi]
        i_min = lo + min(range(len(chunk)), key=chunk.__getitem__)
        i_max = lo + max(range(len(chunk)), key=chunk.__getitem__)
        points.extend(sorted({(i_min, values[i_min]), (i_max, values[i_max])}))
    return points


def _region_bands(p: PassDump) -> list[tuple[str, int, int]]:
    bands: list[list] = []
    for i, node in enumerate(p.nodes):
        region = node.get("region") or "io"
        if region == "io":
            continue
        if bands and bands[-1][0] == region:
            bands[-1][2] = i
        else:
            bands.append([region, i, i])
    return [tuple(b) for b in bands]


def memory_plot(before: PassDump, after: PassDump) -> str:
    """Inline SVG: intermediate bytes live after each node, for two graphs of the pipeline."""
    series = [(before, "#2563eb", "before"), (after, "#ea580c", "after")]
    if before is after:
        series = series[1:]
    lives = [s[0].memory.get("live_bytes") or [0] for s in series]
    n_max = max(len(v) for v in lives)
    y_max = max(max(v) for v in lives) or 1
    left, right, top, bottom = 70, 30, 30, 30
    w, h = PLOT_WIDTH - left - right, PLOT_HEIGHT - top - bottom

    def x(i):
        return left + w * i / max(n_max - 1, 1)

    def y(v):
        return top + h * (1 - v / y_max)

    parts = [f'<svg id="memory-plot" xmlns="http://www.w3.org/2000/svg" width="{PLOT_WIDTH}" '
             f'height="{PLOT_HEIGHT}" viewBox="0 0 {PLOT_WIDTH} {PLOT_HEIGHT}" role="img">']
    for region, lo, hi in _region_bands(after):
        parts.append(f'<rect x="{x(lo):.1f}" y="{top}" width="{max(x(hi) - x(lo), 1):.1f}" height="{h}" '
                     f'fill="{_REGION_FILL.get(region, "#fff")}"><title>{region}</title></rect>'
                     f'<text x="{x(lo) + 3:.1f}" y="{top + 12}" class="band">{region}</text>')
    for k in range(5):
        v = y_max * k / 4
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
                     f'<text x="{left - 5}" y="{y(v) + 4:.1f}" class="tick" text-anchor="end">{fmt_bytes(v)}</text>')
    for k in range(6):
        i = round((n_max - 1) * k / 5)
        parts.append(f'<text x="{x(i):.1f}" y="{top + h + 16}" class="tick" text-anchor="middle">{i}</text>')
    legend_x = left + 10
    for (p, colour, role), live in zip(series, lives):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in _downsample(live, w))
        peak_i = max(range(len(live)), key=live.__getitem__)
        parts.append(f'<polyline class="series" data-stem="{_esc(p.stem)}" points="{pts}" fill="none" '
                     f'stroke="{colour}" stroke-width="1.3"/>')
        parts.append(f'<circle cx="{x(peak_i):.1f}" cy="{y(live[peak_i]):.1f}" r="3.5" fill="{colour}">'
                     f'<title>peak after {_esc(p.memory.get("peak_node", ""))}: {fmt_bytes(live[peak_i])}</title></circle>')
        parts.append(f'<text x="{legend_x}" y="{top - 10}" fill="{colour}" class="legend">■ {role}: '
                     f'{_esc(p.stem)} (peak {fmt_bytes(max(live))} + {fmt_bytes(p.memory.get("resident_bytes", 0))} '
                     f'resident)</text>')
        legend_x += 440
    parts.append(f'<text x="{left + w / 2:.0f}" y="{PLOT_HEIGHT - 2}" class="tick" text-anchor="middle">'
                 'node (graph order)</text></svg>')
    return "".join(parts)


# -- collectives ---------------------------------------------------------------------------------

def collectives_section(p: PassDump) -> str:
    c = p.collectives
    if not c.count:
        return f'<p class="muted" id="no-collectives">No collectives in the final graph ({_esc(p.stem)}).</p>'

    def table(title: str, rows: dict[str, list[int]]) -> str:
        body = "".join(f'<tr><td>{_esc(k)}</td><td class="num">{n}</td><td class="num">{fmt_bytes(b)}</td></tr>'
                       for k, (n, b) in sorted(rows.items()))
        return (f'<table class="small"><thead><tr><th>{title}</th><th>count</th><th>bytes</th></tr></thead>'
                f'<tbody>{body}</tbody><tfoot><tr><td>all</td><td class="num">{c.count}</td>'
                f'<td class="num">{fmt_bytes(c.bytes)}</td></tr></tfoot></table>')

    return f'<div class="row" id="collectives">{table("kind", c.by_kind)}{table("region", c.by_region)}</div>'


# -- module navigation ---------------------------------------------------------------------------

def module_index(p: PassDump) -> dict:
    """The final graph's nodes, compact: [name, op, type, region, module index]."""
    paths: dict[str, int] = {}
    rows = []
    for node in p.nodes:
        path = node.get("module_path") or ""
        index = paths.setdefault(path, len(paths))
        op = short_target(node["target"]) if node["op"] == "call_function" else node["op"]
        rows.append([node["name"], op, node.get("type", ""), _REGION_ABBR.get(node.get("region") or "io", "?"),
                     index])
    return {"stem": p.stem, "paths": list(paths), "nodes": rows}


# -- the page ------------------------------------------------------------------------------------

def _summary(dump: DumpDir) -> str:
    first, last = dump.passes[0], dump.last
    m0, m1 = first.metrics(), last.metrics()
    attrs = last.data.get("attrs", {})
    ops = Counter(n["target"] for n in last.nodes if n["op"] == "call_function")
    return (f'<p><b>{_esc(attrs.get("model", "model"))}</b> with {_esc(attrs.get("optimizer", "?"))} · '
            f'pipeline <code>{_esc(dump.pipeline)}</code></p>'
            f'<p>captured {m0["nodes"]} nodes → final {m1["nodes"]} nodes ({len(ops)} distinct ops) · '
            f'peak {fmt_bytes(m1["peak_bytes"])} · saved activations {fmt_bytes(m1["saved_bytes"])} · '
            f'{fmt_flops(m1["flops"])} · communication {fmt_bytes(m1["comm_bytes"])}'
            f'{ge_headline(dump.directory)}</p>')


def program_section(dump: DumpDir) -> str:
    """The compiled program's graphs (kind, nodes, how often each runs), linked to their own pages."""
    program = dump.program()
    if not program or len(program.get("graphs", {})) < 2:
        return ""
    every = {r["graph"]: r["every"] for r in program.get("schedule", [])}
    rows = []
    for name, graph in program["graphs"].items():
        directory = program.get("directories", {}).get(name, name)
        rows.append(f'<li><a href="{_esc(directory)}/index.html">{_esc(name)}</a>: kind {_esc(graph["kind"])}, '
                    f'{graph["nodes"]} nodes, runs once per {_esc(every.get(name, "?"))}</li>')
    flows = len(program.get("flows", []))
    return (f'<p id="program">This page shows the whole step up to the split; the program runs '
            f'{len(program["graphs"])} graphs ({flows} values flow between them):</p><ul>{"".join(rows)}</ul>')


def planner_section(directory: str) -> str:
    """This rank's memory by term (bars) and step time, from ``simulation.json`` (cann_passes.simulate)."""
    path = os.path.join(directory, "simulation.json")
    if not os.path.exists(path):
        return '<p class="muted">No simulation.json in this dump (written by compile_program\'s dump).</p>'
    with open(path, encoding="utf-8") as f:
        sim = json.load(f)
    if "error" in sim:
        return f'<p class="muted">Not simulated: {_esc(sim["error"])}</p>'
    memory = sim["memory"]
    largest = max(memory, key=memory.get)
    top = max(max(memory.values()), 1)
    rows = "".join(
        f'<tr><td>{_esc(k)}{" (largest)" if k == largest else ""}</td><td class="num">{fmt_bytes(v)}</td>'
        f'<td><div style="background:#4a7bd0;height:10px;width:{max(1, int(300 * v / top))}px"></div></td></tr>'
        for k, v in memory.items())
    peaks = ", ".join(f"{_esc(g)} {fmt_bytes(b)}" for g, b in sim["peaks"].items())
    exposed = max(0.0, sim["step_s"] - sim["compute_s"])
    return (f'<p>Rank {sim["rank"]} of {sim["world_size"]} on <b>{_esc(sim["profile"])}</b> '
            f'({fmt_bytes(sim["capacity_bytes"])}): peak {fmt_bytes(sim["peaks"][sim["peak_graph"]])} in graph '
            f'{_esc(sim["peak_graph"])} (per graph: {peaks}).</p>'
            f'<table id="planner-memory"><thead><tr><th>term</th><th>bytes</th><th></th></tr></thead>'
            f'<tbody>{rows}</tbody></table>'
            f'<p id="planner-time">Step {sim["step_s"] * 1e3:.3g} ms = compute {sim["compute_s"] * 1e3:.3g} ms + '
            f'exposed communication {exposed * 1e3:.3g} ms (communication in all {sim["comm_s"] * 1e3:.3g} ms).</p>'
            f'<p class="muted">Modelled: {_esc(sim["modelled"])}. Not modelled: {_esc(sim["not_modelled"])}.</p>')


def render(dump: DumpDir, diffs: dict[str, str], svgs: set[str] = frozenset()) -> str:
    # Parts that need two graphs first: the pass table then drops all but the last from memory.
    summary = _summary(dump) + program_section(dump)
    before, after = dump.memory_pair()
    plot = memory_plot(before, after)
    rows, infos = pass_rows(dump)
    for info in infos:
        info["svg"] = f"{info['stem']}.svg" if info["stem"] in svgs else None
        info["has_diff"] = info["stem"] in diffs
    page = _TEMPLATE
    for key, value in (("TITLE", _esc(f"graph dump: {dump.last.data.get('attrs', {}).get('model', '')} "
                                      f"{dump.pipeline}")),
                       ("CSS", _CSS), ("SUMMARY", summary), ("ROWS", rows), ("PLOT", plot),
                       ("PLOT_NOTE", _esc(f"{before.stem} vs {after.stem}" + (
                           " (around recompute)" if after.name == "recompute" else " (first vs last)"))),
                       ("COLLECTIVES", collectives_section(dump.last)),
                       ("GE", ge_section(dump.directory, dump.last.stem)),
                       ("PLANNER", planner_section(dump.directory)),
                       ("PASSES_JSON", _json_script("passes-data", infos)),
                       ("MODULES_JSON", _json_script("modules-data", module_index(dump.last))),
                       ("DIFFS_JSON", diff_scripts(diffs)), ("JS", _JS)):
        page = page.replace(f"@@{key}@@", value)
    return page


def write_index(dump: DumpDir, diffs: dict[str, str], svgs=(), path: str | None = None) -> str:
    path = path or os.path.join(dump.directory, "index.html")
    svg_stems = {os.path.basename(s)[:-4] for s in svgs}
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(dump, diffs, svg_stems))
    return path


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>@@TITLE@@</title>
<script>
window.__errors = [];
window.addEventListener("error", function (e) {
  window.__errors.push(String(e.message || e));
  var box = document.getElementById("js-errors");
  if (box) { box.hidden = false; box.textContent = window.__errors.join("\\n"); }
  document.documentElement.setAttribute("data-errors", String(window.__errors.length));
});
</script>
<style>@@CSS@@</style></head>
<body>
<pre id="js-errors" hidden></pre>
<header><h1>Training-step graph dump</h1>@@SUMMARY@@</header>
<section id="passes-section"><h2>Passes</h2>
<p class="muted">Numbers are of the graph after each pass. Click a row for its diff against the previous pass.</p>
<table id="pass-table"><thead><tr><th>#</th><th>pass</th><th>ms</th><th>changed</th><th>nodes</th><th>Δ</th>
<th>ops added</th><th>ops removed</th><th>peak memory</th><th>saved</th><th>FLOPs</th><th>comm bytes</th></tr></thead>
<tbody>
@@ROWS@@
</tbody></table>
<div id="pass-detail" hidden></div>
</section>
<section id="memory-section"><h2>Memory timeline</h2>
<p class="muted">Intermediate bytes live after each node (inputs are resident all step): @@PLOT_NOTE@@.</p>
@@PLOT@@
</section>
<section id="collectives-section"><h2>Collectives</h2>
@@COLLECTIVES@@
</section>
<section id="ge-section"><h2>GE lowering (offline)</h2>
@@GE@@
</section>
<section id="planner-section"><h2>Memory and time per rank (simulated)</h2>
@@PLANNER@@
</section>
<section id="modules-section"><h2>Final graph by module</h2>
<div class="row"><input id="module-filter" placeholder="filter module paths (prefix, e.g. layers.3.attn)" size="50">
<span id="module-count" class="muted"></span></div>
<div class="row top"><div id="module-tree"></div><div id="module-nodes"></div></div>
</section>
@@PASSES_JSON@@
@@MODULES_JSON@@
@@DIFFS_JSON@@
<script>@@JS@@</script>
</body></html>
"""

_CSS = """
body{font:13px/1.4 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:16px 24px;color:#111}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ddd}
code,pre,.code{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px}
table{border-collapse:collapse}th,td{padding:2px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f3f4f6;position:sticky;top:0}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}th{white-space:nowrap}
tr.pass{cursor:pointer}tr.pass:hover{background:#f9fafb}tr.pass.selected{background:#e0e7ff}
tr.same td{color:#6b7280}td.ops{max-width:260px;font-size:11px}td.ops.add{color:#15803d}td.ops.del{color:#b91c1c}
.muted{color:#6b7280}.row{display:flex;gap:24px;align-items:flex-start;flex-wrap:wrap}.row.top{margin-top:8px}
table.small{margin-right:16px}
#js-errors{background:#fee2e2;color:#991b1b;padding:8px}
#pass-detail{margin:10px 0;padding:10px;border:1px solid #c7d2fe;background:#fafaff}
.diff{width:100%;table-layout:fixed;font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:11.5px}
.diff td{white-space:pre-wrap;word-break:break-all;border:0;padding:0 4px}.diff col.ln{width:48px}
.diff td.ln{color:#9ca3af;text-align:right}
.diff tr.hunk td{background:#eef2ff;color:#4338ca}.diff td.del{background:#fee2e2}.diff td.add{background:#dcfce7}
.diff mark.del{background:#fca5a5}.diff mark.add{background:#86efac}
button.more{margin:6px 0}#diff-view{max-height:min(70vh,640px);overflow:auto;border:1px solid #e5e7eb}
svg text.tick{font-size:10px;fill:#4b5563}svg text.legend{font-size:11px}svg text.band{font-size:10px;fill:#9ca3af}
svg line.grid{stroke:#e5e7eb}
#module-tree{min-width:320px;max-height:520px;overflow:auto;border:1px solid #eee;padding:4px}
#module-tree details{margin-left:12px}#module-tree summary{cursor:pointer}
#module-tree .path.selected{background:#e0e7ff}.path{cursor:pointer}
#module-nodes{flex:1;min-width:400px;max-height:520px;overflow:auto}#module-nodes tr.hit{background:#fef3c7}
.ge-ok{color:#15803d}.ge-bad{color:#b91c1c}.ge-stale{background:#fef3c7;padding:4px}
.ge-ops-box{max-height:420px;overflow:auto}table.ge-unsupported{margin-bottom:10px}.ge-graph h3{font-size:14px}
"""

_JS = r"""
"use strict";
const PAGE = 300;
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const readJSON = (id) => { const el = $(id); return el ? JSON.parse(el.textContent) : null; };
const PASSES = readJSON("passes-data");
const fmtBytes = (n) => { const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; } return i ? n.toFixed(1) + " " + u[i] : n + " B"; };

// -- side-by-side diff, parsed from the embedded unified diff when a pass is opened ----------
// The node a code line assigns, so that a changed node's old and new lines sit side by side.
const assigned = (line) => { const m = /^\s*([A-Za-z_][A-Za-z0-9_]*) = /.exec(line); return m ? m[1] : line; };

function pairChanges(dels, adds) {
  const delKeys = new Set(dels.map(assigned)), addKeys = new Set(adds.map(assigned));
  const pairs = []; let i = 0, j = 0;
  while (i < dels.length || j < adds.length) {
    const kd = i < dels.length ? assigned(dels[i]) : null, ka = j < adds.length ? assigned(adds[j]) : null;
    const dOnly = kd !== null && !addKeys.has(kd), aOnly = ka !== null && !delKeys.has(ka);
    if (kd !== null && (kd === ka || (dOnly && aOnly))) pairs.push([i++, j++]);
    else if (kd !== null && (dOnly || ka === null)) pairs.push([i++, -1]);
    else pairs.push([-1, j++]);
  }
  return pairs;
}

function diffRows(text) {
  const rows = []; let a = 0, b = 0, dels = [], adds = [];
  const flush = () => {
    for (const [i, j] of pairChanges(dels, adds))
      rows.push(["chg", i < 0 ? "" : a + i, i < 0 ? undefined : dels[i], j < 0 ? "" : b + j, j < 0 ? undefined : adds[j]]);
    a += dels.length; b += adds.length; dels = []; adds = [];
  };
  let inHunk = false;
  for (const line of text.split("\n")) {
    const m = /^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@/.exec(line);
    if (m) { flush(); a = +m[1]; b = +m[2]; inHunk = true; rows.push(["hunk", line]); continue; }
    if (!inHunk) continue;
    if (line.startsWith("-")) dels.push(line.slice(1));
    else if (line.startsWith("+")) adds.push(line.slice(1));
    else if (line.startsWith("\\")) continue;
    else { flush(); rows.push(["ctx", a, line.slice(1), b, line.slice(1)]); a++; b++; }
  }
  flush();
  return rows;
}

// Marks the part of a changed line that differs from its partner.
function marked(text, other, cls) {
  if (text === undefined) return "";
  if (other === undefined) return esc(text);
  let p = 0; while (p < text.length && p < other.length && text[p] === other[p]) p++;
  let s = 0; while (s < text.length - p && s < other.length - p &&
                   text[text.length - 1 - s] === other[other.length - 1 - s]) s++;
  return esc(text.slice(0, p)) + '<mark class="' + cls + '">' + esc(text.slice(p, text.length - s)) +
         "</mark>" + esc(text.slice(text.length - s));
}

function rowHTML(r) {
  if (r[0] === "hunk") return '<tr class="hunk"><td colspan="4">' + esc(r[1]) + "</td></tr>";
  if (r[0] === "ctx") return '<tr><td class="ln">' + r[1] + "</td><td>" + esc(r[2]) + '</td><td class="ln">' +
                             r[3] + "</td><td>" + esc(r[4]) + "</td></tr>";
  return '<tr><td class="ln">' + r[1] + '</td><td class="' + (r[2] === undefined ? "" : "del") + '">' +
         marked(r[2], r[4], "del") + '</td><td class="ln">' + r[3] + '</td><td class="' +
         (r[4] === undefined ? "" : "add") + '">' + marked(r[4], r[2], "add") + "</td></tr>";
}

// Appends rows PAGE at a time, with a "show more" button for the rest.
function paged(container, items, render, tableClass) {
  const table = document.createElement("table");
  if (tableClass) table.className = tableClass;
  if (tableClass === "diff")
    table.innerHTML = '<colgroup><col class="ln"><col><col class="ln"><col></colgroup>';
  const body = document.createElement("tbody"); table.appendChild(body); container.appendChild(table);
  const button = document.createElement("button"); button.className = "more"; container.appendChild(button);
  let shown = 0;
  const more = () => {
    const next = Math.min(items.length, shown + PAGE);
    body.insertAdjacentHTML("beforeend", items.slice(shown, next).map(render).join(""));
    shown = next;
    button.hidden = shown >= items.length;
    button.textContent = "show more (" + (items.length - shown) + " rows left)";
  };
  button.addEventListener("click", more);
  more();
}

function opsList(ops) {
  const items = Object.entries(ops).sort((x, y) => y[1] - x[1]);
  return items.length ? items.map(([op, n]) => n + "× " + esc(op)).join(", ") : "none";
}

function showPass(stem) {
  const info = PASSES.find((p) => p.stem === stem);
  if (!info) return;
  document.querySelectorAll("tr.pass").forEach((tr) => tr.classList.toggle("selected", tr.dataset.stem === stem));
  const box = $("pass-detail"); box.hidden = false; box.innerHTML = "";
  const files = [".py", ".json", ".dot"].concat(info.has_diff ? [".diff"] : []).concat(info.svg ? [".svg"] : []);
  box.insertAdjacentHTML("beforeend",
    "<h3>" + esc(info.stem) + " · <code>" + esc(info.spec) + "</code></h3><p>" +
    files.map((s) => '<a href="' + esc(info.stem + s) + '">' + esc(info.stem + s) + "</a>").join(" · ") +
    "</p><p>" + (info.seconds * 1e3).toFixed(1) + " ms, verifier " + (info.verify_seconds * 1e3).toFixed(1) +
    " ms · stats <code>" + esc(JSON.stringify(info.stats)) + "</code></p>" +
    '<p class="add">added: ' + opsList(info.ops_added) + '</p><p class="del">removed: ' +
    opsList(info.ops_removed) + "</p>" +
    (info.explain ? "<details><summary>explain</summary><pre>" + esc(info.explain) + "</pre></details>" : ""));
  const data = readJSON("diff-" + stem);
  const holder = document.createElement("div"); holder.id = "diff-view"; box.appendChild(holder);
  if (!data) { holder.innerHTML = '<p class="muted">The captured graph: nothing to compare with.</p>'; return; }
  if (!data.text) { holder.innerHTML = '<p class="muted" id="diff-empty">No change: the code is identical to the previous pass.</p>'; return; }
  if (data.cut) holder.insertAdjacentHTML("beforeend", '<p class="muted">Showing the first part of a ' +
    data.lines + '-line diff; all of it is in <a href="' + esc(stem) + '.diff">' + esc(stem) + ".diff</a>.</p>");
  paged(holder, diffRows(data.text), rowHTML, "diff");
}

// -- module navigation --------------------------------------------------------------------------
const MODULES = readJSON("modules-data");

function moduleTree(paths) {
  const root = {name: "", path: "", children: new Map(), count: 0};
  const counts = new Map();
  for (const n of MODULES.nodes) counts.set(n[4], (counts.get(n[4]) || 0) + 1);
  paths.forEach((path, index) => {
    let node = root;
    const parts = path ? path.split(".") : ["(no module)"];
    parts.forEach((part, i) => {
      if (!node.children.has(part))
        node.children.set(part, {name: part, path: path ? parts.slice(0, i + 1).join(".") : "", children: new Map(), count: 0});
      node = node.children.get(part);
      node.count += counts.get(index) || 0;
    });
  });
  return root;
}

function treeHTML(node, depth) {
  let out = "";
  for (const child of node.children.values()) {
    const label = '<span class="path" data-path="' + esc(child.path) + '">' + esc(child.name) +
                  ' <span class="muted">(' + child.count + ")</span></span>";
    out += child.children.size ? "<details" + (depth < 1 ? " open" : "") + "><summary>" + label +
           "</summary>" + treeHTML(child, depth + 1) + "</details>" : '<div style="margin-left:12px">' + label + "</div>";
  }
  return out;
}

function matches(path, prefix) {
  return prefix === "" ? path === "" : path === prefix || path.startsWith(prefix + ".");
}

let wantedNode = null;     // set by a GE-table link: the node to mark in the module's list

function showModule(prefix) {
  document.querySelectorAll("#module-tree .path").forEach((el) => el.classList.toggle("selected", el.dataset.path === prefix));
  const wanted = new Set(); MODULES.paths.forEach((p, i) => { if (matches(p, prefix)) wanted.add(i); });
  const rows = MODULES.nodes.filter((n) => wanted.has(n[4]));
  const box = $("module-nodes"); box.innerHTML = "<h3>" + esc(prefix || "(no module)") + " · " + rows.length +
    " nodes in " + esc(MODULES.stem) + "</h3>";
  const hit = wantedNode; wantedNode = null;
  paged(box, rows, (n) => (n[0] === hit ? '<tr class="hit">' : "<tr>") + "<td><code>" + esc(n[0]) + "</code></td><td>" +
    esc(n[1]) + "</td><td>" + esc(n[2]) + "</td><td>" + n[3] + '</td><td class="muted">' + esc(MODULES.paths[n[4]]) +
    "</td></tr>");
  const row = box.querySelector("tr.hit"); if (row) row.scrollIntoView({block: "nearest"});
}

function renderTree(filter) {
  const paths = filter ? MODULES.paths.filter((p) => p.startsWith(filter)) : MODULES.paths;
  $("module-tree").innerHTML = treeHTML(moduleTree(paths), 0);
  $("module-count").textContent = paths.length + " module paths, " + MODULES.nodes.length + " nodes";
}

function openFromHash() {
  const h = decodeURIComponent(location.hash.slice(1));
  if (h.startsWith("pass=")) showPass(h.slice(5));
  if (h.startsWith("module=")) showModule(h.slice(7));
}

document.querySelectorAll("tr.pass").forEach((tr) => {
  tr.addEventListener("click", () => { history.replaceState(null, "", "#pass=" + tr.dataset.stem); showPass(tr.dataset.stem); });
  tr.addEventListener("keydown", (e) => { if (e.key === "Enter") showPass(tr.dataset.stem); });
});
$("module-tree").addEventListener("click", (e) => {
  const el = e.target.closest(".path"); if (el) { e.preventDefault(); showModule(el.dataset.path); }
});
$("module-filter").addEventListener("input", (e) => renderTree(e.target.value.trim()));
document.querySelectorAll("a.module-link").forEach((a) => a.addEventListener("click", () => {
  wantedNode = a.dataset.node;
  // The same hash again fires no hashchange: open it here, and scroll to the list either way.
  if (decodeURIComponent(location.hash) === a.getAttribute("href")) openFromHash();
  $("modules-section").scrollIntoView();
}));
window.addEventListener("hashchange", openFromHash);
renderTree("");
openFromHash();
document.documentElement.setAttribute("data-render-ms", performance.now().toFixed(0));
document.documentElement.setAttribute("data-ready", "1");
"""
