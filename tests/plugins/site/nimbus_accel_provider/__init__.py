"""A third vendor's provider plugin, for tests of provider="auto": it declares a higher priority than
acme-npu-provider, and its probe reports what the NIMBUS_DEVICE variable pretends the machine has."""

import os

SPEC = {
    "name": "NimbusExecutionProvider",
    "aliases": ["nimbus"],
    "session_factory": "nimbus_accel_provider.session:NimbusSession",
    "probe": "nimbus_accel_provider:probe",
    "priority": 50,
}


def probe():
    device = os.environ.get("NIMBUS_DEVICE", "")
    if device == "card":
        return True, "Nimbus card 0 found (test double)"
    if device == "simulator":
        return {"available": True, "detail": "the Nimbus host simulator (test double)", "emulated": True}
    return False, "no Nimbus card: /dev/nimbus0 not found (test double)"
