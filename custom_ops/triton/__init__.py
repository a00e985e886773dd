"""Triton backends of canonical ops; each module is imported lazily by the op it serves (see its ``add_backend``)."""
