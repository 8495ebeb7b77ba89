"""The sizes `optimum-ipu check` legalizes each graph at: those given on the command line, those the model
config fixes, and otherwise those the runtime compiles by default, within the model's limits.

The plan is the session's own (``runtime.open.plan_buckets``, with the model directory's
``ipu_config.json`` and sampling rate), as are dimension roles, expressions and limits, so both agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from optimum_ipu_backend.runtime.buckets import model_limit
from optimum_ipu_backend.runtime.dim_expressions import parse_dim
from optimum_ipu_backend.runtime.ipu_config import load_runtime_config
from optimum_ipu_backend.runtime.open import dynamic_dims, plan_buckets
from optimum_ipu_backend.runtime.roles import DimRole, dim_role, generation_step_dims

#: Number of choices of a multiple-choice graph when none is given (the runtime feeds it as it comes).
_DEFAULT_CHOICES = 2


def config_dims(config: Mapping[str, Any]) -> dict[str, int]:
    """Sizes the model config fixes (image sides, channels, mel bins, Whisper's encoder length): the
    runtime compiles these at the size the preprocessor produces, so they are not bucketed."""
    dims: dict[str, int] = {"num_choices": _DEFAULT_CHOICES}
    vision = config.get("vision_config")
    vision = (
        {**vision, **config} if isinstance(vision, Mapping) else config
    )  # CLIP-style: a vision sub-config
    image_size = vision.get("image_size")
    if isinstance(image_size, int):
        dims["height"] = dims["width"] = image_size
    elif isinstance(image_size, (list, tuple)) and len(image_size) == 2:
        dims["height"], dims["width"] = int(image_size[0]), int(image_size[1])
    if isinstance(vision.get("num_channels"), int):
        dims["num_channels"] = vision["num_channels"]
    if config.get("model_type") == "whisper":
        # The encoder reads exactly 2 * max_source_positions mel frames (a static input in the export);
        # optimum's "encoder_sequence_length" on the decoder side is the encoder's output length.
        frames = int(config.get("max_source_positions", 1500))
        dims["feature_size"] = int(config.get("num_mel_bins", 80))
        dims["encoder_sequence_length"] = frames
        dims["past_encoder_sequence_length"] = frames
    return dims


def graph_inputs(model: onnx.ModelProto) -> dict[str, tuple[list[str | int], int]]:
    """Each input a caller feeds (initializers excluded): its symbolic shape and ONNX element type."""
    initializers = {init.name for init in model.graph.initializer}
    return {
        value.name: (
            [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim],
            value.type.tensor_type.elem_type,
        )
        for value in model.graph.input
        if value.name not in initializers
    }


@dataclass
class GraphSizes:
    """The size of every dimension of one graph, and each size the model does not allow."""

    dims: dict[str, int]
    over_limit: list[str] = field(default_factory=list)


def graph_sizes(
    model: onnx.ModelProto,
    config: Mapping[str, Any],
    explicit: Mapping[str, int],
    bindings: Mapping[str, bool] | None = None,
    model_dir: Path | None = None,
) -> GraphSizes:
    """Sizes for the graph's dimensions: ``explicit`` ones, those the config fixes, else by the role the
    runtime gives each dimension (``runtime.roles``) and its default plan: the smallest batch, the largest
    compiled sequence, one new token beside a past and the largest planned past that leaves room for it.
    A merged decoder bound to its no-cache branch reads no past: the prompt gets the largest size and the
    past a placeholder. Other dimensions (the runtime compiles them as they come) need ``--dim``.
    """
    inputs = graph_inputs(model)
    input_shapes = {name: shape for name, (shape, _) in inputs.items()}
    names = dynamic_dims(input_shapes)  # ``past + sequence`` counts both names
    steps = generation_step_dims(input_shapes)
    fixed = config_dims(config)
    elem_types = {name: elem_type for name, (_, elem_type) in inputs.items()}
    plan = plan_buckets(input_shapes, elem_types, config, load_runtime_config(model_dir), model_dir)
    reads_past = not bindings or all(bindings.values())
    sizes: dict[str, int] = {}

    def planned(name: str) -> tuple[int, ...]:
        return plan.sizes.get(name, (1,))

    for name in sorted(names, key=lambda n: n.startswith("past_")):  # a past's sizes depend on the new tokens
        if name in explicit:
            sizes[name] = explicit[name]
        elif name in fixed:
            sizes[name] = fixed[name]
        elif dim_role(name) is DimRole.PAST and name.removeprefix("past_") in sizes:
            new = sizes[name.removeprefix("past_")]
            limit, _ = model_limit(config, name.removeprefix("past_"))
            fitting = [size for size in planned(name) if limit is None or size + new <= limit]
            if not reads_past:
                sizes[name] = planned(name)[0]  # a placeholder the branch never reads
            else:
                sizes[name] = fitting[-1] if fitting else max(planned(name)[0], (limit or 0) - new)
        elif dim_role(name) is DimRole.BATCH:
            sizes[name] = planned(name)[0]  # one call's worth; --dim batch_size=N checks a larger one
        elif name in steps and reads_past:
            sizes[name] = 1  # one generated token per step
        elif dim_role(name) in (DimRole.SEQUENCE, DimRole.PAST):
            sizes[name] = planned(name)[-1]
        # Any other name (an image side without a config, a custom dimension) is left unsized, and
        # legalize() names the input that needs --dim.
    return GraphSizes(sizes, _over_limit(config, sizes, reads_past))


def _over_limit(config: Mapping[str, Any], sizes: Mapping[str, int], reads_past: bool) -> list[str]:
    problems = []
    for name, size in sizes.items():
        if dim_role(name) not in (DimRole.SEQUENCE, DimRole.PAST):
            continue  # positions bound lengths only (not image sides, channels or batch)
        limit, source = model_limit(config, name.removeprefix("past_"))
        if limit is None:
            continue
        where = f"the model's {limit} positions ({source} in config.json)"
        if not name.startswith("past_") and size > limit:
            problems.append(f"{name} {size} is over {where}; lower --dim {name}")
        elif name.startswith("past_") and reads_past and name.removeprefix("past_") in sizes:
            new = sizes[name.removeprefix("past_")]
            if size + new > limit:
                problems.append(
                    f"{name} {size} + {name.removeprefix('past_')} {new} = {size + new} positions is over "
                    f"{where}; lower --dim {name}"
                )
    return problems


def resolve_input_shapes(
    model: onnx.ModelProto, dims: Mapping[str, int], shapes: Mapping[str, Sequence[int]]
) -> dict[str, list[int]]:
    """Static shapes for the graph inputs; a dim nothing sizes is left out for legalize() to report."""
    initializers = {init.name for init in model.graph.initializer}
    resolved: dict[str, list[int]] = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        if graph_input.name in shapes:
            resolved[graph_input.name] = list(shapes[graph_input.name])
            continue
        sizes: list[int] = []
        for dim in graph_input.type.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                sizes.append(dim.dim_value)
                continue
            expression = parse_dim(dim.dim_param) if dim.dim_param else None
            try:
                sizes.append(expression.evaluate(dims))
            except (AttributeError, KeyError):
                break
        else:
            resolved[graph_input.name] = sizes
    return resolved
