"""A test double of the ``popdist`` Python package (PopDist, shipped with the Poplar SDK), for CI
machines without the SDK.

PopDist is closed source. Every behaviour here is *assumed* from what public sources show of it:

* Graphcore's PopRun/PopDist user guide (the Python API page) as summarised in the project's
  reference notes: ``getNumTotalReplicas``, ``getNumLocalReplicas`` (1 when unset),
  ``getNumIpusPerReplica`` (1 when unset), ``getNumInstances`` and ``getInstanceIndex`` (uniform
  replicas per instance), ``getLocalInstanceIndex``, ``getDeviceId(ipusPerReplica=0)``.
* The variables ``poprun`` exports to each instance (a public ``poprun -vv`` log):
  ``POPDIST_NUM_TOTAL_REPLICAS``, ``POPDIST_NUM_LOCAL_REPLICAS``, ``POPDIST_NUM_IPUS_PER_REPLICA``,
  ``POPDIST_REPLICA_INDEX_OFFSET``, ``POPDIST_LOCAL_INSTANCE_INDEX``,
  ``POPDIST_UNIFORM_REPLICAS_PER_INSTANCE``. The functions read them on every call.
* Its callers in graphcore/popart (sdk-release-3.4): python/popart/python_files/
  _popdist_backend_manager.py (``isBackendInitialized``, ``init``), python/popxl/python_files/ir.py and
  tests/integration/distributed_replicated_graph_test.py (``popdist.popart``), tests/integration/
  distributed_test.py (``getInstanceIndex``, ``getNumInstances``). graphcore/examples (v3.1.0)
  nlp/bert/popart/utils: instances = total // local, index = offset // local, which this double uses.

Test control: the double's call log (``POPART_DOUBLE_LOG``), shared with the PopART double.
"""

from __future__ import annotations

import json
import os

__all__ = [
    "getDeviceId",
    "getInstanceIndex",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getNumIpusPerReplica",
    "getNumLocalReplicas",
    "getNumTotalReplicas",
    "getReplicaIndexOffset",
    "init",
    "isBackendInitialized",
    "isPopdistEnvSet",
]

_backend_initialized = False


def _log(call: str, **fields) -> None:
    path = os.environ.get("POPART_DOUBLE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps({"call": call, "pid": os.getpid(), **fields}, default=str) + "\n")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def isPopdistEnvSet() -> bool:  # noqa: N802
    """Assumed: True inside an instance poprun started, which sets POPDIST_NUM_TOTAL_REPLICAS."""
    return "POPDIST_NUM_TOTAL_REPLICAS" in os.environ


def getNumTotalReplicas() -> int:  # noqa: N802
    return _int("POPDIST_NUM_TOTAL_REPLICAS", 1)


def getNumLocalReplicas() -> int:  # noqa: N802
    return _int("POPDIST_NUM_LOCAL_REPLICAS", 1)


def getNumIpusPerReplica() -> int:  # noqa: N802
    return _int("POPDIST_NUM_IPUS_PER_REPLICA", 1)


def getReplicaIndexOffset() -> int:  # noqa: N802
    return _int("POPDIST_REPLICA_INDEX_OFFSET", 0)


def getNumInstances() -> int:  # noqa: N802
    return getNumTotalReplicas() // getNumLocalReplicas()


def getInstanceIndex() -> int:  # noqa: N802
    return getReplicaIndexOffset() // getNumLocalReplicas()


def getLocalInstanceIndex() -> int:  # noqa: N802
    """Assumed: POPDIST_LOCAL_INSTANCE_INDEX, else the instance index (every instance on one host)."""
    return _int("POPDIST_LOCAL_INSTANCE_INDEX", getInstanceIndex())


def getDeviceId(ipusPerReplica: int = 0) -> int:  # noqa: N802, N803
    """The id of this instance's device for ``acquireDeviceById``. Assumed: the aligned group of
    local replicas x IPUs per replica that follows the groups of the instances before it on this host,
    numbered as the PopART double's DeviceManager numbers groups (single IPUs 0..n-1, a group of
    ``size`` IPUs from ``start`` is ``1000 * size + start``)."""
    per_replica = ipusPerReplica or getNumIpusPerReplica()
    size = getNumLocalReplicas() * per_replica
    start = getLocalInstanceIndex() * size
    return start if size == 1 else 1000 * size + start


def isBackendInitialized() -> bool:  # noqa: N802
    return _backend_initialized


def init() -> None:
    """Assumed: registers and initialises PopDist's default (MPI) backend once; a second call raises,
    as _popdist_backend_manager.py's comments say an initialised backend cannot be initialised again."""
    global _backend_initialized
    if _backend_initialized:
        raise RuntimeError("popdist: the backend is already initialised")
    _backend_initialized = True
    _log("popdist.init")
