"""The documented error hierarchy: every error class of the package belongs to exactly one category of
``optimum_ipu_backend.errors``, keeps the built-in base it had (so existing ``except`` clauses still
catch it), and is listed in the user guide; the errors module sits at the bottom of the import graph."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import optimum_ipu_backend
from optimum_ipu_backend import errors

CATEGORIES = {
    errors.InvalidFeedError: ValueError,
    errors.ConfigurationError: ValueError,
    errors.UnsupportedModelError: None,  # no built-in: the model, not the call or a setting, is at fault
    errors.DeviceError: RuntimeError,
    errors.InstallationError: RuntimeError,
}
# Exceptions that never leave the package: each is caught where it is raised.
INTERNAL = {
    "CannotLower": "a lowering rule declines a node; the pass reports it in a LegalizationError",
    "UsageError": "the CLI's argument errors, turned into an exit status",
    "DimExpressionError": "a dim_param outside the grammar counts as an unknown dimension",
    "ProofAborted": "the padding proof gives up on a node; the dimension is then compiled exactly",
    "EvaluationError": "the padding proof cannot evaluate a node; it aborts the proof (ProofAborted)",
    "CarriedStateRefused": "a decode graph of another form; its key/value cache is then streamed, and "
    "session.kv_cache_verdict() says why",
}
# The built-in each class had before the hierarchy existed (exceptions users may already catch).
PREVIOUS_BASES = {
    "InvalidFeedError": ValueError,
    "InputTooLargeError": ValueError,
    "BucketOptionError": ValueError,
    "BoundaryCastError": ValueError,
    "DimensionMismatchError": ValueError,
    "ProviderOptionError": ValueError,
    "IPUConfigError": ValueError,
    "IOBindingError": ValueError,
    "EngineContractError": ValueError,
    "EngineUnavailableError": RuntimeError,
    "DeviceUnavailableError": RuntimeError,
    "ProviderPluginError": RuntimeError,
    "IntegrationError": RuntimeError,
    "CacheError": RuntimeError,
    "ExecutableLimitError": RuntimeError,
    "EngineClosedError": RuntimeError,
    "SdkError": RuntimeError,
    "DeviceFaultError": RuntimeError,
    "DeviceAcquisitionError": RuntimeError,
    "IPUOutOfMemoryError": RuntimeError,
    "DeviceResetError": RuntimeError,
    "DeviceLostError": RuntimeError,
    "SdkFailureError": RuntimeError,
    "WorkerError": RuntimeError,
    "WorkerDiedError": RuntimeError,
    "CompileTimeoutError": RuntimeError,
    "LegalizationError": Exception,
}
USER_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "user-guide.md"


def _package_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in the package's modules (namespace folders such as
    compiler/passes included; the activation shim is a top-level module of its own)."""
    root = Path(optimum_ipu_backend.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent).with_suffix("")
        if "_activation" in relative.parts:
            continue
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        module = importlib.import_module(".".join(parts))
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and not name.startswith("_")  # private classes are caught inside their module
                and issubclass(value, Exception)
                and not issubclass(value, Warning)
                and value.__module__ == module.__name__
            ):
                found[name] = value
    return found


EXCEPTIONS = _package_exceptions()


@pytest.mark.parametrize("name", sorted(set(EXCEPTIONS) - set(INTERNAL)))
def test_every_error_is_in_exactly_one_category(name):
    cls = EXCEPTIONS[name]
    assert issubclass(cls, errors.IPUBackendError), f"{name} is not an IPUBackendError"
    if cls is errors.IPUBackendError:
        return
    assert len([category for category in CATEGORIES if issubclass(cls, category)]) == 1, name


@pytest.mark.parametrize("category, builtin", list(CATEGORIES.items()))
def test_categories_subclass_the_matching_builtin(category, builtin):
    if builtin is None:
        assert not issubclass(category, (ValueError, RuntimeError))
    else:
        assert issubclass(category, builtin)


@pytest.mark.parametrize("name, builtin", sorted(PREVIOUS_BASES.items()))
def test_existing_except_clauses_still_catch(name, builtin):
    assert issubclass(EXCEPTIONS[name], builtin)


def test_internal_exceptions_exist_and_are_not_documented_categories():
    for name in INTERNAL:
        assert name in EXCEPTIONS
        assert not issubclass(EXCEPTIONS[name], errors.IPUBackendError)


def test_the_errors_module_imports_nothing():
    tree = ast.parse(Path(errors.__file__).read_text(encoding="utf-8"))
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imports)


def test_the_user_guide_lists_every_error_with_an_example():
    text = USER_GUIDE.read_text(encoding="utf-8")
    section = text[text.index("## Bad input and errors") :]
    section = section[: section.index("\n## ")]
    for name in sorted(set(EXCEPTIONS) - set(INTERNAL)):
        rows = [line for line in section.splitlines() if re.search(rf"`{name}`", line)]
        assert rows, f"{name} is not in the user guide's errors section"
