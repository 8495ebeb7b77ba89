"""A test double of PopART's public Python API, for CI machines without the Poplar SDK.

Written from the public sources of PopART (graphcore/popart at sdk-release-3.4): the same names,
signatures, enums, exception classes and messages. Graphs execute with
onnxruntime on the CPU (onnx's reference evaluator where onnxruntime is not installed), so results can be compared with a plain CPU run. Nothing in
optimum_ipu_backend may depend on anything here beyond the documented API.

Test controls (environment, read on every call so a test can change them while a process runs):

* ``POPART_DOUBLE_CONFIG``: a JSON file. Keys: ``ipus`` (hardware IPUs visible, default 0),
  ``ipu_version`` (``"ipu2"``), ``version`` (``"3.4.0"``), ``memory_bytes_per_ipu`` (an executable whose
  initializers exceed it per IPU raises ``OutOfMemoryException``; scaled by tiles/1472 on the IPU Model),
  ``faults``: a list of ``{"id", "at": "acquire"|"prepareDevice"|"run", "error":
  "popart_exception"|"OutOfMemoryException"|"recoverable"|"unrecoverable"|"hang"|"exit", "action":
  "IPU_RESET", "times": 1, "seconds": 3600}``; a fault fires ``times`` times per process.
  ``pybind11_enum_name`` (default true): false models a PopART built with pybind11 older than 2.3,
  whose enum values (``RecoveryAction``) have no ``name``. ``compute_threads`` (default: onnxruntime's):
  the CPU threads the double computes a run with, none of them spinning when idle; an IPU computes
  beside the host, so a benchmark sets 1 to leave a core to the host's own threads.
* ``POPART_DOUBLE_LOG``: a file the double appends one JSON line per API call to (the call log).

Every behaviour cites the graphcore/popart source it follows (sdk-release-3.4); what depends on
closed-source Poplar or PopDist says it is assumed. The double of PopDist is the sibling package
``popdist``.
"""

from __future__ import annotations

import sys

# graphcore/popart python/popart/__init__.py.in (sdk-release-3.4): refuses to import after onnx.
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
            _raise_recoverable(
                "poplar_recoverable_runtime_error: an IPU error was detected",
                RecoveryAction.__members__[fault.get("action", "IPU_RESET")],
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


# The classes popart_core registers (graphcore/popart python/popart/popart_core/popart.cpp, the
# py::exception block at the end of PYBIND11_MODULE, sdk-release-3.4): popart::runtime_error is
# popart_runtime_error, popart::error popart_exception, the poplar hierarchy as bound there.


class popart_exception(Exception):  # noqa: N801
    pass


class popart_internal_exception(popart_exception):  # noqa: N801
    pass


class popart_runtime_error(popart_exception):  # noqa: N801
    pass


class OutOfMemoryException(popart_exception):
    """graphcore/popart python/popart/python_files/session.py, OutOfMemoryException (sdk-release-3.4): a
    Python subclass of popart_exception that prepareDevice and compileAndExport raise when the
    OutOfMemoryError status they pass to the core is not successful."""

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


class _Pybind11Enum:
    """A ``py::enum_`` value as pybind11 2.6.2 binds it (pybind/pybind11 include/pybind11/pybind11.h,
    enum_base::init, v2.6.2; graphcore/popart README.md asks for pybind11 2.6.2 and build_scripts/
    CMakeLists.txt pins v2.4.3+8, sdk-release-3.4): ``name`` is a property (it exists since pybind11
    2.3.0), ``str()`` is ``"Type.NAME"``, ``repr()`` ``"<Type.NAME: value>"``, ``int()`` the value;
    members are class attributes and ``Type.__members__`` maps names to them. Unlike Python's
    ``enum.Enum`` there is no ``Type["NAME"]``."""

    _members: dict = {}

    def __init__(self, value: int, name: str) -> None:
        self._value, self._name = value, name

    @property
    def name(self) -> str:
        return self._name

    @property
    def value(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self._name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self._name}: {self._value}>"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    @classmethod
    def _define(cls, **values: int) -> None:
        cls.__members__ = {}
        for name, value in values.items():
            member = cls(value, name)
            setattr(cls, name, member)
            cls.__members__[name] = member


class RecoveryAction(_Pybind11Enum):
    """graphcore/popart python/popart/popart_core/popart.cpp, py::enum_<poplar::RecoveryAction>
    "RecoveryAction" (sdk-release-3.4)."""


RecoveryAction._define(IPU_RESET=0, LINK_RESET=1, PARTITION_RESET=2, FULL_RESET=3)


class poplar_recoverable_runtime_error(poplar_system_runtime_error):  # noqa: N801
    """graphcore/popart python/popart/popart_core/popart.cpp, recoverable_exception::setRecoveryAction
    (sdk-release-3.4): the exception translator sets ``recoveryAction`` with PyObject_SetAttrString on
    the exception *type*, then the message; an instance reads the class attribute, which holds the
    action of the most recent error."""

    recoveryAction = RecoveryAction.IPU_RESET


class _Pybind11PreNameEnumValue:
    """A ``py::enum_`` value as pybind11 before 2.3 binds it (pybind/pybind11 include/pybind11/
    pybind11.h, enum_, v2.2.4): ``__repr__`` (and so ``str()``) is ``"Type.NAME"``, ``int()`` the value,
    and there is no ``name``. Used only when the test configuration asks for such a build
    (``"pybind11_enum_name": false``); the SDK's pinned pybind11 has ``name``."""

    def __init__(self, member: _Pybind11Enum) -> None:
        self._member = member

    def __int__(self) -> int:
        return int(self._member)

    def __repr__(self) -> str:
        return str(self._member)


def _raise_recoverable(message: str, action: RecoveryAction) -> None:
    value = action if _config().get("pybind11_enum_name", True) else _Pybind11PreNameEnumValue(action)
    poplar_recoverable_runtime_error.recoveryAction = value
    raise poplar_recoverable_runtime_error(message)


class poplar_unrecoverable_runtime_error(poplar_system_runtime_error):  # noqa: N801
    pass


class poplar_unknown_runtime_error(poplar_system_runtime_error):  # noqa: N801
    pass


# ---------------------------------------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------------------------------------


class DeviceType(_Pybind11Enum):
    """graphcore/popart python/popart/popart_core/popart.cpp, py::enum_<DeviceType> (sdk-release-3.4):
    its ``__str__`` is replaced by DeviceType's operator<< (willow/src/devicemanager.cpp): "ipu",
    "ipu-model", "offline-ipu", "cpu", "sim"; ``name`` stays the member name."""

    def __str__(self) -> str:
        return {"Ipu": "ipu", "IpuModel": "ipu-model", "OfflineIpu": "offline-ipu"}.get(
            self.name, self.name.lower()
        )


DeviceType._define(IpuModel=0, Cpu=1, Ipu=2, OfflineIpu=3, Sim=4)


class DeviceConnectionType(_Pybind11Enum):
    """graphcore/popart python/popart/popart_core/popart.cpp, py::enum_<DeviceConnectionType>."""


DeviceConnectionType._define(Always=0, OnDemand=1, Never=2)


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

# graphcore/popart willow/src/tensorinfo.cpp, initDataTypeInfoMap (sdk-release-3.4): each DataType's
# name (TensorInfo.data_type()) and lower-case name (TensorInfo.data_type_lcase(), which
# python/popart/python_files/session.py _initAnchorArrays hands to numpy as the anchor dtype). FLOAT's
# lower-case name is "float32", DOUBLE's "float64".
_DATA_TYPE_NAMES = {
    "UINT8": "uint8", "INT8": "int8", "UINT16": "uint16", "INT16": "int16", "INT32": "int32",
    "INT64": "int64", "UINT32": "uint32", "UINT64": "uint64", "BOOL": "bool", "FLOAT16": "float16",
    "BFLOAT16": "bfloat16", "FLOAT8_143": "float8_143", "FLOAT8_152": "float8_152", "FLOAT": "float32",
    "DOUBLE": "float64", "COMPLEX64": "complex64", "COMPLEX128": "complex128", "STRING": "string",
    "UNDEFINED": "undefined",
}  # fmt: skip
# graphcore/popart python/popart/python_files/tensorinfo.py, _get_popart_type (sdk-release-3.4): the
# numpy types a TensorInfo can be built from.
_NUMPY_TO_POPART = {
    np.uint8: "UINT8", np.uint16: "UINT16", np.uint32: "UINT32", np.uint64: "UINT64", np.int8: "INT8",
    np.int16: "INT16", np.int32: "INT32", np.int64: "INT64", np.float16: "FLOAT16", np.float32: "FLOAT",
    np.float64: "DOUBLE", np.bool_: "BOOL",
}  # fmt: skip
# graphcore/popart willow/src/onnxutil.cpp, getDataType: ONNX TensorProto element types.
_ONNX_TO_POPART = {1: "FLOAT", 10: "FLOAT16", 6: "INT32", 7: "INT64", 12: "UINT32", 5: "INT16", 4: "UINT16",
                   3: "INT8", 2: "UINT8", 9: "BOOL", 11: "DOUBLE", 13: "UINT64", 16: "BFLOAT16"}  # fmt: skip
# graphcore/popart willow/src/popx/irlowering.cpp, popType (sdk-release-3.4): the types Poplar streams;
# the others raise "The data type X is not supported in Poplar" when lowered.
_DEVICE_TYPES = {"FLOAT", "FLOAT16", "INT32", "UINT32", "INT16", "UINT16", "INT8", "UINT8", "BOOL",
                 "FLOAT8_143", "FLOAT8_152"}  # fmt: skip


def _data_type_from_string(name: str) -> str:
    """graphcore/popart willow/src/tensorinfo.cpp, dataTypeFromString: exact (upper-case) names only."""
    if name not in _DATA_TYPE_NAMES:
        raise popart_exception(f"no ONNX type {name}, they're [{', '.join(sorted(_DATA_TYPE_NAMES))}].")
    return name


class TensorInfo:
    """graphcore/popart python/popart/python_files/tensorinfo.py, TensorInfo (sdk-release-3.4):
    ``TensorInfo(dtype, shape)`` with a PopART type string, a numpy dtype or type, or
    ``TensorInfo(ndarray)``; anything else raises TypeError."""

    def __init__(self, *args) -> None:
        if len(args) == 2:
            dtype, shape = args
        elif len(args) == 1 and isinstance(args[0], np.ndarray):
            dtype, shape = args[0].dtype, args[0].shape
        else:
            raise TypeError(f"Can not create TensorInfo with args {args}")
        if isinstance(dtype, np.dtype):
            dtype = _NUMPY_TO_POPART[dtype.type]
        elif isinstance(dtype, type):
            dtype = _NUMPY_TO_POPART[dtype]
        self._type = _data_type_from_string(dtype)
        self._shape = [int(d) for d in shape]

    def shape(self) -> list[int]:
        return list(self._shape)

    def data_type(self) -> str:
        return self._type

    def data_type_lcase(self) -> str:
        return _DATA_TYPE_NAMES[self._type]

    def nelms(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def _numpy_dtype(self) -> np.dtype:
        """The double's own helper (not SDK API): the numpy dtype of the host buffers."""
        return np.dtype(self.data_type_lcase())


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


# graphcore/popart willow/include/popart/sessionoptions.hpp, struct SessionOptions member initialisers
# (sdk-release-3.4); the option maps are the Python properties python/popart/__init__.py.in defines.
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
    """graphcore/popart python/popart/popart_core/popart.cpp, py::class_<SessionOptions> (no
    py::dynamic_attr, sdk-release-3.4): setting an unknown attribute raises AttributeError."""

    def __init__(self) -> None:
        for name, value in _OPTION_DEFAULTS.items():
            object.__setattr__(self, name, dict(value) if isinstance(value, dict) else value)
        # graphcore/popart willow/include/popart/sessionoptions.hpp, SessionOptions::SessionOptions()
        # (sdk-release-3.4): a set POPART_CACHE_DIR, then a set POPXL_CACHE_DIR (which wins), turns
        # enableEngineCaching on with that cachePath; "set" is getenv() != NULL, so "" counts too.
        for variable in ("POPART_CACHE_DIR", "POPXL_CACHE_DIR"):
            if variable in os.environ:
                object.__setattr__(self, "enableEngineCaching", True)
                object.__setattr__(self, "cachePath", os.environ[variable])

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
    """graphcore/popart python/popart/popart_core/popart.cpp, py::class_<DeviceInfo> (read-only
    properties type, connectionType, version, ipuVersion, id, numIpus, tilesPerIPU, driverIds, isAttached;
    ``__exit__`` detaches), with the subclasses of willow/include/popart/popx/devicexmanager.hpp
    (sdk-release-3.4) behind it."""

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
        # devicexmanager.hpp, DevicexOfflineIpuInfo::attach: "Cannot attach to offline device".
        if self.type is DeviceType.OfflineIpu:
            raise popart_exception("Cannot attach to offline device")
        # devicexmanager.cpp, DevicexInfo::attach: isAttached_ = poplar::Device::attach(). Assumed (Poplar
        # is closed source): attaching hardware IPUs another device holds returns False, as
        # DeviceManager::tryAcquireAvailableDevice's loop over candidates relies on.
        if self.type is DeviceType.Ipu and not self.isAttached and not DeviceManager()._claim(self):
            return False
        self.isAttached = True
        _log("DeviceInfo.attach", id=self.id, numIpus=self.numIpus)
        return True

    def tryAttachUntilTimeout(self) -> bool:  # noqa: N802
        """willow/src/devicemanager.cpp, DeviceInfo::tryAttachUntilTimeout: one try, then one a second
        until the on-demand timeout (the double does not wait)."""
        return self.attach()

    def detach(self) -> None:
        # devicexmanager.hpp, DevicexOfflineIpuInfo::detach: "Cannot detach from offline device".
        if self.type is DeviceType.OfflineIpu:
            _log("DeviceInfo.detach", id=self.id, type=self.type.name, refused=True)
            raise popart_exception("Cannot detach from offline device")
        # devicexmanager.cpp, DevicexInfo::detach: isAttached_ = false, poplar::Device::detach(); the
        # most-recently-loaded marker is left as it is.
        if self.type is DeviceType.Ipu and self.isAttached:
            DeviceManager()._release(self)
        self.isAttached = False
        _log("DeviceInfo.detach", id=self.id, type=self.type.name, numIpus=self.numIpus)

    def __enter__(self) -> DeviceInfo:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        # willow/src/devicemanager.cpp, DeviceInfo::toString
        return (f"Device Type:{self.type} Connection Type:{_CONNECTION_NAMES[self.connectionType.name]} "
                f"Id:{self.id} Version:{self.version} NumIPUs:{self.numIpus} NumTilesPerIPU:{self.tilesPerIPU} "
                f"DeviceIds: {{{','.join(str(i) for i in self.driverIds)}}}")  # fmt: skip


# willow/src/devicemanager.cpp, operator<<(DeviceConnectionType)
_CONNECTION_NAMES = {"Always": "always", "OnDemand": "on-demand", "Never": "never"}


def _host_device_options(kind: DeviceType, options: dict, valid: list[str]) -> dict[str, str]:
    """python/popart/popart_core/popart.cpp, getDictionary: keys and values are streamed as str(); then
    willow/src/popx/devicexmanager.cpp, DevicexManager::createHostDevice's checkOptions."""
    if not isinstance(options, dict):
        raise TypeError("incompatible function arguments: expected a dict")
    strings = {str(key): str(value) for key, value in options.items()}
    for key in strings:
        if key not in valid:
            raise popart_exception(
                f"Invalid option `{key}' passed to DevicexManager::createHostDevice for device type {kind}. "
                f"Valid options are [{' '.join(valid)}]"
            )
    return strings


class DeviceManager:
    """willow/src/devicemanager.cpp (sdk-release-3.4), a singleton (popart.cpp binds it with
    py::nodelete). The hardware is the double's configuration: ``ipus`` IPUs, numbered from 0."""

    _instance = None

    def __new__(cls) -> DeviceManager:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._attached = set()
            cls._instance._timeout = 0
        return cls._instance

    def _hardware(self) -> int:
        return int(_config().get("ipus", 0))

    def _claim(self, device: DeviceInfo) -> bool:
        if set(device.driverIds) & self._attached:
            return False
        self._attached |= set(device.driverIds)
        return True

    def _release(self, device: DeviceInfo) -> None:
        self._attached -= set(device.driverIds)

    def _groups(self, numIpus: int) -> list[list[int]]:  # noqa: N803
        """Assumed (Poplar's device list is closed source): groups of ``numIpus`` IPUs aligned on
        multiples of ``numIpus``, as gc-info lists them."""
        total = self._hardware()
        return [list(range(start, start + numIpus)) for start in range(0, total - numIpus + 1, numIpus)]

    def enumerateDevices(self, pattern=SyncPattern.Full, numIpus=1, deviceType=DeviceType.Ipu,  # noqa: N802, N803
                         connectionType=DeviceConnectionType.Always, tilesPerIPU=0) -> list[DeviceInfo]:  # noqa: N803  # fmt: skip
        _log("DeviceManager.enumerateDevices", numIpus=numIpus)
        version = _config().get("ipu_version", "ipu2")
        return [DeviceInfo(DeviceType.Ipu, numIpus, FULL_TILES, ids, version, connectionType)
                for ids in self._groups(numIpus)]  # fmt: skip

    def tryAcquireAvailableDevice(self, numIpus=1, tilesPerIpu=0, pattern=SyncPattern.Full,  # noqa: N802, N803
                                  connectionType=DeviceConnectionType.Always,  # noqa: N803
                                  selectionCriterion=DeviceSelectionCriterion.First):  # noqa: N803  # fmt: skip
        """devicemanager.cpp, DeviceManager::tryAcquireAvailableDevice: a count that is not a power of two
        is refused first, then connectionType Never; each candidate is attached (Always) or returned
        unattached (OnDemand); None when none could be attached."""
        _log("DeviceManager.acquireAvailableDevice", numIpus=numIpus, type=type(numIpus).__name__,
             connectionType=getattr(connectionType, "name", connectionType))  # fmt: skip
        if numIpus > 0 and numIpus & (numIpus - 1):
            raise popart_exception(
                f"You have attempted to acquire {numIpus} IPUs. The number of IPUs requested must be a power of two"
            )
        if connectionType is DeviceConnectionType.Never:
            raise popart_exception(
                "Trying to acquire a hardware device when connectionType is DeviceConnectionType::Never"
            )
        _fault("acquire")
        for device in self.enumerateDevices(pattern, numIpus, DeviceType.Ipu, connectionType, tilesPerIpu):
            if tilesPerIpu and tilesPerIpu != device.tilesPerIPU:
                continue
            if connectionType is not DeviceConnectionType.Always or device.attach():
                return device
        return None

    def acquireAvailableDevice(self, numIpus=1, tilesPerIpu=0, pattern=SyncPattern.Full,  # noqa: N802, N803
                               connectionType=DeviceConnectionType.Always,  # noqa: N803
                               selectionCriterion=DeviceSelectionCriterion.First) -> DeviceInfo:  # noqa: N803  # fmt: skip
        """devicemanager.cpp, DeviceManager::acquireAvailableDevice."""
        device = self.tryAcquireAvailableDevice(
            numIpus, tilesPerIpu, pattern, connectionType, selectionCriterion
        )
        if device is None:
            raise popart_exception(
                f"Failed to acquire device with {numIpus} IPUs. Ensure that there are sufficient IPUs available. "
                "If you have enabled the Poplar SDK you can check device availability with the `gc-monitor` "
                "command-line utility."
            )
        return device

    def tryAcquireDeviceById(self, id: int, pattern=SyncPattern.Full,  # noqa: N802, A002
                             connectionType=DeviceConnectionType.Always):  # noqa: N803  # fmt: skip
        """devicemanager.cpp, DeviceManager::tryAcquireDeviceById. Device ids are Poplar's (closed
        source); assumed: 0..n-1 are the single IPUs, and the double numbers a group of ``size`` IPUs
        from ``start`` as ``1000 * size + start`` (gc-info gives groups the ids after n)."""
        if connectionType is DeviceConnectionType.Never:
            raise popart_exception(
                "Trying to acquire a hardware device when connectionType is DeviceConnectionType::Never"
            )
        size, start = (id // 1000, id % 1000) if id >= 1000 else (1, id)
        _log("DeviceManager.acquireDeviceById", id=id, numIpus=size)
        _fault("acquire")
        if id < 0 or start + size > self._hardware() or start % size:
            # Assumed: poplar::DeviceManager::getDevice refuses an id it does not know.
            raise poplar_exception(f"Invalid device ID {id}")
        device = DeviceInfo(DeviceType.Ipu, size, FULL_TILES, list(range(start, start + size)),
                            _config().get("ipu_version", "ipu2"), connectionType)  # fmt: skip
        if connectionType is DeviceConnectionType.Always and not device.attach():
            return None
        return device

    def acquireDeviceById(self, id: int, pattern=SyncPattern.Full,  # noqa: N802, A002
                          connectionType=DeviceConnectionType.Always) -> DeviceInfo:  # noqa: N803  # fmt: skip
        """devicemanager.cpp, DeviceManager::acquireDeviceById."""
        device = self.tryAcquireDeviceById(id, pattern, connectionType)
        if device is None:
            raise popart_exception(
                f"Failed to acquire device with id '{id}'. Ensure it is available. If you have enabled the Poplar "
                "SDK you can check device availability with the `gc-monitor` command-line utility."
            )
        return device

    def createCpuDevice(self) -> DeviceInfo:  # noqa: N802
        _log("DeviceManager.createCpuDevice")
        return DeviceInfo(DeviceType.Cpu, 1, 1)

    def createIpuModelDevice(self, options: dict) -> DeviceInfo:  # noqa: N802
        """devicexmanager.cpp, DevicexManager::createHostDevice, IpuModel: tilesPerIPU defaults to
        defaultFewTiles (4, willow/include/popart/defaulttilecount.hpp); numIPUs and ipuVersion to the
        poplar::IPUModel defaults (closed source; assumed 1 and "ipu2"). The device is not attached
        (DevicexInfo::isAttached_ starts false and nothing in PopART attaches a model)."""
        strings = _host_device_options(
            DeviceType.IpuModel, options, ["numIPUs", "tilesPerIPU", "compileIPUCode", "ipuVersion"]
        )
        _log("DeviceManager.createIpuModelDevice", options=options,
             types={k: type(v).__name__ for k, v in options.items()})  # fmt: skip
        version = strings.get("ipuVersion", "ipu2")
        return DeviceInfo(DeviceType.IpuModel, int(strings.get("numIPUs", 1)),
                          int(strings.get("tilesPerIPU", 4)), version=version)  # fmt: skip

    def createOfflineIPUDevice(self, opts: dict) -> DeviceInfo:  # noqa: N802
        """devicexmanager.cpp, DevicexManager::createHostDevice, OfflineIpu: a poplar Target of numIPUs
        (default 1) full-size IPUs of ipuVersion (default "ipu2"); tilesPerIPU is accepted and not used.
        DevicexOfflineIpuInfo: connection type Never, id 0, version "<offline-ipu>", never attached."""
        strings = _host_device_options(
            DeviceType.OfflineIpu,
            opts,
            ["numIPUs", "tilesPerIPU", "ipuVersion", "syncPattern", "gatewayMode"],
        )
        _log("DeviceManager.createOfflineIPUDevice", options=opts)
        device = DeviceInfo(DeviceType.OfflineIpu, int(strings.get("numIPUs", 1)), FULL_TILES, ids=[0],
                            version="<offline-ipu>", connectionType=DeviceConnectionType.Never)  # fmt: skip
        device.ipuVersion = strings.get("ipuVersion", "ipu2")
        return device

    def setOnDemandAttachTimeout(self, attachTimeout: int) -> None:  # noqa: N802, N803
        self._timeout = attachTimeout


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


# Index outputs PopART computes as INT32 (graphcore/popart willow/src/op/argextrema.cpp,
# ArgExtremaOp::setup and willow/src/op/topk.cpp, TopKOp::setup set INT32 indices), where onnxruntime's
# kernels produce int64: (op type, output position).
_INT32_INDEX_OUTPUTS = {"ArgMax": 0, "ArgMin": 0, "TopK": 1}


def _executable_by_onnxruntime(model):
    """The graph as the double executes it: int32 shape operands go back to int64 for onnxruntime, and
    the int64 indices onnxruntime computes are cast to the int32 PopART produces."""
    import onnx
    from onnx import helper, numpy_helper

    model = type(model).FromString(model.SerializeToString())
    for graph in _graphs(model.graph):
        # PopART infers each intermediate tensor's type from its ops' setup(), not from value_info (which
        # convertINT64ToINT32 leaves as it is); onnxruntime would check the stale entries.
        graph.ClearField("value_info")
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


# -- Variables and CopyVarUpdate (carried state) -----------------------------------------------------------

# graphcore/popart willow/src/defs.cpp, the ai.graphcore CopyVarUpdate v1 schema (float, int32, float16,
# bool) and willow/src/op/copyvarupdate.cpp, copyVarUpdateOpDef (UINT32, INT32, FLOAT16, FLOAT): the types
# both allow (sdk-release-3.4).
_COPY_VAR_UPDATE_TYPES = ("FLOAT", "FLOAT16", "INT32")
# The output the executed copy of a graph gives for a variable's value after a run (the double's own).
_NEXT_VALUE = "popart_double_next_value::"


def _copy_var_updates(graph) -> list:
    return [node for node in graph.node if node.domain == "ai.graphcore" and node.op_type == "CopyVarUpdate"]


def _poisoned(info: TensorInfo) -> np.ndarray:
    """What a variable holds on the device before any weightsFromHost and after another engine was
    loaded: undefined. Assumed (Poplar, closed source: nothing in PopART's Devicex writes variables on a
    load); the double makes it NaN (the lowest integer for integer types) so that a run that relies on it
    fails a comparison."""
    dtype = info._numpy_dtype()
    if dtype.kind == "f":
        return np.full(info.shape(), np.nan, dtype)
    if dtype.kind == "b":
        return np.ones(info.shape(), dtype)
    return np.full(info.shape(), np.iinfo(dtype).min, dtype)


def _shape_operands(graph) -> set:
    """Initializers an op reads when it is created (a Reshape's shape, ...): OpCreatorInfo::
    getInputTensorData (willow/src/opmanager.cpp) reads the tensor's data then, Variables included, so
    their values are fixed at compile time whatever is written later."""
    names = set()
    for node in graph.node:
        for position in _INT64_INPUTS.get(node.op_type, ()):
            if position < len(node.input) and node.input[position]:
                names.add(node.input[position])
    return names


def _variables_as_inputs(model, variables: dict, baked: set):
    """The graph as the double executes it with Variables: each variable (but those fixed at compile time)
    is an input fed from the device's copy, CopyVarUpdate returns its updater (its alias of the updated
    variable, CopyVarUpdateOpx::grow), and each updated variable's new value is the extra output
    ``_NEXT_VALUE + name``. Feeding the old values to every reader is what Graph::setVarUpdateConstraints
    (willow/src/graph.cpp) guarantees: readers of a variable run before its update."""
    from onnx import helper

    model = type(model).FromString(model.SerializeToString())
    graph = model.graph
    updates = {node.input[0]: node.input[1] for node in _copy_var_updates(graph)}
    nodes = [
        helper.make_node("Identity", [node.input[1]], [node.output[0]])
        if node.domain == "ai.graphcore" and node.op_type == "CopyVarUpdate"
        else node
        for node in graph.node
    ]
    fed = [tensor for tensor in graph.initializer if tensor.name in variables and tensor.name not in baked]
    fed_names = {tensor.name for tensor in fed}
    kept = [tensor for tensor in graph.initializer if tensor.name not in fed_names]
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    listed = {value.name for value in graph.input}
    for tensor in fed:
        if tensor.name not in listed:
            graph.input.append(
                helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
            )
    for variable, updater in updates.items():
        graph.node.append(helper.make_node("Identity", [updater], [_NEXT_VALUE + variable]))
        info = variables[variable]
        graph.output.append(helper.make_tensor_value_info(
            _NEXT_VALUE + variable, next(k for k, v in _ONNX_TO_POPART.items() if v == info.data_type()),
            info.shape()))  # fmt: skip
    imports = [entry for entry in model.opset_import if entry.domain != "ai.graphcore"]
    model.ClearField("opset_import")
    model.opset_import.extend(imports)
    return model


def _load_model(fnModel):  # noqa: N803
    import onnx

    try:
        if isinstance(fnModel, str) and os.path.isfile(fnModel):
            # External-data locations are resolved against the process CWD, as the real loader does.
            model = onnx.load(fnModel, load_external_data=False)
            for tensor in model.graph.initializer:
                for entry in tensor.external_data:
                    # willow/src/onnxutil.cpp, ExternalTensorProtoInfo: locations are checked against
                    # the current directory (boost::filesystem::exists on the relative name)
                    if entry.key == "location" and not os.path.exists(entry.value):
                        raise popart_exception(
                            f"Unrecognised file name '{entry.value}' for externally stored tensor '{tensor.name}'"
                        )
            onnx.external_data_helper.load_external_data_for_model(model, os.getcwd())
            return model
        if isinstance(fnModel, str):
            fnModel = fnModel.encode("latin-1")
        return onnx.load_from_string(bytes(fnModel))
    except popart_exception:
        raise
    except Exception as exc:
        # willow/src/filereader.cpp, getModelFromString
        raise popart_exception(
            f"Failed to load a ModelProto from the string '{str(fnModel)[:100]}'.\nCheck that it is either a "
            f"valid path to an existing onnx model file, or is a valid onnx ModelProto string. ({exc})"
        ) from None


def _graphs(graph):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.g.node or attribute.g.output:
                yield from _graphs(attribute.g)


class GraphTransformer:
    """graphcore/popart willow/src/graphtransformer.cpp (sdk-release-3.4): built from a model file path
    or serialised ModelProto bytes (onnxutil::getModelProto)."""

    def __init__(self, modelProtoOrFilename) -> None:  # noqa: N803
        _log("GraphTransformer.__init__", arg_type=type(modelProtoOrFilename).__name__,
             is_path=isinstance(modelProtoOrFilename, str) and os.path.isfile(modelProtoOrFilename))  # fmt: skip
        self._model = _load_model(modelProtoOrFilename)

    def convertINT64ToINT32(self, clip: bool = False) -> None:  # noqa: N802
        """graphcore/popart willow/src/graphtransformer_impl.cpp, GraphTransformerImpl::convertINT64ToINT32
        and convertINT64TensorToINT32 (sdk-release-3.4): only the main graph is visited
        (willow/src/onnxutil.cpp, visitModelNodes / visitModelInitializers / visitModelValueInfos): its
        nodes' INT64 tensor attributes (a GRAPH or GRAPHS attribute is an error), its INT64 initializers,
        and the element types of its inputs and outputs (not value_info). Values beyond int32 are clipped
        with ``clip``, refused without it."""
        import onnx
        from onnx import numpy_helper

        _log("GraphTransformer.convertINT64ToINT32", clip=clip)
        info = np.iinfo(np.int32)

        def narrow(tensor):
            values = numpy_helper.to_array(tensor)
            if clip:
                values = np.clip(values, info.min, info.max)
            elif values.size and (values.max() > info.max or values.min() < info.min):
                raise popart_exception(
                    "In convertINT64TensorToINT32, cannot cast int64 to int32: number is too large. If you are "
                    "sure you want still want to convert your tensor data, you can set 'clip' to 'true'."
                )
            return numpy_helper.from_array(values.astype(np.int32), tensor.name)

        graph = self._model.graph
        for node in graph.node:
            for attribute in node.attribute:
                if (
                    attribute.type == onnx.AttributeProto.TENSOR
                    and attribute.t.data_type == onnx.TensorProto.INT64
                ):
                    attribute.t.CopyFrom(narrow(attribute.t))
                elif attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                    raise popart_exception(
                        "Attributes of type GRAPH and GRAPHS : need impl in convertINT64ToINT32"
                    )
        for index, tensor in enumerate(graph.initializer):
            if tensor.data_type == onnx.TensorProto.INT64:
                graph.initializer[index].CopyFrom(narrow(tensor))
        for value in [*graph.output, *graph.input]:
            if value.type.tensor_type.elem_type == onnx.TensorProto.INT64:
                value.type.tensor_type.elem_type = onnx.TensorProto.INT32

    def getModelProto(self) -> bytes:  # noqa: N802
        return self._model.SerializeToString()


# ---------------------------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------------------------


class PyStepIO:
    """graphcore/popart python/popart/popart_core/popart.cpp, class PyStepIO (sdk-release-3.4)."""

    def __init__(self, inputs: dict, outputs: dict) -> None:
        for kind, arrays in (("input", inputs), ("output", outputs)):
            for name, array in arrays.items():
                if not isinstance(array, np.ndarray):
                    raise TypeError(f"PyStepIO(): {kind} {name!r} is not a numpy array")
                if not array.flags["C_CONTIGUOUS"]:
                    raise popart_exception(
                        f"PyStepIO is unable to use the numpy {kind} array for tensor '{name}' as it is not "
                        "c-contiguous (a data conversion here could have a significant impact on performance "
                        "and hence is not allowed)"
                    )
        self.inputs, self.outputs = inputs, outputs
        self.runtime_asserts = True

    def enableRuntimeAsserts(self, enabled: bool) -> None:  # noqa: N802
        self.runtime_asserts = enabled


class PyWeightsIO:
    """graphcore/popart python/popart/popart_core/popart.cpp, class PyWeightsIO and its binding
    ``PyWeightsIO(weights)`` (sdk-release-3.4): a map of tensor ids to numpy arrays, each C-contiguous."""

    def __init__(self, weights: dict) -> None:
        for name, array in weights.items():
            if not isinstance(array, np.ndarray):
                raise TypeError(f"PyWeightsIO(): {name!r} is not a numpy array")
            if not array.flags["C_CONTIGUOUS"]:
                raise popart_exception(
                    "PyWeightsIO is unable to use the provided numpy output array for tensor "
                    f"'{name}' as it is not c-contiguous. Please use a function like "
                    "`numpy.ascontiguousarray()` to make contiguous before passing to PyWeightsIO"
                )
        self.weights = weights

    def contains(self, id: str) -> bool:  # noqa: A002
        return id in self.weights


_popdist_registered = False


def _popdist_backend_init() -> None:
    """graphcore/popart python/popart/python_files/_popdist_backend_manager.py, init (sdk-release-3.4):
    ``import popdist`` (a ModuleNotFoundError without it), then once per process ``popdist.init()``
    unless ``popdist.isBackendInitialized()``; PopART logs a deprecation warning when it does."""
    global _popdist_registered
    import popdist

    _log("popdist_backend_init")
    if not _popdist_registered:
        if not popdist.isBackendInitialized():
            popdist.init()
        _popdist_registered = True


# python/popart/python_files/session.py: the default userOptions argument is built at import.
_DEFAULT_USER_OPTIONS = SessionOptions()  # evaluated at import, as in the real module


def _initializer_bytes(model) -> int:
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for g in _graphs(model.graph) for t in g.initializer)


class InferenceSession:
    def __init__(self, fnModel, dataFlow, deviceInfo, inputShapeInfo=None, patterns=None,  # noqa: N803
                 userOptions=_DEFAULT_USER_OPTIONS, name="inference") -> None:  # noqa: N803  # fmt: skip
        _log("InferenceSession.__init__", cwd=os.getcwd(), fnModel_type=type(fnModel).__name__,
             dataFlow_type=type(dataFlow).__name__, deviceInfo_type=type(deviceInfo).__name__,
             default_options=userOptions is _DEFAULT_USER_OPTIONS,
             options=userOptions._fields() if isinstance(userOptions, SessionOptions) else None,
             batchesPerStep=dataFlow.batchesPerStep() if isinstance(dataFlow, DataFlow) else None,
             anchors={k: dataFlow.art(k).id().name for k in dataFlow.anchors()} if isinstance(dataFlow, DataFlow) else None,
             device=None if deviceInfo is None else {"type": deviceInfo.type.name, "numIpus": deviceInfo.numIpus,
                                                     "tilesPerIPU": deviceInfo.tilesPerIPU})  # fmt: skip
        if not isinstance(dataFlow, DataFlow) or not isinstance(userOptions, SessionOptions):
            raise TypeError("InferenceSession(): incompatible function arguments")
        # python/popart/python_files/session.py, InferenceSession.__init__ (sdk-release-3.1 onwards):
        # distributed replicated graphs make it call _popdist_backend_manager.init(), which imports
        # popdist and calls popdist.init() unless popdist.isBackendInitialized(). Without the popdist
        # package that is a ModuleNotFoundError, before the core session exists.
        if userOptions.enableDistributedReplicatedGraphs:
            _popdist_backend_init()
        # willow/src/session.cpp, InferenceSession::createFromOnnxModel
        if deviceInfo is None:
            raise popart_exception("Must pass a valid deviceInfo to InferenceSession::createFromOnnxModel")
        self._model = _load_model(fnModel)
        self.dataFlow, self._device, self._options = dataFlow, deviceInfo, userOptions
        self._shape_info = inputShapeInfo or InputShapeInfo()
        self._check_graph()
        opts = userOptions
        # willow/src/ir.cpp, Ir::verifyDistributedReplicatedGraphSettings (only with distributed graphs)
        if opts.enableDistributedReplicatedGraphs:
            if opts.globalReplicationFactor < 1:
                raise popart_exception(f"Invalid globalReplicationFactor value: {opts.globalReplicationFactor}, "
                                       "must be greater or equal than 1")  # fmt: skip
            if opts.globalReplicaOffset < 0:
                raise popart_exception(f"Invalid globalReplicaOffset value: {opts.globalReplicaOffset}, must be "
                                       "greater or equal than 0")  # fmt: skip
            if opts.globalReplicaOffset > opts.globalReplicationFactor:
                raise popart_exception(f"Global replica offset: {opts.globalReplicaOffset}, is larger than global "
                                       f"replication factor: {opts.globalReplicationFactor}")  # fmt: skip
            if opts.enableReplicatedGraphs:
                if opts.replicatedGraphCount == 1:
                    raise popart_exception("Local replicated graphs enabled but replication factor is 1")
                if opts.replicatedGraphCount > opts.globalReplicationFactor:
                    raise popart_exception(f"Invalid local replication factor: {opts.replicatedGraphCount}, larger "
                                           f"than global replication factor: {opts.globalReplicationFactor}")  # fmt: skip
        # willow/src/ir.cpp, Ir::getNumVirtualGraphIds
        if opts.enableReplicatedGraphs and deviceInfo.numIpus % opts.replicatedGraphCount:
            raise popart_exception(
                "For replicated graphs, the number of IPUs must be divisible by the replication factor."
            )
        # willow/src/popx/irlowering.cpp, IrLowering::getReplicationFactor
        if not opts.enableReplicatedGraphs and opts.replicatedGraphCount > 1:
            raise popart_exception("enableReplicatedGraphs is false, but replicatedGraphCount > 1. "
                                   "Either enable replication, or set the replicated graph count to 1")  # fmt: skip
        local = opts.replicatedGraphCount if opts.enableReplicatedGraphs else 1
        # willow/src/popx/irlowering.cpp, IrLowering::initPoplarGraph: distributed graphs need a
        # hardware-compatible device.
        if opts.enableDistributedReplicatedGraphs and deviceInfo.type not in (
            DeviceType.Ipu,
            DeviceType.OfflineIpu,
        ):
            raise popart_exception("Only IPU Hardware devices supported with distributed replicated graphs. "
                                   f"Unsupported device type {deviceInfo!r}")  # fmt: skip
        # willow/src/popx/irlowering.cpp, IrLowering::prepareGraph, virtual graphs off
        if (opts.virtualGraphMode is VirtualGraphMode.Off and deviceInfo.numIpus > 1
                and deviceInfo.numIpus != opts.replicatedGraphCount):  # fmt: skip
            raise popart_exception(f"If virtual graphs are disabled, the replicated graph count "
                                   f"({opts.replicatedGraphCount}) needs to be equal to the number of IPUs "
                                   f"({deviceInfo.numIpus})")  # fmt: skip
        self.replicationFactor = local
        self.accumulationFactor = 1
        self._setup_variables()
        self._executable = None
        self._prepared = False
        # willow/src/session.cpp, Session::configureFromOnnx: with engine caching on, the cache
        # directory is scanned now (getCacheEntries, relative to the current directory) and the IR hash
        # matched against it; prepareDevice loads a hit or writes the new .popef.
        self._cache_hit = None
        cache_file = self._cache_file()
        if cache_file is not None and os.path.isfile(cache_file):
            self._cache_hit = os.path.abspath(cache_file)

    # -- graph checks --------------------------------------------------------------------------------------

    def _check_graph(self) -> None:
        model = self._model
        for opset in model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version > 11 and self._options.strictOpVersions:
                # willow/src/opsets.cpp, getOpset: PopART 3.4 generates ai.onnx opsets 6 to 11
                raise popart_internal_exception(
                    f"Could not find domain and version ai.onnx {opset.version} in opsets. This could be due to "
                    "the generated files being out of date. Current list of domains and versions is:\n"
                    "Domain, Version\n" + "".join(f"ai.onnx, {v}\n" for v in range(6, 12))
                )
        supported = _supported_types()
        for graph in _graphs(model.graph):
            for node in graph.node:
                if node.domain in ("", "ai.onnx") and node.op_type not in supported:
                    # willow/src/opmanager.cpp, OpManager::create: the version is 0 when no opset
                    # defines the operator at all
                    raise popart_exception(f"No class for ai.onnx.{node.op_type}:0")
        initializers = {t.name for t in model.graph.initializer}
        self._inputs, self._outputs = {}, {}
        for value in model.graph.input:
            if value.name in initializers:
                continue
            dims = value.type.tensor_type.shape.dim
            if self._shape_info.has(value.name):
                info = self._shape_info.get(value.name)
            else:
                # willow/src/ir.cpp, checkForDimParams
                shape = ", ".join(d.dim_param if d.HasField("dim_param") else str(d.dim_value) for d in dims)
                for dim in dims:
                    if dim.HasField("dim_param") or dim.dim_value < 0:
                        unknown = dim.dim_param if dim.HasField("dim_param") else str(dim.dim_value)
                        raise popart_exception(
                            f"Input tensor '{value.name}' must be specified in InputShapeInfo, as it has shape "
                            f"[{shape}], which uses an unknown value '{unknown}'."
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
                raise popart_exception(
                    f"Anchor tensor `{name}' not in Ir Tensors. "
                )  # ir.cpp, validateAnchors

    # -- preparing -----------------------------------------------------------------------------------------

    def _cache_file(self) -> str | None:
        """willow/src/ir.cpp, Ir::usingEngineCache: caching on, a non-empty cachePath and an Ipu or
        OfflineIpu device (DeviceInfo::isHwCompatible); willow/src/popx/executablex.cpp,
        Executablex::getCachePath: ``"{cachePath}/{hash}.popef"`` with the decimal IR hash."""
        opts, device = self._options, self._device
        if not (opts.enableEngineCaching and opts.cachePath) or device.type not in (
            DeviceType.Ipu,
            DeviceType.OfflineIpu,
        ):
            return None
        # The key hashes the IR without initializer values, as PopART's does (session.cpp,
        # getEngineCacheHashSeed; ir.cpp, Ir::computeHash): globalReplicaOffset and cachePath are not in it.
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
        return f"{opts.cachePath}/{int(digest.hexdigest()[:16], 16)}.popef"

    def prepareDevice(self, loadEngine: bool = True) -> None:  # noqa: N802, N803
        _log("InferenceSession.prepareDevice", loadEngine=loadEngine, cwd=os.getcwd())
        # willow/src/popx/irlowering.cpp, popType
        for info in {**self._inputs, **self._outputs, **self._variables}.values():
            if info.data_type() not in _DEVICE_TYPES:
                raise popart_exception(f"The data type {info.data_type()} is not supported in Poplar")
        for variable in self._updated:
            if self._variables[variable].data_type() not in _COPY_VAR_UPDATE_TYPES:
                # Assumed where PopART checks it (no check of an OpDefinition's types was found): a type
                # outside both CopyVarUpdate definitions (see _COPY_VAR_UPDATE_TYPES) is refused.
                raise popart_exception(
                    f"CopyVarUpdate of '{variable}': type {self._variables[variable].data_type()} is not "
                    f"one of {', '.join(_COPY_VAR_UPDATE_TYPES)} (double: assumed)"
                )
        _fault("prepareDevice")
        model_bytes = self._raw
        if self._cache_hit is not None:  # session.cpp, Session::tryLoadExecutable
            with open(self._cache_hit, "rb") as stream:
                header = stream.readline()
                model_bytes = stream.read()  # the cached binary: its constant weights win
            _log("cache_hit", path=self._cache_hit, header=header.decode().strip())
        else:
            self._check_memory()
            # willow/src/popx/devicex.cpp, Devicex::prepare: the new executable is serialised to
            # Executablex::getCachePath(cachePath), resolved against the current directory now.
            cache_file = self._cache_file()
            if cache_file:
                os.makedirs(os.path.dirname(cache_file) or ".", exist_ok=True)
                with open(cache_file, "wb") as stream:
                    stream.write(b"POPEF-DOUBLE " + versionString().encode() + b"\n" + self._raw)
                _log("cache_write", path=os.path.abspath(cache_file))
        # How the double computes (not SDK behaviour): onnxruntime where it is installed, else onnx's
        # reference evaluator, so that the double also serves an SDK Python without onnxruntime
        # (tests/engines/test_worker_sdk_python.py). Both take run(output_names, feeds).
        try:
            import onnxruntime
        except ImportError:
            from onnx.reference import ReferenceEvaluator

            self._executable = ReferenceEvaluator(model_bytes)
        else:
            settings = onnxruntime.SessionOptions()
            threads = _config().get("compute_threads")
            if threads:
                settings.intra_op_num_threads = int(threads)
                settings.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._executable = onnxruntime.InferenceSession(
                model_bytes, settings, providers=["CPUExecutionProvider"]
            )
        self._prepared = True
        self._device._loaded = None  # prepare resets the marker
        self._poison_variables()
        # willow/src/session.cpp, Session::prepareDevice: loads when compileEngine and loadEngine
        if loadEngine and self._options.compileEngine:
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
        """willow/src/popx/devicex.cpp, Devicex::loadEngineAndConnectStreams (runtime_error)."""
        if self._device.connectionType is DeviceConnectionType.Never:
            raise popart_runtime_error("Trying to load an engine on an offline device")
        if not self._prepared:
            raise popart_runtime_error(
                "Trying to load an engine but no compiled engine. Did you forget to call prepareDevice()?"
            )
        if (
            self._device.connectionType is DeviceConnectionType.OnDemand
            and not self._device.tryAttachUntilTimeout()
        ):
            raise popart_runtime_error("Failed to attach to device")
        if self._device.type is DeviceType.Ipu and not self._device.isAttached:
            # Assumed (poplar::Engine::load is closed source): loading on hardware the process has not
            # attached fails.
            raise poplar_exception("Cannot load an engine on a device that is not attached")
        _log("InferenceSession.loadEngineAndConnectStreams", device=self._device.id)
        self._device._loaded = self
        # Assumed (Poplar, closed source): a (re)loaded engine's variables are undefined until the next
        # weightsFromHost; nothing in Devicex::loadEngineAndConnectStreams (devicex.cpp) writes them, and
        # Devicex::run reloads without one. Constants come back with the engine.
        self._poison_variables()

    def weightsFromHost(self) -> None:  # noqa: N802
        _log("InferenceSession.weightsFromHost")
        if not self._prepared:
            # willow/src/popx/devicex.cpp, Devicex::weightsFromHost
            raise popart_runtime_error(
                "Devicex::prepare() must be called before Devicex::weightsFromHost() is called."
            )
        # Devicex::weightsFromHost runs the WeightsFromHost program (Devicex::run reloads the engine first
        # when another was loaded), which streams every Variable's host copy to the device.
        if self._device._loaded is not self:
            self.loadEngineAndConnectStreams()
        for replica in self._device_weights:
            for name in self._variables:
                replica[name] = self._host_weights[name].copy()

    def weightsToHost(self) -> None:  # noqa: N802
        """willow/src/popx/devicex.cpp, Devicex::weightsToHost: the WeightsToHost program copies every
        Variable (one replica's copy) into the device-to-host stream buffers; readWeights reads those."""
        _log("InferenceSession.weightsToHost")
        if self._device._loaded is not self:
            self.loadEngineAndConnectStreams()
        self._to_host = {name: value.copy() for name, value in self._device_weights[0].items()}

    def _prefix(self) -> list[int]:
        bps, replicas = self.dataFlow.batchesPerStep(), self.replicationFactor
        return [d for d in (bps, replicas) if d != 1]

    def initAnchorArrays(self) -> dict:  # noqa: N802
        """graphcore/popart python/popart/python_files/session.py, _initAnchorArrays (sdk-release-3.4):
        ``[batchesPerStep, accumulationFactor, replicationFactor]`` for All (``[replicationFactor]`` for
        Final and Sum), ones dropped, then the tensor's shape; the dtype is ``data_type_lcase()``."""
        _log("InferenceSession.initAnchorArrays")
        arrays = {}
        for name in self.dataFlow.anchors():
            info = self.getInfo(name)
            art = self.dataFlow.art(name)
            prefix = [self.replicationFactor]
            if art.id() is AnchorReturnTypeId.All:
                prefix = [self.dataFlow.batchesPerStep(), self.accumulationFactor, *prefix]
            elif art.id() is AnchorReturnTypeId.EveryN:
                if self.dataFlow.batchesPerStep() % art.rp() != 0:
                    raise RuntimeError("Invalid anchor period, is not divisble by batchesPerStep")
                prefix = [self.dataFlow.batchesPerStep() // art.rp(), self.accumulationFactor, *prefix]
            shape = [d for d in prefix if d != 1] + info.shape()
            arrays[name] = np.empty(shape=shape, dtype=info.data_type_lcase())
        return arrays

    def getInfo(self, tensorId: str) -> TensorInfo:  # noqa: N802, N803
        """willow/src/session.cpp, Session::getInfo: any tensor of the executable, Variables included."""
        return {**self._variables, **self._inputs, **self._outputs}[tensorId]

    def getAllTensorIds(self) -> list[str]:  # noqa: N802
        return [*self._inputs, *self._outputs]

    def getCycleCount(self, id: str = "") -> int:  # noqa: N802, A002
        return 0

    def compileAndExport(self, filename: str) -> None:  # noqa: N802
        if self._device.type not in (DeviceType.Ipu, DeviceType.OfflineIpu):
            raise popart_exception(
                f"Executables for device type {self._device.type} cannot be saved"
            )  # session.cpp
        self._check_memory()
        path = os.path.join(filename, "executable.popef") if os.path.isdir(filename) else filename
        with open(path, "wb") as stream:
            stream.write(b"POPEF-DOUBLE " + versionString().encode() + b"\n" + self._raw)

    # -- variables (carried state) -------------------------------------------------------------------------

    def _setup_variables(self) -> None:
        """willow/src/ir.cpp, Ir::registerInputTensors (sdk-release-3.4): an initializer no node consumes
        is not created; in Inference with ``constantWeights`` the others are Const tensors, otherwise
        Variables (with a host copy, TensorData, that weightsFromHost streams to the device)."""
        from onnx import numpy_helper

        graph = self._model.graph
        initializers = {tensor.name: tensor for tensor in graph.initializer}
        consumed = {name for sub in _graphs(graph) for node in sub.node for name in node.input}
        constant = self._options.constantWeights
        for node in _copy_var_updates(graph):
            variable = node.input[0] if node.input else ""
            if variable not in initializers:
                # willow/src/builder.cpp, AiGraphcoreOpset1::copyvarupdate refuses it; a ModelProto does not go
                # through the builder (the IR itself does not check; assumed refused all the same).
                raise popart_exception("The first arg of copyvarupdate should be an initalised tensor.")
            if constant:
                # Assumed (Poplar, closed source): with constantWeights the variable is a Const (ir.cpp above),
                # lowered with setInitialValue and not made writable (irlowering.cpp, prepareGraph); nothing in
                # PopART checks an update of a Const, so the double refuses it rather than guess.
                raise popart_exception(
                    f"CopyVarUpdate '{node.name}' updates '{variable}', which is a constant because "
                    "constantWeights is set (double: assumed refused, PopART has no check)"
                )
        self._variables: dict[str, TensorInfo] = {}
        self._host_weights: dict[str, np.ndarray] = {}
        if not constant:
            for name, tensor in initializers.items():
                if name in consumed:
                    array = numpy_helper.to_array(tensor)
                    self._variables[name] = TensorInfo(_ONNX_TO_POPART[tensor.data_type], list(array.shape))
                    self._host_weights[name] = np.array(array, copy=True)
        self._updated = {node.input[0]: node.input[1] for node in _copy_var_updates(graph)}
        self._baked = _shape_operands(graph) & set(self._variables)
        executed = (
            self._model
            if not self._variables
            else _variables_as_inputs(self._model, self._variables, self._baked)
        )
        self._raw = _executable_by_onnxruntime(executed).SerializeToString()
        # Each replica's copy on the device (assumed, Poplar: replicas keep their own copy of a variable in
        # inference, VariableSettings CommGroup All returns one), and the device-to-host stream buffers
        # weightsToHost fills (undefined before it: assumed).
        self._device_weights: list[dict[str, np.ndarray]] = [{} for _ in range(self.replicationFactor)]
        self._to_host: dict[str, np.ndarray] = {}
        self._poison_variables()

    def _poison_variables(self) -> None:
        for replica in self._device_weights:
            for name, info in self._variables.items():
                replica[name] = _poisoned(info)
        self._to_host = {name: _poisoned(info) for name, info in self._variables.items()}

    def writeWeights(self, weightsIo: PyWeightsIO) -> None:  # noqa: N802, N803
        """willow/src/session.cpp, Session::writeWeights, then willow/src/popx/devicex.cpp,
        Devicex::writeWeights (sdk-release-3.4): only the host copy (TensorData::resetData) of each weight
        tensor the IO contains changes; other names are ignored; the device sees it after weightsFromHost."""
        _log("InferenceSession.writeWeights", names=sorted(getattr(weightsIo, "weights", {})))
        if not isinstance(weightsIo, PyWeightsIO):
            raise TypeError("writeWeights(): incompatible function arguments: expected a PyWeightsIO")
        if self._options.constantWeights:  # an InferenceSession is always in Inference mode
            raise popart_runtime_error(
                "Cannot call writeWeights when constantWeights is set. Set `constantWeights` to False in the "
                "`SessionOption`s when initialising the session to enable this behaviour."
            )
        for name, info in self._variables.items():
            if not weightsIo.contains(name):
                continue
            array = weightsIo.weights[name]
            if list(array.shape) != info.shape():
                # willow/src/tensor.cpp, Tensor::verifyMutableVoidInfo (an internal_error)
                raise popart_internal_exception(
                    "The shape of the MutableVoidData for IO does not not match the expected write region of "
                    f"this tensor. Tensor Write ({len(info.shape())}): {info.shape()} != MutableVoidData "
                    f"({array.ndim}): {list(array.shape)}"
                )
            nbytes = info.nelms() * info._numpy_dtype().itemsize
            if array.nbytes != nbytes:
                # willow/src/tensordata.cpp, TensorData::resetData
                raise popart_exception(
                    f"cannot reset tensor data with data of non-matching size {nbytes} vs {array.nbytes}"
                )
            # a memcpy of the bytes: an array of another dtype and the same size is reinterpreted
            self._host_weights[name] = array.view(info._numpy_dtype()).reshape(info.shape()).copy()

    def readWeights(self, weightsIo: PyWeightsIO) -> None:  # noqa: N802, N803
        """willow/src/popx/devicex.cpp, Devicex::readWeights: the device-to-host stream buffers (as the
        last weightsToHost left them) are copied into the IO's arrays, for each weight tensor it contains."""
        _log("InferenceSession.readWeights")
        for name in self._variables:
            if weightsIo.contains(name):
                target = weightsIo.weights[name]
                source = np.ascontiguousarray(self._to_host[name])
                if target.nbytes != source.nbytes:  # a memcpy past the end on the SDK
                    raise popart_exception(f"double: readWeights array for {name} has the wrong size")
                target.reshape(-1).view(np.uint8)[:] = source.reshape(-1).view(np.uint8)

    # -- running -------------------------------------------------------------------------------------------

    def run(self, stepio, debugName: str = "") -> None:  # noqa: N803
        if not isinstance(stepio, PyStepIO):
            raise TypeError("run(): incompatible function arguments: expected a PyStepIO")
        _log("InferenceSession.run", inputs={k: {"shape": list(v.shape), "dtype": str(v.dtype),
             "c_contiguous": bool(v.flags["C_CONTIGUOUS"])} for k, v in stepio.inputs.items()},
             outputs={k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in stepio.outputs.items()})  # fmt: skip
        # willow/src/session.cpp, Session::run (runtime_error)
        if self._device.connectionType is DeviceConnectionType.Never:
            raise popart_runtime_error("Offline IPU device is not configured for execution")
        if not self._prepared:
            # willow/src/popx/devicex.cpp, Devicex::run
            raise popart_runtime_error(
                "Devicex::prepare() must be called before Devicex::run(const IStepIO &) is called."
            )
        if self._device._loaded is not self:  # switching happens inside run
            self.loadEngineAndConnectStreams()
        _fault("run")
        bps, replicas = self.dataFlow.batchesPerStep(), self.replicationFactor
        feeds = {}
        for name in stepio.inputs:
            if name not in self._inputs:
                # willow/src/stepio_size_assertion.cpp, CorrectnessAsserter::throwIncorrectInput
                raise popart_runtime_error(
                    f"The tensor '{name}' has been provided as one of the inputs to the stepIO, but it is not "
                    "registered as one of the inputs to the model. Please check this tensor and your stepIO."
                )
        for name, info in self._inputs.items():
            if name not in stepio.inputs:
                # willow/include/popart/stepio_generic.hpp, StepIOGeneric::get
                raise popart_runtime_error(f"No tensor {name} provided in PyStepIO's inputs")
            array = stepio.inputs[name]
            expected = info.nelms() * bps * replicas
            if stepio.runtime_asserts and array.size != expected:
                # willow/src/stepio_size_assertion.cpp, CorrectnessAsserter::getBaseError
                raise popart_runtime_error(
                    f"Unexpected number of input elements for Tensor {name}. Expected {expected}, but received "
                    f"{array.size}.\nTo disable this check at your own risk, use IStepIO::enableRuntimeAsserts.\n"
                    f"This with, \n   replication  factor = {replicas}\n   accumulation factor = 1"
                    f"\n   batches per step    = {bps}\n   Tensor nelms        = {info.nelms()}"
                )
            if array.dtype != info._numpy_dtype():
                # willow/src/popx/devicex.cpp, Devicex::InputDatastream::read: equal types are copied, INT64
                # host data for an INT32 tensor is narrowed, anything else is a "Type discrepancy".
                if not (array.dtype == np.int64 and info._numpy_dtype() == np.int32):
                    user = TensorInfo(array.dtype, []).data_type()
                    raise popart_runtime_error(f"Type discrepancy for tensor {name}. User provided : {user} and "
                                               f"expected : {info.data_type()}. Consider a custom copy here (as "
                                               "memcpy cannot be used)")  # fmt: skip
                array = array.astype(np.int32)
            feeds[name] = array.reshape(bps, replicas, *info.shape())
        outputs = {}
        for name, info in self._outputs.items():
            if name not in stepio.outputs:
                continue
            array = stepio.outputs[name]
            if array.size != info.nelms() * bps * replicas or array.dtype != info._numpy_dtype():
                raise popart_runtime_error(
                    f"Unexpected output buffer for anchor {name}: {array.shape} {array.dtype}"
                )
            outputs[name] = array.reshape(bps, replicas, *info.shape())
        names = list(outputs)
        updated = list(self._updated)
        fetched = [*names, *(_NEXT_VALUE + name for name in updated)]
        fed = [name for name in self._variables if name not in self._baked]
        for step in range(bps):
            for replica in range(replicas):
                # [step, replica, ...] keeps a scalar tensor a 0-d array
                feed = {k: v[step, replica, ...] for k, v in feeds.items()}
                device = self._device_weights[replica]
                feed.update({name: device[name] for name in fed})
                results = self._executable.run(fetched, feed)
                for name, value in zip(names, results[: len(names)], strict=True):
                    outputs[name][step, replica] = value
                # CopyVarUpdateOpx::grow copies the updater into the variable: the next micro-batch reads it
                for name, value in zip(updated, results[len(names) :], strict=True):
                    device[name] = np.array(value, dtype=self._variables[name]._numpy_dtype())


__all__ = [name for name in dir() if not name.startswith("_")]
