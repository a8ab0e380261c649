"""The compile cache: a second process with the same model and plan skips capture and the passes.

A compiled step is specialised on the model (its modules' classes and settings, parameter and
buffer names, shapes, dtypes, ``requires_grad``, training modes, tied weights), the loss
function, the optimizer (its class, every hyperparameter of every group, its state's layout),
the batch signature, the plan, the mesh description, the backend, torch's version, this
package's version and sources, and the source of the user's code. The cache key is a hash of
all of that; an entry holds what compiling produced: the captured graph, the
:class:`~graph_ir.program.Program` (``graph_ir.serialize`` with every value's layout, so nothing
is re-propagated), where each input comes from (``StepLayout``), the pass records and the
passes' explanations. Lowering is not stored here: inductor's own FX graph cache and
AOTAutograd cache make the second ``compile_fx`` of the same graph a lookup
(:func:`lowering_context` gives them the ShapeEnv they need).

The user's code is every loaded Python module outside the Python installation (stdlib,
site-packages) and this package, by content; libraries by version. So an edit to the model,
the loss, or a helper they call misses the cache; what no key can see (a library edited in
place without a version change, state read from files at trace time) needs the cache off.

Where: ``Plan.compile_cache`` (a directory, or ``"off"``), else ``$CANN_PASSES_COMPILE_CACHE``
(likewise), else ``~/.cache/cann_recipes_train/compile``. A plan that dumps its passes
compiles without the cache (the dumps need the passes to run). An entry that cannot be read,
was written by another format, or does not verify is ignored with a log line and compiled
anew; entries are written to a temporary directory and renamed into place, so a reader never
sees half an entry.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_ir import TrainGraph
from graph_ir.capture import StepLayout
from graph_ir.guards import rebuild
from graph_ir.mesh import MeshDesc
from graph_ir.meta import GraphAttr
from graph_ir.program import Flow, Program, Run
from graph_ir.serialize import from_json, to_json
from graph_ir.signature import Spec
from graph_ir.verifier import verify_program

from .lowering import required_passes
from .pass_manager import PassContext, PassRecord

log = logging.getLogger("cann_passes")

ENV_VAR = "CANN_PASSES_COMPILE_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "cann_recipes_train", "compile")
FORMAT = 3
_OFF = ("off", "0", "false", "no", "none", "")


def cache_dir(plan) -> str | None:
    """The cache directory for ``plan``, or None when caching is off."""
    if getattr(plan, "dump_dir", None) or os.environ.get("CANN_PASSES_DUMP"):
        return None
    value = getattr(plan, "compile_cache", None)
    if value is None:
        value = os.environ.get(ENV_VAR)
    if value is None:
        value = DEFAULT_DIR
    if str(value).strip().lower() in _OFF:
        return None
    return os.path.expanduser(str(value))


# -- the key -------------------------------------------------------------------------------------

_SOURCES: dict[str, str] = {}
# A source file edited after this process started may differ from the code it runs: its hash
# would file this process's program under the edited code's key, so such a compile skips the cache.
_STARTED = time.time()
MAX_BYTES = 1 << 30        # entries beyond this total are evicted, least recently written first


class Unkeyable(RuntimeError):
    pass


def _file_hash(path: str) -> str:
    if path not in _SOURCES:
        with open(path, "rb") as f:
            _SOURCES[path] = hashlib.sha256(f.read()).hexdigest()
    return _SOURCES[path]


def _installation_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def _hash_source(real: str) -> str:
    if os.path.getmtime(real) > _STARTED:
        raise Unkeyable(f"{real} changed after this process started")
    return _file_hash(real)


def _package_dirs() -> tuple[str, ...]:
    import graph_ir
    here = os.path.dirname(os.path.realpath(__file__))
    return (here + os.sep, os.path.dirname(os.path.realpath(graph_ir.__file__)) + os.sep)


def _code_sources() -> dict[str, str]:
    """Content hash of this package's sources (graph_ir, cann_passes: every file, loaded or
    not, since passes and backends are imported on first use) and of every loaded .py module
    outside the Python installation and this package (the user's code), by path."""
    out = {}
    own = _package_dirs()
    for root in own:
        for folder, _, files in os.walk(root):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    out[path] = _hash_source(path)
    skip = _installation_dirs() + own
    unresolved = tuple(d for d in (sys.prefix, sys.base_prefix, sys.exec_prefix))
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or path.startswith(unresolved):
            continue
        real = os.path.realpath(path)
        if real.startswith(skip) or not os.path.exists(real):
            continue
        out[real] = _hash_source(real)
    return dict(sorted(out.items()))


def _describe(value: Any) -> Any:
    """A stable description of a setting: its repr when that names no memory address."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    text = repr(value)
    return text if " at 0x" not in text else type(value).__qualname__


def _library_versions(objects) -> dict[str, str]:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for obj in objects:
        top = (getattr(obj, "__module__", None) or "").split(".")[0]
        module = sys.modules.get(top)
        if module is not None and getattr(module, "__version__", None):
            out[top] = str(module.__version__)
    try:
        from importlib.metadata import version
        out["cann-recipes-train"] = version("cann-recipes-train")
    except Exception:
        out["cann-recipes-train"] = "source"
    return out


def _model_facts(model: torch.nn.Module) -> dict:
    modules = []
    for path, module in model.named_modules(remove_duplicate=False):
        settings = {k: _describe(v) for k, v in sorted(vars(module).items())
                    if not k.startswith("_") and not isinstance(v, (torch.nn.Module, torch.Tensor))}
        hooks = [_describe(h) for d in (module._forward_pre_hooks, module._forward_hooks)
                 for h in d.values()]
        modules.append([path, f"{type(module).__module__}.{type(module).__qualname__}", module.training,
                        settings, hooks])
    first: dict[int, str] = {}
    params = []
    for name, p in model.named_parameters(remove_duplicate=False):
        params.append([name, list(p.shape), str(p.dtype), p.device.type, p.requires_grad,
                       first.setdefault(id(p), name)])
    buffers = [[n, list(b.shape), str(b.dtype), b.device.type] for n, b in model.named_buffers()]
    return {"modules": modules, "params": params, "buffers": buffers}


def _optimizer_facts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{k: (_describe(v) if k != "params" else [names.get(id(p), "?") for p in v])
               for k, v in sorted(group.items())} for group in optimizer.param_groups]
    state = {names.get(id(p), "?"): {k: _describe(v) for k, v in sorted(s.items())}
             for p, s in optimizer.state.items() if s}
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "groups": groups,
            "state": dict(sorted(state.items()))}


def _function_facts(fn) -> Any:
    code = getattr(fn, "__code__", None)
    facts = {"name": _describe(fn)}
    if code is not None:
        facts["code"] = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()
        facts["closure"] = [_describe(c.cell_contents) for c in (fn.__closure__ or ())]
    return facts


def _batch_facts(batch: Any) -> Any:
    leaves, spec = pytree.tree_flatten(batch)
    return {"spec": str(spec), "leaves": [[list(t.shape), str(t.dtype), t.device.type]
                                          if isinstance(t, torch.Tensor) else type(t).__name__
                                          for t in leaves]}


def cache_key(model, optimizer, loss_fn, batch, plan, mesh: MeshDesc, backend: str) -> tuple[str, dict]:
    """The key and the facts it hashes (kept in the entry, to say why two keys differ)."""
    plan_facts = {k: _describe(v) for k, v in plan.to_dict().items() if k not in ("dump_dir", "compile_cache")}
    facts = {"format": FORMAT, "versions": _library_versions([type(m) for m in model.modules()] + [loss_fn]),
             "sources": _code_sources(), "model": _model_facts(model),
             "optimizer": _optimizer_facts(model, optimizer), "loss_fn": _function_facts(loss_fn),
             "batch": _batch_facts(batch), "plan": plan_facts, "mesh": mesh.to_json(), "backend": backend,
             # The backend's passes depend on it (required_passes), so the cached program does.
             "required_passes": list(required_passes(backend)),
             "torch": {"default_dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
                       "autocast": [[d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))]
                                    for d in ("cpu", "cuda")],
                       "deterministic": torch.are_deterministic_algorithms_enabled()}}
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), facts


# -- entries -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Entry:
    captured: TrainGraph
    program: Program
    layout: StepLayout
    records: list[PassRecord]
    guards: list = dataclasses.field(default_factory=list)   # rebuilt against the live model and loss


def _layout_json(layout: StepLayout) -> dict:
    data = dataclasses.asdict(layout)
    data["batch_spec"] = pytree.treespec_dumps(layout.batch_spec)
    return data


def _layout_from_json(data: dict) -> StepLayout:
    data = dict(data)
    data["batch_spec"] = pytree.treespec_loads(data["batch_spec"])
    data["state_keys"] = {k: tuple(v) for k, v in data["state_keys"].items()}
    return StepLayout(**data)


def graph_constants(tg: TrainGraph) -> dict[str, torch.Tensor]:
    """The tensors a graph reads by `get_attr`, by target: what its JSON form leaves out."""
    return {n.target: getattr(tg.gm, n.target) for n in tg.graph.nodes if n.op == "get_attr"}


def _spec(data: dict) -> Spec:
    return Spec(data["kind"], data["name"])


def for_step(step) -> "CompileCache | None":
    """The cache a ``CompiledStep`` uses: its plan's directory, in a single process (a distributed
    or pipelined step's shards and stages are not cached yet)."""
    directory = cache_dir(step.plan)
    if directory is None or step.world is not None or getattr(step.plan, "pp", 1) > 1:
        return None
    return CompileCache(directory)


class CompileCache:
    def __init__(self, directory: str):
        self.directory = directory

    def key(self, step, batch) -> tuple[str | None, dict | None]:
        """The key of ``step``'s compilation for ``batch``; (None, None) when it cannot be keyed."""
        try:
            return cache_key(step.model, step.optimizer, step.loss_fn, batch, step.plan, step.mesh, step.backend)
        except Unkeyable as exc:
            log.info("compile cache: not used for this compile (%s)", exc)
            return None, None

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key)

    def load(self, key: str | None, model=None, loss_fn=None) -> Entry | None:
        """The entry for ``key``; None when there is none or it cannot be used (logged), or when a
        Python value its trace read (its guards) is not what ``model`` and ``loss_fn`` hold now."""
        if key is None:
            return None
        path = self.path(key)
        if not os.path.isdir(path):
            return None
        # A graph may hold ops a pass defines (``torch.library.custom_op``, e.g. linear_on_onednn's
        # ``cann.onednn_linear``); they exist once the pass modules are imported, which a process
        # that loads its step from the cache has not needed yet.
        from . import passes  # noqa: F401
        try:
            entry = self._read(path, key)
        except Exception as exc:  # stale format, truncated file, a graph that does not verify
            log.warning("compile cache: ignoring entry %s (%s: %s); compiling anew", path,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if model is not None:
            guards = rebuild(entry.guards, model, loss_fn)
            now = None if guards is None else [g.fingerprint() for g in guards]
            if now != [g["fingerprint"] for g in entry.guards]:
                log.info("compile cache: entry %s was traced with other Python values (%s); compiling anew",
                         path, "a guarded value is gone" if now is None else next(
                             g.where for g, d, n in zip(guards, entry.guards, now) if d["fingerprint"] != n))
                return None
            entry.guards = guards
        log.info("compile cache: hit %s", path)
        entry.program.attrs[GraphAttr.COMPILE_CACHE] = "hit"
        return entry

    def _read(self, path: str, key: str) -> Entry:
        with open(os.path.join(path, "entry.json"), encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT or data.get("key") != key:
            raise ValueError(f"entry format {data.get('format')} / key {str(data.get('key'))[:12]} "
                             f"is not format {FORMAT} / key {key[:12]}")
        constants_path = os.path.join(path, "constants.pt")
        constants = torch.load(constants_path, weights_only=True) if os.path.exists(constants_path) else {}
        captured = from_json(data["captured"], constants.get("captured"), recorded_values=True)
        graphs = {name: from_json(g, constants.get(name), recorded_values=True)
                  for name, g in data["program"]["graphs"].items()}
        prog = data["program"]
        program = Program(graphs, [Run(r["graph"], r["every"]) for r in prog["schedule"]],
                          MeshDesc.from_json(prog["mesh"]),
                          [Flow(f["source"], _spec(f["output"]), f["target"], _spec(f["input"]))
                           for f in prog["flows"]], dict(prog["attrs"]))
        verify_program(program)
        records = [PassRecord(**r) for r in data["records"]]
        return Entry(captured, program, _layout_from_json(data["layout"]), records, data["guards"])

    def store(self, key: str, facts: dict, captured: TrainGraph, program: Program, layout: StepLayout,
              guards: list = ()) -> str:
        """Write the entry for ``key`` (atomically), with the fingerprint of every guarded value; returns
        what happened ("stored <key>", or why not: a guarded value no other process could compare)."""
        if key is None:
            return "not keyable"
        fingerprints = [g.fingerprint() for g in guards]
        if None in fingerprints:
            where = guards[fingerprints.index(None)].where
            log.info("compile cache: not stored: %s has no value another process could compare", where)
            return f"not stored ({where} cannot be compared across processes)"
        path = self.path(key)
        try:
            data = {"format": FORMAT, "key": key, "facts": facts,
                    "captured": to_json(captured, with_cost=False, layouts=True),
                    "program": {"graphs": {n: to_json(g, with_cost=False, layouts=True)
                                           for n, g in program.graphs.items()},
                                "schedule": [{"graph": r.graph, "every": r.every} for r in program.schedule],
                                "flows": [{"source": f.source, "output": f.output.to_json(), "target": f.target,
                                           "input": f.input.to_json()} for f in program.flows],
                                "mesh": program.mesh.to_json(), "attrs": program.attrs},
                    "layout": _layout_json(layout),
                    "records": [r.to_json() | {"explanation": r.explanation} for r in program.records],
                    "guards": [g.descriptor() | {"fingerprint": f} for g, f in zip(guards, fingerprints)]}
            text = json.dumps(data, default=str)
            constants = {name: c for name, c in (("captured", graph_constants(captured)),
                                                 *((n, graph_constants(g)) for n, g in program.graphs.items())) if c}
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=os.path.dirname(path))
            with open(os.path.join(tmp, "entry.json"), "w", encoding="utf-8") as f:
                f.write(text)
            if constants:
                torch.save(constants, os.path.join(tmp, "constants.pt"))
            if os.path.isdir(path):          # a stale or unreadable entry under this key
                shutil.rmtree(path, ignore_errors=True)
            try:
                os.rename(tmp, path)
            except OSError:                  # another process wrote it first: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
            self.evict()
        except Exception as exc:
            log.warning("compile cache: could not write %s (%s: %s)", path, type(exc).__name__, exc)
            return f"not stored ({type(exc).__name__})"
        return f"stored {key[:16]}"

    def evict(self, max_bytes: int = MAX_BYTES) -> None:
        """Remove the oldest entries until the cache holds at most ``max_bytes``."""
        entries = []
        for shard in os.scandir(self.directory):
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard.path):
                if entry.is_dir() and not entry.name.startswith("."):
                    files = [f.stat() for f in os.scandir(entry.path) if f.is_file()]
                    entries.append((max((f.st_mtime for f in files), default=0), sum(f.st_size for f in files),
                                    entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= max_bytes:
                break
            shutil.rmtree(path, ignore_errors=True)
            total -= size


@contextlib.contextmanager
def lowering_context(backend: str):
    """Around lowering: let inductor's FX graph cache and AOTAutograd cache work.

    ``compile_fx`` given real example inputs makes a fake mode without a ShapeEnv, and both
    caches then bypass ("No shape env": their keys carry shape guards). A tracing context whose
    fake mode has one, with static shapes (so nothing becomes symbolic and the kernels are the
    ones compiled without it), makes the second process's lowering a cache lookup. Both apply the
    inductor settings for whole steps (:mod:`cann_passes.lowering.inductor_config`)."""
    if backend != "inductor":
        yield
        return
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .lowering.inductor_config import step_settings
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with tracing(TracingContext(fake_mode)), step_settings():
        yield


def context_for(mesh: MeshDesc) -> PassContext:
    """The pass context of a cached compilation (fresh analyses; explanations are on its records)."""
    return PassContext(mesh=mesh)
