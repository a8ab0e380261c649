"""Running compiled steps: binding a model and optimizer to a graph and back."""
from .step import CompiledStep

__all__ = ["CompiledStep"]
