"""The provider under test: a plugin from the ``optimum.onnxruntime.providers`` entry points or one of
onnxruntime's own, with its options, its expectation files and its declared operator support."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from optimum_ipu_backend.compiler.op_table import DEFAULT_DOMAINS, operator_name
from optimum_ipu_backend.conformance.definition import (
    DISTRIBUTION_EXPECTATIONS_FILE,
    DefinitionError,
    Expectation,
    ExpectationFile,
    OperatorDeclaration,
    load_expectation_file,
    suite_expectation_file,
)
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.integration.discovery import (
    ENTRY_POINT_GROUP,
    ProviderRegistration,
    get_registry,
    resolve_qualname,
)

REFERENCE_PROVIDER = "CPUExecutionProvider"


class ProviderNotFoundError(ConfigurationError, LookupError):
    """The provider named on the command line is neither a plugin nor one of onnxruntime's."""


@dataclass(frozen=True)
class OperatorSupport:
    """A provider's declared operator support, resolved: None means "no restriction"."""

    table: frozenset[tuple[str, str]] | None = None
    compile_time_operands: frozenset[tuple[str, int]] = frozenset()
    element_types: frozenset[str] | None = None
    element_types_reason: str = ""
    non_tensor_values: bool = True
    non_tensor_reason: str = ""
    provider_options: Mapping[str, str] = field(default_factory=dict)
    source: str = "no declaration: every operator and element type applies"

    def out_of_table(self, operators: Iterable[tuple[str, str]]) -> list[str]:
        """The operators (``domain::Op`` outside the default domain) that are not in the table."""
        if self.table is None:
            return []
        missing = {
            (domain, op_type)
            for domain, op_type in operators
            if (("" if domain in DEFAULT_DOMAINS else domain), op_type) not in self.table
        }
        return sorted(operator_name(domain, op_type) for domain, op_type in missing)

    def foreign_element_types(self, element_types: Iterable[str]) -> list[str]:
        if self.element_types is None:
            return []
        return sorted(set(element_types) - self.element_types)


def _resolve_ops(value: str | Sequence[str]) -> frozenset[tuple[str, str]]:
    names = resolve_qualname(value) if isinstance(value, str) else value
    names = names() if callable(names) else names
    table = set()
    for name in names:
        domain, sep, op_type = str(name).rpartition("::")
        table.add(("" if not sep or domain in DEFAULT_DOMAINS else domain, op_type))
    return frozenset(table)


def resolve_operator_support(declaration: OperatorDeclaration | None) -> OperatorSupport:
    if declaration is None:
        return OperatorSupport()
    try:
        table = None if declaration.table is None else _resolve_ops(declaration.table)
        operands = declaration.compile_time_operands
        if isinstance(operands, str):
            operands = resolve_qualname(operands)
        operands = frozenset((str(op), int(index)) for op, index in (operands or ()))
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise DefinitionError(f"{declaration.source}: cannot resolve: {type(exc).__name__}: {exc}") from exc
    return OperatorSupport(
        table=table,
        compile_time_operands=operands,
        element_types=None if declaration.element_types is None else frozenset(declaration.element_types),
        element_types_reason=declaration.element_types_reason,
        non_tensor_values=declaration.non_tensor_values,
        non_tensor_reason=declaration.non_tensor_reason,
        provider_options=dict(declaration.provider_options),
        source=declaration.source,
    )


def _entry_point_table(
    registration: ProviderRegistration, declaration: OperatorDeclaration | None, support: OperatorSupport
) -> OperatorSupport:
    """The operator table a plugin declares through its entry point (``ProviderSpec.operator_table``),
    with the rest of its expectation files' declaration; a table declared in both places is an error."""
    where = f"entry point {registration.entry_point!r} of {registration.distribution}"
    if declaration is not None and declaration.table is not None:
        raise DefinitionError(
            f"the operator table of {registration.name} is declared twice: {where} and {declaration.source}"
        )
    try:
        table = _resolve_ops(registration.spec.operator_table)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise DefinitionError(
            f"{where}: operator_table {registration.spec.operator_table!r} cannot be resolved: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    source = f"{where}: operator_table {registration.spec.operator_table}"
    if declaration is not None:
        source += f"; {declaration.source}"
    return replace(support, table=table, source=source)


def _distribution_expectation_file(registration: ProviderRegistration) -> Path | None:
    """The ``conformance.toml`` a distribution ships beside the module its provider entry point names."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(entry_point, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else None
        if entry_point.name != registration.entry_point or dist_name != registration.distribution:
            continue
        module_name = entry_point.value.partition(":")[0]
        package = module_name
        try:
            spec = importlib.util.find_spec(module_name)
            if spec is None or spec.submodule_search_locations is None:
                package = module_name.rpartition(".")[0] or module_name
            candidate = resources.files(package) / DISTRIBUTION_EXPECTATIONS_FILE
        except (ImportError, TypeError, ValueError):
            return None
        return Path(str(candidate)) if candidate.is_file() else None
    return None


@dataclass(frozen=True)
class ProviderUnderTest:
    """The provider a conformance run checks, and everything the run needs to know about it."""

    name: str  # canonical name, e.g. IPUExecutionProvider
    requested: str  # what was asked for, e.g. ipu
    kind: str  # "plugin" or "native"
    options: Mapping[str, str]
    distribution: str
    version: str
    expectation_files: tuple[ExpectationFile, ...] = ()
    operator_support: OperatorSupport = field(default_factory=OperatorSupport)
    _registration: ProviderRegistration | None = field(default=None, repr=False, compare=False)

    @property
    def expectations(self) -> list[Expectation]:
        return [entry for file in self.expectation_files for entry in file.entries]

    def ortmodel_kwargs(self) -> dict[str, Any]:
        """What ``ORTModelForXxx.from_pretrained`` takes to run on this provider."""
        return {"provider": self.name, "provider_options": dict(self.options)}

    def create_session(self, model_path: str | Path) -> Any:
        """An operator-level InferenceSession on this provider alone, with the operator-level options it
        declares under the run's own."""
        options = {**self.operator_support.provider_options, **self.options}
        if self._registration is not None:
            return self._registration.create_session(str(model_path), None, [self.name], [options])
        import onnxruntime

        return onnxruntime.InferenceSession(
            str(model_path), providers=[self.name], provider_options=[options]
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requested": self.requested,
            "kind": self.kind,
            "options": dict(self.options),
            "distribution": self.distribution,
            "version": self.version,
            "expectation_files": [file.path for file in self.expectation_files],
            "operator_support": self.operator_support.source,
        }


def resolve_provider(
    requested: str, options: Mapping[str, str], extra_expectation_files: Sequence[Path] = ()
) -> ProviderUnderTest:
    """Find ``requested`` among the plugins, then among onnxruntime's providers; load its expectations."""
    import optimum_ipu_backend

    # Plugin providers reach ORTModel only through the activation; it is idempotent.
    optimum_ipu_backend.install()
    registry = get_registry()
    registration = registry.lookup(requested)
    if registration is not None:
        name, kind = registration.name, "plugin"
        distribution, version = registration.distribution, registration.version
    else:
        import onnxruntime

        if requested not in onnxruntime.get_available_providers():
            plugins = [
                f"{r.name} ({', '.join(r.spec.aliases) or 'no aliases'})" for r in registry.registrations()
            ]
            raise ProviderNotFoundError(
                f"provider {requested!r} is neither a plugin of the {ENTRY_POINT_GROUP!r} entry points "
                f"(loaded: {', '.join(plugins) or 'none'}) nor one of this onnxruntime's providers "
                f"({', '.join(onnxruntime.get_available_providers())}); "
                "`optimum-ipu providers` lists the plugins"
            )
        name, kind = requested, "native"
        distribution, version = "onnxruntime", onnxruntime.__version__

    paths = [suite_expectation_file(name)]
    if registration is not None:
        paths.append(_distribution_expectation_file(registration))
    paths.extend(Path(path) for path in extra_expectation_files)
    files = []
    for path in paths:
        if path is None:
            continue
        file = load_expectation_file(path)
        if file.provider not in (name, requested):
            raise DefinitionError(f"{path} is the expectation file of {file.provider!r}, not of {name!r}")
        files.append(file)
    declarations = [file.operators for file in files if file.operators is not None]
    if len(declarations) > 1:
        raise DefinitionError(
            f"operator support of {name} is declared twice: "
            f"{declarations[0].source} and {declarations[1].source}"
        )
    support = resolve_operator_support(declarations[0] if declarations else None)
    if registration is not None and registration.spec.operator_table is not None:
        support = _entry_point_table(registration, declarations[0] if declarations else None, support)
    return ProviderUnderTest(
        name=name,
        requested=requested,
        kind=kind,
        options=dict(options),
        distribution=distribution,
        version=version,
        expectation_files=tuple(files),
        operator_support=support,
        _registration=registration,
    )
