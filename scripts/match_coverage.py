"""Coverage table for the match stage: architecture → canonical ops found/expected, max |logit − HF eager|,
match-stage time. Uses the tiny random checkpoints of the test suite.

Run from the repo root: python scripts/match_coverage.py
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autodeploy import autodeploy  # noqa: E402
from autodeploy.transforms.match_report import match_report  # noqa: E402
from tests.coverage_models import coverage_architectures, eager_reference_model  # noqa: E402
from tests.logit_comparison import deployed_max_logit_diff  # noqa: E402

SHAPES = ((1, 1, 0), (2, 9, 0), (3, 17, 0))

print(f"| architecture | attention | norm | mlp | moe | rope | max abs logit diff | match stage (s) |")
print("|---|---|---|---|---|---|---|---|")
for arch in coverage_architectures():
    reference = eager_reference_model(arch)
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory)
        llm = autodeploy(directory, device="cpu")
    report = match_report(llm.graph, reference.config)
    counts = {c.kind: f"{c.found}/{c.expected}" for c in report.counts}
    ropes = sum(1 for n in llm.graph.graph.nodes if n.target is __import__("torch").ops.autodeploy.rope.default)
    seconds = sum(r.seconds for r in llm.records if r.stage == "match")
    diff = deployed_max_logit_diff(reference, llm, SHAPES)
    cells = [counts.get(kind, "–") for kind in ("attention", "norm", "mlp", "moe")]
    print(f"| {arch} | {' | '.join(cells)} | {ropes} | {diff:.1e} | {seconds:.3f} |")
