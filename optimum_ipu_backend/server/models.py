"""The served model: one ORTModel on ``provider="ipu"`` with its tokenizer, the task it serves, the limits
a request is checked against, and the three calls the endpoints make (embed, classify, generate).

Everything here uses the public ORTModel API and the public methods of the IPU session
(``compiled_executables``, ``bucket_sizes``, ...); nothing below the session is imported.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.errors import ConfigurationError, InvalidFeedError

_logger = logging.getLogger(__name__)

#: task -> (the ORTModel class that serves it, the endpoints it gets). The task names are optimum's.
SUPPORTED_TASKS: Mapping[str, str] = {
    "feature-extraction": "ORTModelForFeatureExtraction",
    "text-classification": "ORTModelForSequenceClassification",
    "text-generation": "ORTModelForCausalLM",
}
#: Pooling of token states into one embedding, as sentence-transformers' Pooling module names them.
POOLING_MODES = ("mean", "cls", "lasttoken")
#: text-embeddings-inference's default ``--max-client-batch-size``: the most inputs one request may carry.
DEFAULT_MAX_INPUTS = 32


class RequestError(InvalidFeedError):
    """A request the server refuses: which field, what is wrong, the limit, and the HTTP status (the app
    answers it as a 4xx; it never reaches the client as an exception)."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


@dataclass
class ServeOptions:
    """What ``optimum-ipu serve`` was asked to serve, and how."""

    model: str
    task: str | None = None
    provider_options: dict[str, str] = field(default_factory=dict)
    tokenizer: str | None = None
    pooling: str | None = None
    max_inputs: int = DEFAULT_MAX_INPUTS
    max_input_tokens: int | None = None
    precompile: bool = False
    served_name: str | None = None


def is_export(model_dir: Path) -> bool:
    """An ONNX export (served as it is) rather than a transformers checkpoint (exported at start-up)."""
    return any(model_dir.glob("*.onnx"))


def resolve_task(model_dir: Path, task: str | None) -> str:
    """The task to serve: ``task`` when given, else inferred by optimum from the architecture the export's
    ``config.json`` names. Refused, with the supported tasks, when it is not one of them."""
    if task is None:
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise ConfigurationError(
                f"{model_dir} has no config.json to infer the task from; pass --task "
                f"(one of {', '.join(SUPPORTED_TASKS)})"
            )
        architectures = json.loads(config_file.read_text(encoding="utf-8")).get("architectures") or []
        task = _task_of_architecture(architectures[0]) if architectures else None
        if task is None:
            raise ConfigurationError(
                f"cannot infer the task of {model_dir} (architectures {architectures}); pass --task "
                f"(one of {', '.join(SUPPORTED_TASKS)})"
            )
    task = task.removesuffix("-with-past")
    if task not in SUPPORTED_TASKS:
        raise ConfigurationError(
            f"task {task!r} is not served by optimum-ipu serve; supported tasks: {', '.join(SUPPORTED_TASKS)}"
        )
    return task


def _task_of_architecture(architecture: str) -> str | None:
    import transformers
    from optimum.exporters.tasks import TasksManager

    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        return None
    try:
        return TasksManager.infer_task_from_model(model_class)
    except (KeyError, ValueError, RuntimeError):
        return None


def _read_pooling(model_dir: Path) -> str | None:
    """The pooling mode of a sentence-transformers checkpoint (its ``1_Pooling/config.json``)."""
    config_file = model_dir / "1_Pooling" / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for mode, key in (
        ("mean", "pooling_mode_mean_tokens"),
        ("cls", "pooling_mode_cls_token"),
        ("lasttoken", "pooling_mode_lasttoken"),
    ):
        if config.get(key):
            return mode
    return None


def _limit_of(value: Any) -> int | None:
    # tokenizers without a limit report a huge sentinel (int(1e30))
    return int(value) if isinstance(value, int) and 0 < value < 1_000_000 else None


class ServedModel:
    """One loaded ORTModel and what a request needs from it. ``embed`` and ``classify`` may be called from
    many threads at once (the session's dynamic batcher gathers them); ``generate`` runs one generation at
    a time (a lock), so that a seeded sampling draws the same numbers whatever else is being served."""

    def __init__(self, options: ServeOptions) -> None:
        import optimum.onnxruntime as ort_models
        from transformers import AutoConfig, AutoTokenizer

        model_dir = Path(options.model)
        if not model_dir.is_dir():
            raise ConfigurationError(f"{model_dir} is not a directory (an ONNX export or a checkpoint)")
        self.task = resolve_task(model_dir, options.task)
        self.name = options.served_name or model_dir.name
        self.model_dir = model_dir
        self.options = options
        provider_options = {"dynamic_batching": "1", **options.provider_options}
        if "device" not in provider_options and os.environ.get("OPTIMUM_IPU_DEVICE"):
            provider_options["device"] = os.environ["OPTIMUM_IPU_DEVICE"]
        model_class = getattr(ort_models, SUPPORTED_TASKS[self.task])
        self.model = model_class.from_pretrained(
            model_dir, export=not is_export(model_dir), provider="ipu", provider_options=provider_options
        )
        tokenizer_dir = options.tokenizer or model_dir
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"no usable tokenizer in {tokenizer_dir} ({type(exc).__name__}: {exc}); pass --tokenizer DIR "
                "(the checkpoint the model was exported from)"
            ) from None
        self.config = AutoConfig.from_pretrained(model_dir)
        self._tokenizer_lock = threading.Lock()  # fast tokenizers refuse concurrent use ("Already borrowed")
        self._generation_lock = threading.Lock()
        self.pooling = self._pooling(options.pooling, model_dir)
        self.max_inputs = options.max_inputs
        self.max_input_tokens = self._max_input_tokens(options.max_input_tokens)
        self.compiled_at_start: list[dict[str, Any]] = []
        if options.precompile:
            for session in self.sessions():
                self.compiled_at_start.extend(session.precompile())

    # -- what the model is ----------------------------------------------------------------------

    @property
    def is_decoder(self) -> bool:
        return self.task == "text-generation"

    def _pooling(self, requested: str | None, model_dir: Path) -> str | None:
        if self.task != "feature-extraction":
            return None
        if requested is not None:
            if requested not in POOLING_MODES:
                raise ConfigurationError(
                    f"--pooling {requested!r}: expected one of {', '.join(POOLING_MODES)}"
                )
            return requested
        found = _read_pooling(model_dir) or (
            _read_pooling(Path(self.options.tokenizer)) if self.options.tokenizer else None
        )
        if found is None:
            raise ConfigurationError(
                f"{model_dir} has no sentence-transformers pooling configuration (1_Pooling/config.json); "
                f"pass --pooling (one of {', '.join(POOLING_MODES)})"
            )
        return found

    def _max_input_tokens(self, requested: int | None) -> int:
        """The longest input served: the model's positions, the tokenizer's limit and the largest compiled
        sequence length, whichever is least (and ``--max-input-tokens`` when lower still)."""
        limits = [
            _limit_of(getattr(self.config, name, None))
            for name in ("max_position_embeddings", "n_positions", "max_seq_len")
        ]
        limits.append(_limit_of(self.tokenizer.model_max_length))
        for session in self.sessions():
            lengths = session.bucket_sizes().get("sequence_length")
            if lengths:
                limits.append(max(lengths))
        known = [limit for limit in limits if limit is not None]
        if requested is not None:
            known.append(requested)
        if not known:
            raise ConfigurationError(
                f"{self.model_dir}: no input length limit is known; pass --max-input-tokens"
            )
        return min(known)

    def sessions(self) -> list[Any]:
        """The IPU sessions of the model (one for an encoder or a merged decoder)."""
        parts = [getattr(self.model, name, None) for name in ("model", "encoder", "decoder")]
        sessions = [getattr(part, "session", part) for part in parts if part is not None]
        return [session for session in sessions if hasattr(session, "compiled_executables")]

    def info(self) -> dict[str, Any]:
        sessions = self.sessions()
        return {
            "model_id": self.name,
            "model_dir": str(self.model_dir),
            "task": self.task,
            "model_type": getattr(self.config, "model_type", None),
            "pooling": self.pooling,
            "max_input_tokens": self.max_input_tokens,
            "max_inputs": self.max_inputs,
            "provider_options": [session.get_provider_options() for session in sessions],
            "bucket_sizes": [session.bucket_sizes() for session in sessions],
            "packing": [session.packing_verdict() for session in sessions],
            "executables": [
                {k: v for k, v in entry.items() if k not in ("padding", "packing")}
                for session in sessions
                for entry in session.compiled_executables()
            ],
        }

    def close(self) -> None:
        for session in self.sessions():
            session.close()

    # -- turning requests into feeds --------------------------------------------------------------

    def token_ids(self, texts: Sequence[str], field: str) -> list[list[int]]:
        """Each text's token ids (special tokens included), refused when one is longer than served."""
        with self._tokenizer_lock:
            encoded = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        for index, ids in enumerate(encoded):
            self.check_length(len(ids), f"{field}[{index}]" if len(texts) > 1 or field != "prompt" else field)
        return encoded

    def check_length(self, length: int, field: str) -> None:
        if length > self.max_input_tokens:
            raise RequestError(
                field,
                f"{length} tokens, longer than the {self.max_input_tokens} tokens this model serves; "
                "shorten the input (nothing is truncated)",
                status=413,
            )

    def check_token_ids(self, rows: Sequence[Sequence[int]], field: str) -> None:
        vocab = len(self.tokenizer)
        for index, ids in enumerate(rows):
            self.check_length(len(ids), f"{field}[{index}]")
            for position, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise RequestError(
                        f"{field}[{index}][{position}]",
                        f"token id {token} is outside the vocabulary [0, {vocab})",
                    )

    def _feed(self, rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        """Rows padded on the right to the longest, with their attention mask (and zero token types where
        the model takes them)."""
        longest = max(len(ids) for ids in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = np.full((len(rows), longest), pad, dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        for index, ids in enumerate(rows):
            input_ids[index, : len(ids)] = ids
            mask[index, : len(ids)] = 1
        feed = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.tokenizer.model_input_names:
            feed["token_type_ids"] = np.zeros_like(input_ids)
        return feed

    # -- the calls --------------------------------------------------------------------------------

    def embed(self, rows: Sequence[Sequence[int]], normalize: bool) -> np.ndarray:
        """One pooled embedding per row of token ids, float32."""
        feed = self._feed(rows)
        hidden = np.asarray(self.model(**feed).last_hidden_state, dtype=np.float32)
        mask = feed["attention_mask"].astype(np.float32)[..., None]
        if self.pooling == "mean":
            pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        elif self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = hidden[np.arange(len(rows)), feed["attention_mask"].sum(axis=1) - 1]
        if normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled

    def classify(self, rows: Sequence[Sequence[int]]) -> list[list[dict[str, Any]]]:
        """Per row, every label with its score (softmax, or sigmoid for multi-label), highest first."""
        logits = np.asarray(self.model(**self._feed(rows)).logits, dtype=np.float64)
        if getattr(self.config, "problem_type", None) == "multi_label_classification":
            scores = 1.0 / (1.0 + np.exp(-logits))
        else:
            shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
            scores = shifted / shifted.sum(axis=-1, keepdims=True)
        labels = self.config.id2label
        return [
            sorted(
                ({"label": labels.get(i, str(i)), "score": float(s)} for i, s in enumerate(row)),
                key=lambda entry: -entry["score"],
            )
            for row in scores
        ]

    def max_new_tokens(self, prompt_length: int) -> int:
        return self.max_input_tokens - prompt_length

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        temperature: float,
        top_p: float,
        seed: int | None,
        on_token: Callable[[int], None] | None = None,
    ) -> tuple[list[int], str]:
        """The tokens generated after ``prompt`` and the finish reason (``"stop"`` at the end-of-sequence
        token, else ``"length"``). ``temperature == 0`` is greedy (as OpenAI's API defines it); otherwise
        sampling, seeded by ``seed`` (or by the operating system's randomness when None)."""
        import torch

        settings: dict[str, Any] = {"max_new_tokens": max_tokens, "num_beams": 1}
        if temperature == 0:
            settings["do_sample"] = False
        else:
            settings.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        eos = self.model.generation_config.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        if isinstance(pad, list):
            pad = pad[0]
        streamer = _TokenStreamer(on_token) if on_token is not None else None
        input_ids = torch.tensor([list(prompt)], dtype=torch.int64)
        with self._generation_lock, torch.no_grad():
            torch.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pad_token_id=pad,
                streamer=streamer,
                **settings,
            )
        tokens = output[0, len(prompt) :].tolist()
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        finish = "stop" if tokens and tokens[-1] in eos_ids and len(tokens) < max_tokens else "length"
        return tokens, finish

    def decode(self, tokens: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


class _TokenStreamer:
    """transformers' streamer protocol (``put``/``end``): the first ``put`` is the prompt, then one call per
    generated token; hands each new token to ``on_token``."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self._on_token = on_token
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._on_token(int(token))

    def end(self) -> None:
        pass
