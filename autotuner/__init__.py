"""autotuner: see ARCHITECTURE.md."""
