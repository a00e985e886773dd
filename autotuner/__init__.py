"""The autotuner: profiles the backends that support a canonical op's node, per token-count bucket,
dtype and device, and persists the decisions on disk (see ``tuner.py``)."""

from .buckets import bucket_for, token_buckets
from .decision_cache import Decision, DecisionCache, default_cache_dir, environment
from .token_dispatch import bucket_runs, describe_dispatch, dispatch_from_description, token_dispatch
from .tuner import Autotuner, relative_error, tolerance

__all__ = [
    "Autotuner",
    "Decision",
    "DecisionCache",
    "bucket_for",
    "bucket_runs",
    "default_cache_dir",
    "describe_dispatch",
    "dispatch_from_description",
    "environment",
    "relative_error",
    "token_buckets",
    "token_dispatch",
    "tolerance",
]
