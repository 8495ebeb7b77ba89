"""Every generation mode of ``generate()`` on the ipu provider (issue 39), on GPT-2 and T5 with their
key/value cache, against the same export on CPUExecutionProvider: tokens identical, or the same refusal.

What transformers 4.57 and optimum-onnx 0.1 serve offline, and what each case compares:

* **assisted generation** (``assistant_model=``) and **prompt-lookup decoding**
  (``prompt_lookup_num_tokens=``) fail inside transformers on either provider: assisted decoding crops
  ``outputs.past_key_values`` with ``Cache.crop`` and optimum-onnx returns the cache as tuples
  (``AttributeError: 'tuple' object has no attribute 'crop'``). On ipu that failure is raised as
  ``UnsupportedGenerationModeError`` naming the mode (integration/generation_modes.py); the cases compare
  tokens once optimum-onnx serves the mode on CPU. The calls these
  modes make of a model are checked by ``speculative-*``: the same loop driven step by step here (draft or
  n-gram candidates, one verifying call with several new tokens and a past, the caches cropped after the
  rejected tokens), on ipu and on CPU, whose tokens must also equal plain greedy decoding.
* **contrastive search, group (diverse) beam search, constrained beam search** moved out of transformers
  (4.56) into custom_generate repositories on the Hub; without the network both providers raise the same
  ``ValueError`` naming the mode, with and without ``trust_remote_code=True``.
* **a TextIteratorStreamer** (generation in a thread, text streamed), and the **stopping criteria**
  ``stop_strings`` with a tokenizer, ``max_time``, a custom ``StoppingCriteria`` and an EOS token that ends
  one row of a batch of two prompts of mixed lengths early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from full_matrix import Matrix
from transformers import StoppingCriteria

from integration import kv_cache_checks
from optimum_ipu_backend.conformance.zoo import CORPUS
from optimum_ipu_backend.integration.generation_modes import CACHE_CROPPING_MODES

PROMPT_TOKENS = 320
NEW_TOKENS = 32
DRAFT_TOKENS = 4  # candidates proposed per verifying call


class GenerationModel(NamedTuple):
    ort_class: str
    zoo_name: str  # the model zoo's name (tests/model_zoo.py)
    draft: str  # a smaller model over the same vocabulary, the draft of assisted generation


MODELS: dict[str, GenerationModel] = {
    # GPT-2 with 1,024 positions (prompts of a few hundred tokens); its draft is the real-size zoo's GPT-2
    # of another seed and 1,040 positions (tests/audio_zoo.py), over the same tokenizer
    "gpt2": GenerationModel("ORTModelForCausalLM", "gpt2-long", "gpt2-1040-positions"),
    # T5's draft is the zoo's LongT5, built over the same tokenizer
    "t5": GenerationModel("ORTModelForSeq2SeqLM", "t5", "longt5"),
}
TASKS = {
    "ORTModelForCausalLM": "text-generation-with-past",
    "ORTModelForSeq2SeqLM": "text2text-generation-with-past",
}

MODES = (
    "assisted",
    "prompt-lookup",
    "speculative-draft",
    "speculative-self-draft",
    "speculative-prompt-lookup",
    "contrastive",
    "group-beam",
    "constrained-beam",
    "streamer",
    "stop-strings",
    "max-time",
    "custom-criteria",
    "eos",
)
#: What the default command runs: every mode once and both models, grouped so that a model's cases share
#: executables: GPT-2 the draft-model and verifying calls (its prompt and verifying executables, its
#: draft's prefill and decode), T5 the one-token steps (encoder, prefill, decode, the verifying calls of
#: prompt lookup, and the batch of two).
DEFAULT_SHARE = {
    ("assisted", "gpt2"),
    ("prompt-lookup", "gpt2"),
    ("speculative-draft", "gpt2"),
    ("speculative-self-draft", "t5"),
    ("speculative-prompt-lookup", "t5"),
    ("contrastive", "gpt2"),
    ("group-beam", "t5"),
    ("constrained-beam", "gpt2"),
    ("streamer", "t5"),
    ("stop-strings", "t5"),
    ("max-time", "t5"),
    ("custom-criteria", "t5"),
    ("eos", "t5"),
}
MATRIX: Matrix[tuple[str, str]] = Matrix(
    "generation-modes",
    product=[(mode, model) for mode in MODES for model in MODELS],
    share=DEFAULT_SHARE,
    covers={"mode": lambda case: case[0], "model": lambda case: case[1]},
    why="each further pair compiles its own prefill, decode and verifying executables on the emulator "
    "(a draft model's too), and each verifying call of a new length runs its own padding proof (about "
    "0.3 s on two cores): the product takes 245 s here, the share 128 s",
)


# -- models, prompts ------------------------------------------------------------------------------


@dataclass
class Loaded:
    """One model on CPU and on ipu (one executable cache for the module), its draft, its tokenizer."""

    name: str
    cpu: Any
    ipu: Any
    draft_cpu: Any
    draft_ipu: Any
    tokenizer: Any
    seq2seq: bool


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> dict[str, str]:
    return {"device": "emulator", "executable_cache_dir": str(tmp_path_factory.mktemp("generation-modes"))}


@pytest.fixture(scope="module")
def loaded(zoo, options) -> Callable[[str], Loaded]:
    import optimum.onnxruntime as ort_models
    import transformers
    from audio_zoo import VARIANTS, real_size_zoo

    models: dict[str, Loaded] = {}

    def export(name: str, task: str) -> Path:
        return real_size_zoo(zoo).onnx(name) if name in VARIANTS else zoo.onnx(name, task)

    def load(name: str) -> Loaded:
        if name not in models:
            spec = MODELS[name]
            cls = getattr(ort_models, spec.ort_class)
            task = TASKS[spec.ort_class]
            main, draft = export(spec.zoo_name, task), export(spec.draft, task)
            models[name] = Loaded(
                name,
                cls.from_pretrained(main, provider="CPUExecutionProvider"),
                cls.from_pretrained(main, provider="ipu", provider_options=dict(options)),
                cls.from_pretrained(draft, provider="CPUExecutionProvider"),
                cls.from_pretrained(draft, provider="ipu", provider_options=dict(options)),
                transformers.AutoTokenizer.from_pretrained(main),
                spec.ort_class == "ORTModelForSeq2SeqLM",
            )
        return models[name]

    return load


def prompt(model: Loaded, tokens: int = PROMPT_TOKENS, offset: int = 0) -> dict[str, torch.Tensor]:
    """``tokens`` tokens of the corpus' English (starting ``offset`` sentences in), one row."""
    text = " ".join(CORPUS[offset:] + CORPUS * 8)
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"][:, :tokens]
    assert ids.shape == (1, tokens)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def greedy(model: Any, inputs: dict[str, torch.Tensor], new_tokens: int = NEW_TOKENS, **extra: Any):
    settings = {"max_new_tokens": new_tokens, "do_sample": False, "num_beams": 1, **extra}
    with torch.no_grad():
        return model.generate(**inputs, **settings)


def outcome(call: Callable[[], Any]) -> tuple:
    """What a generate() call ends in: ("tokens", list) or ("error", type, message)."""
    try:
        return ("tokens", call().tolist())
    except Exception as exc:  # noqa: BLE001 - compared between providers
        return ("error", type(exc).__name__, str(exc))


def new_part(tokens: torch.Tensor, model: Loaded, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The generated tokens of generate()'s result: after the prompt, or after the decoder's start token."""
    return tokens[:, 1 if model.seq2seq else inputs["input_ids"].shape[1] :]


# -- the calls assisted decoding makes, driven step by step ---------------------------------------------


class Stepper:
    """One model's forward calls with a cache, as assisted decoding makes them: ``step(tokens, past)``
    feeds the tokens the past does not hold yet and returns their logits and the grown past; ``crop``
    cuts the past to its first positions (the self-attention part of a seq2seq cache; the cross-attention
    part is the encoder's)."""

    def __init__(self, model: Any, inputs: dict[str, torch.Tensor], seq2seq: bool) -> None:
        self.model, self.inputs, self.seq2seq = model, inputs, seq2seq
        self.encoder_outputs = None
        if seq2seq:
            with torch.no_grad():
                self.encoder_outputs = model.get_encoder()(**inputs)

    def start(self) -> list[int]:
        """The tokens generation starts from: the prompt, or the decoder's start token."""
        if self.seq2seq:
            return [int(self.model.config.decoder_start_token_id)]
        return self.inputs["input_ids"][0].tolist()

    def step(self, new: list[int], past: Any) -> tuple[torch.Tensor, Any]:
        held = 0 if past is None else past[0][0].shape[2]
        ids = torch.tensor([new], dtype=torch.int64)
        with torch.no_grad():
            if self.seq2seq:
                out = self.model(
                    encoder_outputs=self.encoder_outputs,
                    attention_mask=self.inputs["attention_mask"],
                    decoder_input_ids=ids,
                    past_key_values=past,
                    use_cache=True,
                )
            else:
                mask = torch.ones((1, held + len(new)), dtype=torch.int64)
                out = self.model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True)
        return out.logits[0], out.past_key_values

    def crop(self, past: Any, length: int) -> Any:
        grown = 2 if self.seq2seq else len(past[0])  # T5: (self key, self value, cross key, cross value)
        return tuple(
            tuple(t[:, :, :length] if index < grown else t for index, t in enumerate(layer)) for layer in past
        )


@dataclass
class LoopFacts:
    verifying_calls: int = 0  # calls with candidates: several new tokens and a past
    accepted: int = 0  # candidates accepted
    crops: int = 0  # caches cut after rejected tokens (the verifier's and the draft's)
    draft_multi_token_calls: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # of every call of the verifying model
    largest_difference: float = 0.0  # between those logits on ipu and on CPU


class DraftCandidates:
    """A draft model's greedy continuation of ``DRAFT_TOKENS`` tokens, from its own cache, cropped to what
    the sequence still shares with it (as transformers' AssistedCandidateGenerator keeps it)."""

    def __init__(self, stepper: Stepper, facts: LoopFacts) -> None:
        self.stepper, self.facts = stepper, facts
        self.past: Any = None
        self.held: list[int] = []  # the tokens whose keys and values the draft's cache holds

    def __call__(self, sequence: list[int]) -> list[int]:
        shared = 0
        while shared < min(len(self.held), len(sequence) - 1) and self.held[shared] == sequence[shared]:
            shared += 1
        if self.past is not None and shared < len(self.held):
            self.past = self.stepper.crop(self.past, shared)
            self.facts.crops += 1
        feed, self.held = sequence[shared:], sequence[:shared]
        self.facts.draft_multi_token_calls += int(self.past is not None and len(feed) > 1)
        proposed: list[int] = []
        for _ in range(DRAFT_TOKENS):
            logits, self.past = self.stepper.step(feed, self.past)
            self.held += feed
            feed = [int(logits[-1].argmax())]
            proposed += feed
        return proposed


class PromptLookupCandidates:
    """transformers' n-gram candidates (PromptLookupCandidateGenerator) from the sequence so far."""

    def __init__(self, eos_token_id: int) -> None:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        self.generator = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor([eos_token_id]), num_output_tokens=DRAFT_TOKENS, max_length=10**6
        )

    def __call__(self, sequence: list[int]) -> list[int]:
        candidates, _ = self.generator.get_candidates(torch.tensor([sequence]))
        return candidates[0, len(sequence) :].tolist()


def speculative(
    model: Any, candidates_of: Callable[[LoopFacts], Callable[[list[int]], list[int]]], loaded: Loaded, inputs
) -> tuple[list[int], LoopFacts]:
    """Greedy assisted decoding: each call feeds the last token and the candidates, keeps the candidates
    up to the first that greedy decoding would not pick plus the model's own next token, and crops the
    cache to the kept tokens. Returns the ``NEW_TOKENS`` new tokens and what the loop did."""
    facts = LoopFacts()
    stepper = Stepper(model, inputs, loaded.seq2seq)
    propose = candidates_of(facts)
    sequence = stepper.start()
    start = len(sequence)
    logits, past = stepper.step(sequence, None)
    facts.logits.append(logits)
    sequence.append(int(logits[-1].argmax()))
    while len(sequence) - start < NEW_TOKENS:
        candidates = propose(sequence)
        logits, past = stepper.step(sequence[-1:] + candidates, past)
        facts.logits.append(logits)
        chosen = logits.argmax(-1).tolist()
        kept = 0
        while kept < len(candidates) and candidates[kept] == chosen[kept]:
            kept += 1
        facts.verifying_calls += int(bool(candidates))
        facts.accepted += kept
        sequence += candidates[:kept] + [chosen[kept]]
        if past[0][0].shape[2] > len(sequence) - 1:
            past = stepper.crop(past, len(sequence) - 1)
            facts.crops += 1
    return sequence[start : start + NEW_TOKENS], facts


# -- the cases --------------------------------------------------------------------------------------


def check_cache_cropping_mode(model: Loaded, argument: str) -> None:
    """Assisted generation or prompt-lookup decoding: CPU's tokens, or, where optimum-onnx's tuple cache
    fails to crop on CPU too, the ipu provider's refusal naming the mode."""
    inputs = prompt(model)
    cpu, ipu = (
        ({"assistant_model": model.draft_cpu}, {"assistant_model": model.draft_ipu})
        if argument == "assistant_model"
        else ({argument: DRAFT_TOKENS}, {argument: DRAFT_TOKENS})
    )
    expected = outcome(lambda: greedy(model.cpu, inputs, **cpu))
    got = outcome(lambda: greedy(model.ipu, inputs, **ipu))
    if expected[0] == "error" and expected[1] == "AttributeError" and "crop" in expected[2]:
        assert got[:2] == ("error", "UnsupportedGenerationModeError"), got
        assert CACHE_CROPPING_MODES[argument] in got[2] and "every provider" in got[2], got
    else:
        assert got == expected, (got[:2], expected[:2])


def _speculative_case(model: Loaded, candidates_from: str) -> LoopFacts:
    """``candidates_from``: "draft" (the smaller model: its candidates are rejected), "self-draft" (the
    model itself: its candidates are accepted, so the draft is fed two new tokens at a time) or
    "prompt-lookup"."""
    inputs = prompt(model)
    eos = int(model.cpu.config.eos_token_id)
    draft = candidates_from != "prompt-lookup"
    # the model itself drafts from its own session: one decode executable serves both caches in turn
    drafters = (
        (model.cpu, model.ipu) if candidates_from == "self-draft" else (model.draft_cpu, model.draft_ipu)
    )

    def candidates(drafter: Any) -> Callable[[LoopFacts], Callable[[list[int]], list[int]]]:
        if draft:
            return lambda facts: DraftCandidates(Stepper(drafter, inputs, model.seq2seq), facts)
        return lambda facts: PromptLookupCandidates(eos)

    def served_on_device() -> int:
        sessions = kv_cache_checks.decoder_sessions(drafters[1])
        return sum(
            e["calls"] for s in sessions for e in s.compiled_executables() if e.get("kv_cache") == "device"
        )

    expected, on_cpu = speculative(model.cpu, candidates(drafters[0]), model, inputs)
    served_before = served_on_device()
    with kv_cache_checks.counted_uploads() as uploads:
        got, facts = speculative(model.ipu, candidates(drafters[1]), model, inputs)
    assert got == expected
    facts.largest_difference = max(
        float((a - b).abs().max()) for a, b in zip(facts.logits, on_cpu.logits, strict=True)
    )
    assert facts.largest_difference <= kv_cache_checks.LOGITS_ATOL, facts.largest_difference
    plain = new_part(greedy(model.cpu, inputs), model, inputs)[0].tolist()
    # assisted greedy decoding is greedy decoding (generate() stops at EOS, the loop goes on)
    common = min(len(plain), len(expected))
    assert common >= 12 and plain[:common] == expected[:common], (plain, expected)
    assert len(set(expected)) >= 4, "degenerate generation cannot tell providers apart"
    assert facts.verifying_calls >= 4, facts
    if candidates_from == "self-draft":
        assert facts.accepted >= NEW_TOKENS // 2 and facts.draft_multi_token_calls >= 2, facts
    else:
        assert facts.crops >= 1, facts
    if candidates_from == "prompt-lookup":
        assert facts.accepted >= 1, facts  # n-gram candidates of a looping decoder are partly accepted
    else:
        # the draft's one-token steps ran with its cache on the device, uploaded again after each crop
        # or step of several tokens
        served = served_on_device() - served_before
        assert served >= NEW_TOKENS // 2, served
        assert len(uploads) >= 2, uploads
    return facts


def check_hub_mode(model: Loaded, mode: str, extra: dict[str, Any]) -> None:
    """A mode transformers serves only from a Hub repository: the same refusal, offline, on both."""
    inputs = prompt(model, tokens=64)
    for trust in (False, True):
        settings = {"trust_remote_code": trust, **extra}
        expected = outcome(lambda settings=settings: greedy(model.cpu, inputs, **settings))
        got = outcome(lambda settings=settings: greedy(model.ipu, inputs, **settings))
        assert got == expected, (got, expected)
        if not trust:
            assert expected[0] == "error" and HUB_MODES[mode][0] in expected[2], expected


def check_streamer(model: Loaded) -> None:
    from transformers import TextIteratorStreamer

    inputs = prompt(model)

    def streamed(ort_model: Any) -> tuple[list[str], torch.Tensor]:
        streamer = TextIteratorStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict[str, Any] = {}

        def work() -> None:
            result["tokens"] = greedy(ort_model, inputs, min_new_tokens=NEW_TOKENS, streamer=streamer)

        thread = threading.Thread(target=work)
        thread.start()
        pieces = list(streamer)  # blocks until generation ends
        thread.join(timeout=300)
        return pieces, result["tokens"]

    expected_pieces, expected = streamed(model.cpu)
    pieces, got = streamed(model.ipu)
    assert torch.equal(got, expected)
    assert pieces == expected_pieces and len(pieces) >= 4, pieces
    text = model.tokenizer.decode(new_part(got, model, inputs)[0], skip_special_tokens=True)
    assert "".join(pieces).strip() == text.strip()


def check_stop_strings(model: Loaded) -> None:
    inputs = prompt(model)
    full = new_part(greedy(model.cpu, inputs, min_new_tokens=NEW_TOKENS), model, inputs)[0]
    # a stop string that greedy decoding reaches after 12 new tokens: the text of tokens 12 and 13
    stop = model.tokenizer.decode(full[11:13], skip_special_tokens=True).strip()
    assert len(stop) >= 2, stop
    settings = {"stop_strings": [stop], "tokenizer": model.tokenizer, "max_new_tokens": NEW_TOKENS}
    with torch.no_grad():
        expected = model.cpu.generate(**inputs, **settings)
        got = model.ipu.generate(**inputs, **settings)
    assert torch.equal(got, expected)
    assert new_part(expected, model, inputs).shape[1] < NEW_TOKENS  # it stopped at the string


def check_max_time(model: Loaded) -> None:
    """Where max_time ends a generation depends on each provider's speed; what is generated until then
    must be CPU's greedy tokens."""
    inputs = prompt(model)
    greedy(model.ipu, inputs, new_tokens=4)  # compiled before the clock runs
    long = 4 * NEW_TOKENS
    expected = new_part(greedy(model.cpu, inputs, new_tokens=long, min_new_tokens=long), model, inputs)[0]
    got = new_part(
        greedy(model.ipu, inputs, new_tokens=long, min_new_tokens=long, max_time=3.0), model, inputs
    )
    assert 1 <= got.shape[1] <= long
    assert torch.equal(got[0], expected[: got.shape[1]]), (got[0].tolist(), expected.tolist())


class StopAtSecondRepeat(StoppingCriteria):
    """A custom criterion: a row is done once its new tokens hold ``token`` twice."""

    def __init__(self, token: int, start: int) -> None:
        self.token, self.start, self.calls = token, start, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return (input_ids[:, self.start :] == self.token).sum(-1) >= 2


def check_custom_criteria(model: Loaded) -> None:
    from transformers import StoppingCriteriaList

    inputs = prompt(model)
    full = new_part(greedy(model.cpu, inputs, min_new_tokens=NEW_TOKENS), model, inputs)[0].tolist()
    repeated = [token for index, token in enumerate(full) if token in full[:index]]
    assert repeated, f"no token repeats in {full}"
    start = 1 if model.seq2seq else inputs["input_ids"].shape[1]
    criteria = {}
    outputs = {}
    for label, ort_model in (("cpu", model.cpu), ("ipu", model.ipu)):
        criterion = StopAtSecondRepeat(repeated[0], start)
        criteria[label] = criterion
        outputs[label] = greedy(ort_model, inputs, stopping_criteria=StoppingCriteriaList([criterion]))
    assert torch.equal(outputs["ipu"], outputs["cpu"])
    assert criteria["ipu"].calls == criteria["cpu"].calls
    assert new_part(outputs["cpu"], model, inputs).shape[1] < NEW_TOKENS


def check_eos(model: Loaded) -> None:
    """A batch of two prompts of mixed lengths (padded as the tokenizer pads); a token that one row emits
    after 4 to 24 new tokens, and the other row not before, is made the EOS token, so that row ends early
    and is padded while the other goes on."""
    texts = [" ".join(CORPUS * 6), " ".join(CORPUS[3:8])]
    batch = model.tokenizer(
        texts, return_tensors="pt", padding=True, truncation=True, max_length=PROMPT_TOKENS
    )
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert lengths[0] == PROMPT_TOKENS and lengths[1] < PROMPT_TOKENS - 50, lengths
    full = new_part(greedy(model.cpu, batch, min_new_tokens=NEW_TOKENS), model, batch).tolist()
    ends = [
        (row, at)
        for at in range(4, 24)
        for row in (0, 1)
        if full[row][at] not in full[row][:at] + full[1 - row][: at + 3]
    ]
    assert ends, f"no token ends one row alone: {full}"
    row, at = ends[0]
    eos, pad = full[row][at], int(model.tokenizer.pad_token_id)
    expected = greedy(model.cpu, batch, eos_token_id=eos, pad_token_id=pad)
    got = greedy(model.ipu, batch, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(got, expected)
    rows = new_part(expected, model, batch)
    assert rows[row, at] == eos and (rows[row, at + 1 :] == pad).all(), rows[row].tolist()
    assert rows.shape[1] > at + 2  # the other row went on


#: The modes transformers moved to the Hub: the name its refusal gives, and the settings that select it.
HUB_MODES = {
    "contrastive": ("Contrastive Search", {"penalty_alpha": 0.6, "top_k": 4}),
    "group-beam": ("Group Beam Search", {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}),
    "constrained-beam": ("Constrained Beam Search", {"num_beams": 4, "force_words_ids": [[5, 6]]}),
}


@pytest.mark.parametrize("mode,model_name", MATRIX.cases, ids=[f"{m}-{n}" for m, n in MATRIX.cases])
def test_generation_mode_matches_cpu(loaded, mode, model_name):
    model = loaded(model_name)
    if mode == "assisted":
        check_cache_cropping_mode(model, "assistant_model")
    elif mode == "prompt-lookup":
        check_cache_cropping_mode(model, "prompt_lookup_num_tokens")
    elif mode.startswith("speculative-"):
        _speculative_case(model, mode.removeprefix("speculative-"))
    elif mode in HUB_MODES:
        check_hub_mode(model, mode, HUB_MODES[mode][1])
    else:
        {
            "streamer": check_streamer,
            "stop-strings": check_stop_strings,
            "max-time": check_max_time,
            "custom-criteria": check_custom_criteria,
            "eos": check_eos,
        }[mode](model)
