"""``fuse_add_rms_norm``: residual adds and the RMSNorms of their sums become ``add_rms_norm``, with the
unfused deployment's logits; adds that broadcast, scale, or feed the norm through a cast are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy import autodeploy
from autodeploy.export.export import export_to_graph_module
from autodeploy.pipeline import run_transform
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms.fuse_add_rms_norm import FuseAddRmsNorm
from tests.coverage_models import eager_reference_model

ADD_RMS_NORM, RMS_NORM = torch.ops.autodeploy.add_rms_norm, torch.ops.autodeploy.rms_norm
QUICK = dict(device="cpu", verify={"enabled": False})
UNFUSED = {"fuse_add_rms_norm": {"enabled": False}}
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]


def canonical_nodes(llm, op) -> list:
    """The nodes of ``op``'s canonical op or any of its backends, after ``select``."""
    targets = {op.default, *(getattr(torch.ops.autodeploy, f"{op.__name__}_{name}").default for name in ("torch", "triton"))}
    return [n for n in llm.graph.graph.nodes if n.target in targets]


def assert_fused_like_unfused(fused, unfused, norms: int) -> None:
    for ours, theirs in zip(fused.logits(SEQUENCES), unfused.logits(SEQUENCES)):
        assert torch.equal(ours, theirs)
    # Two per layer (before the post-attention norm; before the next input norm or the final norm).
    (record,) = [r for r in fused.records if r.name == "fuse_add_rms_norm"]
    assert record.matches == 4 and record.notes == "4 residual adds + rms_norm → add_rms_norm"
    assert len(canonical_nodes(fused, ADD_RMS_NORM)) == 4
    assert len(canonical_nodes(fused, RMS_NORM)) == norms - 4 and len(canonical_nodes(unfused, RMS_NORM)) == norms
    assert "add_rms_norm ×4 → add_rms_norm_torch" in fused.pipeline_report()


def test_llama_fuses_two_adds_per_layer_with_the_unfused_logits(llama_llm, llama_dir):
    # The default deployment (the shared fixture) against one with the transform switched off.
    assert_fused_like_unfused(llama_llm, autodeploy(str(llama_dir), **QUICK, transforms=UNFUSED), norms=5)


def test_gemma2_in_bfloat16_keeps_its_weight_offset_and_the_unfused_logits(tmp_path):
    # Gemma's norms scale by weight + 1; Gemma-2's sandwich norms (on sublayer outputs) read no add.
    eager_reference_model("gemma2").save_pretrained(tmp_path)
    fused, unfused = (autodeploy(str(tmp_path), **QUICK, dtype="bfloat16", transforms=t) for t in ({}, UNFUSED))
    assert_fused_like_unfused(fused, unfused, norms=9)
    assert {n.args[4] for n in canonical_nodes(fused, ADD_RMS_NORM)} == {1.0}


class ResidualNorm(nn.Module):
    """``rms_norm`` of the sum ``combine`` spells; returns the norm and a later use of the sum (and with
    ``read_early``, one placed before the norm)."""

    def __init__(self, combine, read_early: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)
        self.combine, self.read_early = combine, read_early

    def forward(self, x, residual):
        total = self.combine(x, residual)
        early = [total * 2] if self.read_early else []
        return RMS_NORM(total, self.weight, 1e-6), total * 3, *early


def _sum(x, residual):
    return x + residual


CASES = {  # case → (the sum's spelling, read early, matches, what the report says about the add)
    "x + residual": (_sum, False, 1, None),
    "residual + x": (lambda x, r: r + x, False, 1, None),
    "broadcast bias": (lambda x, r: x + r[0, 0], False, 0, "broadcasts or promotes"),
    "alpha 2": (lambda x, r: torch.add(x, r, alpha=2), False, 0, "alpha=2"),
    "upcast sum": (lambda x, r: (x.bfloat16() + r.bfloat16()).float(), False, 0, None),
    "sum read before the norm": (_sum, True, 0, "before rms_norm"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_only_an_add_of_two_like_tensors_straight_into_the_norm_fuses(case):
    combine, read_early, matches, reason = CASES[case]
    x, residual = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    gm = export_to_graph_module(ResidualNorm(combine, read_early), (x, residual))
    expected = gm(x, residual)
    result = run_transform(FuseAddRmsNorm(TransformConfig()), gm, TransformContext(settings=None))
    assert result.matches == matches
    assert sum(1 for n in gm.graph.nodes if n.target is ADD_RMS_NORM.default) == matches
    if reason is None:
        assert result.details == []
    else:
        (detail,) = result.details
        assert "kept apart from its add" in detail and reason in detail
    for ours, theirs in zip(gm(x, residual), expected):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    if matches:
        fused = next(n for n in gm.graph.nodes if n.target is ADD_RMS_NORM.default)
        assert [v.shape for v in fused.meta["val"]] == [x.shape, x.shape]
        assert all("val" in n.meta for n in fused.users)  # the norm output and the sum both have values
