"""Assembles the runtime for one ONNX graph: bucket plan, executable table, cache, serving runner."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.engines.base import CompileOptions, Engine
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.buckets import DEFAULT_SAMPLING_RATE, BucketPlan, model_limit
from optimum_ipu_backend.runtime.cache_files import PROOFS_DIR
from optimum_ipu_backend.runtime.dim_expressions import parse_dim
from optimum_ipu_backend.runtime.executable_cache import ExecutableCache
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.graph_source import GraphSource
from optimum_ipu_backend.runtime.ipu_config import IPURuntimeConfig
from optimum_ipu_backend.runtime.padding import PaddingDecisions
from optimum_ipu_backend.runtime.progress import progress_enabled
from optimum_ipu_backend.runtime.roles import audio_sample_dims, fill_value, generation_step_dims
from optimum_ipu_backend.runtime.serving import ServingConfig, StaticShapeRunner

_logger = logging.getLogger(__name__)


def open_cache(runtime: IPURuntimeConfig) -> ExecutableCache | None:
    """The executable cache the settings ask for, or None when it is disabled."""
    if not runtime.cache_enabled:
        return None
    return ExecutableCache(runtime.executable_cache_dir, runtime.cache_size_limit)


def _max_position_id(config: Mapping[str, Any]) -> int | None:
    limit, _ = model_limit(config, "sequence_length")
    return None if limit is None else limit - 1


def sampling_rate(model_dir: Path | None) -> int:
    """The audio sampling rate of the feature extractor saved beside the model
    (``preprocessor_config.json``), or ``DEFAULT_SAMPLING_RATE`` when there is none."""
    if model_dir is not None:
        try:
            stored = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            stored = None
        rate = stored.get("sampling_rate") if isinstance(stored, dict) else None
        if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0:
            return rate
    return DEFAULT_SAMPLING_RATE


def dynamic_dims(input_shapes: Mapping[str, Any]) -> list[str]:
    """Every dimension name the inputs' declared shapes use, in order of first appearance."""
    dims: list[str] = []
    for shape in input_shapes.values():
        for dim in shape:
            parsed = parse_dim(dim)
            if parsed is not None:
                dims.extend(name for name in sorted(parsed.symbols) if name not in dims)
    return dims


def pipeline_device_iterations(runtime: IPURuntimeConfig, engine: Engine) -> int:
    """``device_iterations``, raised to fill the pipeline of a model sharded over several IPUs.

    A pipeline of N stages (at most one per IPU of a replica) runs only with at least N batches per step
    (PopART refuses fewer), so a sharded model's steps take ``max(device_iterations, ipus_per_replica)``
    micro-batches; the runtime pads a short last step as it does for any step.
    """
    if runtime.ipus_per_replica == 1:
        return runtime.device_iterations
    if not engine.shards:
        raise ConfigurationError(
            f"ipus_per_replica={runtime.ipus_per_replica} "
            f"({runtime.sources.get('ipus_per_replica', 'set')}): the {engine.name} engine runs each replica "
            "on one IPU; use engine='popart' to shard a model over several IPUs, or set ipus_per_replica to 1"
        )
    if runtime.device_iterations < runtime.ipus_per_replica:
        _logger.info(
            "device_iterations raised from %d to %d to fill the %d-IPU pipeline",
            runtime.device_iterations,
            runtime.ipus_per_replica,
            runtime.ipus_per_replica,
        )
    return max(runtime.device_iterations, runtime.ipus_per_replica)


def build_runner(
    source: GraphSource,
    cache: ExecutableCache | None,
    engine: Engine,
    device: str,
    runtime: IPURuntimeConfig,
    *,
    precision: str,
    threads: int | None,
    progress: bool | None,
    trim_padding: bool = False,
    config: Mapping[str, Any],
    output_dtypes: Mapping[str, np.dtype],
    compile_settings: Mapping[str, Any] | None = None,
) -> StaticShapeRunner:
    description = source.description
    input_shapes = {name: tuple(dims) for name, dims in description.served_inputs.items()}
    elem_types = {name: elem_type for name, _, elem_type in description.inputs}
    audio_dims = audio_sample_dims(input_shapes, elem_types)
    rate = sampling_rate(None if source.path is None else source.path.parent) if audio_dims else 0
    plan = BucketPlan.for_dims(
        config,
        dynamic_dims(input_shapes),
        user_sizes=runtime.bucket_options(),
        sizes_per_dimension=runtime.sizes_per_dimension,
        step_dims=generation_step_dims(input_shapes),
        audio_dims=dict.fromkeys(audio_dims, rate),
    )
    device_iterations = pipeline_device_iterations(runtime, engine)
    options = CompileOptions(
        device=device,
        precision=precision,
        threads=threads,
        device_iterations=device_iterations,
        replicas=runtime.replication_factor,
        ipus_per_replica=runtime.ipus_per_replica,
        layers_per_ipu=runtime.layers_per_ipu,
        **(compile_settings or {}),  # the session's engine settings (offline, timeout, PopDist share)
    )
    table = ExecutableTable(
        source.served_model,
        engine,
        options,
        graph_digest=description.digest,
        branch_inputs=description.branch_inputs,
        cache=cache,
        progress=progress_enabled(progress),
        model_path=source.path,
    )
    pad_token_id = config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None
    fills = {name: fill_value(name, pad_token_id) for name in input_shapes}
    masks = description.masks()
    left_padded = tuple(mask.dim for mask in masks if mask.side == "left")
    # inputs the runtime makes itself: (mask input, the dimension whose real positions it marks)
    generated = tuple((mask.input, mask.dim) for mask in masks)
    decisions = PaddingDecisions(
        source.served_model,
        input_shapes,
        fills,
        left_padded_dims=left_padded,
        generated_masks=generated,
        store=None if cache is None else cache.root / PROOFS_DIR / description.digest,
        canonical_sizes={dim: plan.canonical_sizes(dim) for dim in plan.dims},
    )
    serving = ServingConfig(
        plan=plan,
        fills=fills,
        max_position_id=_max_position_id(config),
        device_iterations=device_iterations,
        replicas=runtime.replication_factor,
        left_padded_dims=left_padded,
        generated_masks=generated,
        trim_padding=trim_padding,
        max_executables=runtime.max_executables,
        token_counts=tuple(description.token_count_checks()),
    )
    _logger.info("compiled sizes: %s", plan.describe())
    return StaticShapeRunner(table, input_shapes, output_dtypes, serving, decisions)
