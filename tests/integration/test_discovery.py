"""Entry-point discovery: the registration record, lazy factories, isolation of broken plugins,
the OPTIMUM_PROVIDER_PLUGINS filter."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest

from optimum_ipu_backend.errors import ProviderPluginError
from optimum_ipu_backend.integration.discovery import (
    ENTRY_POINT_GROUP,
    ProviderRegistry,
    ProviderSpec,
)

GOOD = ProviderSpec(name="FooExecutionProvider", aliases=("foo",), session_factory="json:loads")


def _registry(*entries: tuple[str, str]) -> ProviderRegistry:
    eps = [metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in entries]
    return ProviderRegistry(lambda: eps)


def test_spec_mapping_and_callable_forms_are_accepted(monkeypatch):
    import sys
    import types

    module = types.ModuleType("fake_vendor_plugin")
    module.SPEC_OBJ = GOOD
    module.SPEC_DICT = {"name": "BarExecutionProvider", "aliases": ["bar"], "session_factory": "json:dumps"}
    module.register = lambda: {"name": "BazExecutionProvider", "session_factory": "json:loads"}
    monkeypatch.setitem(sys.modules, "fake_vendor_plugin", module)
    registry = _registry(
        ("foo", "fake_vendor_plugin:SPEC_OBJ"),
        ("bar", "fake_vendor_plugin:SPEC_DICT"),
        ("baz", "fake_vendor_plugin:register"),
    )
    assert registry.lookup("foo").name == "FooExecutionProvider"
    assert registry.lookup("FooExecutionProvider").entry_point == "foo"
    assert registry.lookup("bar").spec.aliases == ("bar",)
    assert registry.lookup("BazExecutionProvider") is not None
    assert registry.lookup("CPUExecutionProvider") is None
    assert registry.broken() == []


def test_factory_is_imported_lazily_and_its_failure_names_the_plugin(monkeypatch):
    import sys
    import types

    module = types.ModuleType("lazy_plugin")
    module.SPEC = ProviderSpec(
        name="LazyExecutionProvider", session_factory="module_that_does_not_exist:factory"
    )
    monkeypatch.setitem(sys.modules, "lazy_plugin", module)
    registry = _registry(("lazy", "lazy_plugin:SPEC"))
    registration = registry.lookup("LazyExecutionProvider")  # discovery does not import the factory
    assert registration is not None
    with pytest.raises(ProviderPluginError, match="module_that_does_not_exist.*failed to import"):
        registration.create_session("model.onnx")


def test_broken_plugin_is_isolated_logged_once_and_raised_when_asked_for(monkeypatch, caplog):
    import sys
    import types

    module = types.ModuleType("good_plugin")
    module.SPEC = GOOD
    monkeypatch.setitem(sys.modules, "good_plugin", module)
    registry = _registry(("broken", "no_such_module_xyz:SPEC"), ("foo", "good_plugin:SPEC"))
    with caplog.at_level(logging.WARNING):
        assert registry.lookup("foo") is not None  # the good one still works
        registry.lookup("foo")
    warnings = [r for r in caplog.records if "no_such_module_xyz" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(ProviderPluginError) as info:
        registry.lookup("broken")
    message = str(info.value)
    assert "entry point broken = no_such_module_xyz:SPEC" in message
    assert "ModuleNotFoundError" in message


@pytest.mark.parametrize(
    "value, env, expected",
    [
        ("", None, {"foo", "bar"}),
        ("0", None, set()),
        ("foo", None, {"foo"}),
        ("foo,bar", None, {"foo", "bar"}),
    ],
)
def test_plugins_env_filter(monkeypatch, value, env, expected):
    import sys
    import types

    module = types.ModuleType("two_plugins")
    module.FOO = GOOD
    module.BAR = {"name": "BarExecutionProvider", "session_factory": "json:dumps"}
    monkeypatch.setitem(sys.modules, "two_plugins", module)
    monkeypatch.setenv("OPTIMUM_PROVIDER_PLUGINS", value)
    registry = _registry(("foo", "two_plugins:FOO"), ("bar", "two_plugins:BAR"))
    assert {r.entry_point for r in registry.registrations()} == expected


def test_native_names_and_duplicates_are_refused(monkeypatch):
    import sys
    import types

    module = types.ModuleType("rogue_plugin")
    module.CPU = {"name": "CPUExecutionProvider", "session_factory": "json:loads"}
    module.FOO = GOOD
    module.FOO_AGAIN = {"name": "OtherExecutionProvider", "aliases": ["foo"], "session_factory": "json:loads"}
    monkeypatch.setitem(sys.modules, "rogue_plugin", module)
    registry = _registry(
        ("cpu", "rogue_plugin:CPU"), ("foo", "rogue_plugin:FOO"), ("foo2", "rogue_plugin:FOO_AGAIN")
    )
    assert [r.entry_point for r in registry.registrations()] == ["foo"]
    errors = {b.entry_point: str(b.error) for b in registry.broken()}
    assert "belongs to onnxruntime" in errors["cpu"]
    assert "already registered" in errors["foo2"]


def test_our_own_entry_point_is_installed_and_cheap():
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "ipu"]
    assert eps, "the ipu entry point is not installed; install the package (pip install .)"
    spec = eps[0].load()
    assert spec.name == "IPUExecutionProvider" and "ipu" in spec.aliases
    assert spec.session_factory == "optimum_ipu_backend.session:create_session"
