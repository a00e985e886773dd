"""The first thing a new user runs, ``autodeploy run`` on the embedded demo model, prints no warning from a library
above the completion (torch's pytree deprecation came from copying the graph for verification)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_run_on_the_demo_model_prints_no_warning():
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}  # Python's defaults, as a user has
    run = subprocess.run([sys.executable, "-m", "autodeploy", "run", "--prompt", "import os", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=300, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "import os" in run.stdout
    assert "Warning" not in run.stderr and "warn" not in run.stderr.lower(), run.stderr
