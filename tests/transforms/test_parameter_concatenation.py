"""concatenate_parameters: one new parameter, the originals deleted, no attribute replaced."""

import torch
from torch import fx, nn

from autodeploy.transforms.parameter_concatenation import concatenate_parameters, concatenated_name


def test_names_say_what_was_concatenated():
    assert concatenated_name(["a.b.q_proj.weight", "a.b.k_proj.weight"]) == ("a.b", "q_proj_k_proj_weight")
    assert concatenated_name(["a.gate_proj.weight", "a.up_proj.weight"]) == ("a", "gate_proj_up_proj_weight")
    assert concatenated_name(["x", "y"]) == ("", "x_y")


def test_a_taken_name_gets_a_suffix_and_the_originals_go():
    root = nn.Module()
    root.x, root.y, root.x_y = (nn.Parameter(torch.randn(2, 3)) for _ in range(3))
    graph = fx.Graph()
    graph.output([graph.get_attr(name) for name in ("x", "y", "x_y")])
    gm = fx.GraphModule(root, graph)
    existing = gm.x_y
    x, y = gm.x.detach().clone(), gm.y.detach().clone()
    target, fused = concatenate_parameters(gm, ["x", "y"])
    assert target == "x_y_1" and gm.x_y is existing
    assert torch.equal(fused, torch.cat([x, y])) and not fused.requires_grad
    assert [name for name, _ in gm.named_parameters()] == ["x_y", "x_y_1"]
