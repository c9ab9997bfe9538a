"""Frozen, keyword-only configuration dataclasses. YAML and JSON are only their serialisation."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jaxserve.errors import JaxserveError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the host in the decoded text
    ignore_eos: bool = False
    logprobs: int = 0  # how many top log-probabilities to return per token (0 to 20)
    # vLLM's semantics (jaxserve.model.sampler): presence and frequency penalise the output's tokens, repetition
    # the prompt's and the output's; 0, 0 and 1 disable them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one; 0 disables
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # the stop tokens (end of sequence and stop_token_ids) and stop strings wait for this many
    n: int = 1  # samples of the prompt, each from its own seed (seed + i), sharing the prompt's KV pages
    prompt_logprobs: int | None = None  # each prompt token's log-probability and this many top alternatives
    grammar: str | None = None  # an llguidance grammar the output must match (jaxserve.engine.grammar)
    speculate: bool | None = None  # speculative decoding for this request (EngineConfig.speculative); None: on if
    # the engine speculates

    @property
    def penalized(self) -> bool:
        """Whether the step needs this request's token counts (jaxserve.step): any of the three penalties."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def children(self) -> list[SamplingParams]:
        """The n samples as requests of their own (n = 1 each), sample i seeded seed + i: the engine takes one
        sample a request, and siblings share the prompt's pages through the prefix cache (jaxserve.engine)."""
        return [dataclasses.replace(self, n=1, seed=(self.seed + i) % 2**32) for i in range(self.n)]

    @property
    def reads_every_prompt_token(self) -> bool:
        """Whether every prompt token must pass through the step (no prefix-cache hits): penalties count the
        prompt's tokens there, and prompt log-probabilities are computed there."""
        return self.penalized or self.prompt_logprobs is not None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise JaxserveError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise JaxserveError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise JaxserveError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise JaxserveError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.logprobs <= 20:
            raise JaxserveError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise JaxserveError("stop strings must not be empty")
        if self.repetition_penalty <= 0:
            raise JaxserveError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise JaxserveError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise JaxserveError(f"min_tokens must be between 0 and max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.n < 1:
            raise JaxserveError(f"n must be at least 1, got {self.n}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise JaxserveError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")


T = TypeVar("T")


def load_yaml(cls: type[T], path: str) -> T:
    """Loads a YAML file into the frozen config dataclass `cls`; unknown keys are an error.

    A mapping under a field typed as another config dataclass loads into that class (so
    `engine:` in a serve config becomes an EngineConfig), and a list under a tuple field becomes
    a tuple.
    """
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise JaxserveError(f"{path}: expected a mapping of {cls.__name__} keys, got {type(data).__name__}")
    return _from_mapping(cls, data, path)


def _from_mapping(cls: type[T], data: dict[str, Any], where: str) -> T:
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise JaxserveError(f"{where}: unknown keys {unknown} for {cls.__name__}; known keys: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        hint = hints[key]
        nested = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
        if nested is not None and isinstance(value, dict):
            value = _from_mapping(nested, value, f"{where}: {key}")  # type: ignore[arg-type]
        elif isinstance(value, list) and typing.get_origin(hint) is tuple:
            value = tuple(value)
        values[key] = value
    return cls(**values)


ATTENTION_BACKENDS = ("auto", "reference", "pallas", "mosaic_gpu", "mosaic_tpu")  # pallas_kernels.backend.BACKENDS
KV_CACHE_DTYPES = ("auto", "float8_e4m3fn")  # auto: the activations' dtype


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Mesh sizes: `tp` devices split heads, FFN and vocabulary (axis `model`), `sp` split the sequence
    (axis `seq`: ring-attention prefill, KV pages striped across devices), `ep` split a mixture's experts (axis
    `expert`; the rest of the model is copied along it), `dp` copies the rest (`data`)."""

    tp: int = 1
    sp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "sp", "dp", "ep"):
            if getattr(self, name) < 1:
                raise JaxserveError(f"parallel {name} must be at least 1, got {getattr(self, name)}")

    @property
    def num_devices(self) -> int:
        return self.tp * self.sp * self.dp * self.ep


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-host start-up (`jax.distributed.initialize`). Unset fields default from the environment:
    JAXSERVE_COORDINATOR_ADDRESS / JAXSERVE_NUM_PROCESSES / JAXSERVE_PROCESS_ID, else a LeaderWorkerSet
    pod's LWS_LEADER_ADDRESS (port 8476) / LWS_GROUP_SIZE / LWS_WORKER_INDEX (see jaxserve.parallel.distributed)."""

    coordinator_address: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self) -> None:
        if self.num_processes is not None and self.num_processes < 1:
            raise JaxserveError(f"num_processes must be at least 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise JaxserveError(f"process_id must be >= 0, got {self.process_id}")
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise JaxserveError(f"process_id={self.process_id} must be below num_processes={self.num_processes}")
        if self.initialization_timeout_s < 1:
            raise JaxserveError(f"initialization_timeout_s must be at least 1, got {self.initialization_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Sizes of the engine: slots, the page pool, and the compiled prefill chunk buckets."""

    max_slots: int = 8
    page_size: int = 16
    num_pages: int = 512
    max_pages_per_slot: int = 64  # the longest sequence a slot can hold is page_size * this
    chunk_buckets: tuple[int, ...] = (16, 64, 256)  # prefill chunk sizes; the largest is the chunk limit
    prefill_rows: tuple[int, ...] = (1,)  # how many requests' chunks one prefill step may carry
    # Tokens one step's prefill may carry over all its rows (how long running streams wait for it);
    # 0 means the largest chunk. Rows of narrower chunks fill it: 8 rows of 32 under a budget of 256.
    prefill_tokens: int = 0
    # "auto", "reference" (XLA), "pallas" (the platform's kernels; interpreted on CPU), or one kernel
    # family by name, "mosaic_gpu" or "mosaic_tpu" (interpreted where the platform cannot compile it)
    attention: str = "auto"
    # Page-table widths of the compiled decode steps: a decode step attends over the smallest width
    # that holds its longest row, not over max_pages_per_slot. Empty: max_pages_per_slot only.
    decode_page_buckets: tuple[int, ...] = ()
    # Row counts of the compiled decode steps (max_slots is always added). Empty: powers of 4 below max_slots.
    decode_row_buckets: tuple[int, ...] = ()
    compilation_cache_dir: str | None = None
    max_logprobs: int = 20
    # Share of each device's memory limit the engine may hold in all (weights, KV pages): when above 0,
    # num_pages becomes however many pages fit in it beside what is already in use (the weights), as vLLM's
    # gpu_memory_utilization. The rest is left for the compiled steps' activations. 0: num_pages as given.
    kv_memory_fraction: float = 0.0
    # The KV pages' dtype. float8_e4m3fn halves their bytes (twice the pages in the same memory, half the reads
    # a decode step makes); values are clipped to its range (+-448) when written and upcast when read.
    kv_cache_dtype: str = "auto"
    # Decode through one kernel for every layer (pallas_kernels.decode_megakernel; on a GPU its Mosaic GPU kernel,
    # elsewhere its jnp reference): one slot, int8 weights with one scale a channel, one device. The layers' int8
    # weights are then held twice (stacked for decode, per layer for prefill) and the KV pages stacked. With it,
    # 128-position pages (page_size: 128) decode ~3 % faster on an H100 than 16.
    decode_megakernel: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the device mesh the engine runs on
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off

    def __post_init__(self) -> None:
        for name in ("max_slots", "page_size", "num_pages", "max_pages_per_slot"):
            if getattr(self, name) < 1:
                raise JaxserveError(f"engine config {name} must be at least 1, got {getattr(self, name)}")
        if not self.chunk_buckets or list(self.chunk_buckets) != sorted(set(self.chunk_buckets)):
            raise JaxserveError(f"chunk_buckets must be strictly increasing and non-empty, got {self.chunk_buckets}")
        if self.attention not in ATTENTION_BACKENDS:
            raise JaxserveError(f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if any(not 0 < p <= self.max_pages_per_slot for p in self.decode_page_buckets):
            raise JaxserveError(f"decode_page_buckets={self.decode_page_buckets} must lie in [1, max_pages_per_slot="
                                f"{self.max_pages_per_slot}]")
        if any(not 0 < r <= self.max_slots for r in self.decode_row_buckets):
            raise JaxserveError(f"decode_row_buckets={self.decode_row_buckets} must lie in [1, max_slots={self.max_slots}]")
        if not self.prefill_rows or list(self.prefill_rows) != sorted(set(self.prefill_rows)) or self.prefill_rows[0] != 1:
            raise JaxserveError(f"prefill_rows must be strictly increasing and start at 1, got {self.prefill_rows}")
        if self.prefill_tokens < 0:
            raise JaxserveError(f"prefill_tokens must be >= 0 (0: the largest chunk), got {self.prefill_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise JaxserveError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.parallel.num_devices > 1:
            raise JaxserveError(f"kv_cache_dtype={self.kv_cache_dtype!r} runs on one device; the sharded attention "
                                f"(tp/sp over {self.parallel.num_devices} devices) takes kv_cache_dtype='auto'")
        if not isinstance(self.decode_megakernel, bool):
            raise JaxserveError(f"decode_megakernel must be true or false, got {self.decode_megakernel!r}")
        if self.decode_megakernel and (self.max_slots != 1 or self.parallel.num_devices > 1):
            raise JaxserveError(f"decode_megakernel decodes one row on one device: max_slots must be 1 (got "
                                f"{self.max_slots}) and parallel one device (got {self.parallel.num_devices})")
        if not 0.0 <= self.kv_memory_fraction < 1.0:
            raise JaxserveError(f"kv_memory_fraction must be in [0, 1) (0: use num_pages), got {self.kv_memory_fraction}")
        if self.num_pages < self.max_pages_per_slot:
            raise JaxserveError(
                f"num_pages={self.num_pages} cannot hold even one full slot of max_pages_per_slot={self.max_pages_per_slot}"
            )
        sp = self.parallel.sp
        if sp > 1 and self.num_pages % sp:
            raise JaxserveError(f"num_pages={self.num_pages} must be a multiple of sp={sp}: the page pool is split "
                                f"evenly over the devices of the sequence axis")
        if sp > 1 and any(c % (2 * sp) for c in self.chunk_buckets):
            raise JaxserveError(f"chunk_buckets={self.chunk_buckets} must be multiples of 2 * sp={2 * sp}: ring "
                                f"attention gives each device two equal blocks of every prefill chunk")

    @property
    def max_seq_len(self) -> int:
        return self.page_size * self.max_pages_per_slot

    @property
    def max_chunk(self) -> int:
        return self.chunk_buckets[-1]

    @property
    def prefill_buckets(self) -> tuple[tuple[int, int], ...]:
        """(rows, width) of the compiled prefill steps: every chunk size, with as many rows as fit
        in one step's prefill budget of tokens."""
        budget = self.prefill_tokens or self.max_chunk
        return tuple((r, c) for c in self.chunk_buckets for r in self.prefill_rows if r == 1 or r * c <= budget)

    def width_for(self, length: int) -> int:
        """The smallest chunk bucket that holds `length` tokens."""
        return next(c for c in self.chunk_buckets if c >= length)

    def prefill_rows_for(self, width: int, rows: int) -> int:
        """The smallest compiled row count at this width that holds `rows` chunks."""
        return next(r for r, c in self.prefill_buckets if c == width and r >= rows)

    def max_prefill_rows(self, width: int) -> int:
        return max(r for r, c in self.prefill_buckets if c == width)

    @property
    def decode_page_widths(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.decode_page_buckets) | {self.max_pages_per_slot}))

    def decode_pages_for(self, pages: int) -> int:
        """The smallest decode page-table width that holds `pages` pages."""
        return next(p for p in self.decode_page_widths if p >= pages)

    def decode_rows_for(self, slots: int) -> int:
        """The smallest decode bucket that covers slots [0, slots)."""
        return next(r for r in self.decode_buckets if r >= slots)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Row counts of the compiled decode steps: `decode_row_buckets` (default: powers of 4 below
        max_slots), and max_slots."""
        if self.decode_row_buckets:
            return tuple(sorted(set(self.decode_row_buckets) | {self.max_slots}))
        sizes = {self.max_slots}
        n = 1
        while n < self.max_slots:
            sizes.add(n)
            n *= 4
        return tuple(sorted(sizes))


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (jaxserve.engine.speculative): a decode row proposes up to `num_tokens` tokens and one
    step of the target verifies them all, keeping the target's own output distribution. `ngram` proposes what
    followed the latest earlier occurrence of the sequence's last n tokens (max_n down to min_n; prompt lookup),
    `draft` what a smaller model sharing the target's tokenizer (`model`) generates greedily."""

    method: str
    num_tokens: int = 4
    min_n: int = 1
    max_n: int = 4
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise JaxserveError(f"speculative method={self.method!r} must be one of {SPECULATIVE_METHODS}")
        if not 1 <= self.num_tokens <= 16:
            raise JaxserveError(f"speculative num_tokens={self.num_tokens} must be between 1 and 16")
        if not 1 <= self.min_n <= self.max_n:
            raise JaxserveError(f"speculative min_n={self.min_n} and max_n={self.max_n} need 1 <= min_n <= max_n")
        if (self.method == "draft") != (self.model is not None):
            raise JaxserveError(f"speculative method={self.method!r} {'needs' if self.method == 'draft' else 'takes no'}"
                                f" model (got {self.model!r})")


QUANTIZE_MODES = ("int8",)


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Weight quantization (see jaxserve.model.quant): int8 values, float32 scales per output channel
    or per `group_size` inputs. `head`: quantize the output head too (with tied embeddings, the shared
    table); `embed`: quantize an untied input embedding as well (a gather: saves memory, not time)."""

    mode: str = "int8"
    group_size: int = 0  # 0: one scale per output channel; else inputs per scale, a positive multiple of 32
    head: bool = True
    embed: bool = False

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZE_MODES:
            raise JaxserveError(f"unknown quantization {self.mode!r}; supported: {', '.join(QUANTIZE_MODES)}")
        if self.group_size < 0 or self.group_size % 32:
            raise JaxserveError(f"quantization group_size must be 0 (per output channel) or a positive multiple of 32, "
                                f"got {self.group_size}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The gRPC server: where it listens, its limits, TLS and auth, and the model and engine it serves."""

    host: str = "0.0.0.0"
    port: int = 50051  # 0 picks a free port
    http_port: int = 8000  # the OpenAI-compatible HTTP API (jaxserve.http); 0 turns it off
    metrics_host: str = "127.0.0.1"  # the k8s overlays listen on 0.0.0.0 for their scrapers
    metrics_port: int | None = 9090  # Prometheus /metrics over HTTP; None turns it off, 0 picks a free port
    metrics_auth_token: str | None = None  # bearer token required on the metrics port
    metrics_auth_token_file: str | None = None  # or a file holding it
    model: str | None = None  # GGUF file, HF or orbax directory; None serves the embedded SmolLM2
    served_model_name: str | None = None  # the model's name to callers; None: the model path's last part
    dtype: str | None = None  # float32 or bfloat16; None: float32 on CPU, bfloat16 on GPU/TPU
    quantize: QuantConfig | None = None  # int8 weights, quantized at load (an orbax model saved quantized needs none)
    engine: EngineConfig = field(default_factory=EngineConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    max_waiting: int = 64  # requests admitted beyond the running slots; past it, RESOURCE_EXHAUSTED
    retry_after_ms: int = 1000  # the hint sent with RESOURCE_EXHAUSTED when the queue is full
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight calls get to finish
    max_message_bytes: int = 4 * 1024 * 1024  # larger requests get RESOURCE_EXHAUSTED
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    max_stop_strings: int = 8
    # A prompt's UTF-8 bytes (or a chat's contents together), checked before tokenizing; 0: 32 bytes for each
    # token of one sequence (max_pages_per_slot * page_size)
    max_prompt_bytes: int = 0
    max_messages: int = 1024  # chat messages in one request
    stream_idle_timeout_s: float = 30.0  # a stream whose client reads nothing for this long is cancelled
    stream_buffer_tokens: int = 1024  # output a stream may fall behind its client by before it is cancelled
    tls_cert: str | None = None  # PEM certificate chain; with tls_key turns TLS on
    tls_key: str | None = None  # PEM private key
    tls_client_ca: str | None = None  # PEM CA bundle; set, clients must present a certificate it signed (mTLS)
    auth_token: str | None = None  # bearer token required on InferenceService calls
    auth_token_file: str | None = None  # or a file holding it (a mounted secret)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise JaxserveError(f"port must be between 0 and 65535, got {self.port}")
        if not 0 <= self.http_port <= 65535:
            raise JaxserveError(f"http_port must be between 0 and 65535 (0 turns HTTP off), got {self.http_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise JaxserveError(f"metrics_port must be between 0 and 65535 (null turns metrics off), got {self.metrics_port}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise JaxserveError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        for name in ("max_waiting", "retry_after_ms"):
            if getattr(self, name) < 0:
                raise JaxserveError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_message_bytes", "max_tokens_limit", "max_messages", "stream_buffer_tokens"):
            if getattr(self, name) < 1:
                raise JaxserveError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_stop_strings < 0:
            raise JaxserveError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.max_prompt_bytes < 0:
            raise JaxserveError(f"max_prompt_bytes must be >= 0 (0: 32 bytes a token of one sequence), got "
                                f"{self.max_prompt_bytes}")
        if not self.stream_idle_timeout_s > 0:
            raise JaxserveError(f"stream_idle_timeout_s must be > 0, got {self.stream_idle_timeout_s}")
        if self.metrics_auth_token is not None and self.metrics_auth_token_file is not None:
            raise JaxserveError("set metrics_auth_token or metrics_auth_token_file, not both")
        if self.drain_timeout_s < 0:
            raise JaxserveError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise JaxserveError(
                f"TLS needs both tls_cert and tls_key, got tls_cert={self.tls_cert!r} and tls_key={self.tls_key!r}"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise JaxserveError(f"tls_client_ca={self.tls_client_ca!r} (mutual TLS) needs tls_cert and tls_key as well")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise JaxserveError("set auth_token or auth_token_file, not both")
        if self.auth_token is not None and not self.auth_token.strip():
            raise JaxserveError("auth_token must not be empty; leave it unset to turn auth off")

    def prompt_bytes_limit(self, max_sequence_length: int) -> int:
        """max_prompt_bytes, or its default for an engine of this sequence length."""
        return self.max_prompt_bytes or 32 * max_sequence_length

    @property
    def model_name(self) -> str:
        """The name callers see: served_model_name, else the model path's last part (no file extension)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "SmolLM2-135M-Instruct"
        base = os.path.basename(os.path.normpath(self.model))
        return os.path.splitext(base)[0] if base.endswith((".gguf", ".GGUF")) else base


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """An offline batch job (`jaxserve batch`): input and output JSONL, the model and engine, request defaults."""

    input: str | None = None  # OpenAI batch JSONL or {"custom_id", "prompt"} lines
    output: str | None = None  # results are appended here; with num_shards > 1 each shard writes its own file
    model: str | None = None  # GGUF file, HF or orbax directory; None runs the embedded SmolLM2
    dtype: str | None = None  # float32 or bfloat16; None: float32 on CPU, bfloat16 on GPU/TPU
    quantize: QuantConfig | None = None  # int8 weights, quantized at load, as ServerConfig.quantize
    engine: EngineConfig = field(default_factory=EngineConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # a multi-host group, as a server's
    sampling: SamplingParams = field(default_factory=SamplingParams)  # for every key a request leaves out
    max_in_flight: int | None = None  # requests handed to the engine at once; None: 4 * engine.max_slots
    shard_index: int | None = None  # None: $JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), else 0
    num_shards: int = 1  # input line i (from 1) belongs to shard (i - 1) % num_shards
    fsync_interval_s: float = 1.0  # results reach the disk at least this often; 0 syncs after every step
    progress: bool = True  # a progress bar on stderr

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float32", "bfloat16"):
            raise JaxserveError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.num_shards < 1:
            raise JaxserveError(f"num_shards must be at least 1, got {self.num_shards}")
        if self.shard_index is not None and not 0 <= self.shard_index < self.num_shards:
            raise JaxserveError(f"shard_index={self.shard_index} must lie in [0, num_shards={self.num_shards})")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise JaxserveError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.fsync_interval_s < 0:
            raise JaxserveError(f"fsync_interval_s must be >= 0, got {self.fsync_interval_s}")
        if self.sampling.logprobs:
            raise JaxserveError(f"sampling.logprobs={self.sampling.logprobs}: batch jobs do not write log-probabilities; "
                                "leave it at 0")

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or 4 * self.engine.max_slots


def engine_config_for(prompt_lens: list[int], max_tokens: int, *, page_size: int = 16, max_slots: int = 16,
                      chunk_sizes: tuple[int, ...] = (16, 64, 256), attention: str = "auto",
                      parallel: ParallelConfig | None = None) -> EngineConfig:
    """An engine just big enough for a known set of prompts (CLI generate, benchmarks, tests)."""
    parallel = parallel or ParallelConfig()
    chunk_sizes = sequence_parallel_chunks(chunk_sizes, parallel.sp)
    longest = max(prompt_lens) + max_tokens
    pages_per_slot = -(-longest // page_size)
    pages_per_slot = -(-pages_per_slot // parallel.sp) * parallel.sp
    slots = max(1, min(len(prompt_lens), max_slots))
    return EngineConfig(max_slots=slots, page_size=page_size, num_pages=slots * pages_per_slot,
                        max_pages_per_slot=pages_per_slot, chunk_buckets=chunks_for(chunk_sizes, max(prompt_lens)),
                        attention=attention, parallel=parallel)


def chunks_for(chunk_sizes: tuple[int, ...], longest_prompt: int) -> tuple[int, ...]:
    """The chunk sizes a load can use: those below its longest prompt and the first that holds it."""
    holds = next((c for c in chunk_sizes if c >= longest_prompt), max(chunk_sizes))  # or the largest, in chunks
    return tuple(sorted({c for c in chunk_sizes if c < longest_prompt} | {holds}))


def sequence_parallel_chunks(chunk_sizes: tuple[int, ...], sp: int) -> tuple[int, ...]:
    """Chunk sizes rounded up to multiples of 2 * sp (ring attention's zig-zag blocks) when sp > 1."""
    unit = 2 * sp if sp > 1 else 1
    return tuple(sorted({-(-c // unit) * unit for c in chunk_sizes}))
