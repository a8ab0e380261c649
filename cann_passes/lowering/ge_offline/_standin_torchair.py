"""Offline stand-in for torchair's native module ``torchair.core._torchair``.

GRAPH-CONSTRUCTION ONLY; NEVER USED WHERE CANN EXISTS.

torchair builds GE graphs (``ge_ir_pb2.GraphDef`` protobufs) in pure Python.
The only native module that graph *construction* touches is
``torchair.core._torchair`` (a pybind11 extension linked against CANN's
``libge_runner.so``/``libgraph.so``/``libascendcl.so`` and ``libtorch``):

* ``TorchNpuGraphBase`` -- base class of ``torchair.core._backend.TorchNpuGraph``;
  every ``GeGraph`` instantiates one in its constructor (the "executor").
* ``TorchDataType`` -- dtype enum referenced at import time by ``llm_datadist``.
* ``InitializeGraphEngine`` / ``FinalizeGraphEngine`` -- called by
  ``GeConcreteGraph.__init__`` and at interpreter exit.
* ``check_cann_compat`` -- queried by ``compat_ir.ge_op`` when a converter
  emits an op through the CANN-compat path; we answer "compatible" ("").
* ``get_registered_ir_def`` -- only used to *auto-generate* converters for
  custom (non-aten) ops from CANN's op registry; we answer "not available",
  which torchair turns into a clean RuntimeError (reported as unsupported).

Everything that needs GE proper (``load``/``compile``/``run``/``export``/
``auto_tune``, dump/soc queries) raises :class:`GeOfflineUnavailable`, so the
stand-in can never silently pretend to execute or compile a graph.

The loader (``_loader.py``) installs this module under the name
``torchair.core._torchair`` only when the real extension cannot be imported.
"""

from __future__ import annotations

import enum

IS_OFFLINE_STANDIN = True


class GeOfflineUnavailable(RuntimeError):
    """Raised for any operation that needs the real Graph Engine (CANN)."""


def _unavailable(what: str):
    raise GeOfflineUnavailable(
        f"{what} needs the CANN Graph Engine; this is the cann_passes offline "
        "torchair stand-in, which only supports GE graph construction"
    )


class TorchDataType(enum.IntEnum):
    BOOL = 0
    UINT8 = 1
    INT8 = 2
    INT16 = 3
    UINT16 = 4
    INT32 = 5
    UINT32 = 6
    INT64 = 7
    UINT64 = 8
    BF16 = 9
    FLOAT16 = 10
    FLOAT32 = 11
    FLOAT64 = 12
    COMPLEX64 = 13
    COMPLEX128 = 14


class TorchNpuGraphBase:
    """Executor half of ``GeGraph``; construction is fine, execution is not."""

    def __init__(self, name: str = "") -> None:
        self._name = str(name)

    def load(self, *args, **kwargs):
        _unavailable("TorchNpuGraph.load (GE graph load)")

    def compile(self, *args, **kwargs):
        _unavailable("TorchNpuGraph.compile")

    def auto_tune(self, *args, **kwargs):
        _unavailable("TorchNpuGraph.auto_tune")

    def run(self, *args, **kwargs):
        _unavailable("TorchNpuGraph.run")

    def set_hint_shape(self, *args, **kwargs):
        return None

    def summary(self, *args, **kwargs):
        _unavailable("TorchNpuGraph.summary")


def InitializeGraphEngine(options=None):  # noqa: N802 - mirrors the native name
    return None


def FinalizeGraphEngine():  # noqa: N802
    return None


def SetDebugLogPath(path):  # noqa: N802
    return None


def StupidRepeat(word, times):  # noqa: N802 - torchair's native smoke-test function
    return str(word) * int(times)


def check_cann_compat(optype, runtime_optional_inputs=(), runtime_optional_attrs=()):
    # "" means compatible: offline we cannot query the installed CANN opset, so
    # we build the newest IR that torchair's converters emit.
    return ""


def get_registered_ir_def(op_type):
    # Status "None" makes torchair raise ConverterErrorMsg.SO_LOAD_FAILED, i.e.
    # no auto-generated converter for ops outside torchair's own registry.
    return "None", [], [], []


def InitDeviceStdoutChannel(device_id):  # noqa: N802
    _unavailable("InitDeviceStdoutChannel")


def GetSocName():  # noqa: N802
    _unavailable("GetSocName")


def export(serialized_graph, options):
    _unavailable("torchair export (.air)")


def AclmdlSetDump(path):  # noqa: N802
    _unavailable("AclmdlSetDump")


def AclopStartDumpArgs(*args):  # noqa: N802
    _unavailable("AclopStartDumpArgs")


def AclopStopDumpArgs(*args):  # noqa: N802
    _unavailable("AclopStopDumpArgs")


def as_torch_tensors(*args):
    _unavailable("as_torch_tensors")
