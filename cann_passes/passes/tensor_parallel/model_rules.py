"""The built-in rule tables: one per model family, chosen by the parameter names a graph has."""
from __future__ import annotations

import fnmatch
from typing import Iterable

from .rules import Rule, parse_rules

# Built-in rule sets: (family, a parameter name that identifies it, rules). Module paths, as
# named_parameters spells them minus the trailing ".weight"/".bias".
BUILTIN_RULES: tuple[tuple[str, str, str], ...] = (
    ("recipe-gpt", "*layers.*.attn.qkv.weight",
     "*layers.*.attn.qkv=column:3;*layers.*.attn.proj=row;*layers.*.mlp.fc1=column;"
     "*layers.*.mlp.fc2=row;wte=vocab;lm_head=column"),
    ("gpt2", "*.attn.c_attn.weight",
     "*.h.*.attn.c_attn=column:3;*.h.*.attn.c_proj=row;*.h.*.mlp.c_fc=column;*.h.*.mlp.c_proj=row;"
     "*wte=vocab;lm_head=column"),
    # fairseq's naming, as transformers' OPT, BART, mBART, Whisper, M2M-100 and Marian spell it:
    # q/k/v/out_proj in self- and cross-attention, fc1/fc2 the MLP (before llama, whose q_proj
    # marker these share)
    ("fairseq", "*.self_attn.out_proj.weight",
     "*.self_attn.q_proj=column;*.self_attn.k_proj=column;*.self_attn.v_proj=column;*.self_attn.out_proj=row;"
     "*.encoder_attn.q_proj=column;*.encoder_attn.k_proj=column;*.encoder_attn.v_proj=column;"
     "*.encoder_attn.out_proj=row;*.fc1=column;*.fc2=row"),
    ("llama", "*.self_attn.q_proj.weight",
     "*.self_attn.q_proj=column;*.self_attn.k_proj=column;*.self_attn.v_proj=column;"
     "*.self_attn.o_proj=row;*.mlp.gate_proj=column;*.mlp.up_proj=column;*.mlp.down_proj=row;"
     "*embed_tokens=vocab;lm_head=column"),
    # Phi-3: q, k and v fused in one projection and sliced apart, gate and up fused likewise
    # (equal parts: Phi-3-mini's kv heads equal its heads; a GQA variant's unequal parts are
    # refused naming the slice)
    ("phi3", "*.self_attn.qkv_proj.weight",
     "*.self_attn.qkv_proj=column:3;*.self_attn.o_proj=row;*.mlp.gate_up_proj=column:2;*.mlp.down_proj=row;"
     "*embed_tokens=vocab;lm_head=column"),
    # GPT-NeoX (Pythia): q, k and v interleaved per head in one query_key_value, so a plain
    # column split keeps whole heads on each rank ('column:3' would cut a head's q, k, v apart)
    ("gpt_neox", "*.attention.query_key_value.weight",
     "*.attention.query_key_value=column;*.attention.dense=row;*.mlp.dense_h_to_4h=column;"
     "*.mlp.dense_4h_to_h=row"),
    ("bert", "*.attention.self.query.weight",
     "*.attention.self.query=column;*.attention.self.key=column;*.attention.self.value=column;"
     "*.attention.output.dense=row;*.intermediate.dense=column;*.layer.*.output.dense=row;"
     "*word_embeddings=vocab"),
)


def builtin_rules(param_names: Iterable[str]) -> tuple[str, list[Rule]]:
    names = list(param_names)
    for family, marker, text in BUILTIN_RULES:
        if any(fnmatch.fnmatchcase(n, marker) for n in names):
            return family, parse_rules(text)
    return "none", []
