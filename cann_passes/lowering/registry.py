"""The backends by name, and the choice of one: ``auto`` picks torchair where an Ascend NPU is
usable, inductor where a C++ toolchain exists (its CPU code generator needs one), and eager
otherwise."""
from __future__ import annotations

from .base import BackendUnavailable, Lowering
from .eager import EagerLowering
from .inductor import InductorLowering
from .torchair import TorchairLowering

BACKENDS = {"eager": EagerLowering, "inductor": InductorLowering, "torchair": TorchairLowering}


def required_passes(name: str) -> tuple[str, ...]:
    """The passes backend ``name`` needs at the end of a pipeline (pipeline text)."""
    passes = getattr(get_lowering(name), "required_passes", ())
    return tuple(passes() if callable(passes) else passes)


def get_lowering(name: str) -> Lowering:
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)} or auto")
    return BACKENDS[name]()


def resolve_backend(name: str) -> str:
    """The concrete backend for ``name``; ``auto`` -> torchair on NPU, else inductor, else eager."""
    if name != "auto":
        ok, why = get_lowering(name).available()
        if not ok:
            raise BackendUnavailable(f"backend '{name}' is not usable here: {why}")
        return name
    for candidate in ("torchair", "inductor"):
        if get_lowering(candidate).available()[0]:
            return candidate
    return "eager"


def available_backends() -> dict[str, str]:
    """Each backend -> '' if usable, else what is missing."""
    return {n: get_lowering(n).available()[1] for n in ("eager", "inductor", "torchair")}
