"""The errors this package raises, as one small hierarchy that every layer can import.

Every error a user can get from an ipu session is an instance of ``IPUBackendError`` and of exactly one
of the categories below. Each category also subclasses the built-in exception that code written for
onnxruntime already catches (``ValueError`` for bad input or settings, ``RuntimeError`` for a device,
engine or installation fault), so existing ``except`` clauses keep working. Narrower classes live
beside the code that raises them (``InputTooLargeError`` in ``runtime.buckets``, ``DeviceUnavailableError``
in ``engines.probe``, ...) and subclass one of these; the user guide lists them with an example message
each.

This module imports nothing, so it sits at the bottom of the import graph: the bootstrap, the
integration patches, the compiler, the engines, the runtime and the session all import it without
pulling anything else in.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DeviceError",
    "IPUBackendError",
    "InstallationError",
    "IntegrationError",
    "InvalidFeedError",
    "ProviderPluginError",
    "UnsupportedModelError",
]


class IPUBackendError(Exception):
    """Base of every error optimum-ipu-backend raises on purpose; catch it to catch them all."""


class InvalidFeedError(IPUBackendError, ValueError):
    """The inputs of one call cannot be served: an input is missing or unknown, has the wrong dtype, rank
    or shape, holds a value the device cannot take (an index outside its table, an integer outside int32),
    has an empty dimension, or is larger than the largest compiled size. The message names the input."""


class ConfigurationError(IPUBackendError, ValueError):
    """Provider options, an ``ipu_config.json`` or a list of compiled sizes is malformed or contradicts
    the model. The message names the option (or field and file) and what it accepts."""


class UnsupportedModelError(IPUBackendError):
    """The exported graph cannot become an IPU executable (an operator or a shape the compiler cannot
    take). Raised when the session is created, or when a call needs a shape the graph cannot be compiled
    for; the message lists the offending nodes. Not a ``ValueError``: the model, not the call, is at fault,
    and a warned fallback to the providers listed after ipu catches exactly this class."""


class DeviceError(IPUBackendError, RuntimeError):
    """The device or what drives it cannot do what was asked: no IPU or SDK, an engine whose SDK cannot start
    here, a device that refuses what it was fed, a broken executable cache entry."""


class InstallationError(IPUBackendError, RuntimeError):
    """This package, a provider plugin or optimum-onnx is installed in a way that cannot serve the request:
    a plugin failed to load or is disabled, or optimum-onnx's internals are not the ones the patches know."""


class ProviderPluginError(InstallationError):
    """A provider plugin was asked for but cannot be used. Here rather than beside discovery, so that the
    patches raise it without importing anything at start-up."""


class IntegrationError(ProviderPluginError):
    """optimum-onnx's internals are not what the patches expect."""
