"""BART and MBart sequence classification, and the zero-shot pipeline on them, with provider="ipu".

Their heads take each row's hidden state at its last end-of-sentence token, a selection the export writes
with NonZero; the served graph computes it densely (``compiler.graph_rewrites.eos_selection``). Each check
runs ORTModelForSequenceClassification on the host emulator against the same class on
CPUExecutionProvider: padded batches of mixed lengths (tokenizer padding), sentence pairs as a zero-shot
classifier feeds them, the longest texts the tiny models take (BART's 128 positions, MBart's 512), and a
call whose rows hold different numbers of end-of-sentence tokens, which the PyTorch head refuses and the
session must refuse too, never answer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import transformers

from optimum_ipu_backend.conformance.zoo import CORPUS
from optimum_ipu_backend.errors import InvalidFeedError

ATOL = 1e-5
MODELS = ("bart", "mbart")
ORT_CLASS = "ORTModelForSequenceClassification"
TASK = "text-classification"
EMULATOR = {"provider": "ipu", "provider_options": {"device": "emulator"}}
LABELS = ["weather", "animals", "travel and holidays"]


@pytest.fixture(scope="session")
def classification_exports(zoo) -> dict[str, Path]:
    return {name: zoo.onnx(name, TASK) for name in MODELS}


@pytest.fixture(scope="module")
def models(classification_exports: dict[str, Path]) -> dict[str, tuple]:
    """Per architecture: (tokenizer, ipu model, cpu model)."""
    from optimum.onnxruntime import ORTModelForSequenceClassification

    loaded = {}
    for name, onnx_dir in classification_exports.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(onnx_dir)
        ipu = ORTModelForSequenceClassification.from_pretrained(onnx_dir, **EMULATOR)
        cpu = ORTModelForSequenceClassification.from_pretrained(onnx_dir)
        assert ipu.providers[0] == "IPUExecutionProvider"
        loaded[name] = (tokenizer, ipu, cpu)
    return loaded


def _texts(words: list[int]) -> list[str]:
    """One text per entry, of about that many words of the corpus."""
    corpus = " ".join(CORPUS).split()
    return [" ".join(np.resize(corpus, count)) for count in words]


def _logits(model, encoded) -> np.ndarray:
    return model(**encoded).logits.detach().numpy()


@pytest.mark.parametrize("name", MODELS)
def test_a_padded_batch_of_mixed_lengths_up_to_the_longest_matches_cpu(models, name):
    """Sentence pairs, as a zero-shot classifier feeds them, padded to the longest row: one truncated to
    the tokenizer's model_max_length (BART: 128 tokens, MBart: 512), the others far shorter."""
    tokenizer, ipu, cpu = models[name]
    longest = tokenizer.model_max_length
    encoded = tokenizer(
        _texts([longest, longest // 3, 9, 2]),
        _texts([4, 11, 1, 6]),
        truncation="only_first",
        padding=True,
        return_tensors="pt",
    )
    assert encoded["input_ids"].shape == (4, longest) and not encoded["attention_mask"].all()
    expected, found = _logits(cpu, encoded), _logits(ipu, encoded)
    np.testing.assert_allclose(found, expected, rtol=0, atol=ATOL)
    assert np.ptp(expected[:, 0]) > 1e-3  # rows differ: each row's own features are compared
    if name == "bart":  # pad id 1 never equals </s> (2): the proof pads BART's sequences and batches
        verdicts = ipu.model.padding_verdicts()
        assert verdicts == {"batch_size": "padded (proven)", "sequence_length": "padded (proven)"}


@pytest.mark.parametrize("name", MODELS)
def test_zero_shot_classification_matches_cpu(models, name):
    """Two texts of different lengths, three candidate labels each, in one padded batch of six pairs."""
    tokenizer, ipu, cpu = models[name]
    sequences = [" ".join(CORPUS[:6]), "a dog and a cat"]
    results = {}
    for device, model in (("ipu", ipu), ("cpu", cpu)):
        classifier = transformers.pipeline("zero-shot-classification", model=model, tokenizer=tokenizer)
        results[device] = classifier(sequences, candidate_labels=LABELS, multi_label=True, batch_size=8)
    for found, expected in zip(results["ipu"], results["cpu"], strict=True):
        scores = dict(zip(expected["labels"], expected["scores"], strict=True))
        found_scores = dict(zip(found["labels"], found["scores"], strict=True))
        assert found_scores.keys() == scores.keys() == set(LABELS)
        np.testing.assert_allclose([found_scores[k] for k in LABELS], [scores[k] for k in LABELS], atol=ATOL)
    assert len({round(score, 4) for score in results["cpu"][0]["scores"]}) > 1


@pytest.mark.parametrize("name", MODELS)
def test_rows_with_different_numbers_of_eos_tokens_are_refused(models, name):
    tokenizer, ipu, _ = models[name]
    encoded = tokenizer(_texts([6, 6, 6]), padding=True, return_tensors="np")
    uneven = dict(encoded)
    uneven["input_ids"] = encoded["input_ids"].copy()
    uneven["input_ids"][1, 2] = tokenizer.eos_token_id  # one more </s> in the second row
    counts = (uneven["input_ids"] == tokenizer.eos_token_id).sum(axis=1).tolist()
    with pytest.raises(InvalidFeedError) as raised:
        ipu.model.run(None, uneven)
    message = str(raised.value)
    assert "'input_ids'" in message and f"[{', '.join(map(str, counts))}]" in message
    assert f"tokens of id {tokenizer.eos_token_id}" in message and "same number" in message
    none = dict(encoded)
    none["input_ids"] = np.where(encoded["input_ids"] == tokenizer.eos_token_id, 5, encoded["input_ids"])
    with pytest.raises(InvalidFeedError, match="at least one"):
        ipu.model.run(None, none)
    # Through the ORTModel as well (torch tensors, optimum's own call path).
    import torch

    with pytest.raises(InvalidFeedError):
        ipu(**{key: torch.from_numpy(value) for key, value in uneven.items()})
