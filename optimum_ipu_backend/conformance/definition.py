"""The suite's definition: the model matrix, the tolerance tiers, the quick operators and the expectation
files, read from the TOML files of the top-level ``conformance/`` directory.

A wheel carries those files inside the package (``optimum_ipu_backend/conformance/suite/``, put there
by hatch's ``force-include``); a source checkout or an editable install reads them from ``conformance/``.
Every file is checked when read, and a mistake is an error naming the file and the key.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from optimum_ipu_backend.conformance.results import CASE_PREFIXES, LEVELS
from optimum_ipu_backend.conformance.zoo import MODEL_NAMES, OPTIMIZATION_LEVELS, TASK_ROUTES
from optimum_ipu_backend.errors import ConfigurationError

MODELS_FILE = "models.toml"
TIERS_FILE = "tiers.toml"
OPERATORS_FILE = "operators.toml"
EXPECTATIONS_DIR = "expectations"

#: What a distribution ships beside the module its provider entry point names.
DISTRIBUTION_EXPECTATIONS_FILE = "conformance.toml"


class DefinitionError(ConfigurationError):
    """A definition or expectation file is malformed."""


def definition_dir() -> Path:
    """Where the definition files are: inside an installed wheel, else the checkout's ``conformance/``."""
    packaged = Path(str(resources.files(__package__))) / "suite"
    if (packaged / MODELS_FILE).is_file():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "conformance"
    if (checkout / MODELS_FILE).is_file():
        return checkout
    raise DefinitionError(
        f"the conformance definition files are missing: neither {packaged} (an installed wheel) nor "
        f"{checkout} (a source checkout) holds {MODELS_FILE}; reinstall optimum-ipu-backend"
    )


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionError(f"{path}: not valid TOML: {exc}") from exc


def _check_keys(
    where: str, table: Mapping[str, Any], allowed: set[str], required: set[str] = frozenset()
) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise DefinitionError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(table))
    if missing:
        raise DefinitionError(f"{where}: missing key(s) {missing}")


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputSet:
    """One batch of seeded inputs: ``batch`` rows of at most ``sequence_length`` tokens."""

    batch: int
    sequence_length: int
    seed: int

    @property
    def label(self) -> str:
        return f"b{self.batch}-s{self.sequence_length}"


@dataclass(frozen=True)
class ModelEntry:
    """One architecture x task of the matrix; the export task and the ORTModel class follow from the task."""

    architecture: str
    task: str
    quick: bool = False
    #: The ORTOptimizer level (O1..O4) the export is optimized at before it is run, or None for none.
    optimization: str | None = None

    @property
    def case_id(self) -> str:
        suffix = f"-{self.optimization}" if self.optimization else ""
        return f"model/{self.architecture}-{self.task}{suffix}"

    @property
    def export_task(self) -> str:
        return TASK_ROUTES[self.task].export_task

    @property
    def ort_class(self) -> str:
        return TASK_ROUTES[self.task].ort_class


@dataclass(frozen=True)
class ModelMatrix:
    entries: tuple[ModelEntry, ...]
    input_sets: tuple[InputSet, ...]
    quick_input_sets: tuple[InputSet, ...]
    generation_inputs: InputSet

    def select(self, quick: bool, names: Sequence[str] | None) -> list[ModelEntry]:
        """The entries to run: ``names`` (globs over case ids, with or without ``model/``) win over
        ``quick``; ``none``: no model, ``all``: every entry."""
        names = list(names or ())
        if names == ["none"]:
            return []
        if names == ["all"]:
            return list(self.entries)
        if not names:
            return [entry for entry in self.entries if entry.quick or not quick]
        patterns = [name if name.startswith("model/") else f"model/{name}" for name in names]
        entries = [e for e in self.entries if any(fnmatch.fnmatchcase(e.case_id, p) for p in patterns)]
        if not entries:
            known = ", ".join(e.case_id.removeprefix("model/") for e in self.entries)
            raise DefinitionError(f"--models {names} matches no matrix entry; entries: {known}")
        return entries


def _input_set(where: str, raw: Mapping[str, Any]) -> InputSet:
    _check_keys(where, raw, {"batch", "sequence_length", "seed"}, {"batch", "sequence_length", "seed"})
    values = {key: raw[key] for key in ("batch", "sequence_length", "seed")}
    if not all(isinstance(value, int) and value >= 0 for value in values.values()) or not values["batch"]:
        raise DefinitionError(f"{where}: batch, sequence_length and seed must be integers, batch > 0: {raw}")
    return InputSet(**values)


def load_models(directory: Path | None = None) -> ModelMatrix:
    path = (directory or definition_dir()) / MODELS_FILE
    raw = read_toml(path)
    _check_keys(str(path), raw, {"inputs", "generation", "model"}, {"inputs", "generation", "model"})
    inputs = raw["inputs"]
    _check_keys(f"{path} [inputs]", inputs, {"sets", "quick_sets"}, {"sets", "quick_sets"})
    entries = []
    seen = set()
    for index, item in enumerate(raw["model"]):
        where = f"{path} [[model]] #{index + 1}"
        _check_keys(where, item, {"architecture", "task", "quick", "optimization"}, {"architecture", "task"})
        if item.get("optimization", OPTIMIZATION_LEVELS[0]) not in OPTIMIZATION_LEVELS:
            raise DefinitionError(f"{where}: optimization must be one of {OPTIMIZATION_LEVELS}")
        if item["architecture"] not in MODEL_NAMES:
            raise DefinitionError(
                f"{where}: architecture {item['architecture']!r} is not in the zoo {MODEL_NAMES}"
            )
        if item["task"] not in TASK_ROUTES:
            raise DefinitionError(f"{where}: task {item['task']!r} is not one of {sorted(TASK_ROUTES)}")
        entry = ModelEntry(
            item["architecture"], item["task"], bool(item.get("quick", False)), item.get("optimization")
        )
        if entry.case_id in seen:
            raise DefinitionError(f"{where}: {entry.case_id} is listed twice")
        seen.add(entry.case_id)
        entries.append(entry)
    return ModelMatrix(
        entries=tuple(entries),
        input_sets=tuple(_input_set(f"{path} [inputs] sets", item) for item in inputs["sets"]),
        quick_input_sets=tuple(
            _input_set(f"{path} [inputs] quick_sets", item) for item in inputs["quick_sets"]
        ),
        generation_inputs=_input_set(f"{path} [generation]", raw["generation"]),
    )


# ------------------------------------------------------------------------------------------------
# Tiers
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tier:
    """What a tier promises. A check applies only when the tier sets its threshold."""

    name: str
    description: str
    atol: float | None = None  # every output element: |provider - cpu| <= atol + rtol * |cpu|
    rtol: float | None = None
    top1_agreement: float | None = None  # classification, token classification, masked LM, multiple choice
    span_agreement: float | None = None  # question answering: start and end positions
    embedding_cosine: float | None = None  # feature extraction: mean-pooled embeddings, every row
    identical_new_tokens: int = 16  # greedy generation: this many new tokens, all identical
    # Operator level: at least these tolerances instead of a node case's own (rtol 1e-3, atol 1e-7).
    operator_rtol: float | None = None
    operator_atol: float | None = None

    def thresholds(self) -> dict[str, float]:
        values = {key: getattr(self, key) for key in _THRESHOLDS}
        return {key: value for key, value in values.items() if value is not None}

    def operator_tolerance(self, rtol: float, atol: float) -> tuple[float, float]:
        """The tolerances a node case is judged with in this tier."""
        return max(rtol, self.operator_rtol or 0.0), max(atol, self.operator_atol or 0.0)


# Every field of a Tier after its name and description, in their order.
_THRESHOLDS = tuple(item.name for item in fields(Tier)[2:])


def load_tiers(directory: Path | None = None) -> dict[str, Tier]:
    path = (directory or definition_dir()) / TIERS_FILE
    raw = read_toml(path)
    tiers = {}
    numeric = set(_THRESHOLDS) - {"identical_new_tokens"}
    for name, table in raw.items():
        where = f"{path} [{name}]"
        _check_keys(where, table, {"description", "identical_new_tokens", *numeric}, {"description"})
        for pair in (("atol", "rtol"), ("operator_atol", "operator_rtol")):
            if (pair[0] in table) != (pair[1] in table):
                raise DefinitionError(f"{where}: {pair[0]} and {pair[1]} go together")
        for key in numeric & set(table):
            if not isinstance(table[key], (int, float)) or table[key] < 0:
                raise DefinitionError(f"{where}: {key} must be a non-negative number, got {table[key]!r}")
        tokens = table.get("identical_new_tokens", 16)
        if not isinstance(tokens, int) or tokens <= 0:
            raise DefinitionError(f"{where}: identical_new_tokens must be a positive integer, got {tokens!r}")
        description = " ".join(str(table["description"]).split())
        tiers[name] = Tier(name=name, **{**table, "description": description, "identical_new_tokens": tokens})
    return tiers


# ------------------------------------------------------------------------------------------------
# Operators
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperatorSelection:
    quick: tuple[str, ...]

    def select(self, quick: bool, names: Sequence[str] | None) -> frozenset[str] | None:
        """Operator types to run (None: all): ``--ops`` wins over ``--quick``; ``none``: no operator."""
        if names:
            chosen = frozenset(name for part in names for name in part.split(",") if name)
            if chosen == {"all"}:
                return None
            return frozenset() if chosen == {"none"} else chosen
        return frozenset(self.quick) if quick else None


def load_operators(directory: Path | None = None) -> OperatorSelection:
    path = (directory or definition_dir()) / OPERATORS_FILE
    raw = read_toml(path)
    _check_keys(str(path), raw, {"quick"}, {"quick"})
    _check_keys(f"{path} [quick]", raw["quick"], {"operators"}, {"operators"})
    return OperatorSelection(quick=tuple(raw["quick"]["operators"]))


# ------------------------------------------------------------------------------------------------
# Expectation files
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expectation:
    """One entry of an expectation file: cases (globs over case ids) with the reason they do not pass."""

    kind: str  # "known_failure" or "not_applicable"
    cases: tuple[str, ...]
    reason: str
    source: str  # file and entry number, so a report can say which line to edit
    file: str = ""  # the expectation file, for the command that removes a case from it
    tier: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)

    def applies(self, case_id: str, tier: str, options: Mapping[str, str]) -> bool:
        if self.tier is not None and self.tier != tier:
            return False
        if any(str(options.get(key)) != value for key, value in self.options.items()):
            return False
        return any(fnmatch.fnmatchcase(case_id, pattern) for pattern in self.cases)


@dataclass(frozen=True)
class OperatorDeclaration:
    """How a provider declares its operator support (see docs/conformance.md).

    ``table`` names the operators it takes, as ``"module:attribute"`` of a collection of op types
    (``"domain::Op"`` outside the default domain) or inline as a list; unset, every operator applies.
    ``compile_time_operands`` names ``(op type, input index)`` slots the provider must know when it
    compiles: a case's values there become constants of its graph. ``element_types`` lists the tensor
    element types (ONNX names) the provider takes; a case with another is not applicable, and so is a
    case with sequence, optional or map values when ``non_tensor_values`` is false.
    ``provider_options`` are added to the operator level's sessions (options given to the run win).
    """

    source: str
    table: str | tuple[str, ...] | None = None
    compile_time_operands: str | tuple[tuple[str, int], ...] | None = None
    element_types: tuple[str, ...] | None = None
    element_types_reason: str = ""
    non_tensor_values: bool = True
    non_tensor_reason: str = ""
    provider_options: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExpectationFile:
    path: str
    provider: str
    operators: OperatorDeclaration | None
    entries: tuple[Expectation, ...]


def _string_list(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(item, str) and item for item in value):
        raise DefinitionError(f"{where}: expected a non-empty list of strings, got {value!r}")
    return tuple(value)


def _expectation(path: str, kind: str, index: int, raw: Mapping[str, Any]) -> Expectation:
    where = f"{path} [[{kind}]] #{index + 1}"
    _check_keys(where, raw, {"cases", "reason", "tier", "options"}, {"cases", "reason"})
    if not isinstance(raw["reason"], str) or not raw["reason"].strip():
        raise DefinitionError(f"{where}: every entry needs a reason")
    cases = _string_list(f"{where} cases", raw["cases"])
    prefixes = tuple(prefix for level in LEVELS for prefix in CASE_PREFIXES[level])
    for pattern in cases:
        if not pattern.startswith(prefixes):
            raise DefinitionError(
                f"{where}: case pattern {pattern!r} must start with "
                f"{', '.join(prefixes[:-1])} or {prefixes[-1]}"
            )
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise DefinitionError(f"{where}: options must be a table of provider options")
    return Expectation(
        kind=kind,
        cases=cases,
        reason=" ".join(raw["reason"].split()),
        source=where,
        file=path,
        tier=raw.get("tier"),
        options={str(key): str(value) for key, value in options.items()},
    )


def _operator_declaration(path: str, raw: Mapping[str, Any]) -> OperatorDeclaration:
    where = f"{path} [operators]"
    _check_keys(where, raw, {item.name for item in fields(OperatorDeclaration)} - {"source"})
    non_tensor_values = raw.get("non_tensor_values", True)
    if not isinstance(non_tensor_values, bool):
        raise DefinitionError(f"{where} non_tensor_values: expected true or false")
    if not non_tensor_values and not raw.get("non_tensor_reason"):
        raise DefinitionError(f"{where}: non_tensor_values = false needs a non_tensor_reason")
    options = raw.get("provider_options", {})
    if not isinstance(options, dict):
        raise DefinitionError(f"{where} provider_options: expected a table of provider options")
    table = raw.get("table")
    if table is not None and not isinstance(table, str):
        table = _string_list(f"{where} table", table)
    operands = raw.get("compile_time_operands")
    if operands is not None and not isinstance(operands, str):
        if not isinstance(operands, list) or not all(
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], int)
            for item in operands
        ):
            raise DefinitionError(
                f"{where} compile_time_operands: expected 'module:attribute' or [[op, index], ...]"
            )
        operands = tuple((item[0], item[1]) for item in operands)
    element_types = raw.get("element_types")
    if element_types is not None:
        element_types = _string_list(f"{where} element_types", element_types)
        if not raw.get("element_types_reason"):
            raise DefinitionError(f"{where}: element_types needs an element_types_reason")
    return OperatorDeclaration(
        source=where,
        table=table,
        compile_time_operands=operands,
        element_types=element_types,
        element_types_reason=" ".join(str(raw.get("element_types_reason", "")).split()),
        non_tensor_values=non_tensor_values,
        non_tensor_reason=" ".join(str(raw.get("non_tensor_reason", "")).split()),
        provider_options={str(key): str(value) for key, value in options.items()},
    )


def load_expectation_file(path: Path) -> ExpectationFile:
    raw = read_toml(path)
    _check_keys(str(path), raw, {"provider", "operators", "known_failure", "not_applicable"}, {"provider"})
    entries = [
        _expectation(str(path), kind, index, item)
        for kind in ("known_failure", "not_applicable")
        for index, item in enumerate(raw.get(kind, []))
    ]
    operators = raw.get("operators")
    return ExpectationFile(
        path=str(path),
        provider=str(raw["provider"]),
        operators=None if operators is None else _operator_declaration(str(path), operators),
        entries=tuple(entries),
    )


#: The command that removes cases from an expectation file (``remove_cases``).
REMOVE_COMMAND = "optimum-ipu conformance-expectations remove"


def removal_command(path: str, case_id: str) -> str:
    """The command a report prints for a listed failure that now passes."""
    return f"{REMOVE_COMMAND} {shlex.quote(path)} {shlex.quote(case_id)}"


_ENTRY_HEADER = re.compile(r"^\[\[(known_failure|not_applicable)\]\]\s*$")


def _entry_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(first, end) line ranges of the file's entries, in ``load_expectation_file``'s order (every
    ``[[known_failure]]``, then every ``[[not_applicable]]``). An entry owns the comment lines right
    above its header (no blank line between); a comment separated by a blank line heads a section."""
    headers = [index for index, line in enumerate(lines) if _ENTRY_HEADER.match(line)]
    spans: dict[str, list[tuple[int, int]]] = {"known_failure": [], "not_applicable": []}
    for number, header in enumerate(headers):
        first = header
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        end = headers[number + 1] if number + 1 < len(headers) else len(lines)
        while end > header + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1  # trailing blank lines and the next entry's own comments are not this entry's
        spans[_ENTRY_HEADER.match(lines[header]).group(1)].append((first, end))
    return spans["known_failure"] + spans["not_applicable"]


def remove_cases(path: Path, case_ids: Sequence[str]) -> list[str]:
    """Remove ``case_ids`` from the entries of an expectation file that list them by name, editing only
    those quoted names, so every comment and the layout stay; an entry left with no case goes, with the
    comments right above it. A case listed only through a glob, or not at all, is an error naming the
    entry: a glob may still cover cases that fail, so its edit is a reviewer's decision. Nothing is
    written unless every case can be removed, and the result must load as an expectation file."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    entries = list(load_expectation_file(path).entries)
    spans = _entry_spans(lines)
    if len(spans) != len(entries):
        raise DefinitionError(f"{path}: cannot locate its entries in the text; edit it by hand")
    emptied = set()
    for case_id in case_ids:
        listed = [number for number, entry in enumerate(entries) if case_id in entry.cases]
        if not listed:
            for entry in entries:
                pattern = next((p for p in entry.cases if fnmatch.fnmatchcase(case_id, p)), None)
                if pattern is not None:
                    raise DefinitionError(
                        f"{entry.source}: {case_id} is listed through the pattern {pattern!r}, which may "
                        "cover cases that still fail; edit that entry by hand"
                    )
            raise DefinitionError(f"{path}: no entry lists {case_id}")
        for number in listed:
            first, end = spans[number]
            quoted = r'"' + re.escape(case_id) + r'"[ \t]*,?[ \t]*'
            text = re.sub(quoted, "", "".join(lines[first:end]), count=1)
            text = re.sub(r",([ \t]*)\]", r"\1]", text)  # a comma the removal left before "]"
            text = re.sub(r"\n[ \t]+(?=\n)", "", text)  # a line the removal left holding only its indent
            edited = text.splitlines(keepends=True)
            lines[first:end] = edited + [""] * (end - first - len(edited))  # spans keep their line numbers
            kept = tuple(case for case in entries[number].cases if case != case_id)
            entries[number] = replace(entries[number], cases=kept)
            if not entries[number].cases:
                emptied.add(number)
    for number in sorted(emptied, reverse=True):
        first, end = spans[number]
        while end < len(lines) and not lines[end].strip():
            end += 1  # the blank lines after it
        del lines[first:end]
    edited = path.with_name(path.name + ".edited")
    edited.write_text("".join(lines), encoding="utf-8")
    try:
        load_expectation_file(edited)  # the edited file must still be a valid expectation file
    except DefinitionError:
        edited.unlink()
        raise
    left = [
        case for entry in load_expectation_file(edited).entries for case in entry.cases if case in case_ids
    ]
    if left:  # the text did not hold a name where its entry lists it: never report a removal not made
        edited.unlink()
        raise DefinitionError(f"{path}: could not remove {left} from its text; edit it by hand")
    os.replace(edited, path)
    return list(case_ids)


def suite_expectation_file(provider_name: str, directory: Path | None = None) -> Path | None:
    """The suite's own expectation file for a provider (``expectations/<canonical name>.toml``), if any."""
    path = (directory or definition_dir()) / EXPECTATIONS_DIR / f"{provider_name}.toml"
    return path if path.is_file() else None
