"""Activation hook run from a ``.pth`` line, a PEP 829 ``.start`` file or torch's ``torch.backends``
entry point.

It runs at every interpreter start, so it must never raise and must cost next to nothing: it
imports no module that a bare interpreter has not already loaded (no ``importlib.abc``, ``logging``
or ``threading``; those alone cost tens of milliseconds), and only inserts a meta-path finder that
patches optimum-onnx's modules right after they execute, plus those already imported.
"""

import _thread
import os
import sys

# The one list of what we patch: each optimum-onnx module and the globals in it that integration/patches.py
# replaces ("Class.method": a method of a class there). The finder below watches these modules; the
# patches derive their targets from it.
PATCHED_GLOBALS = {
    "optimum.onnxruntime.utils": ("validate_provider_availability",),
    "optimum.onnxruntime.base": (
        "validate_provider_availability",
        "IOBinding",
        "ORTSessionMixin.to",
        "ORTParentMixin.to",
    ),
    "optimum.onnxruntime.modeling": ("InferenceSession",),
    "optimum.onnxruntime.modeling_decoder": ("InferenceSession", "ORTModelForCausalLM.generate"),
    "optimum.onnxruntime.modeling_seq2seq": ("InferenceSession", "ORTModelForConditionalGeneration.generate"),
    "optimum.onnxruntime.modeling_diffusion": ("InferenceSession",),
}
TARGET_MODULES = frozenset(PATCHED_GLOBALS)

PLUGINS_ENV = "OPTIMUM_PROVIDER_PLUGINS"

_lock = _thread.allocate_lock()
_finder = None


def plugins_disabled():
    """``OPTIMUM_PROVIDER_PLUGINS=0`` turns every provider plugin off, ours included."""
    return os.environ.get(PLUGINS_ENV, "").strip() == "0"


def _report(message, *args):
    import logging  # only on the error path

    logging.getLogger("optimum_ipu_backend").exception(message, *args)


def _patch(module):
    try:
        from optimum_ipu_backend.integration import patches

        patches.patch_module(module)
    except Exception:  # a failed patch is recorded, never allowed to break the import
        _report("optimum-ipu-backend could not patch %s", module.__name__)


class _PatchingLoader:
    """Runs the real loader, then patches the module it produced."""

    def __init__(self, wrapped):
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module):
        self._wrapped.exec_module(module)
        _patch(module)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._wrapped, name)


class _PostImportPatcher:
    """A meta-path finder: finds the target modules through the other finders, wraps their loader."""

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


def install():
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
    except Exception:  # see module docstring
        _report("optimum-ipu-backend activation failed")
        return False


def is_installed():
    return _finder is not None and _finder in sys.meta_path


def torch_autoload():
    """Target of the ``torch.backends`` entry point: torch turns any exception here into a failed
    ``import torch``, so this swallows everything."""
    install()
