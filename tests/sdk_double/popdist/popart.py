"""A double of ``popdist.popart`` (closed source; see the package docstring for the sources).

* ``configureSessionOptions(opts)``: graphcore/popart docs/popart/tensor_locations.rst and
  tests/integration/distributed_replicated_graph_test.py (sdk-release-3.4) say it sets
  ``enableReplicatedGraphs``, ``replicatedGraphCount``, ``enableDistributedReplicatedGraphs``,
  ``globalReplicaOffset`` and ``globalReplicationFactor``. Assumed values: local replication when the
  instance has more than one replica (willow/src/ir.cpp, Ir::verifyDistributedReplicatedGraphSettings
  refuses enableReplicatedGraphs with a count of 1), the total replicas and this instance's offset.
* ``getDevice(ipus_per_replica=0, connectionType=Always)``: this instance's device
  (python/popxl/python_files/utils.py calls it with only ``connectionType``). Assumed: the device
  ``acquireDeviceById(popdist.getDeviceId(k))`` gives.
"""

from __future__ import annotations

import popart

import popdist


def configureSessionOptions(opts) -> None:  # noqa: N802
    local = popdist.getNumLocalReplicas()
    popdist._log("popdist.popart.configureSessionOptions")
    opts.enableReplicatedGraphs = local > 1
    opts.replicatedGraphCount = local
    opts.enableDistributedReplicatedGraphs = True
    opts.globalReplicationFactor = popdist.getNumTotalReplicas()
    opts.globalReplicaOffset = popdist.getReplicaIndexOffset()


def getDevice(ipus_per_replica: int = 0, connectionType=None):  # noqa: N802, N803
    device_id = popdist.getDeviceId(ipus_per_replica)
    popdist._log("popdist.popart.getDevice", id=device_id)
    connection = popart.DeviceConnectionType.Always if connectionType is None else connectionType
    return popart.DeviceManager().acquireDeviceById(device_id, connectionType=connection)
