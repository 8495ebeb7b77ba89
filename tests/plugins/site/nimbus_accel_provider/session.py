"""Nimbus sessions: the Acme test double's CPU-backed session under another name."""

from acme_npu_provider.session import AcmeSession


class NimbusSession(AcmeSession):
    NAME = "NimbusExecutionProvider"
