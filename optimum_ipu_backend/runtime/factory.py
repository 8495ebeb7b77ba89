"""Assembles the runtime for one ONNX graph: bucket plan, executable table, cache, serving runner."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from optimum_ipu_backend.engines.base import CompileOptions, Engine
from optimum_ipu_backend.runtime.buckets import (
    BucketPlan,
    is_batch_dim,
    is_past_dim,
    model_limit,
    option_name,
)
from optimum_ipu_backend.runtime.executable_cache import ExecutableCache
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.graph_source import GraphSource
from optimum_ipu_backend.runtime.ipu_config import IPURuntimeConfig
from optimum_ipu_backend.runtime.progress import progress_enabled
from optimum_ipu_backend.runtime.serving import BATCH_DIM, ServingConfig, StaticShapeRunner, bucketable_dims

_logger = logging.getLogger(__name__)

# Micro-batch sizes compiled when the user sets none: a call of N rows pads to the next one.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)


def open_cache(runtime: IPURuntimeConfig) -> ExecutableCache | None:
    """The executable cache the settings ask for, or None when it is disabled."""
    if not runtime.cache_enabled:
        return None
    return ExecutableCache(runtime.executable_cache_dir, runtime.cache_size_limit)


def _max_position_id(config: Mapping[str, Any]) -> int | None:
    limit, _ = model_limit(config, "sequence_length")
    return None if limit is None else limit - 1


def build_plan(config: Mapping[str, Any], dims: list[str], runtime: IPURuntimeConfig) -> BucketPlan:
    """Compiled sizes per dimension. Executables are compiled lazily, only for the shapes calls need,
    so each dimension gets its own sizes rather than a share of a product: one sequence per call uses
    at most ``max_executables`` of them. A past (key/value cache) grows by one per generated token,
    so its default sizes are powers of two, which keeps a generation to a few executables."""
    overrides = runtime.bucket_options()
    sizes: dict[str, tuple[int, ...]] = {}
    limits: dict[str, int | None] = {}
    sources: dict[str, str | None] = {}
    for dim in dims:
        if is_batch_dim(dim):
            continue
        plan = BucketPlan.from_options(config, [dim], overrides, runtime.max_executables)
        dim_sizes = plan.sizes[dim]
        limits[dim], sources[dim] = plan.limits.get(dim), plan.limit_sources.get(dim)
        if is_past_dim(dim) and option_name(dim) not in overrides:
            largest = dim_sizes[-1]
            dim_sizes = tuple(sorted({min(2**k, largest) for k in range(3, largest.bit_length() + 1)}))
        if f"past_{dim}" in dims and 1 not in dim_sizes:
            dim_sizes = (1, *dim_sizes)  # the one-token steps of generation
        sizes[dim] = dim_sizes
    if BATCH_DIM in dims:
        sizes[BATCH_DIM] = runtime.batch_size or DEFAULT_BATCH_SIZES
    return BucketPlan(sizes, limits, sources)


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
) -> StaticShapeRunner:
    description = source.description
    input_shapes = {name: tuple(dims) for name, dims in description.served_inputs.items()}
    output_shapes = {name: tuple(dims) for name, dims in description.served_outputs.items()}
    extra_masked = [description.past_dim] if description.past_dim else []
    plan = build_plan(config, bucketable_dims(input_shapes, extra_masked), runtime)
    options = CompileOptions(
        device=device,
        precision=precision,
        threads=threads,
        device_iterations=runtime.device_iterations,
        replicas=runtime.replication_factor,
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
    mask = description.past_mask_input
    serving = ServingConfig(
        plan=plan,
        pad_token_id=config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None,
        max_position_id=_max_position_id(config),
        device_iterations=runtime.device_iterations,
        replicas=runtime.replication_factor,
        left_padded_dims=tuple(extra_masked),
        generated_masks=((mask, description.past_dim),) if mask else (),
        trim_padding=trim_padding,
    )
    _logger.info("compiled sizes: %s", plan.describe())
    return StaticShapeRunner(table, input_shapes, output_shapes, output_dtypes, serving)
