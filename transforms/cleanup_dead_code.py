"""``cleanup_dead_code``: drop nodes nobody uses, then the submodules and tensors nobody reads.

Export keeps values a model computes but never returns (HF's unused causal-mask pieces, ``sym_size``
calls, ``get_attr`` of tied or unused weights); other passes leave more behind when they rewire users.
``torch.fx`` does the work: ``Graph.eliminate_dead_code`` keeps every side-effecting node (asserts,
in-place ops, export's ``_guards_fn`` input check), ``GraphModule.delete_all_unused_submodules`` drops
submodules no node refers to. Parameters, buffers and constant tensors that no ``get_attr`` reads any more
are deleted here, so they are neither loaded nor sharded later.

``matches`` is the number of nodes removed; ``notes`` also counts the submodules and tensors deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.fx import GraphModule

from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)


def _tensor_attributes(module: nn.Module) -> Iterator[str]:
    """Names of a module's own parameters, buffers and plain tensor attributes (export's constants)."""
    yield from (name for name, value in module._parameters.items() if value is not None)
    yield from (name for name, value in module._buffers.items() if value is not None)
    yield from (name for name, value in vars(module).items() if isinstance(value, torch.Tensor))


def _is_referenced(qualified_name: str, targets: set[str]) -> bool:
    """Whether a node reads this tensor, directly or through one of the modules that contains it."""
    parts = qualified_name.split(".")
    return any(".".join(parts[:end]) in targets for end in range(1, len(parts) + 1))


def _delete_unused_tensors(gm: GraphModule) -> int:
    """Delete tensors no node reads. A module reachable under several names keeps a tensor if any name is read."""
    targets = {node.target for node in gm.graph.nodes if node.op in ("get_attr", "call_module")}
    owners: dict[tuple[int, str], nn.Module] = {}
    referenced: dict[tuple[int, str], bool] = {}
    for module_name, module in gm.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attribute in _tensor_attributes(module):
            key = (id(module), attribute)
            owners[key] = module
            referenced[key] = referenced.get(key, False) or _is_referenced(prefix + attribute, targets)
    unused = [key for key, is_read in referenced.items() if not is_read]
    for key in unused:
        delattr(owners[key], key[1])
    return len(unused)


@register_transform("cleanup_dead_code", stage="cleanup", roles=ALL_ROLES)
class CleanupDeadCode(Transform):
    """Remove unused side-effect-free nodes, then unused submodules, parameters, buffers and constants."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        graph = module.graph
        nodes_before = len(graph.nodes)
        graph.eliminate_dead_code()
        removed_nodes = nodes_before - len(graph.nodes)

        modules_before = len(list(module.named_modules()))
        module.delete_all_unused_submodules()
        removed_modules = modules_before - len(list(module.named_modules()))
        removed_tensors = _delete_unused_tensors(module)

        changed = bool(removed_nodes or removed_modules or removed_tensors)
        notes = f"removed {removed_nodes} nodes, {removed_modules} submodules, {removed_tensors} unused tensors"
        logger.debug("cleanup_dead_code: %s", notes)
        return TransformResult(matches=removed_nodes, changed=changed, notes=notes)
