"""``autodeploy quantize`` (autodeploy/quantized_checkpoint.py) of a MoE checkpoint writes its dense layers under
every scheme that has a compressed-tensors form, and no run leaves a partial checkpoint under ``--out``: not one
that fails, nor one killed while it writes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autodeploy.quantized_checkpoint as quantized_checkpoint
from autodeploy import autodeploy
from autodeploy.quantized_checkpoint import quantize_checkpoint
from tests.patterns.tiny_family_configs_moe import tiny_moe_model
from tests.tiny_models import train_tiny_tokenizer

PROMPTS = [[3, 4, 5, 6, 7], list(range(40, 70))]
REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("scheme", ["int4_wo", "int4_gptq"])
def test_a_moe_checkpoint_is_written_and_serves_the_logits_of_the_deploy_that_quantized_it(scheme, tiny_checkpoint, tmp_path,
                                                                                           monkeypatch):
    # transformers splits the stacked experts back into one view per expert; safetensors refused those views.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"default": scheme, "int4_group_size": 32, "calibration": {"samples": 2, "seq_len": 64}}
    out = quantize_checkpoint(str(tiny_checkpoint("mixtral")), tmp_path / "mixtral-int4", device="cpu", quantize=settings)
    here = autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", quantize=settings)
    served = autodeploy(str(out), device="cpu")
    for got, want in zip(served.logits(PROMPTS), here.logits(PROMPTS)):
        assert torch.equal(got, want)
    notes = next(r for r in served.records if r.name == "quantize_linear").notes
    assert notes.startswith("9 int4_wo as the checkpoint's compressed-tensors")  # 2 layers × q, k, v, o and the LM head


def test_a_one_row_gate_reloads_from_its_packed_zero_points(tmp_path):
    # Qwen2-MoE's shared-expert gate has one output: its int4 zero points pack into one int32 row, which
    # compressed-tensors' own unpacking cannot read back.
    checkpoint = tmp_path / "qwen2-moe"
    tiny_moe_model("qwen2_moe").save_pretrained(checkpoint)
    train_tiny_tokenizer(checkpoint)
    settings = {"default": "int4_wo", "int4_group_size": 16}
    out = quantize_checkpoint(str(checkpoint), tmp_path / "qwen2-moe-int4", device="cpu", quantize=settings)
    here = autodeploy(str(checkpoint), device="cpu", quantize=settings)
    for got, want in zip(autodeploy(str(out), device="cpu").logits(PROMPTS), here.logits(PROMPTS)):
        assert torch.equal(got, want)


def test_a_failed_run_leaves_the_empty_folder_it_found_and_nothing_beside_it(tiny_checkpoint, tmp_path, monkeypatch):
    def full_disk(tensors, folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quantized_checkpoint, "_write_weights", full_disk)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="No space left"):
        quantize_checkpoint(str(tiny_checkpoint("llama")), tmp_path / "out", device="cpu", quantize={"default": "int8_wo"})
    assert [path.name for path in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())


def test_a_run_killed_while_it_writes_leaves_no_output_folder(tiny_checkpoint, tmp_path):
    out = tmp_path / "nested" / "llama-int8"
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPOSITORY)!r})
import autodeploy.quantized_checkpoint as quantized_checkpoint
write = quantized_checkpoint._write_weights
def write_then_die(tensors, folder):
    write(tensors, folder)
    os.kill(os.getpid(), signal.SIGKILL)
quantized_checkpoint._write_weights = write_then_die
quantized_checkpoint.quantize_checkpoint({str(tiny_checkpoint("llama"))!r}, {str(out)!r}, device="cpu", quantize={{"default": "int8_wo"}})
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert not out.exists()
