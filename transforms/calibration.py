"""Calibration for activation-aware quantization (AWQ), GPTQ, SmoothQuant, static fp8 activation scales and
fp8 KV cache scales: statistics of each projection's input (and of the key and value projections' outputs).

The ``quantize`` settings' ``calibration`` names the text (``builtin``: Python standard-library modules
that ship with every interpreter, or a path to a text or JSONL file of ``{"text": …}`` lines), how many
windows of how many tokens to run (``samples`` × ``seq_len``). What runs is the partially transformed
graph: the canonical graph as the ``quantize`` stage found it (after ``match``), with the checkpoint's
weights in the deploy's dtype, one window at a time, on the deploy's GPU when it has one (else on the
CPU); so the statistics are those of the ops the deploy runs. For each projection that asks for statistics
(a canonical ``linear``, or a projection inside ``gated_mlp`` / ``mlp``) it accumulates ``mean |x|``,
``mean x²`` and ``max |x|`` of its input over every token, in float32 (beside its weights' ``max |w|`` per
input, ``weight_max_abs``), and for GPTQ its Hessian ``E[x xᵀ]`` (``K × K`` float32: 0.8 GB for a
14,336-wide input).
Statistics of up to ``CACHE_LIMIT_BYTES`` (1 GiB) are cached on disk
(``$XDG_CACHE_HOME/autodeploy/calibration``), keyed by the checkpoint, the text and the window sizes, so
a second build does not run the model again; larger ones (a large model's Hessians) are recomputed.

```python
from autodeploy.transforms.calibration import calibration_windows
windows = calibration_windows(tokenizer, "builtin", samples=4, seq_len=64)   # 4 lists of 64 token ids
```
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx, nn

from autodeploy.custom_ops.activations import activation_fn
from autodeploy.errors import ConfigError
from autodeploy.transforms.quantize_linear import module_path, uncalibrated_random_weights

logger = logging.getLogger(__name__)

# Held out: json/ (the accuracy workload's perplexity text in README) is not among these.
_STATISTICS_VERSION = 4  # 2: max_abs (smoothquant); 3: weight_max_abs; 4: from the canonical graph; part of the cache key
CACHE_LIMIT_BYTES = 1 << 30  # statistics past this (GPTQ's Hessians of a large model) are recomputed, not cached
_BUILTIN_MODULES = ("argparse.py", "textwrap.py", "difflib.py", "dataclasses.py", "inspect.py", "typing.py",
                    "pathlib.py", "csv.py", "functools.py", "collections/__init__.py", "enum.py", "shutil.py")


def _builtin_text() -> str:
    library = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((library / name).read_text(encoding="utf-8") for name in _BUILTIN_MODULES if (library / name).is_file())


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"quantize.calibration.dataset: {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} "
                          f"at offset {error.start}); convert it to UTF-8 (iconv -t UTF-8) or name another file") from None


def calibration_text(dataset: str) -> str:
    """The calibration text: ``builtin`` or a UTF-8 text / JSONL file (one ``{"text": …}`` object a line)."""
    if dataset == "builtin":
        return _builtin_text()
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"quantize.calibration.dataset: {dataset!r} is neither 'builtin' nor a readable file")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(_read_utf8(path).splitlines(), 1):
            if line.strip():
                try:
                    texts.append(str(json.loads(line)["text"]))
                except (ValueError, KeyError, TypeError) as error:
                    raise ConfigError(f"{path}:{number}: a calibration line must be a JSON object with a \"text\" "
                                      f"field ({type(error).__name__})") from error
        return "\n\n".join(texts)
    return _read_utf8(path)


def calibration_windows(tokenizer, dataset: str, samples: int, seq_len: int) -> list[list[int]]:
    """``samples`` consecutive windows of ``seq_len`` token ids from the calibration text; a text shorter
    than that is a ``ConfigError`` saying how many tokens it has."""
    if samples < 1 or seq_len < 1:
        raise ConfigError(f"quantize.calibration needs samples ≥ 1 and seq_len ≥ 1; got {samples} and {seq_len}")
    if tokenizer is None:
        raise ConfigError("calibration needs the checkpoint's tokenizer, and it has none; pass tokenizer=…")
    ids = tokenizer(calibration_text(dataset), add_special_tokens=False).input_ids
    if len(ids) < samples * seq_len:
        raise ConfigError(
            f"the calibration set {dataset!r} has {len(ids)} tokens, fewer than samples × seq_len = "
            f"{samples} × {seq_len}; lower quantize.calibration.samples or seq_len, or give a longer text"
        )
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(samples)]


def _cache_file(identity: str, dataset: str, samples: int, seq_len: int, modules: list[str]) -> Path:
    text = calibration_text(dataset)
    key = hashlib.sha256(json.dumps([identity, hashlib.sha256(text.encode()).hexdigest(), samples, seq_len, modules,
                                     _STATISTICS_VERSION]).encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autodeploy" / "calibration"
    return root / f"{key.hexdigest()[:32]}.pt"


class _Statistics:
    """Sums of each watched projection's input (and output) over every calibration token."""

    def __init__(self, hessian_modules):
        self.hessian_modules = set(hessian_modules)
        self.sums: dict[str, dict[str, torch.Tensor]] = {}
        self.counts: dict[str, int] = {}

    def weights(self, name: str, weight: torch.Tensor) -> None:
        """smoothquant's ``max_n |w_nk|`` of a ``[N, K]`` weight (shared over one input's projections: share_smoothing)."""
        self.sums.setdefault(name, {})["weight_max_abs"] = weight.detach().to(torch.float32).abs().amax(0)

    def inputs(self, name: str, value: torch.Tensor) -> None:
        x = value.detach().to(torch.float32).reshape(-1, value.shape[-1])
        # Sums stay on the model's device (no host sync a call); Hessians, K × K each, on the host.
        entry = self.sums.setdefault(name, {})
        for key in ("mean_abs", "mean_square", "max_abs"):
            entry.setdefault(key, x.new_zeros(x.shape[1]))
        entry["mean_abs"] += x.abs().sum(0)
        entry["mean_square"] += x.square().sum(0)
        entry["max_abs"] = torch.maximum(entry["max_abs"], x.abs().amax(0))
        if name in self.hessian_modules:
            entry["hessian"] = entry.get("hessian", 0) + (x.T.double() @ x.double()).cpu()
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]

    def outputs(self, name: str, value: torch.Tensor) -> None:
        entry = self.sums.setdefault(name, {})
        largest = value.detach().abs().amax().to(torch.float32).reshape(1)
        entry["output_max_abs"] = torch.maximum(entry.get("output_max_abs", largest), largest)

    def result(self, modules, output_modules) -> dict[str, dict[str, torch.Tensor]]:
        missing = ([name for name in modules if name not in self.counts]
                   + [name for name in output_modules if "output_max_abs" not in self.sums.get(name, {})])
        if missing:
            raise ConfigError(f"calibration: modules {missing[:3]} never ran on the calibration text; they cannot be "
                              f"calibrated: name another scheme for them under quantize.layers")
        means = ("mean_abs", "mean_square", "hessian")
        return {name: {k: (v / self.counts[name] if k in means else v).to(torch.float32).cpu() for k, v in entry.items()}
                for name, entry in self.sums.items()}


def _weight_path(node) -> str | None:
    """The module path of the projection whose weight a get_attr node reads (``model.layers.0.mlp.up_proj``)."""
    return module_path(node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def graph_statistics(graph: fx.GraphModule, windows: list[list[int]], modules: list[str], hessian_modules=(),
                     output_modules=()) -> dict[str, dict[str, torch.Tensor]]:
    """Run the canonical graph (after ``match``, before ``quantize``, with the checkpoint's weights) over
    ``windows`` and return, per projection (module path), ``mean_abs``, ``mean_square`` and ``max_abs`` of its
    input's last dimension and its weights' ``weight_max_abs`` (float32, on the CPU), for ``hessian_modules``
    also ``hessian``: ``E[x xᵀ]``, and for ``output_modules`` ``output_max_abs``: the largest |value| of
    their output (an fp8 KV cache's scale). Projections are the canonical ``linear`` nodes and the
    gate / up / down of ``gated_mlp`` and the up / down of ``mlp``, whose inner input (``act(gate) · up``,
    ``act(up)``) is computed here as the op computes it."""
    linear, gated, plain = (torch.ops.autodeploy.linear.default, torch.ops.autodeploy.gated_mlp.default,
                            torch.ops.autodeploy.mlp.default)
    wanted, outputs = set(modules), set(output_modules)
    statistics = _Statistics(hessian_modules)
    watched: dict[fx.Node, object] = {}

    def weight(node):
        return graph.get_parameter(node.target)

    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target not in (linear, gated, plain):
            continue
        if node.target is linear:
            path = _weight_path(node.args[1])
            if path in wanted or path in outputs:
                watched[node] = ("linear", path)
            if path in wanted:
                statistics.weights(path, weight(node.args[1]))
            continue
        roles = ({"gate": node.args[1], "up": node.args[2], "down": node.args[3]} if node.target is gated
                 else {"up": node.args[1], "down": node.args[3]})
        paths = {role: _weight_path(w) for role, w in roles.items()}
        if any(p in wanted for p in paths.values()):
            watched[node] = ("gated" if node.target is gated else "mlp", paths)
            for role, path in paths.items():
                if path in wanted:
                    statistics.weights(path, weight(roles[role]))

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node not in watched:
                return result
            kind, paths = watched[node]
            args = [self.env[a] if isinstance(a, fx.Node) else a for a in node.args]
            if kind == "linear":
                if paths in wanted:
                    statistics.inputs(paths, args[0])
                if paths in outputs:
                    statistics.outputs(paths, result)
                return result
            x = args[0].to(torch.float32)
            for role in ("gate", "up"):
                if paths.get(role) in wanted:
                    statistics.inputs(paths[role], x)
            if paths["down"] in wanted:
                if kind == "gated":
                    act = activation_fn(args[4])
                    inner = act(F.linear(x, args[1].to(torch.float32))) * F.linear(x, args[2].to(torch.float32))
                else:
                    up_bias = None if args[2] is None else args[2].to(torch.float32)
                    inner = activation_fn(args[5])(F.linear(x, args[1].to(torch.float32), up_bias))
                statistics.inputs(paths["down"], inner)
            return result

    recorder = Recorder(graph)
    device = next(graph.parameters()).device
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([window], device=device)
            recorder.run(ids, torch.arange(len(window), device=device)[None])
    return statistics.result(modules, output_modules)


def calibrate(factory, settings, float_graph, modules: list[str], hessian_modules: list[str] = (),
              output_modules: list[str] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """The input statistics of ``modules`` (module paths; ``hessian_modules`` with their input Hessians too,
    ``output_modules``' largest output) for this model and calibration set, from the cache or by running
    ``float_graph(device)`` once: the canonical graph before ``quantize``, with the checkpoint's weights."""
    calibration = settings.quantize.calibration
    dataset, samples, seq_len = str(calibration.dataset), int(calibration.samples), int(calibration.seq_len)
    if seq_len > int(settings.max_seq_len):
        # Longer windows hold positions the deploy never serves, past what the exported graph may accept.
        raise ConfigError(f"quantize.calibration.seq_len={seq_len} is longer than max_seq_len={settings.max_seq_len} (the "
                          f"longest sequence this deploy takes; the model's max_position_embeddings unless set); set "
                          f"quantize.calibration.seq_len to {settings.max_seq_len} or less")
    if settings.weights == "random" and factory.tensors is None:
        raise uncalibrated_random_weights([])
    cache = None
    if factory.tensors is None:  # a checkpoint folder; a twin's in-memory weights are calibrated afresh
        identity = json.dumps([str(factory.source.directory), _checkpoint_stamp(factory.source.directory)])
        cache = _cache_file(identity, dataset, samples, seq_len, [sorted(modules), sorted(hessian_modules), sorted(output_modules)])
        if cache.is_file():
            return torch.load(cache, weights_only=True)
    tokenizer = factory.load_tokenizer(settings.tokenizer)
    if tokenizer is None and not modules:
        # Only an fp8 KV cache's scales were asked for, and they may stay 1 (the deploy's choice for random weights,
        # the best measured on the demo model): a random-weight deploy's verification twin, a checkpoint
        # without a tokenizer. Weight schemes cannot do without their statistics, so they still fail below.
        logger.info("fp8 KV cache: no tokenizer to calibrate its scales on; they stay 1")
        return {}
    windows = calibration_windows(tokenizer, dataset, samples, seq_len)
    # On the deploy's GPU when it has one: a large model's calibration run is hours of float32 on a CPU.
    device = torch.device(settings.device) if torch.device(settings.device).type == "cuda" else torch.device("cpu")
    graph = float_graph(device)
    logger.info("calibrating %d projections on %d × %d tokens of %s (%s)", len(modules) + len(output_modules), samples, seq_len,
                dataset, device)
    statistics = graph_statistics(graph, windows, modules, hessian_modules, output_modules)
    del graph
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the float model's memory goes back before the deploy's weights load
    size = sum(t.numel() * t.element_size() for entry in statistics.values() for t in entry.values())
    if cache is not None and size <= CACHE_LIMIT_BYTES:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(statistics, cache)
    elif cache is not None:
        logger.info("calibration statistics not cached: %.1f GB is past the %.1f GB limit", size / 1e9, CACHE_LIMIT_BYTES / 1e9)
    return statistics


def _checkpoint_stamp(directory: Path) -> list:
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(directory).glob("*.safetensors"))


def kv_projections(model: nn.Module) -> list[str]:
    """The key and value projections of every attention layer that has them as modules (``…self_attn.k_proj``)."""
    return [name for name, module in model.named_modules()
            if name.rpartition(".")[2] in ("k_proj", "v_proj") and isinstance(module, nn.Linear)]


# A scale keeps the largest calibrated key or value at 448 / 16 or below: four binades of headroom for inputs
# larger than any the calibration saw. It is never below 1: on the demo model, scales that lifted small values
# higher measured no better (perplexity +0.4% against scale 1's +0.05%; notes/quantization.md).
_KV_HEADROOM = 16.0


def kv_cache_scales(statistics: dict, projections: list[str]) -> dict[str, tuple[float, float]]:
    """Per attention module, the fp8 cache scales of its keys and values: 1 (also for projections without
    statistics), or, where the largest calibrated
    value times ``_KV_HEADROOM`` passes 448, that over 448. RoPE rotates keys in pairs, so a rotated key can be
    up to √2 × the larger of its pair: the keys' scale allows for that too."""
    scales: dict[str, dict[str, float]] = {}
    for name in projections:
        if name not in statistics:  # not calibrated (no tokenizer): scale 1
            continue
        attention, _, leaf = name.rpartition(".")
        largest = float(statistics[name]["output_max_abs"]) * (2**0.5 if leaf == "k_proj" else 1.0)
        scales.setdefault(attention, {})[leaf] = max(1.0, largest * _KV_HEADROOM / 448.0)
    return {path: (found.get("k_proj", 1.0), found.get("v_proj", 1.0)) for path, found in scales.items()}
