"""The `vx` command: `vx serve [MODEL]`, `vx bench serve`, `vx version`.

Comparing vx with its peers (vLLM, llama.cpp) is a script, not a subcommand:
`python bench/compare.py`.

Runs in: the front process. Flags mirror vLLM's; argparse turns them into an `EngineConfig`
(engine side) and `ServerSettings` (front side), validated once.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from vx.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_kv_events_config,
    parse_speculative_config,
)
from vx.exit_code import ExitCode, exit_codes_help

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '4g' or a plain number of bytes (a bare number below 1024 means GiB)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GiB or 512MiB)")
    value, unit = float(m.group(1)), (m.group(2) or "").upper()[:1]
    if not unit and value < 1024:
        unit = "G"
    return int(value * _UNITS[unit])


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=help)


def build_serve_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m",
                   help="HF directory, .gguf file, hub id, or the alias smollm2-135m (default)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="concurrent sequences per step (default: 1024 on cuda, 256 on cpu)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: 1024 on CPU; 8192 on cuda, 16384 on 160+ GiB)")
    p.add_argument("--small-step-tokens", type=int, default=None,
                   help="while fewer than 48 requests run and are held (running or waiting), "
                        "at most this many tokens a step (default: 192 for the CPU server when "
                        "the budget is not given, with 512 while a burst of 48 waits; 0: off)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="CPU KV pool size, e.g. 4GiB (default 4GiB)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, dest="num_blocks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    _bool_flag(p, "enable-prefix-caching", True, "reuse KV blocks of shared prefixes")
    _bool_flag(p, "async-scheduling", True, "schedule step n+1 while step n runs")
    _bool_flag(p, "batch-invariant", False,
               "a request's tokens do not depend on its batch, the prefix cache, chunking or "
               "preemption (CPU, bf16 or fp32, AVX2 and later)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": '
                        'DIR, "num_speculative_tokens": 4}\'')
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV-cache events for routers over ZMQ, vLLM\'s keys: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                        '"tcp://*:5557", "topic": "kv-events"}\' (needs pyzmq: the kv-events extra)')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    # Across nodes (one `vx serve` per node; defaults from torchrun's MASTER_ADDR, MASTER_PORT,
    # WORLD_SIZE and RANK): node 0 serves, the others run --headless.
    p.add_argument("--nnodes", type=int, default=None, help="nodes the Workers span (default 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (default 0)")
    p.add_argument("--master-addr", default=None, help="node 0's address (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="node 0's torch.distributed port; its step link listens on the next")
    p.add_argument("--headless", action="store_true",
                   help="run only this node's Workers, for node 0's EngineCore (node rank > 0)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    # Data parallel across nodes (vLLM's flags): the front's node runs ranks [0, local); each
    # other node runs --headless with its --data-parallel-start-rank.
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="data-parallel ranks on this node (default: all)")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="this node's first data-parallel rank (headless nodes)")
    p.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="the front's node address, where remote EngineCores connect "
                        "(default 127.0.0.1)")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=29550,
                   help="the front's port for remote EngineCores")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                   help="CPU weight-only quantized linears and LM head for small decode batches")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on cuda")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", action="append", default=[], help="repeatable")
    p.add_argument("--ssl-keyfile", default=None)
    p.add_argument("--ssl-certfile", default=None)
    p.add_argument("--allowed-origins", action="append", default=[],
                   help="CORS origins (off by default); repeatable")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object a line (time, level, role, pid, request_id, "
                        "logger, message), from every process")
    p.add_argument("--enable-log-requests", "--log-requests", action="store_true",
                   dest="enable_log_requests",
                   help="log each request's admission (with its prompt), first token and "
                        "finish at INFO; prompts are never logged without it")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry span per request over OTLP/HTTP (protobuf) "
                        "to URL, e.g. http://collector:4318/v1/traces (off by default)")
    p.add_argument("--disable-access-log", action="store_true",
                   help="no access line per HTTP request (method, path, status, request id, "
                        "tokens, TTFT, total time)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--profile-steps", action="store_true",
                   help="log a per-step timing breakdown (host share of each step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-timeout", type=float, default=30.0,
                   help="seconds before a step is declared stuck")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish")
    p.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds a stream may wait for a client that stopped reading")
    _add_output_flags(p)


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Structured outputs, tool calls and reasoning (the front's parsing of the text)."""
    p.add_argument("--structured-outputs-timeout", type=float, default=5.0,
                   help="seconds a new JSON schema, regex or grammar may take to compile; a "
                        "request whose constraint fails or takes longer gets a 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=True,
                   help="accepted for vLLM compatibility: tool_choice auto is always parsed")
    p.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json", "mistral"],
                   help="how tool calls are found in the text under tool_choice auto")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split <think>...</think> into reasoning_content")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file used instead of the tokenizer's, or the "
                        "name of one vx ships: chatml_tools (ChatML with hermes tool calls)")


def _small_step_tokens(args: argparse.Namespace, offline: bool) -> int:
    """The CPU server's small steps (192 tokens while fewer than 48 requests run and are held:
    32 clients of 128-token prompts get their first tokens sooner at the same throughput; a
    burst of 64 comes in 512 tokens a step, then full steps; measured, see
    docs/performance.md), unless told otherwise."""
    given = getattr(args, "small_step_tokens", None)
    if given is not None:
        return given
    if offline or args.device != "cpu" or args.max_num_batched_tokens is not None:
        return 0
    return 192


def engine_config_from_args(args: argparse.Namespace, *, offline: bool = False) -> EngineConfig:
    from vx.models_hub.device import resolve_scheduler_defaults  # no torch import

    max_num_seqs, budget = resolve_scheduler_defaults(
        args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        offline=offline,
    )
    small_step_tokens = _small_step_tokens(args, offline)
    speculative = parse_speculative_config(getattr(args, "speculative_config", None))
    async_scheduling = args.async_scheduling
    config = EngineConfig(
        model=ModelConfig(
            model=args.model,
            served_model_name=args.served_model_name or "",
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            quantization=args.quantization,
        ),
        cache=CacheConfig(
            kv_cache_memory_bytes=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            num_blocks_override=args.num_blocks,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            async_scheduling=async_scheduling,
            small_step_tokens=small_step_tokens,
            burst_step_tokens=512 if small_step_tokens else 0,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.data_parallel_size,
            data_parallel_size_local=args.data_parallel_size_local or 0,
            data_parallel_start_rank=args.data_parallel_start_rank,
            data_parallel_address=args.data_parallel_address or "127.0.0.1",
            data_parallel_rpc_port=args.data_parallel_rpc_port,
            **_nodes_from_args(args),
        ),
        device=args.device,
        profile_steps=args.profile_steps,
        step_timeout_s=args.step_timeout,
        num_threads=args.num_threads,
        enforce_eager=getattr(args, "enforce_eager", False),
        batch_invariant=getattr(args, "batch_invariant", False),
        speculative=speculative,
        kv_events=parse_kv_events_config(getattr(args, "kv_events_config", None)),
    )
    config.validate()
    if config.kv_events.enabled:
        import importlib.util

        if importlib.util.find_spec("zmq") is None:
            raise ValueError("--kv-events-config needs pyzmq: pip install 'vx[kv-events]'")
    return config


def _nodes_from_args(args: argparse.Namespace) -> dict[str, object]:
    """--nnodes, --master-addr, --master-port, with torchrun's variables as their defaults."""
    from vx import envs

    port = args.master_port
    if port is None and envs.MASTER_PORT:
        # torchrun's agent keeps its own store on MASTER_PORT: vx's ports are the next two
        port = envs.MASTER_PORT + 1
    return {
        "nnodes": args.nnodes or envs.WORLD_SIZE or 1,
        "master_addr": args.master_addr or envs.MASTER_ADDR or "127.0.0.1",
        "master_port": port or 0,
    }


def _node_rank(args: argparse.Namespace) -> int:
    from vx import envs

    return args.node_rank if args.node_rank is not None else envs.RANK or 0


def _serve(args: argparse.Namespace) -> int:
    import anyio

    from vx.launch import ServerSettings, serve
    from vx.log import setup_logging

    node_rank = _node_rank(args)
    headless = args.headless or node_rank > 0
    role = f"node{node_rank}" if headless else "api"
    if headless and args.data_parallel_start_rank:
        role = f"dp{args.data_parallel_start_rank}"
    setup_logging(
        role, args.log_level, log_format=args.log_format,
        log_requests=args.enable_log_requests,
    )  # fmt: skip
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        logger.error("invalid configuration: %s", e)
        return ExitCode.BAD_CONFIG
    if headless and config.parallel.data_parallel_start_rank > 0:
        from vx.headless import run_headless_dp

        return run_headless_dp(config)
    if headless:
        from vx.headless import run_headless

        return run_headless(config, node_rank)
    if config.parallel.data_parallel_start_rank:
        logger.error("invalid configuration: --data-parallel-start-rank > 0 needs --headless")
        return ExitCode.BAD_CONFIG
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_keys=tuple(args.api_key),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        allowed_origins=tuple(args.allowed_origins),
        drain_timeout_s=args.drain_timeout,
        stall_timeout_s=args.stall_timeout,
        access_log=not args.disable_access_log,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        structured_outputs_timeout_s=args.structured_outputs_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template,
    )
    try:
        return anyio.run(serve, config, settings)
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:
        from vx.bench.serve import main as bench_serve

        return bench_serve(argv[2:])
    parser = argparse.ArgumentParser(prog="vx", description="vx: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    build_serve_parser(
        sub.add_parser(
            "serve",
            help="start the OpenAI-compatible server",
            epilog=exit_codes_help(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    sub.add_parser(
        "bench",
        help="`vx bench serve --help` for the load generator (comparisons with vLLM and "
        "llama.cpp are a script: python bench/compare.py)",
    )
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "version":
        from vx import __version__

        print(__version__)
        return 0
    parser.print_help()
    return 2
