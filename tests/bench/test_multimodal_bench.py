"""``autodeploy bench --images-per-request``: a vision-language model's requests carry images (each its own, or one
for all), made off the step loop; the run reports how long the loop waited for them and the encoder cache's hits,
and the HF baseline gets the same images."""

from __future__ import annotations

import pytest

from autodeploy.bench.benchmark import BenchmarkConfig, run_benchmark
from autodeploy.errors import ConfigError
from autodeploy.runtime.engine import Engine
from tests.tiny_vision_models import IMAGE_TOKEN_ID, write_tiny_llava


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    write_tiny_llava(directory, "clip")
    return str(directory)


def config(model: str, **fields) -> BenchmarkConfig:
    return BenchmarkConfig(**{"model": model, "set_arguments": ["device=cpu", "dtype=float32", "max_seq_len=128"],
                              "workloads": ["concurrency"], "concurrency": [3], "num_requests": 6, "input_dist": "fixed:12",
                              "output_dist": "fixed:4", "repeats": 1, "progress": False, "images_per_request": 2,
                              "image_size": 40, **fields})


def test_each_request_carries_its_own_images_and_the_run_reports_the_wait_for_them(llava):
    result = run_benchmark(config(llava))
    [run] = result.runs
    assert run.id.endswith("-img2x40/autodeploy")
    assert run.metrics["images_encoded"] == 6 * 2 and run.metrics["encoder_cache_hits"] == 0 and run.metrics["image_wait_s"] >= 0
    assert run.metrics["output_tokens_per_s"] > 0


def test_one_image_for_every_request_is_encoded_once(llava):
    [run] = run_benchmark(config(llava, same_image=True)).runs
    assert run.id.endswith("-img2x40-same/autodeploy")
    assert run.metrics["images_encoded"] == 2  # each run starts from a cold cache
    assert run.metrics["encoder_cache_hits"] >= 3  # the later steps' requests (a step's own repeats are encoded once)


def test_the_hf_baseline_gets_the_same_images_and_the_engine_is_not_built_again_beside_it(llava, monkeypatch):
    import autodeploy.frontend.llm as frontend

    built = []
    monkeypatch.setattr(frontend, "Engine", lambda *args, **kwargs: built.append(1) or Engine(*args, **kwargs))
    result = run_benchmark(config(llava, workloads=["synthetic"], batch=[2], input_len=[12], output_len=[4], compare=["hf-eager"]))
    ours, hf = (result.run(f"synthetic/b2-in12-out4-img2x40/{engine}") for engine in ("autodeploy", "hf-eager"))
    assert ours.metrics["output_tokens_per_s"] > 0 and hf.metrics["output_tokens_per_s"] > 0
    assert len(built) == 1  # a second engine would hold a second KV pool while HF runs (out of memory on a GPU)


def test_images_for_a_text_model_are_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="takes no images"):
        run_benchmark(config(str(tiny_checkpoint("llama"))))


def test_random_prompts_never_hold_a_stray_image_placeholder(llava):
    from autodeploy.bench.benchmark import build_workloads
    from autodeploy import autodeploy

    llm = autodeploy(llava, device="cpu", dtype="float32", max_seq_len=128, verify={"enabled": False})
    workloads = build_workloads(config(llava, num_requests=64, input_dist="fixed:64"), llm.vocab_size, 128, llm.tokenizer, llm.engine.vision)
    for request in workloads[0].requests:
        assert request.prompt_token_ids[:2] == [IMAGE_TOKEN_ID] * 2 and IMAGE_TOKEN_ID not in request.prompt_token_ids[2:]
