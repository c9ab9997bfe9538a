"""The `jaxserve` command line: thin wrappers over the library (batch jobs: jaxserve/jobs/command.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxserve import launch
from jaxserve.errors import InputError, JaxserveError

log = logging.getLogger("jaxserve")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF or orbax directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and activations (default: float32 on CPU, bfloat16 on GPU/TPU)")
    _add_quantize_args(p)


def _add_quantize_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--quantize", choices=("int8",), default=default,
                   help="quantize the linear layers' weights as they load (int8: one scale per output channel)")
    p.add_argument("--quantize-group-size", type=int, default=0, metavar="G",
                   help="with --quantize: one scale per G inputs of each output channel (default 0: per channel)")
    p.add_argument("--float-head", action="store_true",
                   help="with --quantize: keep the output head (and a tied embedding) in float")


def _quant_config(args: argparse.Namespace) -> Any:
    from jaxserve.config import QuantConfig

    if args.quantize is None:
        if args.quantize_group_size or args.float_head:
            raise InputError("--quantize-group-size and --float-head need --quantize int8")
        return None
    return QuantConfig(mode=args.quantize, group_size=args.quantize_group_size, head=not args.float_head)


def _add_attention_arg(p: argparse.ArgumentParser) -> None:
    from jaxserve.config import ATTENTION_BACKENDS

    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default=None,
                   help="attention implementation: Pallas kernels where the platform has them (auto), plain XLA "
                        "(reference), or the kernels everywhere (pallas; interpreted, slowly, on CPU), or one "
                        "kernel family by name (mosaic_gpu, mosaic_tpu; interpreted off their platform)")


def _add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    from jaxserve.config import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="dtype of the KV pages: the activations' (auto), or float8_e4m3fn (half the bytes: twice the "
                        "pages in the same memory; single device)")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    from jaxserve.config import SPECULATIVE_METHODS

    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="propose tokens by prompt lookup (ngram) or with a draft model (draft), verified in one step")
    g.add_argument("--speculative-tokens", type=int, default=None, help="tokens proposed a step (default 4)")
    g.add_argument("--speculative-model", default=None, help="the draft model (method draft)")


def speculative_from_args(args: argparse.Namespace, base: Any = None) -> Any:
    """The engine's SpeculativeConfig: `base` (a config file's) with the flags over it; None when neither sets it."""
    from jaxserve.config import SpeculativeConfig

    if args.speculative_method is None:
        if args.speculative_tokens is not None or args.speculative_model is not None:
            if base is None:
                raise InputError("--speculative-tokens and --speculative-model need --speculative-method")
            return dataclasses.replace(base, num_tokens=args.speculative_tokens or base.num_tokens,
                                       model=args.speculative_model or base.model)
        return base
    return SpeculativeConfig(method=args.speculative_method, num_tokens=args.speculative_tokens or 4,
                             model=args.speculative_model)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """--tp/--sp/--ep/--dp and the multi-host flags, for every command that runs a model."""
    g = p.add_argument_group("devices and hosts")
    g.add_argument("--tp", type=int, default=None, help="tensor parallelism: devices that split heads, FFN, vocabulary")
    g.add_argument("--ep", type=int, default=None,
                   help="expert parallelism: devices that split a mixture of experts' experts (mesh axis `expert`)")
    g.add_argument("--sp", type=int, default=None,
                   help="sequence parallelism: devices that split the KV pages and run ring-attention prefill")
    g.add_argument("--dp", type=int, default=None, help="data parallelism (one engine serves dp=1)")
    g.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0 (multi-host)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the group, one per host")
    g.add_argument("--process-id", type=int, default=None, help="this process's index; 0 serves, the others follow")


def parallel_from_args(args: argparse.Namespace, base: Any = None) -> Any:
    """`base` (a ParallelConfig; default one device) with the given --tp/--sp/--ep/--dp."""
    from jaxserve.config import ParallelConfig

    given = {name: getattr(args, name) for name in ("tp", "sp", "dp", "ep") if getattr(args, name, None) is not None}
    return dataclasses.replace(base or ParallelConfig(), **given)


def _load(args: argparse.Namespace) -> Any:
    """The model of the command's --model, --dtype and --quantize flags (see jaxserve.launch.load_model)."""
    from jaxserve.config import EngineConfig

    return launch.load_model(args.model, dtype=args.dtype, quantize=_quant_config(args),
                             engine=EngineConfig(parallel=parallel_from_args(args)))


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.config import SamplingParams, engine_config_for
    from jaxserve.runner import release_followers

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, **sampling_extras(args))
    launch.join(args)
    model = _load(args)
    tok = model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) if args.chat else tok.encode(p) for p in args.prompts]
    for p in prompts:
        if len(p) + params.max_tokens > model.config.max_position_embeddings:
            raise InputError(
                f"prompt of {len(p)} tokens plus max_tokens={params.max_tokens} exceeds the model's context of "
                f"{model.config.max_position_embeddings} tokens; shorten the prompt or lower max_tokens"
            )
    engine_cfg = engine_config_for([len(p) for p in prompts], params.max_tokens, attention=args.attention or "auto",
                                   parallel=parallel_from_args(args))
    if args.kv_cache_dtype:
        engine_cfg = dataclasses.replace(engine_cfg, kv_cache_dtype=args.kv_cache_dtype)
    engine_cfg = dataclasses.replace(engine_cfg, speculative=speculative_from_args(args))
    engine = launch.engine_or_follow(model, engine_cfg)
    if engine is None:
        return 0
    start = time.perf_counter()
    children = params.children()
    requests = engine.generate([p for p in prompts for _ in children], children * len(prompts))
    release_followers(engine)
    for i, r in enumerate(requests):
        text_in = args.prompts[i // len(children)]
        if args.json:
            out = {"prompt": text_in, "index": i % len(children), "text": r.text, "token_ids": r.output_ids,
                   "prompt_token_ids": r.prompt_ids, "finish_reason": r.finish_reason}
            if params.logprobs:
                out["logprobs"] = [{"logprob": lp, "top": top} for lp, top in r.logprobs]
            if params.prompt_logprobs is not None:
                out["prompt_logprobs"] = [e and {"logprob": e[0], "top": e[1]} for e in r.prompt_logprobs]
            print(json.dumps(out, ensure_ascii=False), flush=True)
        else:
            print(r.text if args.chat else text_in + r.text, flush=True)
    tokens = sum(len(r.output_ids) for r in requests)
    log.info("%d tokens in %.2f s (%.1f tokens/s) over %d engine steps", tokens, time.perf_counter() - start,
             tokens / (time.perf_counter() - start), engine.stats.steps)
    return 0


def sampling_extras(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields of the sampling flags beyond the basic ones (those a command has)."""
    extras: dict[str, Any] = {}
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "min_tokens", "n",
                 "prompt_logprobs"):
        if hasattr(args, name):
            extras[name] = getattr(args, name)
    bias = []
    for entry in args.logit_bias:
        token, _, value = entry.partition("=")
        try:
            bias.append((int(token), float(value)))
        except ValueError:
            raise InputError(f"--logit-bias {entry!r} must be TOKEN=BIAS, a token id and a number") from None
    extras["logit_bias"] = tuple(bias)
    return extras


def _grpc_sampling(extras: dict[str, Any]) -> dict[str, Any]:
    """`sampling_extras` as jaxserve.v1 SamplingParams fields."""
    out = dict(extras)
    out["logit_bias"] = dict(extras["logit_bias"])
    if out.get("prompt_logprobs") is None:
        out.pop("prompt_logprobs", None)
    return out


def cmd_info(args: argparse.Namespace) -> int:
    from jaxserve.model.quant import is_quantized, linear_bytes
    from jaxserve.model.weights import param_bytes

    model = _load(args)
    import jax

    weights = jax.tree_util.tree_leaves(model.weights, is_leaf=is_quantized)
    info = {
        "source": model.source,
        "architecture": model.config.architecture,
        "switches": model.config.switches,  # the ModelConfig switches this model turns on (jaxserve.model.transformer)
        "config": model.config.to_dict(),
        "dtype": str(model.weights.final_norm.dtype),
        "quantization": dataclasses.asdict(model.quantization) if model.quantization else None,
        "parameters": sum(int(x.values.size if is_quantized(x) else x.size) for x in weights),
        "parameter_bytes": param_bytes(model.weights),
        "linear_bytes": linear_bytes(model.weights),
        "tokenizer": {"vocab_size": model.tokenizer.vocab_size, "bos_token_id": model.tokenizer.bos_token_id,
                      "eos_token_ids": list(model.tokenizer.eos_token_ids),
                      "has_chat_template": bool(model.tokenizer.chat_template)},
    }
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Writes an orbax checkpoint of the model with int8 weights, loadable with --model DIR alone."""
    from jaxserve.checkpoint import save_model
    from jaxserve.model.weights import param_bytes

    model = _load(args)
    save_model(model, args.output)
    result = {"output": args.output, "source": model.source, "parameter_bytes": param_bytes(model.weights)}
    print(json.dumps(result) if args.json else f"wrote {args.output} ({result['parameter_bytes']} parameter bytes)")
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from jaxserve.perplexity import perplexity

    try:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InputError(f"cannot read --text-file {args.text_file}: {e}") from e
    model = _load(args)
    ids = model.tokenizer.encode(text)
    result = perplexity(model, ids, context=args.context, stride=args.stride, attention=args.attention or "auto",
                        kv_cache_dtype=args.kv_cache_dtype or "auto")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serves the gRPC API until SIGTERM; flags override the YAML config."""
    from jaxserve.config import ServerConfig, load_yaml
    from jaxserve.server.server import serve

    cfg = load_yaml(ServerConfig, args.config) if args.config else ServerConfig()
    overrides = {name: getattr(args, name) for name in ("host", "port", "http_port", "metrics_port", "model", "dtype")
                 if getattr(args, name) is not None}
    if args.quantize is not None or args.quantize_group_size or args.float_head:
        overrides["quantize"] = _quant_config(args)
    cfg = dataclasses.replace(cfg, **overrides)
    if args.attention is not None:
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, attention=args.attention))
    if args.kv_cache_dtype is not None:
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kv_cache_dtype=args.kv_cache_dtype))
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, parallel=parallel_from_args(args, cfg.engine.parallel),
                                                              speculative=speculative_from_args(args, cfg.engine.speculative)))
    launch.join(args, cfg.distributed)

    def load_model() -> Any:
        return launch.load_model(cfg.model, dtype=cfg.dtype, quantize=cfg.quantize, engine=cfg.engine)

    if launch.is_follower():  # a multi-host follower serves nothing: it runs the leader's steps
        launch.engine_or_follow(load_model(), cfg.engine)
        return 0
    engines = []

    def load() -> tuple[Any, Any]:
        from jaxserve.server.server import model_info

        model = load_model()
        engine = launch.engine_or_follow(model, cfg.engine)
        engines.append(engine)
        return engine, model_info(model, engine, cfg, dtype=str(model.weights.final_norm.dtype))

    from jaxserve.runner import compilation_count, release_followers

    logging.getLogger("jaxserve").setLevel(logging.INFO)  # start-up progress: loading, each bucket compiled
    code = serve(cfg, load, compilations=compilation_count)
    for engine in engines:
        release_followers(engine)
    return code


def cmd_client_generate(args: argparse.Namespace) -> int:
    """Streams one generation from a running server to stdout."""
    import grpc

    from jaxserve.client import TLS, Client, gather

    tls = TLS.from_files(args.ca, args.key, args.cert) if (args.ca or args.cert) else None
    kwargs = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    if args.n > 1 and not args.json:
        raise InputError(f"--n={args.n} streams samples interleaved; add --json to get one object per sample")
    responses = []
    with Client(args.address, token=args.token, tls=tls) as client:
        try:
            for response in client.generate(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                            top_p=args.top_p, seed=args.seed, timeout=args.timeout,
                                            **_grpc_sampling(sampling_extras(args)), **kwargs):
                responses.append(response)
                if response.HasField("chunk") and not args.json:
                    print(response.chunk.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\njaxserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if not args.json:
        print(flush=True)
    for result in gather(responses) if args.json else ():
        print(json.dumps({"prompt": args.prompt, "index": result.index, "text": result.text,
                          "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                          "cached_tokens": result.cached_tokens}, ensure_ascii=False))
    return 0


def _bench_constraint(args: argparse.Namespace, model: Any) -> tuple[str, Any] | None:
    """bench's --json-schema as a grammar, and the tokenizer its masks are made for (--tokenizer's, of a model
    whose own llguidance cannot read: a random model's); None without --json-schema."""
    if not args.json_schema:
        if args.tokenizer:
            raise InputError("--tokenizer is for --json-schema: it gives the masks a tokenizer llguidance reads")
        return None
    from jaxserve.checkpoint.tokenizer import tokenizer_from_hf_dir
    from jaxserve.engine import validation

    try:
        with open(args.json_schema) as f:
            grammar = validation.constraint("json_schema", f.read(), "--json-schema")
    except OSError as e:
        raise InputError(f"--json-schema {args.json_schema!r}: {e.strerror}") from None
    tokenizer = tokenizer_from_hf_dir(args.tokenizer) if args.tokenizer else model.tokenizer
    if tokenizer.vocab_size > model.config.vocab_size:
        raise InputError(f"--tokenizer {args.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{model.config.vocab_size}")
    return grammar, tokenizer


def cmd_bench(args: argparse.Namespace) -> int:
    from jaxserve.bench import bench_config, run_bench

    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.config:  # the engine a server with this config runs: the baseline of a load over gRPC
        from jaxserve.config import ServerConfig, load_yaml

        if args.max_slots is not None:
            raise InputError(f"--max-slots={args.max_slots} and --config both size the engine; give one")
        server_cfg = load_yaml(ServerConfig, args.config)
        args.model = args.model or server_cfg.model
        args.dtype = args.dtype or server_cfg.dtype
        if args.quantize is None and server_cfg.quantize is not None:
            args.quantize, args.quantize_group_size = server_cfg.quantize.mode, server_cfg.quantize.group_size
            args.float_head = not server_cfg.quantize.head
        cfg = dataclasses.replace(server_cfg.engine, parallel=parallel_from_args(args, server_cfg.engine.parallel))
        if args.attention:
            cfg = dataclasses.replace(cfg, attention=args.attention)
    launch.join(args)
    model = _load(args)
    grammar = _bench_constraint(args, model)
    if grammar is not None and args.tokenizer:
        model = dataclasses.replace(model, tokenizer=grammar[1])
    if not args.config:
        cfg = bench_config(args.num_requests, args.input_len, args.output_len, max_slots=args.max_slots,
                           attention=args.attention or "auto", parallel=parallel_from_args(args))
    if args.kv_memory_fraction:
        cfg = dataclasses.replace(cfg, kv_memory_fraction=args.kv_memory_fraction)
    if args.kv_cache_dtype:
        cfg = dataclasses.replace(cfg, kv_cache_dtype=args.kv_cache_dtype)
    cfg = dataclasses.replace(cfg, speculative=speculative_from_args(args, cfg.speculative))
    from jaxserve.config import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, **sampling_extras(args))
    constrained = None if grammar is None else dataclasses.replace(params, grammar=grammar[0])
    result = run_bench(model, args.num_requests, args.input_len, args.output_len, cfg, params=params,
                       constrained=constrained, rounds=args.rounds)
    if result is None:  # a follower
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value:.4g}" if isinstance(value, float) else f"{key:>20}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference on JAX")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    def sampling(p: argparse.ArgumentParser, *, lengths: bool = True) -> None:
        if lengths:
            p.add_argument("--max-tokens", type=int, default=64)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--min-tokens", type=int, default=0,
                           help="hold back the stop tokens and stop strings until this many tokens are out")
            p.add_argument("--n", type=int, default=1, help="samples of each prompt, sample i seeded seed + i")
            p.add_argument("--prompt-logprobs", type=int, default=None,
                           help="each prompt token's log-probability and this many top alternatives (with --json)")
        p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
        p.add_argument("--top-k", type=int, default=0, help="0 disables")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
        p.add_argument("--presence-penalty", type=float, default=0.0)
        p.add_argument("--frequency-penalty", type=float, default=0.0)
        p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")
        p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                       help="add BIAS to token id TOKEN's logit (repeatable)")
        p.add_argument("--logprobs", type=int, default=0, help="top log-probabilities per token (with --json)")

    gen = sub.add_parser("generate", help="continue one or more prompts")
    _add_model_args(gen)
    _add_attention_arg(gen)
    _add_kv_cache_arg(gen)
    _add_speculative_args(gen)
    add_parallel_args(gen)
    sampling(gen)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="model config and parameter bytes")
    _add_model_args(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    quant = sub.add_parser("quantize", help="write an int8 orbax checkpoint that --model DIR loads without the source")
    quant.add_argument("--model", default=None, help="source: GGUF file, HF or orbax directory (default: embedded)")
    quant.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="the weights left in float (norms, embedding) (default: float32 on CPU, bfloat16 on GPU)")
    _add_quantize_args(quant, default="int8")
    quant.add_argument("--output", required=True, metavar="DIR", help="directory to write (created)")
    quant.add_argument("--json", action="store_true")
    quant.set_defaults(func=cmd_quantize)

    ppl = sub.add_parser("perplexity", help="perplexity over a text file, in sliding windows over the context")
    _add_model_args(ppl)
    _add_attention_arg(ppl)
    _add_kv_cache_arg(ppl)
    ppl.add_argument("--text-file", required=True, metavar="F", help="UTF-8 text")
    ppl.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    ppl.add_argument("--stride", type=int, default=512,
                     help="window step; each scored token has at least context - stride tokens of context (default 512)")
    ppl.add_argument("--json", action="store_true", help='print {"perplexity": ..., "tokens": ...}')
    ppl.set_defaults(func=cmd_perplexity)

    bench = sub.add_parser("bench", help="offline throughput and latency through the engine")
    _add_model_args(bench)
    _add_attention_arg(bench)
    _add_kv_cache_arg(bench)
    _add_speculative_args(bench)
    add_parallel_args(bench)
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--max-slots", type=int, default=None, help="decode slots (default: min(requests, 64))")
    bench.add_argument("--config", default=None,
                       help="a serve config (e.g. k8s/overlays/gpu/serve.yaml): its model, dtype, quantization and "
                            "engine, every bucket, instead of an engine sized for the load (flags still override)")
    bench.add_argument("--kv-memory-fraction", type=float, default=0.0,
                       help="size the KV pages from the device's memory: this share of it in all (GPU/TPU; default: "
                            "every slot's full length)")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--json-schema", default=None, metavar="PATH",
                       help="structured output: the load unconstrained and with every request's output constrained to "
                            "this JSON schema, alternating (--rounds), each one's median run and their ratio")
    bench.add_argument("--rounds", type=int, default=1, help="with --json-schema: rounds of the two loads")
    bench.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="with --json-schema: a tokenizer.json directory whose tokens the masks follow, for a "
                            "model whose own tokenizer llguidance cannot read (random:NAME's)")
    sampling(bench, lengths=False)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="serve the gRPC API (jaxserve.v1.InferenceService) and the OpenAI-compatible "
                                         "HTTP API until SIGTERM")
    _add_model_args(serve)
    _add_attention_arg(serve)
    _add_kv_cache_arg(serve)
    _add_speculative_args(serve)
    add_parallel_args(serve)
    serve.add_argument("--config", default=None, help="ServerConfig YAML, e.g. configs/serve.yaml (default: built-in)")
    serve.add_argument("--host", default=None, help="address to listen on (default from the config: 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="gRPC port (default from the config: 50051)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="OpenAI-compatible HTTP port (default from the config: 8000; 0 turns HTTP off)")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default from the config: 9090)")
    serve.set_defaults(func=cmd_serve)

    client = sub.add_parser("client", help="talk to a running server")
    client_sub = client.add_subparsers(dest="client_command", required=True)
    cgen = client_sub.add_parser("generate", help="stream one generation to the terminal")
    cgen.add_argument("--address", default="localhost:50051", help="HOST:PORT of the server")
    cgen.add_argument("--token", default=None, help="bearer token, if the server wants one")
    cgen.add_argument("--ca", default=None, help="PEM CA of the server's certificate (turns TLS on)")
    cgen.add_argument("--cert", default=None, help="PEM client certificate for mutual TLS")
    cgen.add_argument("--key", default=None, help="PEM client key for mutual TLS")
    cgen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    cgen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    cgen.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    sampling(cgen)
    cgen.add_argument("prompt", metavar="PROMPT")
    cgen.set_defaults(func=cmd_client_generate)

    from jaxserve.jobs.command import add_parser as add_batch_parser

    add_batch_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except JaxserveError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
