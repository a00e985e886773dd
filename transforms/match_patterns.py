"""The match stage: aten subgraphs → canonical ops (``torch.ops.autodeploy.*``).

``match_patterns`` applies the registered patterns (``autodeploy.patterns``) family by family, in
``FAMILIES`` order; ``match_linear`` then turns every ``aten.linear`` left over into
``autodeploy.linear``, so it must run after the MLP patterns have absorbed theirs.

Choose patterns in YAML by family or by name; ``skip`` removes some of them again::

    transforms:
      match_patterns: {stage: match, patterns: [norm, mlp], skip: [rms_norm_gemma]}
      match_linear:   {stage: match}

A pattern of your own is registered (``register_pattern``) before the config is loaded and then named
like any other. ``matches`` is the number of subgraphs replaced; ``notes`` counts them per pattern.
Every node keeps a correct ``meta["val"]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.linear)
from autodeploy.patterns import attention, mlp, moe, norm, rope  # noqa: F401  (register the built-in patterns)
from autodeploy.patterns.registry import FAMILIES, apply_patterns, select_patterns
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformConfig, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)


@dataclass
class MatchPatternsConfig(TransformConfig):
    patterns: list[str] = field(default_factory=lambda: list(FAMILIES))  # families or pattern names
    skip: list[str] = field(default_factory=list)

    def __post_init__(self):
        select_patterns(self.patterns, self.skip)  # unknown names are a ConfigError when the YAML loads


# Traced replacements carry their values already (see autodeploy.patterns.registry); a whole-graph propagation
# costs more than all matching, so it runs only for a rewrite that left a node without one.
@register_transform("match_patterns", stage="match", dead_code=True, shapes="missing", roles=ALL_ROLES)
class MatchPatterns(Transform):
    """Replace every subgraph a selected pattern matches by its canonical op."""

    config_class = MatchPatternsConfig

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        gm = module
        counts = apply_patterns(gm, select_patterns(self.config.patterns, self.config.skip))
        matches = sum(counts.values())
        notes = ", ".join(f"{name}×{count}" for name, count in counts.items() if count) or "no matches"
        logger.debug("match_patterns: %s", notes)
        return TransformResult(matches=matches, changed=matches > 0, notes=notes)


@register_transform("match_linear", stage="match", roles=ALL_ROLES)
class MatchLinear(Transform):
    """``aten.linear(x, weight, bias?)`` → ``autodeploy.linear(x, weight, bias)``: same arguments, same values."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        gm = module
        linears = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
        for node in linears:
            x, weight, *bias = node.args
            node.target = torch.ops.autodeploy.linear.default
            node.args = (x, weight, bias[0] if bias else node.kwargs.get("bias"))
            node.kwargs = {}
        return TransformResult(matches=len(linears), changed=bool(linears), notes=f"{len(linears)} linears")
