"""IPU counts the Poplar SDK cannot take are refused when the configuration is read, on every device.

The SDK's device manager has devices of 1, 2, 4, 8, ... IPUs, and PopART's replicated graphs need the
device's IPUs to equal replicas x IPUs per replica; the worker used to round 3 up to 4, which PopART then
refused inside the compile (or which compiled for a count nobody asked for). The configuration now says so
up front, naming the option, the value and the nearest counts that work, on the emulator too, so that a
configuration means the same thing on every device.
"""

from __future__ import annotations

import json

import pytest

from optimum_ipu_backend.runtime.ipu_config import (
    IPUConfigError,
    IPUProviderOptions,
    ProviderOptionError,
    load_runtime_config,
)


@pytest.mark.parametrize(
    ("option", "value", "nearest"),
    [
        ("replication_factor", 3, "use 2 or 4"),
        ("replication_factor", "6", "use 4 or 8"),
        ("inference_replication_factor", 5, "use 4 or 8"),
        ("ipus_per_replica", 3, "use 2 or 4"),
        ("inference_ipus_per_replica", "12", "use 8 or 16"),
    ],
)
def test_a_count_that_is_not_a_power_of_two_is_refused_by_name(option, value, nearest):
    with pytest.raises(IPUConfigError) as info:
        load_runtime_config(None, {option: value})
    message = str(info.value)
    assert f"provider option {option!r}" in message
    assert f"power of two (1, 2, 4, 8, ...), got {int(value)}" in message
    assert nearest in message


@pytest.mark.parametrize("device", ["emulator", "ipu-model", "ipu"])
def test_every_device_refuses_it(device):
    with pytest.raises(ProviderOptionError, match=r"'replication_factor'.*got 3.*use 2 or 4"):
        IPUProviderOptions.parse({"device": device, "replication_factor": "3"})


def test_an_ipu_config_file_names_the_field_and_the_file(tmp_path):
    path = tmp_path / "ipu_config.json"
    path.write_text(json.dumps({"inference_ipus_per_replica": 3, "layers_per_ipu": [1, 1, 1]}))
    with pytest.raises(IPUConfigError) as info:
        load_runtime_config(tmp_path)
    assert f"field 'inference_ipus_per_replica' in {path}" in str(info.value)
    assert "use 2 or 4" in str(info.value)


@pytest.mark.parametrize("count", [1, 2, 4, 8, 16, 64])
def test_powers_of_two_are_taken(count):
    config = load_runtime_config(None, {"replication_factor": count, "ipus_per_replica": str(count)})
    assert (config.replication_factor, config.ipus_per_replica) == (count, count)


def test_layers_per_ipu_of_three_ipus_without_ipus_per_replica_is_refused():
    """optimum-graphcore's rule takes the IPUs per replica from the length of layers_per_ipu."""
    with pytest.raises(IPUConfigError) as info:
        load_runtime_config(None, {"layers_per_ipu": "1,1,-1"})
    message = str(info.value)
    assert "provider option 'layers_per_ipu'" in message and "got 3 entries" in message
    assert "use 2 or 4 entries" in message
    assert load_runtime_config(None, {"layers_per_ipu": "1,-1"}).ipus_per_replica == 2
