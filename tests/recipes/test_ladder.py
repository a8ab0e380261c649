"""The optimization ladder: every rung measured here and estimated at full size, in the right direction,
with its report; the adapter registry; the full-size depth extrapolation against a direct capture."""
from __future__ import annotations

import json

import pytest
import torch

from recipes import ladder
from recipes.llama.ladder import family as llama_family

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def captures():
    """The tiny family's full-size captures, shared by the report and the extrapolation check."""
    return {}


@pytest.fixture(scope="module")
def report(tmp_path_factory, captures):
    out = tmp_path_factory.mktemp("ladder")
    data = ladder.run_ladder(llama_family(tiny=True), steps=4, dp=8, gloo=False, log=lambda *_: None,
                             captures=captures)
    paths = ladder.write_report(data, out)
    return data, paths


def _rung(data, key):
    return next(r for r in data["rungs"] if r["key"] == key)


def test_every_rung_has_measured_or_declared_and_estimated_figures(report):
    data, _ = report
    assert [r["key"] for r in data["rungs"]] == ["fp32", "bf16", "recompute", "zero", "accumulation"]
    for r in data["rungs"]:
        assert r["estimated"], r.get("estimated_error")
        assert r["estimated"]["peak_bytes"] > 0 and r["estimated"]["step_seconds"] > 0
        if r["plan"].get("dp", 1) > 1:
            assert r["measured"] is None and "--no-gloo" in r["measured_error"]
        else:
            m = r["measured"]
            assert m["step_seconds"] > 0 and m["peak_bytes"] > 0 and len(m["losses"]) == 4


def test_measured_peak_agrees_with_the_memory_analysis_of_the_same_graph(report):
    data, _ = report
    for key in ("fp32", "bf16", "recompute"):
        m = _rung(data, key)["measured"]
        assert abs(m["peak_bytes"] - m["graph_peak_bytes"]) <= 0.25 * m["graph_peak_bytes"], (key, m)


def test_each_technique_moves_its_estimate_the_right_way(report):
    data, _ = report
    state = {r["key"]: (r["estimated"]["state_bytes"].get("step") or r["estimated"]["state_bytes"]["grad"])
             for r in data["rungs"]}
    assert state["bf16"]["activations"] < state["fp32"]["activations"]
    assert state["recompute"]["activations"] < state["bf16"]["activations"]
    zero = _rung(data, "zero")["estimated"]
    assert zero["dp"] == 8
    opt_fp32 = state["fp32"]["optimizer_state"]
    assert state["zero"]["optimizer_state"] == pytest.approx(opt_fp32 / 8, rel=0.05)
    assert zero["peak_bytes"] < _rung(data, "recompute")["estimated"]["peak_bytes"]
    assert state["accumulation"]["activations"] < state["zero"]["activations"]


def test_precision_is_reported_against_the_fp32_curve(report):
    data, _ = report
    assert _rung(data, "fp32")["measured"]["max_loss_deviation"] == 0.0
    bf16 = _rung(data, "bf16")["measured"]
    assert 0.0 < bf16["max_loss_deviation"] < 0.05


def test_report_files(report):
    data, paths = report
    text = paths["markdown"].read_text()
    for r in data["rungs"]:
        assert f"| {r['label']} |" in text
    assert "estimate only" in text and "ladder.png" in text
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["json"].read_text())["family"] == "llama"


def test_depth_extrapolation_matches_a_direct_capture(report, captures):
    fam = llama_family(tiny=True)
    fam.full_layers = 6
    fields = dict(ladder.rungs(fam, 8)[3][1])          # bf16 + recompute + ZeRO-1
    extrapolated = ladder.FullSizeEstimator(fam, dp=8, profile="ascend_910b", layers=None,
                                            captures=captures).estimate(fields)   # the report's 2 and 4 layers
    direct = ladder.FullSizeEstimator(fam, dp=8, profile="ascend_910b", layers=6, captures=captures).estimate(fields)
    assert extrapolated["peak_bytes"] == pytest.approx(direct["peak_bytes"], rel=0.02)
    assert extrapolated["step_seconds"] == pytest.approx(direct["step_seconds"], rel=0.02)


def test_families_are_found_by_name():
    assert {"gpt", "llama", "bert"} <= set(ladder.known_families())
    assert ladder.family("llama").full_layers == 32
    with pytest.raises(SystemExit, match="no family 'nope'"):
        ladder.family("nope")


def test_peak_tensor_memory_counts_live_storage():
    x = torch.randn(256, 256)                      # 256 KiB, resident
    with ladder.PeakTensorMemory().track([x]) as tracker:
        a = x @ x
        b = a @ a                                  # a and b live together
        del a
        c = b + 1                                  # b and c live together
        del b, c
    assert tracker.resident == x.untyped_storage().nbytes()
    assert tracker.peak == 2 * x.untyped_storage().nbytes()
