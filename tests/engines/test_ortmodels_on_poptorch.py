"""The ORTModel engine matrix (tests/engines/ortmodels_on_engines.py) on the PopTorch engine: every
ORTModel class the emulator serves, unchanged, with device="ipu" and device="ipu-model" against the SDK
double, outputs equal to CPUExecutionProvider's within the emulator's tolerances."""

from __future__ import annotations

from engines.ortmodels_on_engines import check_engine


def test_every_ortmodel_class_on_poptorch(tmp_path_factory, zoo):
    check_engine(tmp_path_factory, zoo, "poptorch")
