"""Fixtures the custom-op tests share."""

import pytest
import torch


@pytest.fixture
def interpreter_rounds_to_fp8_correctly():
    """Triton 3.6's interpreter rounds a float to e4m3 half-up on the mantissa and drops the carry into
    the exponent (126.2 → 64, not 128); the GPU's conversion rounds to nearest even. While a test runs,
    down-casts to e4m3 in the interpreter go through torch's conversion, which rounds as the GPU does."""
    if torch.cuda.is_available():
        yield
        return
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_to_e4m3_to_nearest_even(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype.primitive_bitwidth <= 8:
            return convert(values, input_dtype, output_dtype, rounding_mode)
        as_float = torch.from_numpy(np.ascontiguousarray(values).astype(np.float32))
        return as_float.to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", convert_to_e4m3_to_nearest_even)
        yield
