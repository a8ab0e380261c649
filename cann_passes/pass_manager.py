"""Passes, pipelines and the pass manager.

A pass is a function ``fn(graph: TrainGraph, ctx: PassContext, *, <options>) -> TrainGraph``
registered with :func:`register_pass`. Its keyword-only parameters, with their
annotations and defaults, are its typed options. A pass registered with
``on="program"`` takes and returns the whole :class:`~graph_ir.program.Program`
instead (a split: one graph in, several out). A pipeline is a list of passes
with options and has a text form that parses back to itself::

    cleanup,autocast{dtype=bf16},grad_accumulation{microbatches=4},split_grad_apply,apply(cleanup)

A graph pass runs on every graph of the program; ``kind(p1,p2)`` nests
passes so that they run only on the graphs of that kind (MLIR's ``nest``).

The manager's loop only runs passes; everything around a pass is an
:class:`Instrument` (MLIR's PassInstrumentation): :class:`Timing`,
:class:`Verify`, :class:`Statistics` (changed or not, nodes and ops
added/removed, the pass's own counters, analysis invalidation),
:class:`Dump` and :class:`Reproducer` (on failure: the graph the pass was
given and the one-pass pipeline, so the text alone reproduces it). Analyses
are cached per graph version and dropped when a pass changes the graph,
unless the pass declares it preserves them.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import tempfile
import time
import typing
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from graph_ir import TrainGraph
from graph_ir.train_graph import GraphState
from graph_ir.meta import GraphAttr
from graph_ir.analysis import graph_cost, memory_profile, to_networkx
from graph_ir.analysis.collectives import collectives
from graph_ir.analysis.memory import state_bytes
from graph_ir.program import Program
from graph_ir.verifier import VerificationError, verify, verify_program

from .dump import write_reproducer

log = logging.getLogger("cann_passes")

PassFn = Callable[..., TrainGraph]


@dataclass(frozen=True)
class PassOption:
    name: str
    type: type
    default: Any
    # Literal["a", "b"] in the signature: the values the pipeline text may give (checked when parsed,
    # so a plan naming another is refused when it is made, not after capture).
    choices: tuple | None = None


@dataclass(frozen=True)
class PassInfo:
    name: str
    fn: PassFn
    options: dict[str, PassOption]
    preserves: tuple[str, ...]
    doc: str
    on: str = "graph"          # "graph": fn(TrainGraph, ctx) | "program": fn(Program, ctx)

    def coerce(self, options: dict[str, Any]) -> dict[str, Any]:
        """Options converted to their declared types; unknown names are refused."""
        out = {}
        for key, value in options.items():
            if key not in self.options:
                known = ", ".join(self.options) or "none"
                raise PipelineError(f"pass '{self.name}' has no option '{key}' (options: {known})")
            out[key] = _convert(self.name, self.options[key], value)
        return out


class PipelineError(ValueError):
    pass


class PassOptionError(ValueError):
    """A pass refuses one of its options (or what the graph makes of it): the message names the
    pass, the option and the rule. The compile driver, which knows which plan field set the
    option, re-raises it as that field's :class:`~cann_passes.plan.PlanError`."""

    def __init__(self, pass_name: str, option: str, rule: str, value: Any = None):
        self.pass_name, self.option, self.rule, self.value = pass_name, option, rule, value
        super().__init__(f"pass '{pass_name}' option '{option}' = {value!r}: {rule}")


class PassFailure(RuntimeError):
    """A pass raised or produced a graph that fails verification."""

    def __init__(self, pass_name: str, index: int, pipeline: str, reproducer_dir: str | None,
                 cause: BaseException):
        self.pass_name, self.index, self.pipeline = pass_name, index, pipeline
        self.reproducer_dir = reproducer_dir
        where = f"; the graph it was given is in {reproducer_dir}" if reproducer_dir else ""
        super().__init__(
            f"pass '{pass_name}' (#{index} of pipeline '{pipeline}') failed: "
            f"{type(cause).__name__}: {cause}{where}; reproduce with "
            f"`cann-graph-dump replay {reproducer_dir or 'DIR'}`")


_REGISTRY: dict[str, PassInfo] = {}


def _choices(annotation: Any) -> tuple | None:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return None


def _option_type(annotation: Any) -> type:
    if isinstance(annotation, str):  # unresolved "float | None"-style text
        first = annotation.split("|")[0].strip()
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(
            first, tuple if first.startswith("tuple") else str)
    origin = typing.get_origin(annotation)
    if origin is tuple:   # tuple[str, ...]: a list option, ``a;b;c`` in pipeline text
        return tuple
    if origin is typing.Literal:
        return type(typing.get_args(annotation)[0])
    if origin is not None:  # Optional[X] / X | None -> X
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if args else str
    return annotation if annotation is not inspect.Parameter.empty else str


def _convert(pass_name: str, option: PassOption, value: Any) -> Any:
    converted = _convert_type(pass_name, option, value)
    if option.choices is not None and converted not in option.choices:
        raise PipelineError(f"pass '{pass_name}' option '{option.name}' = {value!r}: must be one of "
                            f"{', '.join(map(repr, option.choices))}")
    return converted


def _convert_type(pass_name: str, option: PassOption, value: Any) -> Any:
    if option.type is tuple:
        items = value.split(";") if isinstance(value, str) else list(value or ())
        if not all(isinstance(item, str) for item in items):
            raise PipelineError(f"pass '{pass_name}' option '{option.name}' must be a list of strings, "
                                f"got {value!r}")
        return tuple(item.strip() for item in items if item.strip())
    if value is None or isinstance(value, option.type) and not (option.type is int and isinstance(value, bool)):
        return value
    text = str(value).strip()
    try:
        if option.type is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if option.type is float and text.lower() in ("none", "null"):
            return None
        return option.type(text)
    except (TypeError, ValueError):
        raise PipelineError(f"pass '{pass_name}' option '{option.name}' must be "
                            f"{option.type.__name__}, got {value!r}") from None


def register_pass(name: str | None = None, *, preserves: tuple[str, ...] = (), on: str = "graph"):
    """Register ``fn(graph, ctx, *, options...) -> TrainGraph`` as a pass named ``name``
    (``on="program"``: ``fn(program, ctx, *, options...) -> Program``)."""
    if on not in ("graph", "program"):
        raise PipelineError(f"register_pass on={on!r}: must be 'graph' or 'program'")

    def decorate(fn: PassFn) -> PassFn:
        pass_name = name or fn.__name__.removesuffix("_pass")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", pass_name):
            raise PipelineError(f"pass name {pass_name!r} must be lower_snake_case")
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2 or any(p.kind != p.KEYWORD_ONLY for p in params[2:]):
            raise PipelineError(f"pass '{pass_name}' must have the signature "
                                "fn(graph, ctx, *, option=default, ...)")
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # annotations naming things not importable here: fall back to text
            hints = {}
        options = {}
        for p in params[2:]:
            if p.default is inspect.Parameter.empty:
                raise PipelineError(f"pass '{pass_name}' option '{p.name}' needs a default")
            annotation = hints.get(p.name, p.annotation)
            options[p.name] = PassOption(p.name, _option_type(annotation), p.default, _choices(annotation))
        _REGISTRY[pass_name] = PassInfo(pass_name, fn, options, tuple(preserves),
                                        inspect.getdoc(fn) or "", on)
        return fn

    return decorate


def is_registered(name: str) -> bool:
    _load_builtin_passes()
    return name in _REGISTRY


def get_pass(name: str) -> PassInfo:
    _load_builtin_passes()
    if name not in _REGISTRY:
        raise PipelineError(f"unknown pass '{name}'; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_passes() -> dict[str, PassInfo]:
    _load_builtin_passes()
    return dict(_REGISTRY)


def _load_builtin_passes() -> None:
    from . import passes  # noqa: F401  (registers the built-in passes on import)


# -- pipelines ---------------------------------------------------------------------------------

def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        value = ";".join(value)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f'"{text}"' if re.search(r'[,{}="\s]', text) else text


@dataclass(frozen=True)
class PassSpec:
    name: str
    options: tuple[tuple[str, Any], ...] = ()
    # Run only on the program's graphs of this kind (or of this name): ``apply(cleanup)``.
    nest: str | None = None

    def text(self) -> str:
        if not self.options:
            return self.name
        return self.name + "{" + ",".join(f"{k}={_format_value(v)}" for k, v in self.options) + "}"

    def __str__(self) -> str:
        return f"{self.nest}({self.text()})" if self.nest else self.text()


_NAME = re.compile(r'\s*([a-z][a-z0-9_]*)\s*')
_OPTION = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*("([^"]*)"|[^,"]*)\s*(,|$)')


def _parse_options(info: PassInfo, body: str) -> tuple[tuple[str, Any], ...]:
    raw, opos = {}, 0
    while opos < len(body.strip()):
        om = _OPTION.match(body, opos)
        if not om or om.end() == opos:
            raise PipelineError(f"cannot parse options of pass '{info.name}': {body!r}")
        raw[om.group(1)] = om.group(3) if om.group(3) is not None else om.group(2).strip()
        opos = om.end()
    return tuple(sorted(info.coerce(raw).items()))


def _parse_list(text: str, pos: int, nest: str | None, specs: list[PassSpec]) -> int:
    """Parse ``item,item,...`` from ``pos`` up to the end or a closing parenthesis; returns the end."""
    while True:
        m = _NAME.match(text, pos)
        if not m or m.end() == pos:
            raise PipelineError(f"cannot parse pipeline at column {pos}: {text[pos:pos + 30]!r} "
                                "(expected name, name{option=value,...} or kind(passes))")
        pos = m.end()
        if text.startswith("(", pos):
            if nest is not None:
                raise PipelineError(f"cannot parse pipeline at column {pos}: nests do not nest "
                                    f"('{m.group(1)}(' inside '{nest}(')")
            pos = _parse_list(text, pos + 1, m.group(1), specs)
            if not text.startswith(")", pos):
                raise PipelineError(f"cannot parse pipeline: '{m.group(1)}(' is not closed")
            pos += 1
        else:
            info = get_pass(m.group(1))
            options: tuple = ()
            if text.startswith("{", pos):
                close = text.find("}", pos)
                if close < 0:
                    raise PipelineError(f"cannot parse options of pass '{info.name}': no closing brace")
                options = _parse_options(info, text[pos + 1:close])
                pos = close + 1
            specs.append(PassSpec(info.name, options, nest))
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text) or text[pos] == ")":
            return pos
        if text[pos] != ",":
            raise PipelineError(f"cannot parse pipeline at column {pos}: {text[pos:pos + 30]!r} "
                                "(expected ',' between passes)")
        pos += 1
        if pos >= len(text.rstrip()):
            raise PipelineError(f"cannot parse pipeline {text!r}: it ends with a comma")


@dataclass(frozen=True)
class Pipeline:
    passes: tuple[PassSpec, ...]

    @classmethod
    def parse(cls, text: str) -> "Pipeline":
        """Parse ``name{opt=value,...},kind(name,...),...``; option values are typed by each pass."""
        text = text.strip()
        if not text:
            return cls(())
        if text.endswith(","):
            raise PipelineError(f"cannot parse pipeline {text!r}: it ends with a comma")
        specs: list[PassSpec] = []
        pos = _parse_list(text, 0, None, specs)
        if pos < len(text):
            raise PipelineError(f"cannot parse pipeline at column {pos}: unmatched {text[pos]!r}")
        return cls(tuple(specs))

    @classmethod
    def of(cls, *items: str | PassSpec) -> "Pipeline":
        specs: list[PassSpec] = []
        for item in items:
            specs.extend(cls.parse(item).passes if isinstance(item, str) else [item])
        return cls(tuple(specs))

    def __str__(self) -> str:
        parts: list[str] = []
        i = 0
        while i < len(self.passes):
            nest = self.passes[i].nest
            j = i
            while j < len(self.passes) and self.passes[j].nest == nest:
                j += 1
            texts = [p.text() for p in self.passes[i:j]]
            parts.extend([f"{nest}({','.join(texts)})"] if nest else texts)
            i = j
        return ",".join(parts)

    def __len__(self) -> int:
        return len(self.passes)


def spec(name: str, **options: Any) -> PassSpec:
    info = get_pass(name)
    return PassSpec(name, tuple(sorted(info.coerce(options).items())))


# -- analyses ----------------------------------------------------------------------------------

class AnalysisManager:
    """Lazily computed analyses of a graph, cached per graph version."""

    def __init__(self):
        self._cache: dict[tuple[int, int, str], Any] = {}
        self.computed = Counter()

    @staticmethod
    def _compute(name: str, graph: TrainGraph) -> Any:
        analyses = {"cost": lambda: graph_cost(graph.graph),
                    "memory": lambda: memory_profile(graph.graph),
                    "networkx": lambda: to_networkx(graph.graph),
                    "collectives": lambda: collectives(graph.graph),
                    "state_bytes": lambda: state_bytes(graph)}
        if name not in analyses:
            raise KeyError(f"unknown analysis '{name}'; known: {', '.join(analyses)}")
        return analyses[name]()

    def get(self, name: str, graph: TrainGraph) -> Any:
        key = (id(graph), graph.version, name)
        if key not in self._cache:
            self._cache[key] = self._compute(name, graph)
            self.computed[name] += 1
        return self._cache[key]

    def advance(self, graph: TrainGraph, old_version: int, preserves: tuple[str, ...]) -> None:
        """The graph changed: keep only what the pass preserved, under the new version."""
        for (gid, version, name), value in list(self._cache.items()):
            if gid == id(graph) and version == old_version:
                del self._cache[(gid, version, name)]
                if name in preserves:
                    self._cache[(gid, graph.version, name)] = value


# -- running ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides its graph and its options: the mesh and the analyses.

    Frozen: nothing a pass does through it reaches another pass. The plan is not here (the
    pipeline text carries every choice a pass makes, so the text reproduces the run); what a
    pass reports (``stat``, ``explain``) goes to this run's collectors, which the manager
    moves onto the pass's :class:`PassRecord`. The manager hands each pass run a context of
    its own (:meth:`for_run`).
    """

    # The mesh description (graph_ir.mesh.MeshDesc: size(axis), local_rank(axis), group_name(axis),
    # group_size(group_name)); a fake one for compiling without processes. None: a single process.
    mesh: Any = None
    analyses: AnalysisManager = field(default_factory=AnalysisManager, compare=False)
    # The name of the program's graph the running pass was given ("step", "grad", ...).
    graph_name: str = "step"
    stats: dict[str, Any] = field(default_factory=dict, compare=False)
    explained: list = field(default_factory=list, compare=False)

    @property
    def rank(self) -> int:
        return int(getattr(self.mesh, "rank", 0)) if self.mesh is not None else 0

    @property
    def world_size(self) -> int:
        return int(getattr(self.mesh, "world_size", 1)) if self.mesh is not None else 1

    def stat(self, key: str, value: Any) -> None:
        self.stats[key] = value

    def explain(self, explanation: Any) -> None:
        """Why the pass decided what it did (for the dump tool), one value per run."""
        self.explained[:] = [explanation]

    @property
    def explanation(self) -> Any:
        return self.explained[0] if self.explained else None

    def for_run(self, graph_name: str) -> "PassContext":
        return dataclasses.replace(self, graph_name=graph_name, stats={}, explained=[])


@dataclass
class PassRecord:
    index: int
    name: str
    spec: str
    seconds: float
    changed: bool
    nodes_before: int
    nodes_after: int
    ops_added: dict[str, int]
    ops_removed: dict[str, int]
    stats: dict[str, Any]
    verify_seconds: float = 0.0
    graph: str = "step"          # the program's graph it ran on; "program" for a program pass
    explanation: Any = None      # the pass's ctx.explain(...) value; dumped beside its graph

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "explanation"}


def _graphs_of(ir) -> list[TrainGraph]:
    return list(ir.graphs.values()) if isinstance(ir, Program) else [ir]


def _op_counts(ir) -> Counter:
    # Counted by target, then named: formatting an OpOverload per node costs more than counting.
    by_target = Counter(n.target for g in _graphs_of(ir) for n in g.compute_nodes())
    out: Counter = Counter()
    for target, count in by_target.items():
        out[str(target)] += count
    return out


def _state(ir, known: dict[int, GraphState] | None = None):
    """What a graph or a program is now (``TrainGraph.state``, compared with ``==``); ``known``:
    graphs' states already taken in their present form, by ``id``."""
    known = known or {}

    def of(g: TrainGraph) -> GraphState:
        return known.get(id(g)) or g.state()
    if isinstance(ir, Program):
        return tuple((k, of(g)) for k, g in ir.graphs.items())
    return of(ir)


def _num_nodes(ir) -> int:
    return sum(g.num_nodes() for g in _graphs_of(ir))


def _version(ir) -> tuple:
    return tuple((id(g), g.version) for g in _graphs_of(ir))


@dataclass
class PassRun:
    """One pass applied to one graph (or to the program), as the instruments see it."""

    index: int
    spec: PassSpec
    info: PassInfo
    target: str                 # the graph's name in the program, or "program"
    given: Any                  # the TrainGraph or Program handed to the pass
    ctx: PassContext
    pipeline: Pipeline
    result: Any = None
    seconds: float = 0.0
    verify_seconds: float = 0.0
    record: PassRecord | None = None
    scratch: dict[str, Any] = field(default_factory=dict)   # per-instrument state


class Instrument:
    """Hooks around every pass. ``before_pass`` runs in list order, ``after_pass`` and
    ``after_failure`` in reverse order, so an instrument wraps those after it;
    ``before_pipeline`` once per run, before the first pass."""

    def before_pipeline(self, program: Program, ctx: PassContext) -> None:
        pass

    def before_pass(self, run: PassRun) -> None:
        pass

    def after_pass(self, run: PassRun) -> None:
        pass

    def after_failure(self, run: PassRun, exc: Exception) -> Exception | None:
        """Return an exception to raise instead of the pass's own (the last one returned wins)."""
        return None


class Timing(Instrument):
    """The pass's own time (innermost: nothing else is timed with it)."""

    def before_pass(self, run: PassRun) -> None:
        log.info("pass %d/%d on %s: %s", run.index, len(run.pipeline), run.target, run.spec)
        run.scratch["timing"] = time.perf_counter()

    def after_pass(self, run: PassRun) -> None:
        run.seconds = time.perf_counter() - run.scratch["timing"]


class Verify(Instrument):
    """The verifier after every pass: each graph by its kind, and a program's flows.

    The rules on nodes (FX's lint, values, regions, module paths) are checked once per graph state
    and kind: a graph a pass left as it was (the same ``TrainGraph.state``: its nodes, arguments,
    tags and fake values; a pass that only marks nodes for a lowering) passed them when it was last
    changed, and gets the signature and program rules alone. ``deep`` re-propagates fake values
    through a graph (seconds on a Swin step), also once per state. The states go to
    ``run.scratch``, where :class:`Statistics` reads them instead of taking them again."""

    def __init__(self, level: str = "shallow"):
        self.level = level
        self._values_checked: dict[int, GraphState] = {}     # id(graph) -> its state when checked
        self._nodes_checked: dict[int, tuple] = {}           # id(graph) -> (state, kind) that passed

    def before_pipeline(self, program: Program, ctx: PassContext) -> None:
        self._values_checked, self._nodes_checked = {}, {}

    @staticmethod
    def _state(graph: TrainGraph, run: PassRun) -> GraphState:
        states = run.scratch.setdefault("states", {})
        if id(graph) not in states:
            states[id(graph)] = graph.state()
        return states[id(graph)]

    def _check_values(self, graph: TrainGraph, run: PassRun) -> bool:
        state = self._state(graph, run)
        if self._values_checked.get(id(graph)) == state:
            return False
        self._values_checked[id(graph)] = state
        return True

    def _check_nodes(self, graph: TrainGraph, run: PassRun) -> bool:
        return self._nodes_checked.get(id(graph)) != (self._state(graph, run), graph.attrs.get(GraphAttr.KIND))

    def after_pass(self, run: PassRun) -> None:
        if self.level == "off":
            return
        start = time.perf_counter()
        deep = self.level == "deep"
        graphs = list(_graphs_of(run.result))
        nodes = {id(g): self._check_nodes(g, run) for g in graphs}
        if isinstance(run.result, Program):
            verify_program(run.result, deep=lambda graph: deep and self._check_values(graph, run),
                           nodes=lambda graph: nodes[id(graph)])
        else:
            verify(run.result, deep=deep and self._check_values(run.result, run), nodes=nodes[id(run.result)])
        for graph in graphs:       # (verify raised if any rule failed)
            self._nodes_checked[id(graph)] = (self._state(graph, run), graph.attrs.get(GraphAttr.KIND))
        run.verify_seconds = time.perf_counter() - start


class Statistics(Instrument):
    """Changed or not (``TrainGraph.state`` before and after), node and op deltas, the pass's
    counters; bumps the graph version and drops the analyses the pass did not preserve.

    What a pass left is what the next pass is given (nothing else edits a graph between
    two passes of one run), so each graph's state is taken once per pass, not twice: it
    reads every node.
    """

    def __init__(self):
        self._last: dict[int, tuple] = {}     # id(ir) -> (ir, version, state, op counts, nodes)

    def before_pipeline(self, program: Program, ctx: PassContext) -> None:
        self._last = {}

    def _facts(self, ir) -> tuple[Any, Counter, int]:
        last = self._last.get(id(ir))
        if last is not None and last[0] is ir and last[1] == _version(ir):
            return last[2:]
        return _state(ir), _op_counts(ir), _num_nodes(ir)

    def before_pass(self, run: PassRun) -> None:
        run.scratch["stats"] = self._facts(run.given)

    def after_pass(self, run: PassRun) -> None:
        before_state, before_ops, before_nodes = run.scratch["stats"]
        result, ctx = run.result, run.ctx
        after_state = _state(result, run.scratch.get("states"))
        changed = after_state != before_state
        if changed:
            for graph in _graphs_of(result):
                old = graph.version
                graph.version = old + 1
                ctx.analyses.advance(graph, old, run.info.preserves)
        # An unchanged graph has the same nodes with the same targets: its counts are the ones before.
        after_ops = before_ops if not changed else _op_counts(result)
        self._last[id(result)] = (result, _version(result), after_state, after_ops, _num_nodes(result))
        if isinstance(result, Program):     # its graphs are what the next graph pass is given
            for graph in result.graphs.values():
                self._last.pop(id(graph), None)
        run.record = PassRecord(run.index, run.info.name, run.spec.text(), run.seconds, changed, before_nodes,
                                _num_nodes(result), dict(after_ops - before_ops), dict(before_ops - after_ops),
                                dict(ctx.stats), run.verify_seconds, run.target, ctx.explanation)
        if ctx.explanation is not None:
            run.record.stats.setdefault("explained", True)


class Dump(Instrument):
    """Every pass's graph(s) into the dump directory (a cann_passes.dump.DumpWriter)."""

    def __init__(self, writer):
        self.writer = writer

    def after_pass(self, run: PassRun) -> None:
        if isinstance(run.result, Program):
            self.writer.write_program_pass(run.record, run.result, run.ctx)
        else:
            self.writer.write_pass(run.record, run.result, run.ctx, graph=run.target)


class Reproducer(Instrument):
    """On failure: the graph the pass was given and the one-pass pipeline, as a directory.

    Passes edit their graph in place, so the graph a failing pass was given is gone by the
    time it fails. Copying every graph before every pass would cost a whole-graph copy per
    pass (seconds on a 7B-shaped step); instead the program the pipeline started from is
    kept — ``source()`` rebuilds it when the caller holds an unchanged original (the compile
    driver keeps the captured step), else one copy is taken before the first pass — and on
    failure the passes before the failing one are run again on it. Passes are
    deterministic functions of their graph and options, so that is the graph it was given.
    """

    def __init__(self, directory: str | None = None, fallback=None, source=None):
        self.directory = directory
        self.fallback = fallback        # () -> a directory, asked only when a pass fails
        self.source = source            # () -> a fresh copy of the program the pipeline starts from
        self._start: Callable[[], Program] | None = None

    def before_pipeline(self, program: Program, ctx: PassContext) -> None:
        if self.source is not None:
            self._start = self.source
        else:
            snapshot = program.copy()
            self._start = lambda: snapshot

    def _given(self, run: PassRun):
        """The graph (or program) ``run``'s pass was given, rebuilt by replaying the passes before it."""
        if self._start is None:
            return run.given
        program = self._start()
        ctx = PassContext(mesh=run.ctx.mesh)
        before = Pipeline(run.pipeline.passes[:run.index - 1])
        if before.passes:
            program = PassManager(before, instruments=[]).run_program(program, ctx)
        return program if run.target == "program" else program.graphs[run.target]

    def after_failure(self, run: PassRun, exc: Exception) -> Exception:
        if isinstance(exc, VerificationError):
            log.error("pass %s produced an invalid graph", run.spec)
        directory = self.directory or (self.fallback() if self.fallback else None)
        directory = directory or tempfile.mkdtemp(prefix="cann_passes_repro_")
        try:
            given = self._given(run)
        except Exception:  # the replay itself fails: what the pass left is the best there is
            log.exception("could not rebuild the graph pass %s was given", run.spec)
            given = run.given
        graph = given.main if isinstance(given, Program) else given
        try:
            path = write_reproducer(directory, graph, run.spec.text(), run.index, run.info.fn)
        except Exception:  # never hide the pass's own error behind a dump error
            log.exception("could not write the reproducer")
            path = None
        return PassFailure(run.info.name, run.index, str(run.pipeline), path, exc)


class PassManager:
    """Runs a pipeline over a graph or a program, with instruments around every pass."""

    def __init__(self, pipeline: Pipeline | str, *, verify_level: str = "shallow",
                 dump=None, reproducer_dir: str | None = None, instruments: list[Instrument] | None = None,
                 source: Callable[[], Program] | None = None):
        self.pipeline = Pipeline.parse(pipeline) if isinstance(pipeline, str) else pipeline
        self.verify_level = verify_level
        self.dump = dump                      # a DumpWriter, or None
        self.reproducer_dir = reproducer_dir
        self.records: list[PassRecord] = []
        if instruments is None:
            # ``source``: () -> a fresh copy of the program ``run`` will be given (see Reproducer).
            instruments = [Reproducer(reproducer_dir, lambda: self.dump.directory if self.dump else None,
                                      source)]
            instruments += [Dump(dump)] if dump is not None else []
            instruments += [Statistics(), Verify(verify_level), Timing()]
        self.instruments = instruments

    def run(self, graph: TrainGraph | Program, ctx: PassContext | None = None):
        """Run the pipeline. Given one graph, returns the graph (or the Program, if a pass split it)."""
        if isinstance(graph, Program):
            return self.run_program(graph, ctx)
        program = self.run_program(Program.of_step(graph), ctx)
        return program.graphs["step"] if list(program.graphs) == ["step"] else program

    def run_program(self, program: Program, ctx: PassContext | None = None) -> Program:
        ctx = ctx or PassContext()
        log.info("pipeline: %s", self.pipeline)
        for instrument in self.instruments:
            instrument.before_pipeline(program, ctx)
        for index, pass_spec in enumerate(self.pipeline.passes, start=1):
            info = get_pass(pass_spec.name)
            if info.on == "program":
                program = self._run_one(index, pass_spec, info, "program", program, ctx.for_run("program"))
                continue
            for name in list(program.graphs):
                if pass_spec.nest and pass_spec.nest not in (name, program.kind(name).value):
                    continue
                program.graphs[name] = self._run_one(index, pass_spec, info, name, program.graphs[name],
                                                     ctx.for_run(name))
        return program

    def _run_one(self, index: int, pass_spec: PassSpec, info: PassInfo, target: str, given, ctx: PassContext):
        run = PassRun(index, pass_spec, info, target, given, ctx, self.pipeline)
        try:
            for instrument in self.instruments:
                instrument.before_pass(run)
            result = info.fn(given, ctx, **dict(pass_spec.options))
            expected = Program if info.on == "program" else TrainGraph
            if not isinstance(result, expected):
                raise TypeError(f"a {info.on} pass must return a {expected.__name__}, got {type(result).__name__}")
            for graph in _graphs_of(result):
                graph.recompile()
            run.result = result
            for instrument in reversed(self.instruments):
                instrument.after_pass(run)
        except Exception as exc:
            failure: Exception | None = None
            for instrument in reversed(self.instruments):
                failure = instrument.after_failure(run, exc) or failure
            raise (failure or PassFailure(info.name, index, str(self.pipeline), None, exc)) from exc
        if run.record is not None:
            self.records.append(run.record)
        return run.result
