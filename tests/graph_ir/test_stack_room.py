"""``with_stack_room``: a call whose frames oscillate across more than one CPython frame chunk no
longer maps a chunk and faults its pages in on every oscillation; the call itself is unchanged."""
from __future__ import annotations

import sys

import pytest

from graph_ir.stack_room import with_stack_room

resource = pytest.importorskip("resource")

needs_chunked_frames = pytest.mark.skipif(
    sys.implementation.name != "cpython" or sys.version_info < (3, 11),
    reason="frames live in mapped chunks on CPython 3.11+ only")

DEPTH = 400          # small frames of about 100 bytes each: a 40 KiB stretch, more than a 16 KiB chunk
OSCILLATIONS = 300


def _down(n: int) -> int:
    return _down(n - 1) if n else 0


def _oscillate() -> int:
    """Page faults while calling down ``DEPTH`` frames and back, ``OSCILLATIONS`` times."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(OSCILLATIONS):
        _down(DEPTH)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@needs_chunked_frames
def test_frames_deeper_than_a_chunk_stop_faulting_with_stack_room():
    _oscillate()   # warm: the interpreter's own first-use faults
    # Without room, each oscillation crosses into a fresh chunk and unmaps it on the way back.
    assert _oscillate() >= OSCILLATIONS
    assert with_stack_room(_oscillate)() < OSCILLATIONS // 10


def test_the_wrapped_call_keeps_its_arguments_result_name_and_errors():
    def scale(x, *, by):
        if by == 0:
            raise ValueError("by must not be 0")
        return x * by

    roomy = with_stack_room(scale)
    assert roomy(3, by=4) == 12
    assert roomy.__name__ == "scale" and roomy.__wrapped__ is scale
    with pytest.raises(ValueError, match="by must not be 0"):
        roomy(3, by=0)
