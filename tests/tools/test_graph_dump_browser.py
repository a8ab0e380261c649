"""index.html in a real headless browser: it renders, with no console error, and screenshots.

Needs Debian's chromium (``scripts/install_browser.sh`` installs it); skipped
where it is not installed.
"""
from __future__ import annotations

import json
import os
import re
import struct

import pytest

from tools.graph_dump.browser import find_chromium, load, screenshot
from tools.graph_dump.cli import run_target
from tools.graph_dump.dumpdir import DumpDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    find_chromium() is None,
    reason="chromium is not installed (scripts/install_browser.sh installs it with apt-get)")]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("browser_dump"))
    run_target("gpt-tiny", out, svg=False, ge=True)   # the GE section, when torchair loads
    return DumpDir(out), f"{out}/index.html"


def _rendered(load_result):
    assert load_result.console == [], load_result.console
    dom = load_result.dom
    html_tag = re.search(r"<html[^>]*>", dom).group(0)
    assert 'data-ready="1"' in html_tag and "data-errors" not in html_tag
    return dom


def test_pass_table_and_memory_plot_render_without_console_errors(page):
    dump, index = page
    dom = _rendered(load(index))
    assert len(re.findall(r'<tr class="pass (changed|same)"', dom)) == len(dump.passes)
    plot = re.search(r'<svg id="memory-plot".*?</svg>', dom, re.S).group(0)
    lines = re.findall(r'<polyline [^>]*points="([^"]+)"', plot)
    assert len(lines) == 2 and all(len(points.split()) > 100 for points in lines)
    # The module tree is built by the page's script.
    assert re.search(r'<span class="path" data-path="layers\.0">', dom)


def test_a_pass_opens_its_side_by_side_diff(page):
    dump, index = page
    dom = _rendered(load(index, "pass=001_cleanup"))
    detail = dom[dom.index('id="pass-detail"'):].split("</section>")[0]
    removed = detail.count('<td class="del">')
    assert removed >= dump.passes[1].record["nodes_before"] - dump.passes[1].record["nodes_after"]
    assert '<tr class="hunk">' in detail and '<mark class="del">' in detail

    dom = _rendered(load(index, "pass=003_cleanup"))
    assert 'id="diff-empty"' in dom


def test_module_navigation_lists_the_nodes_of_a_module(page):
    dump, index = page
    dom = _rendered(load(index, "module=layers.1.mlp"))
    nodes = dom[dom.index('id="module-nodes"'):].split("</section>")[0]
    expected = [n for n in dump.last.nodes if (n["module_path"] + ".").startswith("layers.1.mlp.")]
    shown = re.findall(r'<tr><td><code>([^<]+)</code>', nodes)
    assert shown == [n["name"] for n in expected][:300]


def test_ge_section_renders_with_links_into_module_navigation(page):
    dump, index = page
    report_file = os.path.join(dump.directory, "ge", "report.json")
    if not os.path.exists(report_file):
        pytest.skip("torchair unavailable: the page has no GE section")
    report = json.load(open(report_file))
    dom = _rendered(load(index, "module=layers.0.attn"))
    section = dom[dom.index('id="ge-section"'):].split("</section>")[0]
    assert "not a compile on an NPU" in section
    histogram = re.search(r'<table class="small ge-ops">.*?<tbody>(.*?)</tbody>', section, re.S).group(1)
    rows = re.findall(r'<tr><td>([^<]+)</td><td class="num">(\d+)</td></tr>', histogram)
    assert {op: int(n) for op, n in rows} == report["op_histogram"]
    links = re.findall(r'<a class="module-link" href="#module=([^"]+)"', section)
    assert len(links) == sum(1 for u in report["unsupported"] if u["module_path"])
    assert "layers.0.attn · " in dom[dom.index('id="module-nodes"'):]


def test_screenshot(page, tmp_path):
    _, index = page
    png = screenshot(index, str(tmp_path / "page.png"), fragment="pass=001_cleanup", width=1200, height=900)
    with open(png, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (1200, 900)
