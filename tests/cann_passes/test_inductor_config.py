"""The inductor settings for whole-step graphs apply inside ``step_settings`` and are restored after."""
from __future__ import annotations


def test_the_step_settings_apply_inside_and_are_restored():
    from torch._inductor import config
    from cann_passes.lowering.inductor_config import SETTINGS, step_settings
    before = {k: getattr(config, k) for k in SETTINGS}
    with step_settings():
        assert {k: getattr(config, k) for k in SETTINGS} == SETTINGS
    assert {k: getattr(config, k) for k in SETTINGS} == before
