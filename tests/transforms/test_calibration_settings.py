"""Calibration settings that cannot work (transforms/calibration.py) are ``ConfigError``s naming the setting
and its fix, raised before any calibration forward runs."""

from __future__ import annotations

import pytest

from autodeploy import autodeploy
from autodeploy.errors import ConfigError
from autodeploy.transforms import calibration

GPTQ = {"default": "int4_gptq", "int4_group_size": 32}


@pytest.fixture
def no_forward(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached statistics answer for the run

    def forward(*args, **kwargs):
        raise AssertionError("a calibration forward ran before the settings were checked")

    monkeypatch.setattr(calibration, "graph_statistics", forward)


def test_windows_longer_than_the_model_takes_are_refused(tiny_checkpoint, no_forward):
    # The tiny Llama takes 512 positions; the export's guard (2048 here: max_num_tokens) once failed instead.
    for seq_len in (513, 4096):
        with pytest.raises(ConfigError, match=rf"quantize.calibration.seq_len={seq_len} is longer than max_seq_len=512 .*"
                                              r"set quantize.calibration.seq_len to 512 or less"):
            autodeploy(str(tiny_checkpoint("llama")), device="cpu",
                       quantize={**GPTQ, "calibration": {"samples": 1, "seq_len": seq_len}})


def test_a_calibration_file_that_is_not_utf8_is_refused(tiny_checkpoint, no_forward, tmp_path):
    for name, text in (("latin1.txt", "café au lait\n" * 200), ("latin1.jsonl", '{"text": "café au lait"}\n' * 200)):
        path = tmp_path / name
        path.write_bytes(text.encode("latin-1"))
        with pytest.raises(ConfigError, match=rf"quantize.calibration.dataset: \S*{name} is not UTF-8 text \(byte 0xe9 at "
                                              r"offset \d+\); convert it to UTF-8"):
            autodeploy(str(tiny_checkpoint("llama")), device="cpu",
                       quantize={**GPTQ, "calibration": {"dataset": str(path), "samples": 1, "seq_len": 16}})
