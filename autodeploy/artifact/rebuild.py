"""Where a saved deployment is built again from, when this process cannot serve it as saved.

A deployment serves only under the library versions and the device kind that built it (its graph names
kernels chosen and tuned there, in torch.export's format of that torch). Elsewhere it is rebuilt from the
source its manifest records, or, when that source is not reachable, refused with a ``CheckpointError``
that names the mismatch and both ways out.
"""

from __future__ import annotations

from pathlib import Path

from autodeploy.errors import CheckpointError, ModelNotFoundError, error_summary
from autodeploy.models.source import resolve_model_source

from .manifest import Manifest


def rebuild_command(manifest: Manifest, directory: Path) -> str:
    """The command that builds the deployment in ``directory`` again from its source."""
    model = manifest.source.get("model")
    return f"autodeploy build {model + ' ' if model else ''}--out {directory}"


def rebuild_source(manifest: Manifest, directory: Path, mismatches: list[str]) -> str | None:
    """The ``model`` argument that builds the deployment again (None: the demo model); ``CheckpointError``
    when neither the folder it was built from nor the model as given resolves here."""
    folder = manifest.source.get("directory")
    if folder and (Path(folder) / "config.json").is_file():
        return folder
    model = manifest.source.get("model")
    try:
        resolve_model_source(model, manifest.source.get("weights", "checkpoint"))
    except ModelNotFoundError as error:
        built_with = ", ".join(f"{package} {version}" for package, version in manifest.versions.items())
        raise CheckpointError(
            f"{directory} cannot be served here: it was built with {'; '.join(mismatches)}. It would be rebuilt from "
            f"its source {model!r}, which is not reachable ({error_summary(error, 200)}). Serve it where it was built "
            f"({built_with} on {manifest.device.get('name')}), or rebuild it where the source is: "
            f"{rebuild_command(manifest, directory)}"
        ) from error
    return model
