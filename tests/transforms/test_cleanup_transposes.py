"""cleanup_transposes removes transpose/permute pairs that cancel and folds the rest into one permute."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.transforms.cleanup_harness import call_targets, export_dynamic, run_transform

aten = torch.ops.aten
PERMUTE_LIKE = (aten.transpose.int, aten.permute.default)


class TransposeChains(nn.Module):
    def forward(self, x):  # [batch, seq, heads, dim]
        undone = x.transpose(1, 2).transpose(2, 1)  # cancels, dims in the other order
        undone_negative = x.transpose(-1, 1).transpose(1, 3)  # cancels once -1 is read as 3
        undone_permute = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2)  # cancels
        folded = x.transpose(1, 2).transpose(2, 3)  # one permute(0, 2, 3, 1)
        folded_three = x.transpose(1, 2).transpose(2, 3).transpose(0, 1)  # one permute(2, 0, 3, 1)
        shared = x.transpose(0, 1)
        undone_shared = shared.transpose(1, 0)  # cancels; `shared` stays for its other user
        not_folded = shared.transpose(2, 3)  # `shared` has another user: folding would add a node
        return undone, undone_negative, undone_permute, folded, folded_three, undone_shared, not_folded, shared.sum()


def test_cancels_and_folds_transpose_chains():
    x = torch.randn(2, 3, 4, 5)
    gm = export_dynamic(TransposeChains(), x, dynamic_dims={0: "batch", 1: "seq"})
    before = call_targets(gm)
    assert before["aten.transpose.int"] == 12 and before["aten.permute.default"] == 2

    result = run_transform("cleanup_transposes", gm)

    after = call_targets(gm)
    # 4 pairs removed (8 nodes, `shared` stays), folded → 1 permute, folded_three → 1 permute in 2 steps,
    # not_folded untouched.
    assert result.matches == 7
    assert after["aten.transpose.int"] == 2 and after["aten.permute.default"] == 2
    folded, folded_three = (node for node in gm.graph.nodes if node.target is aten.permute.default)
    assert list(folded.args[1]) == [0, 2, 3, 1] and list(folded_three.args[1]) == [2, 0, 3, 1]
    assert folded.meta["val"].shape[1] == 4 and isinstance(folded.meta["val"].shape[0], torch.SymInt)
    for shape in [(2, 3, 4, 5), (6, 7, 4, 5)]:
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), TransposeChains()(x), rtol=0, atol=0)


def test_identity_transpose_and_permute_alone_are_removed():
    class Identities(nn.Module):
        def forward(self, x):
            return aten.transpose.int(x, 1, -2).tanh() + aten.permute.default(x, [0, 1, 2])

    x = torch.randn(2, 3, 4)
    gm = export_dynamic(Identities(), x, dynamic_dims={0: "batch"})
    identities = sum(call_targets(gm)[str(op)] for op in PERMUTE_LIKE)

    result = run_transform("cleanup_transposes", gm)

    assert result.matches == identities == 2
    assert not any(node.target in PERMUTE_LIKE for node in gm.graph.nodes)
    torch.testing.assert_close(gm(x), Identities()(x), rtol=0, atol=0)


RANK = 4
transposes = st.tuples(st.integers(-RANK, RANK - 1), st.integers(-RANK, RANK - 1)).map(lambda dims: ("transpose", dims))
permutes = st.permutations(range(RANK)).map(lambda dims: ("permute", tuple(dims)))
breaks = st.just(("tanh", ()))


class PermuteProgram(nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def forward(self, x):
        for kind, dims in self.steps:
            if kind == "transpose":
                x = x.transpose(*dims)
            elif kind == "permute":
                x = x.permute(*dims)
            else:
                x = x.tanh()
        return x


def _chains_left(gm) -> list[str]:
    """Transposes/permutes applied directly to one whose only user they are (the pass folds those)."""
    return [
        node.name
        for node in gm.graph.nodes
        if node.target in PERMUTE_LIKE and node.args[0].target in PERMUTE_LIKE and len(node.args[0].users) == 1
    ]


def _non_identity_segments(steps) -> int:
    """How many runs of transposes/permutes between two tanh's move dims (sizes are distinct, so shape tells)."""
    runs = [list(run) for is_break, run in itertools.groupby(steps, key=lambda step: step[0] == "tanh") if not is_break]
    probe = torch.empty(2, 3, 4, 5)
    return sum(PermuteProgram(run)(probe).shape != probe.shape for run in runs)


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.one_of(transposes, permutes, breaks), min_size=1, max_size=7),
    sizes=st.permutations([2, 3, 4, 5]),
    seed=st.integers(0, 2**16),
)
def test_outputs_unchanged_and_chains_fully_folded(steps, sizes, seed):
    torch.manual_seed(seed)
    program = PermuteProgram(steps)
    gm = export_dynamic(program, torch.randn(sizes), dynamic_dims={0: "a", 2: "b"})

    run_transform("cleanup_transposes", gm)

    assert _chains_left(gm) == []
    assert sum(node.target in PERMUTE_LIKE for node in gm.graph.nodes) == _non_identity_segments(steps)
    for shape in (sizes, [size + 3 if dim in (0, 2) else size for dim, size in enumerate(sizes)]):
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), program(x), rtol=0, atol=0)
