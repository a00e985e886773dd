"""The autotuner: profiles the backends that support a canonical op's node, per token-count bucket,
dtype and device, and persists the decisions on disk (see ``tuner.py``)."""

from .buckets import bucket_for, token_buckets
from .decision_cache import Decision, DecisionCache, default_cache_dir, environment
from .tuner import Autotuner, relative_error, tolerance

__all__ = [
    "Autotuner",
    "Decision",
    "DecisionCache",
    "bucket_for",
    "default_cache_dir",
    "environment",
    "relative_error",
    "token_buckets",
    "tolerance",
]
