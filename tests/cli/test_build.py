"""``autodeploy build MODEL --out DIR`` writes a deployment that ``autodeploy run DIR`` serves."""

from __future__ import annotations

from autodeploy import SamplingParams
from autodeploy.cli.main import main


def test_build_then_run_serves_the_same_completion(capsys, llama_dir, llama_llm, tmp_path):
    out = tmp_path / "deployed"
    assert main(["build", str(llama_dir), "--out", str(out), "--set", "device=cpu", "--set", "verify.enabled=false"]) == 0
    assert f"serve it with: autodeploy run {out}" in capsys.readouterr().out
    assert main(["run", str(out), "--prompt", "def f(x):", "--max-tokens", "6"]) == 0
    expected = llama_llm.generate("def f(x):", SamplingParams(max_tokens=6, temperature=0))[0].text
    assert capsys.readouterr().out.startswith(f"def f(x):{expected}\n--- ")


def test_build_refuses_a_folder_that_is_not_a_deployment_in_one_line(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["build", "--out", str(tmp_path), "--set", "device=cpu", "--set", "verify.enabled=false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "is not a saved deployment" in err[0]
