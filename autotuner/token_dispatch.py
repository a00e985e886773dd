"""A node target that runs, per call, the backend its token count's bucket chose.

The select stage builds one where the autotuner's winners for a node differ between token buckets. A
dispatch describes itself as plain data (``describe_dispatch``) and is rebuilt from that description with
the backends looked up by name (``dispatch_from_description``), so a saved deployment keeps the choice:

    dispatch = token_dispatch("rms_norm", {1: triton_backend, 32: torch_backend}, position=(0, 1))
    dispatch.__name__                                   # rms_norm_by_tokens__1_1_triton__32_32_torch
    again = dispatch_from_description(describe_dispatch(dispatch))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autodeploy.custom_ops import Backend, candidates, canonical_ops



def bucket_runs(winners: dict[int, str]) -> list[tuple[int, int, str]]:
    """Consecutive buckets with one winner as ``(first, last, winner)``, in bucket order."""
    runs: list[tuple[int, int, str]] = []
    for bucket in sorted(winners):
        if runs and runs[-1][2] == winners[bucket]:
            runs[-1] = (runs[-1][0], bucket, winners[bucket])
        else:
            runs.append((bucket, bucket, winners[bucket]))
    return runs


def token_dispatch(op_name: str, table: dict[int, Backend], position: tuple[int, int]) -> Callable[..., Any]:
    """A callable that runs ``table[bucket_for(T)]`` where ``T = args[position[0]].shape[position[1]]``."""
    argument, dim = position
    runs = bucket_runs({bucket: backend.name for bucket, backend in table.items()})
    by_name = {backend.name: backend.op for backend in table.values()}
    # (last bucket of a run, its op): T up to a run's last bucket goes to that run (bucket_for's rule:
    # the smallest bucket ≥ T), beyond the largest to the last run. A plain loop over comparisons, not
    # bisect, so torch.compile traces it (one guard per run boundary) instead of breaking the graph.
    run_ends = [(last, by_name[name]) for _, last, name in runs]

    def dispatch(*args, **kwargs):  # keyword arguments as the node has them (a packed attention's seq_start)
        tokens = args[argument].shape[dim]
        for last, op in run_ends[:-1]:
            if tokens <= last:
                return op(*args, **kwargs)
        return run_ends[-1][1](*args, **kwargs)

    # The name graphs and profiles show, e.g. rms_norm_by_tokens__1_16_triton__32_2048_torch.
    dispatch.__name__ = dispatch.__qualname__ = f"{op_name}_by_tokens__" + "__".join(f"{a}_{b}_{n}" for a, b, n in runs)
    dispatch.backends = tuple(table.values())  # what it may call (the compile stage checks them)
    dispatch.by_token_bucket = {
        "op": op_name,
        "buckets": {str(bucket): backend.name for bucket, backend in sorted(table.items())},
        "position": list(position),
    }
    return dispatch


def describe_dispatch(target: Any) -> dict[str, Any] | None:
    """``{"op", "buckets": {bucket: backend name}, "position": [argument, dim]}`` of a token dispatch, else None."""
    return getattr(target, "by_token_bucket", None)


def dispatch_from_description(description: dict[str, Any]) -> Callable[..., Any]:
    """The token dispatch ``describe_dispatch`` described; ``ValueError`` naming what is not registered."""
    op_name = description["op"]
    if op_name not in canonical_ops():
        raise ValueError(f"no canonical op is named {op_name!r}")
    by_name = {backend.name: backend for backend in candidates(op_name)}
    missing = sorted({name for name in description["buckets"].values() if name not in by_name})
    if missing:
        raise ValueError(f"{op_name} has no backend {', '.join(missing)} in this process (registered: {', '.join(by_name)})")
    table = {int(bucket): by_name[name] for bucket, name in description["buckets"].items()}
    argument, dim = description["position"]
    return token_dispatch(op_name, table, (int(argument), int(dim)))
