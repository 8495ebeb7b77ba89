"""``model.to(device)`` on ORTModels (issue 39, point 6; integration/model_moves.py): an ipu model moved to
"cpu" runs on a new CPUExecutionProvider session of the same file, with CPU's own outputs; a device no
onnxruntime provider serves is refused naming provider=, and a refused move leaves the model where it was."""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch
from optimum.onnxruntime import ORTModelForSeq2SeqLM, ORTModelForSequenceClassification

from integration.ortmodel_checks import CPU, IPU
from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
from optimum_ipu_backend.integration.model_moves import UnsupportedDeviceMoveError
from optimum_ipu_backend.session import IPUInferenceSession


def _logits(model, feeds) -> torch.Tensor:
    with torch.no_grad():
        return model(**{key: torch.from_numpy(value) for key, value in feeds.items()}).logits


def test_to_cpu_moves_an_ipu_model_to_a_cpu_session_of_the_same_file(bert):
    model_dir, export = bert
    feeds = preprocessed_inputs(model_dir, batch=3, seq=128)
    cpu = ORTModelForSequenceClassification.from_pretrained(export, **CPU)
    ipu = ORTModelForSequenceClassification.from_pretrained(export, **IPU)
    before = ipu.session
    assert isinstance(before, IPUInferenceSession)

    assert ipu.to("cpu") is ipu
    assert ipu.providers == ["CPUExecutionProvider"]
    assert type(ipu.session) is ort.InferenceSession and ipu.model is ipu.session
    assert ipu.path == cpu.path and ipu.device == torch.device("cpu")
    assert torch.equal(_logits(ipu, feeds), _logits(cpu, feeds))  # the same CPU session, the same numbers
    assert ipu.to("cpu") is ipu and ipu.providers == ["CPUExecutionProvider"]  # a CPU model stays


def test_to_cpu_moves_every_part_of_a_seq2seq_model(zoo):
    export = zoo.onnx("t5", "text2text-generation-with-past")
    ipu = ORTModelForSeq2SeqLM.from_pretrained(export, **IPU)
    cpu = ORTModelForSeq2SeqLM.from_pretrained(export, **CPU)
    ipu.to(torch.device("cpu"))
    assert all(part.providers == ["CPUExecutionProvider"] for part in ipu.parts)
    assert ipu.model is ipu.encoder.session  # optimum-onnx's alias follows the encoder
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 1], [8, 4, 31, 1, 0, 0, 0]])
    settings = {"attention_mask": (ids != 0).long(), "max_new_tokens": 8, "do_sample": False}
    assert torch.equal(ipu.generate(ids, **settings), cpu.generate(ids, **settings))


@pytest.mark.parametrize("device", ["mps", "ipu", torch.device("meta")])
def test_a_device_without_an_onnxruntime_provider_is_refused_naming_provider(bert, device):
    _, export = bert
    ipu = ORTModelForSequenceClassification.from_pretrained(export, **IPU)
    with pytest.raises(
        UnsupportedDeviceMoveError, match=r"from_pretrained\(path, provider=\.\.\.\)"
    ) as raised:
        ipu.to(device)
    assert "this model runs on IPUExecutionProvider" in str(raised.value)
    assert isinstance(ipu.session, IPUInferenceSession) and ipu.providers[0] == "IPUExecutionProvider"


def test_a_cpu_model_asked_for_ipu_by_torch_device_is_refused(bert):
    """optimum-onnx maps every device type but cuda to the CPU provider: to("ipu") would keep running on
    the CPU while the model reports device ipu."""
    _, export = bert
    cpu = ORTModelForSequenceClassification.from_pretrained(export, **CPU)
    with pytest.raises(UnsupportedDeviceMoveError, match='for example provider="ipu"'):
        cpu.to("ipu")
    assert cpu.device == torch.device("cpu")


def test_to_cuda_without_its_provider_is_refused_and_keeps_the_model_on_ipu(bert):
    _, export = bert
    ipu = ORTModelForSequenceClassification.from_pretrained(export, **IPU)
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(ValueError, match="CUDAExecutionProvider"):
        ipu.to("cuda")
    assert isinstance(ipu.session, IPUInferenceSession)
