"""pp = 4 on gloo for GPipe, interleaved 1F1B (v = 2) and DualPipeV, and ``dynamic`` at pp = 2.

Complements ``test_pp_gloo`` (pp = 2 for every schedule, pp = 4 for 1F1B and ZB1P): the same
check against plain eager PyTorch trained on the same global batches from the same weights (SGD
with momentum: every parameter to 1e-5; AdamW: the losses to 1e-5; 10 steps), on the 4-layer
GPT and the heavy-head one (vocab 2048: its last stage holds most of the work), with 4 ranks of
one intra-op thread each launched once for all plans; and GPT2LMHeadModel with its embedding tied
across the first and the last of four stages, in fp16 with loss scaling (against the same plan
compiled at pp = 1, ``test_pp_gloo._check_fp16``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cann_passes import schedules as S
from cann_passes.runtime.distributed import launch_local, rank_failures
from cann_passes.schedules import timeline_from_events
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
import pp_worker  # noqa: E402
from test_pp_gloo import FP16, _check, _check_fp16  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).parent / "pp4_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]

# every schedule with SGD and with AdamW, on both models; the last: GPT2LMHeadModel, its embedding tied
# to the head across stages 0 and 3 (summed over a group of just those two pipeline ranks; stages 1
# and 2 do not hold it), trained in fp16 with loss scaling (the overflow flag combined over all four)
TIED_FP16 = f"gpt2/1f1b:sgd:{FP16}"
PP4 = ["gpipe:sgd", "interleaved_1f1b:sgd:2", "dualpipev:adamw",
       "heavy_head/gpipe:adamw", "heavy_head/interleaved_1f1b:adamw:2", "heavy_head/dualpipev:sgd", TIED_FP16]


def _launch(tmp_path_factory, name: str, pp: int, configs: list[str]):
    out = tmp_path_factory.mktemp(name)
    results = launch_local([WORKER, str(out), "gpt4", str(pp), *configs], pp,
                           env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout_s=900, cwd=str(REPO), preload=PRELOAD)
    report = rank_failures(results)
    assert not report, report
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(pp)]


def test_pp4_gpipe_interleaved_and_dualpipev_match_single_process_training(tmp_path_factory, subtests):
    ranks = _launch(tmp_path_factory, "pp4", 4, PP4)
    for config in PP4:
        with subtests.test(config=config):
            if config == TIED_FP16:
                _check_fp16(ranks, config, pp=4)
                assert ranks[0][config]["shared"] == {"transformer.wte.weight": [0, 3]}
                assert [list(r[config]["subgroups"].values()) for r in ranks] == [[[0, 3]]] * 4
                assert torch.equal(ranks[0][config]["params"]["transformer.wte.weight"],
                                   ranks[3][config]["params"]["transformer.wte.weight"])
                assert "transformer.wte.weight" not in ranks[1][config]["params"]
            else:
                _check(ranks, config, "gpt4")
            schedule, _, *options = pp_worker.parse_config(config, "gpt4")[1].split(":")
            v = S.stages_per_rank(schedule, int(options[0]) if options and options[0].isdigit() else 1)
            assert ranks[0][config]["stages"] == 4 * v
            # every stage ran every microbatch's forward once and its backward once (whole, or as its
            # input and weight halves: DualPipeV mixes both), each on the rank torch's placement gives it
            events = timeline_from_events([e for r in ranks for e in r[config]["events"]]).events
            m = pp_worker.microbatches_for(schedule, 4)
            owner = S.stage_to_rank(schedule, 4, v)
            ran = {}
            for e in events:
                ran.setdefault((e.stage, e.microbatch), []).append(e.kind)
            assert set(ran) == {(s, i) for s in range(4 * v) for i in range(m)}, config
            for key, kinds in ran.items():
                assert sorted(kinds) in (["B", "F"], ["F", "I", "W"]), (config, key, kinds)
            assert all(e.rank == owner[e.stage] for e in events)


def test_pp2_dynamic_runs_its_choice_and_matches_single_process_training(tmp_path_factory, subtests):
    configs = ["dynamic:sgd", "dynamic:adamw"]
    ranks = _launch(tmp_path_factory, "dynamic", 2, configs)
    for config in configs:
        with subtests.test(config=config):
            _check(ranks, config, "gpt4")
            result = ranks[0][config]
            choice = result["dynamic"]
            assert choice is not None and result["schedule"] == choice["schedule"] != "dynamic"
            ran = [c for c in choice["candidates"] if c["makespan_s"] is not None and c["verdict"]
                   and not c["verdict"].startswith("refused")]
            assert min(ran, key=lambda c: c["makespan_s"])["schedule"] == choice["schedule"]
            # the ranks ran the chosen schedule: its stage count and, split backward or not, its kinds
            assert result["stages"] == 2 * choice["virtual_stages"]
            kinds = {e[3] for r in ranks for e in r[config]["events"]}
            assert ("I" in kinds) == (choice["schedule"] in S.SPLIT_BACKWARD)
