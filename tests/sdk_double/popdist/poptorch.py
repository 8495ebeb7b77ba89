"""A double of ``popdist.poptorch`` (PopDist is closed source; see the package docstring).

``Options(ipus_per_replica=1)`` is a ``poptorch.Options`` that PopDist configures for this instance.

* graphcore/poptorch tests/popdist_test.py (sdk-release-3.4), test_blocked_options: calling ``useIpuId``,
  ``replicationFactor``, ``Distributed.disable``, ``Distributed.setEnvVarNames`` or
  ``Distributed.configureProcessId`` raises RuntimeError("Cannot call `<name>` with
  popdist.poptorch.Options"); test_getters: outside PopRun it reports process 0 of 1.
* graphcore/poptorch python/options.py, _DistributedOptions: under PopRun/PopDist "use
  popdist.poptorch.Options to set these values automatically". Assumed, because the values it sets are
  not public: the local replication factor (``popdist.getNumLocalReplicas()``), the process id and count
  (``getInstanceIndex()``, ``getNumInstances()``) and, inside a PopRun instance, the device PopDist
  assigns (``useIpuId(getDeviceId(ipus_per_replica))``).
"""

from __future__ import annotations

import poptorch

import popdist


def _blocked(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"Cannot call `{name}` with popdist.poptorch.Options")

    return refuse


class Options(poptorch.Options):
    def __init__(self, ipus_per_replica: int = 1) -> None:
        super().__init__()
        poptorch.Options.replicationFactor(self, popdist.getNumLocalReplicas())
        distributed = self.Distributed
        type(distributed).configureProcessId(
            distributed, popdist.getInstanceIndex(), popdist.getNumInstances()
        )
        if popdist.isPopdistEnvSet():
            poptorch.Options.useIpuId(self, popdist.getDeviceId(ipus_per_replica))
        for name in ("disable", "setEnvVarNames", "configureProcessId"):
            setattr(distributed, name, _blocked(f"Distributed.{name}"))
        popdist._log("popdist.poptorch.Options", ipus_per_replica=ipus_per_replica)

    useIpuId = _blocked("useIpuId")  # noqa: N815
    replicationFactor = _blocked("replicationFactor")  # noqa: N815
