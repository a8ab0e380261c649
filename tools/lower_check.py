"""Lower training-step graphs to GE GraphDefs offline (torchair's converters, no NPU) and report coverage.

Usage::

    cann-lower-check run TARGET --plan PLAN.yaml --out DIR [--batch-size B] [--seq-len T] [--attention A]
    cann-lower-check DUMP_DIR
    cann-lower-check GRAPH --out DIR [--name NAME]

``run`` compiles one training step of a recipe model (TARGET = ``pkg.module:factory`` returning a
``GPTConfig`` or an ``nn.Module``; default loss ``recipes.models.gpt:gpt_loss``, AdamW, batches from
``recipes.data.text``) with the plan's torchair pipeline (npu_legalize included) on CPU, dumps every
pass into DIR and lowers the final graph. ``DUMP_DIR`` lowers the final graphs of an existing dump
directory (the last ``NNN_*.json`` of DIR and of each per-rank/stage subdirectory). Both write
``DIR/ge/<graph>.ge.txt`` and ``DIR/ge/report.json`` (GE-op histogram; every unsupported op with its
FX node and module path).

GRAPH lowers a single FX graph: ``pkg.module:factory`` (a GraphModule with ``meta["val"]``, or an
``(fn, example_args)`` pair traced with ``make_fx``), a ``FILE.pt`` (``torch.save`` of a GraphModule
or of ``{"gm": gm, "example_inputs": [...]}``), or ``demo`` (a small MLP step); it writes
``DIR/<name>.ge.txt`` and ``DIR/<name>.ge_ops.json``.

Exit status: 0 if every node lowered, 1 if some were unsupported, 2 on usage/load errors (one line on
stderr; ``CANN_PASSES_TRACEBACK=1`` shows the traceback instead).
How torchair is obtained without torch_npu / CANN: ``cann_passes/lowering/ge_offline/_loader.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

from cann_passes.lowering.ge_offline._report import write_ge_report  # noqa: F401  (the dump tool's GE page)


def _demo():
    import torch
    import torch.nn.functional as F

    def step(x, y, w1, b1, w2, b2):
        params = (w1, b1, w2, b2)

        def loss_fn(w1, b1, w2, b2):
            h = F.gelu(torch.addmm(b1, x, w1))
            return F.cross_entropy(torch.addmm(b2, h, w2), y)

        loss = loss_fn(*params)
        grads = torch.autograd.grad(loss, params)
        return (loss, *(p - 0.01 * g for p, g in zip(params, grads)))

    args = (torch.randn(8, 16), torch.randint(0, 10, (8,)))
    args += tuple(torch.randn(*s, requires_grad=True) for s in ((16, 32), (32,), (32, 10), (10,)))
    return step, args


def _trace(fn, example_args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*example_args)


def _with_meta(gm, example_inputs):
    from graph_ir.build import propagate_fake_values

    if all("val" in n.meta for n in gm.graph.nodes if n.op != "output"):
        return gm
    if example_inputs is None:
        raise SystemExit(
            "lower_check: the GraphModule has no node.meta['val'] (lost when pickled); "
            'save {"gm": gm, "example_inputs": [...]} instead'
        )
    return propagate_fake_values(gm, example_inputs)


def load_graph(target: str):
    """Resolve TARGET (see module doc) to a GraphModule with meta vals."""
    import torch

    if target == "demo":
        return _trace(*_demo())
    if target.endswith((".pt", ".pth")) or Path(target).is_file():
        try:  # unpickling re-traces the GraphModule; torch 2.13 forgets to import this module
            import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401
        except ImportError:
            pass
        obj = torch.load(target, weights_only=False)
        if isinstance(obj, dict):
            return _with_meta(obj["gm"], obj.get("example_inputs"))
        return _with_meta(obj, None)
    if ":" not in target:
        raise SystemExit(f"lower_check: TARGET must be 'pkg.module:factory', a .pt file or 'demo', got {target!r}")
    mod_name, attr = target.split(":", 1)
    obj = getattr(importlib.import_module(mod_name), attr)()
    if isinstance(obj, torch.fx.GraphModule):
        return obj
    fn, example_args = obj
    return _trace(fn, example_args)


def lower_check(gm, *, name: str, out_dir) -> "object":
    """Lower ``gm``, write ``<name>.ge.txt`` / ``<name>.ge_ops.json`` into ``out_dir``, return the report."""
    from cann_passes.lowering.ge_offline import lower_to_ge

    report = lower_to_ge(gm, name=name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.ge.txt").write_text(report.graph_text)
    (out / f"{name}.ge_ops.json").write_text(
        json.dumps(
            {
                "name": name,
                "ok": report.ok,
                "op_histogram": dict(sorted(report.op_histogram.items())),
                "unsupported": [dataclasses.asdict(u) for u in report.unsupported],
                "notes": report.notes,
            },
            indent=2,
        )
        + "\n"
    )
    return report


def _factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"lower_check: expected 'pkg.module:name', got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    return getattr(importlib.import_module(mod_name), attr)


def _recipe_model(target: str, attention: str | None):
    import dataclasses

    import torch

    from recipes.models.gpt import GPT, GPTConfig

    obj = _factory(target)()
    if isinstance(obj, GPTConfig):
        cfg = dataclasses.replace(obj, attention=attention) if attention else obj
        return GPT(cfg), cfg.seq_len
    if isinstance(obj, torch.nn.Module):
        return obj, None
    raise SystemExit(f"lower_check: {target} returned a {type(obj).__name__}, not a GPTConfig or nn.Module")


def torchair_plan(plan):
    """The plan as the torchair backend would compile it, run on CPU: same pipeline, eager lowering."""
    from cann_passes.pass_pipeline import build_pipeline

    # torchair's CompilerConfig options do not apply to the eager lowering that stands in for GE.
    return plan.replace(pipeline=str(build_pipeline(plan, "torchair")), backend="eager", torchair={})


def compile_recipe(target: str, plan, out_dir, *, loss: str = "recipes.models.gpt:gpt_loss",
                   batch_size: int = 4, seq_len: int | None = None, attention: str | None = None,
                   seed: int = 0):
    """Compile (not run) one training step of a recipe model with ``plan``, dumping into ``out_dir``."""
    import torch

    from cann_passes import compile_for_npu
    from recipes.data.text import TextBatches, load_corpus

    torch.manual_seed(seed)
    model, max_len = _recipe_model(target, attention)
    seq_len = seq_len or min(max_len or 64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step = compile_for_npu(model, torchair_plan(plan).replace(dump_dir=str(out_dir)),
                           optimizer=optimizer, loss_fn=_factory(loss))
    batch = next(iter(TextBatches(load_corpus(), batch_size, seq_len, seed=seed)))
    step.compile(batch)
    return step


def _print_report(path) -> bool:
    data = json.loads(Path(path).read_text())
    for name, entry in data["graphs"].items():
        print(f"GE graph {name} (from {entry['source']}): {entry['ge_ops']} ops, ok={entry['ok']}")
        for op, n in sorted(entry["op_histogram"].items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:5d}  {op}")
        for u in entry["unsupported"]:
            where = f" [{u['module_path']}]" if u["module_path"] else ""
            print(f"  unsupported: {u['node']}: {u['target']}{where}: {u['reason']}")
        for note in entry["notes"]:
            print(f"  note: {note}")
    print(f"wrote {path}")
    return data["ok"]


def _run_main(argv) -> int:
    from cann_passes import Plan
    from cann_passes.lowering.ge_offline import write_ge_report

    ap = argparse.ArgumentParser(prog="cann-lower-check run", description="compile a recipe step, lower it")
    ap.add_argument("target", help="pkg.module:factory returning a GPTConfig or nn.Module")
    ap.add_argument("--plan", default=None, help="plan YAML/JSON (default: fp32 defaults)")
    ap.add_argument("--out", required=True, help="dump directory")
    ap.add_argument("--loss", default="recipes.models.gpt:gpt_loss")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--attention", choices=("explicit", "sdpa"), default=None)
    args = ap.parse_args(argv)
    plan = Plan.load(args.plan) if args.plan else Plan()
    _make_out(args.out)
    compile_recipe(args.target, plan, args.out, loss=args.loss, batch_size=args.batch_size,
                   seq_len=args.seq_len, attention=args.attention)
    return 0 if _print_report(write_ge_report(args.out)) else 1


def _graph_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="cann-lower-check", description=__doc__.split("\n")[0])
    ap.add_argument("target", help="DUMP_DIR | pkg.module:factory | FILE.pt | demo (or: run TARGET ...)")
    ap.add_argument("--out", default=None, help="output directory (graph targets)")
    ap.add_argument("--name", default=None, help="graph name (default: derived from TARGET)")
    ap.add_argument("--as-dumped", action="store_true",
                    help="lower a dump directory's graphs exactly as dumped (by default a dump of another "
                         "backend is first put through npu_legalize, as the torchair backend compiles it)")
    args = ap.parse_args(argv)
    if Path(args.target).is_dir():
        from cann_passes.lowering.ge_offline import write_ge_report

        return 0 if _print_report(write_ge_report(args.target, legalize=not args.as_dumped)) else 1
    looks_like_path = "/" in args.target or args.target.startswith(".") or args.target.endswith((".pt", ".pth"))
    if looks_like_path and ":" not in args.target and not Path(args.target).exists():
        ap.error(f"TARGET {args.target!r}: no such dump directory or file")
    if args.out is None:
        ap.error("--out is required unless TARGET is a dump directory")
    _make_out(args.out)
    name = args.name or Path(args.target.split(":")[-1]).stem or "graph"
    report = lower_check(load_graph(args.target), name=name, out_dir=args.out)
    print(report.summary())
    print(f"wrote {Path(args.out) / (name + '.ge.txt')} and {Path(args.out) / (name + '.ge_ops.json')}")
    return 0 if report.ok else 1


# Bad input, not bugs: a plan or pipeline that breaks a rule, a path that cannot be read or
# written, a TARGET that does not import, a capability or backend missing here.
_USER_ERRORS = (ValueError, RuntimeError, OSError, ImportError, AttributeError, TypeError)


def _make_out(directory: str) -> None:
    """Before any compiling or lowering: an --out that cannot be made fails now, not minutes later."""
    Path(directory).mkdir(parents=True, exist_ok=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["run"]:
            return _run_main(argv[1:])
        return _graph_main(argv)
    except _USER_ERRORS as e:  # torchair unavailable, no dumps, missing plan file, unwritable --out ...
        if os.environ.get("CANN_PASSES_TRACEBACK"):
            raise
        print(f"lower_check: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, (ValueError, RuntimeError)) else f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
