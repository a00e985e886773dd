"""Tuning decisions on disk, so a later build of the same model on the same machine profiles nothing.

One JSON file per *environment* (device name, torch / triton / autodeploy versions): a decision made on
another GPU or another release is never read, it simply lives in another file. Inside, decisions are
keyed by problem (op, argument shapes and dtypes with the token dimension left open, candidate set)
and token bucket. A file that does not parse or holds the wrong structure is ignored with a warning and
rewritten; a directory that cannot be written keeps the decisions in memory for this process, with a
warning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: weights that fit in the L2 cache are timed over rotated copies (tuner.rotated_input_sets)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autodeploy/autotuner``, or ``~/.cache/autodeploy/autotuner``."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "autodeploy" / "autotuner"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment(device: torch.device, graphed: bool = False) -> dict[str, str]:
    """What a timing depends on besides the problem: the device model, the software that compiled the
    kernels, and whether calls were timed inside CUDA graphs (``graphed``) or as eager launches."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        import platform

        name = f"cpu:{platform.processor() or platform.machine()}:{os.cpu_count()}"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "autodeploy": _version("autodeploy"),
        "format": str(FORMAT),
        **({"timing": "cuda_graph"} if graphed else {}),
    }


@dataclass
class Decision:
    """The fastest candidate for one problem at one token bucket, and every candidate's median time."""

    backend: str
    seconds: dict[str, float]
    excluded: dict[str, str]  # candidate → why it did not compete (wrong result, crashed)


class DecisionCache:
    """Decisions for one environment, read from and written to ``cache_dir``."""

    def __init__(self, cache_dir: str | Path | None, env: dict[str, str]):
        self.env = env
        digest = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(cache_dir) if cache_dir else default_cache_dir()
        self.path = self.path / f"decisions-{digest}.json"
        self.decisions: dict[str, Decision] = self._read()
        self._writable = True

    def get(self, key: str) -> Decision | None:
        return self.decisions.get(key)

    def put(self, key: str, decision: Decision) -> None:
        self.decisions[key] = decision

    def save(self) -> None:
        """Write every decision (atomically: a crash never leaves half a file); warn once if the directory is not writable."""
        if not self._writable:
            return
        payload = {
            "environment": self.env,
            "decisions": {key: vars(d) for key, d in sorted(self.decisions.items())},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as handle:
                json.dump(payload, handle, indent=1)
            os.replace(handle.name, self.path)
        except OSError as error:
            self._writable = False
            logger.warning(
                "autotuner: cannot write %s (%s); tuning decisions are kept in memory for this process only. "
                "Set autotuner.cache_dir to a writable directory to keep them.", self.path, error.strerror or error,
            )

    def _read(self) -> dict[str, Decision]:
        if not self.path.is_file():
            return {}
        try:
            payload = json.loads(self.path.read_text())
            if payload.get("environment") != self.env:
                raise ValueError("it was written for another environment")
            return {key: Decision(**fields) for key, fields in payload["decisions"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            logger.warning("autotuner: ignoring the unreadable cache %s (%s); it will be rebuilt", self.path, error)
            return {}


def problem_key(op_name: str, signature: Any, candidates: list[str], bucket: int) -> str:
    return json.dumps([op_name, signature, sorted(candidates), bucket])
