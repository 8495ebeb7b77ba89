"""The activation hook, seen from inside the package.

The hook itself is the top-level module ``_optimum_ipu_backend_bootstrap`` (installed beside the
``.pth`` file), so that interpreter start-up imports one small module and not this package. From a
source tree that was never installed, the same file is loaded from ``_activation/`` under that name,
so there is only ever one hook and one state.
"""

import sys

_NAME = "_optimum_ipu_backend_bootstrap"

try:
    import _optimum_ipu_backend_bootstrap as _hook
except ModuleNotFoundError:  # not installed: load it from the source tree
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location(
        _NAME, Path(__file__).parent / "_activation" / f"{_NAME}.py"
    )
    _hook = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _hook
    _spec.loader.exec_module(_hook)

if not hasattr(_hook, "PATCHED_GLOBALS"):  # pip copies the hook; an old copy outlives a source update
    raise ImportError(
        f"{_hook.__file__} is from an older optimum-ipu-backend than {__file__}; reinstall the package "
        "(pip install -e . from a checkout, or pip install .)"
    )

install = _hook.install
is_installed = _hook.is_installed
plugins_disabled = _hook.plugins_disabled
torch_autoload = _hook.torch_autoload
TARGET_MODULES = _hook.TARGET_MODULES
PATCHED_GLOBALS = _hook.PATCHED_GLOBALS
