"""patterns: search/replacement pairs that turn aten subgraphs into canonical ops, grouped by family.

Importing a family module (``autodeploy.patterns.norm``, ``autodeploy.patterns.mlp``, …) registers its
patterns; ``registry.py`` explains how matching works and how to add your own.
"""

from autodeploy.patterns.registry import (
    FAMILIES,
    Pattern,
    PatternRegistrationError,
    apply_patterns,
    register_pattern,
    register_rewrite,
    registered_patterns,
    select_patterns,
    trace_export_ir,
    unregister_pattern,
)

__all__ = [
    "FAMILIES",
    "Pattern",
    "PatternRegistrationError",
    "apply_patterns",
    "register_pattern",
    "register_rewrite",
    "registered_patterns",
    "select_patterns",
    "trace_export_ir",
    "unregister_pattern",
]
