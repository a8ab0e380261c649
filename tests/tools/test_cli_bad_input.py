"""cann-plan, cann-lower-check and cann-graph-dump: bad input is one line and exit status 2, checked
before any search or compile, with nothing written."""
from __future__ import annotations

import pytest


def _run(main, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert [p.name for p in tmp_path.iterdir()] == []
    return err[-1]


@pytest.mark.parametrize("argv, message", [
    (["llama-tiny", "--out", "/dev/null/plan.yaml"], "--out '/dev/null/plan.yaml': '/dev/null' is not a directory"),
    (["llama-tiny", "--breakdown", "b.txt"], "--breakdown 'b.txt': the picture is written as .png, .svg or .pdf (got .txt)"),
    (["llama-tiny", "--breakdown", "/dev/null/b.png"], "--breakdown '/dev/null/b.png': '/dev/null' is not a directory"),
    (["llama-tiny", "--top", "0"], "--top 0: must be >= 1"),
], ids=["out", "breakdown-suffix", "breakdown-dir", "top"])
def test_cann_plan_checks_its_outputs_before_the_search(argv, message, capsys, tmp_path, monkeypatch):
    from tools.plan_cli import main
    assert _run(main, argv, capsys, tmp_path, monkeypatch) == f"cann-plan: error: {message}"


@pytest.mark.parametrize("target", ["/nonexistent", "./missing.pt"])
def test_cann_lower_check_names_a_missing_target(target, capsys, tmp_path, monkeypatch):
    from tools.lower_check import main
    line = _run(main, [target], capsys, tmp_path, monkeypatch)
    assert line == f"cann-lower-check: error: TARGET {target!r}: no such dump directory or file"


@pytest.mark.parametrize("item, message", [
    ("n_layer=three", "--set n_layer='three': GPTConfig.n_layer is an int"),
    ("dropout=high", "--set dropout='high': GPTConfig.dropout is a float"),
])
def test_cann_graph_dump_checks_the_type_of_a_set_value(item, message, capsys, tmp_path, monkeypatch):
    from tools.graph_dump.cli import main
    line = _run(main, ["run", "gpt", "--set", item, "--out", str(tmp_path / "d")], capsys, tmp_path, monkeypatch)
    assert line == f"cann-graph-dump: error: {message}"
