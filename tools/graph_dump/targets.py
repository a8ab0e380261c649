"""What ``cann-graph-dump run TARGET`` compiles: a recipe by name, or a Python file.

A recipe returns a :class:`Target`: model, optimizer, loss function and a
list of batches (one per step). A Python file exposes ``model``,
``optimizer``, ``loss_fn`` and ``batch`` at module level, or a ``make()``
that returns them (a tuple in that order, or a dict with those keys).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch


class TargetError(ValueError):
    pass


@dataclass
class Target:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: list[Any]
    meta: bool = False        # built on the meta device: capture only, nothing can run

    def batch(self, step: int) -> Any:
        return self.batches[step % len(self.batches)]


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise TargetError(f"--set {item!r}: expected KEY=VALUE")
        try:
            value: Any = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = {"true": True, "false": False}.get(text.lower(), text)
        out[key.strip()] = value
    return out


def _gpt_config(preset: Callable, overrides: dict[str, Any]):
    from recipes.models.gpt import GPTConfig
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known - {"batch_size"})
    if unknown:
        raise TargetError(f"--set {unknown[0]}: not a GPTConfig field; fields are {', '.join(sorted(known))}")
    kinds = {"int": int, "float": float, "bool": bool}
    declared = {f.name: kinds.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
                for f in dataclasses.fields(GPTConfig)}
    for key, value in overrides.items():
        want = declared.get(key)
        fits = want is None or (isinstance(value, want) and not (want is not bool and isinstance(value, bool))) \
            or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            raise TargetError(f"--set {key}={value!r}: GPTConfig.{key} is {'an' if want is int else 'a'} "
                              f"{want.__name__}")
    return preset(**{k: v for k, v in overrides.items() if k in known})


def _gpt(preset_name: str, steps: int, overrides: dict[str, Any], batch_size: int) -> Target:
    from recipes.data import TextBatches, load_corpus
    from recipes.models import gpt
    cfg = _gpt_config(getattr(gpt, preset_name), overrides)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = TextBatches(load_corpus(), int(overrides.get("batch_size", batch_size)), cfg.seq_len, seed=0)
    return Target(model, optimizer, gpt.gpt_loss, list(itertools.islice(batches, steps)))


def _gpt_meta(steps: int, overrides: dict[str, Any]) -> Target:
    """The 7B-class GPT (32 layers, d_model 4096, seq 2048) on the meta device: shapes only."""
    from recipes.models import gpt
    cfg = _gpt_config(gpt.gpt_7b, overrides)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
        batch_size = int(overrides.get("batch_size", 1))
        idx = torch.zeros(batch_size, cfg.seq_len, dtype=torch.long)
        batch = (idx, torch.zeros_like(idx))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return Target(model, optimizer, gpt.gpt_loss, [batch], meta=True)


def _mlp(steps: int, overrides: dict[str, Any]) -> Target:
    from recipes.models.mlp import MLP, mlp_loss
    sizes = tuple(int(s) for s in str(overrides.get("sizes", "16-64-64-4")).split("-"))
    batch_size = int(overrides.get("batch_size", 32))
    torch.manual_seed(0)
    model = MLP(sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch_size, sizes[0], generator=generator),
                torch.randint(0, sizes[-1], (batch_size,), generator=generator)) for _ in range(steps)]
    return Target(model, optimizer, mlp_loss, batches)


RECIPES: dict[str, tuple[str, Callable[[int, dict], Target]]] = {
    "gpt": ("GPT gpt_small_cpu (4 layers, d_model 128) on the shipped text, batch 8",
            lambda steps, o: _gpt("gpt_small_cpu", steps, o, 8)),
    "gpt-tiny": ("GPT gpt_tiny (2 layers, d_model 32) on the shipped text, batch 2",
                 lambda steps, o: _gpt("gpt_tiny", steps, o, 2)),
    "gpt-7b-meta": ("GPT gpt_7b (32 layers, d_model 4096, seq 2048) on the meta device; --capture-only",
                    _gpt_meta),
    "mlp": ("MLP 16-64-64-4 on random data, batch 32", _mlp),
}


def _from_file(path: str, steps: int) -> Target:
    spec = importlib.util.spec_from_file_location(f"_graph_dump_target_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = ("model", "optimizer", "loss_fn", "batch")
    if hasattr(module, "make"):
        made = module.make()
        values = dict(made) if isinstance(made, dict) else dict(zip(names, made))
    else:
        values = {n: getattr(module, n) for n in names if hasattr(module, n)}
    missing = [n for n in names if n not in values]
    if missing:
        raise TargetError(f"{path} must expose {', '.join(names)} (or a make() returning them); "
                          f"missing: {', '.join(missing)}")
    model = values["model"]
    meta = any(p.is_meta for p in model.parameters())
    return Target(model, values["optimizer"], values["loss_fn"], [values["batch"]], meta=meta)


def resolve(target: str, *, steps: int = 1, overrides: list[str] = ()) -> Target:
    options = _parse_overrides(list(overrides))
    if target in RECIPES:
        return RECIPES[target][1](steps, options)
    if target.endswith(".py") or os.path.isfile(target):
        if not os.path.isfile(target):
            raise TargetError(f"no file {target}")
        if options:
            raise TargetError("--set applies to recipes, not to Python files")
        return _from_file(target, steps)
    raise TargetError(f"unknown target {target!r}: give a recipe ({', '.join(RECIPES)}) or a Python file")
