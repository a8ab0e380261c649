"""Command-line front ends: cann-graph-dump, cann-lower-check."""
