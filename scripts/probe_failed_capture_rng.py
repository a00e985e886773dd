"""Does a CUDA graph capture that fails leave CUDA's default random generator in capture state ("Offset
increment outside graph capture encountered unexpectedly" at the next torch.rand)? And what puts it right?
One fresh process per case (a broken generator stays broken). Run on a GPU machine:

    python3 scripts/probe_failed_capture_rng.py
"""

import subprocess
import sys

CASES = {
    "sync inside capture": "x.sum().item()",
    "host copy inside capture": "x.cpu()",
    "exception raised inside capture": "raise ValueError('a kernel the compile stage could not vet')",
}
REMEDIES = {
    "none": "",
    "capture an empty graph": "g2 = torch.cuda.CUDAGraph()\nwith torch.cuda.graph(g2):\n    pass\n",
    "graph.reset()": "graph.reset()\n",
}

CASE = '''
import torch
x = torch.ones(4, device="cuda")
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        y = x * 2
        {body}
except Exception as error:
    print("capture failed:", type(error).__name__, str(error).splitlines()[0][:100])
try:
    {remedy_indented}
except Exception as error:
    print("remedy failed:", type(error).__name__, str(error).splitlines()[0][:100])
try:
    torch.rand(2, device="cuda")
    print("torch.rand after: ok")
except Exception as error:
    print("torch.rand after:", type(error).__name__, str(error).splitlines()[0][:100])
'''

for case, body in CASES.items():
    for remedy, code in REMEDIES.items():
        script = CASE.format(body=body, remedy_indented=("\n    ".join(code.splitlines()) or "pass"))
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()][-3:]
        print(f"== {case} / remedy: {remedy}\n   " + "\n   ".join(lines), flush=True)
