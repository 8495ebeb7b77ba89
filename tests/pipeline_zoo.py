"""The preprocessors a ``transformers.pipeline`` needs beside the zoos' models, built locally: test data for
tests/integration/test_pipelines.py.

The class zoo (tests/class_zoo.py) and the real-size zoo (tests/audio_zoo.py) save some models without a
tokenizer or processor (their checks feed arrays); a pipeline takes text, images or audio, so each gets
the preprocessor its architecture uses, sized to the tiny model: a CTC character vocabulary of the
wav2vec2 head's 32 ids, a word-level CLIP tokenizer inside the CLIP text tower's 99 ids (ending every text
with its end-of-text id 98), and image processors at each model's image size. The inputs users feed
(``texts``, ``images``, ``audio``) are here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from optimum_ipu_backend.conformance.zoo import CORPUS, build_once

if TYPE_CHECKING:
    import PIL.Image
    import transformers

SAMPLING_RATE = 16_000

#: Wav2Vec2CTCTokenizer's layout: pad (the CTC blank) first, "|" the word delimiter, then letters.
_CTC_VOCAB = ("<pad>", "<s>", "</s>", "<unk>", "|", *"abcdefghijklmnopqrstuvwxyz", "'")

#: The CLIP text tower of tests/class_zoo.py: 99 ids, <|startoftext|> 0, padding 1, <|endoftext|> 98.
_CLIP_VOCAB_SIZE = 99
_CLIP_SPECIALS = {"<|startoftext|>": 0, "<pad>": 1, "<unk>": 2, "<|endoftext|>": _CLIP_VOCAB_SIZE - 1}


def ctc_tokenizer(root: Path) -> transformers.Wav2Vec2CTCTokenizer:
    """A character-level CTC tokenizer over the 32 ids of the audio zoos' CTC heads."""
    import transformers

    def build(staging: Path) -> None:
        (staging / "vocab.json").write_text(
            json.dumps({token: index for index, token in enumerate(_CTC_VOCAB)}), encoding="utf-8"
        )

    directory = build_once(Path(root) / "ctc-tokenizer", build)
    return transformers.Wav2Vec2CTCTokenizer(str(directory / "vocab.json"))


def clip_processor(image_size: int) -> transformers.CLIPProcessor:
    """CLIP's processor for the class zoo's CLIP: a word-level tokenizer of the corpus' words (ids 3 to 97,
    unknown words 2) that wraps every text in <|startoftext|> ... <|endoftext|>, and CLIP's image
    processor at ``image_size``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({word.strip(".,?!") for sentence in CORPUS for word in sentence.split()} - {""})
    vocab = dict(_CLIP_SPECIALS)
    for word in words[: _CLIP_VOCAB_SIZE - len(_CLIP_SPECIALS)]:
        vocab[word] = len(vocab) - 1  # ids 3.. (98 is taken by <|endoftext|>)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[(token, vocab[token]) for token in ("<|startoftext|>", "<|endoftext|>")],
    )
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=16,
        model_input_names=["input_ids", "attention_mask"],
    )
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return transformers.CLIPProcessor(image_processor=image_processor, tokenizer=wrapped)


def texts(words: list[int], offset: int = 0) -> list[str]:
    """One text per entry, of that many words of the corpus (starting ``offset`` words in)."""
    corpus = " ".join(CORPUS).split()
    corpus = corpus[offset:] + corpus[:offset]
    return [" ".join(np.resize(corpus, count)) for count in words]


def images(sides: list[tuple[int, int]], seed: int = 0) -> list[PIL.Image.Image]:
    """RGB images of the (width, height) given: smooth random colour fields, as photographs are smooth."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    found = []
    for width, height in sides:
        coarse = rng.integers(0, 256, (max(height // 16, 2), max(width // 16, 2), 3), dtype=np.uint8)
        found.append(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))
    return found


def audio(seconds: list[float], seed: int = 0) -> list[np.ndarray]:
    """Clips of 16 kHz audio of those durations (random samples at speech-like scale, 0.1)."""
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(round(s * SAMPLING_RATE))).astype(np.float32) for s in seconds]
