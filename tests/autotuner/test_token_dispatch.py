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
