"""Device profiles: the handful of figures a roofline and an alpha-beta model need.

Every figure carries its public source. Where no vendor figure exists the
value is marked ESTIMATE with how it was derived. Throughputs are dense (no
structured sparsity), per device (one chip / one GPU), in FLOP/s; bandwidths
in bytes/s; latencies in seconds.

The ``cpu`` profile is measured, not looked up: a short microbenchmark run
once per CPU (its model and vector ISA), core and thread count and torch version, cached on disk. It runs on
one thread and scales throughputs by the thread count (see ``_measure_cpu``).
It times one op of each class the roofline tells apart, at the sizes of a
small transformer's activations (a 512x256x1024 matmul, by the faster of MKL and oneDNN, 256k-element
elementwise and RNG ops, row reductions, attention-shaped softmax, chains of
1-element aten ops and of views for the fixed per-op and per-view costs), so
that a recompute choice made with it is judged by what the ops cost here, not
by a single matmul rate. For predicting a given graph, ``calibrate.measure_ops``
adds the measured time of each of its op signatures (``op_seconds``).

Each figure is the best of several timed runs of this thread's CPU time, but a machine busy with
other work still inflates them (memory bandwidth and page faults are shared): a measurement taken
while the load average exceeds half the cores is used by this process and not cached.
``$CANN_PASSES_CPU_PROFILE`` names a JSON file of one-thread figures (the keys of a cached
measurement) to price with instead of measuring: the same plans on every machine and run (the
test suite pins one).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

TFLOPS = 1e12
GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    matrix_flops: dict[str, float]     # dtype name -> FLOP/s on the matrix unit (Cube / tensor cores)
    vector_flops: dict[str, float]     # dtype name -> FLOP/s on the vector unit (Vector / CUDA cores)
    memory_bandwidth: float            # device memory, bytes/s
    memory_capacity: float             # bytes
    intra_node_bandwidth: float        # per device, one direction, bytes/s (HCCS / NVLink / UB)
    intra_node_latency: float          # seconds per message step
    inter_node_bandwidth: float        # per device, one direction, bytes/s (RoCE / InfiniBand)
    inter_node_latency: float
    devices_per_node: int = 8
    op_overhead: float = 0.0           # fixed cost per launched op (kernel launch / task dispatch)
    # Fixed cost of a view node (reshape, transpose, slice: no data moved) where the runtime still
    # dispatches it: eager PyTorch calls into aten for each. 0 where views are compiled into their
    # consumers' addressing (GE graph mode, CUDA graphs / inductor), as the fixed profiles assume.
    view_overhead: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # Measured profiles only: effective bytes/s (read + written) per op class that is not a matmul
    # ("elementwise", "reduction", "softmax", "rng"); the roofline uses it in place of the memory
    # bandwidth for that class. Empty for looked-up profiles.
    class_bandwidth: dict[str, float] = field(default_factory=dict)
    # Measured profiles only: seconds of one op by its signature (``calibrate.op_key``: op, argument
    # layouts and values), each timed alone by ``calibrate.measure_ops``; used in place of the
    # roofline for those signatures (the dispatch is inside the measured time).
    op_seconds: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    def matrix_rate(self, dtype: torch.dtype) -> float:
        return _rate(self.matrix_flops, dtype)

    def vector_rate(self, dtype: torch.dtype) -> float:
        return _rate(self.vector_flops, dtype)

    def to_json(self) -> dict:
        return asdict(self)


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64", torch.int8: "int8"}.get(dtype, "fp32")


def _rate(table: dict[str, float], dtype: torch.dtype) -> float:
    key = dtype_key(dtype)
    # Integer and boolean elementwise work runs at the fp32 vector rate or better.
    return table.get(key) or table["fp32"]


# -- Ascend ------------------------------------------------------------------------------------
# Atlas A2 training: Ascend 910B (as in Atlas 800T A2, 8 NPUs per server).
ASCEND_910B = DeviceProfile(
    name="ascend_910b",
    # ESTIMATE: Huawei publishes no per-SKU datasheet figure for 910B. 313 TFLOPS FP16 is the
    # widely reported figure for 910B3 (e.g. the 910B3 entries in Huawei Cloud ModelArts
    # resource docs and the Atlas 800T A2 press coverage); bf16 runs at the fp16 Cube rate.
    # fp32 on the Cube goes through HF32 emulation: ESTIMATE 1/2 of fp16.
    matrix_flops={"fp16": 313 * TFLOPS, "bf16": 313 * TFLOPS, "fp32": 156 * TFLOPS,
                  "int8": 626 * TFLOPS},
    # ESTIMATE: from the DaVinci core ratio (HPCA 2021, Liao et al., "Ascend: a Scalable and
    # Unified Architecture for Ubiquitous DNN Computing": Cube 4096 fp16 MAC/cycle vs a
    # 2048-bit Vector unit, 128 fp16 lanes) => vector ~ cube / 32; fp32 at half the fp16 rate.
    vector_flops={"fp16": 9.8 * TFLOPS, "bf16": 9.8 * TFLOPS, "fp32": 4.9 * TFLOPS},
    # ESTIMATE: 64 GB HBM2e at ~1.6 TB/s, as reported for 910B (4 HBM2e stacks).
    memory_bandwidth=1.6e12,
    memory_capacity=64 * GB,
    # Atlas 800T A2 datasheet (Huawei, e.hua..., "Atlas 800T A2 training server"): HCCS
    # full mesh, 392 GB/s per NPU aggregate (7 links x 56 GB/s); one direction taken as half.
    intra_node_bandwidth=196 * GB,
    intra_node_latency=5e-6,            # ESTIMATE: HCCL small-message step latency
    # Atlas 800T A2 datasheet: 8 x 200GE RoCE, one port per NPU => 25 GB/s per direction.
    inter_node_bandwidth=25 * GB,
    inter_node_latency=10e-6,           # ESTIMATE: RoCE v2 step latency incl. HCCL overhead
    op_overhead=5e-6,                   # ESTIMATE: GE task dispatch per op in graph mode
    sources={"matrix": "910B3 reported 313 TFLOPS fp16 (estimate)",
             "vector": "estimate from DaVinci Cube/Vector ratio, HPCA 2021",
             "memory": "reported 64 GB HBM2e, 1.6 TB/s (estimate)",
             "interconnect": "Atlas 800T A2 datasheet: HCCS 392 GB/s, 8x200GE RoCE"},
)

# Atlas A3 (Atlas 900 A3 SuperPoD / CloudMatrix384): Ascend 910C, two 910B-class dies per package.
ASCEND_A3 = DeviceProfile(
    name="ascend_a3",
    # Huawei CloudMatrix384 paper (Zuo et al., arXiv:2506.12708, Sec. 3): 910C ~752 TFLOPS
    # dense BF16/FP16 per package (two dies); fp32 ESTIMATE at half.
    matrix_flops={"fp16": 752 * TFLOPS, "bf16": 752 * TFLOPS, "fp32": 376 * TFLOPS,
                  "int8": 1504 * TFLOPS},
    # ESTIMATE: same cube/vector ratio as 910B (two dies).
    vector_flops={"fp16": 23.5 * TFLOPS, "bf16": 23.5 * TFLOPS, "fp32": 11.8 * TFLOPS},
    # CloudMatrix384 paper: 128 GB on-package memory, 3.2 TB/s per 910C.
    memory_bandwidth=3.2e12,
    memory_capacity=128 * GB,
    # CloudMatrix384 paper: Unified Bus, 392 GB/s unidirectional per NPU within the supernode.
    intra_node_bandwidth=392 * GB,
    intra_node_latency=2e-6,            # ESTIMATE: UB one-hop latency is reported in the low us
    # CloudMatrix384 paper: RDMA plane, 400 Gbps per NPU => 50 GB/s.
    inter_node_bandwidth=50 * GB,
    inter_node_latency=10e-6,           # ESTIMATE
    devices_per_node=384,               # the supernode is one UB domain
    op_overhead=5e-6,                   # ESTIMATE, as for 910B
    sources={"all": "Zuo et al., Serving Large Language Models on Huawei CloudMatrix384, "
                    "arXiv:2506.12708; fp32 and vector rates are estimates"},
)

# -- NVIDIA ------------------------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): dense figures are half the "with sparsity" ones.
H100 = DeviceProfile(
    name="h100",
    matrix_flops={"fp16": 989 * TFLOPS, "bf16": 989 * TFLOPS, "fp32": 494.5 * TFLOPS,  # TF32
                  "fp64": 67 * TFLOPS, "int8": 1979 * TFLOPS},
    # H100 datasheet: 67 TFLOPS fp32 (CUDA cores); fp16/bf16 non-tensor 2x fp32 per the
    # Hopper architecture whitepaper (Table: "Peak FP16 (non-Tensor) 133.8 TFLOPS").
    vector_flops={"fp32": 67 * TFLOPS, "fp16": 133.8 * TFLOPS, "bf16": 133.8 * TFLOPS,
                  "fp64": 34 * TFLOPS},
    memory_bandwidth=3.35e12,           # datasheet: 80 GB HBM3, 3.35 TB/s
    memory_capacity=80 * GB,
    intra_node_bandwidth=450 * GB,      # datasheet: NVLink 900 GB/s bidirectional
    intra_node_latency=3e-6,            # ESTIMATE: NCCL ring step latency over NVLink
    inter_node_bandwidth=50 * GB,       # DGX H100: ConnectX-7 400 Gb/s InfiniBand per GPU
    inter_node_latency=6e-6,            # ESTIMATE: NCCL step latency over InfiniBand
    op_overhead=4e-6,                   # ESTIMATE: kernel launch
    sources={"all": "NVIDIA H100 datasheet, Hopper architecture whitepaper, DGX H100 user guide"},
)

# NVIDIA H200 datasheet (SXM): H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
H200 = DeviceProfile(
    name="h200",
    matrix_flops=dict(H100.matrix_flops),
    vector_flops=dict(H100.vector_flops),
    memory_bandwidth=4.8e12,
    memory_capacity=141 * GB,
    intra_node_bandwidth=450 * GB,
    intra_node_latency=3e-6,            # ESTIMATE, as H100
    inter_node_bandwidth=50 * GB,       # DGX H200: ConnectX-7 400 Gb/s per GPU
    inter_node_latency=6e-6,            # ESTIMATE
    op_overhead=4e-6,                   # ESTIMATE
    sources={"all": "NVIDIA H200 Tensor Core GPU datasheet; compute as H100"},
)

# NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB).
A100 = DeviceProfile(
    name="a100",
    matrix_flops={"fp16": 312 * TFLOPS, "bf16": 312 * TFLOPS, "fp32": 156 * TFLOPS,  # TF32
                  "fp64": 19.5 * TFLOPS, "int8": 624 * TFLOPS},
    # Datasheet: 19.5 TFLOPS fp32; Ampere whitepaper: 78 TFLOPS fp16 non-tensor.
    vector_flops={"fp32": 19.5 * TFLOPS, "fp16": 78 * TFLOPS, "bf16": 39 * TFLOPS,
                  "fp64": 9.7 * TFLOPS},
    memory_bandwidth=2.039e12,          # datasheet: 80 GB HBM2e, 2,039 GB/s
    memory_capacity=80 * GB,
    intra_node_bandwidth=300 * GB,      # datasheet: NVLink 600 GB/s bidirectional
    intra_node_latency=3e-6,            # ESTIMATE
    inter_node_bandwidth=25 * GB,       # DGX A100: ConnectX-6 200 Gb/s per GPU
    inter_node_latency=6e-6,            # ESTIMATE
    op_overhead=4e-6,                   # ESTIMATE
    sources={"all": "NVIDIA A100 datasheet, Ampere GA100 whitepaper, DGX A100 user guide"},
)

_FIXED = {p.name: p for p in (ASCEND_910B, ASCEND_A3, H100, H200, A100)}


# -- CPU, measured -----------------------------------------------------------------------------
def _best_of(fn, repeats: int) -> float:
    # The calling thread's CPU time: the measurement runs on one thread (see _measure_cpu), so
    # this is the op's time without the time other processes held the core.
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return max(best, 1e-9)


_MEASURED_KEYS = ("matmul_flops", "vector_flops", "bandwidth", "op_overhead", "view_overhead", "class_bandwidth")


def _measure_cpu() -> dict:
    """Figures for this process's thread count, measured on one thread and scaled by it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _measure_one_thread()
    finally:
        torch.set_num_threads(threads)
    return _scaled(one, threads)


def _scaled(one: dict, threads: int) -> dict:
    # ESTIMATE: throughput scales with the intra-op threads (the per-op cost does not). Measured on
    # one thread because on a machine shared with other work a multi-threaded op waits at OpenMP
    # barriers for descheduled threads, and the figures would say more about the load than the ops.
    one = {k: v for k, v in one.items() if k != "threads_scaled_from_one"}
    scaled = {k: v * threads for k, v in one.items() if k in ("matmul_flops", "vector_flops", "bandwidth")}
    return {**one, **scaled, "class_bandwidth": {k: v * threads for k, v in one["class_bandwidth"].items()},
            "threads_scaled_from_one": threads}


def _measure_one_thread() -> dict:
    mm_a, mm_b = torch.randn(512, 256), torch.randn(256, 1024)
    # The faster of the two libraries a compiled step runs float32 matmuls with (ATen's MKL, and
    # oneDNN where linear_on_onednn measures it faster): the rate this CPU reaches, MFU's denominator.
    seconds = _best_of(lambda: mm_a @ mm_b, 5)
    if torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
        weight = mm_b.t()
        seconds = min(seconds, _best_of(
            lambda: torch.ops.mkldnn._linear_pointwise(mm_a, weight, None, "none", [], ""), 5))
    matmul = 2 * 512 * 256 * 1024 / seconds
    x, z = torch.randn(4 * 2**20), torch.randn(4 * 2**20)
    y = torch.empty_like(x)
    # One add reads 8 and writes 4 bytes per element: bandwidth-bound, so it also bounds
    # the vector rate from below; a multiply-add chain on a cache-sized tensor bounds it above.
    add = _best_of(lambda: torch.add(x, x, out=y), 5)
    copy = _best_of(lambda: y.copy_(x), 5)
    small = torch.randn(32 * 1024)
    small_out = torch.empty_like(small)
    vec = small.numel() / _best_of(lambda: torch.mul(small, small, out=small_out), 20)
    # Per class, as a functional graph runs it: a fresh output each time, bytes = read + written
    # (what graph_ir.analysis.cost counts).
    m = 2**18
    u, v = x[:m].clone(), z[:m].clone()
    elementwise = 12 * m / _best_of(lambda: torch.mul(u, v), 10)
    rows = u.view(256, 1024)
    reduction = (4 * m + 4 * 256) / _best_of(lambda: rows.sum(-1), 10)
    scores = u.view(2 * 4 * 128, 256)
    softmax = 8 * m / _best_of(lambda: torch.softmax(scores, -1), 10)
    rng = 8 * m / _best_of(lambda: torch.ops.aten.bernoulli.p(u, 0.9), 10)   # what dropout draws
    overhead, view = launch_costs()
    return {"matmul_flops": matmul, "vector_flops": max(vec, x.numel() / add),
            "bandwidth": max(12 * x.numel() / add, 8 * x.numel() / copy), "op_overhead": overhead,
            "view_overhead": view,
            "class_bandwidth": {"elementwise": elementwise, "reduction": reduction, "softmax": softmax,
                                "rng": rng}}


def thread_time_median(fn, repeats: int = 7) -> float:
    """Median seconds of this thread's CPU time over ``repeats`` calls of ``fn``, after one
    warm-up call: what the calibration and the timed steps it is compared with are measured by."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return sorted(times)[len(times) // 2]


def launch_costs(chain: int = 200, repeats: int = 7) -> tuple[float, float]:
    """(seconds per launched op, seconds per view op) as the eager backend's generated code pays
    them: ``torch.ops.aten`` overloads called from Python on a 1-element tensor, the median over
    ``repeats`` chains of ``chain`` calls (this thread's CPU time)."""
    one = torch.ones(1)
    add, view, t = torch.ops.aten.add.Tensor, torch.ops.aten.view.default, torch.ops.aten.t.default

    def adds():
        x = one
        for _ in range(chain):
            x = add(x, one)

    def views():
        x = one.view(1, 1)
        for _ in range(chain // 2):
            x = t(view(x, [1, 1]))

    def per_call(fn):
        return max(thread_time_median(fn, repeats) / chain, 1e-9)
    return per_call(adds), per_call(views)


def _cpu_identity() -> str:
    """The CPU a measurement belongs to: the vector ISA torch's kernels use and the model name. A
    home directory can move to another machine of the same architecture and core count: there a
    cached AVX2 measurement would price an AVX-512 CPU (and put a recipe's MFU above 100%)."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{torch.backends.cpu.get_cpu_capability()}-{digest}"


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = (f"{platform.machine()}-{_cpu_identity()}-{os.cpu_count()}-{torch.get_num_threads()}-"
           f"{torch.__version__}")
    key = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    # v2: the matmul rate is the faster of MKL and oneDNN (v1 timed MKL alone)
    return os.path.join(base, "cann_passes", f"cpu_profile-v2-{key}.json")


# The measurement every rank of a run prices with (rank 0's, handed out by init_distributed).
_SHARED: dict | None = None


PROFILE_ENV = "CANN_PASSES_CPU_PROFILE"


def _pinned() -> dict | None:
    """The one-thread figures ``$CANN_PASSES_CPU_PROFILE`` names, scaled to this process's threads."""
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            one = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"${PROFILE_ENV}={path}: cannot read a CPU measurement from it ({exc})") from exc
    missing = [k for k in _MEASURED_KEYS if k not in one]
    if missing:
        raise ValueError(f"${PROFILE_ENV}={path}: a CPU measurement needs {', '.join(missing)}")
    return _scaled(one, torch.get_num_threads())


def measured_cpu() -> dict:
    """This machine's CPU measurement: the pinned one (``$CANN_PASSES_CPU_PROFILE``), else the
    on-disk cache's, else measured now (cached unless the machine was busy)."""
    pinned = _pinned()
    if pinned is not None:
        return pinned
    path = _cache_path()
    try:
        with open(path, encoding="utf-8") as f:
            measured = json.load(f)
        if not all(k in measured for k in _MEASURED_KEYS):
            raise ValueError("written by an older version: measure again")
    except (OSError, ValueError):
        measured = _measure_cpu()
        if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
            return measured              # other work inflated the figures: measure again next time
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(measured, f)
        except OSError:  # a read-only home: measure again next process
            pass
    return measured


def share_measurement(measured: dict | None) -> None:
    """Price with ``measured`` from now on (None: this process's own again). The ranks of a run
    must make the same priced choices (pipeline cuts, recompute selections): each measuring for
    itself, on a machine the others load, they could cut their stages differently."""
    global _SHARED
    if measured is not None and not all(k in measured for k in _MEASURED_KEYS):
        raise ValueError(f"a shared CPU measurement needs {', '.join(_MEASURED_KEYS)}; got {sorted(measured)}")
    _SHARED = None if measured is None else dict(measured)
    cpu_profile.cache_clear()


@functools.lru_cache(maxsize=1)
def cpu_profile() -> DeviceProfile:
    """This machine's CPU, measured once (then read from the on-disk cache), or the measurement
    shared by rank 0 of a run (``share_measurement``)."""
    measured = _SHARED or measured_cpu()
    matmul, vector = measured["matmul_flops"], measured["vector_flops"]
    return DeviceProfile(
        name="cpu",
        # Measured: fp32 512x256x1024 matmul; bf16/fp16 matmuls on CPUs without AMX/AVX512-BF16 are
        # not faster, so they are given the fp32 rate.
        matrix_flops={"fp32": matmul, "bf16": matmul, "fp16": matmul},
        vector_flops={"fp32": vector, "bf16": vector, "fp16": vector},
        memory_bandwidth=measured["bandwidth"],
        memory_capacity=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        # Collectives between processes on one host go through shared memory (gloo):
        # ESTIMATE a quarter of the measured copy bandwidth, 20 us per step.
        intra_node_bandwidth=measured["bandwidth"] / 4, intra_node_latency=20e-6,
        inter_node_bandwidth=1.25 * GB, inter_node_latency=50e-6,  # ESTIMATE: 10GbE
        devices_per_node=os.cpu_count() or 1,
        op_overhead=measured["op_overhead"],            # a 1-element aten.add from Python
        view_overhead=measured["view_overhead"],        # aten.view / aten.t from Python
        class_bandwidth=dict(measured["class_bandwidth"]),
        sources={"all": "measured by microbenchmark on rank 0 of this run" if _SHARED else
                 f"measured by microbenchmark, cached in {_cache_path()}"},
    )


def get_profile(name: str) -> DeviceProfile:
    """A profile by name; ``auto`` is the machine this runs on (the CPU here: no NPU or GPU)."""
    if name in ("auto", "cpu"):
        return cpu_profile()
    if name not in _FIXED:
        raise ValueError(f"unknown device profile {name!r}; known: auto, cpu, {', '.join(_FIXED)}")
    return _FIXED[name]


def profile_names() -> tuple[str, ...]:
    return ("cpu", *_FIXED)
