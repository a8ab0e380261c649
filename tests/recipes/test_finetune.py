"""Fine-tuning recipe: LoRA (peft) and full fine-tuning of transformers LLaMA through compile_for_npu."""
from __future__ import annotations

import collections
import copy
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import LlamaForCausalLM  # noqa: E402

from cann_passes import Plan, compile_for_npu  # noqa: E402
from recipes.data.instructions import (IGNORE_INDEX, PAD_ID, InstructionBatches, Pair, collate,  # noqa: E402
                                       corpus_pairs, load_pairs, split_pairs)
from recipes.finetune import (ConfigError, FinetuneConfig, ResponseLoss, prepare_model, save_finetuned,  # noqa: E402
                              step_state_bytes, tiny_llama_config, warmup_cosine)
from tests.eager_reference import eager_steps  # noqa: E402

SEQ = 80
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")



def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**TINY))


def lora_model(seed: int = 0):
    model = prepare_model(tiny_llama(seed), FinetuneConfig(method="lora", lora_r=4, lora_alpha=8.0,
                                                           lora_targets=TARGETS))
    # peft starts B at zero; a nonzero start makes A's first gradients nonzero as well.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def padded_batches(n: int, batch: int = 4):
    pairs = corpus_pairs()
    return list(InstructionBatches(pairs, batch, SEQ, seed=3, num_batches=n))


def adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.01)


@pytest.fixture(scope="module")
def lora_run():
    """10 steps of LoRA through compile_for_npu and the same 10 in eager peft, from the same weights."""
    model = lora_model()
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = padded_batches(10)
    step = compile_for_npu(model, Plan(backend="eager", verify="deep"), optimizer=adamw(model),
                           loss_fn=ResponseLoss("2d"))
    compiled_losses = [step(b).item() for b in batches]
    eager = eager_steps(reference, adamw(reference), ResponseLoss("2d"), batches).losses
    return dict(model=model, reference=reference, initial=initial, step=step, batches=batches,
                compiled=compiled_losses, eager=eager)


class TestLoraThroughCompileForNpu:
    def test_ten_steps_equal_eager_peft_training(self, lora_run):
        assert lora_run["compiled"] == pytest.approx(lora_run["eager"], abs=1e-5)
        ref = dict(lora_run["reference"].named_parameters())
        for name, p in lora_run["model"].named_parameters():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=name)
        assert lora_run["compiled"][-1] < lora_run["compiled"][0]

    def test_only_adapter_weights_change(self, lora_run):
        changed = {n for n, p in lora_run["model"].named_parameters()
                   if not torch.equal(p, lora_run["initial"][n])}
        adapters = {n for n, _ in lora_run["model"].named_parameters() if "lora_" in n}
        assert changed == adapters and len(adapters) == 2 * len(TARGETS) * 2   # A and B, 7 targets, 2 layers

    def test_merged_model_loads_in_plain_transformers_with_the_trained_logits(self, lora_run, tmp_path):
        model, batch = copy.deepcopy(lora_run["model"]), lora_run["batches"][0]
        model.eval()
        with torch.no_grad():
            trained = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        save_finetuned(model, tmp_path / "merged")
        reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
        assert not any("lora" in n for n in reloaded.state_dict())
        with torch.no_grad():
            logits = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(logits[real], trained[real], rtol=0, atol=1e-5)
        assert (tmp_path / "merged" / "adapter" / "adapter_config.json").exists()

    def test_lora_plan_holds_gradients_and_optimizer_state_of_adapters_only(self, lora_run):
        model, graph = lora_run["model"], lora_run["step"].last.graph
        adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        assert adapters and all("lora_" in n for n in adapters)
        state = step_state_bytes(lora_run["step"].last.program)
        adapter_bytes = sum(p.numel() * p.element_size() for p in adapters.values())
        assert state.trainable == sorted(adapters)
        assert state.trainable_param_bytes == adapter_bytes
        assert state.frozen_param_bytes == sum(p.numel() * p.element_size() for p in frozen.values())
        # One gradient buffer per adapter, of its shape; none of a frozen weight's shape.
        assert collections.Counter(state.gradient_shapes) == collections.Counter(
            tuple(p.shape) for p in adapters.values())
        assert state.gradient_bytes == adapter_bytes
        # AdamW: exp_avg and exp_avg_sq per adapter (plus its 0-dim step count), nothing else.
        assert {s.rpartition(":")[0] for s in state.optimizer_state} == set(adapters)
        steps_bytes = sum(lora_run["step"].optimizer.state[p]["step"].element_size() for p in adapters.values())
        assert state.optimizer_state_bytes == 2 * adapter_bytes + steps_bytes
        assert lora_run["step"].optimizer_state_bytes() == state.optimizer_state_bytes


def eager_training(model, batches, loss_fn=ResponseLoss("2d"), microbatches: int = 1, clip: float | None = None):
    """Plain peft/transformers training (tests/eager_reference.py) with the recipe's AdamW over the
    trainable weights: the reference for the compiled steps. A step's loss is the sum of its
    microbatches' (weighted) losses as Python floats; with ``clip``, also clip_grad_norm_'s norms."""
    run = eager_steps(model, adamw(model), loss_fn, batches, microbatches=microbatches, grad_clip=clip)
    losses = [sum(parts) for parts in run.microbatch_losses]
    return (losses, run.grad_norms) if clip is not None else losses


def test_a_causal_and_padding_mask_made_by_the_loss_trains_like_the_padding_mask():
    model = lora_model()
    reference = copy.deepcopy(model)
    batches = padded_batches(2)
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=adamw(model), loss_fn=ResponseLoss("4d"))
    assert [step(b).item() for b in batches] == pytest.approx(eager_training(reference, batches), abs=1e-5)


def test_lora_with_gradient_clipping_equals_eager_clip_grad_norm():
    model = lora_model()
    reference = copy.deepcopy(model)
    batches = padded_batches(3)
    step = compile_for_npu(model, Plan(backend="eager", grad_clip_norm=0.05, verify="deep"), optimizer=adamw(model),
                           loss_fn=ResponseLoss())
    losses, norms = [], []
    for b in batches:
        losses.append(step(b).item())
        norms.append(step.metrics["grad_clip:grad_norm"].item())
    eager_losses, eager_norms = eager_training(reference, batches, clip=0.05)
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    assert norms == pytest.approx(eager_norms, rel=1e-5) and min(norms) > 0.05   # the clip acted every step
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=name)


def test_lora_with_full_recompute_is_bitwise_the_step_without_it():
    model = lora_model()
    plain, reference = copy.deepcopy(model), copy.deepcopy(model)
    batches = padded_batches(2)
    step = compile_for_npu(model, Plan(backend="eager", recompute="full"), optimizer=adamw(model),
                           loss_fn=ResponseLoss())
    without = compile_for_npu(plain, Plan(backend="eager"), optimizer=adamw(plain), loss_fn=ResponseLoss())
    losses = [step(b).item() for b in batches]
    assert losses == [without(b).item() for b in batches]
    assert losses == pytest.approx(eager_training(reference, batches), abs=1e-5)
    other = dict(plain.named_parameters())
    assert all(torch.equal(p, other[n]) for n, p in model.named_parameters())
    record = next(r for r in step.records if r.name == "recompute")
    assert record.stats["saved_bytes_after"] < record.stats["saved_bytes_before"] / 2


def test_lora_with_gradient_accumulation_equals_eager_accumulation():
    model = lora_model()
    reference = copy.deepcopy(model)
    batches = padded_batches(2)
    step = compile_for_npu(model, Plan(backend="eager", microbatches=2), optimizer=adamw(model),
                           loss_fn=ResponseLoss("2d"))
    losses = [step(b).item() for b in batches]
    assert losses == pytest.approx(eager_training(reference, batches, microbatches=2), abs=1e-5)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=name)


def test_lora_in_bf16_with_recompute_tracks_fp32_and_keeps_fp32_adapters():
    model = lora_model()
    reference = copy.deepcopy(model)
    batches = padded_batches(3)
    plan = Plan(backend="eager", precision="bf16", recompute="budget", recompute_budget=0.25)
    step = compile_for_npu(model, plan, optimizer=adamw(model), loss_fn=ResponseLoss("2d"))
    losses = [step(b).item() for b in batches]
    assert losses == pytest.approx(eager_training(reference, batches), abs=3e-2)
    record = next(r for r in step.records if r.name == "recompute")
    assert record.stats["saved_bytes_after"] < record.stats["saved_bytes_before"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = step_state_bytes(step.last.program)
    assert state.gradient_bytes == state.trainable_param_bytes   # fp32 gradients of the adapters only


def test_full_fine_tuning_plan_holds_gradients_and_state_of_every_weight():
    model = prepare_model(tiny_llama(), FinetuneConfig(method="full"))
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=adamw(model), loss_fn=ResponseLoss("4d"))
    step(padded_batches(1)[0])
    state = step_state_bytes(step.last.program)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert state.frozen_param_bytes == 0 and state.trainable_param_bytes == total
    assert state.gradient_bytes == total


def test_freezing_by_pattern_trains_only_the_rest():
    model = prepare_model(tiny_llama(), FinetuneConfig(method="freeze", freeze=("model.embed_tokens.*",
                                                                                "model.layers.0.*")))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=adamw(model), loss_fn=ResponseLoss("4d"))
    step(padded_batches(1)[0])
    for name, p in model.named_parameters():
        frozen = name.startswith(("model.embed_tokens.", "model.layers.0."))
        assert torch.equal(p, before[name]) == frozen, name
    assert all(not s.startswith(("model.embed_tokens.", "model.layers.0."))
               for s in step_state_bytes(step.last.program).optimizer_state)


def test_recipe_trains_from_its_command_and_the_saved_directory_reloads(tmp_path):
    from recipes.finetune.__main__ import main
    from recipes.finetune.model import make_base_checkpoint

    base = make_base_checkpoint(tmp_path / "base", **TINY)
    config = tmp_path / "lora.yaml"
    config.write_text(json.dumps(dict(model_dir=str(base), out=str(tmp_path / "out"), method="lora",
                                      steps=16, warmup_steps=4, batch_size=4, seq_len=SEQ, lr=1e-2,
                                      eval_batches=2, plan={"backend": "eager", "grad_clip_norm": 1.0})))
    result = main(["--config", str(config)])
    assert sum(result.losses[-4:]) / 4 < result.losses[0] - 0.05
    assert result.val_loss_after < result.val_loss_before
    assert result.reloaded_val_loss == pytest.approx(result.val_loss_after, abs=1e-4)
    assert result.reload_max_logit_diff < 1e-4
    saved = json.loads((tmp_path / "out" / "model" / "finetune.json").read_text())
    assert saved["result"]["state"]["gradient_bytes"] == result.state.trainable_param_bytes
    # The schedule: linear warmup to the peak, then cosine down.
    assert result.lrs[3] == pytest.approx(1e-2) and result.lrs[0] == pytest.approx(2.5e-3)
    assert result.lrs[-1] < result.lrs[4]
    assert len(result.grad_norms) == 16 and all(n > 0 for n in result.grad_norms)   # the plan clips at 1.0


def test_data_parallel_and_zero_under_lora_communicate_and_shard_the_adapters_only():
    from cann_passes.compile import compile_program
    from graph_ir import capture_train_step
    from graph_ir.analysis.collectives import collectives
    from graph_ir.mesh import MeshDesc

    model = lora_model()
    captured, _ = capture_train_step(model, adamw(model), ResponseLoss(), padded_batches(1, batch=8)[0])
    program = compile_program(captured, Plan(dp=8, verify="deep"), MeshDesc.fake(dp=8))
    reduced = collectives(program.main.graph)
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert reduced and {c.kind for c in reduced} == {"all_reduce"}
    # A ring all-reduce moves twice its input; besides the adapters' gradients only the reported
    # loss (0-dim fp32) is averaged over the ranks.
    assert sum(c.bytes for c in reduced) == 2 * (adapter_bytes + 4)

    # ZeRO shards what the optimizer owns, the adapters; the frozen base stays whole on every rank.
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    n_adapters = sum(1 for p in model.parameters() if p.requires_grad)
    for stage in (1, 3):
        zero = compile_program(captured, Plan(dp=8, zero_stage=stage), MeshDesc.fake(dp=8))
        state = step_state_bytes(zero)
        assert state.frozen_param_bytes == frozen_bytes
        assert state.optimizer_state_bytes == 2 * adapter_bytes // 8 + 4 * n_adapters   # + 0-dim steps
        assert state.gradient_bytes == adapter_bytes // 8
        assert state.trainable_param_bytes == (adapter_bytes // 8 if stage == 3 else adapter_bytes)
        moved = collections.Counter()
        for c in collectives(zero.main.graph):
            moved[c.kind] += c.bytes
        assert moved["reduce_scatter"] == adapter_bytes


def test_the_7b_estimate_extrapolates_exactly_from_one_and_two_layers():
    from recipes.finetune.ladder import RUNGS, _affine, estimate_graph

    def small(layers):
        return tiny_llama_config(num_hidden_layers=layers, **TINY)
    # LoRA: every block is the same, so each quantity grows by the same amount per block. (A
    # recompute budget is solved over the whole graph, and its choices may shift with depth: there the
    # extrapolation is an approximation, which the ladder's --check measures.)
    rung = RUNGS[1]
    at1, at2, at3 = (estimate_graph(rung, n, 1, SEQ, 2, 4, model_config=small) for n in (1, 2, 3))
    predicted = _affine(at1, at2, 3)
    for key in ("peak_bytes", "trainable_param_bytes", "frozen_param_bytes", "gradient_bytes",
                "optimizer_state_bytes", "activation_bytes"):
        assert predicted[key] == at3[key], key
    assert predicted["seconds"] == pytest.approx(at3["seconds"], rel=1e-9)


def test_a_checkpoint_with_its_own_tokenizer_is_trained_and_saved_with_it(tmp_path):
    """Not bytes: a byte-level BPE tokenizer saved beside the checkpoint, as real checkpoints ship."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from recipes.finetune.__main__ import main
    from recipes.finetune.model import make_base_checkpoint

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    pairs = corpus_pairs()[:400]
    bpe.train_from_iterator([p.prompt + " " + p.response for p in pairs], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    base = make_base_checkpoint(tmp_path / "base", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **TINY)
    tokenizer.save_pretrained(base)
    out = tmp_path / "out"
    result = main(["--model", str(base), "--out", str(out), "--steps", "6", "--config", str(_tiny_config(tmp_path))])
    assert result.reload_max_logit_diff < 1e-4
    saved = AutoTokenizer.from_pretrained(out / "model")
    assert saved.encode("What does `json.dumps` do?") == tokenizer.encode("What does `json.dumps` do?")
    from recipes.finetune.model import PretrainedTokenizer
    batch = collate(pairs[:1], SEQ, PretrainedTokenizer(saved))
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert saved.decode(ids[1:-1]).startswith("### Instruction:\nWhat does `abc` do?")


def _finetune(argv):
    from recipes.finetune.__main__ import main
    return main(argv)


def _tensors(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


def test_a_resumed_run_repeats_the_uninterrupted_one_bitwise(tmp_path):
    """4 LoRA steps at once, and 2 steps (of a 4-step schedule) then --resume latest: the same losses,
    evaluations, logged records, adapters and merged weights, bit for bit."""
    from recipes.finetune.model import make_base_checkpoint

    base = make_base_checkpoint(tmp_path / "base", **TINY)
    config = _tiny_config(tmp_path, model_dir=str(base), steps=4, batch_size=2, seq_len=64)
    common = ["--config", str(config), "--save-every", "2", "--eval-every", "2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    want = _finetune([*common, "--out", str(whole)])
    _finetune([*common, "--steps", "2", "--schedule-steps", "4", "--out", str(parts)])
    got = _finetune([*common, "--resume", "latest", "--out", str(parts)])
    assert got.losses == want.losses and len(got.losses) == 4
    assert got.evals == want.evals and [e["step"] for e in got.evals] == [2, 4]
    assert got.val_loss_after == want.val_loss_after and got.lrs == want.lrs[2:]
    logged = [[{k: v for k, v in json.loads(line).items() if k not in ("seconds", "tokens_per_s", "mfu")}
               for line in (out / "metrics.jsonl").read_text().splitlines()] for out in (whole, parts)]
    assert logged[0] == logged[1] and [r["step"] for r in logged[1]] == [1, 2, 3, 4]
    assert all("grad_norm" in r for r in logged[1])          # the config clips: its norm is logged
    for file in ("adapter/adapter_model.safetensors", "model.safetensors"):
        a, b = _tensors(whole / "model" / file), _tensors(parts / "model" / file)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    assert {"config.yaml", "metrics.jsonl", "checkpoints", "loss.png", "metrics.json", "model"} <= {
        p.name for p in parts.iterdir()}
    import yaml
    written = yaml.safe_load((parts / "config.yaml").read_text())
    assert written["start_step"] == 2 and written["args"]["finetune"]["lora_r"] == 8


def _tiny_config(tmp_path, **fields):
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({**dict(method="lora", warmup_steps=2, batch_size=4, seq_len=SEQ, lr=1e-2,
                                         eval_batches=1, plan={"backend": "eager", "grad_clip_norm": 1.0}), **fields}))
    return config


def test_the_lora_family_joins_the_shared_optimization_ladder():
    from recipes import ladder

    fam = ladder.family("finetune")
    assert "finetune" in ladder.known_families() and fam.full_layers == 32
    small = fam.small_model()
    assert {n for n, p in small.named_parameters() if p.requires_grad} == {
        n for n, _ in small.named_parameters() if "lora_" in n}
    with torch.device("meta"):
        full = fam.full_model(1)
    assert full.base_model.model.config.hidden_size == 4096
    r, d, mlp = 16, 4096, 11008   # A (r x in) + B (out x r) on q/k/v/o (d -> d), gate/up (d -> mlp), down
    assert sum(p.numel() for p in full.parameters() if p.requires_grad) == r * (4 * 2 * d + 3 * (d + mlp))
    batch = fam.small_batches(1)[0]
    assert fam.loss_fn(small, batch).dim() == 0


class TestInstructionData:
    def test_labels_cover_only_the_response_and_padding_is_masked(self):
        batch = collate([Pair("What?", "Because."), Pair("Why not?", "It is.")], SEQ)
        for row in range(2):
            real = batch["attention_mask"][row].bool()
            labelled = batch["labels"][row] != IGNORE_INDEX
            assert bool((labelled & ~real).any()) is False
            assert (batch["input_ids"][row][~real] == PAD_ID).all()
            ids = batch["input_ids"][row][labelled].tolist()
            assert bytes(ids[:-1]).decode() in ("Because.", "It is.")   # + EOS

    def test_pairs_are_made_from_the_shipped_corpus_deterministically(self):
        pairs = corpus_pairs()
        assert len(pairs) > 1000 and pairs == corpus_pairs()
        assert Pair("Which module defines `abc.ABCMeta`?", "It is defined in the `abc` module.") in pairs
        train, val = split_pairs(pairs)
        assert not set(train) & set(val)

    def test_a_jsonl_file_replaces_the_shipped_pairs_and_bad_lines_are_named(self, tmp_path):
        good = tmp_path / "pairs.jsonl"
        good.write_text('{"prompt": "a", "response": "b"}\n')
        assert load_pairs(good) == [Pair("a", "b")]
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "a"}\n')
        with pytest.raises(ValueError, match=r"bad.jsonl:1: .*'prompt' and 'response'"):
            load_pairs(bad)


class TestConfig:
    def test_bad_values_name_the_field(self):
        with pytest.raises(ConfigError, match="'method'"):
            FinetuneConfig(method="qlora")
        with pytest.raises(ConfigError, match="'warmup_steps'"):
            FinetuneConfig(steps=10, warmup_steps=20)
        assert FinetuneConfig(steps=10, schedule_steps=40, warmup_steps=20).schedule_length == 40
        with pytest.raises(ConfigError, match="'lr_schedule' .*not a finetune config field"):
            FinetuneConfig.from_dict({"lr_schedule": "cosine"})

    def test_patterns_that_match_nothing_or_everything_are_refused(self):
        with pytest.raises(ConfigError, match="'freeze'.*matches no parameter"):
            prepare_model(tiny_llama(), FinetuneConfig(method="freeze", freeze=("encoder.*",)))
        with pytest.raises(ConfigError, match="freeze every parameter"):
            prepare_model(tiny_llama(), FinetuneConfig(method="freeze", freeze=("*",)))
        with pytest.raises(ConfigError, match="'lora_targets'"):
            prepare_model(tiny_llama(), FinetuneConfig(method="lora", lora_targets=("c_attn",)))
        with pytest.raises(ConfigError, match="'base_dtype'"):
            prepare_model(tiny_llama(), FinetuneConfig(method="full", base_dtype="bf16"))

    def test_warmup_then_cosine(self):
        f = warmup_cosine(4, 20, 0.1)
        assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
        assert f(20) == pytest.approx(0.1) and f(12) == pytest.approx(0.55)
