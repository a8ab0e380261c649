"""Every entry of the usage fuzz corpus (tests/usage_fuzz.py): eager's result, with the recompiles
and reasons it names, or its exact one-line refusal with the state untouched."""
from __future__ import annotations

import re

import pytest

from tests.usage_fuzz import USAGES, run


@pytest.mark.parametrize("usage", USAGES, ids=[u.name.replace(" ", "_") for u in USAGES])
def test_usage(usage):
    if usage.refusal is not None:
        with pytest.raises(Exception) as info:
            run(usage)
        text = str(info.value)
        assert "\n" not in text.strip() and re.search(usage.refusal, text), text
        return
    outcome = run(usage)
    for got, want in zip(outcome.compiled, outcome.eager):
        assert abs(got - want) <= usage.tol * abs(want), (outcome.compiled, outcome.eager)
    assert outcome.max_param_diff <= max(usage.tol, 1e-5 if usage.tol else 0.0), outcome.max_param_diff
    if usage.recompiles is not None:
        assert len(outcome.recompile_reasons) == usage.recompiles, outcome.recompile_reasons
    if usage.reason:
        assert all(r.startswith(usage.reason) for r in outcome.recompile_reasons), outcome.recompile_reasons
