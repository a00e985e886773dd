"""The README's Python example runs as written."""

import re
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_python_example_generates(llama_llm, monkeypatch, capsys):
    # The shared tiny Llama stands in for the demo model: the example's calls are what is checked, and a
    # second deploy would cost the suite seconds for nothing the engine tests do not already cover.
    import autodeploy

    calls = []
    monkeypatch.setattr(autodeploy, "autodeploy", lambda *args, **kwargs: calls.append((args, kwargs)) or llama_llm, raising=False)
    (block,) = re.findall(r"## Python\n.*?```python\n(.*?)```", README, re.S)
    exec(block, {})
    assert calls == [((), {})]   # the README deploys the embedded demo model, which needs no download
    assert capsys.readouterr().out.rstrip().endswith(("length", "stop"))
