"""The model's attention backends agree: Pallas kernels (Mosaic GPU and Mosaic TPU interpreted on CPU, Mosaic GPU
real on the GPU) and XLA."""

from __future__ import annotations

import jax
import pytest

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.errors import JaxserveError
from jaxserve.runner import build_engine
from tests.tiny_models import hf_tiny, write_gguf

# Two prompts of different lengths: one prefill chunk each (padded to the kernels' 128-query tile,
# attending to K/V read from the pages), then decode steps over ragged lengths crossing a page.
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 1, 2, 3, 4, 5], [200, 201, 202]]


def generate(model, attention: str, prompts: list[list[int]], max_tokens: int,
             kv_cache_dtype: str = "auto") -> list[list[int]]:
    # (decode steps of every slot only: a step of fewer rows runs the same kernels, and each step to compile holds an
    # interpreted kernel)
    cfg = EngineConfig(max_slots=len(prompts), page_size=16, num_pages=4 * len(prompts), max_pages_per_slot=4,
                       chunk_buckets=(16,), attention=attention, kv_cache_dtype=kv_cache_dtype,
                       decode_row_buckets=(len(prompts),))
    engine = build_engine(model, cfg)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """head_dim 64 and pages of 16 tokens: shapes the Mosaic GPU kernels take."""
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_gguf(path, hf_tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2))
    return load_model(path, dtype="float32")


@pytest.fixture(scope="module")
def xla_tokens(tiny):
    tokens = generate(tiny, "reference", PROMPTS, 4)
    assert len(set(map(tuple, tokens))) == 2
    return tokens


@pytest.mark.slow
def test_pallas_kernels_in_interpret_mode_generate_what_xla_generates(tiny, xla_tokens):
    assert generate(tiny, "pallas", PROMPTS, 4) == xla_tokens


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory):
    """head_dim 128: the Mosaic GPU kernels' float8 pages need 128-byte rows."""
    path = str(tmp_path_factory.mktemp("tiny128") / "tiny.gguf")
    write_gguf(path, hf_tiny("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1))
    return load_model(path, dtype="float32")


@pytest.mark.slow
def test_float8_pages_through_the_kernels_in_interpret_mode_generate_what_xla_generates(tiny128, tiny):
    """The engine's float8 pages reach the Mosaic GPU kernels (prefill over pages, decode) as XLA reads them;
    a head_dim they cannot take is refused by name."""
    fp8 = "float8_e4m3fn"
    assert generate(tiny128, "mosaic_gpu", PROMPTS, 4, fp8) == generate(tiny128, "reference", PROMPTS, 4, fp8)
    with pytest.raises(JaxserveError, match=r"attention='mosaic_gpu' \(mosaic_gpu\) cannot read 8-bit pages at "
                                            r"this model's head_dim=64"):
        generate(tiny, "mosaic_gpu", PROMPTS, 4, fp8)


@pytest.mark.slow
def test_mosaic_tpu_kernels_in_interpret_mode_generate_what_xla_generates(tiny, xla_tokens):
    assert generate(tiny, "mosaic_tpu", PROMPTS, 4) == xla_tokens


@pytest.mark.gpu
def test_pallas_kernels_on_the_gpu_generate_what_xla_generates(tiny):
    # The embedded GGUF (98 MB) cannot travel to the GPU machine; the tiny model exercises the same
    # paths: a prefill chunk reading its pages, then decode over ragged lengths crossing a page.
    assert jax.default_backend() == "gpu"
    reference = generate(tiny, "reference", PROMPTS, 12)
    assert generate(tiny, "pallas", PROMPTS, 12) == reference


@pytest.mark.gpu
def test_sampled_steps_with_top_logprobs_on_the_gpu(tiny):
    """The sampler runs after the step (jaxserve.model.sampler.sample_fn): seeded draws repeat, and each row's top
    log-probabilities are sorted and start at or above its chosen token's."""
    assert jax.default_backend() == "gpu"
    cfg = EngineConfig(max_slots=2, page_size=16, num_pages=8, max_pages_per_slot=4, chunk_buckets=(16,),
                       attention="pallas")
    engine = build_engine(tiny, cfg)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.95, seed=s, logprobs=3)
              for s in (1, 2)]
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    for request in first:
        assert len(request.logprobs) == 6
        for chosen, top in request.logprobs:
            values = [lp for _, lp in top]
            assert values == sorted(values, reverse=True) and values[0] >= chosen - 1e-5
