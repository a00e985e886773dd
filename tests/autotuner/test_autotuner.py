"""The autotuner on an injected fake timer: it picks the fastest correct candidate per bucket, excludes
wrong and crashing ones, reuses its on-disk decisions, keys them by environment and survives a bad cache."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest
import torch

from autodeploy.autotuner import Autotuner, DecisionCache, bucket_for, environment, token_buckets
from autodeploy.autotuner import decision_cache


@dataclass
class Candidate:
    name: str
    op: object


def reference(x, weight):
    return (x.double() @ weight.double().T).to(x.dtype)


CANDIDATES = [
    Candidate("slow", lambda x, w: x @ w.T),
    Candidate("fast", lambda x, w: x @ w.T),
    Candidate("wrong", lambda x, w: x @ w.T + 1),
    Candidate("crashes", lambda x, w: (_ for _ in ()).throw(RuntimeError("no kernel image"))),
]
SPEED = {"slow": 2.0, "fast": 1.0, "wrong": 0.1, "crashes": 0.01}
WEIGHT = torch.randn(8, 16)


def make_inputs(num_tokens):
    return [torch.randn(num_tokens, 16), WEIGHT]


def fake_timer(log):
    def timer(backend, run, input_sets, device):
        run(input_sets[0])
        log.append(backend.name)
        return SPEED[backend.name]

    return timer


def decide(tuner, candidates=CANDIDATES, buckets=(1, 8)):
    return tuner.decide("probe", ["probe", "16x8"], candidates, reference, make_inputs, buckets, torch.float32)


def test_the_fastest_correct_candidate_wins_and_wrong_or_crashing_ones_are_excluded(tmp_path, caplog):
    timed = []
    tuner = Autotuner("cpu", tmp_path, timer=fake_timer(timed))
    with caplog.at_level(logging.WARNING):
        decisions = decide(tuner)
    assert {bucket: d.backend for bucket, d in decisions.items()} == {1: "fast", 8: "fast"}
    decision = decisions[1]
    assert set(decision.seconds) == {"slow", "fast"}
    assert "relative error" in decision.excluded["wrong"] and "RuntimeError" in decision.excluded["crashes"]
    assert "wrong" not in timed and "crashes" not in timed
    assert "'wrong' excluded" in caplog.text


def test_decisions_are_reused_from_disk_without_profiling(tmp_path):
    first = Autotuner("cpu", tmp_path, timer=fake_timer([]))
    decide(first)
    first.save()
    timed = []
    second = Autotuner("cpu", tmp_path, timer=fake_timer(timed))
    assert decide(second)[8].backend == "fast"
    assert timed == [] and second.profiled == 0


def test_a_device_or_version_change_profiles_again(tmp_path, monkeypatch):
    first = Autotuner("cpu", tmp_path, timer=fake_timer([]))
    decide(first)
    first.save()
    changed = dict(environment(torch.device("cpu")), torch="9.9.9")
    monkeypatch.setattr("autodeploy.autotuner.tuner.environment", lambda device, graphed=False: changed)
    timed = []
    later = Autotuner("cpu", tmp_path, timer=fake_timer(timed))
    decide(later)
    assert later.profiled == 2 and "fast" in timed
    assert later.cache.path != first.cache.path


def test_a_corrupt_cache_file_is_ignored_and_rebuilt(tmp_path, caplog):
    cache = DecisionCache(tmp_path, environment(torch.device("cpu")))
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        tuner = Autotuner("cpu", tmp_path, timer=fake_timer([]))
    assert "ignoring the unreadable cache" in caplog.text
    decide(tuner)
    tuner.save()
    assert json.loads(cache.path.read_text())["environment"] == environment(torch.device("cpu"))


def test_a_cache_written_for_another_environment_is_not_trusted(tmp_path, caplog):
    env = environment(torch.device("cpu"))
    cache = DecisionCache(tmp_path, env)
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text(json.dumps({"environment": dict(env, device="other"), "decisions": {}}))
    with caplog.at_level(logging.WARNING):
        assert DecisionCache(tmp_path, env).decisions == {}
    assert "another environment" in caplog.text


def test_an_unwritable_cache_path_keeps_decisions_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    tuner = Autotuner("cpu", blocker / "cache", timer=fake_timer([]))
    decide(tuner)
    with caplog.at_level(logging.WARNING):
        tuner.save()
    assert "kept in memory" in caplog.text
    assert decide(tuner)[1].backend == "fast" and tuner.profiled == 2


def test_no_correct_candidate_is_an_error_naming_the_reasons(tmp_path):
    tuner = Autotuner("cpu", tmp_path, timer=fake_timer([]))
    with pytest.raises(RuntimeError, match="no candidate of probe ran correctly"):
        decide(tuner, [CANDIDATES[2], CANDIDATES[3]])


def test_the_real_clock_times_on_the_cpu(tmp_path):
    tuner = Autotuner("cpu", tmp_path, warmup=1, repeats=3)
    decision = decide(tuner, CANDIDATES[:2], buckets=(4,))[4]
    assert decision.backend in ("slow", "fast") and all(s > 0 for s in decision.seconds.values())


def two_outputs(x, weight):
    """An op with two outputs, like add_rms_norm's (normed, sum)."""
    return reference(x, weight), x * 2


TWO_OUTPUT_CANDIDATES = [
    Candidate("slow", two_outputs),
    Candidate("fast", lambda x, w: (x @ w.T, x + x)),
    Candidate("wrong", lambda x, w: (x @ w.T, x * 3)),  # right first output, wrong second
    Candidate("one_output", lambda x, w: x @ w.T),  # one output where the reference gives two
]


@pytest.mark.parametrize("clock", ["fake", "real"])
def test_every_output_of_a_two_output_op_is_checked_before_it_is_timed(tmp_path, clock):
    timed = []
    timer = fake_timer(timed) if clock == "fake" else None
    tuner = Autotuner("cpu", tmp_path, timer=timer, warmup=1, repeats=3)
    decision = tuner.decide("pair", ["pair"], TWO_OUTPUT_CANDIDATES, two_outputs, make_inputs, (4,), torch.float32)[4]
    assert set(decision.seconds) == {"slow", "fast"} and all(s > 0 for s in decision.seconds.values())
    assert "relative error" in decision.excluded["wrong"]
    assert "relative error inf" in decision.excluded["one_output"]  # a structural mismatch
    if clock == "fake":
        assert decision.backend == "fast" and timed == ["slow", "fast"]


def test_token_buckets_cover_decode_and_prefill():
    buckets = token_buckets(32, 2048)
    assert buckets[:6] == (1, 2, 4, 8, 16, 32) and buckets[-1] == 2048
    assert bucket_for(3, buckets) == 4 and bucket_for(1, buckets) == 1 and bucket_for(5000, buckets) == 2048


def test_the_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert decision_cache.default_cache_dir() == tmp_path / "autodeploy" / "autotuner"


def test_a_near_tie_keeps_the_default_candidate(tmp_path):
    speeds = {"slow": 1.0, "fast": 0.99}

    def timer(backend, run, input_sets, device):
        return speeds[backend.name]

    tuner = Autotuner("cpu", tmp_path, timer=timer)
    assert decide(tuner, CANDIDATES[:2], buckets=(1,))[1].backend == "slow"
    speeds["fast"] = 0.5
    assert decide(Autotuner("cpu", tmp_path / "other", timer=timer), CANDIDATES[:2], buckets=(1,))[1].backend == "fast"


def test_graph_timed_decisions_live_apart_from_eager_ones(tmp_path):
    eager, graphed = (Autotuner("cpu", tmp_path, timer=fake_timer([]), graphed=g) for g in (False, True))
    assert graphed.cache.env == dict(eager.cache.env, timing="cuda_graph")
    assert graphed.cache.path != eager.cache.path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_timing_counts_kernels_not_launch_gaps():
    from autodeploy.autotuner.timing import median_seconds

    device = torch.device("cuda")
    inputs = [[torch.randn(1, 4096, device=device)] for _ in range(3)]

    def eight_small_kernels(args):
        x = args[0]
        for _ in range(8):
            x = x * 1.0001
        return x

    eager = median_seconds(None, eight_small_kernels, inputs, device)
    graphed = median_seconds(None, eight_small_kernels, inputs, device, graphed=True)
    assert 0 < graphed < eager

    def syncs(args):  # cannot be captured: timed eagerly instead
        return args[0].sum().item()

    assert median_seconds(None, syncs, inputs, device, graphed=True) > 0


def test_timings_rotate_over_copies_of_weights_that_fit_in_the_cache():
    # A 4 KB weight, a 2 KB activation: with a 16 KB cache, the sets must together exceed 32 KB, each later
    # set holding its own copy of the weight; past the cache (or without one: the CPU) the weight is shared.
    from autodeploy.autotuner.tuner import MAX_ROTATIONS, ROTATIONS, rotated_input_sets

    weight = torch.randn(32, 32)
    make_inputs = lambda: [torch.randn(16, 32), weight]  # noqa: E731
    probe = make_inputs()
    sets = rotated_input_sets(probe, make_inputs, cache_bytes=16 << 10)
    assert len(sets) == 6  # 6 KB each: 36 KB > 32 KB
    assert sets[0][1] is weight and all(s[1] is not weight and torch.equal(s[1], weight) for s in sets[1:])
    assert len({id(s[0]) for s in sets}) == len(sets)
    for cache_bytes in (0, 1 << 10):
        sets = rotated_input_sets(probe, make_inputs, cache_bytes=cache_bytes)
        assert len(sets) == ROTATIONS and all(s[1] is weight for s in sets)
    assert len(rotated_input_sets(probe, make_inputs, cache_bytes=1 << 30)) == MAX_ROTATIONS
