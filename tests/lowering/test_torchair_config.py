"""Plan torchair options -> torchair CompilerConfig, checked against the real (offline-loaded) class."""
from __future__ import annotations

import pytest

from cann_passes import Plan, PlanError
from cann_passes.lowering.torchair import build_compiler_config
from cann_passes.lowering.torchair_config import OPTIONS, apply_assignments, config_assignments


@pytest.fixture(scope="module")
def CompilerConfig(torchair):   # torchair (tests/conftest.py) skips where the wheel cannot be had
    from torchair.configs.compiler_config import CompilerConfig
    return CompilerConfig


class _Torchair:  # what build_compiler_config needs of the torchair module
    def __init__(self, cls):
        self.CompilerConfig = cls


def _build(CompilerConfig, **options):
    return build_compiler_config(_Torchair(CompilerConfig), Plan(torchair=options))


class TestMapping:
    def test_each_option_maps_to_one_attribute(self):
        assert config_assignments({"mode": "ge"}) == {"mode": "max-autotune"}
        assert config_assignments({"mode": "aclgraph"}) == {"mode": "reduce-overhead"}
        assert config_assignments({"graph_dump": "pbtxt", "graph_dump_dir": "/tmp/d"}) == {
            "debug.graph_dump.type": "pbtxt", "debug.graph_dump.path": "/tmp/d"}
        assert config_assignments({"frozen_parameter": True}) == {"experimental_config.frozen_parameter": True}
        assert config_assignments({"memory_efficiency": True, "topology_sorting": "RDFS"}) == {
            "experimental_config.memory_efficiency": True,
            "experimental_config.topology_sorting_strategy": "RDFS"}
        assert config_assignments({"ge_opt_level": "O1", "single_stream": True}) == {
            "ge_config.oo_level": "O1", "ge_config.enable_single_stream": True}

    @pytest.mark.parametrize("options, words", [
        ({"mode": "graph"}, ["torchair.mode", "'graph'"]),
        ({"frozen_parameter": "yes"}, ["torchair.frozen_parameter"]),
        ({"ge_opt_level": "O2"}, ["torchair.ge_opt_level", "O3"]),
        ({"optimise": True}, ["torchair.optimise", "unknown option"]),
        ({"mode": "aclgraph", "ge_opt_level": "O1"}, ["torchair.ge_opt_level", "mode 'ge' only"]),
        ({"mode": "aclgraph", "single_stream": True}, ["torchair.single_stream", "mode 'ge' only"]),
        ({"graph_dump_dir": "/tmp/x"}, ["torchair.graph_dump_dir", "graph_dump"]),
    ])
    def test_bad_options_name_the_key(self, options, words):
        with pytest.raises(ValueError) as err:
            config_assignments(options)
        assert all(w in str(err.value) for w in words), str(err.value)

    def test_plan_rejects_bad_options_as_a_plan_error(self):
        with pytest.raises(PlanError, match="torchair"):
            Plan(torchair={"mode": "eager"})


class TestRealCompilerConfig:
    def test_every_attribute_path_exists_on_compiler_config(self, CompilerConfig):
        config = CompilerConfig()
        for key, (path, _, _) in OPTIONS.items():
            target = config
            for name in path.split("."):
                assert hasattr(target, name), f"{key}: CompilerConfig has no {path}"
                target = getattr(target, name)

    def test_defaults_leave_torchair_defaults(self, CompilerConfig):
        assert _build(CompilerConfig).as_dict() == CompilerConfig().as_dict()

    def test_ge_graph_mode_options_reach_ge_options(self, CompilerConfig, tmp_path):
        config = _build(CompilerConfig, mode="ge", ge_opt_level="O1", single_stream=True,
                        memory_efficiency=True, topology_sorting="StableRDFS", frozen_parameter=False,
                        graph_dump="txt", graph_dump_dir=str(tmp_path))
        assert config.mode.value == "max-autotune"
        local, global_ = config.as_dict()
        assert global_["ge.oo.level"] == "O1" and global_["ge.enableSingleStream"] == "true"
        assert local["ge.featureBaseRefreshable"] == "1" and local["ge.topoSortingMode"] == "3"
        assert local["frozen_parameter"] == "0"
        assert config.debug.graph_dump.enabled and config.debug.graph_dump.type.value == "txt"
        assert config.debug.graph_dump.path == str(tmp_path)

    def test_aclgraph_mode(self, CompilerConfig):
        config = _build(CompilerConfig, mode="aclgraph", frozen_parameter=True)
        assert config.mode.value == "reduce-overhead"
        assert config.experimental_config.frozen_parameter.value == "1"

    def test_torchair_setters_validate_too(self, CompilerConfig):
        # our mapping is the first check; torchair's own option types are the second
        with pytest.raises(ValueError, match="not in optional list"):
            apply_assignments(CompilerConfig(), {"ge_config.oo_level": "O2"})
