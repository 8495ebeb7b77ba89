"""optimum-ipu-backend: run Optimum's ONNX Runtime models on Graphcore IPUs with ``provider="ipu"``.

Importing this package is cheap on purpose: it runs from a ``.pth`` line at every interpreter
start, so nothing heavy (torch, onnx, onnxruntime, the Poplar SDK) is imported here.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "install"]


def install():
    """Activate the provider plugins for optimum-onnx in this process.

    Installing the package already does this through a ``.pth`` file; call it explicitly where
    ``.pth`` files are skipped (``python -S``, frozen applications). Returns whether the import
    hook is active (False when ``OPTIMUM_PROVIDER_PLUGINS=0`` disabled plugins).
    """
    from optimum_ipu_backend import _bootstrap

    return _bootstrap.install()
