"""The distributed runtime: a device mesh from the plan, its process groups, launch, faults.

Processes are started by ``torchrun`` (one or many nodes), which sets
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; :func:`init_distributed`
checks the plan against the world before any process-group work, sets the
collective library's algorithm (``HCCL_ALGO`` on Ascend, ``NCCL_ALGO`` on GPU),
creates the default process group with the device's backend (hccl, nccl or
gloo) and a ``(pp, dp, cp, tp)`` :class:`~torch.distributed.device_mesh.DeviceMesh`
with one process group per dimension. Passes see the mesh as its description,
:class:`graph_ir.mesh.MeshDesc` (axis sizes, group names, this rank's coordinates).

Faults: a watchdog thread on every rank heart-beats through the rendezvous
store and polls it for a published failure. A rank whose code raises inside
``with init_distributed(plan) as world:`` publishes "rank R failed: <error>"
before the exception leaves; a rank that stops heart-beating (killed, stuck)
for ``fault_timeout_s`` is declared failed by the others. Every other rank then
prints the failure, naming the rank, and exits with :data:`FAULT_EXIT_CODE`
even if it is blocked inside a collective, so no rank waits forever.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from graph_ir.mesh import MeshDesc

from ..plan import Plan, PlanError

FAULT_EXIT_CODE = 75
MESH_DIMS = ("pp", "dp", "cp", "tp")
BACKEND_OF_DEVICE = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# How plan.allreduce_algo maps onto each collective library's own setting; gloo has none.
ALGO_SETTINGS = {
    "hccl": ("HCCL_ALGO", {"ring": "level0:NA;level1:ring", "tree": "level0:NA;level1:H-D_R"}),
    "nccl": ("NCCL_ALGO", {"ring": "Ring", "tree": "Tree"}),
}

_current: "DistributedRuntime | None" = None


# -- the plan against the world -----------------------------------------------------------------

def check_world(plan: Plan, world_size: int) -> None:
    """Refuse a plan that cannot run on ``world_size`` processes (before any process-group work)."""
    model = plan.cp * plan.tp * plan.pp
    degrees = plan.dp * model
    if world_size % model:
        raise PlanError("dp", f"cp x tp x pp = {model} must divide the number of processes "
                              f"({world_size})", plan.dp)
    if degrees != world_size:
        raise PlanError("dp", f"dp x cp x tp x pp = {plan.dp} x {plan.cp} x {plan.tp} x {plan.pp} = {degrees} "
                              f"must equal the number of processes ({world_size}); for {world_size} "
                              f"processes use dp={world_size // model}", plan.dp)
    if plan.dp % plan.ep:
        raise PlanError("ep", f"the expert-parallel ranks are data-parallel ranks: ep={plan.ep} must "
                              f"divide dp={plan.dp}", plan.ep)
    if plan.zero_stage and plan.dp < 2:
        raise PlanError("zero_stage", "ZeRO shards over data-parallel ranks and needs dp > 1",
                        plan.zero_stage)


def collective_algo_env(algo: str, backend: str) -> dict[str, str]:
    """The environment setting that selects ``algo`` in ``backend``'s collective library."""
    if algo == "auto" or backend not in ALGO_SETTINGS:
        return {}
    variable, values = ALGO_SETTINGS[backend]
    return {variable: values[algo]}


def default_device_type() -> str:
    if hasattr(torch, "npu") and torch.npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


# -- the watchdog -------------------------------------------------------------------------------

class Watchdog(threading.Thread):
    """Heart-beats through the store and stops this process when another rank has failed."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, interval_s: float,
                 fault_timeout_s: float):
        super().__init__(name=f"cann-watchdog-{rank}", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.fault_timeout_s = interval_s, fault_timeout_s
        self.stopped = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.check(["failed"]):
                    self.store.add("failed_seen", 1)
                    self._stop_process(self.store.get("failed").decode())
                silent = self._silent_rank()
                if silent is not None:
                    message = (f"rank {silent} failed: no heartbeat for {self.fault_timeout_s:.0f}s "
                               "(killed or stuck)")
                    publish_failure(self.store, message)
                    self._stop_process(message)
            except (RuntimeError, dist.DistStoreError, ConnectionError, OSError) as exc:
                if self.stopped.is_set():
                    return
                self._stop_process(f"the rendezvous store is unreachable ({exc}); the rank hosting it "
                                   "(rank 0 or the launcher) has most likely failed")

    def _silent_rank(self) -> int | None:
        now = time.monotonic()
        for other in range(self.world_size):
            if other == self.rank or self.store.check([f"done/{other}"]):
                continue
            beats = self.store.add(f"beat/{other}", 0)
            last_beats, since = self._seen.get(other, (-1, now))
            if beats != last_beats:
                self._seen[other] = (beats, now)
            elif now - since > self.fault_timeout_s:
                return other
        return None

    def _stop_process(self, message: str) -> None:
        if self.stopped.is_set():
            return
        sys.stderr.write(f"[rank {self.rank}] stopping: {message}\n")
        sys.stderr.flush()
        os._exit(FAULT_EXIT_CODE)

    def stop(self) -> None:
        self.stopped.set()


def publish_failure(store: dist.Store, message: str) -> None:
    # compare_set keeps the first failure: later ones are usually consequences of it.
    store.compare_set("failed", "", message)


# -- the runtime ----------------------------------------------------------------------------------

class DistributedRuntime:
    """The process groups of one run; a context manager that turns exceptions into a published failure."""

    def __init__(self, plan: Plan, mesh, backend: str, device_type: str, watchdog: Watchdog | None,
                 store: dist.Store):
        self.plan, self.mesh, self.backend, self.device_type = plan, mesh, backend, device_type
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.watchdog, self.store = watchdog, store
        self.info = MeshDesc.from_device_mesh(mesh)
        # Expert parallelism: dp unflattened into (edp, ep), ep inner (graph_ir.mesh's sub-axes).
        self.expert_mesh = (mesh._unflatten("dp", (plan.dp // plan.ep, plan.ep), ("edp", "ep"))
                            if plan.ep > 1 else None)
        if self.expert_mesh is not None:
            self.info = self.info.with_subaxes_of(self.expert_mesh)
        # Data and context parallelism: dp and cp flattened, the group one all-reduce of a
        # gradient (partial over cp, per dp rank's rows) sums it over.
        self.dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp") if plan.dp > 1 and plan.cp > 1 else None
        if self.dp_cp_mesh is not None:
            self.info = self.info.with_subaxes_of(self.dp_cp_mesh, ("dp_cp",))

    def group(self, dim: str):
        if dim in ("ep", "edp") and self.expert_mesh is not None:
            return self.expert_mesh.get_group(dim)
        if dim == "dp_cp" and self.dp_cp_mesh is not None:
            return self.dp_cp_mesh.get_group(dim)
        return self.mesh.get_group(dim)

    @property
    def dp_rank(self) -> int:
        return self.info.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.info.size("dp")

    def fail(self, exc: BaseException) -> None:
        """Publish that this rank failed, and give the others a moment to read it."""
        message = f"rank {self.rank} failed: {type(exc).__name__}: {exc}"
        try:
            publish_failure(self.store, message)
            deadline = time.monotonic() + 4 * (self.watchdog.interval_s if self.watchdog else 0.5)
            while time.monotonic() < deadline and self.store.add("failed_seen", 0) < self.world_size - 1:
                time.sleep(0.05)
        except Exception:  # the store itself is gone: the others find out through it too
            pass
        if self.watchdog:
            self.watchdog.stop()

    def shutdown(self) -> None:
        """Leave together: a rank that finished is not mistaken for a failed one."""
        global _current
        self.store.set(f"done/{self.rank}", "1")
        dist.barrier()
        if self.watchdog:
            self.watchdog.stop()
        dist.destroy_process_group()
        _current = None

    def __enter__(self) -> "DistributedRuntime":
        return self

    def _published_failure(self) -> str | None:
        try:
            return self.store.get("failed").decode() if self.store.check(["failed"]) else None
        except Exception:  # the store is gone with the failed rank
            return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        earlier = self._published_failure() if exc is not None else None
        if earlier:
            # Another rank failed first and this rank's error (a closed connection in a
            # collective, most often) follows from it: report the cause, like the watchdog.
            sys.stderr.write(f"[rank {self.rank}] stopping: {earlier} (here: {type(exc).__name__})\n")
            sys.stderr.flush()
            os._exit(FAULT_EXIT_CODE)
        if exc is not None:
            sys.stderr.write(f"[rank {self.rank}] failed:\n{''.join(traceback.format_exception(exc))}")
            self.fail(exc)
            return False
        self.shutdown()
        return False


def init_distributed(plan: Plan, *, device_type: str | None = None, timeout_s: float | None = None,
                     heartbeat_s: float = 0.5, fault_timeout_s: float = 30.0) -> DistributedRuntime:
    """Start this process's part of a run launched by ``torchrun`` (or :func:`launch_local`)."""
    global _current
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise RuntimeError("init_distributed needs RANK and WORLD_SIZE in the environment: launch with "
                           "`torchrun --nproc-per-node N script.py` (see docs/distributed.md)")
    check_world(plan, int(os.environ["WORLD_SIZE"]))
    device_type = device_type or default_device_type()
    backend = BACKEND_OF_DEVICE[device_type]
    os.environ.update(collective_algo_env(plan.allreduce_algo, backend))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(backend, **kwargs)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, (plan.pp, plan.dp, plan.cp, plan.tp), mesh_dim_names=MESH_DIMS)
    store = dist.PrefixStore("cann_passes/", dist.distributed_c10d._get_default_store().clone())
    _share_cpu_measurement(store, dist.get_rank())
    watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(), interval_s=heartbeat_s,
                        fault_timeout_s=fault_timeout_s)
    watchdog.start()
    _current = DistributedRuntime(plan, mesh, backend, device_type, watchdog, store)
    return _current


def _share_cpu_measurement(store, rank: int) -> None:
    """Every rank prices with rank 0's CPU measurement (through the rendezvous store, whatever the
    backend): a profile measured by each rank under the others' load differs, and the pipeline cut
    chosen from it would differ between ranks."""
    from ..cost_model.profiles import measured_cpu, share_measurement
    if rank == 0:
        store.set("cpu_profile", json.dumps(measured_cpu()))
    share_measurement(json.loads(store.get("cpu_profile")))


def current() -> DistributedRuntime | None:
    """The runtime of this process, once :func:`init_distributed` ran."""
    return _current


# -- batches --------------------------------------------------------------------------------------

def shard_batch(batch: Any, dp_rank: int, dp_size: int) -> Any:
    """This data-parallel rank's rows of a global batch (dim 0 of every tensor leaf)."""
    leaves, spec = pytree.tree_flatten(batch)
    out = []
    for leaf in leaves:
        if leaf.shape[0] % dp_size:
            raise ValueError(f"a global batch of {leaf.shape[0]} rows does not split over dp={dp_size} ranks")
        rows = leaf.shape[0] // dp_size
        out.append(leaf[dp_rank * rows:(dp_rank + 1) * rows])
    return pytree.tree_unflatten(out, spec)


# -- launching local processes --------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(argv: Sequence[str], nprocs: int, *, env: dict[str, str] | None = None,
                 timeout_s: float | None = None, cwd: str | None = None,
                 preload: Sequence[str] = ()) -> list[subprocess.CompletedProcess]:
    """Run ``python argv...`` as ``nprocs`` ranks on this machine with torchrun's environment.

    Each rank is a plain process (no agent restarting or killing anything), so
    what a rank does on a fault is its own behaviour. Processes still running
    after ``timeout_s`` are killed and reported with return code None. A rank
    that crashes in native code reports its Python stack (``PYTHONFAULTHANDLER``).

    ``preload`` (module names) forks the ranks from a server process that imported those modules
    once (multiprocessing's forkserver, started on the first such launch and kept for the next):
    a rank then starts in milliseconds where a fresh interpreter spends seconds importing torch
    and transformers. ``argv`` is then ``script.py args...`` or ``-m module args...``, run as
    ``__main__`` with this launch's environment, working directory and ``sys.argv``. As with any
    forkserver start, the launching program's own main module must be import-safe (its work under
    ``if __name__ == "__main__":``): each rank imports it before it runs ``argv``.
    """
    port = str(free_port())
    envs = [{"PYTHONFAULTHANDLER": "1", **os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
             "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0"} for rank in range(nprocs)]
    if preload:
        return _launch_forked(list(argv), envs, timeout_s, cwd, list(preload))
    procs = [subprocess.Popen([sys.executable, *argv], env=rank_env, cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank_env in envs]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results = []
    for proc in procs:
        try:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            out, err = proc.communicate(timeout=left)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            results.append(subprocess.CompletedProcess(proc.args, None, out, err))
    return results


def _launch_forked(argv: list[str], envs: list[dict], timeout_s: float | None, cwd: str | None,
                   preload: list[str]) -> list[subprocess.CompletedProcess]:
    import multiprocessing
    import tempfile
    if not argv or (argv[0] == "-m" and len(argv) < 2) or (argv[0].startswith("-") and argv[0] != "-m"):
        raise ValueError(f"launch_local(preload=...) runs 'script.py args' or '-m module args', not {argv!r}")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    with tempfile.TemporaryDirectory(prefix="cann-ranks-") as tmp:
        procs = []
        for rank, rank_env in enumerate(envs):
            out, err = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
            proc = ctx.Process(target=_forked_rank, args=(argv, rank_env, cwd, out, err), name=f"rank {rank}")
            proc.start()
            procs.append((proc, out, err))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results = []
        for proc, out, err in procs:
            proc.join(None if deadline is None else max(0.1, deadline - time.monotonic()))
            code = proc.exitcode
            if code is None:
                proc.kill()
                proc.join()
            results.append(subprocess.CompletedProcess([sys.executable, *argv], code, _read(out), _read(err)))
    return results


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _forked_rank(argv: list[str], env: dict, cwd: str | None, out: str, err: str) -> None:
    """One rank, in a process forked from the preloading server: what a fresh ``python argv...``
    would see (environment, working directory, ``sys.argv``, ``sys.path``), then ``__main__``."""
    import faulthandler
    import runpy
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    faulthandler.enable()
    # The server's OpenMP runtime read its thread count before this rank's environment existed.
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def rank_failures(results: Sequence[subprocess.CompletedProcess], tail: int = 4000) -> str:
    """What went wrong in a ``launch_local`` run, or ``""`` if every rank exited 0.

    Every failed rank is reported, the likely first failure first: a rank killed by a signal, then
    one that failed on its own, then ranks that only lost a peer ("Connection reset by peer"), then
    ranks killed at the timeout.
    """
    failed = [(rank, r) for rank, r in enumerate(results) if r.returncode != 0]
    failed.sort(key=lambda f: (f[1].returncode is None, (f[1].returncode or 0) >= 0,
                               "Connection reset" in (f[1].stderr or "")))
    return "\n".join(f"rank {rank} " + ("killed at the timeout" if r.returncode is None else f"exited {r.returncode}")
                     + f":\n{(r.stderr or '')[-tail:]}" for rank, r in failed)
