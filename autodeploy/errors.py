"""Typed errors. Each says what was wrong and what to do about it.

The CLI prints ``str(error)`` as one line; ``--debug`` shows the traceback.
"""


class AutoDeployError(Exception):
    """Base class of every error autodeploy raises on purpose."""


class ModelNotFoundError(AutoDeployError):
    """The model id or path does not resolve to a checkpoint or config."""


class UnsupportedModelError(AutoDeployError):
    """The checkpoint exists but its architecture cannot be built."""


class CheckpointError(AutoDeployError):
    """The checkpoint's tensors do not fit the model (missing keys, wrong shapes), or a saved deployment
    cannot be served (a file that fails its sha256, an archive that is truncated or holds what it must not)."""


class ConfigError(AutoDeployError):
    """A YAML file, keyword override or ``--set`` argument is invalid."""


class ExportError(AutoDeployError):
    """``torch.export`` could not capture the model."""


class TransformError(AutoDeployError):
    """A pipeline transform failed."""


class InvalidRequestError(AutoDeployError, ValueError):
    """A generate() call has invalid prompts or sampling parameters."""


class WorkerError(AutoDeployError):
    """A worker process of a deployment over several ranks died or stopped answering; the deployment
    cannot serve any more (deploy it again)."""


class RegistryError(AutoDeployError):
    """etcd, the disaggregated workers' registry, cannot be reached or answered with an error, or a worker's record in it
    is invalid."""


class TransferError(AutoDeployError):
    """A KV-cache transfer between disaggregated workers was refused (another model or KV layout) or cannot start."""


def error_summary(error: BaseException, limit: int = 400) -> str:
    """A wrapped library error's message on one line: its lines joined (libraries wrap long messages),
    cut at a sentence or word boundary when longer than ``limit`` — never mid-word."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) <= limit:
        return text
    cut = text[:limit]
    sentence = cut.rfind(". ")
    end = sentence + 1 if sentence >= limit // 2 else cut.rfind(" ")
    return cut[: end if end > 0 else limit].rstrip() + " …"
