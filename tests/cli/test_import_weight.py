"""What ``import autodeploy`` and the CLI parser import: no torch until a public name is used.

Each check runs in a fresh interpreter, since this test process has torch loaded already. They assert
which modules are loaded, not how long that took: timings on a shared machine are noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import autodeploy

REPO = Path(__file__).parents[2]
HEAVY = ("torch", "transformers", "omegaconf")


def _run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it reports by assigning a dict to ``report``."""
    script = f"import json, sys\n{code}\nprint(json.dumps(report))"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _loaded_heavy_modules() -> str:
    return f"sorted(m for m in {HEAVY!r} if m in sys.modules)"


def test_building_the_parser_and_help_and_version_import_no_heavy_module():
    report = _run_python(f"""
import contextlib, io
import autodeploy.cli.main as cli
cli.build_parser().parse_args(["--debug", "run", "--prompt", "hi"])
for flag in ("--help", "--version"):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main([flag])
report = {{"heavy": {_loaded_heavy_modules()}}}
""")
    assert report["heavy"] == []


def test_import_autodeploy_defers_torch_until_a_heavy_name_is_used():
    report = _run_python(f"""
import autodeploy
version = autodeploy.__version__
names = dir(autodeploy)
autodeploy.errors.ConfigError
before = {_loaded_heavy_modules()}
autodeploy.LLM
report = {{"before": before, "after": {_loaded_heavy_modules()}, "version": version, "names": names}}
""")
    assert report["before"] == []
    assert "torch" in report["after"]
    assert report["version"]
    assert set(autodeploy.__all__) | {"__version__"} <= set(report["names"])


def test_loading_settings_registers_the_built_in_transforms():
    # build_model, load_weights and export_to_fx register as a side effect of modules the lazy package
    # does not import; loading settings (which validates every transform the pipeline names) imports them.
    report = _run_python("""
from autodeploy.config import load_settings
from autodeploy.pipeline import Pipeline
from autodeploy.transforms import registered_transforms
names = [t.name for t in Pipeline.from_settings(load_settings()).transforms]
report = {"registered": sorted(registered_transforms()), "pipeline": names}
""")
    assert {"build_model", "load_weights", "export_to_fx", "select_kernels", "compile_model"} <= set(report["registered"])
    assert report["pipeline"][:2] == ["build_model", "export_to_fx"] and report["pipeline"][-2:] == ["select_kernels", "compile_model"]


def test_every_public_name_resolves():
    assert [name for name in autodeploy.__all__ if not hasattr(autodeploy, name)] == []
    assert not hasattr(autodeploy, "no_such_name")
