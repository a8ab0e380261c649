"""Lower an FX graph to a GE GraphDef offline (torchair converters, no NPU) and report coverage.

Usage::

    python -m tools.lower_check TARGET --out DIR [--name NAME]

TARGET is one of

* ``pkg.module:factory`` -- ``factory()`` returns a ``torch.fx.GraphModule`` whose nodes
  carry ``meta["val"]``, or a ``(fn, example_args)`` pair that is traced with
  ``make_fx(fn, tracing_mode="fake")``;
* ``FILE.pt`` -- ``torch.save`` of a GraphModule, or of ``{"gm": gm, "example_inputs": [...]}``
  (pickled GraphModules lose ``node.meta``; with ``example_inputs`` the metadata is recomputed
  with FakeTensorProp);
* ``demo`` -- a small built-in MLP training step.

Writes ``DIR/<name>.ge.txt`` (GraphDef, protobuf text format) and ``DIR/<name>.ge_ops.json``
(op histogram, unsupported ops, notes), prints the histogram and the unsupported list.
Exit status: 0 if every node lowered, 1 if some were unsupported, 2 on usage/load errors.

How torchair is obtained without torch_npu / CANN: see ``cann_passes/lowering/ge_offline``
(``_loader.py`` and the graph-construction-only ``_standin_torchair.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path


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
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    if all("val" in n.meta for n in gm.graph.nodes if n.op != "output"):
        return gm
    if example_inputs is None:
        raise SystemExit(
            "lower_check: the GraphModule has no node.meta['val'] (lost when pickled); "
            'save {"gm": gm, "example_inputs": [...]} instead'
        )
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake)
    return gm


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.lower_check", description=__doc__.split("\n")[0])
    ap.add_argument("target", help="pkg.module:factory | FILE.pt | demo")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--name", default=None, help="graph name (default: derived from TARGET)")
    args = ap.parse_args(argv)
    name = args.name or Path(args.target.split(":")[-1]).stem or "graph"
    try:
        gm = load_graph(args.target)
        report = lower_check(gm, name=name, out_dir=args.out)
    except RuntimeError as e:  # load_torchair reports missing wheel/protobuf this way
        print(f"lower_check: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    print(f"wrote {Path(args.out) / (name + '.ge.txt')} and {Path(args.out) / (name + '.ge_ops.json')}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
