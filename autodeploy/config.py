"""Deployment settings: OmegaConf, merged with a fixed precedence and validated when loaded.

Precedence (later wins): dataclass defaults < ``configs/default.yaml`` < the files named by the
``AUTODEPLOY_CONFIG`` environment variable (``os.pathsep``-separated: site-wide settings, e.g. a
smaller KV pool on a shared GPU) < user YAML files (in order) < Python keyword overrides < CLI
``--set key=value``. Every ``transforms.<name>`` entry is
checked against that transform's config dataclass: unknown names, unknown keys and wrong types
are ``ConfigError``s that say what to fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from autodeploy.custom_ops.parallel_state import RULE_KINDS
from autodeploy.errors import ConfigError, error_summary
from autodeploy.transforms.registry import STAGES, TransformConfig, registered_transforms

DEVICES = ("auto", "cpu", "cuda", "meta")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTS = ("checkpoint", "random")


@dataclass
class KVCacheSettings:
    """The paged KV cache. Its size: ``num_blocks`` if set; else on GPU ``memory_fraction`` of the memory
    left after the weights and a warm-up forward's activations; on CPU ``cpu_bytes``. Never more than
    ``max_batch_size`` sequences of ``max_seq_len`` tokens need (plus what the prefix cache can use on GPU)."""

    block_size: int = 16  # tokens per block
    memory_fraction: float = 0.9
    cpu_bytes: int = 1 << 30
    num_blocks: Optional[int] = None
    prefix_caching: bool = True


@dataclass
class DistributedSettings:
    """A deployment over several processes, one per rank (``torchrun``'s environment: RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or spawned by ``autodeploy()`` on one machine. The world is
    ``pipeline_parallel`` stages of ``max(tensor_parallel, expert_parallel)`` ranks (``custom_ops/parallel_state.py``).
    ``tensor_parallel``: the ranks each attention and MLP is sliced over (``transforms/shard_tensor_parallel.py``);
    ``expert_parallel``: the ranks a MoE layer's experts are placed over; ``pipeline_parallel``: the stages the
    layers are cut into; ``backend``: ``torch.distributed``'s (``auto``: NCCL on GPUs, gloo on CPUs; any backend
    the PyTorch build has, e.g. ``mpi``); ``timeout_s``: how long a collective waits for the other ranks before
    it fails."""

    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    backend: str = "auto"
    timeout_s: float = 600.0
    # Which ranks hold which experts under expert_parallel (transforms/shard_expert_parallel.py): contiguous
    # (rank r: experts r·E/N …), or balanced: placed by the routing measured on the calibration text.
    expert_placement: str = "contiguous"
    # Globs over linear layers' module paths (``model.layers.*.self_attn.o_proj``, ``lm_head``) → colwise, rowwise
    # or replicate, overriding what tensor parallelism detects for them (first matching glob wins).
    rules: Dict[str, str] = field(default_factory=dict)
    # Under pipeline_parallel (runtime/pipeline_schedule.py): each engine step's chunks in this many micro-batches;
    # async: stage s computes micro-batch m+1 while stage s+1 computes m (GPipe; at most pipeline_depth micro-batches
    # in flight, None: all); sync: one micro-batch at a time through the whole pipe.
    pipeline_micro_batches: int = 1
    pipeline_schedule: str = "async"
    pipeline_depth: Optional[int] = None


@dataclass
class SchedulerSettings:
    """In-flight batching: at most ``max_num_tokens`` new tokens per forward (prompts longer than that
    are prefilled in chunks when ``chunked_prefill``); ``max_batch_size`` caps the sequences. With
    ``overlap``, the host plans and launches step N+1 while the device computes step N (the tokens
    step N samples stay on the device and feed step N+1); off, every step waits for its own tokens. ``None``
    (the default) overlaps on GPUs only: on a CPU the host computes the forward itself, so there is nothing
    to overlap, and running ahead would only hold each token back by one step (measured: a CPU batch-8
    TTFT of 333 against HF eager's 297 ms, one decode step behind)."""

    max_num_tokens: int = 2048
    chunked_prefill: bool = True
    overlap: Optional[bool] = None


@dataclass
class VerifySettings:
    """Build-time verification (``autodeploy/verification.py``): a reduced twin of the model, deployed through
    the same pipeline, must match Hugging Face eager within ``tolerance[dtype]`` (max |Δlogit| / max |logit|)."""

    enabled: bool = True
    tolerance: Dict[str, float] = field(default_factory=lambda: {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2})
    # When layers quantize their activations (fp8, smoothquant), at least this, and at least twice the effect rounding
    # the activations has on the reference: per-token scales follow each token's max |x|, so a last-bit
    # difference upstream moves a token's whole rounding grid.
    quantized_activations_tolerance: float = 1e-1


@dataclass
class AutotunerSettings:
    """The autotuner (``autotuner/``): where several backends support a node, time them per token-count
    bucket on the deploy's device and keep the fastest; decisions persist in ``cache_dir`` (default
    ``$XDG_CACHE_HOME/autodeploy/autotuner``, i.e. ``~/.cache/…``) and later builds reuse them."""

    enabled: bool = True
    cache_dir: Optional[str] = None
    warmup: int = 3  # untimed calls per candidate and bucket
    repeats: int = 15  # timed calls; the median counts


COMPILE_BACKENDS = ("none", "cuda_graph", "torch_compile", "torch_compile_cuda_graph")


@dataclass
class CompileSettings:
    """The compile stage (``transforms/compile_model.py``). ``cuda_graph``: on a GPU, the runtime captures the
    decode step once per batch size in ``batch_sizes`` (default: 1, 2, 4, 8, then steps of 16 and 32 up to
    ``max_batch_size``) and replays it, a batch padded up to the next captured size; prefill and mixed
    steps run as piecewise graphs (all but attention) captured per token count of ``prefill_token_sizes``
    (default: powers of two from 16 to ``scheduler.max_num_tokens``; ``[]``: eager), and everything on the
    CPU runs eagerly. ``torch_compile``: the graph runs under
    ``torch.compile`` (Inductor; our ops opaque to it), on any device. ``torch_compile_cuda_graph``: both,
    the captured decode steps replaying the compiled graph. ``none``: always eager."""

    backend: str = "cuda_graph"
    batch_sizes: Optional[List[int]] = None
    prefill_token_sizes: Optional[List[int]] = None  # cuda_graph: piecewise prefill graphs; [] turns them off
    # cuda_graph: an encoder–decoder's encoder pass captured for the first N shapes (requests × input length) it runs,
    # replayed after; 0: eager (runtime/encoder_pass.py). Opt-in until the device measures it (notes/encoder_decoder.md).
    encoder_graphs: int = 0


@dataclass
class CalibrationSettings:
    """The text the calibrated schemes (``int4_awq``, ``int4_gptq``) calibrate on (``transforms/calibration.py``):
    ``builtin`` (Python standard-library modules) or a text / JSONL file; ``samples`` windows of ``seq_len`` tokens."""

    dataset: str = "builtin"
    samples: int = 128
    seq_len: int = 512


@dataclass
class QuantizeSettings:
    """The quantize stage (``transforms/quantize_linear.py``): ``default`` is the scheme of every projection no
    rule in ``layers`` names (globs over module paths, first match wins). Schemes: ``int8_wo``,
    ``int4_wo`` (groups of ``int4_group_size`` inputs), ``int4_awq`` (the same, activation-aware, from
    ``calibration``), ``int4_gptq`` (the same layout, GPTQ rounding from ``calibration``), ``fp8`` (weight scales per output ``channel`` or per
    ``tensor``: ``fp8_weight_scale``; activations with a scale per token, or one per layer from ``calibration``:
    ``fp8_activations``), ``smoothquant`` (W8A8: int8 weights and
    activations, ``smoothquant_alpha`` of the activations' range moved into the weights, from ``calibration``),
    ``none`` (the model's dtype). MoE experts follow ``experts`` alone (``int8_wo``, ``int4_wo`` or ``none``),
    whatever the dense layers take. ``embedding: int8`` stores the token embedding table in int8 with a scale
    per row (a table tied to the LM head: once for both, when the head is ``int8_wo``). ``kv_cache: fp8`` stores the paged KV cache in float8_e4m3fn (the cache
    stage reads it)."""

    default: str = "none"
    layers: Dict[str, str] = field(default_factory=dict)
    int4_group_size: int = 128
    fp8_weight_scale: str = "channel"
    fp8_activations: str = "dynamic"
    smoothquant_alpha: float = 0.5
    experts: str = "none"
    embedding: str = "none"
    kv_cache: str = "none"
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)


@dataclass
class SpeculativeSettings:
    """Speculative decoding (``docs/speculative.md``): each decode step a drafter proposes up to ``num_tokens``
    tokens per sequence and the model scores them all in one forward, keeping the longest prefix it would have
    produced itself and one token of its own after it. ``method``: ``ngram`` (prompt lookup: the tokens that followed
    the latest earlier occurrence of the sequence's last ``ngram_max`` … ``ngram_min`` tokens), ``draft`` (a smaller
    model, ``model``, with the same tokenizer, deployed through the same pipeline with its own KV cache), ``eagle3``
    (an EAGLE-3 head, ``model``, drafting from the model's own hidden states), ``mtp`` (the checkpoint's own
    multi-token-prediction layer), or a name given to ``register_drafter``; ``None`` decodes one token a step. ``options``: a registered drafter's own settings.
    ``auto``: time decode and verification steps at set-up and, each step, draft only as many tokens as the
    sequences' acceptance so far makes worth it (none where drafting would be slower); off, every step drafts
    ``num_tokens``. ``tree_width`` (``eagle3``, ``mtp``, drafters that return a ``DraftTree``): > 1 drafts a tree,
    the head's next ``tree_width - 1`` likeliest tokens beside each chain token, all verified in one forward under
    a tree attention mask (``num_tokens × tree_width`` rows a sequence)."""

    method: Optional[str] = None
    num_tokens: int = 4
    tree_width: int = 1
    auto: bool = True
    model: Optional[str] = None
    ngram_min: int = 1
    ngram_max: int = 4
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class VisionSettings:
    """Vision-language models (``docs/multimodal.md``). ``max_images_per_batch``: images the vision graph encodes
    in one forward (a step's images beyond it are encoded in further forwards; on a GPU, CUDA graphs are captured
    for 1, 2, 4, … up to it). ``max_images_per_request``: images one prompt may carry. ``encoder_cache_mb``: the
    encoder cache's budget — the vision graph's output per image, kept by a hash of the decoded pixels and the
    preprocessing settings so an image seen again is not encoded again (0: off). ``preprocess_workers``: threads
    that decode and preprocess images off the engine's thread. ``max_image_pixels`` / ``max_image_bytes``:
    larger images are refused before they are decoded (decompression bombs). ``allowed_local_dir``: the folder the
    server may read local image files from (``file://`` and paths; unset: none); the Python API reads any path.
    ``fetch_timeout_s``: the time limit of an ``http(s)`` image fetch."""

    max_images_per_batch: int = 16
    max_images_per_request: int = 8
    encoder_cache_mb: float = 256.0
    preprocess_workers: int = 4
    max_image_pixels: int = 40_000_000
    max_image_bytes: int = 20 * 2**20
    allowed_local_dir: Optional[str] = None
    fetch_timeout_s: float = 10.0


MAX_SPECULATIVE_TOKENS = 32  # drafted tokens a sequence may carry into one step
MAX_TREE_NODES = 62  # drafted tokens of a tree: with the newest token, the bits of cached_attention's tree_mask


@dataclass
class AutoSettings:
    """Bolder automatic choices, each opt-in (``docs/planning.md``): the planner (``planning/planner.py``) sets
    ``max_batch_size`` (``batch``), ``scheduler.max_num_tokens`` (``token_budget``) and
    ``distributed.tensor_parallel`` (``tensor_parallel``: at most the GPUs this process sees) for ``concurrency``
    sequences of ``max_seq_len`` tokens on this device. (``quantize.default: auto`` is the quantization's switch.)"""

    batch: bool = False
    token_budget: bool = False
    tensor_parallel: bool = False
    concurrency: int = 32


@dataclass
class DeploySettings:
    """Top-level settings. ``auto`` values are resolved from the model and hardware (see auto_settings)."""

    model: Optional[str] = None
    weights: str = "checkpoint"  # "checkpoint" | "random" (benchmark without a checkpoint)
    tokenizer: Optional[str] = None  # default: the checkpoint's own
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N" | "meta"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_seq_len: Optional[int] = None  # default: the model's max_position_embeddings
    max_batch_size: int = 32
    seed: int = 0
    trust_remote_code: bool = False
    # Kernel preferences per canonical op, read by the select stage: {linear: [torch], cached_attention:
    # [triton, sdpa]}, or per node (globs over module paths / node names, first match wins):
    # {rms_norm: {"*.layers.0.*": [reference], "*": [triton, torch]}}.
    backends: Dict[str, Any] = field(default_factory=dict)
    # Every token's result independent of the rest of its step (custom_ops/batch_invariant.py): greedy output the
    # same with and without speculation, alone or in any batch, in bfloat16 too; slower kernels, GPUs only. The
    # select stage takes the batch-invariant backend of every op and refuses ops that have none.
    batch_invariant: bool = False
    autotuner: AutotunerSettings = field(default_factory=AutotunerSettings)
    compile: CompileSettings = field(default_factory=CompileSettings)
    dump_graphs: Optional[str] = None  # folder: write the graph after every transform
    kv_cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    verify: VerifySettings = field(default_factory=VerifySettings)
    quantize: QuantizeSettings = field(default_factory=QuantizeSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    vision: VisionSettings = field(default_factory=VisionSettings)
    auto: AutoSettings = field(default_factory=AutoSettings)
    transforms: Dict[str, Any] = field(default_factory=dict)


def default_yaml_path() -> Path:
    return Path(str(resources.files("autodeploy.configs").joinpath("default.yaml")))


def load_yaml(path: str | Path) -> DictConfig:
    """One YAML settings file as a config; ``ConfigError`` for a missing file, bad YAML or a bad shape."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML pipeline config")
    try:
        loaded = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError and OmegaConf errors alike
        raise ConfigError(f"config file {path} is not valid YAML: {error_summary(error)}") from error
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of settings, got a {type(loaded).__name__}")
    transforms = loaded.get("transforms")
    if transforms is not None and not isinstance(transforms, DictConfig):
        raise ConfigError(
            f"config file {path}: transforms must be a mapping of transform name → options, got a {type(transforms).__name__}"
        )
    return loaded


def parse_set_arguments(assignments: Iterable[str]) -> DictConfig:
    """``["transforms.cleanup_noop.enabled=false", "max_batch_size=8"]`` → a config."""
    assignments = list(assignments)
    for assignment in assignments:
        key, sep, _ = assignment.partition("=")
        if not sep or not key.strip() or " " in key.strip():
            raise ConfigError(f"--set expects key=value (e.g. --set transforms.cleanup_noop.enabled=false), got {assignment!r}")
    try:
        return OmegaConf.from_dotlist(assignments)
    except OmegaConfBaseException as error:
        raise ConfigError(f"--set could not parse {assignments}: {str(error).splitlines()[0]}") from error


def _unknown_key_message(error: OmegaConfBaseException, where: str, options: Iterable[str]) -> str:
    """Name the offending key; suggest a close match only for keys that do not exist."""
    options = list(options)
    key = getattr(error, "key", None) or ""
    text = str(error).splitlines()[0]
    if key in options:  # a known key with a value of the wrong type
        return f"{where}.{key}: {text}"
    if "did you mean" in str(error).lower():  # OmegaConf already suggested one
        return f"{where}: {' '.join(str(error).split())}"
    close = difflib.get_close_matches(str(key), list(options), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(options))}"
    return f"{where}: {text}{hint}"


# Modules whose import registers the built-in transforms (the graph passes register with autodeploy.transforms).
BUILT_IN_TRANSFORM_MODULES = ("autodeploy.transforms", "autodeploy.export")


def register_built_in_transforms() -> None:
    """Import every module that registers a built-in transform (idempotent; the package loads them lazily)."""
    for module in BUILT_IN_TRANSFORM_MODULES:
        importlib.import_module(module)


def validate_transform_entry(name: str, entry: Any) -> TransformConfig:
    """Check one ``transforms.<name>`` mapping against the transform's config dataclass."""
    register_built_in_transforms()
    registry = registered_transforms()
    if name not in registry:
        close = difflib.get_close_matches(name, list(registry), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"registered transforms: {', '.join(sorted(registry))}"
        raise ConfigError(f"unknown transform {name!r} in config; {hint} (register your own with @register_transform)")
    config_class = registry[name].config_class
    if entry is None:
        entry = {}
    if not isinstance(entry, (Mapping, DictConfig)):
        raise ConfigError(f"transforms.{name} must be a mapping of options, got {entry!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(config_class), entry)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        fields = [f.name for f in dataclasses.fields(config_class)]
        raise ConfigError(_unknown_key_message(error, f"transforms.{name}", fields)) from error
    if config.stage is None:
        return dataclasses.replace(config, stage=registry[name].stage)
    if config.stage not in STAGES:
        raise ConfigError(f"transforms.{name}.stage is {config.stage!r}; stages are {', '.join(STAGES)}")
    return config


SITE_CONFIG_VARIABLE = "AUTODEPLOY_CONFIG"


def site_config_files() -> list[str]:
    """The YAML files named by ``AUTODEPLOY_CONFIG``, in order."""
    return [path for path in os.environ.get(SITE_CONFIG_VARIABLE, "").split(os.pathsep) if path]


def load_settings(
    config_files: Iterable[str | Path] = (),
    overrides: Mapping[str, Any] | None = None,
    set_arguments: Iterable[str] = (),
    base: DictConfig | None = None,
) -> DictConfig:
    """Merge and validate settings. Returns a DictConfig whose ``transforms`` are validated mappings.
    ``base`` takes the place of ``configs/default.yaml`` (a saved deployment's settings, reloaded).

    >>> settings = load_settings(set_arguments=["max_batch_size=4"])
    >>> settings.max_batch_size
    4
    """
    layers = [load_yaml(default_yaml_path()) if base is None else base]
    layers += [load_yaml(path) for path in site_config_files()]
    layers += [load_yaml(path) for path in config_files]
    if overrides:
        try:
            layers.append(OmegaConf.create(dict(overrides)))
        except OmegaConfBaseException as error:
            raise ConfigError(f"invalid keyword override: {str(error).splitlines()[0]}") from error
    layers.append(parse_set_arguments(set_arguments))
    try:
        settings = OmegaConf.merge(OmegaConf.structured(DeploySettings), *layers)
    except TypeError as error:  # OmegaConf: "Cannot merge incompatible container types"
        raise ConfigError(f"settings have the wrong structure: {error}; transforms must be a mapping of name → options") from error
    except OmegaConfBaseException as error:
        fields = [f.name for f in dataclasses.fields(DeploySettings)]
        raise ConfigError(_unknown_key_message(error, "settings", fields)) from error
    _check_choices(settings)
    for name, entry in settings.transforms.items():
        validate_transform_entry(name, entry)
    return settings


def _check_choices(settings: DictConfig) -> None:
    device = settings.device
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ConfigError(f"device is {device!r}; use one of {', '.join(DEVICES)} or cuda:N")
    if settings.dtype not in DTYPES:
        raise ConfigError(f"dtype is {settings.dtype!r}; use one of {', '.join(DTYPES)}")
    if settings.weights not in WEIGHTS:
        raise ConfigError(f"weights is {settings.weights!r}; use one of {', '.join(WEIGHTS)}")
    if settings.max_batch_size < 1:
        raise ConfigError(f"max_batch_size must be ≥ 1, got {settings.max_batch_size}")
    if settings.max_seq_len is not None and settings.max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be ≥ 1, got {settings.max_seq_len}")
    kv = settings.kv_cache
    if kv.block_size < 1 or kv.block_size & (kv.block_size - 1):
        raise ConfigError(f"kv_cache.block_size must be a power of two (e.g. 16), got {kv.block_size}")
    if not 0 < kv.memory_fraction <= 1:
        raise ConfigError(f"kv_cache.memory_fraction must be in (0, 1], got {kv.memory_fraction}")
    if kv.cpu_bytes < 1 or (kv.num_blocks is not None and kv.num_blocks < 1):
        raise ConfigError(f"kv_cache.cpu_bytes and kv_cache.num_blocks must be ≥ 1, got {kv.cpu_bytes} and {kv.num_blocks}")
    missing = [dtype for dtype in DTYPES if dtype != "auto" and dtype not in settings.verify.tolerance]
    if missing or any(not value > 0 for value in settings.verify.tolerance.values()):
        raise ConfigError(f"verify.tolerance needs a value > 0 for each of float32, bfloat16, float16; got {dict(settings.verify.tolerance)}")
    if settings.compile.backend not in COMPILE_BACKENDS:
        raise ConfigError(f"compile.backend is {settings.compile.backend!r}; use one of {', '.join(COMPILE_BACKENDS)}")
    sizes = settings.compile.batch_sizes
    if sizes is not None and (not sizes or any(size < 1 for size in sizes)):
        raise ConfigError(f"compile.batch_sizes must list batch sizes ≥ 1 (or be null for the default), got {list(sizes)}")
    encoder_graphs = settings.compile.encoder_graphs
    if isinstance(encoder_graphs, bool) or not isinstance(encoder_graphs, int) or encoder_graphs < 0:
        raise ConfigError(f"compile.encoder_graphs must be a count ≥ 0 of encoder shapes to capture (0: eager), got {encoder_graphs!r}")
    token_sizes = settings.compile.prefill_token_sizes
    if token_sizes is not None and any(size < 1 for size in token_sizes):
        raise ConfigError(f"compile.prefill_token_sizes must list token counts ≥ 1 ([] for none, null for the default), got {list(token_sizes)}")
    if settings.scheduler.max_num_tokens < 1:
        raise ConfigError(f"scheduler.max_num_tokens must be ≥ 1, got {settings.scheduler.max_num_tokens}")
    distributed = settings.distributed
    sizes = {name: distributed[name] for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel")}
    if any(size < 1 for size in sizes.values()) or distributed.timeout_s <= 0:
        raise ConfigError(f"distributed.tensor_parallel, expert_parallel and pipeline_parallel must be ≥ 1 and "
                          f"distributed.timeout_s > 0, got {sizes} and {distributed.timeout_s}")
    stage = max(distributed.tensor_parallel, distributed.expert_parallel)
    if distributed.tensor_parallel not in (1, stage) or distributed.expert_parallel not in (1, stage):
        raise ConfigError(f"distributed.tensor_parallel={distributed.tensor_parallel} and expert_parallel="
                          f"{distributed.expert_parallel}: a pipeline stage's ranks serve both, so each must be 1 or "
                          f"the other's value (e.g. tensor_parallel=2 with expert_parallel=2 or 1)")
    if distributed.pipeline_micro_batches < 1 or distributed.pipeline_schedule not in ("sync", "async") or (
            distributed.pipeline_depth is not None and distributed.pipeline_depth < 1):
        raise ConfigError(f"distributed.pipeline_micro_batches must be ≥ 1, pipeline_schedule sync or async and "
                          f"pipeline_depth ≥ 1 or null, got {distributed.pipeline_micro_batches}, "
                          f"{distributed.pipeline_schedule!r} and {distributed.pipeline_depth}")
    if distributed.expert_placement not in ("contiguous", "balanced"):
        raise ConfigError(f"distributed.expert_placement must be contiguous or balanced, got {distributed.expert_placement!r}")
    _check_speculative(settings.speculative)
    vision = settings.vision
    if min(vision.max_images_per_batch, vision.max_images_per_request, vision.preprocess_workers, vision.max_image_pixels,
           vision.max_image_bytes) < 1 or vision.encoder_cache_mb < 0 or not vision.fetch_timeout_s > 0:
        raise ConfigError(f"vision.max_images_per_batch, max_images_per_request, preprocess_workers, max_image_pixels and "
                          f"max_image_bytes must be ≥ 1, encoder_cache_mb ≥ 0 and fetch_timeout_s > 0; got "
                          f"{OmegaConf.to_container(vision)}")
    unknown = {glob: kind for glob, kind in distributed.rules.items() if kind not in RULE_KINDS}
    if unknown:
        raise ConfigError(f"distributed.rules {unknown}: each rule's kind must be one of {', '.join(RULE_KINDS)}")


def _check_speculative(speculative: DictConfig) -> None:
    """The shape of the ``speculative`` section; which methods exist is the runtime's drafter registry's to say
    (``runtime/speculative.py``), checked when the deployment is built."""
    if speculative.method is None:
        return
    if not 1 <= speculative.num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"speculative.num_tokens must be in 1 … {MAX_SPECULATIVE_TOKENS} (tokens drafted per step), "
                          f"got {speculative.num_tokens}")
    if speculative.tree_width < 1 or speculative.num_tokens * speculative.tree_width > MAX_TREE_NODES:
        raise ConfigError(f"speculative.tree_width must be ≥ 1 (1: a chain) with num_tokens × tree_width ≤ {MAX_TREE_NODES} "
                          f"(drafted tokens a tree verifies), got tree_width {speculative.tree_width} with num_tokens "
                          f"{speculative.num_tokens}")
    if speculative.tree_width > 1 and speculative.method in ("ngram", "draft"):
        raise ConfigError(f"speculative.tree_width > 1 drafts trees, which come from heads (eagle3, mtp) and drafters that "
                          f"return a DraftTree; {speculative.method!r} drafts chains: set speculative.tree_width=1")
    if not 1 <= speculative.ngram_min <= speculative.ngram_max:
        raise ConfigError(f"speculative.ngram_min and ngram_max must satisfy 1 ≤ ngram_min ≤ ngram_max, got "
                          f"{speculative.ngram_min} and {speculative.ngram_max}")
    if speculative.method == "eagle3" and not speculative.model:
        raise ConfigError("speculative.method is 'eagle3' but speculative.model is not set: name the EAGLE-3 head's folder "
                          "(config.json and model.safetensors, trained for this model), e.g. speculative.model=path/to/head")
    if speculative.method == "draft" and not speculative.model:
        raise ConfigError("speculative.method is 'draft' but speculative.model is not set: name the draft checkpoint "
                          "(a smaller model with the same tokenizer), e.g. speculative.model=path/to/draft")


def transform_configs(settings: DictConfig) -> dict[str, TransformConfig]:
    """The validated config dataclass of every transform named in the settings, in YAML order."""
    return {name: validate_transform_entry(name, entry) for name, entry in settings.transforms.items()}


def settings_to_yaml(settings: DictConfig) -> str:
    return OmegaConf.to_yaml(settings)
