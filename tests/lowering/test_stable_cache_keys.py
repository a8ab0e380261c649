"""Inductor's cache keys do not depend on what a process imported first (``stable_cache_keys``).

A memory format pickles by name with no module, and pickle takes the first module in
``sys.modules`` that reaches ``torch``: a module registered before torch was imported that holds
it (a rank started by multiprocessing: its ``__mp_main__``), elsewhere ``torch._utils``. Two
processes, one of each kind, hash the same tensor metadata as inductor's cache keys do."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HASH = """
import torch
from torch._inductor.codecache import FxGraphCachePickler, extract_tensor_metadata_for_cache_key
from cann_passes.lowering.inductor import stable_cache_keys
meta = extract_tensor_metadata_for_cache_key(torch.empty(2, 3))
pickler = lambda: FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
with stable_cache_keys():
    stable = pickler().get_hash(meta)
print(pickler().get_hash(meta), stable)
"""


# A module in sys.modules ahead of torch's own that reaches torch, as __mp_main__ is in a rank.
AHEAD = """
import sys, types
ahead = sys.modules["reaches_torch"] = types.ModuleType("reaches_torch")
import torch
ahead.torch = torch
"""


def _hashes(tmp_path, first: str) -> list[str]:
    code = f"{first}\n{HASH}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(tmp_path), env={"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    return out.stdout.split()


def test_a_memory_format_hashes_alike_whatever_the_process_imported_first(tmp_path):
    plain_raw, plain_stable = _hashes(tmp_path, "")
    first_raw, first_stable = _hashes(tmp_path, AHEAD)
    assert plain_raw != first_raw          # torch's own key: the import order shows through
    assert plain_stable == first_stable


def test_the_pickling_is_restored_after_the_lowering():
    import copyreg
    import pickle

    import torch

    from cann_passes.lowering.inductor import stable_cache_keys
    with stable_cache_keys():
        data = pickle.dumps(torch.channels_last)
        assert b"cann_passes.lowering.inductor" in data and pickle.loads(data) is torch.channels_last
    assert torch.memory_format not in copyreg.dispatch_table
