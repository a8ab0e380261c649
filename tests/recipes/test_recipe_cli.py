"""Every recipe command refuses bad input on one line with exit status 2, before any training, and
writes nothing."""
from __future__ import annotations

import pytest


def _mains():
    from recipes import train_gpt
    from recipes.align import RECIPE as ALIGN
    from recipes.bert.train import main as bert
    from recipes.clip import RECIPE as CLIP
    from recipes.clip.train import main as clip_main
    from recipes.finetune.__main__ import main as finetune
    from recipes.flamingo import RECIPE as FLAMINGO
    from recipes.llama.train import main as llama
    return {"train_gpt": train_gpt.main, "llama": llama, "bert": bert,
            "clip": lambda argv: clip_main(CLIP, argv), "align": lambda argv: clip_main(ALIGN, argv),
            "flamingo": lambda argv: clip_main(FLAMINGO, argv), "finetune": finetune}


BAD = [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--steps", "ten"], "argument --steps: must be a whole number, got 'ten'"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["--lr", "-1"], "argument --lr: must be a positive finite number, got -1"),
    (["--lr", "nan"], "argument --lr: must be a positive finite number, got nan"),
    (["--backend", "inductr"], "argument --backend: 'inductr': must be one of 'auto', 'eager', 'inductor', 'torchair'"),
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["--plan", "/nonexistent/plan.yaml"], "plan file '/nonexistent/plan.yaml': cannot be read"),
    (["--save-every", "0"], "argument --save-every: must be at least 1, got 0"),
    (["--eval-every", "x"], "argument --eval-every: must be a whole number, got 'x'"),
    (["--schedule-steps", "0"], "argument --schedule-steps: must be at least 1, got 0"),
    (["--log", "csv"], "argument --log: invalid choice: 'csv'"),
    (["--resume", "latest"], "--resume latest: no checkpoint under 'out/"),
    (["--resume", "/nonexistent/ckpt"], "--resume '/nonexistent/ckpt': not a checkpoint"),
]
RECIPES = ["train_gpt", "llama", "bert", "clip", "align", "flamingo", "finetune"]
# finetune's defaults are its config's (recipes/finetune/configs/lora.yaml)
DEFAULT_OUT = {recipe: f"out/{recipe}" for recipe in RECIPES} | {"finetune": "out/finetune/llama-tiny-lora"}


def _refused(recipe, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)       # anything a refused command wrote would land here
    with pytest.raises(SystemExit) as info:
        _mains()[recipe](argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert list(tmp_path.iterdir()) == []
    return err


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_flag_is_one_line_and_exit_status_2(recipe, argv, message, capsys, tmp_path, monkeypatch):
    err = _refused(recipe, argv, capsys, tmp_path, monkeypatch)
    # argparse prints its usage above its one error line; a refusal of ours is the one line alone
    assert err[-1].endswith(message) or message in err[-1], err
    assert err[-1].startswith(f"python -m recipes.{recipe}: error: "), err
    assert all(line.startswith(("usage:", " ")) for line in err[:-1]), err


@pytest.mark.parametrize("recipe, flag", [(r, "--out") for r in RECIPES] + [("clip", "--figure")])
def test_an_unwritable_output_is_refused_before_training(recipe, flag, capsys, tmp_path, monkeypatch):
    target = "/dev/null/x" if flag == "--out" else "/dev/null/x/loss.png"
    err = _refused(recipe, [flag, target, "--steps", "1"], capsys, tmp_path, monkeypatch)
    assert err == [f"python -m recipes.{recipe}: error: {flag} '/dev/null/x': '/dev/null' is not a directory"]


def test_a_multi_rank_plan_without_torchrun_says_how_to_launch_it(capsys, tmp_path, monkeypatch):
    from pathlib import Path
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = str(Path(__file__).resolve().parents[2] / "recipes" / "plans" / "gpt_dp2_zero1.yaml")
    err = _refused("train_gpt", ["--plan", plan], capsys, tmp_path, monkeypatch)
    assert len(err) == 1 and "runs on 2 ranks (dp=2, tp=1, pp=1); launch it with `.venv/bin/torchrun " \
        "--standalone --nproc-per-node 2 -m recipes.train_gpt" in err[0], err


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_shows_every_default(recipe, capsys):
    with pytest.raises(SystemExit) as info:
        _mains()[recipe](["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--steps", "--batch-size", "--lr", "--seed", "--threads", "--plan", "--out", "--resume",
                 "--save-every", "--eval-every", "--log", "--schedule-steps"):
        assert flag in out
    assert f"(default: {DEFAULT_OUT[recipe]})" in out and "(default: jsonl)" in out
    assert out.count("(default:") >= 12, out


FINETUNE_BAD = [
    (["--config", "/nonexistent/lora.yaml"], "--config '/nonexistent/lora.yaml': cannot be read"),
    (["--config", "{dir}/bad.yaml"], "finetune config field 'lora_r' = 0: must be an integer >= 1"),
    (["--config", "{dir}/dp2.yaml"], "plans 2 ranks (dp=2, tp=1, pp=1); launch it with `.venv/bin/torchrun"),
    (["--method", "qlora"], "argument --method: invalid choice: 'qlora'"),
]


@pytest.mark.parametrize("argv, message", FINETUNE_BAD, ids=[" ".join(a) for a, _ in FINETUNE_BAD])
def test_a_bad_finetune_config_is_one_line_and_exit_status_2(argv, message, capsys, tmp_path, monkeypatch):
    configs = tmp_path.parent / f"{tmp_path.name}-configs"      # outside the directory that must stay empty
    configs.mkdir()
    (configs / "bad.yaml").write_text("method: lora\nlora_r: 0\n")
    (configs / "dp2.yaml").write_text("method: lora\nplan: {backend: eager, dp: 2}\n")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _refused("finetune", [a.format(dir=configs) for a in argv], capsys, tmp_path, monkeypatch)
    assert message in err[-1] and err[-1].startswith("python -m recipes.finetune: error: "), err
    assert all(line.startswith(("usage:", " ")) for line in err[:-1]), err
