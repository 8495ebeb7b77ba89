"""``optimum-ipu serve MODEL``: an HTTP server holding one ORTModel on ``provider="ipu"``
(docs/deployment.md).

On one machine (uvicorn) by default; ``--ray`` runs the same app as a Ray Serve deployment, one replica
per IPU partition. Heavy imports happen in the run function only (``optimum-cli`` builds this parser).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from optimum_ipu_backend.config import parse_assignments
from optimum_ipu_backend.errors import ConfigurationError

DEFAULT_PORT = 8080
DEFAULT_DRAIN_SECONDS = 30


def add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP (text-embeddings-inference and OpenAI endpoints)",
        description=(
            "Serve MODEL (an ONNX export, or a transformers checkpoint exported at start-up) on provider "
            "ipu with dynamic batching: /embed, /predict and /v1/embeddings for encoders, /v1/completions "
            "for decoders, /health, /info and /metrics (Prometheus)."
        ),
    )
    parser.add_argument("model", help="an exported model directory or a transformers checkpoint directory")
    parser.add_argument("--task", default=None, help="the task to serve (default: inferred from config.json)")
    parser.add_argument(
        "--provider-option",
        "-o",
        action="append",
        default=[],
        metavar="K=V",
        help="a provider option (device, sequence_lengths, batch_size, max_queue_delay_ms, ...); "
        "dynamic_batching is on unless set to 0",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: MODEL)")
    parser.add_argument(
        "--pooling",
        default=None,
        help="embedding pooling: mean, cls or lasttoken (default: 1_Pooling/config.json)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name in answers and /info")
    parser.add_argument(
        "--max-inputs", type=int, default=None, help="most inputs in one request (default 32)"
    )
    parser.add_argument("--max-input-tokens", type=int, default=None, help="lower the longest input served")
    parser.add_argument(
        "--precompile", action="store_true", help="compile every bucket before /health reports ready"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="requests in flight before new ones get 429 (default 512)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help=f"seconds to let requests in flight finish on shutdown (default {DEFAULT_DRAIN_SECONDS})",
    )
    parser.add_argument("--log-level", default="info", help="log level (default info)")
    ray = parser.add_argument_group("Ray Serve (--ray)")
    ray.add_argument("--ray", action="store_true", help="run as a Ray Serve deployment")
    ray.add_argument(
        "--ray-address", default=None, help="Ray cluster address (default: the one of RAY_ADDRESS)"
    )
    ray.add_argument("--replicas", type=int, default=1, help="replicas (one per IPU partition; default 1)")
    ray.add_argument(
        "--ipus-per-replica", type=float, default=1, help='Ray custom resource {"IPU": n} per replica'
    )
    ray.add_argument("--max-ongoing-requests", type=int, default=64, help="requests in flight per replica")
    ray.add_argument(
        "--ray-proxy-location",
        choices=("HeadOnly", "EveryNode"),
        default="HeadOnly",
        help="one HTTP proxy on the head node (default), or one on every node behind a load balancer",
    )
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound")
    parser.set_defaults(func=run_serve)


def serve_options(args: argparse.Namespace) -> Any:
    """The ``ServeOptions`` the command line asks for (the task checked now, before anything loads)."""
    from optimum_ipu_backend.server.models import DEFAULT_MAX_INPUTS, ServeOptions, resolve_task

    options = parse_assignments(args.provider_option, "--provider-option", "device=emulator")
    task = resolve_task(Path(args.model), args.task)
    return ServeOptions(
        model=args.model,
        task=task,
        provider_options=options,
        tokenizer=args.tokenizer,
        pooling=args.pooling,
        max_inputs=args.max_inputs or DEFAULT_MAX_INPUTS,
        max_input_tokens=args.max_input_tokens,
        precompile=args.precompile,
        served_name=args.served_model_name,
    )


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"optimum-ipu serve needs the serve extra ({exc.name} is missing): "
            "pip install 'optimum-ipu-backend[serve]'"
        ) from None
    try:
        options = serve_options(args)
    except ConfigurationError as exc:
        raise SystemExit(f"optimum-ipu serve: {exc}") from None
    if args.ray:
        from optimum_ipu_backend.server.ray_app import run_on_ray

        return run_on_ray(options, args)
    return _run_uvicorn(options, args)


def _run_uvicorn(options: Any, args: argparse.Namespace) -> int:
    import uvicorn

    from optimum_ipu_backend.server.app import DEFAULT_MAX_CONCURRENT_REQUESTS, create_app
    from optimum_ipu_backend.server.models import ServedModel

    app = create_app(
        lambda: ServedModel(options),
        max_concurrent_requests=args.max_concurrent_requests or DEFAULT_MAX_CONCURRENT_REQUESTS,
    )
    config = uvicorn.Config(
        app,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.drain_timeout,
        access_log=False,
    )
    server = uvicorn.Server(config)
    state = app.state.serving

    def stop() -> None:
        server.should_exit = True

    state.on_load_failure = stop
    # Bound here, so that --port 0 can say which port it got before the model loads.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(
        f"optimum-ipu serve: listening on http://{host}:{port} ({options.task}, {options.model})", flush=True
    )
    server.run(sockets=[sock])
    if state.load_error is not None:
        print(f"optimum-ipu serve: the model failed to load: {state.load_error}", file=sys.stderr)
        return 1
    return 0
