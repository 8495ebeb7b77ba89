"""Runtime settings from ipu_config.json and provider options, with optimum-graphcore's field names."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from optimum_ipu_backend.runtime.buckets import BucketPlan
from optimum_ipu_backend.runtime.ipu_config import (
    IgnoredIPUConfigFieldsWarning,
    IPUConfigError,
    IPURuntimeConfig,
    load_runtime_config,
)

# What optimum-graphcore's IPUConfig(...).to_json_file() writes for an inference set-up (its defaults plus
# a few changed values), including the training and pipelining fields this runtime has no use for.
GRAPHCORE_IPU_CONFIG = {
    "auto_loss_scaling": False,
    "device_iterations": 1,
    "embedding_serialization_factor": 1,
    "enable_half_partials": True,
    "executable_cache_dir": "./exe_cache",
    "explicit_ir_inference": False,
    "gradient_accumulation_steps": 16,
    "inference_device_iterations": 4,
    "inference_embedding_serialization_factor": 1,
    "inference_ipus_per_replica": 1,
    "inference_layers_per_ipu": [-1],
    "inference_matmul_proportion": 0.2,
    "inference_parallelize_kwargs": {},
    "inference_projection_serialization_factor": 1,
    "inference_replication_factor": 2,
    "inference_serialized_embedding_splits_per_ipu": None,
    "inference_serialized_projection_splits_per_ipu": None,
    "ipus_per_replica": 4,
    "layers_per_ipu": [0, 4, 4, 4],
    "matmul_proportion": [0.25, 0.25, 0.25, 0.25],
    "optimizer_state_offchip": True,
    "optimum_version": "1.6.1",
    "output_mode": "final",
    "parallelize_kwargs": {},
    "projection_serialization_factor": 1,
    "recompute_checkpoint_every_layer": True,
    "replicated_tensor_sharding": True,
    "replication_factor": 4,
    "seed": 42,
    "serialized_embedding_splits_per_ipu": None,
    "serialized_projection_splits_per_ipu": None,
    "transformers_version": "4.29.2",
}


def write(directory: Path, content: object) -> Path:
    path = directory / "ipu_config.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    return path


def test_defaults_without_a_file_or_options(tmp_path: Path) -> None:
    config = load_runtime_config(tmp_path)
    assert config == IPURuntimeConfig()
    assert (config.device_iterations, config.replication_factor, config.ipus_per_replica) == (1, 1, 1)
    assert config.cache_enabled and config.executable_cache_dir is None and config.precision is None
    assert config.bucket_options() == {}


def test_a_graphcore_file_maps_inference_fields_and_reports_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, GRAPHCORE_IPU_CONFIG)
    with pytest.warns(IgnoredIPUConfigFieldsWarning) as caught:
        config = load_runtime_config(tmp_path)
    message = str(caught[0].message)
    ignored = [
        "gradient_accumulation_steps",
        "matmul_proportion",
        "recompute_checkpoint_every_layer",
        "seed",
        "output_mode",
    ]
    for name in ignored:
        assert name in message and name in config.ignored_fields
    assert str(path) in message
    for name in ("inference_device_iterations", "executable_cache_dir", "optimum_version"):
        assert name not in config.ignored_fields
    # The inference_* twins win over the training values.
    assert config.device_iterations == 4
    assert config.replication_factor == 2
    assert config.ipus_per_replica == 1
    assert config.layers_per_ipu == (-1,)  # inference_layers_per_ipu wins; sharding now reads it
    assert "layers_per_ipu" not in config.ignored_fields
    assert config.executable_cache_dir == "./exe_cache" and config.cache_enabled
    assert config.sources["device_iterations"].endswith("inference_device_iterations")
    assert config.samples_per_step(micro_batch=3) == 3 * 4 * 2


def test_plain_names_apply_when_no_inference_twin_is_given(tmp_path: Path) -> None:
    write(tmp_path, {"device_iterations": 8, "replication_factor": 2, "ipus_per_replica": 2})
    config = load_runtime_config(tmp_path)
    assert (config.device_iterations, config.replication_factor, config.ipus_per_replica) == (8, 2, 2)


def test_the_inference_twin_wins_whatever_the_key_order(tmp_path: Path) -> None:
    write(tmp_path, {"inference_device_iterations": 5, "device_iterations": 9})
    assert load_runtime_config(tmp_path).device_iterations == 5
    write(tmp_path, {"device_iterations": 9, "inference_device_iterations": 5})
    assert load_runtime_config(tmp_path).device_iterations == 5


def test_unknown_fields_are_errors_naming_field_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"device_iterations": 2, "devise_iterations": 4})
    with pytest.raises(IPUConfigError, match="devise_iterations") as caught:
        load_runtime_config(tmp_path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"device_iterations": 0}, "device_iterations"),
        ({"inference_replication_factor": "two"}, "inference_replication_factor"),
        ({"ipus_per_replica": True}, "ipus_per_replica"),
        ({"sequence_lengths": "64,abc"}, "sequence_lengths"),
        ({"precision": "bf16"}, "precision"),
        ({"cache_size_limit": "lots"}, "cache_size_limit"),
        ({"executable_cache_dir": 3}, "executable_cache_dir"),
        ({"cache_enabled": "maybe"}, "cache_enabled"),
        ({"device_iterations": {"pod16": 4}}, "default"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_values_are_errors_naming_the_field(tmp_path: Path, content: object, message: str) -> None:
    write(tmp_path, content)
    with pytest.raises(IPUConfigError, match=message):
        load_runtime_config(tmp_path)


def test_an_unreadable_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "ipu_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(IPUConfigError, match="JSON"):
        load_runtime_config(tmp_path)
    with pytest.raises(IPUConfigError, match="does not exist"):
        load_runtime_config(config_path=tmp_path / "missing.json")


@pytest.mark.parametrize("value", ["", "disabled", "DISABLED"])
def test_an_empty_or_disabled_cache_dir_turns_the_cache_off(tmp_path: Path, value: str) -> None:
    write(tmp_path, {"executable_cache_dir": value})
    config = load_runtime_config(tmp_path)
    assert not config.cache_enabled and config.executable_cache_dir is None
    # A provider option naming a directory turns it back on.
    config = load_runtime_config(tmp_path, {"executable_cache_dir": str(tmp_path / "cache")})
    assert config.cache_enabled and config.executable_cache_dir == str(tmp_path / "cache")


def test_pod_specific_values_use_their_default(tmp_path: Path) -> None:
    write(tmp_path, {"inference_device_iterations": {"default": 3, "pod16": 12}})
    assert load_runtime_config(tmp_path).device_iterations == 3


def test_provider_options_override_the_file_and_arrive_as_strings(tmp_path: Path) -> None:
    write(tmp_path, {"inference_device_iterations": 4, "sequence_lengths": [64, 128], "precision": "fp32"})
    options = {
        "device_iterations": "2",
        "batch_size": "8",
        "past_sequence_lengths": "16,32,64",
        "precision": "FP16",
        "cache_size_limit": "2GB",
        "max_executables": "24",
        "device": "emulator",
    }
    config = load_runtime_config(tmp_path, options, other_options=["device"])
    assert config.device_iterations == 2
    assert config.sequence_lengths == (64, 128)  # from the file
    assert config.batch_size == (8,)
    assert config.past_sequence_lengths == (16, 32, 64)
    assert config.precision == "fp16"
    assert config.cache_size_limit == 2 * 1024**3
    assert config.max_executables == 24
    assert config.sources["device_iterations"] == "provider option 'device_iterations'"
    assert config.bucket_options() == {
        "batch_size": (8,),
        "sequence_lengths": (64, 128),
        "past_sequence_lengths": (16, 32, 64),
    }


def test_unknown_provider_options_are_errors(tmp_path: Path) -> None:
    with pytest.raises(IPUConfigError, match="'sequence_length'"):
        load_runtime_config(tmp_path, {"sequence_length": "128"})
    # Graphcore spellings work as options too.
    assert load_runtime_config(tmp_path, {"inference_replication_factor": "4"}).replication_factor == 4


def test_an_ipu_config_option_points_at_another_file(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = write(elsewhere, {"replication_factor": 8})
    write(tmp_path, {"replication_factor": 2})
    assert load_runtime_config(tmp_path, {"ipu_config": str(path)}).replication_factor == 8
    assert load_runtime_config(tmp_path, config_path=path).replication_factor == 8
    assert load_runtime_config(tmp_path).replication_factor == 2


def test_the_config_feeds_a_bucket_plan(tmp_path: Path) -> None:
    write(tmp_path, {"sequence_lengths": "32,64,128", "batch_size": 4})
    config = load_runtime_config(tmp_path)
    plan = BucketPlan.for_dims(
        {"max_position_embeddings": 512},
        ["batch_size", "sequence_length"],
        user_sizes=config.bucket_options(),
    )
    assert plan.sizes == {"batch_size": (4,), "sequence_length": (32, 64, 128)}


def test_a_file_without_graphcore_leftovers_warns_nothing(tmp_path: Path) -> None:
    write(tmp_path, {"device_iterations": 2, "optimum_version": "1.6.1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_runtime_config(tmp_path)
    assert config.ignored_fields == ()
    assert config.to_dict()["device_iterations"] == 2
