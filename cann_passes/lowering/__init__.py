"""Lowering backends behind one interface: eager, inductor, torchair (Ascend GE)."""
from .base import BackendUnavailable, Lowering, available_backends, get_lowering, resolve_backend

__all__ = ["BackendUnavailable", "Lowering", "available_backends", "get_lowering", "resolve_backend"]
