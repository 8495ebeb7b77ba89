"""Request bodies, in the conventions clients already speak: text-embeddings-inference's ``/embed`` and
``/predict``, OpenAI's ``/v1/embeddings`` and ``/v1/completions``.

Strict types (a number is not a string, a bool not a number) and no unknown fields: a field the server
does not implement (``stop``, ``logprobs``, ``truncate=true``) is refused by name rather than ignored, so a
client never gets an answer to a question it did not ask. Limits that depend on the model (tokens, inputs
per request) are checked by ``models.ServedModel`` and the app, with the limit in the message.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EmbedRequest(_Request):
    """text-embeddings-inference's ``POST /embed``."""

    inputs: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)]
    normalize: bool = True
    truncate: Literal[False] = Field(
        False, description="truncation is not offered: an over-long input is refused, never cut"
    )


class PredictRequest(_Request):
    """text-embeddings-inference's ``POST /predict``."""

    inputs: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)]
    raw_scores: Literal[False] = False
    truncate: Literal[False] = False


class EmbeddingsRequest(_Request):
    """OpenAI's ``POST /v1/embeddings``."""

    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class CompletionRequest(_Request):
    """OpenAI's ``POST /v1/completions``: one prompt (text or token ids), one choice."""

    prompt: NonEmptyText | TokenIds
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1
    #: vLLM's extension: each choice (and each streamed chunk) carries the generated token ids.
    return_token_ids: bool = False
    user: str | None = None
