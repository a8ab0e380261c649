"""Lowering backends behind one interface: eager, inductor, torchair (Ascend GE)."""
from .base import BackendUnavailable, Lowering, LoweringFailed
from .registry import available_backends, get_lowering, required_passes, resolve_backend

__all__ = ["BackendUnavailable", "Lowering", "LoweringFailed", "available_backends", "get_lowering", "required_passes",
           "resolve_backend"]
