"""The `jaxserve` command line: thin wrappers over the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxserve.errors import InputError, JaxserveError

log = logging.getLogger("jaxserve")


def _default_dtype() -> str:
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF or orbax directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and activations (default: float32 on CPU, bfloat16 on GPU/TPU)")


def _load(args: argparse.Namespace) -> Any:
    from jaxserve.checkpoint import load_model

    dtype = args.dtype or _default_dtype()
    start = time.perf_counter()
    model = load_model(args.model, dtype=dtype)
    log.info("loaded %s as %s in %.1f s", model.source, dtype, time.perf_counter() - start)
    return model


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.config import SamplingParams
    from jaxserve.step import build_engine, engine_config_for

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    model = _load(args)
    tok = model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) if args.chat else tok.encode(p) for p in args.prompts]
    for p in prompts:
        if len(p) + params.max_tokens > model.config.max_position_embeddings:
            raise InputError(
                f"prompt of {len(p)} tokens plus max_tokens={params.max_tokens} exceeds the model's context of "
                f"{model.config.max_position_embeddings} tokens; shorten the prompt or lower max_tokens"
            )
    engine = build_engine(model, engine_config_for([len(p) for p in prompts], params.max_tokens))
    start = time.perf_counter()
    requests = engine.generate(prompts, [params] * len(prompts))
    for text_in, r in zip(args.prompts, requests):
        if args.json:
            print(json.dumps({"prompt": text_in, "text": r.text, "token_ids": r.output_ids,
                              "prompt_token_ids": r.prompt_ids, "finish_reason": r.finish_reason},
                             ensure_ascii=False), flush=True)
        else:
            print(r.text if args.chat else text_in + r.text, flush=True)
    tokens = sum(len(r.output_ids) for r in requests)
    log.info("%d tokens in %.2f s (%.1f tokens/s) over %d engine steps", tokens, time.perf_counter() - start,
             tokens / (time.perf_counter() - start), engine.stats.steps)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from jaxserve.model.weights import param_bytes

    model = _load(args)
    import jax

    info = {
        "source": model.source,
        "config": model.config.to_dict(),
        "dtype": str(jax.tree_util.tree_leaves(model.weights)[0].dtype),
        "parameters": sum(int(x.size) for x in jax.tree_util.tree_leaves(model.weights)),
        "parameter_bytes": param_bytes(model.weights),
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


def cmd_serve(args: argparse.Namespace) -> int:
    """Until the gRPC service lands: an interactive chat on stdin."""
    from jaxserve.config import EngineConfig, SamplingParams
    from jaxserve.step import build_engine

    model = _load(args)
    engine = build_engine(model, EngineConfig(max_slots=1, num_pages=256, max_pages_per_slot=256))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print("jaxserve interactive demo (the gRPC server is not built yet). Type a message; Ctrl-D quits.",
          file=sys.stderr)
    history: list[dict[str, str]] = []
    for line in sys.stdin:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        prompt = model.tokenizer.encode_chat(history)
        try:
            reply = engine.generate([prompt], [params])[0].text
        except JaxserveError as e:
            print(f"error: {e}", file=sys.stderr)
            history.clear()
            continue
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from jaxserve.bench import bench_config, run_bench

    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    model = _load(args)
    cfg = bench_config(args.num_requests, args.input_len, args.output_len, max_slots=args.max_slots)
    result = run_bench(model, args.num_requests, args.input_len, args.output_len, cfg)
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

    def sampling(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
        p.add_argument("--top-k", type=int, default=0, help="0 disables")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=0)

    gen = sub.add_parser("generate", help="continue one or more prompts")
    _add_model_args(gen)
    sampling(gen)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="model config and parameter bytes")
    _add_model_args(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="offline throughput and latency through the engine")
    _add_model_args(bench)
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--max-slots", type=int, default=None, help="decode slots (default: min(requests, 64))")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="serve the model")
    _add_model_args(serve)
    sampling(serve)
    serve.set_defaults(func=cmd_serve)
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
