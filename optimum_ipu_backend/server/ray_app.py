"""``optimum-ipu serve --ray``: the same app as a Ray Serve deployment (docs/deployment.md).

One replica per IPU partition: each replica declares the Ray custom resource ``{"IPU": n}``, so Ray places
replicas only on nodes started with that resource (``ray start --resources='{"IPU": 4}'``), and each
replica opens its own session (and its own writable cache beside the fleet's shared layer). The app is
built on the replica by a builder function (Ray Serve's ASGI ingress), with the model loaded before the
replica reports ready. Ray Serve restarts a replica that dies; a request that was on it fails with a 5xx
(Ray Serve does not retry HTTP requests; clients retry, as documented).
"""

from __future__ import annotations

import argparse
import os
import signal
from functools import partial
from typing import Any

from optimum_ipu_backend.server.app import DEFAULT_MAX_CONCURRENT_REQUESTS, create_app
from optimum_ipu_backend.server.models import ServedModel, ServeOptions

APP_NAME = "optimum-ipu"
#: The settings a replica needs from the environment of the command that deployed it.
FORWARDED_ENV_PREFIXES = ("OPTIMUM_IPU_", "OPTIMUM_PROVIDER", "HF_", "TRANSFORMERS_", "POPLAR_", "IPUOF_")


def build_replica_app(options: ServeOptions, max_concurrent_requests: int) -> Any:
    """Runs on each replica: the model, loaded now, behind the app."""
    return create_app(
        partial(ServedModel, options), max_concurrent_requests=max_concurrent_requests, preload=True
    )


def deployment(options: ServeOptions, args: argparse.Namespace) -> Any:
    """The Ray Serve application of ``options``, as the command line sizes it."""
    from ray import serve

    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        autoscaling = {
            "min_replicas": args.min_replicas if args.min_replicas is not None else 1,
            "max_replicas": args.max_replicas if args.max_replicas is not None else args.replicas,
            "initial_replicas": args.replicas,
        }
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    limit = args.max_concurrent_requests or DEFAULT_MAX_CONCURRENT_REQUESTS

    def build() -> Any:  # a function (not a partial): Ray Serve calls it on the replica to get the app
        return build_replica_app(options, limit)

    replica_class = serve.ingress(build)()
    settings: dict[str, Any] = {
        "name": "optimum-ipu-serve",
        "ray_actor_options": {
            "num_cpus": 0,  # placed by IPUs, not CPUs
            "resources": {"IPU": args.ipus_per_replica},
            "runtime_env": {"env_vars": env},
        },
        "max_ongoing_requests": args.max_ongoing_requests,
        "graceful_shutdown_timeout_s": args.drain_timeout,
        # a stopping replica looks for requests still in flight this often (Ray Serve's default, 2 s, keeps an
        # idle replica waiting that long before it stops)
        "graceful_shutdown_wait_loop_s": 0.25,
    }
    if autoscaling is not None:
        settings["autoscaling_config"] = autoscaling
    else:
        settings["num_replicas"] = args.replicas
    return serve.deployment(replica_class, **settings).bind()


def run_on_ray(options: ServeOptions, args: argparse.Namespace) -> int:
    """Deploy on the Ray cluster at ``--ray-address`` (or ``RAY_ADDRESS``), serve until SIGTERM or SIGINT,
    then delete the application (Ray Serve drains its replicas)."""
    import ray
    from ray import serve

    ray.init(address=args.ray_address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    # By default one HTTP proxy, on the head node: every replica is reached through it.
    serve.start(proxy_location=args.ray_proxy_location, http_options={"host": args.host, "port": args.port})
    serve.run(deployment(options, args), name=APP_NAME, route_prefix="/", blocking=False)
    print(
        f"optimum-ipu serve: listening on http://{args.host}:{args.port} ({options.task}, {options.model}; "
        f"Ray Serve, {args.replicas} replica(s))",
        flush=True,
    )
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    return 0
