"""add_audio_frame_mask: a raw-audio encoder padded on the samples axis gives its unpadded results.

Tiny wav2vec2 and WavLM models are exported with optimum (as users get them: ``input_values`` only, no
attention mask). Every comparison is against onnxruntime CPU runs of the ORIGINAL exported graph at the
caller's length: with a mask of ones the rewritten graph computes what the original does, and padded
to a longer length with the generated mask, the real frames (cut where the padding proof says they are)
match the unpadded run. The padding proof must find layer-norm models exact and name the group norm of
wav2vec2-base as what keeps the samples axis exact.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler import legalize
from optimum_ipu_backend.compiler.graph_rewrites.audio_frame_mask import (
    MASK_INPUT,
    AudioFrameMaskRewrite,
    add_audio_frame_mask,
)
from optimum_ipu_backend.compiler.padding import PaddingAnalyzer
from optimum_ipu_backend.conformance.zoo import save_audio_feature_extractor
from optimum_ipu_backend.runtime.padding import cut_output, output_cuts, padded_inputs

UNCHANGED_ATOL = 1e-5
PADDED_ATOL = 1e-4
AUDIO = "input_values"

# name: (transformers class, config class, feat_extract_norm, optimum task, extra config)
MODELS = {
    "w2v-ctc-layer": ("Wav2Vec2ForCTC", "Wav2Vec2Config", "layer", "automatic-speech-recognition", {}),
    "w2v-cls-layer": (
        "Wav2Vec2ForSequenceClassification",
        "Wav2Vec2Config",
        "layer",
        "audio-classification",
        {"num_labels": 5},
    ),
    "wavlm-ctc": ("WavLMForCTC", "WavLMConfig", "layer", "automatic-speech-recognition", {}),
    "hubert-ctc": ("HubertForCTC", "HubertConfig", "layer", "automatic-speech-recognition", {}),
    "w2v-frames-layer": (
        "Wav2Vec2ForAudioFrameClassification",
        "Wav2Vec2Config",
        "layer",
        "audio-frame-classification",
        {"num_labels": 3},
    ),
    "w2v-ctc-group": ("Wav2Vec2ForCTC", "Wav2Vec2Config", "group", "automatic-speech-recognition", {}),
    "w2v-xvector-layer": (
        "Wav2Vec2ForXVector",
        "Wav2Vec2Config",
        "layer",
        "audio-xvector",
        {
            "tdnn_dim": (16, 16, 16),
            "tdnn_kernel": (3, 3, 1),
            "tdnn_dilation": (1, 2, 1),
            "xvector_output_dim": 8,
        },
    ),
}
LAYER_NORM = ["w2v-ctc-layer", "w2v-cls-layer", "wavlm-ctc", "hubert-ctc", "w2v-frames-layer"]


def _export(root: Path, name: str) -> onnx.ModelProto:
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    model_class, config_class, norm, task, extra = MODELS[name]
    out = root / name
    (out / "pt").mkdir(parents=True, exist_ok=True)
    save_audio_feature_extractor(out / "pt")
    config = getattr(transformers, config_class)(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm=norm,
        do_stable_layer_norm=norm == "layer",
        pad_token_id=0,
        **extra,
    )
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).eval().save_pretrained(out / "pt")
    main_export(str(out / "pt"), output=str(out / "onnx"), task=task, no_post_process=True)
    return onnx.load(str(out / "onnx" / "model.onnx"))


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio-frame-mask")
    cache: dict[str, onnx.ModelProto] = {}

    def get(name: str) -> onnx.ModelProto:
        if name not in cache:
            cache[name] = _export(root, name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def rewritten(exported):
    cache: dict[str, AudioFrameMaskRewrite] = {}

    def get(name: str) -> AudioFrameMaskRewrite:
        if name not in cache:
            result = add_audio_frame_mask(exported(name))
            assert result is not None, name
            cache[name] = result
        return cache[name]

    return get


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _audio(batch: int, samples: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, samples)).astype(np.float32)


def _prove(rewrite: AudioFrameMaskRewrite, batch: int, real: int, padded: int, analyzer=None):
    """The padding proof for one call, its inputs described as the runtime pads them: the audio filled
    with 0 on the right, the generated mask 1 over the real samples and 0 after."""
    shapes = {
        AUDIO: ["batch_size", rewrite.samples_dim],
        rewrite.mask_input: [rewrite.batch_dim, rewrite.samples_dim],
    }
    inputs = padded_inputs(
        shapes,
        {AUDIO: 0.0, rewrite.mask_input: 0},
        {"batch_size": batch, rewrite.samples_dim: real},
        {rewrite.samples_dim: padded},
        generated_masks=((rewrite.mask_input, rewrite.samples_dim),),
    )
    return (analyzer or PaddingAnalyzer(rewrite.model)).prove(inputs)


# ----------------------------------------------------------------------------------------------------
# What the rewrite changes
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*LAYER_NORM, "w2v-ctc-group", "w2v-xvector-layer"])
def test_with_a_mask_of_ones_the_rewritten_graph_computes_what_the_original_does(exported, rewritten, name):
    original = exported(name)
    before = original.SerializeToString()
    rewrite = rewritten(name)
    assert original.SerializeToString() == before, "the argument was modified"
    assert rewrite.mask_input == MASK_INPUT and rewrite.padding_side == "right"
    assert rewrite.samples_dim == "sequence_length" and rewrite.audio_input == AUDIO
    mask_info = next(vi for vi in rewrite.model.graph.input if vi.name == MASK_INPUT)
    assert mask_info.type.tensor_type.elem_type == TensorProto.INT64
    assert [d.dim_param for d in mask_info.type.tensor_type.shape.dim] == ["batch_size", "sequence_length"]
    # The positional convolution is zeroed, and every layer's attention is masked.
    assert len(rewrite.zeroed_convs) == 1 and "pos_conv" in rewrite.zeroed_convs[0]
    assert len(rewrite.masked_softmaxes) == 2
    assert len(rewrite.masked_means) == (1 if "cls" in name else 0)
    expected_session, actual_session = _session(original), _session(rewrite.model)
    for batch, samples in [(1, 400), (2, 1601), (1, 16000)]:
        audio = _audio(batch, samples, seed=samples)
        expected = expected_session.run(None, {AUDIO: audio})
        actual = actual_session.run(None, {AUDIO: audio, MASK_INPUT: np.ones((batch, samples), np.int64)})
        for e, a in zip(expected, actual, strict=True):
            assert e.shape == a.shape
            np.testing.assert_allclose(a, e, rtol=0, atol=UNCHANGED_ATOL, err_msg=f"{name} at {samples}")


def test_graphs_without_raw_audio_or_with_their_own_mask_need_no_rewrite(exported):
    # No rank-2 float input read as a convolution's spatial axis.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "length"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    weight = numpy_helper.from_array(np.ones((2, 3, 3), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g", [x], [y], [weight])
    assert add_audio_frame_mask(helper.make_model(graph)) is None
    # An exported attention mask over the samples: the graph masks itself.
    model = onnx.ModelProto()
    model.CopyFrom(exported("w2v-ctc-layer"))
    model.graph.input.append(
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "sequence_length"])
    )
    assert add_audio_frame_mask(model) is None


def test_an_audio_input_of_static_length_is_refused_by_name(exported):
    model = onnx.ModelProto()
    model.CopyFrom(exported("w2v-ctc-layer"))
    dim = model.graph.input[0].type.tensor_type.shape.dim[1]
    dim.Clear()
    dim.dim_value = 16000
    with pytest.raises(ValueError, match="input_values.*named dynamic axes"):
        add_audio_frame_mask(model)


# ----------------------------------------------------------------------------------------------------
# What the padding proof then finds, and what the padded graph computes
# ----------------------------------------------------------------------------------------------------

CALLS = [(1, 16001, 21800), (2, 16000, 16400)]


@pytest.mark.parametrize("batch,real,padded", CALLS)
@pytest.mark.parametrize("name", LAYER_NORM)
def test_layer_norm_models_pad_the_samples_and_match_the_unpadded_run(
    exported, rewritten, name, batch, real, padded
):
    rewrite = rewritten(name)
    proof = _prove(rewrite, batch, real, padded)
    assert proof.exact, proof.problems
    audio = _audio(batch, real, seed=real)

    # The runtime's padding: real samples first, zeros after; the mask it generates says so.
    padded_audio = np.zeros((batch, padded), np.float32)
    padded_audio[:, :real] = audio
    mask = np.zeros((batch, padded), np.int64)
    mask[:, :real] = 1
    (padded_out,) = _session(rewrite.model).run(None, {AUDIO: padded_audio, MASK_INPUT: mask})
    (expected,) = _session(exported(name)).run(None, {AUDIO: audio})
    cut = cut_output(padded_out, output_cuts(proof.output_maps)["logits"])
    # The cut keeps exactly the frames the unpadded input yields.
    assert cut.shape == expected.shape
    if expected.ndim == 3:
        assert padded_out.shape[1] > expected.shape[1]
    np.testing.assert_allclose(cut, expected, rtol=0, atol=PADDED_ATOL, err_msg=f"{name} {real} -> {padded}")


def test_without_the_mask_the_padded_frames_change_the_real_ones(exported, rewritten):
    """The reason for the rewrite: padded frames fed unmasked move the real logits well past tolerance."""
    rewrite = rewritten("w2v-ctc-layer")
    audio = _audio(1, 16001, seed=3)
    padded_audio = np.zeros((1, 21800), np.float32)
    padded_audio[:, :16001] = audio
    (expected,) = _session(exported("w2v-ctc-layer")).run(None, {AUDIO: audio})
    (unmasked,) = _session(rewrite.model).run(
        None, {AUDIO: padded_audio, MASK_INPUT: np.ones((1, 21800), np.int64)}
    )
    assert np.max(np.abs(unmasked[:, : expected.shape[1]] - expected)) > 1e-2


def test_group_norm_keeps_the_samples_axis_exact_and_names_the_normalisation(rewritten):
    rewrite = rewritten("w2v-ctc-group")
    proof = _prove(rewrite, 1, 16001, 21800)
    assert not proof.exact
    assert "InstanceNormalization" in proof.problems[0], proof.problems


def test_xvector_statistics_pooling_keeps_the_samples_axis_exact(exported, rewritten):
    """The x-vector head pools mean and standard deviation over the TDNN's frames, which the mask does
    not follow (a dilated convolution without pads): the proof refuses, naming the pooling."""
    rewrite = rewritten("w2v-xvector-layer")
    proof = _prove(rewrite, 1, 16001, 21800)
    assert not proof.exact
    assert "ReduceMean" in proof.problems[0], proof.problems


@pytest.mark.parametrize("name", ["w2v-ctc-layer", "w2v-cls-layer"])
def test_the_rewritten_graph_legalizes_and_matches(exported, rewritten, name):
    rewrite = rewritten(name)
    audio = _audio(1, 16000, seed=7)
    legalized = legalize(rewrite.model, {AUDIO: (1, 16000), MASK_INPUT: (1, 16000)}, precision="fp32")
    feed = {AUDIO: audio, MASK_INPUT: np.ones((1, 16000), np.int64)}
    feed = {
        name: value.astype(helper.tensor_dtype_to_np_dtype(legalized.input_types[name]))
        for name, value in feed.items()
        if name in legalized.input_types
    }
    actual = _session(legalized.model).run(None, feed)[0]
    (expected,) = _session(exported(name)).run(None, {AUDIO: audio})
    np.testing.assert_allclose(actual, expected, rtol=0, atol=PADDED_ATOL)


def test_the_proof_stays_fast_at_thirty_seconds(rewritten):
    rewrite = rewritten("w2v-ctc-layer")
    analyzer = PaddingAnalyzer(rewrite.model)
    for real, padded in [(15000, 16000), (470000, 480000)]:
        start = time.perf_counter()
        proof = _prove(rewrite, 1, real, padded, analyzer)
        elapsed = time.perf_counter() - start
        assert proof.exact, proof.problems
        assert elapsed < 20, (padded, elapsed)
