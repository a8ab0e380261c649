"""cann-graph-dump: every artifact of a run on a small GPT, and the diff/show/report commands."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from cann_passes import Plan, compile_for_npu
from graph_ir.serialize import node_json
from tools.graph_dump import main
from tools.graph_dump.artifacts import to_dot
from tools.graph_dump.cli import run_target
from tools.graph_dump.dumpdir import Collectives, DumpDir, PassDump, value_bytes
from tools.graph_dump.html import _downsample, collectives_section
from tools.graph_dump.show import in_module


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpt_dump"))
    return run_target("gpt-tiny", out, steps=2, svg=False)


@pytest.fixture(scope="module")
def gpt_dump(gpt_run):
    return DumpDir(gpt_run.directory)


def _stdout(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


class TestRunArtifacts:
    def test_default_pipeline_is_dumped_pass_by_pass(self, gpt_dump):
        assert gpt_dump.pipeline == \
            "cleanup,attention_masks_as_flags,cleanup,wait_for_reductions_first,scalars_on_host," \
            "reuse_dead_operands,plan_buffers"
        assert [p.stem for p in gpt_dump.passes] == ["000_capture", "001_cleanup", "002_attention_masks_as_flags",
                                                     "003_cleanup", "004_wait_for_reductions_first",
                                                     "005_scalars_on_host", "006_reuse_dead_operands",
                                                     "007_plan_buffers"]
        for p in gpt_dump.passes:
            for suffix in (".py", ".json", ".dot"):
                assert os.path.getsize(p.path(suffix)) > 0, p.path(suffix)

    def test_last_pass_dump_runs_standalone_and_gives_the_first_step_loss(self, gpt_run, gpt_dump):
        done = subprocess.run([sys.executable, gpt_dump.last.path(".py")], capture_output=True, text=True,
                              timeout=120, cwd=gpt_run.directory, check=True)
        loss = float(re.search(r"^loss (\S+)$", done.stdout, re.M).group(1))
        assert len(gpt_run.losses) == 2
        assert loss == pytest.approx(gpt_run.losses[0], abs=1e-6)
        assert loss != pytest.approx(gpt_run.losses[1], abs=1e-6)   # the inputs are the first step's

    def test_json_holds_every_node_of_the_graph(self, gpt_run, gpt_dump):
        comp = gpt_run.step.last
        for p, graph in ((gpt_dump.passes[0], comp.captured), (gpt_dump.last, comp.graph)):
            assert [n["name"] for n in p.nodes] == [n.name for n in graph.graph.nodes]
            assert len(p.nodes) == graph.num_nodes() == p.record["nodes_after"]
        assert gpt_dump.last.memory["peak_bytes"] == comp.memory.peak_bytes
        assert gpt_dump.last.data["flops"] == comp.cost.total_flops

    def test_diff_is_empty_exactly_when_the_pass_changed_nothing(self, gpt_dump):
        first, second = gpt_dump.passes[1], gpt_dump.passes[2]
        assert first.record["changed"] and not second.record["changed"]
        first_diff = open(first.path(".diff")).read()
        assert first_diff.startswith("--- 000_capture.py\n+++ 001_cleanup.py\n")
        removed = [line for line in first_diff.splitlines() if line.startswith("-  ")]
        assert len(removed) >= first.record["nodes_before"] - first.record["nodes_after"]
        assert open(second.path(".diff")).read() == ""
        assert not os.path.exists(gpt_dump.passes[0].path(".diff"))

    def test_dot_has_every_node_and_edge(self, gpt_dump):
        p = gpt_dump.last
        dot = open(p.path(".dot")).read()
        assert dot == to_dot(p)
        node_lines = [line for line in dot.splitlines() if "[label=" in line]
        assert len(node_lines) == len(p.nodes)
        edges = sum(len(n["users"]) for n in p.nodes)
        assert dot.count(" -> ") == edges

    @pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
    def test_svg_rendered_for_small_graphs(self, tmp_path):
        directory = str(tmp_path / "mlp")
        run_target("mlp", directory, capture_only=True)
        for p in DumpDir(directory).passes:
            assert open(p.path(".svg")).read().lstrip().startswith(("<?xml", "<svg", "<!DOCTYPE"))

    def test_index_html_is_one_standalone_page(self, gpt_dump):
        page = open(os.path.join(gpt_dump.directory, "index.html")).read()
        assert page.count('<tr class="pass') == len(gpt_dump.passes)
        assert '<svg id="memory-plot"' in page and "<polyline" in page
        assert not re.search(r"<(link|img|iframe)\b|\bsrc=", page)
        assert set(re.findall(r"https?://[^\s\"')]+", page)) <= {"http://www.w3.org/2000/svg"}
        diff = json.loads(re.search(r'id="diff-001_cleanup">(.*?)</script>', page).group(1))
        assert diff["text"] == open(gpt_dump.passes[1].path(".diff")).read().rstrip("\n")


class TestCommands:
    def test_show_prints_the_last_pass_by_default(self, gpt_dump, capsys):
        out = _stdout(capsys, ["show", gpt_dump.directory]).splitlines()
        assert out[0].startswith(f"# {gpt_dump.last.stem} ")
        assert len(out) == 1 + len(gpt_dump.last.nodes)
        assert any(re.match(r"addmm\w* = aten\.addmm\(.*\)  # f32\[", line) for line in out)

    def test_show_one_module_by_path_prefix(self, gpt_dump, capsys):
        out = _stdout(capsys, ["show", gpt_dump.directory, "--pass", "0", "--module", "layers.1"]).splitlines()
        assert out[0].startswith("# 000_capture (capture): module layers.1:")
        header = [line for line in out if line.startswith("# ")]
        assert len(header) == 3
        expected = [n for n in gpt_dump.passes[0].nodes if in_module(n["module_path"], "layers.1")]
        assert len(out) - len(header) == len(expected) > 0
        assert all(re.search(r" layers\.1(\.\S+)?$", line) for line in out[len(header):])
        assert in_module("layers.1.attn", "layers.1") and not in_module("layers.10", "layers.1")

    def test_show_module_figures_are_the_sum_over_its_nodes_not_the_whole_graph(self, gpt_dump, capsys):
        p = gpt_dump.last
        out = _stdout(capsys, ["show", gpt_dump.directory, "--module", "layers.1"]).splitlines()
        module_line, whole_line = out[1], out[2]
        assert module_line.startswith("# module layers.1 with its submodules: ")
        assert whole_line.startswith("# whole graph, not the module's")
        nodes = [n for n in p.nodes if in_module(n["module_path"], "layers.1")]
        by_name = {n["name"]: n for n in p.nodes}
        flops = sum(n["cost"]["flops"] for n in nodes)
        moved = sum(n["cost"]["bytes"] for n in nodes)
        names = {n["name"] for n in nodes}
        saved = sum(value_bytes(by_name[v]["value"]) for v in p.memory["saved_values"] if v in names)
        assert 0 < flops < p.data["flops"] and 0 < saved < p.memory["saved_bytes"]
        assert f" {flops:,} FLOPs (" in module_line and f" {moved:,} B read+written" in module_line
        assert f" {saved:,} B saved for backward" in module_line
        assert f"peak {p.memory['peak_bytes']:,} B" in whole_line and f"{p.data['flops']:,} FLOPs" in whole_line
        assert "peak" not in module_line and f"{p.data['flops']:,}" not in module_line
        # The per-node figures add up to the whole graph's, so a module's share is on the same footing.
        assert sum(n["cost"]["flops"] for n in p.nodes) == p.data["flops"]
        assert sum(value_bytes(by_name[v]["value"]) for v in p.memory["saved_values"]) == p.memory["saved_bytes"]

    def test_show_names_the_paths_there_are_when_a_module_is_unknown(self, gpt_dump, capsys):
        assert main(["show", gpt_dump.directory, "--module", "layers.7"]) == 2
        assert "no node of module 'layers.7'" in capsys.readouterr().err

    def test_diff_compares_two_runs_pass_by_pass(self, gpt_dump, tmp_path, capsys):
        # The same model with no pass at all: its dump is the capture alone.
        bare = tmp_path / "bare"
        bare.mkdir()
        for name in ("000_capture.py", "000_capture.json", "pipeline.txt"):
            shutil.copy(os.path.join(gpt_dump.directory, name), bare / name)
        records = json.load(open(os.path.join(gpt_dump.directory, "passes.json")))
        (bare / "passes.json").write_text(json.dumps(records[:1]))
        out = _stdout(capsys, ["diff", gpt_dump.directory, str(bare)])
        table = out.split("\n\n")[1].splitlines()
        assert table[0].split()[:2] == ["pass", "(A"]
        assert [row.split()[0] for row in table[2:]] == ["capture", "cleanup", "attention_masks_as_flags",
                                                         "cleanup", "wait_for_reductions_first",
                                                         "scalars_on_host", "reuse_dead_operands", "plan_buffers"]
        assert table[3].split()[1:4] == ["|", "-", str(records[1]["nodes_after"])]
        # Op counts of the final graphs differ by what the cleanup removed.
        removed = records[1]["ops_removed"]
        for op, n in removed.items():
            short = op[:-len(".default")] if op.endswith(".default") else op
            row = next(line for line in out.splitlines() if line.split()[:1] == [short])
            assert int(row.split()[3]) == n

    def test_report_turns_an_env_var_dump_into_a_page(self, tmp_path, monkeypatch, capsys):
        directory = tmp_path / "env"
        monkeypatch.setenv("CANN_PASSES_DUMP", str(directory))
        from recipes.models.mlp import MLP, mlp_loss
        torch.manual_seed(0)
        model = MLP((8, 16, 3))
        step = compile_for_npu(model, Plan(backend="eager"), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               loss_fn=mlp_loss)
        step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])))
        assert _stdout(capsys, ["report", str(directory), "--no-svg"]).strip().endswith("index.html")
        assert os.path.exists(directory / "001_cleanup.diff") and os.path.exists(directory / "index.html")

    def test_run_a_python_file_target(self, tmp_path, capsys):
        source = tmp_path / "my_model.py"
        source.write_text(
            "import torch\n"
            "from recipes.models.mlp import MLP, mlp_loss\n"
            "def make():\n"
            "    torch.manual_seed(0)\n"
            "    model = MLP((6, 12, 2))\n"
            "    return model, torch.optim.Adam(model.parameters(), lr=1e-2), mlp_loss, "
            "(torch.randn(5, 6), torch.tensor([0, 1, 1, 0, 1]))\n")
        out = _stdout(capsys, ["run", str(source), "--steps", "2", "--no-svg", "--pipeline", "cleanup",
                               "--out", str(tmp_path / "out")])
        assert re.search(r"^step 2: loss \d", out, re.M)
        assert [p.stem for p in DumpDir(str(tmp_path / "out")).passes] == [
            "000_capture", "001_cleanup", "002_wait_for_reductions_first", "003_scalars_on_host",
            "004_reuse_dead_operands", "005_plan_buffers"]

    def test_unknown_target_is_refused_with_the_recipes(self, tmp_path, capsys):
        assert main(["run", "resnet", "--out", str(tmp_path)]) == 2
        assert "unknown target 'resnet'" in capsys.readouterr().err

    def test_capture_only_on_a_meta_model(self, tmp_path):
        directory = str(tmp_path / "meta")
        result = run_target("gpt-7b-meta", directory, capture_only=True, svg=False,
                            overrides=["n_layer=2", "d_model=64", "n_head=2", "seq_len=32", "vocab_size=128"])
        dump = DumpDir(directory)
        assert result.losses == [] and not os.path.exists(os.path.join(directory, "inputs.pt"))
        assert dump.last.nodes[0]["value"]["shape"] == [128, 64]
        assert dump.last.memory["peak_bytes"] > 0
        assert os.path.exists(os.path.join(directory, "index.html"))


class TestPageParts:
    def _collective_nodes(self):
        mode = FakeTensorMode()
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        with mode:
            x.meta["val"] = torch.empty(1024, dtype=torch.float32)
        c10d = torch.ops._c10d_functional
        nodes = [x]
        for target, args, region, shape in (
                (c10d.all_reduce.default, (x, "sum", "0"), "backward", (1024,)),
                (c10d.all_gather_into_tensor.default, (x, 4, "0"), "forward", (4096,)),
                (c10d.all_reduce.default, (x, "sum", "0"), "backward", (1024,))):
            node = graph.call_function(target, args)
            wait = graph.call_function(c10d.wait_tensor.default, (node,))
            with mode:
                node.meta["val"] = torch.empty(shape)
                wait.meta["val"] = torch.empty(shape)
            node.meta["region"] = wait.meta["region"] = region
            nodes += [node, wait]
        return [node_json(n) for n in nodes]

    def test_collectives_count_bytes_per_kind_and_region(self):
        c = Collectives.of(self._collective_nodes())
        assert c.count == 3 and c.bytes == 2 * 4096 + 16384
        assert c.by_kind == {"all_reduce": [2, 8192], "all_gather": [1, 16384]}
        assert c.by_region == {"backward": [2, 8192], "forward": [1, 16384]}

    def test_collectives_section_and_empty_graph(self, tmp_path):
        p = PassDump(str(tmp_path), {"index": 3, "name": "data_parallel"})
        p.__dict__["data"] = {"nodes": self._collective_nodes()}
        section = collectives_section(p)
        assert "all_gather" in section and "24.0 KiB" in section
        empty = PassDump(str(tmp_path), {"index": 1, "name": "cleanup"})
        empty.__dict__["data"] = {"nodes": self._collective_nodes()[:1]}
        assert 'id="no-collectives"' in collectives_section(empty)

    def test_memory_plot_compares_around_recompute_when_it_ran(self, tmp_path):
        names = ["capture", "cleanup", "recompute", "cleanup"]
        (tmp_path / "passes.json").write_text(json.dumps([{"index": i, "name": n} for i, n in enumerate(names)]))
        before, after = DumpDir(str(tmp_path)).memory_pair()
        assert (before.stem, after.stem) == ("001_cleanup", "002_recompute")
        (tmp_path / "passes.json").write_text(json.dumps([{"index": i, "name": n} for i, n in enumerate(names[:2])]))
        before, after = DumpDir(str(tmp_path)).memory_pair()
        assert (before.stem, after.stem) == ("000_capture", "001_cleanup")

    def test_downsampled_timeline_keeps_the_peak(self):
        values = [i % 97 for i in range(50_000)]
        values[31_337] = 10_000
        points = _downsample(values, 400)
        assert len(points) <= 800 and (31_337, 10_000) in points
        assert min(v for _, v in points) == 0


def test_replay_reruns_a_reproducer(tmp_path, capsys):
    from cann_passes.dump import write_reproducer
    from graph_ir import capture_train_step
    from recipes.models.mlp import MLP, mlp_loss
    torch.manual_seed(0)
    model = MLP((6, 12, 2))
    graph, _ = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss,
                                  (torch.randn(5, 6), torch.tensor([0, 1, 1, 0, 1])))
    path = write_reproducer(str(tmp_path), graph, "cleanup", 1)
    out = _stdout(capsys, ["replay", path, "--out", str(tmp_path / "replayed")])
    assert re.match(rf"1 cleanup: (un)?changed, nodes {graph.num_nodes()} -> \d+", out)
    assert [p.stem for p in DumpDir(str(tmp_path / "replayed")).passes] == ["001_cleanup"]


def test_an_accumulation_dump_reports_each_graph_of_the_program_on_its_own_page(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("microbatches: 2\n")
    out = _stdout(capsys, ["run", "mlp", "--out", str(tmp_path), "--no-svg", "--set", "batch_size=8", "--plan",
                           str(plan), "--pipeline",
                           "cleanup,grad_accumulation{microbatches=2},split_grad_apply,apply(cleanup)"])
    assert "dumped to" in out
    dump = DumpDir(str(tmp_path))
    assert [os.path.basename(d) for d in dump.graph_directories()] == ["grad", "apply"]
    for name in ("grad", "apply"):
        sub = DumpDir(str(tmp_path / name))
        assert sub.passes[0].stem == "003_split_grad_apply" and (tmp_path / name / "index.html").exists()
    assert [p.stem for p in DumpDir(str(tmp_path / "apply")).passes] == [
        "003_split_grad_apply", "004_cleanup", "005_wait_for_reductions_first", "006_scalars_on_host",
        "007_reuse_dead_operands", "008_plan_buffers"]
    assert "graph apply: kind apply" in (tmp_path / "program.txt").read_text()
    page = (tmp_path / "index.html").read_text()
    assert 'href="grad/index.html"' in page and 'href="apply/index.html"' in page


# -- the GE lowering section (torchair's converters, offline) ------------------------------------

# ``torchair`` (tests/conftest.py) skips these where the torch_npu wheel cannot be had.

def _main_stdout(argv) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def ge_legal(torchair, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ge_legal"))
    stdout = _main_stdout(["run", "gpt-tiny", "--pipeline", "cleanup,npu_legalize,cleanup", "--ge", "--no-svg",
                           "--out", out])
    return out, stdout


@pytest.fixture(scope="module")
def ge_sdpa(torchair, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ge_sdpa"))
    stdout = _main_stdout(["run", "gpt-tiny", "--set", "attention=sdpa", "--pipeline", "cleanup", "--ge-as-dumped",
                           "--no-svg", "--out", out])
    return out, stdout


def _page_and_report(directory):
    page = open(os.path.join(directory, "index.html"), encoding="utf-8").read()
    report = json.load(open(os.path.join(directory, "ge", "report.json")))
    section = page[page.index('<section id="ge-section">'):].split("</section>")[0]
    return page, report, section


def _histogram_rows(section) -> list[tuple[str, int]]:
    table = re.search(r'<table class="small ge-ops">.*?<tbody>(.*?)</tbody>', section, re.S).group(1)
    return [(op, int(n)) for op, n in re.findall(r'<tr><td>([^<]+)</td><td class="num">(\d+)</td></tr>', table)]


class TestGeSection:
    def test_legalized_step_lowers_with_nothing_unsupported(self, ge_legal):
        directory, stdout = ge_legal
        page, report, section = _page_and_report(directory)
        last = DumpDir(directory).last
        assert report["ok"] and report["unsupported"] == []
        assert report["graphs"]["step"]["source"] == f"{last.stem}.json" == "007_plan_buffers.json"
        assert "GE lowering (offline, torchair converters): ok" in stdout
        assert "not a compile on an NPU" in section and "0 unsupported" in section
        assert "ge-unsupported" not in section and "Possibly stale" not in section
        # The page's histogram is the report's, most frequent first.
        rows = _histogram_rows(section)
        assert dict(rows) == report["op_histogram"]
        assert [n for _, n in rows] == sorted((n for _, n in rows), reverse=True)
        matmuls = {op: n for op, n in rows if op in ("MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2")}
        mm_nodes = sum(1 for n in last.nodes if n["target"] in ("aten.mm.default", "aten.addmm.default",
                                                                   "aten.bmm.default"))
        assert sum(matmuls.values()) == mm_nodes > 0
        ge_txt = os.path.join(directory, "ge", "step.ge.txt")
        assert '<a href="ge/step.ge.txt">' in section and os.path.getsize(ge_txt) > 0
        assert "GE lowering (offline): ok" in page.split("</header>")[0]

    def test_unsupported_ops_are_listed_with_their_module(self, ge_sdpa):
        directory, stdout = ge_sdpa
        page, report, section = _page_and_report(directory)
        nodes = {n["name"]: n for n in DumpDir(directory).last.nodes}
        bad = report["unsupported"]
        assert not report["ok"] and len(bad) >= 2          # forward and backward attention of each layer
        assert f"{len(bad)} unsupported" in stdout and f"GE lowering (offline): {len(bad)} unsupported" in page
        listed = re.findall(r'<a class="module-link" href="#module=([^"]+)" data-node="([^"]+)">', section)
        assert sorted(listed) == sorted((u["module_path"], u["node"]) for u in bad)
        attention = 0
        for path, name in listed:      # each links to the module its node belongs to in the final graph
            assert nodes[name]["module_path"] == path
            if "scaled_dot_product" in nodes[name]["target"]:
                attention += 1
                assert re.fullmatch(r"layers\.\d+\.attn", path)
            else:   # AdamW's lerp, which only npu_legalize rewrites: this pipeline is cleanup alone
                assert nodes[name]["target"] == "aten.lerp.Tensor"
        assert attention >= 2          # forward and backward attention
        assert "no torchair FX-&gt;GE converter registered" in section

    def test_stale_and_dropped_reports(self, ge_sdpa, tmp_path):
        directory = str(tmp_path / "copy")
        shutil.copytree(ge_sdpa[0], directory)
        last = DumpDir(directory).last.path(".json")
        os.utime(last, (os.path.getmtime(last) + 60,) * 2)     # the dump rewritten after the lowering
        _main_stdout(["report", directory, "--no-svg"])
        assert "Possibly stale" in _page_and_report(directory)[2]
        # A new run into the directory removes the old lowering with the old dumps.
        _main_stdout(["run", "mlp", "--pipeline", "cleanup", "--no-svg", "--out", directory])
        assert not os.path.exists(os.path.join(directory, "ge", "report.json"))
        assert not os.path.exists(os.path.join(directory, "ge", "step.ge.txt"))
        assert 'id="no-ge"' in open(os.path.join(directory, "index.html")).read()


def test_report_ge_on_another_backends_dump_lowers_what_torchair_would_compile(torchair, gpt_dump, tmp_path):
    # The eager pipeline has no npu_legalize: lowered as dumped, AdamW's lerp and friends would be
    # counted unsupported though the torchair backend rewrites them.
    directory = str(tmp_path / "copy")
    shutil.copytree(gpt_dump.directory, directory)
    assert "npu_legalize" not in DumpDir(directory).pipeline
    out = _main_stdout(["report", directory, "--ge", "--no-svg"])
    report = json.load(open(os.path.join(directory, "ge", "report.json")))
    assert report["legalized"] and report["ok"] and report["unsupported"] == [], report["unsupported"]
    assert "GE lowering (offline, torchair converters after npu_legalize (the dump's pipeline has none)): ok" in out
    assert all("has no npu_legalize: lowered after npu_legalize,cleanup" in g["notes"][0]
               for g in report["graphs"].values())
    as_dumped = _main_stdout(["report", directory, "--ge-as-dumped", "--no-svg"])
    assert "unsupported" in as_dumped.split("GE lowering")[1].splitlines()[0]


def test_ge_unavailable_is_a_note_not_a_failure(gpt_dump, tmp_path, monkeypatch):
    from cann_passes.lowering import ge_offline

    def unavailable(directory, **_options):
        raise ge_offline.TorchairUnavailable("could not download torch_npu==2.13.0 wheel\nmore detail")

    monkeypatch.setattr(ge_offline, "write_ge_report", unavailable)
    directory = str(tmp_path / "copy")
    shutil.copytree(gpt_dump.directory, directory)
    out = _main_stdout(["report", directory, "--ge", "--no-svg"])
    assert "cann-graph-dump: no GE lowering section: could not download torch_npu==2.13.0 wheel\n" in out
    assert out.strip().endswith("index.html")
    page = open(os.path.join(directory, "index.html")).read()
    assert 'id="no-ge"' in page and "GE lowering (offline):" not in page
