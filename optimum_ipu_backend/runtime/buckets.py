"""Compiled sizes ("buckets") for the dynamic dimensions of an exported graph: the one bucket policy.

An IPU executable has one fixed shape and compiling one takes minutes, so dynamic ONNX dimensions
(``dim_param``: ``batch_size``, ``sequence_length``, ``past_sequence_length``, ...) are served from a small
sorted set of compiled sizes. A call is padded up to the smallest size that holds it
(``BucketPlan.choose``) where the padding proof allows it; an input larger than the largest size is an
error (``InputTooLargeError``), never a silent truncation. Executables are compiled lazily, only for the
shapes calls need, so each dimension gets its own sizes rather than a share of a product.

The plan a session uses (``BucketPlan.for_dims``), by the dimension's role (``runtime.roles``):

* **Batch** dimensions: the sizes of ``batch_size`` (default ``1, 2, 4, 8``). A call's samples are split
  into micro-batches of one of these sizes; the last one is filled by repeating real samples.
* **Sequence** dimensions (``sequence_length``, ``encoder_sequence_length``, ...): ``sizes_per_dimension``
  sizes (default 16) spaced geometrically from 8 up to the model's maximum positions
  (``max_position_embeddings``, ``n_positions``, Whisper's ``max_source_positions`` /
  ``max_target_positions``, ...; 512 when the config states none, and never more than 2048 by default
  because an executable for longer inputs rarely fits an IPU's memory), rounded up to multiples of 4.
  Geometric spacing bounds the worst-case waste of every bucket by the same ratio, and text lengths are
  roughly log-normal, so it wastes far less than powers of two for the same number of executables. On
  the Python standard library's docstring paragraphs tokenized for MiniLM (median 18 tokens) the 16
  buckets ``8, 12, 16, 20, 28, 32, 44, 56, 76, 100, 128, 172, 224, 296, 392, 512`` compute 0.88 real
  tokens per computed token for one sequence per call, against 0.70 for powers of two 16..512 and 0.90
  for the best possible 16 buckets fitted to that very data (``benchmarks/bench_padding.py``). The
  dimensions of the new tokens of a graph that reads a key/value cache (``roles.generation_step_dims``)
  also get size 1, so each generated token runs unpadded, whatever the export calls them.
* **Past** dimensions (a key/value cache length): powers of two from 8 up to the model's maximum, because
  the cache grows by one position per generated token and a generation should cross few sizes.
* **Audio samples** (the samples axis of a rank-2 float audio input such as wav2vec2's ``input_values``
  ``[batch, samples]``, found by ``roles.audio_sample_dims``): ten sizes spaced geometrically from 1 s to
  30 s of audio at the feature extractor's ``sampling_rate`` (16 kHz when none is known), rounded up to
  whole 10 ms: at 16 kHz ``16000, 23360, 34080, 49760, 72640, 105920, 154560, 225440, 328960, 480000``,
  so clips of 1 to 10 s use at most 8 of them (``audio_sample_sizes``). The text limits
  (``max_position_embeddings``...) never apply to samples. These sizes matter only where the padding proof
  lets the samples be padded; a samples axis the proof keeps exact is compiled at each length it comes in.
* **Other** dimensions (image sizes, choices, Whisper's feature frames): no sizes; they are compiled at the
  size they come in, unless the user gives sizes.

A dimension compiled at exact sizes (its padding not proven invisible, ``runtime.padding``) is
limited only by the model's own limit, never by its plan's largest size; only a padded dimension past
its plan is refused with ``InputTooLargeError`` naming the option that raises it.

Users choose sizes with provider options (``sequence_lengths="64,128,256,512"``, ``batch_size=8``,
``past_sequence_lengths=...``; see ``option_name``) or the same keys in ``ipu_config.json``; those are
kept as given, and checked against the model's own limit. How many executables a session may compile in
all is a separate, optional cap (``max_executables``, enforced by the runtime).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optimum_ipu_backend.config import positive_int_or_none
from optimum_ipu_backend.errors import ConfigurationError, InvalidFeedError
from optimum_ipu_backend.runtime.roles import DimRole, dim_role, is_batch_dim

# Smallest default bucket of a sequence-like dimension: one sequence of a few words still pads to at most 8.
DEFAULT_SMALLEST_SIZE = 8
# Largest default bucket when the config states no limit (T5's relative positions, for example).
FALLBACK_LARGEST_SIZE = 512
# Default buckets stop here even when the model allows more; users raise it explicitly.
DEFAULT_LARGEST_CAP = 2048
# Default buckets above 2 * this are rounded up to a multiple of it: tile-friendly sizes, little waste.
SIZE_MULTIPLE = 4
DEFAULT_SIZES_PER_DIMENSION = 16
#: Micro-batch sizes compiled when the user sets none.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
#: Packed rows (``dynamic_batching``) also come at every multiple of this many tokens up to the largest
#: sequence size: a group of requests fills its last row only partly, and finer lengths waste less of it
#: (docs/performance.md, "Packed rows and the dynamic batcher").
PACKED_ROW_STEP = 32
#: Audio sizes: from this many seconds to that many, at the feature extractor's sampling rate.
AUDIO_SHORTEST_SECONDS = 1
AUDIO_LONGEST_SECONDS = 30
AUDIO_SIZES = 10
#: Sampling rate assumed when the model ships no ``preprocessor_config.json`` (wav2vec2 and its kin).
DEFAULT_SAMPLING_RATE = 16000

# Config keys holding a model's maximum number of positions, by the role of the dimension, in order.
_PLAIN_LIMIT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)
_ENCODER_LIMIT_KEYS = ("max_source_positions", "max_encoder_position_embeddings", *_PLAIN_LIMIT_KEYS)
_DECODER_LIMIT_KEYS = ("max_target_positions", "max_decoder_position_embeddings", *_PLAIN_LIMIT_KEYS)
# Sub-configs searched when the top level has no limit (multimodal and composite configs).
_SUB_CONFIG_KEYS = ("text_config", "decoder", "encoder")
# RoBERTa-style models number positions from pad_token_id + 1, so fewer tokens fit than there are positions.
_POSITION_OFFSET_MODEL_TYPES = frozenset(
    {
        "roberta",
        "camembert",
        "xlm-roberta",
        "xlm-roberta-xl",
        "data2vec-text",
        "longformer",
        "roberta-prelayernorm",
    }
)


class BucketOptionError(ConfigurationError):
    """A user-given list of compiled sizes is malformed or exceeds what the model allows."""


class InputTooLargeError(InvalidFeedError):
    """An input does not fit the largest compiled size of one of its dimensions."""

    def __init__(
        self,
        *,
        input_name: str | None,
        dim_name: str,
        size: int,
        largest: int | None,
        option: str,
        sizes: Sequence[int],
        model_limit: int | None,
        limit_source: str | None,
    ) -> None:
        self.input_name, self.size, self.largest = input_name, size, largest
        subject = f"input {input_name!r}" if input_name else "an input"
        readable_dim = dim_name.replace("_", " ")
        if largest is None:  # compiled at exact sizes: only the model's own limit applies
            message = f"{subject} has {dim_name} {size} but "
        else:
            message = (
                f"{subject} has {dim_name} {size} but the largest compiled {readable_dim} is {largest}; "
            )
        if model_limit is not None and size > model_limit:
            source = f" ({limit_source} in the model config)" if limit_source else ""
            message += (
                f"the model itself allows at most {model_limit}{source}, so shorten the input "
                f"(for example tokenizer(..., truncation=True, max_length={model_limit}))"
            )
        else:
            suggestion = 1 << max(size - 1, 1).bit_length()
            if model_limit is not None:
                suggestion = min(suggestion, model_limit)
            raised = ",".join(str(s) for s in (*sizes, suggestion))
            assert largest is not None, "an exact dimension is refused only past the model's limit"
            message += f"raise it with provider_options={{{option!r}: {raised!r}}}"
            if model_limit is not None:
                message += f" (the model allows at most {model_limit})"
            else:
                message += " (the model config states no limit)"
        super().__init__(message)


def option_name(dim_name: str) -> str:
    """The provider option / ``ipu_config.json`` key that sets the compiled sizes of ``dim_name``.

    ``batch_size`` -> ``batch_size``; ``sequence_length`` -> ``sequence_lengths``;
    ``past_sequence_length`` -> ``past_sequence_lengths``; other names get an ``s`` when they end in
    ``length`` and are used as they are otherwise.
    """
    if is_batch_dim(dim_name):
        return dim_name
    return f"{dim_name}s" if dim_name.endswith("length") else dim_name


def parse_sizes(option: str, value: Any) -> tuple[int, ...]:
    """Parse the value of a sizes option into a sorted tuple of distinct positive ints.

    Accepts an int, a comma-separated string (``"64,128,256"``, optionally in brackets, as provider
    options arrive as strings), or a sequence of ints / digit strings. Raises ``BucketOptionError`` that
    names ``option`` for anything else.
    """
    if isinstance(value, bool):
        raise BucketOptionError(f"option {option!r}={value!r}: expected sizes such as '64,128,256,512'")
    if isinstance(value, int):
        items: list[Any] = [value]
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")) and text.endswith(("]", ")")):
            text = text[1:-1]
        items = [part.strip() for part in text.split(",")]
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise BucketOptionError(
            f"option {option!r}={value!r}: expected an int, a comma-separated string such as "
            f"'64,128,256,512' or a list of ints, not {type(value).__name__}"
        )
    sizes = []
    for item in items:
        size = positive_int_or_none(item)
        if size is None:
            raise BucketOptionError(
                f"option {option!r}={value!r}: {item!r} is not a positive integer; "
                "expected comma-separated sizes such as '64,128,256,512'"
            )
        sizes.append(size)
    if not sizes:
        raise BucketOptionError(f"option {option!r} is empty; expected sizes such as '64,128,256,512'")
    return tuple(sorted(set(sizes)))


def packed_row_lengths(sequence_sizes: Sequence[int]) -> tuple[int, ...]:
    """The row lengths packed steps are compiled at: the sequence sizes and every multiple of
    ``PACKED_ROW_STEP`` up to the largest of them."""
    largest = max(sequence_sizes)
    return tuple(sorted({*sequence_sizes, *range(PACKED_ROW_STEP, largest + 1, PACKED_ROW_STEP)}))


def audio_sample_sizes(sampling_rate: int = DEFAULT_SAMPLING_RATE) -> tuple[int, ...]:
    """The default compiled sizes of an audio samples axis: ``AUDIO_SIZES`` sizes spaced geometrically from
    1 s to 30 s at ``sampling_rate``, rounded up to whole 10 ms (at 16 kHz ``16000, 23360, 34080, 49760,
    72640, 105920, 154560, 225440, 328960, 480000``: a clip of 1 to 10 s pads by at most 46%, and such
    clips use at most 8 sizes)."""
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int) or sampling_rate < 1:
        raise ValueError(f"sampling_rate must be a positive integer, got {sampling_rate!r}")
    return geometric_sizes(
        AUDIO_SHORTEST_SECONDS * sampling_rate,
        AUDIO_LONGEST_SECONDS * sampling_rate,
        AUDIO_SIZES,
        multiple=max(1, sampling_rate // 100),
    )


def model_limit(config: Mapping[str, Any], dim_name: str) -> tuple[int | None, str | None]:
    """The largest size the model accepts along ``dim_name`` and the config key it came from.

    Batch dimensions have no limit. ``(None, None)`` when the config states none.
    """
    if is_batch_dim(dim_name):
        return None, None
    base = dim_name.removeprefix("past_")
    if base.startswith("encoder"):
        keys = _ENCODER_LIMIT_KEYS
    elif base.startswith("decoder"):
        keys = _DECODER_LIMIT_KEYS
    else:
        keys = _PLAIN_LIMIT_KEYS
    candidates: list[Mapping[str, Any]] = [config]
    candidates.extend(sub for key in _SUB_CONFIG_KEYS if isinstance(sub := config.get(key), Mapping))
    for candidate in candidates:
        for key in keys:
            value = candidate.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                model_type = candidate.get("model_type", config.get("model_type"))
                pad_token_id = candidate.get("pad_token_id", config.get("pad_token_id"))
                if model_type in _POSITION_OFFSET_MODEL_TYPES and isinstance(pad_token_id, int):
                    return value - pad_token_id - 1, f"{key} - pad_token_id - 1"
                return value, key
    return None, None


def geometric_sizes(
    smallest: int, largest: int, count: int, multiple: int = SIZE_MULTIPLE
) -> tuple[int, ...]:
    """At most ``count`` sizes from ``smallest`` to ``largest`` (both included), spaced geometrically.

    Sizes above ``2 * multiple`` are rounded up to a multiple of ``multiple`` (``largest`` is kept exactly);
    sizes that collapse onto the same value after rounding are kept once.
    """
    if smallest < 1 or largest < smallest or count < 1:
        raise ValueError(f"need 1 <= smallest <= largest and count >= 1, got {smallest}, {largest}, {count}")
    if count == 1 or smallest == largest:
        return (largest,)
    ratio = largest / smallest
    sizes: list[int] = []
    for index in range(count):
        # The small epsilon keeps exact powers (8 * 2.0) from rounding up to the next integer.
        size = math.ceil(smallest * ratio ** (index / (count - 1)) - 1e-9)
        if size > 2 * multiple:
            size = -(-size // multiple) * multiple
        size = min(size, largest)
        if not sizes or size > sizes[-1]:
            sizes.append(size)
    sizes[-1] = largest
    return tuple(sizes)


@dataclass(frozen=True)
class BucketPlan:
    """Compiled sizes per dynamic dimension, plus the model's own limits for error messages.

    ``sizes`` maps each planned dimension name to its sorted tuple of compiled sizes. Dimensions that are
    not planned are not padded: callers compile them at the size they are fed (for example image sizes
    and audio frames that the preprocessor fixes).
    """

    sizes: dict[str, tuple[int, ...]]
    limits: dict[str, int | None] = field(default_factory=dict)
    limit_sources: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for dim, dim_sizes in self.sizes.items():
            if not dim_sizes or list(dim_sizes) != sorted(set(dim_sizes)) or dim_sizes[0] < 1:
                raise ValueError(f"sizes of {dim!r} must be sorted, distinct and positive, got {dim_sizes!r}")

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.sizes)

    def largest(self, dim_name: str) -> int:
        return self._sizes_of(dim_name)[-1]

    def choose(self, dim_name: str, size: int, input_name: str | None = None) -> int:
        """The smallest compiled size >= ``size`` along ``dim_name``.

        Raises ``InputTooLargeError`` (naming ``input_name``, the size, the limit and the option that raises
        it) when ``size`` exceeds the largest bucket, and ``KeyError`` for a dimension the plan lacks.
        """
        sizes = self._sizes_of(dim_name)
        if size < 0:
            raise ValueError(f"{dim_name} cannot be negative, got {size}")
        for bucket in sizes:
            if bucket >= size:
                return bucket
        raise InputTooLargeError(
            input_name=input_name,
            dim_name=dim_name,
            size=size,
            largest=sizes[-1],
            option=option_name(dim_name),
            sizes=sizes,
            model_limit=self.limits.get(dim_name),
            limit_source=self.limit_sources.get(dim_name),
        )

    def check_exact(self, dim_name: str, size: int, input_name: str | None = None) -> None:
        """For a dimension compiled at the exact size it comes in: ``InputTooLargeError`` only when ``size``
        exceeds the model's own limit (the plan's sizes do not bound it, and the message proposes none)."""
        limit = self.limits.get(dim_name)
        if limit is not None and size > limit:
            raise InputTooLargeError(
                input_name=input_name,
                dim_name=dim_name,
                size=size,
                largest=None,
                option=option_name(dim_name),
                sizes=(),
                model_limit=limit,
                limit_source=self.limit_sources.get(dim_name),
            )

    def canonical_sizes(self, dim_name: str) -> tuple[int, int]:
        """A fixed (real size, padded size) pair of ``dim_name`` at which the padding proof decides whether
        the dimension is padded at all: its two smallest compiled sizes (a lone size ``s``: from ``s // 2``
        to ``s``; a lone 1: from 1 to 2). A function of the plan only, so the verdict never depends on
        which calls came first."""
        sizes = self._sizes_of(dim_name)
        if len(sizes) >= 2:
            return sizes[0], sizes[1]
        return (sizes[0] // 2, sizes[0]) if sizes[0] >= 2 else (1, 2)

    def padded_dims(
        self, actual_dims: Mapping[str, int], input_for_dim: Mapping[str, str] | None = None
    ) -> dict[str, int]:
        """Bucket every planned dimension of ``actual_dims``; unplanned dimensions keep their size.

        ``input_for_dim`` names, per dimension, an input that carries it, for the error message.
        """
        input_for_dim = input_for_dim or {}
        return {
            dim: self.choose(dim, size, input_for_dim.get(dim)) if dim in self.sizes else size
            for dim, size in actual_dims.items()
        }

    def to_dict(self) -> dict[str, list[int]]:
        """JSON-friendly form (for cache keys and reports)."""
        return {dim: list(sizes) for dim, sizes in sorted(self.sizes.items())}

    def describe(self) -> str:
        return "; ".join(f"{dim}: {', '.join(map(str, sizes))}" for dim, sizes in self.sizes.items())

    def _sizes_of(self, dim_name: str) -> tuple[int, ...]:
        try:
            return self.sizes[dim_name]
        except KeyError:
            raise KeyError(
                f"dimension {dim_name!r} has no compiled sizes; planned: {', '.join(self.sizes) or 'none'}"
            ) from None

    @classmethod
    def for_dims(
        cls,
        config: Mapping[str, Any],
        dims: Iterable[str],
        *,
        user_sizes: Mapping[str, Any] | None = None,
        sizes_per_dimension: int = DEFAULT_SIZES_PER_DIMENSION,
        step_dims: Iterable[str] = (),
        audio_dims: Mapping[str, int] | None = None,
    ) -> BucketPlan:
        """``planned`` with ``user_sizes`` in any form ``parse_sizes`` accepts (tools, tests)."""
        dims = list(dims)
        names = set(dims) | {option_name(dim) for dim in dims}
        parsed = {
            key: parse_sizes(option_name(key), value)
            for key, value in (user_sizes or {}).items()
            if key in names and value is not None
        }
        return cls.planned(
            config,
            dims,
            parsed,
            sizes_per_dimension=sizes_per_dimension,
            step_dims=step_dims,
            audio_dims=audio_dims,
        )

    @classmethod
    def planned(
        cls,
        config: Mapping[str, Any],
        dims: Iterable[str],
        user_sizes: Mapping[str, tuple[int, ...]],
        *,
        sizes_per_dimension: int = DEFAULT_SIZES_PER_DIMENSION,
        step_dims: Iterable[str] = (),
        audio_dims: Mapping[str, int] | None = None,
    ) -> BucketPlan:
        """The plan for ``dims`` of a model whose ``config.json`` is ``config``, as the module docstring
        describes. ``user_sizes`` maps dimension names *or* their option names (``sequence_lengths``) to
        parsed sizes (``IPURuntimeConfig.bucket_options``); other keys are ignored. ``step_dims`` are the
        dimensions of one generated token per step (``roles.generation_step_dims``): each planned one
        gets size 1. ``audio_dims`` maps the samples dimensions of audio inputs (``roles.audio_sample_dims``)
        to their sampling rate: they get ``audio_sample_sizes`` and no text limit. Raises
        ``BucketOptionError`` for invalid sizes or sizes beyond the model's limit."""
        if isinstance(sizes_per_dimension, bool) or sizes_per_dimension < 1:
            raise BucketOptionError(
                f"sizes_per_dimension must be a positive integer, got {sizes_per_dimension!r}"
            )
        dims = list(dict.fromkeys(dims))
        step_dims = frozenset(step_dims)
        by_option = {option_name(dim): dim for dim in dims}
        given: dict[str, tuple[int, ...]] = {}
        for key, value in user_sizes.items():
            dim = key if key in dims else by_option.get(key)
            if dim is not None:
                given[dim] = value
        sizes: dict[str, tuple[int, ...]] = {}
        limits: dict[str, int | None] = {}
        sources: dict[str, str | None] = {}
        audio_dims = dict(audio_dims or {})
        for dim in dims:
            role = dim_role(dim)
            # samples of audio are no text positions: max_position_embeddings and its kin never bound them
            limit, source = (None, None) if dim in audio_dims else model_limit(config, dim)
            if dim in given:
                if limit is not None and given[dim][-1] > limit:
                    raise BucketOptionError(
                        f"option {option_name(dim)!r}: size {given[dim][-1]} exceeds the model's maximum of "
                        f"{limit} ({source} in config.json); the largest allowed size is {limit}"
                    )
                dim_sizes = given[dim]
            elif role is DimRole.BATCH:
                dim_sizes = DEFAULT_BATCH_SIZES
            elif dim in audio_dims:
                dim_sizes = audio_sample_sizes(audio_dims[dim])
            elif role in (DimRole.PAST, DimRole.SEQUENCE):
                largest = min(limit or FALLBACK_LARGEST_SIZE, DEFAULT_LARGEST_CAP)
                smallest = min(DEFAULT_SMALLEST_SIZE, largest)
                if role is DimRole.PAST:
                    dim_sizes = tuple(
                        sorted({min(2**k, largest) for k in range(3, largest.bit_length() + 1)})
                    )
                    dim_sizes = dim_sizes or (largest,)
                else:
                    dim_sizes = geometric_sizes(smallest, largest, sizes_per_dimension)
            else:
                continue  # compiled at the size it comes in
            if dim in step_dims and 1 not in dim_sizes:
                dim_sizes = (1, *dim_sizes)  # the one-token steps of generation
            sizes[dim], limits[dim], sources[dim] = dim_sizes, limit, source
        return cls(sizes, limits, sources)
