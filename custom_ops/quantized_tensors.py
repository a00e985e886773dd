"""A quantized layer's tensors as a checkpoint stores them, for the schemes' readers (``custom_ops/quantization/``)
and the other formats' (``models/prequantized.py``): each tensor checked against the dtypes and shapes the
format allows before it is converted to our layout.

    layer = CheckpointLayer("model.layers.0.mlp.up_proj", {"weight": w, "weight_scale": s}, (N, K), scheme)
    qweight = layer.tensor("weight", (torch.float8_e4m3fn,), ((N, K),))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autodeploy.errors import CheckpointError, ConfigError

from .quantized_linear import QuantScheme

FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes checkpoints store scales in


@dataclass
class CheckpointLayer:
    """One quantized layer of a checkpoint: its module ``path``, its tensors by leaf name, its weight's
    ``[N, K]`` ``shape`` and the ``scheme`` (``QuantScheme``) it is served as."""

    path: str
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, int]
    scheme: object

    def tensor(self, leaf: str, dtypes: tuple[torch.dtype, ...], shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """``leaf``'s tensor, checked against the dtypes and shapes the format allows here."""
        tensor = self.tensors[leaf]
        if tensor.dtype not in dtypes or tuple(tensor.shape) not in shapes:
            wanted = " or ".join(str(tuple(s)) for s in shapes)
            raise CheckpointError(
                f"checkpoint tensor {self.path}.{leaf} is {str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}, "
                f"but a {self.scheme.name} layer of weight {self.shape} needs {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} "
                f"{wanted}: the quantization_config disagrees with the tensors"
            )
        return tensor

    @property
    def groups(self) -> int:
        return self.shape[1] // self.scheme.group_size


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` → uint8 ``[R, C, 8]``: nibble ``j`` of each word (bits ``4j … 4j+3``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def require_compressed_tensors() -> None:
    """A clear error where the ``compressed-tensors`` package (a dependency on Python 3.11 and later) is missing."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as error:
        raise ConfigError("compressed-tensors checkpoints are read and written with the compressed-tensors package, "
                          "which is not installed: pip install compressed-tensors (it needs Python 3.11 or later)") from error


def checkpoint_scheme(name: str, where: str, **options):
    """``QuantScheme(name, **options)`` for a checkpoint's layers; a ``CheckpointError`` naming ``where`` when the
    options are not ones the scheme takes."""
    try:
        return QuantScheme(name, **options)
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from error
