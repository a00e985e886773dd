"""``shard_expert_parallel``'s balanced placement (a property over routing counts) and its refusals on one process.
Deploys over two ranks: ``tests/distributed/test_expert_parallel.py``."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy import autodeploy
from autodeploy.errors import ConfigError
from autodeploy.transforms.shard_expert_parallel import balanced_placement, imbalance, rank_loads


@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(1, 4), per_rank=st.integers(1, 4), data=st.data())
def test_balanced_placement_is_an_even_deal_no_worse_than_contiguous(ranks, per_rank, data):
    experts = ranks * per_rank
    counts = data.draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))
    order = balanced_placement(counts, ranks)
    assert sorted(order) == list(range(experts))
    assert all(order[r * per_rank:(r + 1) * per_rank] == sorted(order[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))
    assert imbalance(order, counts, ranks) <= imbalance(list(range(experts)), counts, ranks)
    assert sum(rank_loads(order, counts, ranks)) == sum(counts)
    assert balanced_placement(counts, ranks) == order  # deterministic


def test_skewed_routing_is_evened_out():
    counts = [900, 800, 10, 5, 700, 3, 2, 1]  # contiguous over 2 ranks: 1715 against 706
    order = balanced_placement(counts, 2)
    assert imbalance(list(range(8)), counts, 2) == pytest.approx(1715 / 1210.5)
    assert order == [0, 2, 3, 5, 1, 4, 6, 7]  # the best deal of 4 a rank: 918 against 1503 (two of the big three share)
    assert imbalance(order, counts, 2) == pytest.approx(1503 / 1210.5)


def test_what_expert_parallelism_cannot_serve_is_refused_at_build(tiny_checkpoint, monkeypatch):
    # Checked before any collective: no process group is needed to see them.
    from autodeploy import api, distributed

    monkeypatch.setattr(api, "init_distributed", lambda settings, store=None: None)
    monkeypatch.setattr(api, "should_spawn", lambda settings: False)
    monkeypatch.setattr(distributed, "check_parallelism", lambda settings, hf_config: None)
    monkeypatch.setattr(api, "check_parallelism", lambda settings, hf_config: None)
    with pytest.raises(ConfigError, match="expert_parallel=2 but this model has no MoE layers"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"expert_parallel": 2})
    with pytest.raises(ConfigError, match="expert_parallel=3 must divide the experts \\(4\\)"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", distributed={"expert_parallel": 3})
    # Quantized experts are placed whole (tests/distributed/test_expert_parallel.py); TP alone would slice their scales.
    with pytest.raises(ConfigError, match="quantize.experts=int4_wo with expert_parallel=1 and tensor_parallel=2 is not "
                                          "available: tensor parallelism slices every expert's intermediate size"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", distributed={"tensor_parallel": 2},
                   quantize={"experts": "int4_wo", "int4_group_size": 32})
    with pytest.raises(ConfigError, match="expert_parallel > 1 with quantized dense layers is not available yet"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", distributed={"expert_parallel": 2},
                   quantize={"default": "int8_wo"})
    with pytest.raises(ConfigError, match="balanced measures routing on the checkpoint's weights"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", weights="random",
                   distributed={"expert_parallel": 2, "expert_placement": "balanced"})
    with pytest.raises(ConfigError, match="with expert_parallel=1 it would do nothing"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", distributed={"expert_placement": "balanced"})
    with pytest.raises(ConfigError, match="expert_placement must be contiguous or balanced"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", distributed={"expert_placement": "random"})
