"""``provider="auto"``: the best provider usable on this machine, and why each one above it was passed over.

The order, one for everything that asks (sessions, ``optimum-ipu providers``):

1. provider plugins, highest ``priority`` (declared in the entry point's spec) first, ties by entry
   point name;
2. onnxruntime's own accelerators, in onnxruntime's order, at priority 0: after plugins of equal
   priority and before plugins with a negative one;
3. ``CPUExecutionProvider``, last.

A candidate is taken only if it computes on this machine without emulation: a plugin when its probe
says its default device is usable and not emulated; a native provider when ``native_providers`` sees
its device (never Azure). ``OPTIMUM_PROVIDER_PREFERENCE`` (a comma list of names) replaces the order:
only the providers it names are candidates, in its order; a name that is not installed is an error
listing what is.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimum_ipu_backend.errors import ConfigurationError, ProviderPluginError
from optimum_ipu_backend.integration import AUTO
from optimum_ipu_backend.integration.discovery import ProviderRegistry, get_registry
from optimum_ipu_backend.integration.native_providers import (
    CPU,
    available_providers,
    native_availability,
)

PREFERENCE_ENV = "OPTIMUM_PROVIDER_PREFERENCE"
NATIVE_PRIORITY = 0

_logger = logging.getLogger(__name__)


class ProviderPreferenceError(ConfigurationError):
    """``OPTIMUM_PROVIDER_PREFERENCE`` names a provider that is not installed."""


class NoUsableProviderError(ProviderPluginError):
    """``provider="auto"`` found no candidate that computes here."""


@dataclass(frozen=True)
class Candidate:
    """One provider ``auto`` considered: ``origin`` is ``"onnxruntime"`` or the plugin's distribution."""

    name: str
    origin: str
    usable: bool
    reason: str
    priority: int = NATIVE_PRIORITY
    aliases: tuple[str, ...] = ()

    @property
    def is_plugin(self) -> bool:
        return self.origin != "onnxruntime"


@dataclass(frozen=True)
class AutoChoice:
    """The outcome: the candidates in the order considered, and the first usable one. ``installed``
    holds every provider found, candidates or not (the preference may leave some out)."""

    candidates: tuple[Candidate, ...]
    preference: tuple[str, ...] | None = None
    installed: tuple[Candidate, ...] = ()

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.usable), None)

    @property
    def passed_over(self) -> list[Candidate]:
        """The candidates ranked above the choice (all of them when there is none)."""
        passed = []
        for candidate in self.candidates:
            if candidate.usable:
                break
            passed.append(candidate)
        return passed

    def order_source(self) -> str:
        if self.preference is None:
            return "the default order"
        return f"{PREFERENCE_ENV}={','.join(self.preference)}"

    def summary(self) -> str:
        chosen = self.chosen
        head = (
            f"provider='auto' chose {chosen.name} ({chosen.reason})"
            if chosen is not None
            else "provider='auto' found no usable provider"
        )
        passed = "; ".join(f"{c.name}: {c.reason}" for c in self.passed_over)
        return f"{head}, by {self.order_source()}" + (f"; passed over: {passed}" if passed else "")

    def provider_options(self) -> dict[str, str]:
        """What the session's provider options report about the choice (strings, as onnxruntime's are)."""
        chosen = self.chosen
        return {
            "auto": f"chosen by provider='auto' by {self.order_source()}: {chosen.reason if chosen else ''}",
            "auto_passed_over": "; ".join(f"{c.name}: {c.reason}" for c in self.passed_over),
        }


def _plugin_candidates(registry: ProviderRegistry) -> list[Candidate]:
    candidates = []
    for registration in registry.registrations():
        availability = registration.probe()
        if not availability.available:
            usable, reason = False, availability.detail or "its probe says its default device is not usable"
        elif availability.emulated:
            usable = False
            reason = (
                f"its default device is emulated on the host ({availability.detail}); emulation is never "
                f"chosen automatically, name {registration.name!r} explicitly to use it"
            )
        else:
            usable, reason = True, availability.detail or "its probe says its default device is usable"
        candidates.append(
            Candidate(
                registration.name,
                f"{registration.distribution} {registration.version}",
                usable,
                reason,
                registration.spec.priority,
                (*registration.spec.aliases, registration.entry_point),
            )
        )
    for broken in registry.broken():
        candidates.append(
            Candidate(
                broken.entry_point,
                f"{broken.distribution} {broken.version}",
                False,
                f"the plugin failed to load: {type(broken.error).__name__}: {broken.error}",
                aliases=(broken.distribution,),
            )
        )
    return candidates


def _native_candidates() -> list[Candidate]:
    candidates = []
    for name in available_providers():
        availability = native_availability(name)
        short = name.removesuffix("ExecutionProvider")
        candidates.append(
            Candidate(name, "onnxruntime", availability.usable, availability.reason, aliases=(short,))
        )
    return candidates


def default_order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Plugins and native accelerators by priority (plugins first on ties, then by name), onnxruntime's
    order kept among its own (``candidates`` lists them in that order), the CPU last."""
    position = {id(c): index for index, c in enumerate(candidates)}
    ranked = sorted(
        (c for c in candidates if c.name != CPU),
        key=lambda c: (-c.priority, 0 if c.is_plugin else 1, c.name if c.is_plugin else "", position[id(c)]),
    )
    return ranked + [c for c in candidates if c.name == CPU]


def preference() -> tuple[str, ...] | None:
    raw = os.environ.get(PREFERENCE_ENV, "")
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    return names or None


def _names_of(candidate: Candidate) -> set[str]:
    return {candidate.name.lower(), *(alias.lower() for alias in candidate.aliases)}


def resolve_name(name: str, candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate a user's name means: canonical name, alias, entry point or short native name."""
    wanted = name.lower()
    return next((c for c in candidates if wanted in _names_of(c)), None)


def _installed_listing(candidates: Sequence[Candidate]) -> str:
    parts = []
    for c in candidates:
        aliases = [a for a in c.aliases if a.lower() != c.name.lower()]
        parts.append(f"{c.name} ({', '.join(dict.fromkeys(aliases))})" if aliases else c.name)
    return ", ".join(parts)


def choose(registry: ProviderRegistry | None = None) -> AutoChoice:
    """Rank the candidates and say which one ``auto`` takes; never raises for a broken or absent plugin,
    only for a preference that names an uninstalled provider."""
    registry = registry or get_registry()
    installed = _plugin_candidates(registry) + _native_candidates()
    wanted = preference()
    if wanted is None:
        return AutoChoice(tuple(default_order(installed)), None, tuple(installed))
    ordered: list[Candidate] = []
    for name in wanted:
        if name.lower() == AUTO:
            raise ProviderPreferenceError(f"{PREFERENCE_ENV} lists 'auto'; list provider names instead")
        candidate = resolve_name(name, installed)
        if candidate is None and name in registry.skipped():
            raise ProviderPreferenceError(
                f"{PREFERENCE_ENV}={','.join(wanted)} names {name!r}, a plugin that OPTIMUM_PROVIDER_PLUGINS "
                "leaves out; allow it there or remove it from the preference"
            )
        if candidate is None:
            raise ProviderPreferenceError(
                f"{PREFERENCE_ENV}={','.join(wanted)} names {name!r}, which is not installed here. "
                f"Installed providers: {_installed_listing(installed)}. Fix the variable or install the "
                "provider."
            )
        if candidate not in ordered:
            ordered.append(candidate)
    return AutoChoice(tuple(ordered), wanted, tuple(installed))


_logged: set[str] = set()
_logged_lock = threading.Lock()


def chosen_provider(registry: ProviderRegistry | None = None) -> AutoChoice:
    """``choose()`` for a session: raises when nothing is usable, and logs each distinct outcome once."""
    choice = choose(registry)
    summary = choice.summary()
    with _logged_lock:
        first = summary not in _logged
        _logged.add(summary)
    if choice.chosen is None:
        raise NoUsableProviderError(
            f"{summary}. Set {PREFERENCE_ENV} to include a provider that works here (for example end it "
            "with cpu), or name a provider explicitly."
        )
    if first:
        _logger.info("%s", summary)
    return choice


def options_for(choice: AutoChoice, provider_options: Any) -> dict[str, Any]:
    """The chosen provider's options from what the caller gave with ``provider="auto"``.

    The provider is not known in advance, so options must be keyed by provider name
    (``{"IPUExecutionProvider": {...}, "cuda": {...}}``); options for providers not chosen are unused.
    """
    if isinstance(provider_options, Sequence) and not isinstance(provider_options, (str, bytes)):
        provider_options = provider_options[0] if provider_options else None
    if not provider_options:
        return {}
    if not isinstance(provider_options, Mapping):
        raise TypeError(f"provider_options must be a dict, got {type(provider_options).__name__}")
    chosen = choice.chosen
    everything = choice.installed or choice.candidates
    selected: dict[str, Any] = {}
    for key, value in provider_options.items():
        target = resolve_name(str(key), everything) if isinstance(value, Mapping) else None
        if target is None:
            raise ValueError(
                "with provider='auto', provider_options must be keyed by provider name, e.g. "
                "{'IPUExecutionProvider': {...}, 'CPUExecutionProvider': {...}}, because the provider is "
                f"chosen at load time; got key {key!r}. Candidates: {_installed_listing(everything)}"
            )
        if target == chosen:
            selected.update(value)
    return selected


def annotate(session: Any, choice: AutoChoice) -> Any:
    """Make the choice visible on the session: ``session.auto_choice`` and two entries in the chosen
    provider's ``get_provider_options()``."""
    report = choice.provider_options()
    original = session.get_provider_options

    def get_provider_options() -> dict[str, dict[str, str]]:
        options = {name: dict(values) for name, values in original().items()}
        providers = session.get_providers()
        if providers:
            options.setdefault(providers[0], {}).update(report)
        return options

    session.auto_choice = choice
    session.get_provider_options = get_provider_options
    return session
