"""Config loading: the serve preset, nested engine sections, and errors that name the bad key or value."""

from __future__ import annotations

import os

import pytest

from jaxserve.config import EngineConfig, ServerConfig, load_yaml
from jaxserve.errors import JaxserveError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_preset_loads_with_its_nested_engine():
    cfg = load_yaml(ServerConfig, os.path.join(REPO, "configs", "serve.yaml"))
    assert cfg.port == 50051 and cfg.metrics_port == 9090 and cfg.model is None
    assert isinstance(cfg.engine, EngineConfig)
    assert cfg.engine.chunk_buckets == (32, 128, 512) and cfg.engine.max_seq_len == 2048


def test_int8_latency_preset_loads_and_its_pages_are_the_kernels():
    """configs/serve-int8-latency.yaml: int8 weights with one scale a channel, one slot through the decode
    megakernel, 128-position pages, which the kernel's Mosaic GPU check takes for an 8B Llama."""
    from jaxserve.checkpoint.random_model import PRESETS
    from pallas_kernels.decode_megakernel.mosaic_gpu import check_config

    cfg = load_yaml(ServerConfig, os.path.join(REPO, "configs", "serve-int8-latency.yaml"))
    assert cfg.quantize is not None and (cfg.quantize.mode, cfg.quantize.group_size) == ("int8", 0)
    assert cfg.engine.decode_megakernel and cfg.engine.max_slots == 1 and cfg.engine.page_size == 128
    assert cfg.engine.max_seq_len == 8192 and cfg.dtype == "bfloat16"
    check_config(PRESETS["llama3-8b"], cfg.engine.page_size)


def test_engine_section_may_be_partial_and_top_level_engine_config_still_loads(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("port: 0\nengine:\n  max_slots: 2\n")
    cfg = load_yaml(ServerConfig, str(path))
    assert cfg.engine == EngineConfig(max_slots=2) and cfg.port == 0
    path.write_text("max_slots: 3\nchunk_buckets: [8, 16]\n")
    assert load_yaml(EngineConfig, str(path)) == EngineConfig(max_slots=3, chunk_buckets=(8, 16))


@pytest.mark.parametrize(("text", "message"), [
    ("engine:\n  max_slot: 2\n", "engine: unknown keys ['max_slot'] for EngineConfig"),
    ("prot: 1\n", "unknown keys ['prot'] for ServerConfig"),
    ("port: 70000\n", "port must be between 0 and 65535, got 70000"),
    ("tls_cert: a.pem\n", "TLS needs both tls_cert and tls_key"),
    ("tls_client_ca: ca.pem\n", "tls_client_ca='ca.pem' (mutual TLS) needs tls_cert and tls_key"),
    ("engine:\n  chunk_buckets: [64, 16]\n", "chunk_buckets must be strictly increasing"),
    ("engine:\n  kv_memory_fraction: 1.5\n", "kv_memory_fraction must be in [0, 1) (0: use num_pages), got 1.5"),
    ("engine:\n  kv_cache_dtype: int8\n", "kv_cache_dtype must be one of ('auto', 'float8_e4m3fn'), got 'int8'"),
    ("engine:\n  kv_cache_dtype: float8_e4m3fn\n  parallel: {tp: 2}\n",
     "kv_cache_dtype='float8_e4m3fn' runs on one device"),
    ("dtype: float16\n", "dtype must be float32 or bfloat16, got 'float16'"),
    ("auth_token: x\nauth_token_file: /t\n", "set auth_token or auth_token_file, not both"),
    ("- 1\n", "expected a mapping of ServerConfig keys, got list"),
])
def test_bad_serve_config_names_the_key_or_value(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(JaxserveError) as info:
        load_yaml(ServerConfig, str(path))
    assert message in str(info.value)
