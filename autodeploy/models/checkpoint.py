"""Read checkpoint tensors one at a time (safetensors, single or sharded; legacy ``.bin`` via mmap)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from autodeploy.errors import CheckpointError, error_summary


class CheckpointReader:
    """Lazy access to a checkpoint folder's tensors: ``keys()``, ``read(key)``, ``read_slice(key, dim, start, stop)``."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        self._index_files()

    def _index_files(self) -> None:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as error:
                raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map')") from error
            for key, file_name in weight_map.items():
                self._file_of[key] = self.directory / file_name
            missing = sorted({p.name for p in self._file_of.values() if not p.is_file()})
            if missing:
                raise CheckpointError(f"{index} names shard(s) that are not in the folder: {', '.join(missing[:4])}")
            return
        files = sorted(self.directory.glob("*.safetensors")) or sorted(self.directory.glob("pytorch_model*.bin"))
        if not files:
            raise CheckpointError(
                f"no *.safetensors (or pytorch_model*.bin) weights in {self.directory}; pass weights='random' "
                f"(--set weights=random) to run the architecture with random weights"
            )
        for file in files:
            for key in self._handle(file).keys():
                self._file_of[key] = file

    def _handle(self, file: Path):
        handle = self._open.get(file)
        if handle is None:
            try:
                if file.suffix == ".safetensors":
                    from safetensors import safe_open

                    handle = safe_open(str(file), framework="pt", device="cpu")
                else:
                    handle = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as error:  # safetensors raises its own SafetensorError; torch.load many kinds
                raise CheckpointError(f"cannot read checkpoint file {file}: {error_summary(error)}") from error
            self._open[file] = handle
        return handle

    def keys(self) -> list[str]:
        return list(self._file_of)

    def read(self, key: str) -> torch.Tensor:
        handle = self._handle(self._file_of[key])
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]

    def read_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``start … stop − 1`` of the tensor along ``dim``; from safetensors only those bytes are read
        (a tensor-parallel rank's slice), from a ``.bin`` only those pages of the memory map are touched."""
        handle = self._handle(self._file_of[key])
        if hasattr(handle, "get_slice"):
            return handle.get_slice(key)[(slice(None),) * dim + (slice(start, stop),)]
        return handle[key].narrow(dim, start, stop - start)

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, read from the file header (no data is loaded for safetensors)."""
        handle = self._handle(self._file_of[key])
        if hasattr(handle, "get_slice"):
            return tuple(handle.get_slice(key).get_shape())
        return tuple(handle[key].shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)


class StateDictReader:
    """A ``CheckpointReader`` over tensors already in memory (the reduced twin's weights, for verification)."""

    def __init__(self, tensors: dict[str, torch.Tensor], directory: Path | str = "<in memory>"):
        self.tensors = tensors
        self.directory = Path(directory)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def read_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.tensors[key].narrow(dim, start, stop - start)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)
