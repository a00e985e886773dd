"""The transform registry: a pass's stage is required, the pipeline does the upkeep a pass declares, and every
module of transforms/ registers without a list to edit."""

from __future__ import annotations

import pkgutil
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import autodeploy.transforms
from autodeploy.config import validate_transform_entry
from autodeploy.export.export import export_to_graph_module
from autodeploy.pipeline import Pipeline, run_transform
from autodeploy.transforms import (Transform, TransformConfig, TransformContext, TransformResult, get_transform_class,
                                   register_transform, registered_transforms)


class _AddOne(Transform):
    """Adds one to the output through a new node, and leaves the old output's node and a dead node behind."""

    def apply(self, module, context):
        graph = module.graph
        output = graph.output_node()
        (value,) = output.all_input_nodes
        with graph.inserting_before(output):
            graph.call_function(torch.ops.aten.neg.default, (value,))  # unused: dead code
            plus = graph.call_function(torch.ops.aten.add.Tensor, (value, 1.0))
        output.replace_input_with(value, plus)
        return TransformResult(matches=1, changed=True)


def _exported() -> torch.fx.GraphModule:
    return export_to_graph_module(nn.Linear(4, 4).eval(), (torch.randn(2, 4),))


def test_a_pass_without_a_stage_is_refused():
    with pytest.raises(TypeError, match="needs the pass's stage"):
        register_transform("test_no_stage")(_AddOne)
    assert get_transform_class("test_no_stage") is None


def test_a_stage_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="stages are factory"):
        register_transform("test_bad_stage", stage="later")(type("BadStage", (_AddOne,), {}))


def test_the_old_form_stage_in_the_config_registers_with_a_deprecation_warning():
    @dataclass
    class OldConfig(TransformConfig):
        stage: str = "fuse"

    old = type("OldForm", (_AddOne,), {"config_class": OldConfig})
    with pytest.warns(DeprecationWarning, match="stage='fuse'"):
        register_transform("test_old_form")(old)
    assert old.stage == "fuse" and validate_transform_entry("test_old_form", {}).stage == "fuse"


def test_the_registered_stage_fills_a_config_and_yaml_may_move_it():
    assert validate_transform_entry("refold_transposes", {}).stage == "cache"
    assert validate_transform_entry("refold_transposes", {"stage": "cleanup"}).stage == "cleanup"
    assert get_transform_class("cleanup_noop")(TransformConfig()).config.stage == "cleanup"


def test_the_pipeline_recompiles_after_a_pass_and_prunes_dead_code_when_declared():
    plain = register_transform("test_add_one", stage="fuse")(type("AddOne", (_AddOne,), {}))
    pruned = register_transform("test_add_one_pruned", stage="fuse", dead_code=True, shapes="all")(
        type("AddOnePruned", (_AddOne,), {}))
    x = torch.randn(2, 4)
    for cls, dead_left in ((plain, 1), (pruned, 0)):
        gm = _exported()
        expected = gm(x) + 1
        run_transform(cls(TransformConfig()), gm, TransformContext(settings=None))
        torch.testing.assert_close(gm(x), expected)  # the forward was regenerated from the rewritten graph
        assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)) == dead_left
    added = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)))
    assert tuple(added.meta["val"].shape) == (2, 4)  # shapes="all": the new node has its value


def test_an_unchanged_graph_is_left_alone():
    class Nothing(Transform):
        def apply(self, module, context):
            module.graph.output_node().meta["touched"] = True
            return TransformResult()

    nothing = register_transform("test_nothing", stage="cleanup")(Nothing)
    gm = _exported()
    code = gm.code
    Pipeline([nothing(TransformConfig())]).run(TransformContext(settings=None), gm)
    assert gm.code is code


def test_every_module_of_the_package_is_imported_and_every_built_in_pass_has_a_stage():
    names = {m.name for m in pkgutil.iter_modules(autodeploy.transforms.__path__)}
    assert {"fuse_gemms", "registry", "select_kernels"} <= names
    for name in names:
        assert f"autodeploy.transforms.{name}" in sys.modules
    for name, cls in registered_transforms().items():
        assert cls.stage, name
