"""Stdlib-only activation hook, run from a ``.pth`` line, a PEP 829 ``.start`` file or torch's
``torch.backends`` entry point.

It must never raise (an exception here would break every interpreter start, or ``import torch``)
and must stay cheap: it only inserts a meta-path finder that patches optimum-onnx's modules right
after they execute, and patches those that were already imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from types import ModuleType

# The optimum-onnx modules whose module globals we patch (see integration/patches.py).
TARGET_MODULES = (
    "optimum.onnxruntime.utils",
    "optimum.onnxruntime.base",
    "optimum.onnxruntime.modeling",
    "optimum.onnxruntime.modeling_decoder",
    "optimum.onnxruntime.modeling_seq2seq",
    "optimum.onnxruntime.modeling_diffusion",
)

PLUGINS_ENV = "OPTIMUM_PROVIDER_PLUGINS"

_logger = logging.getLogger("optimum_ipu_backend")
_lock = threading.RLock()
_finder: _PostImportPatcher | None = None


def plugins_disabled() -> bool:
    """``OPTIMUM_PROVIDER_PLUGINS=0`` turns every provider plugin off, ours included."""
    return os.environ.get(PLUGINS_ENV, "").strip() == "0"


def _patch(module: ModuleType) -> None:
    try:
        from optimum_ipu_backend.integration import patches

        patches.patch_module(module)
    except Exception:  # noqa: BLE001 - a failed patch is recorded, never allowed to break the import
        _logger.exception("optimum-ipu-backend could not patch %s", module.__name__)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it produced."""

    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._wrapped, name)


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Finds the target modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGET_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and not isinstance(spec.loader, _PatchingLoader):
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        return None


def install() -> bool:
    """Insert the post-import patcher once and patch already-imported targets. Never raises."""
    global _finder
    try:
        if plugins_disabled():
            return False
        with _lock:
            if _finder is None:
                _finder = _PostImportPatcher()
                sys.meta_path.insert(0, _finder)
            for name in TARGET_MODULES:
                module = sys.modules.get(name)
                if module is not None:
                    _patch(module)
        return True
    except Exception:  # noqa: BLE001 - see module docstring
        _logger.exception("optimum-ipu-backend activation failed")
        return False


def is_installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def torch_autoload() -> None:
    """Target of the ``torch.backends`` entry point: torch turns any exception here into a failed
    ``import torch``, so this swallows everything."""
    install()
