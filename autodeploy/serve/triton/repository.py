"""Write a Triton Inference Server model repository that serves a deployed model (``autodeploy triton-repo``).

    DIR/
      llm/             the engine: Python backend, decoupled (streams) unless decoupled=False, text or token ids in
        config.pbtxt   its tensors, and the deployment's metadata as parameters
        1/model.py     imports autodeploy.serve.triton.llm_model
        1/deployment/  the deployment as `autodeploy build` saves it
      preprocessing/   text → token ids (the deployment's tokenizer); a vision-language model's images → pixel values
      postprocessing/  token ids → text
      output_filter/   text → text through a blocklist (only with one)
      ensemble/        text in → preprocessing → llm → postprocessing [→ output_filter] → text out

The engine model serves the saved deployment rather than rebuilding from the original MODEL and settings:
the repository is then whole by itself (no hub or checkpoint needed where it is served; the tokenizer
travels with it), starts without export or transforms, and serves exactly the graph that was verified
when it was written. On another device kind or other library versions the deployment rebuilds itself
from its recorded source, with a warning (``autodeploy/artifact``).

Each ``model.py`` is one import of a module of this package, so the server runs the code of the autodeploy
installed in the Python environment of Triton's Python backend (``launch.py`` starts one).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from autodeploy.errors import ConfigError, InvalidRequestError
from autodeploy.serve.triton import tensor_specs as specs
from autodeploy.serve.triton.blocklist import Blocklist

LLM, PREPROCESSING, POSTPROCESSING, OUTPUT_FILTER, ENSEMBLE = "llm", "preprocessing", "postprocessing", "output_filter", "ensemble"
DEPLOYMENT = "deployment"  # the saved deployment, in the llm model's version folder
# Every tensor has a leading batch dimension (of 1), as the TensorRT-LLM backend's clients send them; the
# engine batches requests itself.
MAX_BATCH_SIZE = 1

MODEL_PY = '''"""Triton Python-backend model written by `autodeploy triton-repo`; the code is autodeploy's."""

import locale

# Triton's stub runs an isolated Python that stays in the C locale, where open() reads ASCII: take the
# environment's locale (autodeploy.serve.triton.launch sets a UTF-8 one) before anything reads a file.
locale.setlocale(locale.LC_CTYPE, "")

from autodeploy.serve.triton.{module} import {cls} as TritonPythonModel  # noqa: E402,F401
'''


def write_model_repository(llm, directory: str | Path, blocklist: Blocklist | None = None, source: str | None = None,
                           stream_interval: int = 1, decoupled: bool = True) -> Path:
    """Write the repository for ``llm`` (a deployed model with a tokenizer) into ``directory`` (new or empty).
    ``stream_interval``: a stream's responses after the first come every this many tokens, unless a request
    says otherwise (its ``stream_interval`` input). ``decoupled``: the llm model (and so the ensemble) may
    send any number of responses a request (streams, ``n`` > 1); False: exactly one, as Triton's plain
    ``infer`` (HTTP and gRPC) needs, like the TensorRT-LLM backend's ``decoupled_mode`` false.

    >>> write_model_repository(autodeploy("path/to/checkpoint"), "triton-repo")  # doctest: +SKIP
    """
    directory = Path(directory)
    check_repository_destination(directory)
    check_stream_interval(stream_interval)
    if llm.tokenizer is None:
        raise ConfigError("the model has no tokenizer; the repository's text inputs and its ensemble need one: pass --set tokenizer=…")
    llm.save(directory / LLM / "1" / DEPLOYMENT)
    metadata_parameters = {
        DEPLOYMENT: DEPLOYMENT,
        "source": source or llm.settings.model or "",
        "max_seq_len": str(llm.settings.max_seq_len),
        "vocab_size": str(llm.vocab_size),
        "dtype": str(llm.settings.dtype),
        "device": str(llm.settings.device),
        "autodeploy_version": metadata.version("autodeploy"),
        specs.STREAM_INTERVAL.name: str(stream_interval),
    }
    tokenizer = {"tokenizer": f"{LLM}/1/{DEPLOYMENT}/tokenizer"}
    images = llm.image_token is not None  # a vision-language model: images through preprocessing to the llm model
    llm_inputs = (*specs.LLM_INPUTS, specs.LLM_PIXEL_VALUES) if images else specs.LLM_INPUTS
    _write_model(directory, LLM, "llm_model", "TritonPythonModel", llm_inputs, specs.LLM_OUTPUTS, metadata_parameters, decoupled)
    if images:
        _write_model(directory, PREPROCESSING, "tokenizer_models", "PreprocessingModel", (*specs.PREPROCESSING_INPUTS, specs.IMAGE_INPUT),
                     (*specs.PREPROCESSING_OUTPUTS, specs.PIXEL_VALUES), {**tokenizer, "image_processor": f"{LLM}/1/{DEPLOYMENT}/image_processor"})
    else:
        _write_model(directory, PREPROCESSING, "tokenizer_models", "PreprocessingModel", specs.PREPROCESSING_INPUTS,
                     specs.PREPROCESSING_OUTPUTS, tokenizer)
    _write_model(directory, POSTPROCESSING, "tokenizer_models", "PostprocessingModel", specs.POSTPROCESSING_INPUTS, specs.POSTPROCESSING_OUTPUTS, tokenizer)
    if blocklist is not None:
        _write_model(directory, OUTPUT_FILTER, "output_filter_model", "OutputFilterModel", specs.FILTER_INPUTS, specs.FILTER_OUTPUTS,
                     {"blocklist": json.dumps(blocklist.terms), "action": blocklist.action})
    (directory / ENSEMBLE / "1").mkdir(parents=True)
    (directory / ENSEMBLE / "config.pbtxt").write_text(ensemble_config(with_filter=blocklist is not None, with_images=images))
    return directory


def check_repository_destination(directory: Path) -> None:
    """``ConfigError`` unless ``directory`` is new or an empty folder."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"{directory} exists and is not an empty folder; write the Triton repository to a new or empty folder")


def check_stream_interval(value) -> None:
    """``ConfigError`` unless ``value`` is a stream interval (a positive integer)."""
    from autodeploy.frontend.async_llm import check_stream_interval as check

    try:
        check(value)
    except InvalidRequestError as error:
        raise ConfigError(str(error)) from None


def _write_model(directory: Path, name: str, module: str, cls: str, inputs, outputs, parameters: dict[str, str], decoupled: bool = False) -> None:
    (directory / name / "1").mkdir(parents=True, exist_ok=True)
    (directory / name / "1" / "model.py").write_text(MODEL_PY.format(module=module, cls=cls))
    (directory / name / "config.pbtxt").write_text(python_model_config(name, inputs, outputs, parameters, decoupled))


def python_model_config(name: str, inputs, outputs, parameters: dict[str, str], decoupled: bool) -> str:
    """A Python-backend model's config.pbtxt: one instance (the engine batches inside itself, and a
    stateless tokenizer step is quick), a batch of one request (``tensor_specs``)."""
    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {MAX_BATCH_SIZE}"]
    if decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines += [_tensor_list("input", inputs), _tensor_list("output", outputs), "instance_group [ { count: 1, kind: KIND_CPU } ]"]
    lines += [f"parameters {{ key: {json.dumps(key)} value: {{ string_value: {json.dumps(value)} }} }}" for key, value in parameters.items()]
    return "\n".join(lines) + "\n"


def ensemble_config(with_filter: bool, with_images: bool = False) -> str:
    """The ensemble: its inputs reach the steps that read them; its outputs come from the last steps. With images,
    preprocessing turns them into the pixel values the llm model takes."""
    options = [spec.name for spec in specs.REQUEST_OPTIONS]
    # With a filter, the engine's text and finish reason pass through it on their way out.
    text, finish_reason = ("_filter_input", "_finish_reason") if with_filter else (specs.TEXT_OUTPUT.name, specs.FINISH_REASON.name)
    to_postprocessing = {"output_ids": "output_ids", "num_new_tokens": "_num_new_tokens", "finish_reason": finish_reason, "stop": "_stop"}
    postprocessing_out = {"text_output": text}
    if with_filter:
        postprocessing_out |= {"text_so_far": "_text_so_far", "finish_reason": "_filter_finish_reason"}
    images_in = {specs.IMAGE_INPUT.name: specs.IMAGE_INPUT.name} if with_images else {}
    pixels = {specs.PIXEL_VALUES.name: "_pixel_values"} if with_images else {}
    steps = [
        _step(PREPROCESSING, {"text_input": "text_input", **images_in}, {"input_ids": "_input_ids", **pixels}),
        _step(LLM, {"input_ids": "_input_ids", **pixels, **{name: name for name in options}},
              {**to_postprocessing, **{name: name for name in (specs.OUTPUT_LOG_PROBS.name, specs.OUTPUT_TOP_TOKEN_IDS.name,
                                                                specs.OUTPUT_TOP_LOG_PROBS.name, specs.SEQUENCE_INDEX.name)}}),
        _step(POSTPROCESSING, to_postprocessing, postprocessing_out),
    ]
    if with_filter:
        steps.append(_step(OUTPUT_FILTER, {"text_input": text, "text_so_far": "_text_so_far", "finish_reason": "_filter_finish_reason"},
                           {"text_output": specs.TEXT_OUTPUT.name, "finish_reason": specs.FINISH_REASON.name}))
    return "\n".join([
        f'name: "{ENSEMBLE}"', 'platform: "ensemble"', f"max_batch_size: {MAX_BATCH_SIZE}",
        _tensor_list("input", (*specs.ENSEMBLE_INPUTS, specs.IMAGE_INPUT) if with_images else specs.ENSEMBLE_INPUTS),
        _tensor_list("output", specs.ENSEMBLE_OUTPUTS),
        "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}",
    ]) + "\n"


def _tensor_list(kind: str, tensors) -> str:
    return f"{kind} [\n" + ",\n".join(f"  {spec.pbtxt()}" for spec in tensors) + "\n]"


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'      input_map {{ key: "{key}" value: "{value}" }}' for key, value in inputs.items()]
    maps += [f'      output_map {{ key: "{key}" value: "{value}" }}' for key, value in outputs.items()]
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n' + "\n".join(maps) + "\n    }"
