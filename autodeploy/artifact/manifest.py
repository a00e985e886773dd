"""``manifest.json``: what a saved deployment is, what built it, where it came from, and every file's digest.

    manifest = Manifest.read(directory)        # CheckpointError when missing or malformed
    manifest.environment_mismatches()          # ["torch 2.12.0 (this process has 2.13.0)", …]; [] to serve as saved
    manifest.verify_files(directory)           # CheckpointError naming a file whose digest differs

A file's digest (:func:`file_digest`) is its sha256 up to 64 MiB; a larger file's is the sha256 of its 64 MiB
chunks' sha256s, which the cores compute at once: one sha256 over a 16 GB weights file is ~10 s on one core,
most of a reload. The digests catch a file that was truncated, corrupted or edited since the save. They
prove integrity, not origin: whoever can write the folder can rewrite the manifest too. What keeps a hostile
folder harmless is that nothing in it is unpickled or evaluated (``archive_safety.py``, ``weights_file.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from autodeploy.errors import CheckpointError

FORMAT = "autodeploy-deployment"
FORMAT_VERSION = 2  # 2: digests over 64 MiB chunks (1: one sha256 a file)
MANIFEST_FILE = "manifest.json"
# The software a saved graph depends on: another version of any of them rebuilds from the source.
VERSIONED_PACKAGES = ("autodeploy", "torch", "transformers", "triton")
RELOAD_VERIFICATION = "not repeated on reload: the graph and weights are the ones verified at build (see files' digests)"
DIGEST_CHUNK = 64 << 20


def package_versions() -> dict[str, str]:
    versions = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "absent"
    return versions


def device_kind(device: str) -> dict[str, str]:
    """The hardware a graph's kernels were chosen and tuned for: the GPU model, or the CPU architecture."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return {"type": "cuda", "name": "no GPU visible"}
        major, minor = torch.cuda.get_device_capability(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}"}
    return {"type": device.type, "name": platform.machine()}


def file_digest(path: Path) -> str:
    """The file's sha256 when it holds at most ``DIGEST_CHUNK`` bytes; otherwise the sha256 of the
    concatenated sha256s of its ``DIGEST_CHUNK``-byte chunks, hashed on as many threads as there are cores
    (hashlib leaves the GIL while it hashes)."""
    with open(path, "rb") as file:
        descriptor = file.fileno()

        def chunk_sha256(offset: int) -> bytes:
            return hashlib.sha256(os.pread(descriptor, DIGEST_CHUNK, offset)).digest()

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            return digest_of_chunks(list(pool.map(chunk_sha256, range(0, os.path.getsize(path), DIGEST_CHUNK))))


def incomplete(directory: Path, name: str) -> CheckpointError:
    """The error for a saved deployment that lacks the file ``name`` (a save writes every file or none)."""
    return CheckpointError(f"{Path(directory) / name} is missing: the saved deployment in {directory} is incomplete (copied in "
                           f"part, or a file was removed since the save); save the deployment again")


def digest_of_chunks(chunk_sha256s: list[bytes]) -> str:
    """:func:`file_digest` from the sha256s of the file's ``DIGEST_CHUNK``-byte chunks, in order (a reader
    that hashes each chunk as it reads it, ``weights_file.load_tensors``, needs no second pass)."""
    if len(chunk_sha256s) <= 1:  # one chunk: its own sha256 is the file's (an empty file's too)
        return chunk_sha256s[0].hex() if chunk_sha256s else hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(b"".join(chunk_sha256s)).hexdigest()


@dataclass
class Manifest:
    """What ``manifest.json`` holds. ``source`` is what the deployment was built from: ``model`` as given (a
    path, hub id or shipped config name; None for the demo model), ``directory`` the folder it resolved to,
    and ``weights`` (checkpoint or random). ``verification`` is the build's report (None when it was off)."""

    versions: dict[str, str]
    device: dict[str, str]
    dtype: str
    source: dict[str, Any]
    files: dict[str, str]  # path inside the deployment → its file_digest
    verification: dict[str, Any] | None = None
    reload_verification: str = RELOAD_VERIFICATION
    created: str = dataclasses.field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def write(self, directory: Path) -> None:
        (Path(directory) / MANIFEST_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        try:
            fields = json.loads(path.read_text())
        except FileNotFoundError:
            raise incomplete(directory, MANIFEST_FILE) from None
        except OSError as error:
            raise CheckpointError(f"{directory} has no readable {MANIFEST_FILE} ({error.strerror}); save the deployment again") from error
        except ValueError as error:
            raise CheckpointError(f"{path} is not valid JSON ({error}); the folder is damaged: save the deployment again") from error
        if not isinstance(fields, dict) or fields.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an autodeploy deployment manifest (no \"format\": \"{FORMAT}\")")
        known = {field.name for field in dataclasses.fields(cls)}
        try:
            manifest = cls(**{key: value for key, value in fields.items() if key in known})
        except TypeError as error:
            raise CheckpointError(f"{path} lacks a required entry ({error}); save the deployment again") from error
        if not isinstance(manifest.files, dict) or not isinstance(manifest.versions, dict) or not isinstance(manifest.source, dict):
            raise CheckpointError(f"{path}: files, versions and source must be mappings; save the deployment again")
        return manifest

    def environment_mismatches(self) -> list[str]:
        """How this process differs from the one that built the deployment; empty when it can serve it as saved."""
        found = []
        if self.format_version != FORMAT_VERSION:
            found.append(f"deployment format {self.format_version} (this autodeploy reads {FORMAT_VERSION})")
        here = package_versions()
        for package in VERSIONED_PACKAGES:
            saved = self.versions.get(package, "absent")
            if saved != here[package]:
                found.append(f"{package} {saved} (this process has {here[package]})")
        device = device_kind(self.device.get("type", "cpu"))
        if device != self.device:
            found.append(f"device {self.device.get('name')} (this machine has {device['name']})")
        return found

    def verify_files(self, directory: Path, only: tuple[str, ...] | None = None) -> None:
        """Every listed file (or those in ``only``) exists under ``directory`` with its recorded digest."""
        for name in self.files if only is None else only:
            digest = self.files.get(name)
            path = Path(directory) / name
            if digest is None:
                raise CheckpointError(f"{directory / MANIFEST_FILE} lists no digest for {name}; save the deployment again")
            if not path.resolve().is_relative_to(Path(directory).resolve()):
                raise CheckpointError(f"{directory / MANIFEST_FILE} lists {name!r}, which is outside the deployment folder")
            if not path.is_file():
                raise incomplete(directory, name)
            self.check_digest(directory, name, file_digest(path))

    def check_digest(self, directory: Path, name: str, digest: str) -> None:
        """``digest`` (the file's, as :func:`file_digest` computes it) is the one recorded for ``name``."""
        if self.files.get(name) != digest:
            raise CheckpointError(
                f"{Path(directory) / name} does not match the sha256 digest its manifest recorded: the file was truncated, "
                f"corrupted or edited since it was saved; save the deployment again (autodeploy build … --out {directory})"
            )
