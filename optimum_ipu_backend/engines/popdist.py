"""This process's share of the replicas under PopRun, as PopDist describes it.

``poprun --num-instances N --num-replicas R ...`` starts N processes and gives each its share through
environment variables (as PopDist documents them): ``POPDIST_NUM_TOTAL_REPLICAS`` (R),
``POPDIST_NUM_LOCAL_REPLICAS`` (R / N), ``POPDIST_REPLICA_INDEX_OFFSET`` (this instance's first replica),
``POPDIST_NUM_IPUS_PER_REPLICA``. Where the ``popdist`` package is installed its documented functions
are used instead; either way the instance count is total / local and the index offset / local, as
Graphcore's own PopART examples compute them. The engines then configure each session as
``popdist.popart.configureSessionOptions`` does: distributed replicated graphs with this instance's
local replicas, the global replication factor and this instance's offset.

Sharding the data is the caller's job: each instance feeds its own part (see docs/hardware.md).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from optimum_ipu_backend.engines.base import DistributedReplicas

ENVIRONMENT = (
    "POPDIST_NUM_TOTAL_REPLICAS",
    "POPDIST_NUM_LOCAL_REPLICAS",
    "POPDIST_REPLICA_INDEX_OFFSET",
    "POPDIST_NUM_IPUS_PER_REPLICA",
)


@dataclass(frozen=True)
class PopDistShare:
    total_replicas: int
    local_replicas: int
    replica_offset: int
    ipus_per_replica: int = 1
    device_id: int | None = None

    @property
    def instances(self) -> int:
        return self.total_replicas // self.local_replicas

    @property
    def instance_index(self) -> int:
        return self.replica_offset // self.local_replicas

    def replicas(self) -> DistributedReplicas:
        return DistributedReplicas(
            self.total_replicas, self.replica_offset, self.ipus_per_replica, self.device_id
        )


def _from_popdist() -> PopDistShare | None:
    import popdist  # only where installed (it comes with the Poplar SDK)

    if not popdist.isPopdistEnvSet():
        return None
    ipus = popdist.getNumIpusPerReplica()
    return PopDistShare(
        popdist.getNumTotalReplicas(),
        popdist.getNumLocalReplicas(),
        popdist.getReplicaIndexOffset(),
        ipus,
        popdist.getDeviceId(ipus),
    )


def read_popdist(environ: Mapping[str, str] | None = None) -> PopDistShare | None:
    """This instance's share, or None outside PopRun. ``ValueError`` for inconsistent variables."""
    environ = os.environ if environ is None else environ
    if environ is os.environ and importlib.util.find_spec("popdist") is not None:
        return _from_popdist()
    if "POPDIST_NUM_TOTAL_REPLICAS" not in environ:
        return None
    try:
        total = int(environ["POPDIST_NUM_TOTAL_REPLICAS"])
        local = int(environ.get("POPDIST_NUM_LOCAL_REPLICAS", "1"))
        offset = int(environ.get("POPDIST_REPLICA_INDEX_OFFSET", "0"))
        ipus = int(environ.get("POPDIST_NUM_IPUS_PER_REPLICA", "1"))
    except ValueError as exc:
        raise ValueError(
            f"a POPDIST_* variable is not an integer ({exc}); check the poprun command"
        ) from None
    if local < 1 or total % local or not 0 <= offset < total or offset % local or ipus < 1:
        raise ValueError(
            f"inconsistent PopDist variables: {total} total replicas, {local} local, offset {offset}, "
            f"{ipus} IPU(s) per replica; poprun's --num-replicas must be a multiple of --num-instances"
        )
    return PopDistShare(total, local, offset, ipus)
