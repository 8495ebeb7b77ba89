"""Assembles the runtime for one ONNX graph: bucket plan, executable table, cache, serving runner."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

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
from optimum_ipu_backend.runtime.ipu_config import IPURuntimeConfig
from optimum_ipu_backend.runtime.padding import SymbolicShape
from optimum_ipu_backend.runtime.progress import progress_enabled
from optimum_ipu_backend.runtime.serving import BATCH_DIM, ServingConfig, StaticShapeRunner, bucketable_dims

_logger = logging.getLogger(__name__)

# Micro-batch sizes compiled when the user sets none: a call of N rows pads to the next one.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
_HASH_CHUNK = 1 << 20


def graph_digest(path_or_bytes: str | os.PathLike | bytes, model: onnx.ModelProto) -> str:
    """sha256 of the exported graph and its external weights: the identity of the cache entries."""
    digest = hashlib.sha256()
    if isinstance(path_or_bytes, (bytes, bytearray)):
        digest.update(path_or_bytes)
        return digest.hexdigest()
    path = Path(path_or_bytes)
    files = [path]
    locations = {
        entry.value
        for tensor in model.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    files.extend(path.parent / location for location in sorted(locations))
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _symbolic_shapes(values) -> dict[str, SymbolicShape]:
    shapes = {}
    for value in values:
        dims: list[Any] = []
        for dim in value.type.tensor_type.shape.dim:
            dims.append(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None))
        shapes[value.name] = tuple(dims)
    return shapes


def _past_padding(model: onnx.ModelProto):
    """The graph rewrite that lets a decoder's past be padded, when the graph needs one."""
    try:
        from optimum_ipu_backend.compiler.passes.mask_padded_past import add_past_padding_mask
    except ModuleNotFoundError:
        return None
    try:
        return add_past_padding_mask(model)
    except ValueError as exc:
        # Not provably safe to pad (e.g. a merged decoder): compile the past at the size it comes in.
        _logger.info("the decoder's past is compiled per length: %s", exc)
        return None


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


class RuntimeRunner:
    """What the session holds: the serving runner plus what it reports."""

    def __init__(
        self, runner: StaticShapeRunner, table: ExecutableTable, cache: ExecutableCache | None
    ) -> None:
        self._runner = runner
        self._table = table
        self._cache = cache

    @property
    def plan(self) -> BucketPlan:
        return self._runner.plan

    @property
    def cache_description(self) -> str:
        return "disabled" if self._cache is None else str(self._cache.root)

    def run(self, feed: Mapping[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        return self._runner.run(feed, output_names)

    def statistics(self) -> list[dict[str, object]]:
        return self._table.statistics()


def build_runner(
    model: onnx.ModelProto,
    digest: str,
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
) -> RuntimeRunner:
    rewrite = _past_padding(model)
    served = rewrite.model if rewrite is not None else model
    input_shapes = _symbolic_shapes(
        v for v in served.graph.input if v.name not in {i.name for i in served.graph.initializer}
    )
    output_shapes = _symbolic_shapes(served.graph.output)
    extra_masked = [rewrite.past_dim] if rewrite is not None else []
    plan = build_plan(config, bucketable_dims(input_shapes, extra_masked), runtime)
    cache = None
    if runtime.cache_enabled:
        cache = ExecutableCache(runtime.executable_cache_dir, runtime.cache_size_limit)
    options = CompileOptions(
        device=device,
        precision=precision,
        threads=threads,
        device_iterations=runtime.device_iterations,
        replicas=runtime.replication_factor,
    )
    table = ExecutableTable(
        served, engine, options, graph_digest=digest, cache=cache, progress=progress_enabled(progress)
    )
    serving = ServingConfig(
        plan=plan,
        pad_token_id=config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None,
        max_position_id=_max_position_id(config),
        device_iterations=runtime.device_iterations,
        replicas=runtime.replication_factor,
        left_padded_dims=tuple(extra_masked),
        generated_masks=((rewrite.mask_input, rewrite.past_dim),) if rewrite is not None else (),
        trim_padding=trim_padding,
    )
    runner = StaticShapeRunner(table, input_shapes, output_shapes, output_dtypes, serving)
    _logger.info("compiled sizes: %s", plan.describe())
    return RuntimeRunner(runner, table, cache)
