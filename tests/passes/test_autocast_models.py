"""autocast on models users bring: transformers models from configs, against eager torch.autocast.

One tiny model per behaviour: SDPA forward and backward (LLaMA: GQA, RoPE, padded mask),
fp16 with loss scaling and tied embeddings (GPT-2), the recipe GPT's own SDPA variant, and a
non-promoting op fed two dtypes (CLIP's pooled-token gather, ``index_put`` in backward).
"""
from __future__ import annotations

import copy

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.precision_policy import op_packet_name
from graph_ir.meta import Region, region_of
from tests.zoo import build, compare

TOLERANCE = 2e-2   # bf16/fp16 loss vs eager torch.autocast, at every step
_SDPA_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _plan(precision: str) -> Plan:
    return Plan(backend="eager", precision=precision, verify="deep")


def _assert_tracks(run, tolerance=TOLERANCE):
    for i, (ours, ref) in enumerate(zip(run.compiled_losses, run.eager_losses, strict=True)):
        assert abs(ours - ref) <= tolerance * abs(ref), f"step {i}: {ours} vs eager autocast {ref}"


def _final_graph(step):
    return next(iter(step.last.graphs.values())) if hasattr(step.last, "graphs") else step.last.graph


@pytest.fixture(scope="module")
def llama_bf16():
    return compare("llama", _plan("bf16"), steps=3, autocast=torch.bfloat16)


class TestSdpaModels:
    def test_llama_bf16_tracks_eager_autocast_at_every_step(self, llama_bf16):
        _assert_tracks(llama_bf16)
        assert all(p.dtype == torch.float32 for p in llama_bf16.compiled_params.values())

    def test_optimizer_state_stays_fp32(self, llama_bf16):
        for state in llama_bf16.compiled_optimizer.state.values():
            assert state["exp_avg"].dtype == torch.float32

    def test_attention_backward_reads_low_precision_qkv_and_fp32_logsumexp(self, llama_bf16):
        graph = llama_bf16.step.last.graph
        backward = [n for n in graph.graph.nodes if op_packet_name(n.target) == _SDPA_BACKWARD]
        assert backward, "the LLaMA step should hold SDPA's backward"
        for node in backward:
            grad_out, q, k, v, out, logsumexp = node.args[:6]
            assert {a.meta["val"].dtype for a in (grad_out, q, k, v, out)} == {torch.bfloat16}
            assert logsumexp.meta["val"].dtype == torch.float32, node.format_node()

    def test_recipe_gpt_with_sdpa_attention_runs_bf16(self):
        _assert_tracks(compare("gpt", _plan("bf16"), steps=3, autocast=torch.bfloat16, attention="sdpa"))


class TestBackwardFollowsForward:
    def test_bias_gradient_of_a_low_precision_linear_is_summed_in_low_precision(self):
        # Eager autocast runs a bf16 linear's whole backward formula on bf16 tensors.
        entry = build("gpt2")
        step = compile_for_npu(entry.model, _plan("bf16"), optimizer=torch.optim.SGD(entry.model.parameters(), lr=0.1),
                               loss_fn=entry.loss_fn)
        step(entry.make_batch(0))
        graph = step.last.graph
        sums = [n for n in graph.graph.nodes if region_of(n) == Region.BACKWARD
                and op_packet_name(n.target) == "sum" and "c_fc" in n.meta.get("module_path", "")]
        assert sums and all(n.meta["val"].dtype == torch.bfloat16 for n in sums)

    def test_fp16_gpt2_with_loss_scaling_skips_the_steps_eager_grad_scaler_skips(self):
        # At this initial scale eager GradScaler skips steps 0-2 (fp16 gradients overflow in the
        # backward of the fp16 linears) and applies step 3: the compiled step must agree.
        init = 2.0 ** 20
        entry = build("gpt2")
        model, ref = entry.model, copy.deepcopy(entry.model)
        step = compile_for_npu(model, _plan("fp16").replace(loss_scale_init=init),
                               optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=entry.loss_fn)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=init)
        scales = []
        for i in range(4):
            batch = entry.make_batch(1000 + i)
            ours = float(step(batch))
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = entry.loss_fn(ref, batch)
            used = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(ref_opt)
            scaler.update()
            skipped = scaler.get_scale() < used
            assert abs(ours - loss.item()) <= TOLERANCE * abs(loss.item()), f"step {i}"
            assert float(step.metrics["loss_scale:scale"]) == used, f"step {i}"
            assert bool(step.metrics["loss_scale:found_inf"]) == skipped, f"step {i}"
            scales.append(scaler.get_scale())
        assert scales[0] < init and scales[-1] == scales[-2], "the reference should skip, then apply"
        for name, p in ref.named_parameters():
            assert (p - dict(model.named_parameters())[name]).abs().max() < 1e-2, name
        # Tied embeddings: one parameter, still fp32 and still shared.
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.dtype == torch.float32


def test_clip_non_promoting_ops_get_one_dtype():
    # The pooled-token gather's backward is index_put(fp32 zeros, ..., bf16 grad): its CPU
    # kernel refuses two dtypes (its meta kernel does not), so autocast promotes it.
    run = compare("clip", _plan("bf16"), steps=2, autocast=torch.bfloat16, layers=1)
    _assert_tracks(run)
    graph = run.step.last.graph
    for node in graph.graph.nodes:
        if op_packet_name(node.target) == "index_put":
            dtypes = {a.meta["val"].dtype for a in node.all_input_nodes
                      if a.meta["val"].is_floating_point()}
            assert len(dtypes) == 1, node.format_node()
