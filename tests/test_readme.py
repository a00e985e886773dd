"""The README's extension examples run as written."""

import re
from pathlib import Path

import torch

README = (Path(__file__).parent.parent / "README.md").read_text()


def _python_block(heading: str) -> str:
    return re.search(rf"## {heading}\n.*?```python\n(.*?)```", README, re.S).group(1)


def test_readme_transform_example_runs_from_config(llama_llm, llama_dir):
    from autodeploy import autodeploy

    exec(_python_block("Adding a transform"), {})
    llm = autodeploy(str(llama_dir), device="cpu", transforms={"count_linears": {"warn_above": 10}})
    (record,) = [r for r in llm.records if r.name == "count_linears"]
    assert record.stage == "fuse" and record.matches == 15  # 2 layers × 7 linears + lm_head


def test_readme_op_example_registers_a_canonical_op():
    exec(_python_block("Adding an op"), {})
    x = torch.randn(3)
    torch.testing.assert_close(torch.ops.autodeploy.my_gelu(x), torch.nn.functional.gelu(x, approximate="tanh"))
