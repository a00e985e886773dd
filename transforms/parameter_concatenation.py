"""Replace module parameters by their concatenation, keeping no second copy: the weight side of the ``fuse``
stage's horizontal GEMM fusions (``fuse_gemms``, ``fuse_gate_up``).

```python
import torch
from torch import fx, nn
from autodeploy.transforms.parameter_concatenation import concatenate_parameters

root = nn.Module()
root.mlp = nn.Module()
root.mlp.gate_proj, root.mlp.up_proj = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
graph = fx.Graph()
graph.output([graph.get_attr("mlp.gate_proj.weight"), graph.get_attr("mlp.up_proj.weight")])
gm = fx.GraphModule(root, graph)
target, fused = concatenate_parameters(gm, ["mlp.gate_proj.weight", "mlp.up_proj.weight"])
assert target == "mlp.gate_proj_up_proj_weight" and fused.shape == (8, 8)
assert not hasattr(gm.mlp.gate_proj, "weight")  # the originals are deleted: no second copy
```
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule


def concatenated_name(targets: list[str]) -> tuple[str, str]:
    """``(owner module path, attribute)`` for the concatenation of ``targets``: ``a.b.q_proj.weight,
    a.b.k_proj.weight`` → ``("a.b", "q_proj_k_proj_weight")``; ``x, y`` → ``("", "x_y")``."""
    parents = [target.split(".")[:-1] for target in targets]
    lasts = [target.rsplit(".", 1)[-1] for target in targets]
    common = 0
    while all(len(p) > common and p[common] == parents[0][common] for p in parents):
        common += 1
    leaves = ["_".join(p[common:]) for p in parents]
    if all(leaves) and len(set(lasts)) == 1:
        attribute = "_".join(leaves) + "_" + lasts[0]
    else:
        attribute = "_".join("_".join([*p[common:], last]) for p, last in zip(parents, lasts))
    return ".".join(parents[0][:common]), attribute


def concatenate_parameters(gm: GraphModule, targets: list[str]) -> tuple[str, torch.Tensor]:
    """Concatenate the parameters at ``targets`` (dim 0) into a new one and delete them; returns the new
    parameter's target and tensor (the concatenation's size more memory while both exist, in this call)."""
    owner_path, attribute = concatenated_name(targets)
    owner = gm.get_submodule(owner_path)
    taken, suffix = attribute, 1
    while hasattr(owner, attribute):  # never replace an attribute the module has already
        attribute, suffix = f"{taken}_{suffix}", suffix + 1
    fused = nn.Parameter(torch.cat([gm.get_parameter(t) for t in targets]), requires_grad=False)
    for target in targets:
        module_path, _, leaf = target.rpartition(".")
        delattr(gm.get_submodule(module_path), leaf)
    owner.register_parameter(attribute, fused)
    return f"{owner_path}.{attribute}" if owner_path else attribute, fused
