"""Values on their way into a tensor from a kernel, in its element type: a float8_e4m3fn destination (an
fp8 KV cache) saturates them at ±448 first, as ``cached_attention.to_cache_dtype`` does on the host."""

import triton
import triton.language as tl


@triton.jit
def stored_as(x, ptr):
    """``x`` in ``ptr``'s element type, saturated at ±448 when that is float8_e4m3fn."""
    if ptr.dtype.element_ty == tl.float8e4nv:
        return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return x.to(ptr.dtype.element_ty)
