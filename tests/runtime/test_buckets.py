"""Bucket plans: parsing user sizes, model limits, default sizes, choosing a bucket, and the error for
inputs that do not fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_ipu_backend.runtime.buckets import (
    DEFAULT_LARGEST_CAP,
    FALLBACK_LARGEST_SIZE,
    BucketOptionError,
    BucketPlan,
    InputTooLargeError,
    geometric_sizes,
    model_limit,
    option_name,
    parse_sizes,
)

BERT_CONFIG = {"model_type": "bert", "max_position_embeddings": 512}
GPT2_CONFIG = {"model_type": "gpt2", "n_positions": 1024, "n_ctx": 1024}
WHISPER_CONFIG = {"model_type": "whisper", "max_source_positions": 1500, "max_target_positions": 448}
ROBERTA_CONFIG = {"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}


# ----------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dim", "option"),
    [
        ("batch_size", "batch_size"),
        ("sequence_length", "sequence_lengths"),
        ("past_sequence_length", "past_sequence_lengths"),
        ("encoder_sequence_length", "encoder_sequence_lengths"),
        ("decoder_sequence_length", "decoder_sequence_lengths"),
        ("past_decoder_sequence_length", "past_decoder_sequence_lengths"),
        ("num_choices", "num_choices"),
    ],
)
def test_option_name(dim: str, option: str) -> None:
    assert option_name(dim) == option


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("64,128,256,512", (64, 128, 256, 512)),
        (" 512, 64 ,128", (64, 128, 512)),
        ("[64, 128]", (64, 128)),
        ("8", (8,)),
        (8, (8,)),
        ([256, 64, 64], (64, 256)),
        (("16", 32), (16, 32)),
    ],
)
def test_parse_sizes_accepts_the_usual_spellings(value: object, expected: tuple[int, ...]) -> None:
    assert parse_sizes("sequence_lengths", value) == expected


BAD_SIZES = ["64,abc", "0,64", "-8", "", "64,,128", 0, -1, True, 1.5, [64, None], {"a": 1}]


@pytest.mark.parametrize("value", BAD_SIZES)
def test_parse_sizes_rejects_bad_values_naming_the_option(value: object) -> None:
    with pytest.raises(BucketOptionError, match="sequence_lengths"):
        parse_sizes("sequence_lengths", value)


# ----------------------------------------------------------------------------------------------------------
# Model limits
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "dim", "limit"),
    [
        (BERT_CONFIG, "sequence_length", 512),
        (GPT2_CONFIG, "sequence_length", 1024),
        (GPT2_CONFIG, "past_sequence_length", 1024),
        (WHISPER_CONFIG, "encoder_sequence_length", 1500),
        (WHISPER_CONFIG, "decoder_sequence_length", 448),
        (WHISPER_CONFIG, "past_decoder_sequence_length", 448),
        # RoBERTa numbers positions from pad_token_id + 1: 514 positions hold 512 tokens.
        (ROBERTA_CONFIG, "sequence_length", 512),
        ({"model_type": "t5", "d_model": 16}, "encoder_sequence_length", None),
        ({"model_type": "llava", "text_config": {"max_position_embeddings": 4096}}, "sequence_length", 4096),
        (BERT_CONFIG, "batch_size", None),
    ],
)
def test_model_limit(config: dict, dim: str, limit: int | None) -> None:
    assert model_limit(config, dim)[0] == limit


# ----------------------------------------------------------------------------------------------------------
# Geometric sizes
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    smallest=st.integers(1, 64),
    span=st.integers(0, 4096),
    count=st.integers(1, 24),
)
def test_geometric_sizes_bound_the_waste_of_every_length(smallest: int, span: int, count: int) -> None:
    largest = smallest + span
    sizes = geometric_sizes(smallest, largest, count)
    assert list(sizes) == sorted(set(sizes))
    assert sizes[0] >= smallest and sizes[-1] == largest and len(sizes) <= count
    ratio = (largest / smallest) ** (1 / (count - 1)) if count > 1 else math.inf
    # Any length is padded to less than ratio * length, plus the rounding to a multiple of 4 (and the ceil).
    for length in range(smallest, largest + 1, max(1, (largest - smallest) // 97)):
        bucket = next(size for size in sizes if size >= length)
        assert bucket < length * ratio + 5


# ----------------------------------------------------------------------------------------------------------
# Default plans
# ----------------------------------------------------------------------------------------------------------


def test_default_plan_for_an_encoder_uses_sixteen_geometric_buckets() -> None:
    plan = BucketPlan.for_dims(BERT_CONFIG, ["batch_size", "sequence_length"])
    assert plan.sizes["batch_size"] == (1, 2, 4, 8)
    sequence = plan.sizes["sequence_length"]
    assert len(sequence) == 16 and sequence[0] == 8 and sequence[-1] == 512
    ratios = [b / a for a, b in zip(sequence, sequence[1:], strict=False)]
    # Finer than powers of two everywhere, and a multiple of 4 above 8.
    assert max(ratios) < 1.6
    assert all(size % 4 == 0 for size in sequence)


def test_default_plan_gives_a_generating_decoder_single_token_steps_and_a_power_of_two_past() -> None:
    plan = BucketPlan.for_dims(
        GPT2_CONFIG,
        ["batch_size", "sequence_length", "past_sequence_length"],
        step_dims={"sequence_length"},
    )
    assert plan.sizes["sequence_length"][0] == 1
    assert plan.sizes["sequence_length"][-1] == 1024
    assert plan.sizes["past_sequence_length"] == (8, 16, 32, 64, 128, 256, 512, 1024)


def test_default_plan_caps_the_largest_size_and_falls_back_without_a_limit() -> None:
    long_model = {"model_type": "llama", "max_position_embeddings": 131072}
    long_plan = BucketPlan.for_dims(long_model, ["sequence_length"])
    assert long_plan.largest("sequence_length") == DEFAULT_LARGEST_CAP
    t5_plan = BucketPlan.for_dims({"model_type": "t5"}, ["encoder_sequence_length"])
    assert t5_plan.largest("encoder_sequence_length") == FALLBACK_LARGEST_SIZE


def test_dimensions_without_a_size_policy_are_compiled_as_they_come() -> None:
    plan = BucketPlan.for_dims(BERT_CONFIG, ["batch_size", "num_choices", "height"])
    assert set(plan.sizes) == {"batch_size"}
    given = BucketPlan.for_dims(BERT_CONFIG, ["num_choices"], user_sizes={"num_choices": "2,4"})
    assert given.sizes["num_choices"] == (2, 4)


DIM_NAMES = [
    "batch_size",
    "sequence_length",
    "past_sequence_length",
    "encoder_sequence_length",
    "decoder_sequence_length",
    "past_decoder_sequence_length",
]


@settings(max_examples=150, deadline=None)
@given(
    dims=st.lists(st.sampled_from(DIM_NAMES), min_size=1, max_size=6, unique=True),
    per_dimension=st.integers(1, 40),
    limit=st.integers(1, 5000),
)
def test_default_plan_gives_each_dimension_its_own_sizes(
    dims: list[str], per_dimension: int, limit: int
) -> None:
    config = {"max_position_embeddings": limit}
    plan = BucketPlan.for_dims(config, dims, sizes_per_dimension=per_dimension)
    assert set(plan.sizes) == set(dims)
    for dim in dims:
        if dim == "batch_size":
            continue
        assert plan.largest(dim) == min(limit, DEFAULT_LARGEST_CAP)
        if dim.startswith("past_"):
            assert all(size & (size - 1) == 0 for size in plan.sizes[dim][:-1])
        else:
            one = 1 if f"past_{dim}" in dims else 0
            assert len(plan.sizes[dim]) <= per_dimension + one


def test_user_sizes_are_kept_as_given() -> None:
    plan = BucketPlan.for_dims(
        BERT_CONFIG,
        ["batch_size", "sequence_length"],
        user_sizes={"batch_size": "1,8", "past_sequence_lengths": "64", "device": "emulator"},
    )
    assert plan.sizes["batch_size"] == (1, 8)
    assert len(plan.sizes["sequence_length"]) == 16
    explicit = BucketPlan.for_dims(
        BERT_CONFIG, ["sequence_length"], user_sizes={"sequence_lengths": "64,128,256,512"}
    )
    assert explicit.sizes["sequence_length"] == (64, 128, 256, 512)


def test_user_sizes_beyond_the_model_limit_are_rejected_naming_the_option() -> None:
    with pytest.raises(BucketOptionError, match=r"'sequence_lengths'.*1024.*512"):
        BucketPlan.for_dims(BERT_CONFIG, ["sequence_length"], user_sizes={"sequence_lengths": "128,1024"})


def test_plan_rejects_unsorted_sizes() -> None:
    with pytest.raises(ValueError, match="sorted"):
        BucketPlan({"sequence_length": (64, 32)})


# ----------------------------------------------------------------------------------------------------------
# Choosing
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 600), min_size=1, max_size=12, unique=True).map(sorted),
    size=st.integers(0, 600),
)
def test_choose_is_the_smallest_bucket_that_fits(sizes: list[int], size: int) -> None:
    plan = BucketPlan({"sequence_length": tuple(sizes)})
    if size > sizes[-1]:
        with pytest.raises(InputTooLargeError):
            plan.choose("sequence_length", size)
        return
    chosen = plan.choose("sequence_length", size)
    assert chosen in sizes and chosen >= size
    assert all(bucket < size for bucket in sizes if bucket < chosen)


def test_one_token_over_the_largest_bucket_names_input_length_limit_and_option() -> None:
    config = {"model_type": "bert", "max_position_embeddings": 2048}
    plan = BucketPlan.for_dims(config, ["sequence_length"], user_sizes={"sequence_lengths": "64,128,256,512"})
    with pytest.raises(InputTooLargeError) as caught:
        plan.choose("sequence_length", 513, input_name="input_ids")
    message = str(caught.value)
    assert message.startswith(
        "input 'input_ids' has sequence_length 513 but the largest compiled sequence length is 512; "
    )
    assert "provider_options={'sequence_lengths': '64,128,256,512,1024'}" in message
    assert "the model allows at most 2048" in message
    assert (caught.value.input_name, caught.value.size, caught.value.largest) == ("input_ids", 513, 512)


def test_input_over_the_model_limit_asks_for_truncation_not_a_bigger_bucket() -> None:
    plan = BucketPlan.for_dims(BERT_CONFIG, ["sequence_length"])
    with pytest.raises(InputTooLargeError, match=r"513.*512.*allows at most 512.*max_length=512"):
        plan.choose("sequence_length", 513, input_name="input_ids")


def test_padded_dims_buckets_planned_dims_only() -> None:
    plan = BucketPlan({"batch_size": (1, 4), "sequence_length": (8, 16)})
    padded = plan.padded_dims({"batch_size": 3, "sequence_length": 9, "num_choices": 5})
    assert padded == {"batch_size": 4, "sequence_length": 16, "num_choices": 5}
    with pytest.raises(KeyError, match="num_choices"):
        plan.choose("num_choices", 3)


def _efficiency(lengths: np.ndarray, plan: BucketPlan) -> float:
    computed = sum(plan.choose("sequence_length", int(length)) for length in lengths)
    return float(lengths.sum()) / computed


def test_default_plan_reaches_the_padding_efficiency_target_on_a_docstring_like_distribution() -> None:
    # Log-normal lengths with the median (20 tokens) and 90th percentile (67), cut at 512 tokens.
    rng = np.random.default_rng(0)
    sigma = math.log(67 / 20) / 1.2816
    lengths = np.clip(np.round(rng.lognormal(math.log(20), sigma, size=20000)), 3, 512).astype(int)
    default = BucketPlan.for_dims(BERT_CONFIG, ["sequence_length"])
    powers_of_two = BucketPlan({"sequence_length": (16, 32, 64, 128, 256, 512)})
    assert _efficiency(lengths, default) >= 0.85
    assert _efficiency(lengths, powers_of_two) < 0.75


# -- audio samples (issue 19) ----------------------------------------------------------------------------


def test_the_audio_plan_spans_1_to_30_seconds_and_clips_of_1_to_10_seconds_use_at_most_8_sizes() -> None:
    from optimum_ipu_backend.runtime.buckets import audio_sample_sizes

    sizes = audio_sample_sizes(16000)
    assert sizes == (16000, 23360, 34080, 49760, 72640, 105920, 154560, 225440, 328960, 480000)
    plan = BucketPlan({"sequence_length": sizes})
    used = {plan.choose("sequence_length", samples) for samples in range(16000, 160001, 50)}
    assert len(used) <= 8
    assert audio_sample_sizes(8000) == tuple(size // 2 for size in sizes)


def test_audio_samples_get_the_audio_plan_and_no_text_limit_and_user_sizes_still_override() -> None:
    from optimum_ipu_backend.runtime.buckets import audio_sample_sizes

    config = {"model_type": "wav2vec2", "max_position_embeddings": 512}  # a text limit that must not apply
    plan = BucketPlan.for_dims(
        config, ["batch_size", "sequence_length"], audio_dims={"sequence_length": 16000}
    )
    assert plan.sizes["sequence_length"] == audio_sample_sizes(16000)
    assert plan.limits["sequence_length"] is None
    plan.check_exact("sequence_length", 10 * 480000)  # an exact samples axis has no limit at all
    given = BucketPlan.for_dims(
        config,
        ["batch_size", "sequence_length"],
        user_sizes={"sequence_lengths": "32000,64000,960000"},
        audio_dims={"sequence_length": 16000},
    )
    assert given.sizes["sequence_length"] == (32000, 64000, 960000)


def test_audio_sample_dims_are_the_samples_of_rank_2_float_audio_inputs_only() -> None:
    from onnx import TensorProto

    from optimum_ipu_backend.runtime.roles import audio_sample_dims

    shapes = {
        "input_values": ("batch_size", "sequence_length"),
        "input_features": ("batch_size", "feature_size", "encoder_sequence_length"),
        "input_ids": ("batch_size", "decoder_sequence_length"),
    }
    types = {
        "input_values": TensorProto.FLOAT,
        "input_features": TensorProto.FLOAT,
        "input_ids": TensorProto.INT64,
    }
    assert audio_sample_dims(shapes, types) == {"sequence_length"}
    assert audio_sample_dims(shapes, {**types, "input_values": TensorProto.INT64}) == frozenset()


def test_an_exact_dimension_past_the_model_limit_names_the_limit_and_proposes_no_sizes() -> None:
    plan = BucketPlan(
        {"sequence_length": (8, 16)}, {"sequence_length": 512}, {"sequence_length": "n_positions"}
    )
    plan.check_exact("sequence_length", 512)  # up to the model's limit, whatever the plan's largest size
    with pytest.raises(InputTooLargeError) as info:
        plan.check_exact("sequence_length", 600, "input_ids")
    message = str(info.value)
    assert "'input_ids' has sequence_length 600" in message
    assert "allows at most 512 (n_positions in the model config)" in message
    assert "raise it with" not in message and "largest compiled" not in message
