"""The settings a reloaded deployment serves with: the saved ones, overridden only where the graph does not depend on them.

Overrides go through the same loader as a build's (config files, keyword overrides, ``--set``; the site
files of ``AUTODEPLOY_CONFIG`` too), over the saved settings instead of ``configs/default.yaml``. Only the
runtime reads the keys in ``RELOADABLE`` (batch and sequence limits, the KV pool, the scheduler, the seed,
the tokenizer, speculative decoding), so those may change on a reload; ``max_seq_len`` may shrink, not grow past what the build
checked against the model. Everything else (dtype, device, weights, transforms, backends, compile,
autotuner, verify) shaped the saved graph, so a change is a ``ConfigError`` that says how to rebuild;
``auto`` for device or dtype means the saved value.

    settings = reload_settings(saved, set_arguments=["max_batch_size=4"], rebuild_hint="autodeploy build m --out d")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from autodeploy.config import load_settings
from autodeploy.errors import ConfigError

RELOADABLE = frozenset({
    "max_batch_size", "max_seq_len", "seed", "tokenizer",
    "kv_cache.memory_fraction", "kv_cache.cpu_bytes", "kv_cache.num_blocks", "kv_cache.prefix_caching",
    "scheduler.max_num_tokens", "scheduler.chunked_prefill",
})
RELOADABLE_SECTIONS = ("speculative.",)  # speculative decoding drafts beside the graph: a reload may turn it on


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {key: leaf for name, item in value.items() for key, leaf in _flat(item, f"{prefix}{name}.").items()}
    return {prefix.removesuffix("."): value}


def reload_settings(
    saved: DictConfig,
    config_files: Iterable[str | Path] = (),
    overrides: Mapping[str, Any] | None = None,
    set_arguments: Iterable[str] = (),
    rebuild_hint: str = "",
) -> DictConfig:
    """``saved`` with the overrides merged in; ``ConfigError`` for an override the saved graph cannot honour."""
    # The saved transforms ran at build; only those an override names must be registered (and validated) here.
    untransformed = OmegaConf.masked_copy(saved, [key for key in saved if key != "transforms"])
    merged = load_settings(config_files, overrides, set_arguments, base=untransformed)
    merged.transforms = OmegaConf.merge(saved.transforms, merged.transforms)
    for key in ("device", "dtype"):
        if merged[key] == "auto":
            merged[key] = saved[key]
    before, after = _flat(OmegaConf.to_container(saved, resolve=True)), _flat(OmegaConf.to_container(merged, resolve=True))
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    refused = [key for key in changed if key not in RELOADABLE and not key.startswith(RELOADABLE_SECTIONS)]
    if refused:
        shown = ", ".join(f"{key}={after.get(key)!r} (saved: {repr(before[key]) if key in before else 'not set'})" for key in refused)
        raise ConfigError(
            f"{shown}: the saved graph was built with {'this setting' if len(refused) == 1 else 'these settings'}, so a "
            f"reload cannot change {'it' if len(refused) == 1 else 'them'}; rebuild with the new value ({rebuild_hint} "
            f"--set …) or drop the override. A reload may change {', '.join(sorted(RELOADABLE))}"
        )
    if merged.max_seq_len > saved.max_seq_len:
        raise ConfigError(
            f"max_seq_len={merged.max_seq_len} exceeds the saved deployment's {saved.max_seq_len}, the most its build "
            f"checked against the model; rebuild for longer sequences ({rebuild_hint} --set max_seq_len=…)"
        )
    return merged
