"""cann-graph-dump: see what every pass did to a training step.

    cann-graph-dump run gpt --out /tmp/dump                    # compile, run 1 step, dump, report
    cann-graph-dump run gpt --plan recipes/plans/gpt_bf16.yaml --steps 3 --out /tmp/bf16
    cann-graph-dump run model.py --pipeline "cleanup,cleanup" --out /tmp/mine
    cann-graph-dump run gpt-7b-meta --capture-only --out /tmp/7b   # shapes only, no run
    cann-graph-dump report DIR            # diffs, Graphviz and index.html for any dump directory
    cann-graph-dump report DIR --ge       # ... plus the final graph lowered to GE offline (torchair)
    cann-graph-dump diff DIR_A DIR_B      # two plans of one model, pass by pass
    cann-graph-dump show DIR [--pass NAME] [--module PATH]
    cann-graph-dump screenshot DIR --png page.png [--open pass=001_cleanup]
    cann-graph-dump replay DIR/reproducer_NNN   # re-run the pass that failed, on the graph it got

Dumps are also switched on by ``Plan(dump_dir=DIR)`` and by ``$CANN_PASSES_DUMP``;
``report`` turns such a directory into the same page.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

from .dumpdir import DumpError

log = logging.getLogger("cann_graph_dump")

# Files of an earlier dump into the same directory; a shorter pipeline would leave them behind.
_STALE = re.compile(r"^(\d{3}_.+\.(py|json|diff|dot|svg|constants\.pt)|passes\.json|index\.html|inputs\.pt|"
                    r"program\.(txt|json))$")


@dataclass
class RunResult:
    directory: str
    losses: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    step: object = None           # the CompiledStep, unless capture-only


# -- run -------------------------------------------------------------------------------------------

def make_plan(plan_file: str | None, pipeline: str | None, backend: str | None, out: str):
    from cann_passes import Plan
    plan = Plan.load(plan_file) if plan_file else Plan()
    if backend:
        plan = plan.replace(backend=backend)
    elif plan.backend == "auto":   # the point is the graphs: the quickest lowering will do
        plan = plan.replace(backend="eager")
    if pipeline:
        plan = plan.replace(pipeline=pipeline)
    return plan.replace(dump_dir=out)


def clear_dump(directory: str) -> None:
    from .ge import clear_ge
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if _STALE.match(name):
            os.remove(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "passes.json")):
            clear_dump(path)      # a graph's subdirectory from an earlier program
    clear_ge(directory)


def capture_and_dump(target, plan, directory: str):
    """Capture and compile the program with dumps, without lowering: works on meta models.

    The plan's parallel degrees compile for rank 0 of a fake mesh of those sizes (no processes).
    """
    from cann_passes.planning import compile_planned
    from graph_ir import capture_train_step, gather_inputs
    from graph_ir.mesh import MeshDesc
    batch = target.batch(0)
    captured, layout = capture_train_step(target.model, target.optimizer, target.loss_fn, batch)
    inputs = None if target.meta else gather_inputs(target.model, target.optimizer, layout, batch)
    # Nothing is lowered, so the backend only decides the pipeline and need not be present.
    return compile_planned(captured, plan, MeshDesc.fake(dp=plan.dp, cp=plan.cp, tp=plan.tp, pp=plan.pp),
                           dump_dir=directory, inputs=inputs)


def run_target(target_name: str, out: str, *, plan_file: str | None = None, pipeline: str | None = None,
               steps: int = 1, backend: str | None = None, capture_only: bool = False,
               overrides: list[str] = (), svg: bool = True, ge: bool | str = False) -> RunResult:
    from cann_passes import compile_for_npu
    from .targets import resolve
    result = RunResult(out)
    t0 = time.perf_counter()
    target = resolve(target_name, steps=steps, overrides=overrides)
    plan = make_plan(plan_file, pipeline, backend, out)
    clear_dump(out)
    t1 = time.perf_counter()
    result.seconds["build"] = t1 - t0
    if capture_only or target.meta or plan.dp * plan.cp * plan.tp * plan.pp > 1:
        capture_and_dump(target, plan, out)
    else:
        step = result.step = compile_for_npu(target.model, plan, optimizer=target.optimizer,
                                             loss_fn=target.loss_fn)
        for i in range(steps):
            result.losses.append(float(step(target.batch(i))))
    t2 = time.perf_counter()
    result.seconds["compile_and_dump"] = t2 - t1
    report(out, svg=svg, ge=ge)
    result.seconds["report"] = time.perf_counter() - t2
    return result


# -- report ----------------------------------------------------------------------------------------

def report(directory: str, *, svg: bool = True, ge: bool | str = False) -> str:
    """Diffs, Graphviz files and index.html for a dump directory; returns the page's path.

    ``ge``: first lower the final graph(s) to GE offline (``DIR/ge/``), through the torchair
    pipeline's ``npu_legalize`` where the dump's own pipeline has none (``"as-dumped"``: the graphs
    exactly as dumped); the page shows a ``DIR/ge/report.json`` whether written now or earlier by
    ``cann-lower-check DIR``.
    """
    from .artifacts import write_diffs, write_graphviz
    from .dumpdir import DumpDir
    from .html import write_index
    dump = DumpDir(directory)
    if ge:
        from .ge import lower
        lower(directory, legalize=ge != "as-dumped")
    diffs = write_diffs(dump)
    svgs = write_graphviz(dump, svg=svg)
    for p in dump.passes[:-1]:     # big graphs: keep only the final one loaded
        p.release()
    page = write_index(dump, diffs, svgs)
    for sub in dump.graph_directories():   # the further graphs of the program, each its own page
        report(sub, svg=svg)
    return page


# -- replay ----------------------------------------------------------------------------------------

def replay(directory: str, out: str | None = None, verify: str = "deep") -> str:
    """Run a reproducer's pipeline on its saved input graph."""
    import json
    import torch
    from cann_passes.dump import DumpWriter
    from cann_passes.pass_manager import PassContext, PassManager
    from graph_ir.mesh import MeshDesc
    from graph_ir.meta import GraphAttr
    from graph_ir.serialize import from_json
    graph_file, pipeline_file = os.path.join(directory, "input.json"), os.path.join(directory, "pipeline.txt")
    for path in (graph_file, pipeline_file):
        if not os.path.isfile(path):
            raise DumpError(f"{directory} is not a reproducer: it has no {os.path.basename(path)}")
    constants_file = os.path.join(directory, "input.constants.pt")
    constants = torch.load(constants_file, weights_only=True) if os.path.exists(constants_file) else None
    with open(graph_file, encoding="utf-8") as f:
        graph = from_json(json.load(f), constants)
    pipeline = open(pipeline_file, encoding="utf-8").read().strip()
    _import_pass_module(directory)
    dump = DumpWriter(out, pipeline) if out else None
    manager = PassManager(pipeline, verify_level=verify, dump=dump)
    # The graph and the pipeline text are the whole reproducer: passes read nothing else but the
    # mesh it was compiled for, which the graph's attrs carry.
    mesh = graph.attrs.get(GraphAttr.MESH)
    manager.run(graph, PassContext(mesh=MeshDesc.from_json(mesh) if mesh else None))
    return "\n".join(f"{r.index} {r.spec}: {'changed' if r.changed else 'unchanged'}, "
                     f"nodes {r.nodes_before} -> {r.nodes_after}" for r in manager.records)


def _import_pass_module(directory: str) -> None:
    """Register the failing pass where it is a user's: import the module it was defined in, or,
    for a script run as ``__main__``, load that file under another name (its ``if __name__ ==
    "__main__":`` block does not run)."""
    import importlib
    import importlib.util
    import json
    info_file = os.path.join(directory, "pass.json")
    if not os.path.isfile(info_file):
        return
    with open(info_file, encoding="utf-8") as f:
        info = json.load(f)
    module, source = info.get("module"), info.get("file")
    if module and module != "__main__":
        try:
            importlib.import_module(module)
            return
        except ImportError:
            pass
    if source and os.path.isfile(source):
        spec = importlib.util.spec_from_file_location("cann_replayed_passes", source)
        loaded = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(source))
        try:
            spec.loader.exec_module(loaded)
        finally:
            sys.path.remove(os.path.dirname(source))
        return
    raise DumpError(f"the failing pass was defined in {module or source}, which cannot be imported here; "
                    "import it (or run the replay from the directory it lives in)")


# -- the command line ------------------------------------------------------------------------------

_GE_HELP = ("also lower the final graph to a GE GraphDef with torchair's converters, offline (no NPU), "
            "into DIR/ge/, and add a GE section to the page; a graph compiled for another backend is "
            "first put through npu_legalize, as the torchair backend compiles it")
_GE_AS_DUMPED_HELP = "as --ge, but lower the final graph exactly as dumped (no npu_legalize added)"


def _parser() -> argparse.ArgumentParser:
    from .targets import RECIPES
    recipes = "; ".join(f"{name}: {about}" for name, (about, _) in RECIPES.items())
    first, _, rest = __doc__.partition("\n")
    parser = argparse.ArgumentParser(prog="cann-graph-dump", description=first,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log every pass; on an error show the traceback")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="compile a target with dumps on, run it, and report")
    run.add_argument("target", help=f"a recipe ({recipes}) or a Python file exposing model, optimizer, "
                                    "loss_fn and batch (or make() returning them)")
    run.add_argument("--out", required=True, help="dump directory")
    run.add_argument("--plan", help="plan file (YAML or JSON)")
    run.add_argument("--pipeline", help="pipeline text, replacing the plan's")
    run.add_argument("--steps", type=int, default=1, help="steps to run (default 1)")
    run.add_argument("--backend", help="lowering backend (default: the plan's, eager when it says auto)")
    run.add_argument("--capture-only", action="store_true",
                     help="capture and run the passes without lowering or running (meta models)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="recipe option, e.g. --set n_layer=8 --set batch_size=4")
    run.add_argument("--no-svg", action="store_true", help="skip rendering Graphviz SVGs")
    run.add_argument("--ge", action="store_true", help=_GE_HELP)
    run.add_argument("--ge-as-dumped", action="store_true", help=_GE_AS_DUMPED_HELP)

    rep = sub.add_parser("report", help="add diffs, Graphviz and index.html to a dump directory")
    rep.add_argument("dir", help="dump directory")
    rep.add_argument("--no-svg", action="store_true", help="skip rendering Graphviz SVGs")
    rep.add_argument("--ge", action="store_true", help=_GE_HELP)
    rep.add_argument("--ge-as-dumped", action="store_true", help=_GE_AS_DUMPED_HELP)

    diff = sub.add_parser("diff", help="compare two dump directories pass by pass")
    diff.add_argument("dir_a", help="dump directory A")
    diff.add_argument("dir_b", help="dump directory B")

    show = sub.add_parser("show", help="print one pass's graph (default: the last)")
    show.add_argument("dir", help="dump directory")
    show.add_argument("--pass", dest="pass_name", help="index, NNN_name, spec or name (last of that name)")
    show.add_argument("--module", help="only nodes of this module path and its submodules, with their own "
                                        "FLOPs, bytes and saved activations above the whole graph's")

    shot = sub.add_parser("screenshot", help="a PNG of a dump's index.html (headless chromium)")
    shot.add_argument("dir", help="dump directory (with its index.html)")
    shot.add_argument("--png", required=True, help="PNG file to write")
    shot.add_argument("--open", dest="fragment", default="", help="what to open, e.g. pass=001_cleanup")
    shot.add_argument("--size", default="1400x1600", help="WIDTHxHEIGHT in pixels")

    rp = sub.add_parser("replay", help="re-run a failing pass's reproducer directory")
    rp.add_argument("dir", help="reproducer directory (DIR/reproducer_NNN)")
    rp.add_argument("--out", help="dump the replayed pipeline here")
    rp.add_argument("--verify", default="deep", choices=("off", "shallow", "deep"),
                    help="verifier level after each pass (default: %(default)s)")
    return parser


def _run_command(args) -> None:
    result = run_target(args.target, args.out, plan_file=args.plan, pipeline=args.pipeline, steps=args.steps,
                        backend=args.backend, capture_only=args.capture_only, overrides=args.overrides,
                        svg=not args.no_svg, ge="as-dumped" if args.ge_as_dumped else args.ge)
    for i, loss in enumerate(result.losses, start=1):
        print(f"step {i}: loss {loss:.6f}")
    s = result.seconds
    print(f"dumped to {args.out} in {sum(s.values()):.1f}s (build {s['build']:.1f}s, capture+passes+dump "
          f"{s['compile_and_dump']:.1f}s, report {s['report']:.1f}s)")
    print(f"open {os.path.join(os.path.abspath(args.out), 'index.html')}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from cann_passes import PipelineError, PlanError
    from .targets import TargetError
    try:
        if args.command == "run":
            _run_command(args)
        elif args.command == "report":
            print(report(args.dir, svg=not args.no_svg, ge="as-dumped" if args.ge_as_dumped else args.ge))
        elif args.command == "diff":
            from .compare import compare
            sys.stdout.write(compare(args.dir_a, args.dir_b))
        elif args.command == "show":
            from .show import show
            sys.stdout.write(show(args.dir, args.pass_name, args.module))
        elif args.command == "screenshot":
            from .browser import screenshot
            width, height = (int(v) for v in args.size.lower().split("x"))
            print(screenshot(os.path.join(args.dir, "index.html"), args.png, fragment=args.fragment,
                             width=width, height=height))
        elif args.command == "replay":
            print(replay(args.dir, args.out, args.verify))
    except (DumpError, TargetError, PlanError, PipelineError, *_USER_ERRORS) as exc:
        if args.verbose or os.environ.get("CANN_PASSES_TRACEBACK"):
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, (ValueError, RuntimeError)):
            text = f"{type(exc).__name__}: {text}"
        print(f"cann-graph-dump: error: {text}", file=sys.stderr)
        return 2
    return 0


# Bad input, not bugs: a plan that breaks a rule, a path that cannot be read or written, a model
# file that does not import, a model that refuses the batch, a backend missing here. With -v (or
# $CANN_PASSES_TRACEBACK) the traceback is shown instead of the one line.
_USER_ERRORS = (ValueError, RuntimeError, OSError, ImportError, SyntaxError, TypeError)
