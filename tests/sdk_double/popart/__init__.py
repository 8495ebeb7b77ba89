"""A test double of PopART's public Python API, for CI machines without the Poplar SDK.

Written from the public API as the SDK documents it (sessions, devices, sharding, replication, PopDist):
the same names, signatures, enums, exception classes and message prefixes. Graphs execute with
onnxruntime on the CPU, so results can be compared with a plain CPU run. Nothing in
optimum_ipu_backend may depend on anything here beyond the documented API.

Test controls (environment, read on every call so a test can change them while a process runs):

* ``POPART_DOUBLE_CONFIG``: a JSON file. Keys: ``ipus`` (hardware IPUs visible, default 0),
  ``ipu_version`` (``"ipu2"``), ``version`` (``"3.4.0"``), ``memory_bytes_per_ipu`` (an executable whose
  initializers exceed it per IPU raises ``OutOfMemoryException``; scaled by tiles/1472 on the IPU Model),
  ``faults``: a list of ``{"id", "at": "acquire"|"prepareDevice"|"run", "error":
  "popart_exception"|"OutOfMemoryException"|"recoverable"|"unrecoverable"|"hang"|"exit", "action":
  "IPU_RESET", "times": 1, "seconds": 3600}``; a fault fires ``times`` times per process.
* ``POPART_DOUBLE_LOG``: a file the double appends one JSON line per API call to (the call log).
"""

from __future__ import annotations

import sys

if "onnx" in sys.modules:
    raise ImportError(
        "It looks like onnx has already been imported. Due to an ongoing issue, popart must be imported "
        "before onnx."
    )

import enum  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

_HERE = Path(__file__).resolve().parent
FULL_TILES = 1472
_fired: dict[str, int] = {}


# ---------------------------------------------------------------------------------------------------------
# Test controls
# ---------------------------------------------------------------------------------------------------------


def _config() -> dict:
    path = os.environ.get("POPART_DOUBLE_CONFIG")
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def _log(call: str, **fields) -> None:
    path = os.environ.get("POPART_DOUBLE_LOG")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(json.dumps({"call": call, "pid": os.getpid(), **fields}, default=str) + "\n")


def _fault(at: str) -> None:
    """Raise (or hang, or die) when the configuration asks for a fault at ``at``."""
    for fault in _config().get("faults", []):
        if fault.get("at") != at:
            continue
        key = str(fault.get("id", json.dumps(fault, sort_keys=True)))
        if _fired.get(key, 0) >= int(fault.get("times", 1)):
            continue
        _fired[key] = _fired.get(key, 0) + 1
        _log("fault", at=at, fault=fault)
        kind = fault["error"]
        if kind == "hang":
            time.sleep(float(fault.get("seconds", 3600)))
        elif kind == "exit":
            os._exit(int(fault.get("code", 70)))
        elif kind == "recoverable":
            raise poplar_recoverable_runtime_error(
                "poplar_recoverable_runtime_error: an IPU error was detected",
                RecoveryAction[fault.get("action", "IPU_RESET")],
            )
        elif kind == "unrecoverable":
            raise poplar_unrecoverable_runtime_error("poplar_unrecoverable_runtime_error: the IPU is lost")
        elif kind == "OutOfMemoryException":
            raise OutOfMemoryException("Out of memory: provoked by the test configuration")
        else:
            raise globals()[kind](fault.get("message", f"{kind} provoked by the test configuration"))


# ---------------------------------------------------------------------------------------------------------
# Exceptions
# ---------------------------------------------------------------------------------------------------------


class popart_exception(Exception):  # noqa: N801
    pass


class popart_internal_exception(popart_exception):  # noqa: N801
    pass


class popart_runtime_error(popart_exception):  # noqa: N801
    pass


class OutOfMemoryException(popart_exception):
    def getSummaryReport(self) -> str:  # noqa: N802
        return "memory report of the double: initializers do not fit"

    def getProfilePath(self) -> str:  # noqa: N802
        return "profile.pop"


class poplibs_exception(Exception):  # noqa: N801
    pass


class poplar_exception(Exception):  # noqa: N801
    pass


class poplar_runtime_error(poplar_exception):  # noqa: N801
    pass


class poplar_application_runtime_error(poplar_runtime_error):  # noqa: N801
    pass


class poplar_system_runtime_error(poplar_runtime_error):  # noqa: N801
    pass


class RecoveryAction(enum.Enum):
    IPU_RESET = 0
    LINK_RESET = 1
    PARTITION_RESET = 2
    FULL_RESET = 3


class poplar_recoverable_runtime_error(poplar_system_runtime_error):  # noqa: N801
    def __init__(self, message: str, action: RecoveryAction = RecoveryAction.IPU_RESET) -> None:
        super().__init__(message)
        self.recoveryAction = action


class poplar_unrecoverable_runtime_error(poplar_system_runtime_error):  # noqa: N801
    pass


class poplar_unknown_runtime_error(poplar_system_runtime_error):  # noqa: N801
    pass


# ---------------------------------------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------------------------------------


class DeviceType(enum.Enum):
    IpuModel = 0
    Cpu = 1
    Ipu = 2
    OfflineIpu = 3
    Sim = 4


class DeviceConnectionType(enum.Enum):
    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.Enum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class DeviceSelectionCriterion(enum.Enum):
    First = 0
    Random = 1


class VirtualGraphMode(enum.Enum):
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class SyntheticDataMode(enum.Enum):
    Off = 0
    Zeros = 1
    RandomNormal = 2
    RandomUniform = 3


class PatternsLevel(enum.Enum):
    NoPatterns = 0
    Minimal = 1
    Default = 2
    All = 3


class AnchorReturnTypeId(enum.Enum):
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3


# ---------------------------------------------------------------------------------------------------------
# Versions, operators
# ---------------------------------------------------------------------------------------------------------


def versionString() -> str:  # noqa: N802
    return str(_config().get("version", "3.4.0"))


def versionNumber():  # noqa: N802
    major, minor, point = (int(part) for part in versionString().split(".")[:3])
    return (major, minor, point)


class OperatorIdentifier:
    def __init__(self, domain: str, type: str, version: int) -> None:  # noqa: A002
        self.domain, self.type, self.version = domain, type, version


def _supported_types() -> set[str]:
    return set(json.loads((_HERE / "supported_ops.json").read_text())["ops"])


def getSupportedOperations(includeInternal: bool) -> list[OperatorIdentifier]:  # noqa: N802, N803
    return [OperatorIdentifier("ai.onnx", name, 11) for name in sorted(_supported_types())]


class _Logger:
    def setLevel(self, level: str) -> None:  # noqa: N802
        pass


def getLogger(name: str = "all") -> _Logger:  # noqa: N802
    return _Logger()


# ---------------------------------------------------------------------------------------------------------
# Tensors, data flow, options
# ---------------------------------------------------------------------------------------------------------

_POPART_TYPES = {
    "FLOAT": np.float32,
    "FLOAT16": np.float16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT32": np.uint32,
    "INT16": np.int16,
    "UINT16": np.uint16,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
    "DOUBLE": np.float64,
}
_ONNX_TO_POPART = {1: "FLOAT", 10: "FLOAT16", 6: "INT32", 7: "INT64", 12: "UINT32", 5: "INT16", 4: "UINT16",
                   3: "INT8", 2: "UINT8", 9: "BOOL", 11: "DOUBLE"}  # fmt: skip
_DEVICE_TYPES = {"FLOAT", "FLOAT16", "INT32", "UINT32", "INT16", "UINT16", "INT8", "UINT8", "BOOL"}


class TensorInfo:
    def __init__(self, dtype, shape=None) -> None:
        if isinstance(dtype, np.ndarray):
            shape, dtype = dtype.shape, dtype.dtype
        if isinstance(dtype, str):
            name = dtype.upper()
        else:
            name = next(k for k, v in _POPART_TYPES.items() if np.dtype(v) == np.dtype(dtype))
        self._type = name
        self._shape = [int(d) for d in shape]

    def shape(self) -> list[int]:
        return list(self._shape)

    def data_type(self) -> str:
        return self._type

    def data_type_lcase(self) -> str:
        return self._type.lower()

    def nelms(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_POPART_TYPES[self._type])


class InputShapeInfo:
    def __init__(self) -> None:
        self._infos: dict[str, TensorInfo] = {}

    def add(self, tensorId: str, info: TensorInfo) -> None:  # noqa: N803
        self._infos[tensorId] = info

    def get(self, tensorId: str) -> TensorInfo:  # noqa: N803
        return self._infos[tensorId]

    def has(self, tensorId: str) -> bool:  # noqa: N803
        return tensorId in self._infos


class AnchorReturnType:
    def __init__(self, anchorReturnTypeString: str, *args, **kwargs) -> None:  # noqa: N803
        kind = anchorReturnTypeString.lower()
        ids = {"all": AnchorReturnTypeId.All, "final": AnchorReturnTypeId.Final,
               "sum": AnchorReturnTypeId.Sum, "everyn": AnchorReturnTypeId.EveryN}  # fmt: skip
        if kind not in ids:
            raise popart_exception(f"Invalid anchor return type ID supplied: {anchorReturnTypeString}")
        period = args[0] if args and isinstance(args[0], int) else kwargs.get("returnPeriod")
        if kind == "everyn" and not period:
            raise popart_exception("Must specify return period with option 'EVERYN'")
        self._id, self._rp = ids[kind], period or 0

    def id(self) -> AnchorReturnTypeId:
        return self._id

    def rp(self) -> int:
        return self._rp


class DataFlow:
    def __init__(self, batchesPerStep: int, anchorTensors, anchorReturnType=None) -> None:  # noqa: N803
        if not isinstance(batchesPerStep, int) or isinstance(batchesPerStep, bool):
            raise TypeError("DataFlow(): incompatible function arguments: batchesPerStep must be an int")
        if isinstance(anchorTensors, dict):
            anchors = dict(anchorTensors)
        else:
            anchors = {name: anchorReturnType or AnchorReturnType("All") for name in anchorTensors}
        for value in anchors.values():
            if not isinstance(value, AnchorReturnType):
                raise TypeError("DataFlow(): incompatible function arguments: anchors need AnchorReturnType")
        self._bps, self._anchors = batchesPerStep, anchors

    def batchesPerStep(self) -> int:  # noqa: N802
        return self._bps

    def setBatchesPerStep(self, n: int) -> None:  # noqa: N802
        self._bps = n

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def art(self, anchorId: str) -> AnchorReturnType:  # noqa: N803
        return self._anchors[anchorId]

    def isAnchored(self, anchorId: str) -> bool:  # noqa: N802, N803
        return anchorId in self._anchors

    def nAnchors(self) -> int:  # noqa: N802
        return len(self._anchors)


_OPTION_DEFAULTS = {
    "enableEngineCaching": False,
    "cachePath": "session_cache",
    "enableVariablesCaching": True,
    "enableReplicatedGraphs": False,
    "replicatedGraphCount": 1,
    "enableDistributedReplicatedGraphs": False,
    "globalReplicationFactor": 1,
    "globalReplicaOffset": 0,
    "virtualGraphMode": VirtualGraphMode.Off,
    "enablePipelining": False,
    "partialsTypeMatMuls": "",
    "defaultBufferingDepth": 1,
    "enablePrefetchDatastreams": True,
    "constantWeights": True,
    "enableSupportedDataTypeCasting": True,
    "strictOpVersions": True,
    "compileEngine": True,
    "enableOutlining": True,
    "outlineThreshold": 1.0,
    "enableStableNorm": False,
    "enableNonStableSoftmax": False,
    "enableFloatingPointChecks": False,
    "enableStochasticRounding": False,
    "syntheticDataMode": SyntheticDataMode.Off,
    "engineOptions": {},
    "convolutionOptions": {},
    "matmulOptions": {},
    "reportOptions": {},
    "gclOptions": {},
    "instrumentWithHardwareCycleCounter": False,
    "logDir": "",
    "groupHostSync": False,
    "rearrangeAnchorsOnHost": True,
    "numIOTiles": 0,
    "accumulationFactor": 1,
    "enableGradientAccumulation": False,
    "enableExplicitMainLoops": False,
    "useHostCopyOps": False,
}


class SessionOptions:
    """An attribute bag like the pybind class: unknown attributes raise AttributeError."""

    def __init__(self) -> None:
        for name, value in _OPTION_DEFAULTS.items():
            object.__setattr__(self, name, dict(value) if isinstance(value, dict) else value)
        cache_dir = os.environ.get("POPART_CACHE_DIR") or os.environ.get("POPXL_CACHE_DIR")
        if cache_dir:  # read at construction, as the real class does
            object.__setattr__(self, "enableEngineCaching", True)
            object.__setattr__(self, "cachePath", cache_dir)

    def __setattr__(self, name: str, value) -> None:
        if name not in _OPTION_DEFAULTS:
            raise AttributeError(f"'popart_core.SessionOptions' object has no attribute '{name}'")
        object.__setattr__(self, name, value)

    def _fields(self) -> dict:
        return {name: getattr(self, name) for name in _OPTION_DEFAULTS}


class Patterns:
    def __init__(self, level=PatternsLevel.Default) -> None:
        self.level = level


# ---------------------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------------------


class DeviceInfo:
    def __init__(self, type: DeviceType, numIpus: int, tilesPerIPU: int, ids=(), version="ipu2",  # noqa: A002, N803
                 connectionType=DeviceConnectionType.Always) -> None:  # fmt: skip
        self.type = type
        self.numIpus = numIpus
        self.tilesPerIPU = tilesPerIPU
        self.driverIds = list(ids)
        self.id = ids[0] if ids else 0
        self.ipuVersion = version
        self.version = version
        self.connectionType = connectionType
        self.numWorkerContexts = 6
        self.isAttached = False
        self._loaded = None  # the session whose engine was most recently loaded

    def attach(self) -> bool:
        if self.type in (DeviceType.Ipu,):
            DeviceManager()._claim(self)
        self.isAttached = True
        _log("DeviceInfo.attach", id=self.id, numIpus=self.numIpus)
        return True

    def tryAttachUntilTimeout(self) -> bool:  # noqa: N802
        return self.attach()

    def detach(self) -> None:
        if self.type is DeviceType.Ipu:
            DeviceManager()._release(self)
        self.isAttached = False
        self._loaded = None
        _log("DeviceInfo.detach", id=self.id, type=self.type.name, numIpus=self.numIpus)

    def __enter__(self) -> DeviceInfo:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


class DeviceManager:
    _instance = None

    def __new__(cls) -> DeviceManager:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._attached = set()
            cls._instance._timeout = 0
        return cls._instance

    def _hardware(self) -> int:
        return int(_config().get("ipus", 0))

    def _claim(self, device: DeviceInfo) -> None:
        if set(device.driverIds) & self._attached:
            raise popart_exception(f"Failed to attach to device {device.id}: it is in use")
        self._attached |= set(device.driverIds)

    def _release(self, device: DeviceInfo) -> None:
        self._attached -= set(device.driverIds)

    def _free_group(self, numIpus: int):  # noqa: N803
        total = self._hardware()
        for start in range(0, total - numIpus + 1, numIpus):
            ids = list(range(start, start + numIpus))
            if not set(ids) & self._attached:
                return ids
        return None

    def enumerateDevices(self, pattern=SyncPattern.Full, numIpus=1, deviceType=DeviceType.Ipu,  # noqa: N802, N803
                         connectionType=DeviceConnectionType.Always, tilesPerIPU=0) -> list[DeviceInfo]:  # noqa: N803  # fmt: skip
        _log("DeviceManager.enumerateDevices", numIpus=numIpus)
        version = _config().get("ipu_version", "ipu2")
        total = self._hardware()
        return [DeviceInfo(DeviceType.Ipu, numIpus, FULL_TILES, list(range(s, s + numIpus)), version)
                for s in range(0, total - numIpus + 1, numIpus)]  # fmt: skip

    def _acquire(self, numIpus, tilesPerIpu, connectionType, raise_on_failure: bool):  # noqa: N803
        _log("DeviceManager.acquireAvailableDevice", numIpus=numIpus, type=type(numIpus).__name__,
             connectionType=getattr(connectionType, "name", connectionType), tries=not raise_on_failure)  # fmt: skip
        if connectionType is DeviceConnectionType.Never:
            raise popart_exception(
                "Trying to acquire a hardware device when connectionType is DeviceConnectionType::Never"
            )
        if numIpus < 1 or numIpus & (numIpus - 1):
            raise popart_exception(
                f"Failed to acquire device with {numIpus} IPUs. The number of IPUs requested must be a power of two"
            )
        _fault("acquire")
        ids = self._free_group(numIpus)
        if ids is None:
            if not raise_on_failure:
                return None
            raise popart_exception(
                f"Failed to acquire device with {numIpus} IPUs. Ensure that there are sufficient IPUs available. "
                "If you have enabled the Poplar SDK you can check device availability with the `gc-monitor` "
                "command-line utility."
            )
        device = DeviceInfo(DeviceType.Ipu, numIpus, FULL_TILES, ids, _config().get("ipu_version", "ipu2"),
                            connectionType)  # fmt: skip
        if connectionType is DeviceConnectionType.Always:
            device.attach()
        return device

    def acquireAvailableDevice(self, numIpus=1, tilesPerIpu=0, pattern=SyncPattern.Full,  # noqa: N802, N803
                               connectionType=DeviceConnectionType.Always,  # noqa: N803
                               selectionCriterion=DeviceSelectionCriterion.First) -> DeviceInfo:  # noqa: N803  # fmt: skip
        return self._acquire(numIpus, tilesPerIpu, connectionType, True)

    def tryAcquireAvailableDevice(self, numIpus=1, tilesPerIpu=0, pattern=SyncPattern.Full,  # noqa: N802, N803
                                  connectionType=DeviceConnectionType.Always,  # noqa: N803
                                  selectionCriterion=DeviceSelectionCriterion.First):  # noqa: N803  # fmt: skip
        return self._acquire(numIpus, tilesPerIpu, connectionType, False)

    def acquireDeviceById(self, id: int, pattern=SyncPattern.Full,  # noqa: N802, A002
                          connectionType=DeviceConnectionType.Always) -> DeviceInfo:  # noqa: N803  # fmt: skip
        """Ids follow ``gc-info -l``: 0..n-1 are single IPUs; a group of 2^k IPUs starting at s has id
        n + ... in the real tool; the double numbers groups as ``1000 * size + start``."""
        size, start = (id // 1000, id % 1000) if id >= 1000 else (1, id)
        _log("DeviceManager.acquireDeviceById", id=id, numIpus=size)
        _fault("acquire")
        ids = list(range(start, start + size))
        if start + size > self._hardware() or set(ids) & self._attached:
            raise popart_exception(f"Failed to acquire device with id '{id}'. Ensure it is available.")
        device = DeviceInfo(DeviceType.Ipu, size, FULL_TILES, ids, _config().get("ipu_version", "ipu2"),
                            connectionType)  # fmt: skip
        if connectionType is DeviceConnectionType.Always:
            device.attach()
        return device

    def createCpuDevice(self) -> DeviceInfo:  # noqa: N802
        _log("DeviceManager.createCpuDevice")
        return DeviceInfo(DeviceType.Cpu, 1, 1)

    def createIpuModelDevice(self, options: dict) -> DeviceInfo:  # noqa: N802
        if not isinstance(options, dict):
            raise TypeError("createIpuModelDevice(): incompatible function arguments: expected a dict")
        allowed = {"numIPUs", "tilesPerIPU", "compileIPUCode", "ipuVersion"}
        for key in options:
            if key not in allowed:
                raise popart_exception(
                    f"Invalid option '{key}' for IPUModelDevice. Valid options are {sorted(allowed)}"
                )
        _log("DeviceManager.createIpuModelDevice", options=options,
             types={k: type(v).__name__ for k, v in options.items()})  # fmt: skip
        device = DeviceInfo(DeviceType.IpuModel, int(str(options.get("numIPUs", 1))),
                            int(str(options.get("tilesPerIPU", 4))), version=str(options.get("ipuVersion", "ipu2")))  # fmt: skip
        device.isAttached = True
        return device

    def createOfflineIPUDevice(self, opts: dict) -> DeviceInfo:  # noqa: N802
        allowed = {"numIPUs", "tilesPerIPU", "ipuVersion", "syncPattern", "gatewayMode"}
        for key in opts:
            if key not in allowed:
                raise popart_exception(
                    f"Invalid option '{key}' for OfflineIPUDevice. Valid options are {sorted(allowed)}"
                )
        _log("DeviceManager.createOfflineIPUDevice", options=opts)
        return DeviceInfo(DeviceType.OfflineIpu, int(str(opts.get("numIPUs", 1))), FULL_TILES,
                          version=str(opts.get("ipuVersion", "ipu2")), connectionType=DeviceConnectionType.Never)  # fmt: skip

    def setOnDemandAttachTimeout(self, seconds: int) -> None:  # noqa: N802
        self._timeout = seconds


# ---------------------------------------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------------------------------------


# Inputs that ONNX (and so onnxruntime) requires to be int64, where PopART takes the int32 that
# convertINT64ToINT32 leaves: (op type, input positions).
_INT64_INPUTS = {
    "Reshape": (1,),
    "Expand": (1,),
    "Slice": (1, 2, 3, 4),
    "Tile": (1,),
    "ConstantOfShape": (0,),
    "Pad": (1,),
    "TopK": (1,),
    "Resize": (3,),
    "Upsample": (),
}


# Index outputs PopART computes as INT32 (its ArgMax/ArgMin and TopK ops set up INT32 indices), where
# onnxruntime's kernels produce int64: (op type, output position).
_INT32_INDEX_OUTPUTS = {"ArgMax": 0, "ArgMin": 0, "TopK": 1}


def _executable_by_onnxruntime(model):
    """The graph as the double executes it: int32 shape operands go back to int64 for onnxruntime, and
    the int64 indices onnxruntime computes are cast to the int32 PopART produces."""
    import onnx
    from onnx import helper, numpy_helper

    model = type(model).FromString(model.SerializeToString())
    for graph in _graphs(model.graph):
        initializers = {tensor.name: tensor for tensor in graph.initializer}
        nodes = []
        for node in graph.node:
            for position in _INT64_INPUTS.get(node.op_type, ()):
                if position >= len(node.input) or not node.input[position]:
                    continue
                name = node.input[position]
                tensor = initializers.get(name)
                if tensor is not None and tensor.data_type == onnx.TensorProto.INT32:
                    wide = f"{name}__int64"
                    if wide not in initializers:
                        initializers[wide] = numpy_helper.from_array(
                            numpy_helper.to_array(tensor).astype(np.int64), wide
                        )
                        graph.initializer.append(initializers[wide])
                    node.input[position] = wide
                elif tensor is None:
                    wide = f"{name}__int64_{len(nodes)}"
                    nodes.append(helper.make_node("Cast", [name], [wide], to=onnx.TensorProto.INT64))
                    node.input[position] = wide
            nodes.append(node)
            position = _INT32_INDEX_OUTPUTS.get(node.op_type)
            if position is not None and position < len(node.output) and node.output[position]:
                narrow = node.output[position]
                wide = f"{narrow}__onnxruntime_int64_{len(nodes)}"
                node.output[position] = wide
                nodes.append(helper.make_node("Cast", [wide], [narrow], to=onnx.TensorProto.INT32))
        graph.ClearField("node")
        graph.node.extend(nodes)
    return model


def _load_model(fnModel):  # noqa: N803
    import onnx

    try:
        if isinstance(fnModel, str) and os.path.isfile(fnModel):
            # External-data locations are resolved against the process CWD, as the real loader does.
            model = onnx.load(fnModel, load_external_data=False)
            for tensor in model.graph.initializer:
                for entry in tensor.external_data:
                    if entry.key == "location" and not os.path.exists(entry.value):
                        raise popart_exception(f"Could not find external data file {entry.value}")
            onnx.external_data_helper.load_external_data_for_model(model, os.getcwd())
            return model
        if isinstance(fnModel, str):
            fnModel = fnModel.encode("latin-1")
        return onnx.load_from_string(bytes(fnModel))
    except popart_exception:
        raise
    except Exception as exc:
        raise popart_exception(
            "Failed to load a ModelProto from the string. Check that it is either a valid path to an existing "
            f"onnx model file, or is a valid onnx ModelProto string. ({exc})"
        ) from None


def _graphs(graph):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.g.node or attribute.g.output:
                yield from _graphs(attribute.g)


class GraphTransformer:
    def __init__(self, modelProtoOrFilename) -> None:  # noqa: N803
        _log("GraphTransformer.__init__", arg_type=type(modelProtoOrFilename).__name__,
             is_path=isinstance(modelProtoOrFilename, str) and os.path.isfile(modelProtoOrFilename))  # fmt: skip
        self._model = _load_model(modelProtoOrFilename)

    def convertINT64ToINT32(self, clip: bool = False) -> None:  # noqa: N802
        import onnx
        from onnx import numpy_helper

        _log("GraphTransformer.convertINT64ToINT32", clip=clip)
        info = np.iinfo(np.int32)

        def narrow(tensor):
            values = numpy_helper.to_array(tensor)
            values = np.clip(values, info.min, info.max) if clip else values
            return numpy_helper.from_array(values.astype(np.int32), tensor.name)

        for graph in _graphs(self._model.graph):
            for index, tensor in enumerate(graph.initializer):
                if tensor.data_type == onnx.TensorProto.INT64:
                    graph.initializer[index].CopyFrom(narrow(tensor))
            for value in [*graph.input, *graph.output, *graph.value_info]:
                if value.type.tensor_type.elem_type == onnx.TensorProto.INT64:
                    value.type.tensor_type.elem_type = onnx.TensorProto.INT32
            for node in graph.node:  # Cast's `to` is not rewritten
                for attribute in node.attribute:
                    if (
                        attribute.type == onnx.AttributeProto.TENSOR
                        and attribute.t.data_type == onnx.TensorProto.INT64
                    ):
                        attribute.t.CopyFrom(narrow(attribute.t))

    def getModelProto(self) -> bytes:  # noqa: N802
        return self._model.SerializeToString()


# ---------------------------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------------------------


class PyStepIO:
    def __init__(self, inputs: dict, outputs: dict) -> None:
        for kind, arrays in (("input", inputs), ("output", outputs)):
            for name, array in arrays.items():
                if not isinstance(array, np.ndarray):
                    raise TypeError(f"PyStepIO(): {kind} {name!r} is not a numpy array")
                if not array.flags["C_CONTIGUOUS"]:
                    raise popart_exception(
                        f"PyStepIO is unable to use the numpy {kind} array for tensor '{name}' as it is not "
                        "c-contiguous (a data conversion on a view of the array would leave the data unchanged)"
                    )
        self.inputs, self.outputs = inputs, outputs
        self.runtime_asserts = True

    def enableRuntimeAsserts(self, enabled: bool) -> None:  # noqa: N802
        self.runtime_asserts = enabled


_DEFAULT_USER_OPTIONS = SessionOptions()  # evaluated at import, as in the real module


def _initializer_bytes(model) -> int:
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for g in _graphs(model.graph) for t in g.initializer)


class InferenceSession:
    def __init__(self, fnModel, dataFlow, deviceInfo, inputShapeInfo=None, patterns=None,  # noqa: N803
                 userOptions=_DEFAULT_USER_OPTIONS, name="inference") -> None:  # noqa: N803  # fmt: skip
        _log("InferenceSession.__init__", fnModel_type=type(fnModel).__name__,
             dataFlow_type=type(dataFlow).__name__, deviceInfo_type=type(deviceInfo).__name__,
             default_options=userOptions is _DEFAULT_USER_OPTIONS,
             options=userOptions._fields() if isinstance(userOptions, SessionOptions) else None,
             batchesPerStep=dataFlow.batchesPerStep() if isinstance(dataFlow, DataFlow) else None,
             anchors={k: dataFlow.art(k).id().name for k in dataFlow.anchors()} if isinstance(dataFlow, DataFlow) else None,
             device=None if deviceInfo is None else {"type": deviceInfo.type.name, "numIpus": deviceInfo.numIpus,
                                                     "tilesPerIPU": deviceInfo.tilesPerIPU})  # fmt: skip
        if deviceInfo is None:
            raise popart_exception("Must pass a valid deviceInfo to InferenceSession::createFromOnnxModel")
        if not isinstance(dataFlow, DataFlow) or not isinstance(userOptions, SessionOptions):
            raise TypeError("InferenceSession(): incompatible function arguments")
        self._model = _load_model(fnModel)
        self._raw = _executable_by_onnxruntime(self._model).SerializeToString()
        self.dataFlow, self._device, self._options = dataFlow, deviceInfo, userOptions
        self._shape_info = inputShapeInfo or InputShapeInfo()
        self._check_graph()
        opts = userOptions
        if opts.replicatedGraphCount > 1 and not opts.enableReplicatedGraphs:
            raise popart_exception("enableReplicatedGraphs is false, but replicatedGraphCount > 1. "
                                   "Either enable replication, or set the replicated graph count to 1")  # fmt: skip
        local = opts.replicatedGraphCount if opts.enableReplicatedGraphs else 1
        if opts.enableReplicatedGraphs and local == 1:
            raise popart_exception("Local replicated graphs enabled but replication factor is 1")
        if deviceInfo.numIpus % local:
            raise popart_exception(
                "For replicated graphs, the number of IPUs must be divisible by the replication factor."
            )
        if opts.virtualGraphMode is VirtualGraphMode.Off and local != deviceInfo.numIpus:
            raise popart_exception(f"If virtual graphs are disabled, the replicated graph count ({local}) needs to be "
                                   f"equal to the number of IPUs ({deviceInfo.numIpus})")  # fmt: skip
        if opts.enableDistributedReplicatedGraphs:
            if deviceInfo.type is not DeviceType.Ipu and deviceInfo.type is not DeviceType.OfflineIpu:
                raise popart_exception(
                    "Only IPU Hardware devices supported with distributed replicated graphs."
                )
            if opts.globalReplicaOffset >= opts.globalReplicationFactor:
                raise popart_exception(f"Global replica offset: {opts.globalReplicaOffset}, is larger than global "
                                       f"replication factor: {opts.globalReplicationFactor}")  # fmt: skip
            if local > opts.globalReplicationFactor:
                raise popart_exception(f"Invalid local replication factor: {local}, larger than global replication "
                                       f"factor: {opts.globalReplicationFactor}")  # fmt: skip
        self.replicationFactor = local
        self.accumulationFactor = 1
        self._executable = None
        self._prepared = False

    # -- graph checks --------------------------------------------------------------------------------------

    def _check_graph(self) -> None:
        model = self._model
        for opset in model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version > 11 and self._options.strictOpVersions:
                raise popart_exception(
                    "Internal error encounterd when checking op version against opset. Could not find domain "
                    f"and version ai.onnx {opset.version} in opsets"
                )
        supported = _supported_types()
        for graph in _graphs(model.graph):
            for node in graph.node:
                if node.domain in ("", "ai.onnx") and node.op_type not in supported:
                    raise popart_exception(f"No class for ai.onnx.{node.op_type}:11")
        initializers = {t.name for t in model.graph.initializer}
        self._inputs, self._outputs = {}, {}
        for value in model.graph.input:
            if value.name in initializers:
                continue
            dims = value.type.tensor_type.shape.dim
            if self._shape_info.has(value.name):
                info = self._shape_info.get(value.name)
            else:
                for dim in dims:
                    if not dim.HasField("dim_value"):
                        raise popart_exception(
                            f"Input tensor '{value.name}' must be specified in InputShapeInfo, as it has shape "
                            f"{[d.dim_value or d.dim_param for d in dims]}, which uses an unknown value "
                            f"'{dim.dim_param}'"
                        )
                info = TensorInfo(
                    _ONNX_TO_POPART[value.type.tensor_type.elem_type], [d.dim_value for d in dims]
                )
            self._inputs[value.name] = info
        for value in model.graph.output:
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            self._outputs[value.name] = TensorInfo(_ONNX_TO_POPART[value.type.tensor_type.elem_type], dims)
        for name in self.dataFlow.anchors():
            if name not in self._outputs:
                raise popart_exception(f"Anchor tensor `{name}' is not a tensor of the model")

    # -- preparing -----------------------------------------------------------------------------------------

    def _cache_file(self) -> str | None:
        opts, device = self._options, self._device
        if not opts.enableEngineCaching or device.type not in (DeviceType.Ipu, DeviceType.OfflineIpu):
            return None
        # The key hashes the IR without initializer values, as PopART's does.
        from onnx import numpy_helper  # noqa: F401

        stripped = type(self._model)()
        stripped.CopyFrom(self._model)
        for graph in _graphs(stripped.graph):
            for tensor in graph.initializer:
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data"):
                    tensor.ClearField(field)
        fields = {k: v for k, v in opts._fields().items() if k not in ("cachePath", "globalReplicaOffset")}
        digest = hashlib.sha256()
        digest.update(stripped.SerializeToString())
        digest.update(repr(sorted((k, repr(v)) for k, v in fields.items())).encode())
        digest.update(repr((self.dataFlow.batchesPerStep(), sorted(self.dataFlow.anchors()), device.numIpus,
                            device.tilesPerIPU, device.ipuVersion, versionString())).encode())  # fmt: skip
        return os.path.join(opts.cachePath, f"{digest.hexdigest()[:32]}.popef")

    def prepareDevice(self, loadEngine: bool = True) -> None:  # noqa: N802, N803
        _log("InferenceSession.prepareDevice", loadEngine=loadEngine)
        for name, info in {**self._inputs, **self._outputs}.items():
            if info.data_type() not in _DEVICE_TYPES:
                raise popart_exception(
                    f"The data type {info.data_type()} is not supported in Poplar (tensor {name})"
                )
        _fault("prepareDevice")
        cache_file = self._cache_file()
        model_bytes = self._raw
        if cache_file and os.path.exists(cache_file):
            with open(cache_file, "rb") as stream:
                header = stream.readline()
                model_bytes = stream.read()  # the cached binary: its constant weights win
            _log("cache_hit", path=cache_file, header=header.decode().strip())
        else:
            self._check_memory()
            if cache_file:
                os.makedirs(os.path.dirname(cache_file), exist_ok=True)
                with open(cache_file, "wb") as stream:
                    stream.write(b"POPEF-DOUBLE " + versionString().encode() + b"\n" + self._raw)
                _log("cache_write", path=cache_file)
        import onnxruntime

        self._executable = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
        self._prepared = True
        self._device._loaded = None  # prepare resets the marker
        if loadEngine:
            self.loadEngineAndConnectStreams()

    def _check_memory(self) -> None:
        limit = _config().get("memory_bytes_per_ipu")
        if limit is None:
            return
        limit = float(limit) * self._device.tilesPerIPU / FULL_TILES
        ipus_per_replica = self._device.numIpus // self.replicationFactor
        needed = _initializer_bytes(self._model) / ipus_per_replica
        if needed > limit:
            raise OutOfMemoryException(
                f"Out of memory on tile 0: {int(needed)} bytes of weights per IPU, {int(limit)} available"
            )

    def loadEngineAndConnectStreams(self) -> None:  # noqa: N802
        if self._device.type is DeviceType.OfflineIpu:
            raise popart_exception("Trying to load an engine on an offline device")
        if not self._prepared:
            raise popart_exception(
                "Trying to load an engine but no compiled engine. Did you forget to call prepareDevice()?"
            )
        if not self._device.isAttached:
            if self._device.connectionType is DeviceConnectionType.OnDemand:
                self._device.attach()
            else:
                raise popart_exception("Failed to attach to device")
        _log("InferenceSession.loadEngineAndConnectStreams", device=self._device.id)
        self._device._loaded = self

    def weightsFromHost(self) -> None:  # noqa: N802
        _log("InferenceSession.weightsFromHost")
        if not self._prepared:
            raise popart_exception("Devicex::prepare() must be called before Devicex::weightsFromHost()")
        if self._device._loaded is not self:
            self.loadEngineAndConnectStreams()

    def weightsToHost(self) -> None:  # noqa: N802
        pass

    def _prefix(self) -> list[int]:
        bps, replicas = self.dataFlow.batchesPerStep(), self.replicationFactor
        return [d for d in (bps, replicas) if d != 1]

    def initAnchorArrays(self) -> dict:  # noqa: N802
        _log("InferenceSession.initAnchorArrays")
        arrays = {}
        for name in self.dataFlow.anchors():
            info = self._outputs[name]
            art = self.dataFlow.art(name)
            if art.id() in (AnchorReturnTypeId.Final, AnchorReturnTypeId.Sum):
                prefix = [d for d in (self.replicationFactor,) if d != 1]
            else:
                prefix = self._prefix()
            arrays[name] = np.empty(prefix + info.shape(), dtype=info.numpy_dtype())
        return arrays

    def getInfo(self, tensorId: str) -> TensorInfo:  # noqa: N802, N803
        return {**self._inputs, **self._outputs}[tensorId]

    def getAllTensorIds(self) -> list[str]:  # noqa: N802
        return [*self._inputs, *self._outputs]

    def getCycleCount(self, id: str = "") -> int:  # noqa: N802, A002
        return 0

    def compileAndExport(self, filename: str) -> None:  # noqa: N802
        if self._device.type not in (DeviceType.Ipu, DeviceType.OfflineIpu):
            raise popart_exception(f"Executables for device type {self._device.type.name} cannot be saved")
        self._check_memory()
        path = os.path.join(filename, "executable.popef") if os.path.isdir(filename) else filename
        with open(path, "wb") as stream:
            stream.write(b"POPEF-DOUBLE " + versionString().encode() + b"\n" + self._raw)

    # -- running -------------------------------------------------------------------------------------------

    def run(self, stepio, debugName: str = "") -> None:  # noqa: N803
        if not isinstance(stepio, PyStepIO):
            raise TypeError("run(): incompatible function arguments: expected a PyStepIO")
        _log("InferenceSession.run", inputs={k: {"shape": list(v.shape), "dtype": str(v.dtype),
             "c_contiguous": bool(v.flags["C_CONTIGUOUS"])} for k, v in stepio.inputs.items()},
             outputs={k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in stepio.outputs.items()})  # fmt: skip
        if self._device.type is DeviceType.OfflineIpu:
            raise popart_exception("Offline IPU device is not configured for execution")
        if not self._prepared:
            raise popart_exception("Must call prepareDevice before run")
        if self._device._loaded is not self:  # switching happens inside run
            self.loadEngineAndConnectStreams()
        _fault("run")
        bps, replicas = self.dataFlow.batchesPerStep(), self.replicationFactor
        feeds = {}
        for name in stepio.inputs:
            if name not in self._inputs:
                raise popart_runtime_error(f"The tensor '{name}' provided in PyStepIO is not registered as one of the "
                                           "inputs to the model")  # fmt: skip
        for name, info in self._inputs.items():
            if name not in stepio.inputs:
                raise popart_runtime_error(f"No tensor {name} provided in PyStepIO's inputs")
            array = stepio.inputs[name]
            expected = info.nelms() * bps * replicas
            if stepio.runtime_asserts and array.size != expected:
                raise popart_runtime_error(
                    f"Unexpected number of input elements for Tensor {name}. Expected {expected}, but received "
                    f"{array.size}. To disable this runtime assert, call PyStepIO.enableRuntimeAsserts(false). "
                    f"replication factor = {replicas}, batches per step = {bps}"
                )
            if array.dtype != info.numpy_dtype():
                if not (array.dtype == np.int64 and info.numpy_dtype() == np.int32):
                    user = TensorInfo(array.dtype, []).data_type()
                    raise popart_runtime_error(f"Type discrepancy for tensor {name}. User provided : {user} and "
                                               f"expected : {info.data_type()}")  # fmt: skip
                array = array.astype(np.int32)
            feeds[name] = array.reshape(bps, replicas, *info.shape())
        outputs = {}
        for name, info in self._outputs.items():
            if name not in stepio.outputs:
                continue
            array = stepio.outputs[name]
            if array.size != info.nelms() * bps * replicas or array.dtype != info.numpy_dtype():
                raise popart_runtime_error(
                    f"Unexpected output buffer for anchor {name}: {array.shape} {array.dtype}"
                )
            outputs[name] = array.reshape(bps, replicas, *info.shape())
        names = list(outputs)
        for step in range(bps):
            for replica in range(replicas):
                # [step, replica, ...] keeps a scalar tensor a 0-d array
                results = self._executable.run(names, {k: v[step, replica, ...] for k, v in feeds.items()})
                for name, value in zip(names, results, strict=True):
                    outputs[name][step, replica] = value


__all__ = [name for name in dir() if not name.startswith("_")]
