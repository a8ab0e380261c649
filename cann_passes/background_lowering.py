"""``plan.background_lowering``: the backend's lowering compiles in a child process while the first
steps run on the eager lowering of the same program.

Why a process and not a thread: torch's FX tracing state is process-wide (the "FX is tracing" flag,
the patched ``Module.__call__``, node annotations), so a lowering traced in a thread is seen by the
training thread: ``torch.compile`` called there refuses to run, and a recompile's capture would take
the other trace's annotations. The lowering's Python (AOTAutograd's trace, inductor's scheduler and
code generation) also held the GIL the steps need. The child has its own interpreter: it reads the
program's graphs (``graph_ir.serialize``), the inputs' layouts, the plan and this process's inductor
and functorch configs, lowers every graph into the on-disk compile caches (inductor's FX graph cache
and AOTAutograd's), and exits; a graph's collectives name process groups, which inductor resolves
as it compiles, so the child stands in groups of the same ranks under the same names (torch's fake
backend: nothing is communicated while compiling). Between two steps after it exits, the parent lowers the same graphs
itself, which is then a cache lookup (about 2 s for a small GPT where the cold compile takes 15-60),
and its runners replace the eager ones: every step runs wholly on one lowering, on the same
parameter and state tensors. A child that fails, or a lowering in the parent that fails, is a
warning, and the step keeps the eager runners.

A process that ends before the child does waits for it at exit (its kernels land in the cache for
the next run), as it would for a thread.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import torch

from graph_ir.serialize import from_json, to_json

from . import compile_cache

REQUEST = "request.pkl"
ERROR = "error.txt"
LOG = "child.log"


def describe_error(exc: BaseException) -> str:
    """``Type: first line``, as the warnings and the child's error file name a failure."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def caches_off() -> str | None:
    """Which of the caches the parent's take-over reads is off in this process, or None: with one
    off, the parent would compile all over again on the training thread."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    if inductor_config.force_disable_caches:
        return "torch._inductor.config.force_disable_caches"
    if not inductor_config.fx_graph_cache:
        return "inductor's FX graph cache (torch._inductor.config.fx_graph_cache)"
    if not functorch_config.enable_autograd_cache:
        return "AOTAutograd's cache (torch._functorch.config.enable_autograd_cache)"
    return None


def layouts(examples: dict) -> dict:
    """Each graph's inputs as layouts (a tensor's size, stride, dtype, device; any other value itself)."""
    return {name: [_layout(v) for v in inputs] for name, inputs in examples.items()}


def _layout(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.size()), tuple(value.stride()), value.dtype, str(value.device))
    return ("value", value)


def _empty(layout: tuple) -> Any:
    if layout[0] == "tensor":
        _, size, stride, dtype, device = layout
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return layout[1]


def _groups(graphs: dict) -> list[tuple[str, list[int]]]:
    """Each process group the graphs' collectives name, with its global ranks (inductor resolves the
    groups by name as it compiles: for its collective cost estimates and its repro record)."""
    from graph_ir.analysis.collectives import group_name_of, is_collective
    names = sorted({group_name_of(n) for g in graphs.values() for n in g.graph.nodes if is_collective(n)} - {None})
    if not names:
        return []
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group
    return [(name, dist.get_process_group_ranks(_resolve_process_group(name))) for name in names]


def _stand_in_groups(world: int, rank: int, groups: list[tuple[str, list[int]]]) -> None:
    """In the child: in-process groups of the parent's ranks under the parent's names. Nothing is
    communicated while compiling; what inductor reads is each group's size and this rank in it."""
    if not groups:
        return
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    for name, ranks in groups:
        try:
            if dist.get_process_group_ranks(_resolve_process_group(name)) == ranks:
                continue            # the world group, under its usual name
        except (RuntimeError, ValueError):
            pass
        _register_process_group(name, dist.new_group(ranks, use_local_synchronization=True))


def write_request(directory: str, backend: str, graphs: dict, input_layouts: dict, plan) -> None:
    """What the child needs to lower ``graphs`` as this process would, in ``directory``."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    request = {
        "backend": backend, "plan": plan, "threads": torch.get_num_threads(), "groups": _groups(graphs),
        "world": (torch.distributed.get_world_size(), torch.distributed.get_rank())
        if torch.distributed.is_available() and torch.distributed.is_initialized() else (1, 0),
        "graphs": {name: (to_json(graph, with_cost=False, layouts=True),
                          compile_cache.graph_constants(graph)) for name, graph in graphs.items()},
        "layouts": input_layouts,
        "inductor_config": inductor_config.save_config(),
        "functorch_config": functorch_config.save_config(),
    }
    with open(os.path.join(directory, REQUEST), "wb") as f:
        pickle.dump(request, f)


def lower_request(directory: str) -> None:
    """The child's work: lower every graph of the request in ``directory`` (into the caches)."""
    with open(os.path.join(directory, REQUEST), "rb") as f:
        request = pickle.load(f)
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from . import passes  # noqa: F401  (ops a pass defines, which the graphs may call)
    from .lowering import get_lowering
    inductor_config.load_config(request["inductor_config"])
    functorch_config.load_config(request["functorch_config"])
    torch.set_num_threads(request["threads"])
    _stand_in_groups(*request["world"], request["groups"])
    lowering = get_lowering(request["backend"])
    with compile_cache.lowering_context(request["backend"]):
        for name, (data, constants) in request["graphs"].items():
            graph = from_json(data, constants, recorded_values=True)
            lowering.compile(graph, [_empty(x) for x in request["layouts"][name]], request["plan"])


def _child_main(directory: str) -> int:
    try:
        lower_request(directory)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which keeps running on eager)
        with open(os.path.join(directory, ERROR), "w", encoding="utf-8") as f:
            f.write(describe_error(exc))
        raise
    return 0


def start_child(directory: str) -> subprocess.Popen:
    """The child process lowering the request in ``directory``, importing what this process can; its
    output goes to a log there."""
    code = (f"import sys; sys.path[:0] = {list(sys.path)!r}; "
            "from cann_passes.background_lowering import _child_main; "
            f"sys.exit(_child_main({directory!r}))")
    log = open(os.path.join(directory, LOG), "wb")
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(os.environ))
    finally:
        log.close()


# Lowerings whose child is still running: a process that ends first waits for them (their kernels
# land in the caches for the next run; an orphan would go on using a core after the run had ended).
_RUNNING: set["BackgroundLowering"] = set()


@atexit.register
def wait_for_children() -> None:
    """Until every lowering child of this process has exited."""
    for lowering in list(_RUNNING):
        lowering.wait()


class BackgroundLowering:
    """The backend's lowering of a program's graphs in a child process (see the module's docstring);
    :meth:`take_over` swaps its runners in between two steps."""

    def __init__(self, backend: str, lowering, graphs: dict, examples: dict, plan):
        self.backend, self.lowering, self.plan = backend, lowering, plan
        self.graphs = dict(graphs)
        self.layouts = layouts(examples)
        self.runners: dict | None = None
        self.error: str | None = None
        self.seconds: float | None = None        # the child's lowering, start to exit
        self.take_over_seconds: float | None = None   # the parent's own lowering from the caches
        self.switched_at: int | None = None      # the steps run when the backend's runners took over
        self.warmed_up: bool = False             # the backend's modules imported while the child ran
        self._warming: threading.Thread | None = None
        self._start = time.perf_counter()
        self._dir = tempfile.mkdtemp(prefix="cann-lowering-")
        try:
            write_request(self._dir, backend, self.graphs, self.layouts, plan)
            self._child = start_child(self._dir)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        _RUNNING.add(self)

    def done(self) -> bool:
        return self._child.poll() is not None

    def wait(self) -> None:
        """Until the child has exited."""
        self._child.wait()
        self._finished()

    def _finished(self) -> None:
        """Once the child has exited: its request is no longer needed (a failed child's log and error
        stay, for the warning that names them)."""
        if self.seconds is not None:
            return
        _RUNNING.discard(self)
        self.seconds = time.perf_counter() - self._start
        if self._child.returncode == 0:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self._dir, REQUEST))

    def take_over(self, comp, steps_run: int) -> None:
        """Between two steps: once the child has exited, lower here from the caches it filled and
        replace the eager runners (or warn and keep them)."""
        if self.switched_at is not None:
            return
        if not self.done():
            self._warm_up()
            return
        if self._warming is not None:
            self._warming.join()
        self._finished()
        self.switched_at = steps_run
        if self._child.returncode != 0:
            path = os.path.join(self._dir, ERROR)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    self.error = f.read().strip()
            else:
                self.error = f"the lowering process exited with status {self._child.returncode}"
        else:
            t0 = time.perf_counter()
            try:
                with compile_cache.lowering_context(self.backend):
                    self.runners = {name: self.lowering.compile(graph, [_empty(x) for x in self.layouts[name]],
                                                                self.plan)
                                    for name, graph in self.graphs.items()}
            except Exception as exc:
                self.error = describe_error(exc)
            self.take_over_seconds = time.perf_counter() - t0
        if self.error is not None:
            log = os.path.join(self._dir, LOG)
            where = f" (the lowering's output: {log})" if os.path.exists(log) else ""
            warnings.warn(f"the {self.backend} lowering failed in the background ({self.error}); the step keeps "
                          f"running on the eager lowering{where}", RuntimeWarning, stacklevel=3)
            return
        comp.runners.update(self.runners)
        comp.compile_seconds += self.take_over_seconds

    def _warm_up(self) -> None:
        """Once, while the child compiles and the steps run on eager: import what this process's own
        lowering from the caches will need (inductor's compiler, about 80% of a take-over's time when
        left to it: 1.7 s on a 4-layer GPT). From the second step on, when the training thread has
        imported what it uses; a failure here only leaves the import to the take-over."""
        warm_up = getattr(self.lowering, "warm_up", None)
        if warm_up is None or self._warming is not None:
            return

        def run():
            try:
                warm_up()
                self.warmed_up = True
            except Exception:  # noqa: BLE001  (the take-over imports it again and reports a failure)
                pass
        self._warming = threading.Thread(target=run, name="cann-lowering-warm-up", daemon=True)
        self._warming.start()

    def describe(self) -> str:
        if self.switched_at is None:
            return ("compiling in the background (a child process); the steps so far ran on the eager lowering "
                    "(the process waits for it at exit)")
        if self.error is not None:
            return f"background lowering failed ({self.error.split(':')[0]}); every step ran on the eager lowering"
        return (f"lowered in the background in {self.seconds:.1f}s, taken over in {self.take_over_seconds:.1f}s; "
                f"steps 1-{self.switched_at} ran on the eager lowering")
