"""Cost model: profiles carry sources, the roofline picks the right unit, alpha-beta is sane."""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes.cost_model import collective_time, cpu_profile, get_profile, node_time, profile_names
from cann_passes.cost_model.profiles import _FIXED


class TestProfiles:
    @pytest.mark.parametrize("name", sorted(_FIXED))
    def test_every_fixed_profile_is_complete_and_sourced(self, name):
        p = get_profile(name)
        assert p.sources
        assert p.matrix_flops["bf16"] > p.vector_flops["bf16"] > 0
        assert p.matrix_flops["bf16"] >= p.matrix_flops["fp32"]
        assert p.memory_bandwidth > p.intra_node_bandwidth >= p.inter_node_bandwidth > 0
        assert p.memory_capacity >= 64e9

    def test_cpu_profile_is_measured_quickly_and_cached(self):
        start = time.perf_counter()
        first = cpu_profile()
        assert time.perf_counter() - start < 2.0
        assert cpu_profile() is first
        assert get_profile("auto") is first
        assert first.matrix_flops["fp32"] > 1e8 and first.memory_bandwidth > 1e8
        assert set(first.class_bandwidth) == {"elementwise", "reduction", "softmax", "rng"}
        assert all(v > 1e6 for v in first.class_bandwidth.values()) and first.op_overhead > 0

    def test_a_cache_from_an_older_version_is_measured_again(self, tmp_path, monkeypatch):
        from cann_passes.cost_model import profiles
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
        monkeypatch.setattr(profiles.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        path = profiles._cache_path()
        import json
        import os
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            json.dump({"matmul_flops": 1.0, "vector_flops": 1.0, "bandwidth": 1.0}, f)
        profiles.cpu_profile.cache_clear()
        try:
            fresh = profiles.cpu_profile()
            assert fresh.class_bandwidth and fresh.matrix_flops["fp32"] > 1.0
            with open(path) as f:
                assert "class_bandwidth" in json.load(f)
        finally:
            profiles.cpu_profile.cache_clear()

    def test_a_measurement_cached_for_another_cpu_is_not_read(self, monkeypatch):
        # same architecture and core count, another vector ISA or model: its own cache entry
        from cann_passes.cost_model import profiles
        here = profiles._cache_path()
        assert torch.backends.cpu.get_cpu_capability() in os.path.basename(here)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-elsewhere")
        assert profiles._cache_path() != here
        monkeypatch.undo()
        monkeypatch.setattr(profiles.platform, "processor", lambda: "another model")
        real_open = open
        monkeypatch.setattr("builtins.open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no cpuinfo"))
                            if path == "/proc/cpuinfo" else real_open(path, *a, **k))
        assert profiles._cache_path() != here

    def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(self, tmp_path, monkeypatch):
        from cann_passes.cost_model import profiles
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
        monkeypatch.setattr(profiles.os, "getloadavg", lambda: (float(os.cpu_count() or 1), 0.0, 0.0))
        measured = profiles.measured_cpu()
        assert measured["matmul_flops"] > 1e8 and not os.path.exists(profiles._cache_path())

    def test_a_pinned_measurement_is_priced_with_and_scaled_to_the_threads(self, tmp_path, monkeypatch):
        import json
        from cann_passes.cost_model import profiles
        one = {"matmul_flops": 1e10, "vector_flops": 1e9, "bandwidth": 2e10, "op_overhead": 2e-6,
               "view_overhead": 1e-6, "class_bandwidth": {"elementwise": 1e10, "reduction": 1e10,
                                                          "softmax": 1e9, "rng": 1e9}}
        path = tmp_path / "cpu.json"
        path.write_text(json.dumps(one))
        monkeypatch.setenv(profiles.PROFILE_ENV, str(path))
        threads = torch.get_num_threads()
        measured = profiles.measured_cpu()
        assert measured["matmul_flops"] == 1e10 * threads and measured["op_overhead"] == 2e-6
        path.write_text(json.dumps({"matmul_flops": 1.0}))
        with pytest.raises(ValueError, match="CANN_PASSES_CPU_PROFILE.*needs vector_flops"):
            profiles.measured_cpu()

    def test_a_measurement_shared_by_rank_0_prices_every_rank_alike(self):
        # init_distributed hands rank 0's measurement to every rank (through the rendezvous store),
        # so the ranks' priced choices (the pipeline cut) agree
        from cann_passes.cost_model import profiles
        own = get_profile("auto").matrix_flops["fp32"]
        try:
            profiles.share_measurement(dict(profiles.measured_cpu(), matmul_flops=1.5e9))
            assert get_profile("auto").matrix_flops["fp32"] == 1.5e9
            with pytest.raises(ValueError, match="needs matmul_flops.*got \\['matmul_flops'\\]"):
                profiles.share_measurement({"matmul_flops": 1.0})
            assert get_profile("auto").matrix_flops["fp32"] == 1.5e9
        finally:
            profiles.share_measurement(None)
        assert get_profile("auto").matrix_flops["fp32"] == own

    def test_unknown_profile_is_refused_by_name(self):
        with pytest.raises(ValueError, match="'tpu'"):
            get_profile("tpu")
        assert set(profile_names()) >= {"cpu", "ascend_910b", "ascend_a3", "h100", "h200", "a100"}


def _graph(fn, *shapes, dtype=torch.float32):
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s, dtype=dtype) for s in shapes])


class TestRoofline:
    def test_matmul_uses_the_matrix_unit_and_elementwise_the_memory_bound(self):
        p = get_profile("h100")
        gm = _graph(lambda a, b: torch.mm(a, b).relu(), (4096, 4096), (4096, 4096), dtype=torch.bfloat16)
        mm, relu = [n for n in gm.graph.nodes if n.op == "call_function"]
        expected_mm = 2 * 4096**3 / p.matrix_flops["bf16"]
        assert node_time(mm, p) == pytest.approx(p.op_overhead + expected_mm)
        expected_relu = 2 * 4096 * 4096 * 2 / p.memory_bandwidth
        assert node_time(relu, p) == pytest.approx(p.op_overhead + expected_relu)

    def test_bf16_matmul_is_faster_than_fp32_on_an_npu(self):
        p = get_profile("ascend_910b")
        times = []
        for dtype in (torch.float32, torch.bfloat16):
            gm = _graph(torch.mm, (2048, 2048), (2048, 2048), dtype=dtype)
            times.append(node_time(next(n for n in gm.graph.nodes if n.op == "call_function"), p))
        assert times[1] < times[0]

    def test_op_classes_and_the_measured_class_bandwidth(self):
        from dataclasses import replace

        from cann_passes.cost_model.roofline import op_class

        def f(a, b):
            s = torch.mm(a, b)
            return torch.bernoulli(s, 0.9) + s.softmax(-1), s.sum(-1)

        gm = _graph(f, (64, 64), (64, 64))
        nodes = {str(n.target).split(".")[1]: n for n in gm.graph.nodes if n.op == "call_function"}
        assert {k: op_class(v) for k, v in nodes.items()} == {
            "mm": "matmul", "bernoulli": "rng", "_softmax": "softmax", "add": "elementwise", "sum": "reduction"}
        base = replace(get_profile("a100"), op_overhead=0.0)
        slow_rng = replace(base, class_bandwidth={"rng": base.memory_bandwidth / 10})
        assert node_time(nodes["bernoulli"], slow_rng) == pytest.approx(10 * node_time(nodes["bernoulli"], base))
        # A class the profile does not time uses the memory bandwidth; matmuls their FLOP rate.
        assert node_time(nodes["add"], slow_rng) == node_time(nodes["add"], base)
        assert node_time(nodes["mm"], slow_rng) == node_time(nodes["mm"], base)

    def test_views_cost_nothing(self):
        gm = _graph(lambda a: a.t().unsqueeze(0), (64, 64))
        assert all(node_time(n, get_profile("a100")) == 0 for n in gm.graph.nodes)


class TestCollectives:
    def test_tree_wins_small_messages_and_ring_wins_large_ones(self):
        p = get_profile("h100")
        assert collective_time("all_reduce", 1024, 8, p, "tree") < collective_time("all_reduce", 1024, 8, p, "ring")
        big = 1 << 30
        assert collective_time("all_reduce", big, 8, p, "ring") < collective_time("all_reduce", big, 8, p, "tree")

    def test_ring_all_reduce_matches_the_alpha_beta_formula(self):
        p = get_profile("ascend_910b")
        n, ranks = 256e6, 8
        expected = 2 * 7 * p.intra_node_latency + 2 * 7 / 8 * n / p.intra_node_bandwidth
        assert collective_time("all_reduce", n, ranks, p) == pytest.approx(expected)
        # Crossing nodes is bounded by the slower network.
        assert collective_time("all_reduce", n, 16, p) > 4 * collective_time("all_reduce", n, 8, p)

    def test_all_gather_and_reduce_scatter_move_half_what_all_reduce_does(self):
        p = get_profile("h200")
        ar = collective_time("all_reduce", 1e9, 8, p)
        ag = collective_time("all_gather", 1e9, 8, p)
        rs = collective_time("reduce_scatter", 1e9, 8, p)
        assert ag == pytest.approx(rs) == pytest.approx(ar / 2)
        assert collective_time("all_reduce", 1e9, 1, p) == 0

    def test_unknown_collective_and_algorithm_are_refused(self):
        with pytest.raises(ValueError, match="gossip"):
            collective_time("gossip", 1, 2, get_profile("h100"))
        with pytest.raises(ValueError, match="'mesh'"):
            collective_time("all_reduce", 1, 2, get_profile("h100"), "mesh")
