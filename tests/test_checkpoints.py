"""GGUF, Hugging Face safetensors and orbax loading, checked against transformers' logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.checkpoint import load_model, save_model
from tests.helpers import logits_of
from tests.tiny_models import hf_tiny, write_gguf

IDS = [5, 17, 200, 31, 99, 4, 250, 1, 64, 128, 7, 3]


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def save_hf(hf, directory, hf_tokenizer) -> None:
    hf.save_pretrained(directory, safe_serialization=True)
    hf_tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
               "rope_theta": 500000.0}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {}),
    ("qwen2", {"tie_word_embeddings": True}),
])
def test_safetensors_logits_match_transformers(tmp_path, hf_tokenizer, model_type, overrides):
    hf = hf_tiny(model_type, **overrides)
    save_hf(hf, tmp_path, hf_tokenizer)
    model = load_model(str(tmp_path))
    assert model.config.architecture == model_type
    assert model.config.attention_bias == (model_type == "qwen2")
    np.testing.assert_allclose(logits_of(model, IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_is_read(tmp_path, hf_tokenizer):
    hf = hf_tiny("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    save_hf(hf, tmp_path, hf_tokenizer)
    scaling = load_model(str(tmp_path)).config.rope_scaling
    assert scaling is not None and scaling.kind == "llama3" and scaling.factor == 8.0


def test_gguf_undoes_the_rotary_permutation(tmp_path):
    hf = hf_tiny("llama")
    write_gguf(str(tmp_path / "tiny.gguf"), hf)
    model = load_model(str(tmp_path / "tiny.gguf"))
    np.testing.assert_allclose(logits_of(model, IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)
    assert model.tokenizer.bos_token_id == 256 and model.tokenizer.eos_token_ids == (257,)


def test_gguf_qwen2_keeps_its_row_order(tmp_path):
    hf = hf_tiny("qwen2")
    write_gguf(str(tmp_path / "tiny.gguf"), hf, arch="qwen2")
    model = load_model(str(tmp_path / "tiny.gguf"))
    assert model.config.architecture == "qwen2" and model.config.attention_bias
    np.testing.assert_allclose(logits_of(model, IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantized_types_dequantize_as_gguf_does(tmp_path, qtype):
    import gguf

    hf = hf_tiny("llama")
    write_gguf(str(tmp_path / "q.gguf"), hf, qtype=qtype)
    model = load_model(str(tmp_path / "q.gguf"))
    w = hf.model.layers[0].mlp.gate_proj.weight.detach().numpy()
    qt = gguf.GGMLQuantizationType[qtype]
    expected = gguf.quants.dequantize(gguf.quants.quantize(w, qt), qt)
    np.testing.assert_array_equal(np.asarray(model.weights.layers[0].w_gate_up[:, 0]), expected)
    assert np.abs(expected - w).max() > 0 or qtype == "F16"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gguf_k_quants_load(tmp_path, qtype):
    """gguf cannot quantize K-types, so the file carries random blocks with finite scales."""
    import gguf

    rng = np.random.default_rng(0)
    hf = hf_tiny("llama", intermediate_size=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = str(tmp_path / "k.gguf")
    write_gguf(path, hf, tensor_types={"blk.0.ffn_down.weight": "F32"})
    qt = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(256, 256 // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scale_at = 0 if qtype == "Q4_K" else type_size - 2  # fp16 super-block scale(s)
    blocks[:, scale_at:scale_at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == "Q4_K":
        blocks[:, 2:4] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    # Rewrite the file with blk.0.ffn_up as the K-quant tensor.
    writer_path = str(tmp_path / "k2.gguf")
    _rewrite_with_tensor(path, writer_path, "blk.0.ffn_up.weight", raw, qt, (256, 256))
    model = load_model(writer_path)
    expected = gguf.quants.dequantize(raw, qt).reshape(256, 256)
    np.testing.assert_array_equal(np.asarray(model.weights.layers[0].w_gate_up[:, 1]), expected)


def _rewrite_with_tensor(src: str, dst: str, name: str, raw: np.ndarray, qt, shape) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name == name:
            writer.add_tensor(name, raw, raw_dtype=qt)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_orbax_round_trip_needs_no_source(tmp_path, smollm):
    save_model(smollm, str(tmp_path / "ckpt"))
    restored = load_model(str(tmp_path / "ckpt"))
    assert restored.config == smollm.config
    for a, b in zip(jax.tree_util.tree_leaves(smollm.weights), jax.tree_util.tree_leaves(restored.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype
    # the same weights, config and tokenizer: whatever the source generates, the checkpoint generates
    saved, source = restored.tokenizer, smollm.tokenizer
    assert saved.backend.to_str() == source.backend.to_str()
    assert (saved.bos_token_id, saved.eos_token_ids, saved.chat_template, saved.special_tokens) == (
        source.bos_token_id, source.eos_token_ids, source.chat_template, source.special_tokens)
    assert saved.encode("The capital of France is") == source.encode("The capital of France is")


def test_bfloat16_load(embedded_path):
    model = load_model(embedded_path, dtype="bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(model.weights)} == {jnp.dtype(jnp.bfloat16)}
    ids = model.tokenizer.encode("The capital of France is")
    for _ in range(4):  # greedy, one whole forward a token (logits_of pads them all to one compiled shape)
        ids.append(int(np.argmax(logits_of(model, ids)[-1])))
    assert model.tokenizer.decode(ids[5:]).startswith(" Paris")


def test_random_models_have_real_shapes_and_a_tokenizer_for_every_id():
    """`random:NAME`: preset shapes, random weights, every id decodes; int8 and an unknown name."""
    import jax.numpy as jnp

    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.random_model import PRESETS
    from jaxserve.config import QuantConfig
    from jaxserve.errors import CheckpointError
    from jaxserve.model.quant import QuantizedArray

    eight_b = PRESETS["llama3-8b"]
    assert (eight_b.num_layers, eight_b.hidden_size, eight_b.intermediate_size, eight_b.vocab_size) == (32, 4096, 14336, 128256)
    model = load_model("random:smoke", dtype=jnp.bfloat16)
    assert model.weights.layers[0].wqkv.shape == (2, 4, 64, 256) and model.weights.embed.dtype == jnp.bfloat16
    assert model.tokenizer.vocab_size == 512 and model.tokenizer.eos_token_ids == (511,)
    assert model.tokenizer.decode([3, 511]) == "<3> <511>" and model.tokenizer.encode("<3> <511>") == [3, 511]
    quantized = load_model("random:smoke", dtype=jnp.bfloat16, quantize=QuantConfig(mode="int8"))
    assert isinstance(quantized.weights.layers[0].w_gate_up, QuantizedArray)
    with pytest.raises(CheckpointError, match="unknown random model 'llama9'; presets: gemma3-12b, llama3-1b, "
                                              "llama3-8b, qwen3-30b-a3b, qwen3-8b, smoke, smollm2-135m"):
        load_model("random:llama9")
