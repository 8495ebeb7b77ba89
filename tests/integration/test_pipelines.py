"""Every pipeline task of optimum-onnx's ``ORT_TASKS_MAPPING`` with provider="ipu" (host emulator) against
the same pipeline on CPUExecutionProvider, through both entry points:

* ``transformers``: ``transformers.pipeline(task, model=<ORTModel loaded with provider="ipu">, ...)``;
* ``optimum``: ``optimum.pipelines.pipeline(task, model=<export directory>, accelerator="ort",
  model_kwargs={"provider": "ipu", ...})``, which picks the ORTModel class from the mapping and loads it.

The reference is ``transformers.pipeline`` on the same export loaded with CPUExecutionProvider, called with
the same inputs and arguments. Inputs are the sizes users feed: texts up to the model's limit (512 tokens
where the model takes them) and longer ones that the pipeline itself cuts (question answering's
``doc_stride``, token classification's ``stride``), images of 224 pixels and more, seconds of 16 kHz audio
(long clips cut with ``chunk_length_s`` and strides), and ``batch_size`` > 1 over inputs of mixed lengths.
What must agree: labels, tokens, spans, words and generated text identical; scores, embeddings and
pixels within the tolerances below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import transformers
from audio_zoo import real_size_zoo
from class_zoo import class_zoo
from full_matrix import Matrix
from pipeline_zoo import audio, clip_processor, ctc_tokenizer, images, texts

IPU = {"provider": "ipu", "provider_options": {"device": "emulator"}}
#: Scores (softmax probabilities), embeddings and logits: float32 sums taken in another order on the
#: emulator's legalized graph than on the export.
ATOL = 1e-5
MASKED_POSITIONS_ATOL = 1e-4
#: Image-to-image pixels come back as uint8: a value within ATOL of a rounding boundary may round the
#: other way.
PIXEL_ATOL = 1


class Task(NamedTuple):
    """One pipeline task on one tiny model: how to load it and how the pipeline is called."""

    ort_class: str
    model: str  # what the docs call the model
    call: Callable[[], tuple[Any, dict[str, Any]]]  # the pipeline's input and call arguments
    fed: str = ""  # the inputs, as docs/models.md lists them
    compared: str = ""  # what must be identical (and, for "scores" and the like, within ``atol``)
    atol: float = ATOL  # for every float the pipeline returns


def _generation(**extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": 16, "do_sample": False, **extra}


TASKS: Mapping[str, Task] = {
    "text-classification": Task(
        "ORTModelForSequenceClassification",
        "bert",
        lambda: (texts([200, 5]), {"top_k": None, "batch_size": 2, "truncation": True}),
        fed="texts of 200 words (truncated to the model's 128 tokens) and 5 words, batch_size 2",
        compared="labels and their order identical, scores",
    ),
    "zero-shot-classification": Task(
        "ORTModelForSequenceClassification",
        "mbart",
        lambda: (
            texts([480, 12]),
            {"candidate_labels": ["weather", "animals", "travel"], "multi_label": False, "batch_size": 4},
        ),
        fed="a 512-token text (truncated from 544) and a short one, 3 candidate labels, batch_size 4",
        compared="labels and their order identical, scores",
    ),
    "feature-extraction": Task(
        "ORTModelForFeatureExtraction",
        "minilm (all-MiniLM-L6-v2)",
        lambda: (texts([600, 9]), {"batch_size": 2, "tokenize_kwargs": {"truncation": True}}),
        # A batch's shorter rows come back with the positions the tokenizer padded: those attend to a few
        # real tokens only and their layer norms amplify rounding (tests/integration/test_real_sizes.py
        # holds them to the same 1e-4).
        atol=MASKED_POSITIONS_ATOL,
        fed="texts of 512 (truncated) and 12 tokens, batch_size 2",
        compared="every embedding of every position",
    ),
    "fill-mask": Task(
        "ORTModelForMaskedLM",
        "bert",
        lambda: (
            [f"{text} [MASK] {text}" for text in texts([32, 3], offset=2)],
            {"top_k": 3, "batch_size": 2},
        ),
        fed="a 121-token and a 25-token text with one mask each, top_k 3, batch_size 2",
        compared="tokens and sequences identical, scores",
    ),
    "token-classification": Task(
        "ORTModelForTokenClassification",
        "bert",
        lambda: (
            texts([240, 7]),
            {"aggregation_strategy": "simple", "stride": 32, "batch_size": 2},
        ),
        fed=(
            "a 512-token text cut by the pipeline's stride 32 into 128-token windows, and a short one, "
            "aggregation simple, batch_size 2"
        ),
        compared="entity groups, words and character spans identical, scores",
    ),
    "question-answering": Task(
        "ORTModelForQuestionAnswering",
        "bert",
        lambda: (
            {
                "question": ["where did the fox jump?", "what boils?"],
                "context": texts([240, 40]),
            },
            {"top_k": 3, "max_seq_len": 128, "doc_stride": 32, "batch_size": 2},
        ),
        fed=(
            "2 questions, a 512-token context cut by doc_stride 32 into 128-token windows and an "
            "81-token one, top_k 3, batch_size 2"
        ),
        compared="answers and character spans identical, scores",
    ),
    "text-generation": Task(
        "ORTModelForCausalLM",
        "gpt2",
        lambda: (texts([30, 4]), {**_generation(), "batch_size": 2}),
        fed="prompts of 84 and 14 tokens (a left-padded batch), 16 new tokens greedy, batch_size 2",
        compared="generated text identical",
    ),
    "text2text-generation": Task(
        "ORTModelForSeq2SeqLM",
        "t5",
        lambda: (texts([90, 6]), {**_generation(num_beams=2, max_new_tokens=8), "batch_size": 2}),
        fed="inputs of 90 and 6 words, 8 new tokens, 2 beams, batch_size 2",
        compared="generated text identical",
    ),
    "summarization": Task(
        "ORTModelForSeq2SeqLM",
        "bart",
        lambda: (
            texts([100, 25]),
            # the pipeline's own generation defaults otherwise (transformers' summarization: 4 beams)
            {"max_new_tokens": 10, "min_new_tokens": 4, "batch_size": 2, "truncation": True},
        ),
        fed=(
            "inputs of 100 and 25 words (truncated to 128 tokens), 4 to 10 new tokens with the "
            "pipeline's 4 beams, batch_size 2"
        ),
        compared="summary text identical",
    ),
    "translation": Task(
        "ORTModelForSeq2SeqLM",
        "t5",
        lambda: (texts([40, 8], offset=5), {**_generation(), "batch_size": 2}),
        fed="inputs of 40 and 8 words, 16 new tokens with the pipeline's 4 beams, batch_size 2",
        compared="translation text identical",
    ),
    "image-classification": Task(
        "ORTModelForImageClassification",
        "vit (224x224, patch 16)",
        lambda: (images([(224, 224), (320, 240), (160, 200), (500, 375)]), {"top_k": 4, "batch_size": 2}),
        fed="images of 224x224, 320x240, 160x200 and 500x375 (resized to 224), top_k 4, batch_size 2",
        compared="labels and their order identical, scores",
    ),
    "image-segmentation": Task(
        "ORTModelForSemanticSegmentation",
        "segformer",
        lambda: (images([(224, 224), (300, 200)], seed=1), {"subtask": "semantic", "batch_size": 2}),
        fed="images of 224x224 and 300x200 (resized to 224), semantic, batch_size 2",
        compared="labels identical, masks identical pixel for pixel",
    ),
    "image-to-text": Task(
        "ORTModelForVision2Seq",
        "vit-gpt2",
        # 4 new tokens: the decoder's past is compiled at each length (positions counted from it)
        lambda: (images([(224, 224), (256, 192)], seed=2), {"max_new_tokens": 4, "batch_size": 2}),
        fed="images of 224x224 and 256x192 (resized to 32), 4 new tokens, batch_size 2",
        compared="generated text identical",
    ),
    "automatic-speech-recognition (CTC)": Task(
        "ORTModelForCTC",
        "wavlm-ctc (layer-norm feature encoder, real strides)",
        lambda: (audio([25.0, 3.2]), {"chunk_length_s": 10, "stride_length_s": 2, "batch_size": 2}),
        fed="25 s of 16 kHz audio cut by chunk_length_s 10 with 2 s strides, and a 3.2 s clip, batch_size 2",
        compared="transcription identical",
    ),
    "automatic-speech-recognition (Whisper)": Task(
        "ORTModelForSpeechSeq2Seq",
        "whisper",
        lambda: (
            audio([42.0], seed=3),
            {"chunk_length_s": 30, "batch_size": 2, "generate_kwargs": {"max_new_tokens": 8}},
        ),
        fed=(
            "42 s of 16 kHz audio cut by chunk_length_s 30 (5 s strides) into two windows run as one "
            "batch, 8 new tokens with the pipeline's 5 beams, batch_size 2"
        ),
        compared="transcription identical",
    ),
    "audio-classification": Task(
        "ORTModelForAudioClassification",
        "wavlm-audio-classification (layer-norm feature encoder, real strides)",
        lambda: (audio([1.0, 10.0], seed=4), {"top_k": 5, "batch_size": 2}),
        fed=(
            "clips of 1 and 10 s at 16 kHz, top_k 5, batch_size 2 (the 1 s clip padded to 10 s by the "
            "pipeline)"
        ),
        compared="labels and their order identical, scores",
    ),
    "zero-shot-image-classification": Task(
        "ORTModelForZeroShotImageClassification",
        "clip",
        lambda: (
            images([(224, 224), (250, 300)], seed=5),
            {"candidate_labels": ["dog", "car", "river bridge"], "batch_size": 2},
        ),
        fed="images of 224x224 and 250x300 (resized to 30), 3 candidate labels, batch_size 2",
        compared="labels and their order identical, scores",
    ),
    "image-to-image": Task(
        "ORTModelForImageToImage",
        "swin2sr (x2 upscaling)",
        lambda: (images([(224, 224), (96, 64)], seed=6), {"batch_size": 1}),
        fed="images of 224x224 and 96x64, upscaled x2",
        compared="images identical in size, pixels within 1 of 255",
    ),
}

ENTRY_POINTS = ("transformers", "optimum")

#: Every task once, the entry points alternating down the list so that both are covered; the second
#: entry point of each task is release-only.
_SHARE = {(task, ENTRY_POINTS[index % 2]) for index, task in enumerate(TASKS)}

MATRIX = Matrix(
    "pipeline tasks",
    product=[(task, entry) for task in TASKS for entry in ENTRY_POINTS],
    share=_SHARE,
    covers={"task": lambda case: case[0], "entry point": lambda case: case[1]},
    why="each task through its other entry point: the same pipeline code on the same export, loaded once "
    "more (only the ORTModel class lookup and loading differ): 0.1 to 5 s a case with the first entry "
    "point's executables in the cache, where the first took 1 to 18 s",
)


def pipeline_task(task: str) -> str:
    """The pipeline's task name (the ASR rows name their model family in brackets)."""
    return task.split(" (")[0]


class Loaded(NamedTuple):
    onnx_dir: Path
    preprocessors: dict[str, Any]  # tokenizer / feature_extractor / image_processor / processor


def _load(zoo, task: str) -> Loaded:
    """The export of ``task``'s tiny model and the preprocessors its pipeline takes."""
    classes, sizes = class_zoo(zoo), real_size_zoo(zoo)
    tokenizer = transformers.AutoTokenizer.from_pretrained
    if task in ("text-classification", "fill-mask", "token-classification", "question-answering"):
        onnx_dir = zoo.onnx("bert", task)
        return Loaded(onnx_dir, {"tokenizer": tokenizer(onnx_dir)})
    if task == "zero-shot-classification":
        onnx_dir = zoo.onnx("mbart", "text-classification")
        return Loaded(onnx_dir, {"tokenizer": tokenizer(onnx_dir)})
    if task == "feature-extraction":
        onnx_dir = zoo.onnx("minilm", "feature-extraction")
        return Loaded(onnx_dir, {"tokenizer": tokenizer(onnx_dir)})
    if task == "text-generation":
        onnx_dir = zoo.onnx("gpt2", "text-generation-with-past")
        return Loaded(onnx_dir, {"tokenizer": tokenizer(onnx_dir)})
    if task in ("text2text-generation", "translation"):
        onnx_dir = zoo.onnx("t5", "text2text-generation-with-past")
        return Loaded(onnx_dir, {"tokenizer": tokenizer(onnx_dir)})
    if task == "summarization":
        onnx_dir = zoo.onnx("bart", "text2text-generation-with-past")
        return Loaded(onnx_dir, {"tokenizer": tokenizer(onnx_dir)})
    if task == "image-classification":
        onnx_dir = sizes.onnx("vit-224")
        return Loaded(
            onnx_dir, {"image_processor": transformers.AutoImageProcessor.from_pretrained(onnx_dir)}
        )
    if task == "image-segmentation":
        onnx_dir = classes.class_onnx("segformer")
        processor = transformers.SegformerImageProcessor(size={"height": 224, "width": 224})
        return Loaded(onnx_dir, {"image_processor": processor})
    if task == "image-to-text":
        onnx_dir = classes.class_onnx("vit-gpt2")
        processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
        # the zoo GPT-2's byte-level tokenizer: the decoder's 99 ids are its first byte symbols
        gpt2 = tokenizer(zoo.onnx("gpt2", "text-generation-with-past"))
        return Loaded(onnx_dir, {"image_processor": processor, "tokenizer": gpt2})
    if task == "automatic-speech-recognition (CTC)":
        onnx_dir = sizes.onnx("wavlm-layer-ctc")
        extractor = transformers.AutoFeatureExtractor.from_pretrained(onnx_dir)
        return Loaded(onnx_dir, {"feature_extractor": extractor, "tokenizer": ctc_tokenizer(zoo.root)})
    if task == "automatic-speech-recognition (Whisper)":
        onnx_dir = zoo.onnx("whisper", "automatic-speech-recognition-with-past")
        processor = transformers.WhisperProcessor.from_pretrained(zoo.model("whisper"))
        return Loaded(
            onnx_dir, {"feature_extractor": processor.feature_extractor, "tokenizer": processor.tokenizer}
        )
    if task == "audio-classification":
        onnx_dir = sizes.onnx("wavlm-layer-audio-classification")
        extractor = transformers.AutoFeatureExtractor.from_pretrained(onnx_dir)
        return Loaded(onnx_dir, {"feature_extractor": extractor})
    if task == "zero-shot-image-classification":
        onnx_dir = classes.class_onnx("clip")
        processor = clip_processor(image_size=30)
        return Loaded(
            onnx_dir, {"tokenizer": processor.tokenizer, "image_processor": processor.image_processor}
        )
    if task == "image-to-image":
        onnx_dir = classes.class_onnx("swin2sr")
        return Loaded(onnx_dir, {"image_processor": transformers.Swin2SRImageProcessor()})
    raise ValueError(f"no model for pipeline task {task!r}")


@pytest.fixture(scope="module")
def loaded(zoo) -> Callable[[str], Loaded]:
    cache: dict[str, Loaded] = {}

    def get(task: str) -> Loaded:
        if task not in cache:
            cache[task] = _load(zoo, task)
        return cache[task]

    return get


@pytest.fixture(scope="module")
def cpu_results(loaded) -> Callable[[str], Any]:
    """The CPU pipeline's answer per task, computed once for both entry points."""
    import optimum.onnxruntime

    cache: dict[str, Any] = {}

    def get(task: str) -> Any:
        if task not in cache:
            load = loaded(task)
            model = getattr(optimum.onnxruntime, TASKS[task].ort_class).from_pretrained(load.onnx_dir)
            inputs, kwargs = TASKS[task].call()
            pipe = transformers.pipeline(pipeline_task(task), model=model, **load.preprocessors)
            cache[task] = _call(_with_main_input_name(pipe), task, inputs, kwargs)
        return cache[task]

    return get


def _with_main_input_name(pipe):
    """``pipe`` with a CTC model that names its main input. The ASR pipeline feeds a CTC model through
    ``model.main_input_name``, which optimum-onnx 0.1's ORTModelForCTC lacks, so the pipeline fails on
    every provider, CPUExecutionProvider included; users set it themselves, as here (on both sides)."""
    if not hasattr(pipe.model, "main_input_name"):
        pipe.model.main_input_name = "input_values"
    return pipe


def _call(pipe, task: str, inputs: Any, kwargs: dict[str, Any]) -> Any:
    if pipeline_task(task) == "question-answering":
        return pipe(**inputs, **kwargs)
    if pipeline_task(task) == "translation":
        return pipe(inputs, src_lang="en", tgt_lang="de", **kwargs)
    return pipe(inputs, **kwargs)


def _ipu_pipeline(task: str, entry: str, load: Loaded):
    import optimum.onnxruntime

    if entry == "transformers":
        model = getattr(optimum.onnxruntime, TASKS[task].ort_class).from_pretrained(load.onnx_dir, **IPU)
        return transformers.pipeline(pipeline_task(task), model=model, **load.preprocessors)
    from optimum.pipelines import pipeline

    return pipeline(
        pipeline_task(task),
        model=str(load.onnx_dir),
        accelerator="ort",
        model_kwargs=IPU,
        **load.preprocessors,
    )


def compare(found: Any, expected: Any, atol: float, where: str = "") -> float:
    """The largest difference between two pipeline answers; raises AssertionError where anything other
    than a float (a label, a token, a span, a word, a generated text, a shape) differs, or a float, array
    or image differs by more than its tolerance."""
    from PIL import Image

    if isinstance(expected, Image.Image):
        assert isinstance(found, Image.Image) and found.size == expected.size, where
        return compare(np.asarray(found).astype(np.int64), np.asarray(expected).astype(np.int64), atol, where)
    if isinstance(expected, dict):
        assert isinstance(found, dict) and found.keys() == expected.keys(), (where, found, expected)
        return max(
            (compare(found[key], expected[key], atol, f"{where}.{key}") for key in expected), default=0.0
        )
    if isinstance(expected, (list, tuple)):
        assert isinstance(found, (list, tuple)) and len(found) == len(expected), (where, found, expected)
        pairs = enumerate(zip(found, expected, strict=True))
        return max((compare(f, e, atol, f"{where}[{i}]") for i, (f, e) in pairs), default=0.0)
    if hasattr(expected, "numpy") or isinstance(expected, np.ndarray):
        found_array, expected_array = np.asarray(found), np.asarray(expected)
        assert found_array.shape == expected_array.shape, (where, found_array.shape, expected_array.shape)
        if expected_array.dtype.kind in "iub":  # masks, pixels
            difference = float(np.abs(found_array.astype(np.int64) - expected_array.astype(np.int64)).max())
            limit = 0 if expected_array.dtype == bool or expected_array.ndim == 2 else PIXEL_ATOL
        else:
            difference = float(np.abs(found_array - expected_array).max(initial=0.0))
            limit = atol
        assert difference <= limit, (where, difference)
        return difference
    if isinstance(expected, (float, np.floating)) and not isinstance(found, str):
        assert not math.isnan(expected) and abs(found - expected) <= atol, (where, found, expected)
        return abs(found - expected)
    assert found == expected, (where, found, expected)
    return 0.0


def _leaves(answer: Any) -> list:
    """The strings and numbers of a pipeline answer (arrays and images flattened)."""
    from PIL import Image

    if isinstance(answer, dict):
        return [leaf for value in answer.values() for leaf in _leaves(value)]
    if isinstance(answer, (list, tuple)):
        return [leaf for value in answer for leaf in _leaves(value)]
    if isinstance(answer, Image.Image) or hasattr(answer, "numpy") or isinstance(answer, np.ndarray):
        return np.asarray(answer).reshape(-1)[:10_000].tolist()
    return [answer]


def assert_informative(answer: Any) -> None:
    """An answer that could tell two providers apart: varied numbers, or a text of a few characters (a
    constant answer, such as an empty transcription, would match whatever ran)."""
    leaves = _leaves(answer)
    numbers = {round(float(leaf), 6) for leaf in leaves if isinstance(leaf, (int, float, np.number))}
    words = {leaf for leaf in leaves if isinstance(leaf, str) and len(set(leaf.strip())) >= 3}
    assert len(numbers) >= 3 or words, answer


@pytest.mark.parametrize(("task", "entry"), MATRIX.cases, ids=[f"{t}-{e}" for t, e in MATRIX.cases])
def test_pipeline_matches_cpu(loaded, cpu_results, task, entry):
    import optimum.onnxruntime

    load = loaded(task)
    expected = cpu_results(task)
    pipe = _ipu_pipeline(task, entry, load)
    assert isinstance(pipe.model, getattr(optimum.onnxruntime, TASKS[task].ort_class))
    assert pipe.model.providers[0] == "IPUExecutionProvider"
    inputs, kwargs = TASKS[task].call()
    found = _call(_with_main_input_name(pipe), task, inputs, kwargs)
    assert_informative(expected)
    difference = compare(found, expected, TASKS[task].atol)
    print(f"{task} via {entry}: largest difference {difference:.3g}")


def test_clip_scores_a_different_number_of_images_and_texts(zoo):
    """CLIP's export has two batch dimensions (``image_batch_size``, ``text_batch_size``); the
    zero-shot image pipeline feeds them different sizes (images against candidate labels). Such a call
    runs whole, each compiled at its size: cut into device steps along one of them it was refused
    ("the array has 2 samples on axis 0, the plan 3"), and repeating rows would pair wrong ones."""
    from class_zoo import class_inputs
    from optimum.onnxruntime import ORTModelForZeroShotImageClassification

    classes = class_zoo(zoo)
    feed = class_inputs("clip", classes.class_model("clip"), batch=3)
    feed["pixel_values"] = feed["pixel_values"][:2]
    onnx_dir = classes.class_onnx("clip")
    cpu = ORTModelForZeroShotImageClassification.from_pretrained(onnx_dir)
    ipu = ORTModelForZeroShotImageClassification.from_pretrained(onnx_dir, **IPU)
    expected, found = cpu.model.run(None, feed), ipu.model.run(None, feed)
    names = [output.name for output in cpu.model.get_outputs()]
    for name, want, got in zip(names, expected, found, strict=True):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=name)
    logits = dict(zip(names, expected, strict=True))["logits_per_image"]
    assert logits.shape == (2, 3) and np.ptp(logits) > 1e-3
    (entry,) = ipu.model.compiled_executables()
    assert entry["shapes"]["pixel_values"][0] == 2 and entry["shapes"]["input_ids"][0] == 3
