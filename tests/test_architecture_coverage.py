"""The default pipeline on tiny checkpoints of every covered architecture: every attention, norm, MLP
and MoE becomes a canonical op, and the logits equal HF eager attention's (fp32, ≤ 1e-5)."""

import pytest
import torch

from autodeploy import autodeploy
from autodeploy.transforms.match_report import match_report
from tests.coverage_models import KNOWN_UNMATCHED, coverage_architectures, eager_reference_model
from tests.logit_comparison import deployed_max_logit_diff

SHAPES = ((1, 1, 0), (2, 9, 0), (3, 17, 0))  # 9 and 17 exceed the tiny sliding windows


@pytest.fixture(scope="module", params=coverage_architectures())
def deployed(request, tmp_path_factory):
    arch = request.param
    reference = eager_reference_model(arch)
    directory = tmp_path_factory.mktemp(arch)
    reference.save_pretrained(directory)
    # Default pipeline: the rope fusion is on, so every architecture checks the fused cache write against HF too.
    return arch, reference, autodeploy(str(directory), device="cpu")


def test_every_layer_is_canonical(deployed):
    arch, reference, llm = deployed
    report = match_report(llm.graph, reference.config)
    counts = {c.kind: (c.found, c.expected) for c in report.counts}
    left = KNOWN_UNMATCHED.get(arch)
    for kind, (found, expected) in counts.items():
        if kind != left:
            assert found == expected, f"{arch}: {report}"
    assert counts["attention"][0] == reference.config.num_hidden_layers
    if left is None:
        assert report.complete, f"{arch}: {report}"
    else:
        assert report.unmatched_modules, f"{arch}: the unmatched {left} layers must be listed"
    assert not any(n.target is torch.ops.aten.linear.default for n in llm.graph.graph.nodes)


def test_rope_is_applied_in_every_layers_cache_write(deployed):
    arch, reference, llm = deployed
    (record,) = [r for r in llm.records if r.name == "fuse_rope_into_cached_attention"]
    assert record.matches == reference.config.num_hidden_layers, f"{arch}: {record.notes} {record.details}"


def test_logits_equal_hf_eager(deployed):
    arch, reference, llm = deployed
    assert deployed_max_logit_diff(reference, llm, SHAPES) <= 1e-5, arch


def test_every_rms_norm_architecture_fuses_two_residual_adds_per_layer(deployed):
    # Before the post-attention norm, and before the next layer's input norm (the last layer's: the final
    # norm); the logits test above holds the fused graph to HF eager. LayerNorm architectures fuse none.
    arch, reference, llm = deployed
    (record,) = [r for r in llm.records if r.name == "fuse_add_rms_norm"]
    uses_rms_norm = any("rms_norm" in str(node.target) for node in llm.graph.graph.nodes)
    assert record.matches == (2 * reference.config.num_hidden_layers if uses_rms_norm else 0), arch
