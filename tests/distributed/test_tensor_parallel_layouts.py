"""Tensor-parallel layouts beyond an even split, on the CPU (two gloo processes, as ``torchrun`` starts them):
fewer key-value heads than ranks (each rank keeps the one its query heads read), ``distributed.rules``
overriding the detection, and each rank reading only its slices of the safetensors checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.models.checkpoint import CheckpointReader
from autodeploy.transforms.quantize_linear import ATTENTION
from autodeploy.transforms.shard_tensor_parallel import _head_rows
from tests.distributed.test_tensor_parallel import PROMPT, SEQUENCES
from tests.tiny_models import TINY_COMMON, train_tiny_tokenizer

# Layer 0's attention kept whole; layer 1's sliced by rules as the detection would; layer 1's MLP whole; a glob
# matching nothing.
RULES = {"lm_head": "replicate", "model.layers.0.self_attn.*": "replicate",
         "model.layers.1.self_attn.[qkv]_proj": "colwise", "model.layers.1.self_attn.o_proj": "rowwise",
         "model.layers.1.mlp.down_proj": "replicate", "model.layers.7.*": "colwise"}


def write_one_kv_head_checkpoint(directory) -> None:
    """A tiny Qwen3 (per-head q/k norms) with one key-value head for its 4 query heads."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**{**TINY_COMMON, "num_key_value_heads": 1}, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.save_pretrained(directory)
    train_tiny_tokenizer(directory)


def _deploy(directory: str, distributed: dict, reads: list, warnings: list) -> dict:
    reads.clear()
    warnings.clear()
    llm = autodeploy(directory, device="cpu", distributed={"tensor_parallel": 2, "timeout_s": 120, **distributed})
    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    return {"logits": [t.tolist() for t in llm.logits(SEQUENCES)], "tokens": list(tokens), "reads": list(reads),
            "warnings": list(warnings), "report": llm.pipeline_report(),
            "shapes": {name: list(p.shape) for name, p in llm.graph.named_parameters()}}


def deploy_each_spied(rank: int, world: int, jobs: list) -> list[dict]:
    """One rank's results of each (directory, distributed settings) deploy, with the checkpoint reads and warnings
    of each (a job of the spawn in conftest.py)."""
    reads, warnings = [], []  # (method, key, shape) of every checkpoint read; the warnings logged
    read, read_slice = CheckpointReader.read, CheckpointReader.read_slice

    def spy(method, original):
        def call(self, key, *args):
            tensor = original(self, key, *args)
            reads.append((method, key, list(tensor.shape)))
            return tensor
        return call

    CheckpointReader.read, CheckpointReader.read_slice = spy("read", read), spy("read_slice", read_slice)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("autodeploy").addHandler(handler)
    try:
        return [_deploy(directory, distributed, reads, warnings) for directory, distributed in jobs]
    finally:
        CheckpointReader.read, CheckpointReader.read_slice = read, read_slice
        logging.getLogger("autodeploy").removeHandler(handler)


def _hf_greedy(directory) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    return hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):].tolist()


def test_replicated_kv_heads_and_rules_equal_one_process_and_ranks_read_only_their_slices(tiny_checkpoint,
                                                                                          one_kv_head_checkpoint, two_ranks):
    one_kv = one_kv_head_checkpoint
    qwen2 = tiny_checkpoint("qwen2")
    singles = [autodeploy(str(d), device="cpu") for d in (one_kv, qwen2)]
    ranks = [result["layouts"] for result in two_ranks]  # [(one_kv, {}), (qwen2, {"rules": RULES})] on each rank
    for job, (single, directory) in enumerate(zip(singles, (one_kv, qwen2))):
        want = single.logits(SEQUENCES)
        for result in ranks:
            for got, expected in zip(result[job]["logits"], want):
                torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)
        assert ranks[0][job]["tokens"] == ranks[1][job]["tokens"] == _hf_greedy(directory)

    # One KV head over two ranks: both keep it (k/v rows whole), each half the query heads.
    for rank, result in enumerate(r[0] for r in ranks):
        assert f"rank {rank} of 2:" in result["report"] and "key-value heads replicated in 2 attentions" in result["report"]
        reads = {key: (method, shape) for method, key, shape in result["reads"]}
        # Every projection and the vocabulary read as a slice: q half its rows, k/v their one head, o half its
        # columns; only the norms read whole. The bytes a rank reads are the parameters it holds.
        assert reads["model.layers.0.self_attn.q_proj.weight"] == ("read_slice", [32, 64])
        assert reads["model.layers.0.self_attn.k_proj.weight"] == ("read_slice", [16, 64])
        assert reads["model.layers.0.self_attn.o_proj.weight"] == ("read_slice", [64, 32])
        assert reads["model.layers.0.mlp.down_proj.weight"] == ("read_slice", [64, 64])
        assert reads["lm_head.weight"] == ("read_slice", [256, 64])
        assert all("norm" in key for method, key, _ in result["reads"] if method == "read")
        assert sum(torch.Size(shape).numel() for _, _, shape in result["reads"]) == sum(
            torch.Size(shape).numel() for shape in result["shapes"].values())

    # Rules: the LM head whole on each rank (no all_gather), layer 0's attention whole, the rest sliced.
    full = dict(singles[1].graph.named_parameters())
    for result in (r[1] for r in ranks):
        shapes = result["shapes"]
        assert shapes["model.lm_head.weight"] == list(full["model.lm_head.weight"].shape) == [512, 64]
        assert shapes["model.model.embed_tokens.weight"] == [256, 64]
        layer0 = [n for n in shapes if n.startswith("model.model.layers.0.self_attn.")]
        layer1 = [n for n in shapes if n.startswith("model.model.layers.1.self_attn.") and n.endswith("weight")]
        assert layer0 and all(shapes[n] == list(full[n].shape) for n in layer0)
        assert layer1 and all(shapes[n] != list(full[n].shape) for n in layer1)
        assert "the LM head replicate (distributed.rules)" in result["report"]
        mlp0 = [n for n in shapes if n.startswith("model.model.layers.0.mlp.")]
        mlp1 = [n for n in shapes if n.startswith("model.model.layers.1.mlp.")]
        assert mlp0 and all(shapes[n] != list(full[n].shape) for n in mlp0)
        assert mlp1 and all(shapes[n] == list(full[n].shape) for n in mlp1)
        assert "9 linears and 1 MLPs as distributed.rules say" in result["report"]
        assert any("distributed.rules['model.layers.7.*'] matches no linear layer" in w for w in result["warnings"])


def test_rules_of_an_unknown_kind_or_that_do_not_fit_together_are_config_errors(tiny_checkpoint, monkeypatch):
    directory = str(tiny_checkpoint("llama"))
    with pytest.raises(ConfigError, match="each rule's kind must be one of colwise, rowwise, replicate"):
        autodeploy(directory, device="cpu", distributed={"tensor_parallel": 2, "rules": {"lm_head": "sideways"}})
    # An MLP's weights are sliced together: a rule can only replicate them.
    from autodeploy import api
    monkeypatch.setattr(api, "should_spawn", lambda settings: False)
    monkeypatch.setattr(api, "init_distributed", lambda *args: None)
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_proj, a weight of the MLP op .* an MLP takes only "
                                          r"replicate"):
        autodeploy(directory, device="cpu", distributed={"tensor_parallel": 2, "rules": {"*.mlp.gate_proj": "colwise"}})
    # The whole query projection, but the output projection's columns sliced: shapes refuse it at build
    # (rank 0's view; the check runs before any collective, so no other process is needed).
    with pytest.raises(ConfigError, match=r"distributed.rules \{'model.layers.0.self_attn.q_proj': 'replicate'\} "
                                          r"leave the graph's shapes inconsistent"):
        autodeploy(directory, device="cpu", distributed={
            "tensor_parallel": 2, "rules": {"model.layers.0.self_attn.q_proj": "replicate"}})


def _attention(heads: int, kv_heads: int, head_dim: int = 16, options: tuple = ()) -> fx.Node:
    graph = fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    for node, count in zip((q, k, v), (heads, kv_heads, kv_heads)):
        node.meta["val"] = torch.empty(1, 3, count, head_dim)
    return graph.call_function(ATTENTION, (q, k, v, *options))


def test_head_rows_split_query_heads_and_replicate_fewer_kv_heads_than_ranks():
    # 8 query heads, 2 KV heads over 4 ranks: ranks 0 and 1 keep KV head 0, ranks 2 and 3 KV head 1.
    rows = [_head_rows(_attention(8, 2), rank, 4) for rank in range(4)]
    assert [r["q"] for r in rows] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert [r["k"] for r in rows] == [r["v"] for r in rows] == [(0, 16), (0, 16), (16, 32), (16, 32)]
    assert _head_rows(_attention(8, 4), 1, 2)["k"] == (32, 64)  # more KV heads than ranks: an even split
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 must divide the attention heads \(6\) and key-value "
                                          r"heads \(2\).*divides or is a multiple of 2"):
        _head_rows(_attention(6, 2), 0, 3)
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 must divide the attention heads \(6\)"):
        _head_rows(_attention(6, 1), 0, 4)
    alibi = (0.25, None, None, None, [0.5, 0.25, 0.125, 0.0625])  # scale, window, cap, sinks, slopes
    with pytest.raises(ConfigError, match="does not yet slice ALiBi's per-head slopes"):
        _head_rows(_attention(4, 4, options=alibi), 0, 2)


def test_checkpoint_reader_reads_a_slice_of_a_safetensors_tensor(tmp_path):
    from safetensors.torch import save_file

    weight = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    torch.testing.assert_close(reader.read_slice("w", 0, 2, 4), weight[2:4], rtol=0, atol=0)
    torch.testing.assert_close(reader.read_slice("w", 1, 4, 8), weight[:, 4:], rtol=0, atol=0)
