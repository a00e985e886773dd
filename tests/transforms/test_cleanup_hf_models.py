"""The cleanup passes, run in sequence on exported HF models, shrink the graph and keep the logits exact."""

import pytest
import torch

from autodeploy.export.export import export_causal_lm
from tests.tiny_models import ARCHITECTURES, VOCAB_SIZE, tiny_hf_model
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, run_transform


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cleanup_keeps_hf_logits(arch):
    model = tiny_hf_model(arch)
    gm = export_causal_lm(model, max_num_tokens=64, max_seq_len=64)
    nodes_before = len(gm.graph.nodes)

    matches = {name: run_transform(name, gm).matches for name in CLEANUP_PASSES}

    assert matches["cleanup_noop"] > 0 and matches["cleanup_dead_code"] > 0
    assert len(gm.graph.nodes) < nodes_before
    assert "aten._assert_tensor_metadata.default" not in call_targets(gm)
    generator = torch.Generator().manual_seed(0)
    for batch, seq, first_position in [(1, 1, 0), (2, 7, 0), (3, 16, 5)]:
        input_ids = torch.randint(0, VOCAB_SIZE, (batch, seq), generator=generator)
        position_ids = torch.arange(first_position, first_position + seq).expand(batch, seq)
        with torch.no_grad():
            expected = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            logits = gm(input_ids, position_ids)
        assert logits.shape == (batch, seq, VOCAB_SIZE)
        assert (logits - expected).abs().max().item() <= 1e-5, f"batch={batch} seq={seq}"
