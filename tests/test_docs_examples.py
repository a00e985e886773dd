"""The documentation's extension examples (docs/extending.md) run as written; every Python example in docs/ and
the README at least compiles."""

import re
import warnings
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).parent.parent / "docs"
EXTENDING = (DOCS / "extending.md").read_text()
PYTHON_BLOCK = re.compile(r"^ *```python\n(.*?)^ *```", re.S | re.M)


def _python_block(heading: str) -> str:
    return re.search(rf"## {heading}\n.*?```python\n(.*?)```", EXTENDING, re.S).group(1)


def test_transform_example_runs_from_config(llama_llm, llama_dir):
    from autodeploy import autodeploy

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the example registers in the current form, not the deprecated one
        exec(_python_block("Adding a transform"), {})
    llm = autodeploy(str(llama_dir), device="cpu", transforms={"count_linears": {"warn_above": 10}})
    (record,) = [r for r in llm.records if r.name == "count_linears"]
    # 2 layers × (q/k/v fused by fuse_gemms, which runs first in the stage, + o_proj) + lm_head; MLPs are
    # fused_gated_mlp (fuse_gate_up)
    assert record.stage == "fuse" and record.matches == 5


def test_op_example_registers_a_canonical_op():
    exec(_python_block("Adding an op"), {})
    x = torch.randn(3)
    torch.testing.assert_close(torch.ops.autodeploy.scaled_tanh(x, 2.0), torch.tanh(x) * 2.0)


def test_pattern_example_registers_and_runs_by_name(llama_dir):
    from autodeploy import autodeploy
    from autodeploy.patterns import unregister_pattern

    exec(_python_block("Adding a pattern"), {})
    try:
        llm = autodeploy(str(llama_dir), device="cpu", transforms={"match_patterns": {"patterns": ["rope", "attention", "norm", "my_silu_as_sigmoid"]}})
        ops = [r for r in llm.records if r.name == "match_patterns"][0].ops_after
        assert "aten.sigmoid" in ops and "aten.silu" not in ops and "autodeploy.rms_norm" in ops
    finally:
        unregister_pattern("my_silu_as_sigmoid")


def test_backend_example_is_a_correct_rms_norm_kernel(monkeypatch):
    # Recorded rather than registered: a real registration would join every later deploy's contest.
    import autodeploy
    from autodeploy.custom_ops.rms_norm import rms_norm_reference

    registered = []
    monkeypatch.setattr(autodeploy, "register_backend", lambda *args, **kwargs: registered.append((args, kwargs)), raising=False)
    exec(_python_block("Kernel backends"), {})
    ((op_name, name, fn), kwargs), = registered
    assert (op_name, name) == ("rms_norm", "mine")
    x, weight = torch.randn(3, 8), torch.rand(8)
    torch.testing.assert_close(fn(x, weight, 1e-6, 1.0), rms_norm_reference(x, weight, 1e-6, 1.0))
    meta = torch.empty(8, device="meta")
    assert kwargs["supports"](meta, meta, 1e-6, device=torch.device("cpu")) is True
    assert kwargs["supports"](meta.half(), meta, 1e-6, device=torch.device("cpu")) == "needs weight in x's dtype"


@pytest.mark.parametrize("page", [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_python_example_compiles(page):
    for block in PYTHON_BLOCK.findall(page.read_text()):
        # Examples nested in a list item are indented as a whole; dedent by the first line's indent.
        indent = len(block) - len(block.lstrip(" "))
        source = "\n".join(line[indent:] for line in block.splitlines())
        compile(source, f"{page.name} example", "exec")


def test_drafter_example_runs_and_changes_no_token():
    """docs/speculative.md's drafter, as written, on the demo model: the output is the output without speculation."""
    from autodeploy import SamplingParams, autodeploy

    source = re.search(r"## Writing a drafter\n.*?```python\n(.*?)```", (DOCS / "speculative.md").read_text(), re.S).group(1)
    scope: dict = {}
    source = source.replace('autodeploy(speculative={', 'autodeploy(device="cpu", speculative={"auto": False, ')
    exec(source, scope)
    plain = autodeploy(device="cpu").generate("aaaa", SamplingParams(max_tokens=8, temperature=0))[0]
    assert scope["output"].token_ids == plain.token_ids
    assert scope["stats"].drafted > 0
