"""Obtain torchair's pure-Python FX->GE graph builder without torch_npu.

What this does (and why):

1. torchair ships *inside* the torch_npu wheel (``torch_npu/dynamo/torchair``).
   Installing torch_npu without CANN breaks ``import torch`` (torch's backend
   autoload imports it), so we never install it.  Instead we extract only
   ``torch_npu/dynamo/torchair/**`` from the wheel into
   ``~/.cache/cann_passes/torchair-<ver>/torchair`` (override the root with
   ``$CANN_PASSES_CACHE``).  The wheel is taken from ``$CANN_PASSES_TORCH_NPU_WHEEL``,
   the cache dir, ``/tmp/npuwheel``, or ``pip download --no-deps
   torch_npu==<ver>`` (``<ver>`` = torch's version, or
   ``$CANN_PASSES_TORCH_NPU_VERSION``).  Nothing named ``torch_npu`` is ever
   put on ``sys.path``; no ``*.dist-info`` is extracted, so torch's backend
   autoload cannot see it.
2. torchair needs ``protobuf`` (its ``ge_ir_pb2``).  If the environment lacks
   it, it is ``pip install --target``-ed into ``<cache>/deps`` (appended to
   ``sys.path``).
3. ``torchair`` is imported through a meta-path finder that serves exactly the
   ``torchair`` package from the cache dir.  The top-level
   ``torchair/__init__.py`` is NOT executed: it patches
   ``torch.distributed._functional_collectives.traceable_collective_remaps``
   and registers ``air::`` ops, none of which graph construction needs.  The
   package object is an empty shell whose ``__path__`` is the extracted
   directory; submodules import normally.
4. ``torchair.core._torchair`` (native, needs CANN) is imported for real if it
   loads; otherwise :mod:`._standin_torchair` is installed under that name
   (graph construction only; every GE load/compile/run raises).
5. ``torchair.core._backend`` installs SIGINT/SIGTERM handlers and an atexit
   hook at import; with the stand-in we restore the previous handlers and
   unregister the hook so the host process is unaffected.
"""

from __future__ import annotations

import atexit
import glob
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
import zipfile
from pathlib import Path

_WHEEL_PREFIX = "torch_npu/dynamo/torchair/"
_MARKER = ".cann_passes_extracted"
_LOCK = threading.Lock()
_STATE: dict = {}


class TorchairUnavailable(RuntimeError):
    """torchair's sources (the torch_npu wheel) or protobuf could not be obtained."""


def _torch_npu_version() -> str:
    env = os.environ.get("CANN_PASSES_TORCH_NPU_VERSION")
    if env:
        return env
    import torch

    return torch.__version__.split("+")[0]


def _default_cache_root() -> Path:
    env = os.environ.get("CANN_PASSES_CACHE")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "cann_passes"


def _py_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def _find_wheel(version: str, cache_root: Path) -> Path | None:
    env = os.environ.get("CANN_PASSES_TORCH_NPU_WHEEL")
    if env:
        if not Path(env).is_file():
            raise TorchairUnavailable(f"$CANN_PASSES_TORCH_NPU_WHEEL={env} does not exist")
        return Path(env)
    pattern = f"torch_npu-{version}-*.whl"
    for d in (cache_root / "wheels", Path("/tmp/npuwheel")):
        hits = sorted(glob.glob(str(d / pattern)))
        # prefer one matching this interpreter (content of torchair/ is pure python
        # except the native .so files we do not need, so any tag works in a pinch)
        hits.sort(key=lambda p: (_py_tag() not in os.path.basename(p), p))
        if hits:
            return Path(hits[0])
    return None


def _download_wheel(version: str, cache_root: Path) -> Path:
    dest = cache_root / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "-d", str(dest), f"torch_npu=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TorchairUnavailable(f"could not download torch_npu=={version} wheel (needed for torchair): {e}") from None
    wheel = _find_wheel(version, cache_root)
    if proc.returncode != 0 or wheel is None:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise TorchairUnavailable(
            f"could not fetch the torch_npu=={version} wheel (needed for torchair's FX->GE converters) "
            f"with `{' '.join(cmd[2:])}`: {' | '.join(tail) or 'no wheel produced'}. "
            "Set $CANN_PASSES_TORCH_NPU_WHEEL to a local wheel to work offline."
        )
    return wheel


def _extract(version: str, cache_root: Path) -> Path:
    """Return the directory that contains the ``torchair`` package."""
    root = cache_root / f"torchair-{version}"
    if (root / _MARKER).is_file() and (root / "torchair").is_dir():
        return root
    wheel = _find_wheel(version, cache_root) or _download_wheel(version, cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".torchair-{version}-", dir=cache_root))
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.startswith(_WHEEL_PREFIX) and not n.endswith("/")]
            if not names:
                raise TorchairUnavailable(f"{wheel} does not contain {_WHEEL_PREFIX} (not a torch_npu wheel with torchair?)")
            for n in names:
                rel = n[len(_WHEEL_PREFIX):]
                out = tmp / "torchair" / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(n) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        (tmp / _MARKER).write_text(f"{wheel.name}\n")
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
    except zipfile.BadZipFile as e:
        raise TorchairUnavailable(f"torch_npu wheel {wheel} is corrupt: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _ensure_protobuf(cache_root: Path) -> None:
    if importlib.util.find_spec("google") is not None:
        try:
            if importlib.util.find_spec("google.protobuf") is not None:
                return
        except ModuleNotFoundError:
            pass
    deps = cache_root / "deps"
    if not (deps / "google" / "protobuf").is_dir():
        deps.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet",
               "--target", str(deps), "protobuf>=4.21"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TorchairUnavailable(f"torchair needs protobuf; installing it into {deps} failed: {e}") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            raise TorchairUnavailable(f"torchair needs protobuf; `pip install --target {deps} protobuf` failed: {' | '.join(tail)}")
    if str(deps) not in sys.path:
        sys.path.append(str(deps))  # ``google`` is a namespace package: its __path__ follows sys.path
    importlib.invalidate_caches()
    try:
        importlib.import_module("google.protobuf")
    except ImportError as e:
        raise TorchairUnavailable(f"torchair needs protobuf; it is not importable from {deps}: {e}") from None


class _TorchairFinder(importlib.abc.MetaPathFinder):
    """Serves the top-level ``torchair`` package (only) from the cache dir."""

    def __init__(self, pkg_dir: Path):
        self.pkg_dir = pkg_dir

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchair":
            return None
        spec = importlib.machinery.ModuleSpec("torchair", _ShellLoader(), is_package=True)
        spec.submodule_search_locations = [str(self.pkg_dir)]
        spec.origin = str(self.pkg_dir / "__init__.py")
        return spec


class _ShellLoader(importlib.abc.Loader):
    """Creates ``torchair`` without running its ``__init__.py`` (see module doc)."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = module.__spec__.origin
        module.__cann_passes_offline__ = True


def _install_native(pkg_dir: Path) -> bool:
    """Import the real ``torchair.core._torchair`` or install the stand-in. Returns True if stand-in."""
    name = "torchair.core._torchair"
    if name in sys.modules:
        return bool(getattr(sys.modules[name], "IS_OFFLINE_STANDIN", False))
    force = os.environ.get("CANN_PASSES_GE_OFFLINE_STANDIN") == "1"
    has_cann = any(os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"))
    if not force and has_cann:
        try:
            importlib.import_module(name)
            return False
        except (ImportError, OSError):
            sys.modules.pop(name, None)
    from . import _standin_torchair

    sys.modules[name] = _standin_torchair
    core = importlib.import_module("torchair.core")
    setattr(core, "_torchair", _standin_torchair)
    return True


def _import_torchair(pkg_root: Path):
    pkg_dir = pkg_root / "torchair"
    existing = sys.modules.get("torchair")
    if existing is not None and not getattr(existing, "__cann_passes_offline__", False):
        # A real torchair (e.g. via torch_npu on a CANN host) is already loaded: use it.
        importlib.import_module("torchair._ge_concrete_graph.fx2ge_converter")
        importlib.import_module("torchair._ge_concrete_graph.ge_converter")
        return existing, False
    if existing is None:
        sys.meta_path.insert(0, _TorchairFinder(pkg_dir))
    torchair = importlib.import_module("torchair")
    standin = _install_native(pkg_dir)

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        old_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        backend = importlib.import_module("torchair.core._backend")
    finally:
        if standin:
            for s, h in old_handlers.items():
                if h is not None:
                    signal.signal(s, h)
    if standin:
        atexit.unregister(backend.finalize_graph_engine)
    importlib.import_module("torchair._ge_concrete_graph.fx2ge_converter")
    importlib.import_module("torchair._ge_concrete_graph.ge_converter")
    importlib.import_module("torchair.npu_fx_compiler")
    # torchair imports its torch_npu custom-op converters lazily (on the first op without a
    # converter).  Those register against torch.ops.npu.*, which does not exist without
    # torch_npu, so each module fails with AttributeError and is skipped (torchair's own
    # behaviour).  We do it once here, quietly, and remember what was skipped.  We deliberately
    # do NOT define placeholder ``npu::`` schemas: that would squat torch_npu's namespace in
    # this process, and aten-level graphs cannot contain npu ops anyway.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module("torchair._ge_concrete_graph.ge_converter.custom")
    skipped = []
    for w in caught:
        m = re.match(r"Failed to import (\S+)", str(w.message))
        if m:
            skipped.append(m.group(1).rsplit(".", 1)[-1])
    _STATE["skipped_npu_converters"] = sorted(skipped)
    return torchair, standin


def load_torchair(cache_dir=None):
    """Return the ``torchair`` module (graph construction usable on CPU-only hosts).

    Cached per process.  Raises ``RuntimeError`` with a one-line reason if the
    wheel or protobuf cannot be obtained or torchair fails to import.
    """
    with _LOCK:
        if "torchair" in _STATE:
            return _STATE["torchair"]
        cache_root = Path(cache_dir) if cache_dir is not None else _default_cache_root()
        version = _torch_npu_version()
        try:
            _ensure_protobuf(cache_root)
            pkg_root = _extract(version, cache_root)
            with warnings.catch_warnings():  # torchair sources emit Deprecation/SyntaxWarnings on import
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", SyntaxWarning)
                torchair, standin = _import_torchair(pkg_root)
        except RuntimeError:
            raise
        except Exception as e:  # noqa: BLE001 - turn deep import failures into one clear error
            raise RuntimeError(
                f"importing torchair (from torch_npu=={version}) for offline GE lowering failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        if "torch_npu" in sys.modules:  # pragma: no cover - defensive
            raise RuntimeError("offline torchair loader must not import torch_npu, but it is in sys.modules")
        _STATE.update(torchair=torchair, standin=standin, version=version, root=pkg_root)
        return torchair


def loader_info() -> dict:
    """After load_torchair: {'version', 'root', 'standin', 'skipped_npu_converters'}."""
    return {k: v for k, v in _STATE.items() if k != "torchair"}
