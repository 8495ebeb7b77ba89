"""Errors of the integration layer; kept apart so the patches import nothing heavier at start-up."""

from optimum_ipu_backend.errors import InstallationError


class ProviderPluginError(InstallationError):
    """A provider plugin was asked for but cannot be used."""


class IntegrationError(ProviderPluginError):
    """optimum-onnx's internals are not what the patches expect."""
