"""cann-graph-dump: per-pass dumps of a compiled training step, their diffs, and one HTML page."""
from .cli import main

__all__ = ["main"]
