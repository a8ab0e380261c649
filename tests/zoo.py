"""The models users bring, at tiny sizes, with real batches; and an eager-vs-compiled runner.

Every model is built from a ``transformers`` config (nothing is downloaded) or, for
``gpt``, from the recipe (``recipes/models/gpt.py``). Sizes are tiny (hidden 32,
4 heads, vocab 96, 2 layers by default) so a whole step captures in about a second.

API::

    from tests.zoo import MODELS, build, compare

    entry = build("llama", layers=2, seed=0)   # a ZooModel
    entry.model                                 # nn.Module (train mode, dropout 0)
    entry.loss_fn(model, batch)                 # -> scalar loss tensor
    entry.make_batch(seed, pad=True)            # -> a real batch (dict or tuple of tensors)
    entry.has_attention_mask                    # the batch carries an attention_mask
    entry.block_prefixes                        # module paths of the repeated blocks

    run = compare("llama", Plan(backend="eager"), steps=3)
    run.eager_losses, run.compiled_losses       # list[float], one per step
    run.eager_params, run.compiled_params       # dict name -> tensor after the last step
    run.step                                    # the CompiledStep (graphs, records, metrics)
    run.max_param_diff()                        # largest |eager - compiled| over parameters

``MODELS`` lists the names: gpt (recipe GPT, explicit attention), gpt2
(GPT2LMHeadModel), llama (GQA: 4 query heads, 2 key/value heads), mistral, qwen2,
bert (BertForMaskedLM), t5 (T5ForConditionalGeneration), vit
(ViTForImageClassification), phi3 (Phi3ForCausalLM: fused, sliced qkv_proj and gate_up_proj), clip (CLIPModel, contrastive loss through
``return_loss=True``), and three mixtures of experts with transformers' default experts
implementation (a ``grouped_mm`` custom op with its registered backward) and the router's
load-balancing loss in the loss (``output_router_logits=True``): mixtral, qwen2_moe (with a
shared expert), olmoe; 4 experts, top-2. And opt (OPTForCausalLM), bloom (ALiBi), falcon
(parallel attention, multi-query), roberta (RobertaForMaskedLM), bart (encoder-decoder), swin
(shifted windows: a roll, window partitions, a gathered relative position bias), resnet
(convolutions with BatchNorm, whose running statistics the step updates) and whisper (log-mel
features through convolutions into an encoder-decoder).

Batches: token models get right padding on some rows (``attention_mask`` 0,
``labels`` -100 there); ``pad=False`` gives an all-ones mask. ``make_batch`` is
deterministic in ``seed`` and never touches the global RNG.

``compare`` builds the model once, deep-copies it for the eager reference, runs
``steps`` steps of plain ``torch.optim`` (fp16 autocast with ``torch.amp.GradScaler``, as
the plan scales fp16 losses by default; with the plan's ``microbatches`` N: N
row chunks accumulated, each loss weighted by its share of the rows; optionally under ``torch.autocast`` with
``autocast=torch.bfloat16``: master weights stay fp32, as the compiled plan
keeps them) and ``steps`` compiled steps of ``compile_for_npu`` on the same
batches (``make_batch(1000 + i)``). ``optimizer`` is a factory
``params_or_model -> Optimizer``; by default AdamW(lr=1e-3, weight_decay=0.01).
Pass ``param_groups=True`` to give the factory the model (to build its own
groups), else it gets ``model.parameters()``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tests.eager_reference import eager_steps as reference_steps

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN = 96, 32, 4, 2, 64
BATCH, SEQ = 4, 12
IMAGE, PATCH, CHANNELS, CLASSES = 16, 8, 3, 5
MELS, FRAMES = 8, 32
PAD_ID = 0

MODELS = ("gpt", "gpt2", "llama", "mistral", "qwen2", "bert", "t5", "vit", "clip",
          "mixtral", "qwen2_moe", "olmoe", "gpt_neox", "phi3", "gemma",
          "opt", "bloom", "falcon", "roberta", "bart", "swin", "resnet", "whisper")
EXPERTS, TOP_K = 4, 2


@dataclass
class ZooModel:
    name: str
    model: torch.nn.Module
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    make_batch: Callable[..., Any]
    has_attention_mask: bool
    block_prefixes: tuple[str, ...]
    layers: int


# -- batches --------------------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lengths(g: torch.Generator, pad: bool, rows: int = BATCH, seq: int = SEQ) -> list[int]:
    # Row 0 is always full length; with padding every other row is shorter.
    if not pad:
        return [seq] * rows
    return [seq] + [int(torch.randint(seq // 2, seq, (1,), generator=g)) for _ in range(rows - 1)]


def _tokens(g: torch.Generator, lengths: list[int], seq: int = SEQ):
    ids = torch.randint(1, VOCAB, (len(lengths), seq), generator=g)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    ids = ids.masked_fill(mask == 0, PAD_ID)
    return ids, mask


def causal_lm_batch(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (right padding), ``labels`` = ids with -100 on padding."""
    g = _gen(seed)
    ids, mask = _tokens(g, _lengths(g, pad))
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gpt_recipe_batch(seed: int, pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)`` for the recipe GPT (no mask input): targets -100 on padding."""
    g = _gen(seed)
    ids, mask = _tokens(g, _lengths(g, pad, seq=SEQ + 1), seq=SEQ + 1)
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return ids[:, :-1].contiguous(), targets.contiguous()


def mlm_batch(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """BERT masked LM: 25% of the real tokens replaced by [MASK] and predicted, the rest -100."""
    g = _gen(seed)
    ids, mask = _tokens(g, _lengths(g, pad))
    chosen = (torch.rand(ids.shape, generator=g) < 0.25) & (mask == 1)
    chosen[:, 0] = True  # at least one prediction per row
    labels = ids.masked_fill(~chosen, -100)
    return {"input_ids": ids.masked_fill(chosen, VOCAB - 1), "attention_mask": mask,
            "token_type_ids": torch.zeros_like(ids), "labels": labels}


def seq2seq_batch(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """T5: padded source with its mask, padded target as ``labels`` (-100 on padding)."""
    g = _gen(seed)
    ids, mask = _tokens(g, _lengths(g, pad))
    tgt, tgt_mask = _tokens(g, _lengths(g, pad, seq=SEQ // 2), seq=SEQ // 2)
    return {"input_ids": ids, "attention_mask": mask, "labels": tgt.masked_fill(tgt_mask == 0, -100)}


def mlm_batch_one_type(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """RoBERTa's masked LM batch: BERT's, without token types (RoBERTa has one)."""
    batch = mlm_batch(seed, pad)
    del batch["token_type_ids"]
    return batch


def audio_text_batch(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """Whisper: log-mel features ``[batch, mels, frames]`` and the transcript as ``labels``."""
    g = _gen(seed)
    tgt, tgt_mask = _tokens(g, _lengths(g, pad, seq=SEQ // 2), seq=SEQ // 2)
    return {"input_features": torch.randn(BATCH, MELS, FRAMES, generator=g),
            "labels": tgt.masked_fill(tgt_mask == 0, -100)}


def image_batch(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    return {"pixel_values": torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def image_text_batch(seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """CLIP: captions (padded, ending in the eos token) and images."""
    g = _gen(seed)
    lengths = _lengths(g, pad)
    ids, mask = _tokens(g, lengths)
    ids = ids.clamp(max=VOCAB - 3)
    for r, n in enumerate(lengths):
        ids[r, n - 1] = VOCAB - 2  # eos
    return {"input_ids": ids, "attention_mask": mask,
            "pixel_values": torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g)}


# -- losses ---------------------------------------------------------------------------------------

def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's own loss, as a user of ``transformers`` computes it."""
    return model(**batch).loss


def clip_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch, return_loss=True).loss


def gpt_recipe_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


# -- models ---------------------------------------------------------------------------------------

def _decoder_kwargs(layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _build_gpt(layers, **kw):
    from recipes.models.gpt import GPT, gpt_tiny
    cfg = gpt_tiny(vocab_size=VOCAB, n_layer=layers, n_head=HEADS, d_model=HIDDEN, seq_len=SEQ + 1, **kw)
    return GPT(cfg), gpt_recipe_loss, gpt_recipe_batch, False, ("layers",)


def _build_gpt2(layers, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                     n_inner=FFN, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, **kw)
    return GPT2LMHeadModel(cfg), hf_loss, causal_lm_batch, True, ("transformer.h",)


def _decoder(config_cls, model_cls, **defaults):
    def build(layers, **kw):
        import transformers
        cfg = getattr(transformers, config_cls)(**(_decoder_kwargs(layers) | defaults | kw))
        return getattr(transformers, model_cls)(cfg), hf_loss, causal_lm_batch, True, ("model.layers",)
    return build


def _build_gpt_neox(layers, **kw):
    # Parallel residual: attention and MLP read the same input and their outputs are summed, so
    # the two output biases receive one and the same gradient value.
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=64, rotary_pct=0.5,
                        use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0,
                        pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kw)
    return GPTNeoXForCausalLM(cfg), hf_loss, causal_lm_batch, True, ("gpt_neox.layers",)


def _build_bert(layers, **kw):
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                     intermediate_size=FFN, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=PAD_ID, **kw)
    return BertForMaskedLM(cfg), hf_loss, mlm_batch, True, ("bert.encoder.layer",)


def _build_t5(layers, **kw):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=layers,
                   num_decoder_layers=layers, num_heads=HEADS, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=PAD_ID,
                   decoder_start_token_id=PAD_ID, eos_token_id=2, **kw)
    return T5ForConditionalGeneration(cfg), hf_loss, seq2seq_batch, True, ("encoder.block", "decoder.block")


def _build_vit(layers, **kw):
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=HIDDEN,
                    num_hidden_layers=layers, num_attention_heads=HEADS, intermediate_size=FFN,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES, **kw)
    return ViTForImageClassification(cfg), hf_loss, image_batch, False, ("vit.layers",)


def _build_clip(layers, **kw):
    from transformers import CLIPConfig, CLIPModel
    common = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                  num_attention_heads=HEADS, dropout=0.0, attention_dropout=0.0)
    cfg = CLIPConfig(text_config=common | dict(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                               pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=VOCAB - 2),
                     vision_config=common | dict(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS),
                     projection_dim=HIDDEN, **kw)
    return (CLIPModel(cfg), clip_loss, image_text_batch, True,
            ("text_model.encoder.layers", "vision_model.encoder.layers"))


def _build_opt(layers, **kw):
    # OPT: learned positions offset by 2, pre-LayerNorm decoder, ReLU MLP
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, ffn_dim=FFN,
                    num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                    pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kw)
    return OPTForCausalLM(cfg), hf_loss, causal_lm_batch, True, ("model.decoder.layers",)


def _build_bloom(layers, **kw):
    # BLOOM: ALiBi position biases (no position embedding), fused query_key_value, embedding LayerNorm
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=layers, n_head=HEADS, hidden_dropout=0.0,
                      attention_dropout=0.0, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, **kw)
    return BloomForCausalLM(cfg), hf_loss, causal_lm_batch, True, ("transformer.h",)


def _build_falcon(layers, **kw):
    # Falcon-7B's shape: parallel attention and MLP from one LayerNorm, multi-query attention
    # (one kv head) in a fused query_key_value, rotary positions, no biases
    from transformers import FalconConfig, FalconForCausalLM
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                       multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
                       hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
                       pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kw)
    return FalconForCausalLM(cfg), hf_loss, causal_lm_batch, True, ("transformer.h",)


def _build_roberta(layers, **kw):
    # RoBERTa: BERT's encoder with positions counted from the padding index + 1
    from transformers import RobertaConfig, RobertaForMaskedLM
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=PAD_ID, type_vocab_size=1, **kw)
    return RobertaForMaskedLM(cfg), hf_loss, mlm_batch_one_type, True, ("roberta.encoder.layer",)


def _build_bart(layers, **kw):
    # BART: encoder-decoder with learned positions, the decoder fed the labels shifted right
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=layers, decoder_layers=layers,
                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                     decoder_ffn_dim=FFN, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=PAD_ID,
                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, **kw)
    return BartForConditionalGeneration(cfg), hf_loss, seq2seq_batch, True, ("model.encoder.layers",
                                                                             "model.decoder.layers")


# Swin and ResNet come with ``problem_type`` set, as their first forward would set it: each step
# then captures once (ViT's cells keep the recompile that the changed config triggers).
def _build_swin(layers, **kw):
    # Swin: shifted-window attention (a roll of the feature map, window partitions, a relative
    # position bias table gathered by index), patch merging between stages
    from transformers import SwinConfig, SwinForImageClassification
    # (the second block of the first stage is the shifted one; one block after the merge)
    cfg = SwinConfig(image_size=IMAGE, patch_size=2, num_channels=CHANNELS, embed_dim=16, depths=[layers, 1],
                     num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=CLASSES,
                     **({"problem_type": "single_label_classification"} | kw))
    return SwinForImageClassification(cfg), hf_loss, image_batch, False, ("swin.encoder.layers",)


def _build_resnet(layers, **kw):
    # ResNet: convolutions with BatchNorm, whose running statistics the step updates (buffers)
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(num_channels=CHANNELS, embedding_size=8, hidden_sizes=[8, 16], depths=[layers, layers],
                       layer_type="basic", num_labels=CLASSES, **({"problem_type": "single_label_classification"} | kw))
    return ResNetForImageClassification(cfg), hf_loss, image_batch, False, ("resnet.encoder.stages",)


def _build_whisper(layers, **kw):
    # Whisper: log-mel features through two convolutions into an encoder, a decoder over text
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=MELS, d_model=HIDDEN, encoder_layers=layers,
                        decoder_layers=layers, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                        encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_source_positions=FRAMES // 2,
                        max_target_positions=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                        begin_suppress_tokens=None, suppress_tokens=None, **kw)
    return WhisperForConditionalGeneration(cfg), hf_loss, audio_text_batch, False, ("model.encoder.layers",
                                                                                    "model.decoder.layers")


_BUILDERS = {
    "gpt": _build_gpt, "gpt2": _build_gpt2,
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM"),
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "mixtral": _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=EXPERTS,
                        num_experts_per_tok=TOP_K, output_router_logits=True),
    "qwen2_moe": _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, moe_intermediate_size=FFN // 2,
                          shared_expert_intermediate_size=FFN // 2, output_router_logits=True),
    "olmoe": _decoder("OlmoeConfig", "OlmoeForCausalLM", num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                      output_router_logits=True),
    "gpt_neox": _build_gpt_neox,
    # Phi-3-mini's shape: q, k and v fused in qkv_proj (as many kv heads as heads), gate and up in
    # gate_up_proj, each sliced apart in the forward
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=HEADS),
    # Gemma's shape: the embedding tied to the head and scaled by sqrt(hidden) in the forward,
    # GeGLU MLP, RMSNorm by (1 + weight), one kv head (multi-query)
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=HIDDEN // HEADS,
                      tie_word_embeddings=True),
    "bert": _build_bert, "t5": _build_t5, "vit": _build_vit, "clip": _build_clip,
    "opt": _build_opt, "bloom": _build_bloom, "falcon": _build_falcon, "roberta": _build_roberta,
    "bart": _build_bart, "swin": _build_swin, "resnet": _build_resnet, "whisper": _build_whisper,
}


def build(name: str, *, layers: int = 2, seed: int = 0, **config) -> ZooModel:
    """A fresh model ``name`` (see ``MODELS``) with weights from ``torch.manual_seed(seed)``.

    ``config`` overrides go to the config class (e.g. ``attn_implementation="eager"``
    for transformers models, ``attention="sdpa"`` for the recipe GPT).
    """
    if name not in _BUILDERS:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, loss_fn, make_batch, has_mask, blocks = _BUILDERS[name](layers, **config)
    model.train()
    return ZooModel(name, model, loss_fn, make_batch, has_mask, blocks, layers)


# -- eager vs compiled ----------------------------------------------------------------------------

def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@dataclass
class Comparison:
    name: str
    eager_losses: list[float]
    compiled_losses: list[float]
    eager_params: dict[str, torch.Tensor]
    compiled_params: dict[str, torch.Tensor]
    step: Any = field(repr=False)
    eager_optimizer: torch.optim.Optimizer = field(repr=False, default=None)
    compiled_optimizer: torch.optim.Optimizer = field(repr=False, default=None)

    def max_loss_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.eager_losses, self.compiled_losses, strict=True))

    def max_param_diff(self) -> float:
        return max((self.eager_params[n] - self.compiled_params[n]).abs().max().item()
                   for n in self.eager_params)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def eager_steps(model, loss_fn, optimizer, batches, autocast: torch.dtype | None = None,
                clip_norm: float | None = None, microbatches: int = 1) -> list[float]:
    """Plain PyTorch training (tests/eager_reference.py's ``eager_steps``): zero_grad, forward
    (optionally autocast), backward, [clip], step; the loss of every step.

    fp16 as users train it: GradScaler's dynamic loss scaling (the plan's default for fp16), so
    an overflowing step is skipped here as in the compiled step. With ``microbatches`` N,
    gradient accumulation as users write it: each of the N row chunks' losses, weighted by its
    share of the rows, is backpropagated, then one optimizer step; the step's loss is the
    weighted sum.
    """
    scaler = torch.amp.GradScaler("cpu") if autocast == torch.float16 else None
    return reference_steps(model, optimizer, loss_fn, batches, autocast_dtype=autocast, grad_scaler=scaler,
                           grad_clip=clip_norm, microbatches=microbatches).losses


def compare(entry: str | ZooModel, plan=None, *, steps: int = 3, optimizer=default_optimizer,
            param_groups: bool = False, autocast: torch.dtype | None = None,
            clip_norm: float | None = None, pad: bool = True, seed: int = 0,
            batches: list | None = None, **build_kw) -> Comparison:
    """Train ``steps`` steps eager and compiled from the same initial weights and batches.

    ``clip_norm`` clips the eager reference with ``torch.nn.utils.clip_grad_norm_``
    (the plan's ``grad_clip_norm`` is given separately, in ``plan``).
    """
    from cann_passes import Plan, compile_for_npu
    if isinstance(entry, str):
        entry = build(entry, seed=seed, **build_kw)
    plan = plan if plan is not None else Plan(backend="eager")
    model = entry.model
    ref = copy.deepcopy(model)
    if batches is None:
        batches = [entry.make_batch(1000 + i, pad=pad) for i in range(steps)]
    ref_opt = optimizer(ref if param_groups else ref.parameters())
    opt = optimizer(model if param_groups else model.parameters())
    microbatches = getattr(plan, "microbatches", 1)
    eager = eager_steps(ref, entry.loss_fn, ref_opt, batches, autocast=autocast, clip_norm=clip_norm,
                        microbatches=microbatches)
    step = compile_for_npu(model, plan, optimizer=opt, loss_fn=entry.loss_fn)
    compiled = [float(step(b)) for b in batches]
    if hasattr(step, "sync_model"):
        step.sync_model()
    return Comparison(entry.name, eager, compiled, _params(ref), _params(model), step, ref_opt, opt)
