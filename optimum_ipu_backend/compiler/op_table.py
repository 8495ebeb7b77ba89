"""What PopART (SDK 3.4) accepts: its opset-11 operators and the tensor types Poplar cannot hold.

The operator list is a fact table extracted from PopART's sources (``popart_opset11_ops.json``,
shipped as package data); the dtype list comes from Poplar's ``popType``.
"""

from __future__ import annotations

import json
from importlib import resources

import onnx

_TABLE_FILE = "popart_opset11_ops.json"


def _load_table() -> dict:
    return json.loads(resources.files(__package__).joinpath(_TABLE_FILE).read_text(encoding="utf-8"))


_TABLE = _load_table()

#: ai.onnx operators PopART 3.4 implements at opset 11 (a creator registration or an ONNX pre-pass).
POPART_OPSET11_OPS: frozenset[str] = frozenset(_TABLE["ops"])
#: Standard opset-11 operators PopART has no implementation for.
POPART_MISSING_OPSET11_OPS: frozenset[str] = frozenset(_TABLE["not_implemented_at_opset11"])
POPART_MAX_OPSET: int = int(_TABLE["opset"])

#: ONNX element types Poplar has no device type for (``popType`` throws).
FORBIDDEN_DTYPES: frozenset[int] = frozenset(
    {
        onnx.TensorProto.INT64,
        onnx.TensorProto.UINT64,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.STRING,
        onnx.TensorProto.COMPLEX64,
        onnx.TensorProto.COMPLEX128,
    }
)

#: Domains that name the standard operator set.
DEFAULT_DOMAINS: frozenset[str] = frozenset({"", "ai.onnx"})


def operator_name(domain: str, op_type: str) -> str:
    """How the package names an operator: ``Op`` in the default domain, ``domain::Op`` in another."""
    return op_type if domain in DEFAULT_DOMAINS else f"{domain}::{op_type}"


def default_opset(model: onnx.ModelProto) -> int | None:
    """The version of the standard operator set the model imports, None when it imports none."""
    return next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), None)


#: Operand slots that ONNX types as int64 only and that PopART reads at compile time (a constant
#: expression, never a device tensor), so they stay int64 after Int64ToInt32: (op_type, input index).
INT64_COMPILE_TIME_OPERANDS: frozenset[tuple[str, int]] = frozenset(
    {
        ("Reshape", 1),
        ("Expand", 1),
        ("Tile", 1),
        ("ConstantOfShape", 0),
        ("Pad", 1),
        ("TopK", 1),
        ("Resize", 3),
        # Opset-13 forms; the lowering pass turns them into attributes, but if one survives the
        # graph must still type-check until verify reports it.
        ("Squeeze", 1),
        ("Unsqueeze", 1),
        ("Split", 1),
        ("ReduceSum", 1),
        # Opset 18 moved the axes of every other reduction to an input as well.
        *(
            (f"Reduce{kind}", 1)
            for kind in ("Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum", "LogSumExp", "SumSquare")
        ),
    }
)

#: Operand slots ONNX types as int64 only, whether PopART reads them at compile time or on the device
#: (RoiAlign's batch indices, Loop's trip count). A constant read only by such slots stays int64: PopART
#: converts int64 constants to int32 when it loads them (``enableSupportedDataTypeCasting``).
INT64_ONLY_OPERANDS: frozenset[tuple[str, int]] = INT64_COMPILE_TIME_OPERANDS | frozenset(
    {("RoiAlign", 2), ("Loop", 0)}
)

#: Outputs ONNX types int64 that PopART's IR computes as INT32 whatever the ONNX type says (ArgMax and
#: ArgMin, and TopK's indices, whose op sets up an INT32 output in PopART's source):
#: (op_type, output index). Narrowed by a Cast to int32 right where they are produced, they never hold
#: an int64 value on the device.
POPART_INT32_OUTPUTS: frozenset[tuple[str, int]] = frozenset({("ArgMax", 0), ("ArgMin", 0), ("TopK", 1)})

#: Operand slots PopART needs to know at compile time (shapes, indices of slices, clip bounds).
COMPILE_TIME_OPERANDS: frozenset[tuple[str, int]] = INT64_COMPILE_TIME_OPERANDS | frozenset(
    {
        ("Slice", 1),
        ("Slice", 2),
        ("Slice", 3),
        ("Slice", 4),
        ("CumSum", 1),
        ("OneHot", 1),
        ("Clip", 1),
        ("Clip", 2),
        ("Resize", 1),
        ("Resize", 2),
        ("Pad", 3),  # Pad-18's axes, which the lowering folds into Pad-11's pads
        ("Upsample", 1),
        # Read by the lowering into constant Gather positions (passes/rewrites/reverse_sequence.py).
        ("ReverseSequence", 1),
        # Operators PopART lacks, which only folding removes (precheck.FOLDED_ONLY_OPS).
        ("NonZero", 0),
        ("EyeLike", 0),
        # Range's output length is its operands' values: RangeRewrite computes it at compile time.
        ("Range", 0),
        ("Range", 1),
        ("Range", 2),
    }
)

#: Operand slots ONNX types as float32 only, whatever the compute precision.
FLOAT32_ONLY_OPERANDS: frozenset[tuple[str, int]] = frozenset({("Resize", 1), ("Resize", 2), ("Upsample", 1)})


def dtype_name(elem_type: int) -> str:
    """The ONNX name of an element type, e.g. ``INT64``."""
    return onnx.TensorProto.DataType.Name(elem_type) if elem_type else "UNDEFINED"


def branch_inputs(model: onnx.ModelProto) -> list[str]:
    """Boolean graph inputs that are the condition of a top-level ``If`` (optimum's ``use_cache_branch``).

    The two branches of a merged decoder return tensors of different shapes, so no single static graph
    serves both: each value is bound and legalized on its own.
    """
    bool_inputs = {
        value.name for value in model.graph.input if value.type.tensor_type.elem_type == onnx.TensorProto.BOOL
    }
    return sorted(
        {node.input[0] for node in model.graph.node if node.op_type == "If" and node.input[0] in bool_inputs}
    )
