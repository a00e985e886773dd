"""The ``autodeploy`` command line: run (streamed too), config show, inspect, global flags, and one-line errors."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from autodeploy import CompletionOutput, RequestOutput, SamplingParams
from autodeploy.cli.completions import print_stream
from autodeploy.cli.main import build_parser, main
from autodeploy.config import load_settings, transform_configs
from autodeploy.errors import ConfigError, ModelNotFoundError
from autodeploy.runtime.outputs import RequestMetrics
from autodeploy.transforms import registered_transforms

MISSING_MODEL = "/nonexistent/autodeploy-test-model"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def unknown_transform_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-config") / "mine.yaml"
    path.write_text("transforms:\n  cleanup_nop: {enabled: true}\n")
    return path


def assert_one_error_line(err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and fragment in lines[0]
    assert "Traceback" not in err


# --- config show ------------------------------------------------------------------------------

def test_config_show_prints_the_pipeline_and_reflects_set(capsys):
    code, out, _ = run_cli(capsys, "config", "show", "--set", "max_batch_size=7", "--set", "transforms.cleanup_noop.enabled=false")
    assert code == 0
    shown = OmegaConf.create(out)
    assert list(shown.transforms) == list(load_settings().transforms)
    assert shown.max_batch_size == 7
    assert shown.transforms.cleanup_noop.enabled is False


def test_config_show_reflects_config_files(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("max_batch_size: 3\ntransforms:\n  export_to_fx: {strict: true}\n")
    code, out, _ = run_cli(capsys, "config", "show", "--config", path)
    shown = OmegaConf.create(out)
    assert (code, shown.max_batch_size, shown.transforms.export_to_fx.strict) == (0, 3, True)


def test_config_show_with_a_model_resolves_auto_settings(capsys, monkeypatch, llama_dir):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run_cli(capsys, "config", "show", llama_dir)
    shown = OmegaConf.create(out)
    assert code == 0
    assert (shown.device, shown.dtype, shown.max_seq_len, shown.model) == ("cpu", "float32", 512, str(llama_dir))


# --- inspect and run --------------------------------------------------------------------------

def test_inspect_prints_every_transform_and_node_counts(capsys, llama_dir):
    code, out, _ = run_cli(capsys, "inspect", llama_dir)
    assert code == 0
    registry = registered_transforms()  # a decoder's graph: the transforms of its role (not the embedders' packing)
    enabled = [name for name, config in transform_configs(load_settings()).items() if config.enabled and "model" in registry[name].roles]
    report_names = [line.split()[0] for line in out.splitlines()[1 : len(enabled) + 1]]
    assert report_names == enabled
    assert "nodes" in out and "device meta" in out


def test_run_prints_prompt_and_completion(capsys, llama_dir):
    code, out, err = run_cli(capsys, "run", llama_dir, "--prompt", "def f(x):", "--max-tokens", "4")
    assert code == 0
    assert out.startswith("def f(x):")
    assert re.search(r"^--- [1-4] tokens, finish: (length|stop)$", out, re.MULTILINE)
    assert re.search(r"tokens in [0-9.]+s on (cpu|cuda) \(float32\)", err)


def test_speculative_flags_change_no_token_and_an_explicit_set_wins(capsys, llama_dir):
    argv = ["run", llama_dir, "--prompt", "def f(x):", "--max-tokens", "12", "--set", "device=cpu"]
    plain = run_cli(capsys, *argv)
    flags = ["--speculative-method", "ngram", "--speculative-num-tokens", "3", "--set", "speculative.auto=false"]
    speculative = run_cli(capsys, *argv, *flags)
    assert plain[0] == speculative[0] == 0 and plain[1] == speculative[1]
    code, out, err = run_cli(capsys, "config", "show", *flags, "--set", "speculative.num_tokens=5")
    assert code == 0 and "method: ngram" in out and "num_tokens: 5" in out
    code, out, err = run_cli(capsys, "run", llama_dir, "--speculative-method", "ngram", "--speculative-num-tokens", "0")
    assert code == 1 and "num_tokens must be in 1" in err


# --- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", MISSING_MODEL], "not a local path"),
        (["config", "show", "--set", "foo"], "key=value"),
        (["config", "show", "--config", "/nonexistent/mine.yaml"], "does not exist"),
        (["config", "show", "--set", "max_batch_sise=2"], "'max_batch_size'"),
        (["config", "show", "--config", "UNKNOWN_TRANSFORM_YAML"], "unknown transform 'cleanup_nop'"),
        (["run", "LLAMA_DIR", "--max-tokens", "0"], "max_tokens"),
    ],
    ids=["missing-model", "bad-set", "missing-config", "unknown-key", "unknown-transform", "bad-request"],
)
def test_errors_print_one_line_and_exit_1(capsys, hf_offline, llama_dir, unknown_transform_yaml, argv, fragment):
    substitutions = {"LLAMA_DIR": llama_dir, "UNKNOWN_TRANSFORM_YAML": unknown_transform_yaml}
    code, out, err = run_cli(capsys, *[substitutions.get(arg, arg) for arg in argv])
    assert code == 1 and out == ""
    assert_one_error_line(err, fragment)


def test_debug_raises_the_typed_error(capsys, hf_offline):
    with pytest.raises(ModelNotFoundError):
        main(["--debug", "run", MISSING_MODEL])


# --- the real process: exit codes and stderr --------------------------------------------------

SUBPROCESS_CASES = {
    "missing-model": ["run", MISSING_MODEL],
    "bad-set": ["run", MISSING_MODEL, "--set", "a b=1"],
    "unknown-transform": ["config", "show", "--config", "UNKNOWN_TRANSFORM_YAML"],
    "debug": ["--debug", "run", MISSING_MODEL],
}


@pytest.fixture(scope="module")
def subprocess_results(unknown_transform_yaml, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every case in its own ``python -m autodeploy`` process, started together (each imports torch: ~3 s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cwd = tmp_path_factory.mktemp("cli-cwd")
    processes = {}
    for name, argv in SUBPROCESS_CASES.items():
        argv = [str(unknown_transform_yaml) if arg == "UNKNOWN_TRANSFORM_YAML" else arg for arg in argv]
        processes[name] = subprocess.Popen(
            [sys.executable, "-m", "autodeploy", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return results


@pytest.mark.parametrize(
    "case, fragment",
    [("missing-model", MISSING_MODEL), ("bad-set", "'a b=1'"), ("unknown-transform", "cleanup_nop")],
)
def test_process_exits_1_with_one_error_line(subprocess_results, case, fragment):
    result = subprocess_results[case]
    assert result.returncode == 1
    assert result.stdout == ""
    assert_one_error_line(result.stderr, fragment)


def test_process_debug_shows_the_traceback(subprocess_results):
    result = subprocess_results["debug"]
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ModelNotFoundError" in result.stderr and MISSING_MODEL in result.stderr


def test_run_streams_and_returns_several_completions(capsys, llama_dir):
    code, out, _ = run_cli(capsys, "run", llama_dir, "--prompt", "def f(x):", "--max-tokens", "4", "--stream")
    assert code == 0 and out.startswith("def f(x):")
    code, out, _ = run_cli(capsys, "run", llama_dir, "--prompt", "x", "--max-tokens", "3", "--n", "2",
                           "--temperature", "1", "--seed", "1", "--set", "device=cpu")
    assert code == 0 and "--- #0 " in out and "--- #1 " in out
    code, _, err = run_cli(capsys, "run", llama_dir, "--prompt", "a", "--prompt", "b", "--stream")
    assert code == 1 and "single --prompt" in err


# --- streaming several samples ----------------------------------------------------------------

@pytest.fixture
def deployed_llama(monkeypatch, llama_llm):
    """``run`` served by the session's deployed tiny Llama instead of deploying it again per call."""
    import autodeploy

    monkeypatch.setattr(autodeploy, "autodeploy", lambda *args, **kwargs: llama_llm)


@pytest.mark.parametrize(
    "sampling",
    [["--n", "2", "--temperature", "1", "--seed", "1"], ["--n", "2", "--beam-width", "2"], ["--n", "3", "--beam-width", "3"]],
    ids=["samples", "beams", "three-beams"],
)
def test_stream_prints_every_completion_as_run_without_stream_does(capsys, deployed_llama, sampling):
    arguments = ["run", "--prompt", "def f(x):", "--max-tokens", "5", *sampling]
    code, printed, _ = run_cli(capsys, *arguments)
    streamed_code, streamed, _ = run_cli(capsys, *arguments, "--stream")
    assert (code, streamed_code) == (0, 0)
    assert streamed == printed
    n = int(sampling[1])
    assert [line.split()[1] for line in streamed.splitlines() if line.startswith("--- ")] == [f"#{i}" for i in range(n)]


def test_stream_of_one_sample_prints_only_the_prompt_and_the_text(capsys, deployed_llama, llama_llm):
    expected = llama_llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0))[0].text
    code, out, _ = run_cli(capsys, "run", "--prompt", "def f(x):", "--max-tokens", "4", "--stream")
    assert (code, out) == (0, f"def f(x):{expected}\n")


def _chunk(*completions: tuple[int, str, str | None], finished: bool = False):
    outputs = [CompletionOutput(index, "", [0] * 3, reason, new_text=new_text) for index, new_text, reason in completions]
    return RequestOutput("r", "P:", [1], outputs, finished, RequestMetrics())


def test_stream_prints_the_live_sample_as_it_comes_and_a_later_one_from_what_it_gathered(capsys):
    # Sample 1 finishes before sample 0; its text must still print after sample 0's, not inside it.
    chunks = [
        _chunk((0, "a", None), (1, "x", None)),
        _chunk((0, "b", None), (1, "y", "stop")),
        _chunk((0, "c", "length"), (1, "", "stop"), finished=True),
    ]
    seen = []

    def watched():
        for chunk in chunks:
            yield chunk
            seen.append(capsys.readouterr().out)

    print_stream(watched(), "P:", SamplingParams(max_tokens=3, n=2, temperature=1.0))
    seen.append(capsys.readouterr().out)
    assert seen[:2] == ["P:a", "b"]  # sample 0 streams token by token
    assert "".join(seen) == "P:abc\n--- #0 3 tokens, finish: length\nP:xy\n--- #1 3 tokens, finish: stop\n"


# --- global flags anywhere, --version ---------------------------------------------------------

@pytest.mark.parametrize(
    "argv, error",
    [
        (["run", MISSING_MODEL, "--debug"], ModelNotFoundError),
        (["config", "show", "--set", "foo", "--debug"], ConfigError),
        (["config", "--debug", "show", "--set", "foo"], ConfigError),
        (["--debug", "config", "show", "--set", "foo"], ConfigError),
    ],
    ids=["after-run", "after-config-show", "between-config-and-show", "before"],
)
def test_debug_is_accepted_before_or_after_the_subcommand(hf_offline, argv, error):
    with pytest.raises(error):
        main(argv)


@pytest.mark.parametrize("argv", [["-v", "config", "show"], ["config", "show", "--verbose"], ["config", "-v", "show"]])
def test_verbose_is_accepted_before_or_after_the_subcommand(argv):
    parsed = build_parser().parse_args(argv)
    assert parsed.verbose and not parsed.debug
    assert not build_parser().parse_args(["config", "show"]).verbose


@pytest.mark.parametrize("argv", [["--version"], ["run", "--version"], ["config", "show", "--version"], ["bench", "--version"]])
def test_version_prints_autodeploy_torch_and_transformers_versions(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"autodeploy \S+ \(torch \S+, transformers \S+, python \S+\)\n", out), out
    assert f"torch {importlib.metadata.version('torch')}," in out
