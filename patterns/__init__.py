"""patterns: see ARCHITECTURE.md."""
