"""What the SDK worker imports runs on the SDK's own Python: 3.8 or newer, and without the user's stack.

The worker may run on another interpreter (``sdk_python``; engines/worker.py says why). Two rules follow,
checked here:

* the worker, and everything it imports, imports none of transformers, optimum, onnxruntime or this
  package's host layers: checked in a fresh interpreter that does what the worker does (the SDK double
  first, then ``worker_server`` and the backend, a build and a run on each engine), then reads
  ``sys.modules``;
* those modules run on Python 3.8: checked with vermin (``-t=3.8-``; annotations are not evaluated, since
  every one of these files starts with ``from __future__ import annotations``), plus what vermin cannot
  see (runtime ``X | Y`` unions, one-argument ``traceback.format_exception``, ``str.removeprefix`` on a
  variable, builtin generics evaluated at run time).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sdk_testing import DOUBLE_DIR, sdk_environment

import optimum_ipu_backend

PACKAGE = Path(optimum_ipu_backend.__file__).resolve().parent
# Every module the worker process may import (engines/worker.py): the 3.8 rule applies to these files.
WORKER_SIDE_FILES = (
    "__init__.py",
    "errors.py",
    "engines/__init__.py",
    "engines/base.py",
    "engines/probe.py",
    "engines/worker.py",
    "engines/worker_server.py",
    "engines/popart.py",
    "engines/poptorch.py",
    "engines/onnx_torch.py",
)
FORBIDDEN = ("transformers", "optimum", "onnxruntime")
HOST_LAYERS = tuple(
    f"optimum_ipu_backend.{layer}"
    for layer in ("session", "runtime", "compiler", "integration", "cli", "conformance")
)
BACKENDS = {
    "popart": "optimum_ipu_backend.engines.popart:PopARTBackend",
    "poptorch": "optimum_ipu_backend.engines.poptorch:PopTorchBackend",
}

# Run in a fresh interpreter with the double on PYTHONPATH: what engines/worker.py's bootstrap and
# worker_server.serve do (the SDK first), then one build and run of a static graph on the IPU Model.
# Each import of a forbidden module is recorded with the files on the stack: what the SDK double imports,
# or what is imported while it runs, is the SDK's business (the double stands in for it); anything else is
# the package's doing, directly or through what it imports.
_WORKER_SIDE = """
import importlib, json, os, sys
from dataclasses import asdict
sdk, backend, graph, forbidden = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
also = sys.argv[5:]  # modules to import as the package would (the check's own test)
imports = []

class Recorder:
    def find_spec(self, name, path=None, target=None):
        if name in forbidden:  # a package's first import; its submodules follow from its own code
            files, frame = [], sys._getframe(1)
            while frame is not None:
                files.append(frame.f_code.co_filename)
                frame = frame.f_back
            imports.append([name, files])
        return None

sys.meta_path.insert(0, Recorder())
importlib.import_module(sdk)
from optimum_ipu_backend.engines.worker_server import Server
from optimum_ipu_backend.engines.base import CompileOptions
for name in also:
    importlib.import_module(name)
module_name, _, class_name = backend.partition(":")
server = Server(getattr(importlib.import_module(module_name), class_name)())
server.op_hello()
options = asdict(CompileOptions(device="ipu-model"))
reply = server.op_build(graph, None, "ipu-model", False, "ipu2", options)
entry = server.executables[reply["executable"]]
for array in entry.inputs.values():
    array[...] = 1
server.op_run(reply["executable"])
outputs = {name: array.ravel().tolist() for name, array in entry.outputs.items()}
server.op_release(reply["executable"])
server.op_shutdown()
# a look-up (torch._dynamo asks importlib.util.find_spec("onnxruntime")) is not an import
imports = [entry for entry in imports if entry[0] in sys.modules]
print(json.dumps({"modules": sorted(sys.modules), "imports": imports, "outputs": outputs}))
"""


def _static_graph(path: Path) -> Path:
    """y = relu(x @ W + b), x float32[2, 4]: a legalized graph (static, no int64)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["xwb"]),
            helper.make_node("Relu", ["xwb"], ["y"]),
        ],
        "static",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor("W", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32)),
            helper.make_tensor("b", TensorProto.FLOAT, [3], rng.standard_normal(3).astype(np.float32)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)
    onnx.save(model, path)
    return path


def _expected(path: Path) -> list[list[float]]:
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    return np.maximum(np.ones((2, 4), np.float32) @ weights["W"] + weights["b"], 0).ravel().tolist()


def _worker_side(engine: str, directory: Path, *also: str) -> dict:
    graph = _static_graph(directory / "static.onnx")
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            _WORKER_SIDE,
            engine,
            BACKENDS[engine],
            str(graph),
            ",".join(FORBIDDEN),
            *also,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=directory,
        env=_double_environment(directory),
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["outputs"]["y"] == pytest.approx(_expected(graph), rel=1e-5, abs=1e-6)
    return result


def _not_by_the_sdk(result: dict) -> list[str]:
    """The forbidden imports the SDK (here its double) did not make, directly or through what it ran."""
    return [
        f"{name} (imported from {' <- '.join(files[:8])})"
        for name, files in result["imports"]
        if not any(_in_double(file) for file in files)
    ]


def _host_layers(result: dict) -> list[str]:
    return [
        name
        for name in result["modules"]
        if any(name == layer or name.startswith(f"{layer}.") for layer in HOST_LAYERS)
    ]


@pytest.mark.parametrize("engine", sorted(BACKENDS))
def test_the_worker_imports_no_host_stack(engine, tmp_path):
    result = _worker_side(engine, tmp_path)
    assert not _not_by_the_sdk(result), f"the {engine} worker imported {_not_by_the_sdk(result)}"
    assert not _host_layers(result), f"the {engine} worker imported the host layers {_host_layers(result)}"
    # every module of this package the worker imported is one the 3.8 check covers
    files = {
        _module_file(name.removeprefix("optimum_ipu_backend").lstrip(".").replace(".", "/"))
        for name in result["modules"]
        if name.split(".")[0] == "optimum_ipu_backend"
    }
    assert files <= set(WORKER_SIDE_FILES), sorted(files - set(WORKER_SIDE_FILES))
    assert {"engines/worker_server.py", f"engines/{engine}.py"} <= files


def test_the_import_check_sees_an_import_the_package_would_make(tmp_path):
    result = _worker_side("popart", tmp_path, "onnxruntime", "optimum_ipu_backend.runtime.buckets")
    assert [entry.split(" ")[0] for entry in _not_by_the_sdk(result)] == ["onnxruntime"]
    assert "optimum_ipu_backend.runtime.buckets" in _host_layers(result)


def _in_double(file: str) -> bool:
    return not file.startswith("<") and Path(file).resolve().is_relative_to(DOUBLE_DIR)


def _module_file(relative: str) -> str:
    if not relative:
        return "__init__.py"
    return f"{relative}/__init__.py" if (PACKAGE / relative).is_dir() else f"{relative}.py"


def _double_environment(directory: Path) -> dict[str, str]:
    """The double on the path, after the package under test (a directory with a link to it alone)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OPTIMUM_IPU_")}
    environment.update(sdk_environment(directory / "double", ipus=4))
    package = directory / "package"
    package.mkdir()
    (package / PACKAGE.name).symlink_to(PACKAGE, target_is_directory=True)
    environment["PYTHONPATH"] = os.pathsep.join([str(package), environment["PYTHONPATH"]])
    return environment


def test_replies_cross_to_the_host_as_plain_python_values():
    """The host and the SDK's Python may have different numpy versions: no numpy object is pickled."""
    from optimum_ipu_backend.engines.worker_server import plain

    reply = {"shape": (np.int64(2), 3), "seconds": np.float64(0.5), "specs": [{"size": np.int32(4)}]}
    converted = plain(reply)
    assert converted == {"shape": (2, 3), "seconds": 0.5, "specs": [{"size": 4}]}
    assert b"numpy" not in pickle.dumps(converted)
    assert type(converted["shape"][0]) is int and type(converted["seconds"]) is float


# -- Python 3.8 ------------------------------------------------------------------------------------------


def test_vermin_finds_the_worker_side_runs_on_python_3_8():
    """vermin's verdict per file and line; no ``--eval-annotations``: with ``from __future__ import
    annotations`` no annotation is evaluated, so ``int | None`` there is fine on 3.8."""
    files = [str(PACKAGE / name) for name in WORKER_SIDE_FILES]
    vermin = "from vermin.main import main; raise SystemExit(main())"  # the test extra installs vermin
    arguments = ["-t=3.8-", "--no-tips", "--violations", "--format", "parsable", *files]
    completed = subprocess.run(
        [sys.executable, "-c", vermin, *arguments], capture_output=True, text=True, timeout=300
    )
    # parsable lines: file:line:column:py2:py3:feature; the summary lines have no line number
    violations = [
        line
        for line in completed.stdout.splitlines()
        if line.count(":") >= 5 and line.split(":")[1].isdigit()
    ]
    assert not violations, "needs a newer Python than 3.8:\n" + "\n".join(violations)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_every_worker_side_file_with_annotations_does_not_evaluate_them():
    """What lets vermin (and Python 3.8) ignore ``X | None`` and ``list[int]`` in annotations."""
    for name in WORKER_SIDE_FILES:
        tree = ast.parse((PACKAGE / name).read_text())
        futures = {
            alias.name
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module == "__future__"
            for alias in node.names
        }
        assert "annotations" in futures or not _has_annotations(tree), name


def _has_annotations(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.AnnAssign)
        or (isinstance(node, ast.arg) and node.annotation is not None)
        or (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None)
        for node in ast.walk(tree)
    )


_BUILTIN_GENERICS = {"list", "dict", "tuple", "set", "frozenset", "type"}


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside an annotation or an ``if TYPE_CHECKING:`` block (never evaluated)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        roots = []
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            roots.extend(node.body)
        if isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            roots.append(node.returns)
        for root in roots:
            inside.update(id(child) for child in ast.walk(root))
    return inside


def python_3_10_at_run_time(source: str) -> list[tuple[int, str]]:
    """(line, what) for what vermin does not report and fails on Python 3.8 or 3.9 when it runs."""
    tree = ast.parse(source)
    annotations = _annotation_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name in ("isinstance", "issubclass") and len(node.args) == 2:
                if isinstance(node.args[1], ast.BinOp) and isinstance(node.args[1].op, ast.BitOr):
                    found.append((node.lineno, f"{name}(..., X | Y) needs Python 3.10; use a tuple"))
            if (
                name == "format_exception"
                and isinstance(function, ast.Attribute)
                and len(node.args) == 1
                and not node.keywords
            ):
                found.append((node.lineno, "traceback.format_exception(exc) needs Python 3.10"))
            if name in ("removeprefix", "removesuffix") and isinstance(function, ast.Attribute):
                found.append((node.lineno, f"str.{name} needs Python 3.9"))
        if isinstance(node, ast.ExceptHandler) and isinstance(node.type, ast.BinOp):
            found.append((node.lineno, "except X | Y needs Python 3.10; use a tuple"))
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in _BUILTIN_GENERICS
        ):
            found.append((node.lineno, f"{node.value.id}[...] evaluated at run time needs Python 3.9"))
    return sorted(found)


def test_what_vermin_cannot_see_is_not_there_either():
    findings = [
        f"{name}:{line}: {what}"
        for name in WORKER_SIDE_FILES
        for line, what in python_3_10_at_run_time((PACKAGE / name).read_text())
    ]
    assert not findings, "needs a newer Python than 3.8:\n" + "\n".join(findings)


def test_the_run_time_check_finds_what_it_looks_for():
    source = (
        "from __future__ import annotations\n"
        "import traceback\n"
        "def f(e: int | None, A, B, s) -> list[int]:\n"
        "    x: dict[str, int] = {}\n"
        "    isinstance(e, A | B)\n"
        "    traceback.format_exception(e)\n"
        "    s.removeprefix('a')\n"
        "    Alias = list[int]\n"
        "    traceback.format_exception(type(e), e, None)\n"
        "    isinstance(e, (A, B))\n"
        "if TYPE_CHECKING:\n"
        "    Names = list[str]\n"
    )
    assert [line for line, _ in python_3_10_at_run_time(source)] == [5, 6, 7, 8]


def test_ruff_holds_every_worker_side_file_to_python_3_8():
    """pyproject.toml's per-file ``py38`` targets cover these files: ruff never suggests 3.10 code there."""
    import re

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    section = pyproject.split("[tool.ruff.per-file-target-version]", 1)[1].split("\n[", 1)[0]
    covered = set()
    for folder, names, version in re.findall(r'"optimum_ipu_backend/(.*)\{(.*)\}\.py" = "(\w+)"', section):
        assert version == "py38", (folder, names, version)
        covered |= {f"{folder}{name}.py" for name in names.split(",")}
    assert covered == set(WORKER_SIDE_FILES)
