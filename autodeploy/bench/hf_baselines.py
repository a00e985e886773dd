"""Plain transformers ``generate()`` as a baseline engine, timed token by token in the benchmark's process.

Two engines, named as ``RunResult.engine`` names them:

- ``hf-eager``: ``generate()`` as most users call it (dynamic KV cache, eager PyTorch).
- ``hf-compile``: transformers' own compiled path: a static KV cache, which makes ``generate()`` run its
  decode steps through ``torch.compile(model.__call__, **compile_config)`` (prefill stays eager, so each
  prompt length does not cost a compile). On CUDA the compile uses ``mode="reduce-overhead"`` (CUDA
  graphs); elsewhere ``mode="default"``, since CUDA graphs exist only on CUDA.

```python
model = load_hf_model("configs/models/llama-3-8b", torch.bfloat16, torch.device("cuda"))
timing = hf_generate_timing(model, [[1, 2, 3]] * 8, output_len=128, mode="hf-compile")
ttft = timing.token_times[0] - timing.start
```
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM, CompileConfig,
                          PretrainedConfig, PreTrainedModel)
from transformers.generation.streamers import BaseStreamer

from autodeploy.errors import ConfigError, InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from autodeploy.models.factory import parameters_on_meta
from autodeploy.models.random_weights import random_parameter

logger = logging.getLogger(__name__)

HF_ENGINES = ("hf-eager", "hf-compile")

_WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")


@dataclass
class BatchTiming:
    """One ``generate()`` call over a batch of equal-length prompts."""

    start: float  # clock() just before generate
    token_times: list[float]  # clock() when each decoding step's tokens came out; len == output_len
    input_len: int
    output_len: int
    batch: int
    output_token_ids: list[list[int]]  # per prompt, the generated ids (to check against other engines)


@dataclass
class _CompileState:
    """Kept on a model that ran ``hf-compile``: the one compile config, and which shapes are warmed up."""

    config: CompileConfig
    warmed_shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (batch, input_len, output_len)


_COMPILE_STATE_ATTR = "_autodeploy_hf_compile"


class _TokenTimeStreamer(BaseStreamer):
    """Records the clock at each new token batch ``generate()`` streams out, and the tokens themselves."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.times: list[float] = []
        self.steps: list[list[int]] = []  # steps[i][b]: token of prompt b at decoding step i
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        # generate() puts the prompt first (before prefill), then each step's tokens. It hands over
        # tokens already copied with ``.cpu()``, which waits for the GPU, so no explicit synchronize is needed.
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(self.clock())
        self.steps.append(value.reshape(-1).tolist())

    def end(self) -> None:
        """Nothing to flush: every time was recorded as its tokens arrived."""


def load_hf_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The HF causal LM in ``model_dir`` (sdpa attention, eval mode) on ``device``.

    A folder with only a config.json (``configs/models/llama-3-8b``) gives the same architecture with
    random weights: other values than the real checkpoint, the same cost to run.

    >>> model = load_hf_model("configs/models/llama-3-8b", torch.bfloat16, torch.device("cuda"))  # doctest: +SKIP
    """
    directory = Path(model_dir)
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(f"{directory} has no config.json; pass a Hugging Face checkpoint or config folder")
    has_weights = any(next(directory.glob(pattern), None) for pattern in _WEIGHT_PATTERNS)
    try:
        if has_weights:
            model = _model_class(AutoConfig.from_pretrained(directory)).from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").to(device)
        else:
            model = _random_model(AutoConfig.from_pretrained(directory), dtype, device)
    except (ValueError, KeyError) as error:
        raise UnsupportedModelError(f"transformers cannot build a causal LM from {directory}: {error}") from error
    return model.eval()


def _model_class(config: PretrainedConfig) -> type:
    """A vision-language model's HF class is its image-text-to-text one (its generate takes pixel values); an
    encoder–decoder's, its seq2seq one (its generate takes the encoder's input and writes the decoder's)."""
    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def _random_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The architecture with N(0, initializer_range) matrices, unit norms and zero biases, made on ``device``.

    Parameters start on meta and get their values on the device: random init of billions of weights
    takes seconds there, minutes on the CPU.
    """
    with parameters_on_meta():
        model = _model_class(config).from_config(config, dtype=dtype, attn_implementation="sdpa")
    std = getattr(config, "initializer_range", 0.02)
    materialized: dict[int, nn.Parameter] = {}  # by id of the meta parameter, so tied weights stay one tensor
    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in materialized:
                value = random_parameter(f"{prefix}.{name}", param.shape, std, device).to(dtype)
                materialized[id(param)] = nn.Parameter(value, requires_grad=False)
            module._parameters[name] = materialized[id(param)]
        # Buffers (RoPE frequencies) were computed for real on the CPU while the model was built.
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return model


def hf_generate_timing(
    model: PreTrainedModel,
    prompt_token_ids: list[list[int]],
    output_len: int,
    mode: str,
    clock: Callable[[], float] = time.perf_counter,
    pixel_values: torch.Tensor | None = None,
) -> BatchTiming:
    """Greedy-decode exactly ``output_len`` tokens for each prompt in one ``generate()`` call, timing each step.

    ``pixel_values``: a vision-language model's preprocessed images, in the order of the prompts' placeholders.
    ``mode`` is ``"hf-eager"`` or ``"hf-compile"``; the first ``hf-compile`` call for a shape compiles and
    warms up untimed. EOS cannot end a prompt early (``min_new_tokens``), as the other engines are run.

    >>> timing = hf_generate_timing(model, [[5, 6, 7], [8, 9, 10]], output_len=4, mode="hf-eager")  # doctest: +SKIP
    >>> len(timing.token_times)  # doctest: +SKIP
    4
    """
    if mode not in HF_ENGINES:
        raise ConfigError(f"unknown HF baseline mode {mode!r}; use one of {', '.join(HF_ENGINES)}")
    if not prompt_token_ids or not all(prompt_token_ids):
        raise InvalidRequestError("hf_generate_timing needs at least one prompt, and no empty prompt")
    input_len = len(prompt_token_ids[0])
    if any(len(prompt) != input_len for prompt in prompt_token_ids):
        lengths = sorted({len(prompt) for prompt in prompt_token_ids})
        raise InvalidRequestError(f"prompts of one batch must have one length (no padding is timed); got lengths {lengths}")
    if output_len < 1:
        raise InvalidRequestError(f"output_len must be at least 1, got {output_len}")

    input_ids = torch.tensor(prompt_token_ids, dtype=torch.long, device=model.device)
    generate_kwargs = dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=_pad_token_id(model),
        **({"pixel_values": pixel_values} if pixel_values is not None else {}),
    )
    if mode == "hf-compile":
        generate_kwargs.update(cache_implementation="static", compile_config=_compile_state(model).config)
        _warm_up(model, input_ids, output_len, generate_kwargs)
    else:
        # A checkpoint's generation_config may ask for a static cache, which would compile on GPU.
        generate_kwargs.update(disable_compile=True)

    streamer = _TokenTimeStreamer(clock)
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize(input_ids.device)  # work queued earlier must not count as this call's
    start = clock()
    model.generate(input_ids, streamer=streamer, **generate_kwargs)
    return BatchTiming(
        start=start,
        token_times=streamer.times,
        input_len=input_len,
        output_len=output_len,
        batch=len(prompt_token_ids),
        output_token_ids=[list(tokens) for tokens in zip(*streamer.steps)],
    )


def _pad_token_id(model: PreTrainedModel) -> int:
    """generate() warns without a pad id; nothing is padded here, so any id in the vocabulary does."""
    for candidate in (model.generation_config.pad_token_id, model.generation_config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _compile_state(model: PreTrainedModel) -> _CompileState:
    """The model's one compile config: generate() recompiles whenever it is handed a different one."""
    state = getattr(model, _COMPILE_STATE_ATTR, None)
    if state is None:
        on_cuda = model.device.type == "cuda"
        config = CompileConfig(fullgraph=True, mode="reduce-overhead" if on_cuda else "default")
        if not on_cuda:
            # generate() compiles only on accelerators unless told otherwise; this is its switch for that.
            config._compile_all_devices = True
        state = _CompileState(config)
        setattr(model, _COMPILE_STATE_ATTR, state)
    return state


def _warm_up(model: PreTrainedModel, input_ids: torch.Tensor, output_len: int, generate_kwargs: dict) -> None:
    """Run one untimed generate() per new shape, so compiling and CUDA-graph capture are not timed."""
    state = _compile_state(model)
    shape = (input_ids.shape[0], input_ids.shape[1], output_len)
    if shape in state.warmed_shapes:
        return
    logger.info("hf-compile: compiling and warming up for batch %d, input %d, output %d", *shape)
    started = time.perf_counter()
    model.generate(input_ids, **generate_kwargs)
    state.warmed_shapes.add(shape)
    logger.info("hf-compile: warm-up took %.1fs", time.perf_counter() - started)
