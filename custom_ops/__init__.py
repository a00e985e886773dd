"""Canonical ops: ``torch.ops.autodeploy.<name>``, each with a torch reference, a fake and candidate backends.

Importing this package registers every built-in op (one module each); :func:`canonical_ops` lists them
and :func:`register_op` adds one of your own (see ``registry.py``).
"""

from . import attention, cached_attention, cached_attention_sdpa, gated_mlp, layer_norm, linear, mlp, moe, rms_norm, rope  # noqa: F401  (registers the ops)
from .registry import Backend, CanonicalOp, OpRegistrationError, add_backend, canonical_ops, register_op

__all__ = ["Backend", "CanonicalOp", "OpRegistrationError", "add_backend", "canonical_ops", "register_op"]
