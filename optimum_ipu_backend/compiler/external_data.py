"""Graphs whose weights live in external files: read without loading the weights, written without
serializing them.

A protobuf cannot be serialized above 2 GiB, and holding an export's weights in memory twice (the
parsed export and the legalized copy) is what makes large models fail. So:

* ``load_graph`` parses the model file only. Weights stored outside it (``model.onnx_data``, or one
  file per tensor) stay references (``data_location = EXTERNAL``) relative to the model's directory;
  only external tensors under ``WEIGHT_MIN_BYTES`` (shape constants, position ids: values the passes
  and analyses may need) are read in. The graph that remains is small and can be serialized, inferred
  and checked like any other. A model file that holds its weights itself (``SINGLE_FILE_SCAN_BYTES`` or
  more) is read the same way: its protobuf is scanned for the weights' bytes, the rest parsed, and each
  weight becomes a reference to its bytes inside the model file, so not even the parse holds them.
* ``read_weight`` maps one external tensor's bytes (a conversion to fp16 reads one tensor at a time).
* ``save_graph`` writes a graph and every weight it holds (in memory or still in the export's files) into
  one data file beside it, streaming the bytes of referenced weights from file to file, so a legalized
  graph of any size is written with at most one weight in memory. Weights are laid out in initializer
  order at page-aligned offsets, and only weights go there, so graphs legalized from one export for
  different shapes get byte-identical data files (the executable cache stores them once).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from onnx import helper

from .graphs import WEIGHT_MIN_BYTES, iter_graphs, tensor_bytes

#: Model files at least this large that hold their own weights are scanned rather than parsed whole.
SINGLE_FILE_SCAN_BYTES = 64 << 20
#: Offsets of weights in a data file we write are multiples of this: the page size, so an engine can map
#: each tensor without copying it.
ALIGNMENT = 4096
_COPY_CHUNK = 8 << 20


def external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    """The ``external_data`` key/value pairs of a tensor (location, offset, length)."""
    return {entry.key: entry.value for entry in tensor.external_data}


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _locate(tensor: onnx.TensorProto, weights_dir: Path | None) -> tuple[Path, int, int]:
    """The file an external tensor's bytes lie in, and their offset and length (checked against the file's
    size). Locations outside ``weights_dir`` are refused (absolute ones are what ``load_graph`` writes, so
    that no reader resolves them against the working directory)."""
    if weights_dir is None:
        raise ValueError(f"initializer {tensor.name!r} is stored externally and no model directory was given")
    info = external_info(tensor)
    location = info.get("location", "")
    relative = PurePosixPath(location.replace("\\", "/"))
    inside = bool(location) and ".." not in relative.parts
    if inside and relative.is_absolute():
        # the path as written (a model file linked into its directory, as the Hugging Face cache links a
        # snapshot's files to its blobs, stays beside the model) or the file it resolves to
        inside = Path(os.path.abspath(location)).is_relative_to(os.path.abspath(weights_dir)) or Path(
            location
        ).resolve().is_relative_to(weights_dir.resolve())
    if not inside:
        raise ValueError(
            f"initializer {tensor.name!r} points to external data {location!r}, which is not a file beside "
            f"the model in {weights_dir}; re-export the model with its data files next to it"
        )
    path = weights_dir / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"initializer {tensor.name!r} needs the external data file {path}, which does not exist; copy "
            "the model's data files next to the model file"
        )
    offset = int(info.get("offset", 0) or 0)
    expected = tensor_bytes(tensor)
    length = int(info.get("length", expected) or expected)
    size = path.stat().st_size
    if length != expected or offset + length > size:
        raise ValueError(
            f"initializer {tensor.name!r} expects {expected} bytes at offset {offset} of {path.name} "
            f"(length {length}), and the file has {size}: the data file does not belong to this model"
        )
    return path, offset, length


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for graph in iter_graphs(model.graph):
        yield from (tensor for tensor in graph.initializer if is_external(tensor))


def data_files(model: onnx.ModelProto) -> list[str]:
    """The relative locations of the external data files a model points to, sorted."""
    return sorted({external_info(tensor).get("location", "") for tensor in _external_tensors(model)})


def load_graph(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The model at ``path`` with its large external weights left in their files (see module doc)."""
    return read_graph(path)[0]


def read_graph(path: str | os.PathLike[str]) -> tuple[onnx.ModelProto, list[str]]:
    """``load_graph``, and the external data files the model file points to (before any was read in)."""
    path = Path(path)
    model = None
    if path.stat().st_size >= SINGLE_FILE_SCAN_BYTES:
        model = _scan_weights_in_place(path)
    if model is None:
        model = onnx.load(str(path), load_external_data=False)
    files = [name for name in data_files(model) if Path(name).name != path.name]
    for tensor in _external_tensors(model):
        if tensor_bytes(tensor) < WEIGHT_MIN_BYTES:
            tensor.raw_data = _read_bytes(tensor, path.parent)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    _absolute_locations(model, path.parent)
    return model, files


def _absolute_locations(model: onnx.ModelProto, weights_dir: Path) -> None:
    """Point the weights left in files at those files by absolute path: a reader that is not told the
    model's directory (``numpy_helper.to_array``) then reads the right file or fails, never a file of
    the same name in the working directory."""
    for tensor in _external_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location" and not PurePosixPath(entry.value).is_absolute():
                # absolute, without following links: a linked model file keeps its directory
                entry.value = os.path.abspath(weights_dir / entry.value)


# -- weights inside the model file -----------------------------------------------------------------------
# Protobuf wire format: ModelProto.graph is field 7, GraphProto.initializer field 5, TensorProto.raw_data
# field 9, all length-delimited (wire type 2).
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_LENGTH_DELIMITED = 2


def _varint(buffer, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(buffer, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start of the field's tag, end of the field) for each field."""
    position = start
    while position < end:
        tag_start = position
        tag, position = _varint(buffer, position)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, position = _varint(buffer, position)
        elif wire == 1:
            position += 8
        elif wire == _LENGTH_DELIMITED:
            length, position = _varint(buffer, position)
            position += length
        elif wire == 5:
            position += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, tag_start, position


def _payload(buffer, tag_start: int) -> tuple[int, int]:
    """(start, end) of a length-delimited field's bytes."""
    _, position = _varint(buffer, tag_start)
    length, position = _varint(buffer, position)
    return position, position + length


def _delimited(number: int, body: bytes) -> bytes:
    return _encode_varint(number << 3 | _LENGTH_DELIMITED) + _encode_varint(len(body)) + body


def _scan_weights_in_place(path: Path) -> onnx.ModelProto | None:
    """The model with each initializer whose raw bytes are ``WEIGHT_MIN_BYTES`` or more turned into a
    reference to those bytes inside the model file itself; None when the file is laid out otherwise
    (then it is parsed whole)."""
    import mmap

    with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        size = len(buffer)
        model_fields = list(_fields(buffer, 0, size))
        graphs = [field for field in model_fields if field[0] == _MODEL_GRAPH]
        if len(graphs) != 1 or graphs[0][1] != _LENGTH_DELIMITED:
            return None
        spans: list[tuple[int, int] | None] = []
        graph_start, graph_end = _payload(buffer, graphs[0][2])
        graph_body = bytearray()
        for number, wire, tag_start, end in _fields(buffer, graph_start, graph_end):
            if number != _GRAPH_INITIALIZER or wire != _LENGTH_DELIMITED:
                graph_body += buffer[tag_start:end]
                continue
            tensor_start, tensor_end = _payload(buffer, tag_start)
            raw = [f for f in _fields(buffer, tensor_start, tensor_end) if f[0] == _TENSOR_RAW_DATA]
            if len(raw) != 1 or raw[0][1] != _LENGTH_DELIMITED:
                spans.append(None)
                graph_body += buffer[tag_start:end]
                continue
            raw_start, raw_end = _payload(buffer, raw[0][2])
            if raw_end - raw_start < WEIGHT_MIN_BYTES:
                spans.append(None)
                graph_body += buffer[tag_start:end]
                continue
            spans.append((raw_start, raw_end - raw_start))
            tensor = buffer[tensor_start : raw[0][2]] + buffer[raw[0][3] : tensor_end]
            graph_body += _delimited(_GRAPH_INITIALIZER, tensor)
        body = bytearray()
        for number, _, tag_start, end in model_fields:
            body += (
                _delimited(_MODEL_GRAPH, bytes(graph_body))
                if number == _MODEL_GRAPH
                else buffer[tag_start:end]
            )
    model = onnx.ModelProto.FromString(bytes(body))
    if len(model.graph.initializer) != len(spans):
        return None
    for tensor, span in zip(model.graph.initializer, spans, strict=True):
        if span is None:
            continue
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", path.name), ("offset", str(span[0])), ("length", str(span[1]))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
    return model


def _read_bytes(tensor: onnx.TensorProto, weights_dir: Path) -> bytes:
    source, offset, length = _locate(tensor, weights_dir)
    with open(source, "rb") as stream:
        stream.seek(offset)
        return stream.read(length)


def read_weight(tensor: onnx.TensorProto, weights_dir: Path | None) -> np.ndarray:
    """The values of an initializer, mapped from its file when it is external (read-only)."""
    if not is_external(tensor):
        return onnx.numpy_helper.to_array(tensor)
    source, offset, _ = _locate(tensor, weights_dir)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
    shape = tuple(int(d) for d in tensor.dims)
    if not shape or 0 in shape:
        with open(source, "rb") as stream:
            stream.seek(offset)
            return np.frombuffer(stream.read(tensor_bytes(tensor)), dtype).reshape(shape)
    return np.memmap(source, dtype=dtype, mode="r", offset=offset, shape=shape)


def data_file_name(graph_path: Path) -> str:
    """The name of the data file ``save_graph`` writes beside ``graph_path``."""
    return f"{graph_path.name}.data"


def _is_saved_as_weight(tensor: onnx.TensorProto, weight_names: frozenset[str]) -> bool:
    """Whether a tensor goes to the data file: the export's weights when the caller names them (then
    constants folded for one shape, such as a causal mask sliced to the sequence length, stay in the
    graph and the data file is the same for every shape), else every tensor of ``WEIGHT_MIN_BYTES``."""
    if tensor.data_type == onnx.TensorProto.STRING:
        return False  # strings have no fixed-size bytes to place in a data file
    if is_external(tensor):
        return True
    return tensor.name in weight_names if weight_names else tensor_bytes(tensor) >= WEIGHT_MIN_BYTES


def save_graph(
    model: onnx.ModelProto,
    path: Path,
    weights_dir: Path | None = None,
    weight_names: frozenset[str] = frozenset(),
) -> Path:
    """Write ``model`` to ``path`` and its weights to ``<path>.data`` (see module doc).

    ``weights_dir`` is the directory the model's external references are relative to (the export's).
    The top-level initializers that are weights (external, or named in ``weight_names``; without names,
    of ``WEIGHT_MIN_BYTES`` or more) are rewritten in place to point into the new data file;
    nothing else in ``model`` changes. Without weights no data file is written.
    """
    path = Path(path)
    data_path = path.with_name(data_file_name(path))
    weights = [tensor for tensor in model.graph.initializer if _is_saved_as_weight(tensor, weight_names)]
    if not weights:
        data_path.unlink(missing_ok=True)
        onnx.save_model(model, str(path))
        return path
    data_path.unlink(missing_ok=True)  # never write through a hard link into a file others share
    with open(data_path, "wb") as sink:
        for tensor in weights:
            offset = -sink.tell() % ALIGNMENT + sink.tell()
            sink.seek(offset)
            if is_external(tensor):
                source, start, length = _locate(tensor, weights_dir)
                with open(source, "rb") as stream:
                    stream.seek(start)
                    _copy_range(stream, sink, length)
            else:
                length = len(tensor.raw_data)
                if length == 0:  # values in typed fields (float_data, ...): raw bytes first
                    tensor.CopyFrom(
                        onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor), tensor.name)
                    )
                    length = len(tensor.raw_data)
                sink.write(tensor.raw_data)
                tensor.ClearField("raw_data")
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(length)),
            ):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
        sink.truncate()
    onnx.save_model(model, str(path))
    return path


def _copy_range(source, sink, length: int) -> None:
    remaining = length
    while remaining:
        chunk = source.read(min(_COPY_CHUNK, remaining))
        if not chunk:
            raise ValueError(f"external data ended {remaining} bytes early")
        sink.write(chunk)
        remaining -= len(chunk)
