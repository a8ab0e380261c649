"""Guards: the Python state a captured step read and baked into its graph, checked at every call.

Tracing runs ``loss_fn(model, batch)`` once; whatever Python values it read then (a module's
``self.scale``, a flag that picks a code path, ``nn.Dropout.p``, a plain tensor attribute, a
label smoothing or class weights the loss takes from a global or a closure) are constants of the
graph. A guard records such a read and its value; the step driver checks every guard before each
call and compiles anew, with the reason, when one no longer holds (what ``torch.compile``'s guards
do for the frames Dynamo traces).

What is recorded:

- every read of a module's instance attribute (its ``__dict__``) during the trace, except
  ``nn.Module``'s own bookkeeping (hooks, ``_parameters``, ``_modules``, ...); parameters,
  buffers and submodules are the graph's inputs or the model's structure, keyed elsewhere;
- every read, through such an attribute, of a plain object's attributes (a model's config:
  ``self.config.scale``, including properties and transformers' aliased names) whose value is a
  number, string, tensor or a container of them: an edit of the object in place is seen, not
  only its replacement;
- the globals and closure cells that ``loss_fn`` and every module's ``forward`` name, and those
  of the functions and methods they name that are the user's own code (not torch's, not an
  installed library's), followed three calls deep;
- the module tree and its hooks, as one number: which module each submodule slot holds, the
  forward / backward (pre-)hooks of every module and the global ones, and which parameters
  have gradient hooks (a swapped activation module or a hook registered after capture recompiles).

A value is compared by what it is: numbers, strings, ``None``, dtypes and devices, and tuples,
lists and dicts of them by value; a plain tensor by identity and version counter (replaced or
changed in place); anything else by identity. :meth:`Guard.fingerprint` says the same across
processes (a tensor by its contents), for the persistent compile cache; None where a value has
no such form (then the step is not cached).
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import logging
import os
import re
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

_MISSING = object()
# nn.Module's own instance attributes: hooks and bookkeeping, which tracing reads (and capture's
# own hooks change) but which are not values the graph was specialised on.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()).keys())
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_MAX_HASHED_ELEMENTS = 1 << 20


def _summary(value: Any) -> tuple:
    """What a guard compares, in this process."""
    if isinstance(value, _PLAIN):
        return ("value", type(value).__name__, repr(value))
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return ("tensor", id(value), value._version, tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return (type(value).__name__, tuple(_summary(v) for v in value))
    if isinstance(value, dict) and len(value) <= 64 and all(isinstance(k, _PLAIN) for k in value):
        return ("dict", tuple((repr(k), _summary(v)) for k, v in value.items()))
    return ("object", id(value))


def _fingerprint(value: Any, depth: int = 0) -> str | None:
    """The same comparison across processes; None where there is none."""
    if depth > 4:
        return None
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        if value.is_meta or value.numel() > _MAX_HASHED_ELEMENTS:
            return None
        data = value.detach().cpu().contiguous()
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return f"tensor:{tuple(value.shape)}:{value.dtype}:{digest[:16]}"
    if isinstance(value, (tuple, list, set, frozenset)):
        parts = [_fingerprint(v, depth + 1) for v in value]
        parts = sorted(parts, key=str) if isinstance(value, (set, frozenset)) else parts
        return None if None in parts else f"{type(value).__name__}[{','.join(parts)}]"
    if isinstance(value, dict) and all(isinstance(k, _PLAIN) for k in value):
        parts = [_fingerprint(v, depth + 1) for v in value.values()]
        return None if None in parts else "dict{" + ",".join(f"{k!r}:{p}" for k, p in zip(value, parts)) + "}"
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        # The code itself is in the compile cache's key (the sources of every loaded module).
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, logging.Logger):
        return f"logger:{value.name}"
    if isinstance(value, re.Pattern):
        return f"pattern:{value.pattern!r}:{value.flags}"
    if isinstance(value, torch.nn.Module):
        return "module-object"      # the model's modules are keyed by the cache's model facts
    if hasattr(value, "__dict__") and not callable(value):   # a plain object, a model config
        inner = _fingerprint({k: v for k, v in vars(value).items() if not k.startswith("__")}, depth + 1)
        return None if inner is None else f"{type(value).__module__}.{type(value).__qualname__}{inner}"
    return None


@dataclass
class Guard:
    """One Python value the trace read: where it lives and what it was."""

    kind: str                        # "attribute" | "global" | "closure" | "structure"
    owner: str                       # a module path ("" the model), or "loss_fn" / "forward:<path>"
    name: str
    read: Callable[[], Any]          # the value now
    recorded: tuple                  # _summary of the value at capture

    @property
    def where(self) -> str:
        if self.kind == "structure":
            return "the model's submodules or hooks (a module swapped, a hook registered or removed)"
        if self.kind == "attribute":
            return f"attribute {self.owner + '.' if self.owner else ''}{self.name} of the model"
        return f"{self.kind} {self.name!r} of {self.owner}"

    def holds(self) -> bool:
        try:
            return _summary(self.read()) == self.recorded
        except Exception:  # a cell emptied, a module removed: not what was traced
            return False

    def fingerprint(self) -> str | None:
        try:
            if self.kind == "structure":    # the value itself holds object ids, which differ per process
                return self.read.portable()
            return _fingerprint(self.read())
        except Exception:
            return None

    def describe_change(self) -> str:
        try:
            now = self.read()
        except Exception as exc:
            return f"{self.where} can no longer be read ({type(exc).__name__})"
        if self.kind == "structure":
            return f"{self.where} changed"
        return f"{self.where} changed (now {_short(now)})"

    def descriptor(self) -> dict:
        return {"kind": self.kind, "owner": self.owner, "name": self.name}


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, version {value._version}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- recording -------------------------------------------------------------------------------------

def _reader_of_attribute(module: torch.nn.Module, name: str) -> Callable[[], Any]:
    return lambda: object.__getattribute__(module, "__dict__").get(name, _MISSING)


def _reader_of_object_attribute(obj, cls: type, name: str) -> Callable[[], Any]:
    # Through the class's own __getattribute__: properties and aliases read as the model reads them.
    return lambda: cls.__getattribute__(obj, name)


_HEAP_TYPE = 1 << 9     # Py_TPFLAGS_HEAPTYPE: a class defined in Python, whose instances may change class


def _is_plain_object(value: Any) -> bool:
    """An object whose attributes the trace may read (a config): a Python class's instance with a
    ``__dict__``, not a tensor, module, function, class or anything callable."""
    return (hasattr(value, "__dict__") and not callable(value) and type(value).__flags__ & _HEAP_TYPE
            and not isinstance(value, (torch.Tensor, torch.nn.Module, types.ModuleType, type, enum.Enum,
                                       logging.Logger)))


def _is_value(value: Any) -> bool:
    """What an object-attribute guard compares by value (an object, compared by identity, would fail
    for a property that builds a new one at each read)."""
    if isinstance(value, _PLAIN) or (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return all(_is_value(v) for v in value)
    if isinstance(value, dict) and len(value) <= 64:
        return all(isinstance(k, _PLAIN) and _is_value(v) for k, v in value.items())
    return False


def _reader_of_global(fn, name: str) -> Callable[[], Any]:
    namespace = fn.__globals__
    return lambda: namespace.get(name, _MISSING)


def _reader_of_cell(cell) -> Callable[[], Any]:
    return lambda: cell.cell_contents


def _function_of(fn):
    """The Python function behind a callable (a bound method, a functools.partial); None if none."""
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "func") and not hasattr(fn, "__code__"):
        fn = fn.func
    return fn if isinstance(fn, types.FunctionType) else None


_NOT_USERS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}) + (
    os.path.dirname(torch.__file__),)
_HELPER_DEPTH = 3


def _is_users_code(fn) -> bool:
    filename = os.path.abspath(fn.__code__.co_filename)
    return not filename.startswith(_NOT_USERS) and not fn.__code__.co_filename.startswith("<frozen")


def _names_of(fn, cls: type | None = None) -> list[tuple[str, str, Callable[[], Any]]]:
    """(kind, name, reader) of the globals and closure cells ``fn`` names, and of those of the user's
    own functions it names (a helper ``h``'s global ``X`` is ``h.X``); ``cls`` gives methods too."""
    out: list = []
    seen: set = set()

    def walk(fn, prefix: str, depth: int) -> None:
        fn = _function_of(fn)
        if fn is None or fn in seen:
            return
        seen.add(fn)
        code = fn.__code__
        helpers = []
        for name in code.co_names:
            # Globals only: a builtin (len, range) is no value of the user's.
            if name in fn.__globals__:
                out.append(("global", prefix + name, _reader_of_global(fn, name)))
                helpers.append((name, fn.__globals__[name]))
            elif cls is not None and isinstance(inspect.getattr_static(cls, name, None), types.FunctionType):
                helpers.append((name, inspect.getattr_static(cls, name)))    # self.helper(...)
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            if name == "__class__":
                continue
            out.append(("closure", prefix + name, _reader_of_cell(cell)))
            try:
                helpers.append((name, cell.cell_contents))
            except ValueError:
                pass
        if depth >= _HELPER_DEPTH:
            return
        for name, value in helpers:
            helper = _function_of(value)
            if helper is not None and _is_users_code(helper):
                walk(helper, f"{prefix}{name}.", depth + 1)

    walk(fn, "", 0)
    return out


class GuardRecorder:
    """Records the reads a trace makes; :meth:`guards` lists one guard per value read."""

    def __init__(self):
        self._reads: dict[tuple, Guard] = {}

    def _add(self, kind: str, owner: str, name: str, read: Callable[[], Any]) -> None:
        key = (kind, owner, name)
        if key in self._reads:
            return
        try:
            value = read()
        except Exception:
            return
        if value is _MISSING or isinstance(value, torch.nn.Parameter):
            return
        self._reads[key] = Guard(kind, owner, name, read, _summary(value))

    def functions(self, model: torch.nn.Module, loss_fn) -> None:
        """The globals and closure cells of ``loss_fn`` and of every module's ``forward``."""
        for kind, name, read in _names_of(loss_fn):
            self._add(kind, "loss_fn", name, read)
        seen = set()
        for path, module in model.named_modules():
            forward = type(module).forward
            if forward in seen:
                continue
            seen.add(forward)
            for kind, name, read in _names_of(forward, type(module)):
                self._add(kind, f"forward of {type(module).__qualname__}", name, read)

    @contextlib.contextmanager
    def attributes(self, model: torch.nn.Module):
        """Within the block, every module of ``model`` records the reads of its instance attributes."""
        paths = {}
        for path, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), path)
        swapped = []
        recorder = self

        watched: dict[type, type] = {}

        def watch(obj, cls: type, hook) -> None:
            if cls not in watched:   # one recording subclass per class, named as the class
                watched[cls] = type(cls.__name__, (cls,), {"__getattribute__": hook,
                                                           "__module__": cls.__module__,
                                                           "__qualname__": cls.__qualname__})
            try:
                # object's own setter: a frozen dataclass's __setattr__ refuses every name.
                object.__setattr__(obj, "__class__", watched[cls])
            except TypeError:    # a layout the subclass cannot take (slots): its reads go unrecorded
                return
            swapped.append((obj, cls))

        def getattribute(self, name):
            value = object.__getattribute__(self, name)
            if name not in _MODULE_INTERNALS and not name.startswith("__"):
                instance = object.__getattribute__(self, "__dict__")
                if name in instance and not isinstance(value, (torch.nn.Module, types.MethodType)):
                    path = paths.get(id(self), "")
                    recorder._add("attribute", path, name, _reader_of_attribute(self, name))
                    if _is_plain_object(value) and id(value) not in paths:
                        paths[id(value)] = f"{path}.{name}" if path else name
                        watch(value, type(value), object_getattribute)
            return value

        def object_getattribute(self, name):
            cls = type(self).__mro__[1]      # the object's own class (its recording subclass is first)
            value = cls.__getattribute__(self, name)
            # A copy made while tracing (config.to_dict deep-copies) has the recording class but no path.
            path = paths.get(id(self))
            if path is not None and not name.startswith("__") and _is_value(value):
                recorder._add("attribute", path, name, _reader_of_object_attribute(self, cls, name))
            return value

        for module in {id(m): m for m in model.modules()}.values():
            watch(module, type(module), getattribute)
        try:
            yield
        finally:
            for obj, cls in reversed(swapped):
                object.__setattr__(obj, "__class__", cls)

    def structure(self, model: torch.nn.Module) -> None:
        """The model's module tree and every hook on it: a submodule swapped for another, or a hook
        registered or removed after capture (which the trace ran, or did not), recompiles."""
        self._add("structure", "", "modules and hooks", _reader_of_structure(model))

    def guards(self) -> list[Guard]:
        return list(self._reads.values())


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _reader_of_structure(model: torch.nn.Module) -> Callable[[], Any]:
    """One number for the module tree and its hooks (module, global and parameter-gradient hooks),
    read from dicts listed once: hooks and submodules are added to and removed from these
    dicts in place, so a call costs one pass over them, no walk of the model."""
    import torch.nn.modules.module as module_globals
    modules = list({id(m): m for m in model.modules()}.values())
    children = [m._modules for m in modules]
    hooks = [getattr(m, name) for m in modules for name in _HOOK_DICTS]
    hooks += [getattr(module_globals, "_global" + name) for name in _HOOK_DICTS]
    params = [p for m in modules for p in m._parameters.values() if p is not None]

    def hooked() -> tuple:
        return tuple(bool(p._backward_hooks) or bool(getattr(p, "_post_accumulate_grad_hooks", None))
                     for p in params)

    def read() -> int:
        return hash((tuple(id(c) for d in children for c in d.values()),
                     tuple(map(len, hooks)), tuple(next(reversed(d)) for d in hooks if d), hooked()))

    def portable() -> str | None:
        # Across processes: each slot's module class and how many hooks each dict holds; a hook's
        # function has no such form, so a model with hooks is not cached.
        users = any(not getattr(h, "is_compiled_steps_own", False) for d in hooks for h in d.values())
        if users or any(hooked()):
            return None
        text = repr([(name, type(c).__module__, type(c).__qualname__) for d in children for name, c in d.items()])
        return "structure:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    read.portable = portable
    return read


def rebuild(descriptors: list[dict], model: torch.nn.Module, loss_fn) -> list[Guard] | None:
    """Guards from their descriptors against the live model and loss (a compile-cache entry made in
    another process), recorded as the values are now; None when one cannot be found."""
    recorder = GuardRecorder()
    readers: dict[tuple, Callable[[], Any]] = {}
    for kind, name, read in _names_of(loss_fn):
        readers[(kind, "loss_fn", name)] = read
    for _, module in model.named_modules():
        for kind, name, read in _names_of(type(module).forward, type(module)):
            readers[(kind, f"forward of {type(module).__qualname__}", name)] = read
    readers[("structure", "", "modules and hooks")] = _reader_of_structure(model)
    for d in descriptors:
        key = (d["kind"], d["owner"], d["name"])
        if d["kind"] == "attribute":
            owner = _resolve(model, d["owner"])
            if owner is _MISSING:
                return None
            read = (_reader_of_attribute(owner, d["name"]) if isinstance(owner, torch.nn.Module)
                    else _reader_of_object_attribute(owner, type(owner), d["name"]))
        elif key in readers:
            read = readers[key]
        else:
            return None
        recorder._add(*key, read)
        if key not in recorder._reads:
            return None
    return recorder.guards()


def _resolve(model: torch.nn.Module, path: str) -> Any:
    """The module or plain object at a dotted ``path`` of submodules and instance attributes."""
    obj: Any = model
    for part in path.split(".") if path else ():
        if isinstance(obj, torch.nn.Module) and part in obj._modules:
            obj = obj._modules[part]
        else:
            obj = object.__getattribute__(obj, "__dict__").get(part, _MISSING)
            if obj is _MISSING:
                return _MISSING
    return obj


def signature_of(fn) -> str:
    """``loss_fn``'s identity for messages."""
    try:
        return f"{fn.__qualname__}{inspect.signature(fn)}"
    except (TypeError, ValueError, AttributeError):
        return repr(fn)
