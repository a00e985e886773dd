"""Programmatic dependent launch for the short kernels of a decode step.

On Hopper and later, a kernel launched with ``launch_pdl`` is scheduled while the kernel before it in
the stream drains, instead of after it has exited and flushed; it must then wait (``gdc_wait``) before
it touches memory the earlier kernel may write or read. A decode step is a few hundred kernels of a few
microseconds each, so the launch latency between them is a measurable share of the step.

A kernel takes part by taking ``USE_PDL: tl.constexpr`` and calling :func:`wait_for_previous_kernel`
first, and its launch passes ``**dependent_launch(device)``. The two go together: a kernel launched
with ``launch_pdl`` that did not wait could read its inputs before they were written. A kernel launched
without it (cuBLAS, torch, a kernel that does not take part) is serialized as usual, so one that does
may follow any kernel.

``DEPENDENT_LAUNCH = False`` turns it off for the launches that follow (``scripts/profile_engine_step.py
--no-pdl`` measures a step both ways).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import hopper_or_later

DEPENDENT_LAUNCH = True


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then let the next
    kernel be scheduled: it starts as soon as every program of this one has started, and waits in turn."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def dependent_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel that starts with :func:`wait_for_previous_kernel`: with
    programmatic dependent launch on a CUDA device that has it (compute capability 9.0 or later) while
    ``DEPENDENT_LAUNCH`` is set, without it elsewhere (the interpreter included)."""
    use = DEPENDENT_LAUNCH and hopper_or_later(device)
    return {"USE_PDL": True, "launch_pdl": True} if use else {"USE_PDL": False}


# Per device, zeroed int32 counters that the programs of one launch count their arrival on (split
# attention, split GEMMs): the last to arrive finishes the work and sets its counter back to zero, so
# the counters are zero between launches. Launches on a stream run one after another (a dependent launch
# waits before touching memory), so all kernels share them. A CUDA graph keeps the address it was
# captured with: a larger request allocates a new buffer and every earlier one is kept alive.
_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_ARRIVAL_COUNTERS = 1 << 16


def arrival_counters(count: int, device: torch.device) -> torch.Tensor:
    """At least ``count`` zeroed counters on ``device`` (see above)."""
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        buffers.append(torch.zeros(max(_MIN_ARRIVAL_COUNTERS, triton.next_power_of_2(count)), dtype=torch.int32, device=device))
    return buffers[-1]
