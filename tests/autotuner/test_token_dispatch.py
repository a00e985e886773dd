"""A token dispatch runs the backend that ``bucket_for`` picks for the call's token count."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy.autotuner import bucket_for
from autodeploy.autotuner.token_dispatch import token_dispatch


def backend(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, op=lambda *args, name=name: name)


@settings(max_examples=60, deadline=None)
@given(
    winners=st.dictionaries(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), st.sampled_from("abc"), min_size=1),
    tokens=st.integers(1, 300),
)
def test_the_dispatch_runs_the_bucket_for_choice(winners, tokens):
    dispatch = token_dispatch("rms_norm", {bucket: backend(name) for bucket, name in winners.items()}, (0, 1))
    assert dispatch(torch.empty(1, tokens)) == winners[bucket_for(tokens, tuple(sorted(winners)))]


def test_the_dispatch_passes_keyword_arguments_on():
    # A packed attention node holds seq_start as a keyword argument; the backend a bucket picks must receive it.
    seen = {}
    keyed = SimpleNamespace(name="varlen", op=lambda *args, **kwargs: seen.update(kwargs) or "varlen")
    dispatch = token_dispatch("bidirectional_attention", {1: backend("sdpa"), 64: keyed}, (0, 1))
    starts = torch.tensor([0, 40, 100], dtype=torch.int32)
    assert dispatch(torch.empty(1, 100), seq_start=starts) == "varlen" and seen["seq_start"] is starts
