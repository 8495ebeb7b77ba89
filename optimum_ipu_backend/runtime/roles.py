"""What each input and each dimension of an exported Hugging Face graph is, declared once.

The exporters name inputs and dynamic axes after what they hold (``input_ids``, ``attention_mask``,
``past_key_values.0.key``, ``batch_size``, ``past_sequence_length``, ...). The runtime needs those roles
for three things only: what a padded position holds (the fill), how many sizes a dimension is compiled
at (the bucket policy), and which inputs to make up for a merged decoder's first step. Whether padding
is *allowed* is never decided here: the padding proof (``compiler.padding``) decides that from
the graph. A new model family with new names is one entry in a table below.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence

from optimum_ipu_backend.runtime.dim_expressions import SymbolicDim, dim_name, parse_dim


class InputRole(enum.Enum):
    TOKEN_IDS = "token ids"
    ATTENTION_MASK = "attention mask"
    TOKEN_TYPES = "token types"
    POSITIONS = "positions"
    PAST = "past keys and values"
    CACHE_BRANCH = "cache branch"
    PIXELS = "pixel values"
    AUDIO = "audio values"
    OTHER = "other"


class DimRole(enum.Enum):
    BATCH = "batch"  # samples: split into micro-batches, padded by repeating real samples
    PAST = "past"  # a key/value cache length: grows one position per generated token
    SEQUENCE = "sequence"  # token positions: compiled at a few sizes up to the model's limit
    OTHER = "other"  # compiled at the size it comes in unless the user gives sizes


#: Marker fill: padded positions continue the real values (last + 1, last + 2, ...).
CONTINUE = "continue"


# First match wins; patterns are matched against the whole input name.
_INPUT_RULES = tuple(
    (role, re.compile(pattern))
    for role, pattern in (
        (InputRole.PAST, r"past_key_values(\..*)?|past_.*\.(key|value)"),
        (InputRole.CACHE_BRANCH, r"use_cache_branch"),
        (InputRole.ATTENTION_MASK, r".*attention_mask|.*_mask"),
        (InputRole.TOKEN_TYPES, r"token_type_ids"),
        (InputRole.POSITIONS, r".*position_ids|cache_position"),
        (InputRole.TOKEN_IDS, r".*input_ids"),
        (InputRole.PIXELS, r"pixel_values|pixel_mask"),
        (InputRole.AUDIO, r"input_features|input_values"),
    )
)


def input_role(name: str) -> InputRole:
    """The role of the graph input called ``name``."""
    for role, pattern in _INPUT_RULES:
        if pattern.fullmatch(name):
            return role
    return InputRole.OTHER


def fill_value(name: str, pad_token_id: int | None) -> int | str:
    """What a padded position of input ``name`` holds: the pad token for token ids, ``CONTINUE`` for
    positions, 0 for everything else (masks, token types, caches, pixel and audio values).

    Without a ``pad_token_id`` token ids are padded with 0, which every vocabulary has; which id pads
    does not matter where the proof shows padded positions are hidden.
    """
    role = input_role(name)
    if role is InputRole.TOKEN_IDS:
        return 0 if pad_token_id is None else int(pad_token_id)
    if role is InputRole.POSITIONS:
        return CONTINUE
    return 0


def dim_role(dim: str) -> DimRole:
    """The role of a dynamic dimension, from the name the exporter gave it."""
    if dim == "batch_size" or dim.endswith("_batch_size"):
        return DimRole.BATCH
    if dim.startswith("past_"):
        return DimRole.PAST
    if dim.endswith("sequence_length"):
        return DimRole.SEQUENCE
    return DimRole.OTHER


def is_batch_dim(dim: str) -> bool:
    return dim_role(dim) is DimRole.BATCH


def is_past_dim(dim: str) -> bool:
    return dim_role(dim) is DimRole.PAST


def generation_step_dims(input_shapes: Mapping[str, Sequence[SymbolicDim]]) -> frozenset[str]:
    """The dimensions that count the new tokens of a generation step: in a graph that reads a key/value
    cache, the dimensions of its token and position inputs besides the batch. Each step of generation
    feeds one new token along them, so they are compiled at size 1 too (``BucketPlan.for_dims``).

    Found from the inputs' roles, not from how the dimensions are called: exports name the new tokens
    ``sequence_length``, ``decoder_sequence_length`` or anything else, and their past
    ``past_sequence_length`` whatever the new tokens are called (optimum's image-to-text decoders do)."""
    if not any(input_role(name) is InputRole.PAST for name in input_shapes):
        return frozenset()
    dims: set[str] = set()
    for name, shape in input_shapes.items():
        if input_role(name) not in (InputRole.TOKEN_IDS, InputRole.POSITIONS):
            continue
        for dim in shape:
            label = dim_name(dim)
            if label is not None and not is_batch_dim(label):
                dims.add(label)
    return frozenset(dims)


# ONNX element types of floating-point tensors (TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16).
_FLOAT_ELEM_TYPES = frozenset({1, 10, 11, 16})


def audio_sample_dims(
    input_shapes: Mapping[str, Sequence[SymbolicDim]], elem_types: Mapping[str, int]
) -> frozenset[str]:
    """The dimensions that count raw audio samples: axis 1 of a rank-2 floating-point audio input
    (``input_values [batch, samples]`` of wav2vec2, HuBERT, WavLM, SEW, Data2VecAudio...). They get a
    plan of audio sizes (``buckets.audio_sample_sizes``), not the text one. Whisper's ``input_features``
    (rank 3, mel frames the feature extractor fixes) is no such input."""
    dims: set[str] = set()
    for name, shape in input_shapes.items():
        if input_role(name) is not InputRole.AUDIO or len(shape) != 2:
            continue
        if elem_types.get(name) not in _FLOAT_ELEM_TYPES:
            continue
        label = dim_name(shape[1])
        if label is not None and not is_batch_dim(label):
            dims.add(label)
    return frozenset(dims)


#: Roles of the inputs of text models: their dimensions are proven lazily, at the first call (proving them
#: when a session is created costs text models most of a second and their padding is rarely exact).
TEXT_ROLES = frozenset(
    {
        InputRole.TOKEN_IDS,
        InputRole.ATTENTION_MASK,
        InputRole.TOKEN_TYPES,
        InputRole.POSITIONS,
        InputRole.PAST,
    }
)


def text_dims(input_shapes: Mapping[str, Sequence[SymbolicDim]]) -> frozenset[str]:
    """Every dimension name that an input with a text role (``TEXT_ROLES``) carries."""
    dims: set[str] = set()
    for name, shape in input_shapes.items():
        if input_role(name) in TEXT_ROLES:
            for dim in shape:
                expression = parse_dim(dim)
                if expression is not None:
                    dims |= expression.symbols
    return frozenset(dims)
