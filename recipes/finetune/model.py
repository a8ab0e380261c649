"""Load a transformers causal LM, choose what trains (full, LoRA, frozen by pattern), save it back.

Everything a user would do without the compiler: ``from_pretrained`` of a
local directory, ``peft.get_peft_model`` with a ``LoraConfig``,
``requires_grad_(False)`` by name, ``merge_and_unload`` + ``save_pretrained``.
The compiled step sees only an ``nn.Module`` whose frozen parameters do not
require grad and an optimizer over the trainable ones.
"""
from __future__ import annotations

import fnmatch
import os

import torch

from recipes.data.instructions import BOS_ID, BYTES, EOS_ID, PAD_ID
from recipes.data.text import VOCAB_SIZE

from .config import ConfigError, FinetuneConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tiny_llama_config(**overrides):
    """A 2-layer LLaMA small enough to train in a minute on two CPU cores (byte vocabulary)."""
    from transformers import LlamaConfig
    fields = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)
    fields.update(overrides)
    return LlamaConfig(**fields)


def make_base_checkpoint(path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Write a randomly initialised tiny LLaMA with ``save_pretrained`` (no weights are shipped)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config(**overrides)).save_pretrained(path)
    return str(path)


def load_base(path: str | os.PathLike, base_dtype: str = "fp32"):
    """``AutoModelForCausalLM.from_pretrained`` of a local directory, in ``base_dtype``."""
    from transformers import AutoModelForCausalLM
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("model_dir", "must be a directory written by save_pretrained (no config.json there)",
                          str(path))
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[base_dtype])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class PretrainedTokenizer:
    """A checkpoint's transformers tokenizer with the interface the instruction batches use."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        # Padding is masked out of attention and loss, so any id serves; EOS when there is no PAD.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def load_tokenizer(path: str | os.PathLike, model: torch.nn.Module):
    """The checkpoint's own tokenizer when it has one, else bytes; either must fit the model's vocabulary."""
    vocab = model.get_input_embeddings().num_embeddings
    if any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        tokenizer = PretrainedTokenizer(AutoTokenizer.from_pretrained(path))
        if tokenizer.eos_id is None:
            raise ConfigError("model_dir", "the checkpoint's tokenizer has no EOS token, which ends every "
                              "response", str(path))
        if tokenizer.vocab_size > vocab:
            raise ConfigError("model_dir", f"the tokenizer has {tokenizer.vocab_size} tokens, the model's "
                              f"embedding only {vocab}", str(path))
        return tokenizer
    if vocab < VOCAB_SIZE:
        raise ConfigError("model_dir", f"without a tokenizer in the checkpoint the tokens are bytes: the model needs "
                          f"a vocabulary of at least {VOCAB_SIZE}, it has {vocab}", str(path))
    return BYTES


def prepare_model(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    """The model to train: all of it, LoRA adapters on it, or all but the frozen patterns."""
    if cfg.base_dtype != "fp32" and cfg.method != "lora":
        raise ConfigError("base_dtype", f"a {cfg.base_dtype} base is for frozen weights under LoRA; method "
                          f"{cfg.method!r} would train {cfg.base_dtype} weights without fp32 master copies "
                          "(use plan precision: bf16 instead)", cfg.base_dtype)
    if cfg.method == "lora":
        return add_lora(model, cfg)
    model.requires_grad_(True)
    if cfg.method == "freeze":
        freeze_by_pattern(model, cfg.freeze)
    return model


def add_lora(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    targets = "all-linear" if cfg.lora_targets == ("all-linear",) else list(cfg.lora_targets)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    try:
        # Adapters stay fp32 over a bf16 base (peft's autocast_adapter_dtype, on by default).
        return get_peft_model(model, lora)
    except ValueError as exc:
        raise ConfigError("lora_targets", f"peft could not place adapters: {exc}", cfg.lora_targets) from None


def freeze_by_pattern(model: torch.nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Stop gradients to every parameter whose name matches a pattern; returns the frozen names."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError("freeze", f"pattern {pattern!r} matches no parameter (names look like "
                              f"{names[0]!r})", patterns)
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    if len(frozen) == len(names):
        raise ConfigError("freeze", "the patterns freeze every parameter: nothing would train", patterns)
    return frozen


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def save_finetuned(model: torch.nn.Module, output_dir: str | os.PathLike, tokenizer=None) -> torch.nn.Module:
    """``save_pretrained`` a model plain transformers loads: LoRA adapters merged into the weights.

    The adapters alone are saved too (``<output_dir>/adapter``, peft's format),
    and a checkpoint's own tokenizer beside the model. Merging replaces the
    adapter layers in ``model``; the merged model is returned.
    """
    if is_peft(model):
        model.save_pretrained(os.path.join(output_dir, "adapter"))
        model = model.merge_and_unload()
    model.save_pretrained(output_dir)
    if isinstance(tokenizer, PretrainedTokenizer):
        tokenizer.tokenizer.save_pretrained(output_dir)
    return model


class ResponseLoss:
    """``loss_fn(model, batch)``: next-token cross entropy on the response tokens.

    ``labels`` is -100 on the prompt and the padding, which transformers' loss
    ignores. ``attention_mask``: ``2d`` hands the padding mask to the model as
    is; ``4d`` makes the causal-and-padding mask here (boolean for SDPA,
    additive for the eager attention), which transformers uses as given instead
    of inspecting the padding with data-dependent Python.
    """

    def __init__(self, attention_mask: str = "2d"):
        self.mode = attention_mask

    def __call__(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        mask = batch["attention_mask"]
        if self.mode == "4d":
            mask = causal_padding_mask(mask, model)
        # No KV cache: training reads every position once, and the cache would be a step output.
        return model(input_ids=batch["input_ids"], attention_mask=mask, labels=batch["labels"],
                     use_cache=False).loss


def causal_padding_mask(padding: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """(batch, 1, seq, seq): position q may read key k when k <= q and k is a real token."""
    seq = padding.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=padding.device).tril()
    allowed = causal[None, None] & padding[:, None, None, :].bool()
    if getattr(model.config, "_attn_implementation", "sdpa") != "eager":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    zero = torch.zeros((), dtype=dtype, device=padding.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
