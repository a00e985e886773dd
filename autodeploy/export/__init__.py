"""Export: ``torch.export`` with dynamic batch and sequence dimensions, plus export patches."""

from autodeploy.export.export import export_causal_lm, export_to_graph_module
from autodeploy.export.patches import register_export_patch, registered_export_patches

__all__ = ["export_causal_lm", "export_to_graph_module", "register_export_patch", "registered_export_patches"]
