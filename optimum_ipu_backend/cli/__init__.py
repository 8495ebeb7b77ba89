"""The ``optimum-ipu`` command."""
