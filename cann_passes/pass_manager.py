"""Passes, pipelines and the pass manager.

A pass is a function ``fn(graph: TrainGraph, ctx: PassContext, *, <options>) -> TrainGraph``
registered with :func:`register_pass`. Its keyword-only parameters, with their
annotations and defaults, are its typed options. A pipeline is a list of
passes with options and has a text form that parses back to itself::

    cleanup,autocast{dtype=bf16},recompute{budget=0.5,policy=budget}

The manager runs a pipeline with instrumentation around every pass: timing,
the verifier, statistics (changed or not, nodes and ops added/removed, the
pass's own counters) and dumps. Analyses are cached per graph version and
dropped when a pass changes the graph, unless the pass declares it preserves
them. A failing pass is reported by name, with the graph it was given dumped
and the pipeline text that reproduces the failure.
"""
from __future__ import annotations

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
from graph_ir.verifier import VerificationError, verify

log = logging.getLogger("cann_passes")

PassFn = Callable[..., TrainGraph]


@dataclass(frozen=True)
class PassOption:
    name: str
    type: type
    default: Any


@dataclass(frozen=True)
class PassInfo:
    name: str
    fn: PassFn
    options: dict[str, PassOption]
    preserves: tuple[str, ...]
    doc: str

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


def _option_type(annotation: Any) -> type:
    if isinstance(annotation, str):  # unresolved "float | None"-style text
        first = annotation.split("|")[0].strip()
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(first, str)
    origin = typing.get_origin(annotation)
    if origin is not None:  # Optional[X] / X | None -> X
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if args else str
    return annotation if annotation is not inspect.Parameter.empty else str


def _convert(pass_name: str, option: PassOption, value: Any) -> Any:
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


def register_pass(name: str | None = None, *, preserves: tuple[str, ...] = ()):
    """Register ``fn(graph, ctx, *, options...) -> TrainGraph`` as a pass named ``name``."""

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
            options[p.name] = PassOption(p.name, _option_type(hints.get(p.name, p.annotation)), p.default)
        _REGISTRY[pass_name] = PassInfo(pass_name, fn, options, tuple(preserves),
                                        inspect.getdoc(fn) or "")
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
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f'"{text}"' if re.search(r'[,{}="\s]', text) else text


@dataclass(frozen=True)
class PassSpec:
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return self.name + "{" + ",".join(f"{k}={_format_value(v)}" for k, v in self.options) + "}"


_TOKEN = re.compile(r'\s*([a-z][a-z0-9_]*)\s*(\{([^{}]*)\})?\s*(,|$)')
_OPTION = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*("([^"]*)"|[^,"]*)\s*(,|$)')


@dataclass(frozen=True)
class Pipeline:
    passes: tuple[PassSpec, ...]

    @classmethod
    def parse(cls, text: str) -> "Pipeline":
        """Parse ``name{opt=value,...},name,...``; option values are typed by each pass."""
        specs, pos, text = [], 0, text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise PipelineError(f"cannot parse pipeline at column {pos}: {text[pos:pos + 30]!r} "
                                    "(expected name or name{option=value,...})")
            info = get_pass(m.group(1))
            raw = {}
            body = m.group(3) or ""
            opos = 0
            while opos < len(body.strip()):
                om = _OPTION.match(body, opos)
                if not om or om.end() == opos:
                    raise PipelineError(f"cannot parse options of pass '{info.name}': {body!r}")
                raw[om.group(1)] = om.group(3) if om.group(3) is not None else om.group(2).strip()
                opos = om.end()
            specs.append(PassSpec(info.name, tuple(sorted(info.coerce(raw).items()))))
            pos = m.end()
        if text.endswith(","):
            raise PipelineError(f"cannot parse pipeline {text!r}: it ends with a comma")
        return cls(tuple(specs))

    @classmethod
    def of(cls, *items: str | PassSpec) -> "Pipeline":
        specs: list[PassSpec] = []
        for item in items:
            specs.extend(cls.parse(item).passes if isinstance(item, str) else [item])
        return cls(tuple(specs))

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.passes)

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
        from graph_ir.analysis import graph_cost, memory_profile, to_networkx
        analyses = {"cost": lambda: graph_cost(graph.graph),
                    "memory": lambda: memory_profile(graph.graph),
                    "networkx": lambda: to_networkx(graph.graph)}
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

@dataclass
class PassContext:
    """What a pass may read besides the graph: the plan, analyses, the world, its own counters."""

    plan: Any = None
    analyses: AnalysisManager = field(default_factory=AnalysisManager)
    rank: int = 0
    world_size: int = 1
    device_profile: Any = None
    stats: dict[str, Any] = field(default_factory=dict)
    # The device mesh, for distributed passes: duck-typed with group_name(dim), size(dim) and
    # local_rank(dim) (see cann_passes.runtime.distributed.MeshInfo); None in a single process.
    mesh: Any = None
    # Per-pass explanations for the dump tool (e.g. why a value was recomputed).
    explain: dict[str, Any] = field(default_factory=dict)

    def stat(self, key: str, value: Any) -> None:
        self.stats[key] = value


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

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _op_counts(graph: TrainGraph) -> Counter:
    return Counter(str(n.target) for n in graph.compute_nodes())


class PassManager:
    def __init__(self, pipeline: Pipeline | str, *, verify_level: str = "shallow",
                 dump=None, reproducer_dir: str | None = None):
        self.pipeline = Pipeline.parse(pipeline) if isinstance(pipeline, str) else pipeline
        self.verify_level = verify_level
        self.dump = dump                      # a DumpWriter, or None
        self.reproducer_dir = reproducer_dir
        self.records: list[PassRecord] = []

    def run(self, graph: TrainGraph, ctx: PassContext | None = None) -> TrainGraph:
        ctx = ctx or PassContext()
        log.info("pipeline: %s", self.pipeline)
        for i, pass_spec in enumerate(self.pipeline.passes, start=1):
            log.info("pass %d/%d: %s", i, len(self.pipeline), pass_spec)
            graph = self._run_one(i, pass_spec, graph, ctx)
        return graph

    def _run_one(self, index: int, pass_spec: PassSpec, graph: TrainGraph, ctx: PassContext) -> TrainGraph:
        info = get_pass(pass_spec.name)
        given = graph.copy()
        before_fp, before_ops, before_nodes = graph.fingerprint(), _op_counts(graph), graph.num_nodes()
        ctx.stats = {}
        start = time.perf_counter()
        try:
            result = info.fn(graph, ctx, **dict(pass_spec.options))
            if not isinstance(result, TrainGraph):
                raise TypeError(f"a pass must return a TrainGraph, got {type(result).__name__}")
            result.recompile()
            seconds = time.perf_counter() - start
            changed = result.fingerprint() != before_fp
            if changed:
                old = result.version
                result.version = old + 1
                ctx.analyses.advance(result, old, info.preserves)
            verify_start = time.perf_counter()
            if self.verify_level != "off":
                verify(result, deep=self.verify_level == "deep")
            verify_seconds = time.perf_counter() - verify_start
        except Exception as exc:
            raise self._failure(index, pass_spec, given, exc, ctx) from exc
        after_ops = _op_counts(result)
        record = PassRecord(index, info.name, str(pass_spec), seconds, changed, before_nodes,
                            result.num_nodes(), dict(after_ops - before_ops),
                            dict(before_ops - after_ops), dict(ctx.stats), verify_seconds)
        if ctx.explain.get(info.name) is not None:
            record.stats.setdefault("explained", True)
        self.records.append(record)
        if self.dump is not None:
            self.dump.write_pass(record, result, ctx)
        return result

    def _failure(self, index: int, pass_spec: PassSpec, given: TrainGraph, exc: Exception,
                 ctx: PassContext) -> PassFailure:
        from .dump import write_reproducer
        if isinstance(exc, VerificationError):
            log.error("pass %s produced an invalid graph", pass_spec.name)
        directory = self.reproducer_dir or (self.dump.directory if self.dump else None)
        directory = directory or tempfile.mkdtemp(prefix="cann_passes_repro_")
        try:
            path = write_reproducer(directory, given, str(pass_spec), index,
                                    plan=ctx.plan.to_dict() if ctx.plan is not None else None)
        except Exception:  # never hide the pass's own error behind a dump error
            log.exception("could not write the reproducer")
            path = None
        return PassFailure(pass_spec.name, index, str(self.pipeline), path, exc)
