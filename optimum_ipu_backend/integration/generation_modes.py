"""``generate()`` modes that optimum-onnx cannot serve on any provider, refused by name on a plugin model.

Assisted generation (``assistant_model=``) and prompt-lookup decoding (``prompt_lookup_num_tokens=``) crop
the key/value cache after rejected candidates with ``Cache.crop``; optimum-onnx 0.1 returns the cache as
tuples, so transformers fails deep inside its candidate loop with ``AttributeError: 'tuple' object has no
attribute 'crop'``, on CPUExecutionProvider as on ipu. On a plugin model that error is replaced by one that
names the mode, why it fails and what to do instead. The calls these modes make (several new tokens with
a past, a cropped cache) are served exactly (tests/integration/test_generation_modes.py drives them step
by step), so the refusal is only a translation: once optimum-onnx returns a croppable cache, ``generate``
runs, since only that ``AttributeError`` is replaced (the patches in ``patches.py`` route
``ORTModelForCausalLM.generate`` and ``ORTModelForConditionalGeneration.generate`` here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optimum_ipu_backend.errors import ConfigurationError

#: generate() arguments that select a mode which crops the cache, and the mode's name.
CACHE_CROPPING_MODES = {
    "assistant_model": "assisted generation (assistant_model=)",
    "prompt_lookup_num_tokens": "prompt-lookup decoding (prompt_lookup_num_tokens=)",
}


class UnsupportedGenerationModeError(ConfigurationError):
    """A ``generate()`` mode optimum-onnx cannot serve on any provider; the message names the mode."""


def _mode(model: Any, kwargs: dict[str, Any]) -> str | None:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for argument, name in CACHE_CROPPING_MODES.items():
        if kwargs.get(argument) is not None or getattr(config, argument, None) is not None:
            return name
    return None


def _on_plugin(model: Any) -> bool:
    parts = [model, getattr(model, "encoder", None), getattr(model, "decoder", None)]
    return any(getattr(getattr(part, "session", None), "is_provider_plugin_session", False) for part in parts)


def generate(model: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """optimum-onnx's ``generate``; on a plugin model, the tuple cache's failure to crop is raised as
    ``UnsupportedGenerationModeError`` naming the mode."""
    try:
        return original(model, *args, **kwargs)
    except AttributeError as error:
        mode = _mode(model, kwargs)
        if mode is None or "crop" not in str(error) or not _on_plugin(model):
            raise
        raise UnsupportedGenerationModeError(
            f"generate() with {mode} is not served: the mode crops the key/value cache after rejected "
            "candidates with Cache.crop, and optimum-onnx returns the cache as tuples, which have no crop; "
            "it fails on every provider, CPUExecutionProvider included. Generate without it (greedy "
            "decoding, beam search or sampling give the CPU's tokens on ipu)"
        ) from error
