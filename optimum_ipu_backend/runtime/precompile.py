"""Compile a runner's executables ahead of time, so that serving starts warm.

A real IPU compile takes minutes per shape; ``compile_buckets`` builds every bucket signature a runner
can meet (``StaticShapeRunner.compiled_shapes``) into the executable cache, so a later process loads
them and compiles nothing. Engines that declare themselves thread-safe compile several signatures at
once; the Poplar SDK engines compile one after another in their worker process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from optimum_ipu_backend.runtime.serving import StaticShapeRunner


def compile_buckets(
    runner: StaticShapeRunner,
    *,
    limit: int | None = None,
    fixed_dims: Mapping[str, int] | None = None,
    progress: bool = False,
    parallel: int | None = None,
) -> list[dict[str, Any]]:
    """Build the executable of every bucket signature (the first ``limit`` of them, smallest first);
    returns one record per signature: shapes, branches, ``source`` ("compiled" or "cache"), seconds."""
    table = runner.executables
    signatures = runner.compiled_shapes(fixed_dims)  # ValueError names dimensions without sizes
    signatures.sort(key=lambda signature: sorted(signature[0].items()))
    if limit is not None:
        signatures = signatures[:limit]
    workers = (parallel or 1) if table.engine_thread_safe else 1

    def build(signature) -> dict[str, Any]:
        shapes, branches = signature
        started = time.perf_counter()
        entry = table.entry_for(shapes, branches)
        return {
            "shapes": {name: list(shape) for name, shape in shapes.items()},
            "branches": branches,
            "source": entry.source,
            "seconds": round(time.perf_counter() - started, 3),
        }

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(signatures), desc="compiling buckets", unit="shape")
    records = []
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for record in pool.map(build, signatures):
                records.append(record)
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return records
