"""Errors raised when a graph cannot be made PopART-ready."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optimum_ipu_backend.errors import UnsupportedModelError

if TYPE_CHECKING:
    import onnx

    from .passes.base import PassReport

# What kind of construct keeps a node from PopART: one spelling each, for messages and `check --json`.
PATTERN_CUSTOM_DOMAIN = "custom-domain operator"
PATTERN_MISSING_OPERATOR = "operator PopART lacks"
PATTERN_NO_LOWERING = "no opset-11 lowering"
PATTERN_RUNTIME_OPERAND = "compile-time operand computed at run time"
PATTERN_RUNTIME_BRANCH = "If branch chosen at run time"
PATTERN_DEVICE_DTYPE = "type Poplar cannot hold"
PATTERN_DYNAMIC_SHAPE = "shape not static"
PATTERN_INPUT_SIZE = "input size"
PATTERN_INT32_RANGE = "int64 value beyond int32"
PATTERN_INVALID_GRAPH = "invalid ONNX"
PATTERN_SHAPE_INFERENCE = "shapes that do not fit"
PATTERN_OPSET = "opset PopART cannot import"
PATTERN_PASS_FAILURE = "compiler pass failed"
PATTERN_QUANTIZATION = "quantization the IPU cannot compute exactly"

#: Kinds of construct that do not depend on the sizes a graph is compiled for: an error made only of
#: these is the model's (or ours) whatever the shapes of a call.
SHAPE_INDEPENDENT_PATTERNS = frozenset(
    {
        PATTERN_CUSTOM_DOMAIN,
        PATTERN_MISSING_OPERATOR,
        PATTERN_DEVICE_DTYPE,
        PATTERN_OPSET,
        PATTERN_PASS_FAILURE,
        PATTERN_QUANTIZATION,
        # an If whose condition the static sizes fix is folded: one left is chosen by the data
        PATTERN_RUNTIME_BRANCH,
        # the graph is legalized at static input sizes: a shape still dynamic is computed from the data,
        # and a structural fault (a missing field) is the graph's; sizes that do not fit an operator fail
        # shape inference instead (PATTERN_SHAPE_INFERENCE), which does depend on them
        PATTERN_DYNAMIC_SHAPE,
        PATTERN_INVALID_GRAPH,
    }
)

#: The one hint about the sizes of a call: advice for a model that leaves dimensions to its callers only.
DYNAMIC_DIMENSIONS_HINT = (
    "pass static sizes for every dynamic input dimension (input_shapes / --shape NAME=DIMS)"
)

DEFAULT_HINTS = (
    "re-export the model with optimum (a newer or older opset can avoid an operator)",
    DYNAMIC_DIMENSIONS_HINT,
    "try the other precision (precision='fp32' or 'fp16')",
    "file an issue with the model id and this message so the missing rewrite can be added",
)


def branch_binding_hint(choosing: list[str]) -> str:
    """The advice for a graph that picks an If branch from boolean inputs (a merged decoder)."""
    return (
        f"this graph picks an If branch from the input(s) {choosing}: the branches of a merged decoder "
        "return outputs of different shapes, so bind the input first, e.g. "
        "bind_constant_inputs(model, {'use_cache_branch': True}), and legalize each binding"
    )


@dataclass(frozen=True)
class UnsupportedNode:
    """One node (or graph tensor) that keeps the graph from being PopART-ready.

    ``pattern`` names the kind of construct (one of the ``PATTERN_*`` strings); ``origin`` is the node of
    the exported graph it came from (its name path, e.g. ``/model/decoder/layers.0/self_attn/ScatterND``),
    filled in by ``legalize`` when the node was made by a pass from another one.
    """

    name: str
    op_type: str
    domain: str
    reason: str
    pattern: str = ""
    origin: str = ""

    def describe(self) -> str:
        op = f"{self.domain}::{self.op_type}" if self.domain not in ("", "ai.onnx") else self.op_type
        text = f"{self.name or '<unnamed>'} ({op}): {self.reason}"
        details = [f"pattern: {self.pattern}"] if self.pattern else []
        if self.origin and self.origin != self.name:
            details.append(f"from exported node {self.origin}")
        return f"{text} [{'; '.join(details)}]" if details else text


class LegalizationError(UnsupportedModelError):
    """The graph could not be legalized; the message lists every offending node and what to do."""

    def __init__(
        self,
        summary: str,
        nodes: Iterable[UnsupportedNode] = (),
        hints: Iterable[str] | None = None,
    ) -> None:
        self.summary = summary
        self.nodes: list[UnsupportedNode] = list(nodes)
        self.hints: list[str] = list(DEFAULT_HINTS if hints is None else hints)
        #: The ONNX file the graph was read from, when the caller said (``legalize(..., source=...)``).
        self.model_file: str | None = None
        # Filled in by the pipeline: what the passes before the failing one did, and which pass failed.
        self.reports: list[PassReport] = []
        self.failed_pass: str | None = None
        # The graph as the failing pass received it (shapes are static once fix_shapes has run).
        self.model: onnx.ModelProto | None = None
        super().__init__(self._format())

    @property
    def about_shapes(self) -> bool:
        """Whether the sizes the graph was compiled for may be the cause: some offending node is of a
        kind that depends on them (or none is named)."""
        return not self.nodes or any(node.pattern not in SHAPE_INDEPENDENT_PATTERNS for node in self.nodes)

    def for_fixed_shapes(self) -> None:
        """Drop the advice about sizes: the model fixes every input dimension."""
        if DYNAMIC_DIMENSIONS_HINT in self.hints:
            self.hints = [hint for hint in self.hints if hint != DYNAMIC_DIMENSIONS_HINT]
            self.refresh()

    def refresh(self) -> None:
        """Rebuild the message after ``nodes`` or ``model_file`` changed."""
        self.args = (self._format(),)

    def _format(self) -> str:
        lines = [self.summary]
        if self.model_file:
            lines.append(f"model file: {self.model_file}")
        if self.nodes:
            lines.append(f"{len(self.nodes)} offending node(s):")
            lines.extend(f"  - {node.describe()}" for node in self.nodes)
        if self.hints:
            lines.append("What you can do:")
            lines.extend(f"  * {hint}" for hint in self.hints)
        return "\n".join(lines)


class OpsetConversionError(LegalizationError):
    """The model's ai.onnx opset could not be converted to the one PopART reads: a fault of the model file
    (or of onnx's converter), whatever the shapes of a call."""


#: What a user does with a compiler bug: what to send, and where.
REPORT_A_BUG = (
    "this is a bug in optimum-ipu-backend, not a limit of your model or of the IPU",
    "file an issue with this message, the output of `optimum-ipu env` and the model (or the command that "
    "exported it); `optimum-ipu check MODEL --json` shows the passes that ran before the failure",
)


class CompilerBugError(LegalizationError):
    """A compiler pass failed internally (it raised something other than a LegalizationError): a bug of
    ours, reported as one, never as a shape or operator problem of the model."""

    def __init__(self, pass_name: str, error: BaseException) -> None:
        first = str(error).splitlines()[0] if str(error) else ""
        reason = f"{type(error).__name__}: {first}"
        super().__init__(
            f"Compiler bug: the {pass_name} pass failed internally with {reason}",
            [UnsupportedNode("<graph>", pass_name, "", reason, PATTERN_PASS_FAILURE)],
            REPORT_A_BUG,
        )
        self.failed_pass = pass_name
