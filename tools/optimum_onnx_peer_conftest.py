"""pytest plugin that runs optimum-onnx's own ORTModel tests against a provider (tools/optimum_onnx_tests.py).

tools/optimum_onnx_tests.py copies this file, as ``conftest.py``, into the temporary directory holding
optimum-onnx's tests; it is never part of their tree. Its settings come from one environment variable,
``OPTIMUM_PEER_SETTINGS``, a JSON object written by the tool:

* ``provider`` / ``provider_options``: when ``provider`` is set, every ``ORTModel*.from_pretrained`` call
  that names no provider (neither ``provider`` nor ``providers``) gets this provider and these options.
  Calls that name a provider keep it: a test that asks for ``CPUExecutionProvider`` still gets it.
* ``architectures``: the parameterized tests run are those whose architecture (the first parameter, in
  the test's name after its index) is one of these.
* ``extra_tests``: unparameterized tests also run, as ``file.py::Class::test`` ids.
* ``image``: a local image file served to ``requests.get`` for image URLs, since the image tests
  download a photograph and the run has no network.

Every test gets the junit property ``names_cpu_provider`` = ``1`` when its own source names
``CPUExecutionProvider``: on another provider those tests are expected to fail, and the tool lists them
apart from real regressions. A test that loaded models on the injected provider gets the property
``provider_models`` = how many, so the tool can say how many passing tests ran on the provider at all.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

SETTINGS: dict[str, Any] = json.loads(os.environ.get("OPTIMUM_PEER_SETTINGS", "{}"))

# parameterized.expand names a test ``<function>_<index>_<first parameter>``, and grid_parameters makes
# the first parameter ``<architecture>_<other values>``; the other values are True/False here.
_PARAMETERIZED_NAME = re.compile(r"^(?P<function>test\w*?)_(?P<index>\d+)_(?P<rest>\w+)$")


def architecture_of(test_name: str, architectures: list[str]) -> str | None:
    """The architecture a parameterized test name carries, if it is one of ``architectures``.

    Architectures are matched in their "safe" spelling (``deberta-v2`` -> ``deberta_v2``), whole, right
    after the index, followed by nothing or by ``_`` and the other parameters; the longest match wins so
    ``xlm_roberta`` is never read as ``roberta`` (the index comes first) nor ``distilbert`` as ``bert``.
    """
    match = _PARAMETERIZED_NAME.match(test_name)
    if match is None:
        return None
    rest = match.group("rest")
    found = None
    for architecture in architectures:
        safe = re.sub(r"\W", "_", architecture)
        if rest == safe or rest.startswith(safe + "_"):
            if found is None or len(safe) > len(re.sub(r"\W", "_", found)):
                found = architecture
    return found


def _names_cpu_provider(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return False
    return "CPUExecutionProvider" in source


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    architectures = SETTINGS.get("architectures")
    extra_tests = set(SETTINGS.get("extra_tests", ()))
    selected, deselected = [], []
    for item in items:
        keep = architectures is None
        if not keep:
            test_id = "::".join([Path(item.nodeid.split("::")[0]).name, *item.nodeid.split("::")[1:]])
            keep = test_id in extra_tests or architecture_of(item.name, architectures) is not None
        (selected if keep else deselected).append(item)
        if keep and _names_cpu_provider(item):
            item.user_properties.append(("names_cpu_provider", "1"))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


# The test running now, and how many models it loaded on the injected provider.
_running: dict[str, Any] = {"item": None, "models": 0}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running.update(item=item, models=0)
    yield
    _running.update(item=None, models=0)


def _inject_provider(provider: str, provider_options: dict[str, Any]) -> None:
    from optimum.onnxruntime import ORTModel

    original = ORTModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        injected = kwargs.get("provider") is None and kwargs.get("providers") is None
        if injected:
            kwargs["provider"] = provider
            if kwargs.get("provider_options") is None and provider_options:
                kwargs["provider_options"] = dict(provider_options)
        model = original(cls, *args, **kwargs)
        item = _running["item"]
        if injected and item is not None:
            _running["models"] += 1
            # replaced, not appended: the report of each phase carries the count so far
            item.user_properties[:] = [p for p in item.user_properties if p[0] != "provider_models"]
            item.user_properties.append(("provider_models", str(_running["models"])))
        return model

    ORTModel.from_pretrained = classmethod(from_pretrained)


class _ImageResponse:
    """The part of ``requests.Response`` that PIL-loading code reads."""

    status_code = 200
    ok = True

    def __init__(self, content: bytes) -> None:
        import io

        self.content = content
        self.raw = io.BytesIO(content)

    def raise_for_status(self) -> None:
        return None


def _serve_image(image_path: str) -> None:
    import requests

    original_get = requests.get
    content = Path(image_path).read_bytes()

    def get(url, *args, **kwargs):
        if isinstance(url, str) and re.search(r"\.(jpe?g|png)$", url, re.IGNORECASE):
            return _ImageResponse(content)
        return original_get(url, *args, **kwargs)

    requests.get = get


def pytest_configure(config: pytest.Config) -> None:
    if SETTINGS.get("image"):
        _serve_image(SETTINGS["image"])
    if SETTINGS.get("provider"):
        _inject_provider(SETTINGS["provider"], SETTINGS.get("provider_options") or {})
