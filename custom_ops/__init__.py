"""custom_ops: see ARCHITECTURE.md."""
