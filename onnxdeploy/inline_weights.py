"""Inline weights read and written where they lie: just enough of the ONNX protobuf's wire format.

An ``.onnx`` below 2 GiB usually holds its weights inline (optimum writes every such model as one file;
``torch.onnx.export`` too): each initializer's bytes are the ``raw_data`` field of a ``TensorProto`` in
``GraphProto.initializer`` in ``ModelProto.graph``. Parsing that file with protobuf copies every byte (and
onnx_ir copies again when it reads a tensor), so a 1 GB model cost 3.3x its size after loading. This module
never parses the weights:

* :func:`read_header_bytes` walks the file's wire format by positioned reads (``os.pread``) and returns the
  serialized model with each large inline ``raw_data`` replaced by an external-data reference **to the file
  itself** (``location`` = the file's own name, ``offset`` = where the bytes start, ``length``). That is a
  valid ONNX description of where the bytes are, so every later stage (onnx_ir's memory-mapped
  ``ExternalTensor``, :func:`onnxdeploy.model_io.write_for_ort`'s hard links, ONNX Runtime's mapping of
  external data) handles an inline model by reference, as it already did for external data.
* :func:`write_streamed` writes a model whose large initializers are stand-ins (``location`` =
  :data:`STREAM_LOCATION`, ``offset`` = an index into a list of tensors) as one inline ``.onnx``, the
  bytes of each tensor streamed into its ``raw_data`` field (from a mapped file by ``copy_file_range``,
  never through this process's memory) — byte for byte what ``ModelProto.SerializeToString()`` gives.

Sources: protobuf "Encoding" (https://protobuf.dev/programming-guides/encoding/: varints, tags
``field << 3 | wire type``, length-delimited fields, fields serialized in field-number order, repeated
embedded messages concatenated); field numbers from ``onnx/onnx.proto`` (onnx 1.23): ``ModelProto.graph`` 7,
``GraphProto.initializer`` 5, ``TensorProto.raw_data`` 9, ``external_data`` 13, ``data_location`` 14.
Only main-graph initializers are handled; tensors in ``Constant`` nodes, subgraphs, ``float_data`` and other
typed fields stay as they are (exporters put large weights in ``raw_data`` of initializers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

__all__ = [
    "PROTOBUF_LIMIT_BYTES",
    "STAND_IN_THRESHOLD_BYTES",
    "STREAM_LOCATION",
    "read_header_bytes",
    "stream_stand_in",
    "streamed_size",
    "tensor_nbytes",
    "write_streamed",
]

PROTOBUF_LIMIT_BYTES = 2**31 - 1
"""Largest serialized ModelProto protobuf accepts (2 GiB - 1 byte); larger models need external data."""

STAND_IN_THRESHOLD_BYTES = 1024
"""A large initializer has more bytes than this (onnx_ir uses 1000): stripped from the protos handed to onnx's C++
tools, read in place from an inline file, streamed when written inline. Smaller ones stay in memory."""

STREAM_LOCATION = "onnxdeploy-stream"
"""The ``location`` of a stand-in :func:`write_streamed` fills in (its ``offset`` indexes the tensor list)."""

_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION = 9, 13, 14
_LEN = 2  # wire type of length-delimited fields (bytes, strings, embedded messages, packed repeated)
_COPY_CHUNK = 64 << 20


class _Malformed(ValueError):
    """The bytes are not the protobuf this module expects (the caller falls back to protobuf itself)."""


class _FileBytes:
    """A file's bytes indexed and sliced like ``bytes``, read by ``os.pread`` through a small window.

    Not a memory map on purpose: on this machine's kernel (Linux 6.18, ext4 large folios) touching one byte of a
    mapped file maps the whole page-cache folio around it (2 MiB measured, ``RssFile`` of ``/proc/self/status``),
    so walking the initializers' headers of a SmolLM2-shaped 622 MiB single file through a map made 290 MiB
    resident. Reads copy only the bytes asked for (plus one window) and map nothing.
    """

    def __init__(self, fd: int, size: int, window: int = 64 << 10):
        self.fd, self.size, self.window = fd, size, window
        self._start, self._data = 0, b""

    def __len__(self) -> int:
        return self.size

    def _read(self, start: int, length: int) -> bytes:
        data = os.pread(self.fd, length, start)
        if len(data) != length:
            raise _Malformed(f"short read at byte {start} (the file changed?)")
        return data

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.size)
            return self._read(start, stop - start) if stop > start else b""
        if not 0 <= key < self.size:
            raise IndexError(key)
        if not self._start <= key < self._start + len(self._data):
            self._start = key
            self._data = self._read(key, min(self.window, self.size - key))
        return self._data[key - self._start]


_Buffer = bytes | _FileBytes


def _varint(buf: _Buffer, pos: int) -> tuple[int, int]:
    """Decode the base-128 varint at ``pos``; return (value, position after it)."""
    result = shift = 0
    while True:
        try:
            byte = buf[pos]
        except IndexError:
            raise _Malformed("truncated varint") from None
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _Malformed("varint longer than 10 bytes")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire: int = _LEN) -> bytes:
    return _encode_varint(field << 3 | wire)


def _fields(buf: _Buffer, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Each field of the message in ``buf[start:end]``: (number, wire type, tag start, value start, end).

    For a length-delimited field the value starts after its length prefix. Groups (wire types 3, 4) are not
    used by ONNX and are refused.
    """
    pos = start
    while pos < end:
        tag_at = pos
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        value_at = pos
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == _LEN:
            length, value_at = _varint(buf, pos)
            pos = value_at + length
        elif wire == 5:
            pos += 4
        else:
            raise _Malformed(f"wire type {wire}")
        if field == 0 or pos > end:
            raise _Malformed("field past the end of its message")
        yield field, wire, tag_at, value_at, pos


# ---------------------------------------------------------------------------------------------- reading


def tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    """Bytes a tensor's data occupies: ``prod(dims) * itemsize``, sub-byte types packed and rounded up.

    Source: ONNX IR spec, "Tensor Element Types" (int4/uint4/float4e2m1 two per byte, int2/uint2 four).

    Returns:
        The size in bytes, or None for types without a fixed width (string, undefined).
    """
    try:
        bits = ir.DataType(tensor.data_type).bitwidth
    except (ValueError, TypeError):
        return None
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED) or not bits:
        return None
    return (math.prod(tensor.dims) * bits + 7) // 8


def _tensor_reference(buf: _Buffer, start: int, end: int, location: str, threshold: int) -> bytes | None:
    """The serialized ``TensorProto`` in ``buf[start:end]`` as a reference to its own raw_data, or None to keep it.

    Kept as it is: no ``raw_data`` (or more than one), at most ``threshold`` bytes of it, already marked
    external, or a ``raw_data`` whose size disagrees with dims x dtype (the checks report that tensor).
    """
    raw: tuple[int, int, int] | None = None
    for field, wire, tag_at, value_at, field_end in _fields(buf, start, end):
        if field == _EXTERNAL_DATA or (field == _DATA_LOCATION and _varint(buf, value_at)[0] != 0):
            return None  # already external (onnx writes an explicit DEFAULT, 0, after loading external data)
        if field == _RAW_DATA and wire == _LEN:
            if raw is not None:
                return None
            raw = (tag_at, value_at, field_end)
    if raw is None or raw[2] - raw[1] <= threshold:
        return None
    tag_at, value_at, raw_end = raw
    tensor = onnx.TensorProto.FromString(bytes(buf[start:tag_at]) + bytes(buf[raw_end:end]))
    if tensor_nbytes(tensor) != raw_end - value_at:
        return None
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(value_at)), ("length", str(raw_end - value_at))):
        tensor.external_data.add(key=key, value=value)
    return tensor.SerializeToString()


def _graph_header(buf: _Buffer, start: int, end: int, location: str, threshold: int) -> tuple[bytes, int]:
    """``GraphProto`` bytes with large inline initializers turned into references; (bytes, how many turned)."""
    out, run_start, turned = bytearray(), start, 0
    for field, wire, tag_at, value_at, field_end in _fields(buf, start, end):
        if field != _GRAPH_INITIALIZER or wire != _LEN:
            continue
        reference = _tensor_reference(buf, value_at, field_end, location, threshold)
        if reference is None:
            continue
        out += buf[run_start:tag_at]
        out += _key(_GRAPH_INITIALIZER) + _encode_varint(len(reference)) + reference
        run_start, turned = field_end, turned + 1
    out += buf[run_start:end]
    return bytes(out), turned


def read_header_bytes(path: str | os.PathLike[str], threshold: int) -> tuple[bytes, int] | None:
    """Serialized ``ModelProto`` of ``path`` whose inline initializers above ``threshold`` bytes reference the file.

    Each such initializer becomes ``data_location: EXTERNAL`` with ``location`` = the file's own name (relative
    to its folder, as the ONNX spec wants), ``offset`` = the position of its ``raw_data`` bytes in the file and
    ``length`` = their count. The weights are never read: the file is walked by positioned reads of field
    headers (plus each converted tensor's few header bytes and the graph's nodes); nothing is memory-mapped, so
    none of its page-cache folios become resident in this process (:class:`_FileBytes`).

    Args:
        path: an existing, non-empty ``.onnx`` file (never written).
        threshold: bytes of ``raw_data`` above which an initializer is referenced instead of copied.

    Returns:
        (the header's bytes, how many initializers reference the file), or None when the bytes are not a
        protobuf this walk reads (the caller parses the file with protobuf and reports its error).
    """
    location = Path(path).name
    with open(path, "rb") as fh:
        buf = _FileBytes(fh.fileno(), os.fstat(fh.fileno()).st_size)
        try:
            out, run_start, turned = bytearray(), 0, 0
            for field, wire, tag_at, value_at, field_end in _fields(buf, 0, len(buf)):
                if field != _MODEL_GRAPH or wire != _LEN:
                    continue
                graph, n = _graph_header(buf, value_at, field_end, location, threshold)
                if n:
                    out += buf[run_start:tag_at]
                    out += _key(_MODEL_GRAPH) + _encode_varint(len(graph)) + graph
                    run_start, turned = field_end, turned + n
            if not turned:
                return bytes(buf[:]), 0
            out += buf[run_start:]
            return bytes(out), turned
        except (_Malformed, DecodeError):
            return None


# ---------------------------------------------------------------------------------------------- writing


def stream_stand_in(tensor: ir.TensorProtocol, index: int) -> ir.ExternalTensor:
    """A stand-in for ``tensor`` that :func:`write_streamed` fills from ``tensors[index]`` (nothing is read)."""
    return ir.ExternalTensor(
        location=STREAM_LOCATION,
        offset=index,
        length=tensor.nbytes,
        dtype=tensor.dtype,
        shape=tensor.shape,
        name=tensor.name,
        doc_string=tensor.doc_string,
        metadata_props=dict(tensor.metadata_props),
    )


def _split_tensor(data: bytes) -> tuple[bytes, bytes, int, int] | None:
    """A stand-in ``TensorProto``'s bytes as (fields before raw_data, fields after, tensor index, length)."""
    tensor = onnx.TensorProto.FromString(data)
    info = {e.key: e.value for e in tensor.external_data}
    if tensor.data_location != onnx.TensorProto.EXTERNAL or info.get("location") != STREAM_LOCATION:
        return None
    tensor.ClearField("external_data")
    tensor.ClearField("data_location")
    rest = tensor.SerializeToString()
    split = next((tag_at for f, _, tag_at, _, _ in _fields(rest, 0, len(rest)) if f > _RAW_DATA), len(rest))
    return rest[:split], rest[split:], int(info["offset"]), int(info["length"])


_Piece = bytes | tuple[int, int]  # bytes as they are, or (tensor index, length): a raw_data payload to stream


def _pieces(data: bytes) -> list[_Piece]:
    """The serialized model as pieces, each stand-in initializer's ``raw_data`` left as a (index, length) hole."""
    pieces: list[_Piece] = []
    run_start = 0
    for field, wire, tag_at, value_at, field_end in _fields(data, 0, len(data)):
        if field != _MODEL_GRAPH or wire != _LEN:
            continue
        graph: list[_Piece] = []
        graph_run = value_at
        for g_field, g_wire, g_tag, g_value, g_end in _fields(data, value_at, field_end):
            if g_field != _GRAPH_INITIALIZER or g_wire != _LEN:
                continue
            split = _split_tensor(data[g_value:g_end])
            if split is None:
                continue
            pre, post, index, length = split
            head = pre + _key(_RAW_DATA) + _encode_varint(length)
            size = len(head) + length + len(post)
            graph += [data[graph_run:g_tag], _key(_GRAPH_INITIALIZER) + _encode_varint(size) + head]
            graph += [(index, length), post]
            graph_run = g_end
        graph.append(data[graph_run:field_end])
        pieces += [data[run_start:tag_at], _key(_MODEL_GRAPH) + _encode_varint(_size(graph))]
        pieces += graph
        run_start = field_end
    pieces.append(data[run_start:])
    return pieces


def _size(pieces: Sequence[_Piece]) -> int:
    return sum(p[1] if isinstance(p, tuple) else len(p) for p in pieces)


def streamed_size(proto: onnx.ModelProto) -> int:
    """Bytes :func:`write_streamed` writes for ``proto`` (stand-ins counted with their tensors' lengths)."""
    return _size(_pieces(proto.SerializeToString()))


def _copy_range(src: str, offset: int, length: int, out) -> None:
    """Copy ``length`` bytes of file ``src`` from ``offset`` to the open file ``out`` (kernel-side where it can)."""
    with open(src, "rb") as fh:
        done = 0
        while done < length:
            n = min(_COPY_CHUNK, length - done)
            try:
                copied = os.copy_file_range(fh.fileno(), out.fileno(), n, offset + done)
            except (OSError, AttributeError):  # another filesystem type, or not Linux
                fh.seek(offset + done)
                chunk = fh.read(n)
                out.write(chunk)
                copied = len(chunk)
            if copied <= 0:
                raise OSError(f"{src}: short read at byte {offset + done} (the file shrank?)")
            done += copied


def _stream_tensor(tensor: ir.TensorProtocol, length: int, out) -> None:
    """Write ``tensor``'s ``raw_data`` bytes (its ``tobytes()``) to ``out``; a mapped file's range is copied."""
    if isinstance(tensor, ir.ExternalTensor):  # its file holds the raw_data encoding (ONNX: little-endian, packed)
        out.flush()  # the buffered bytes before this range must land first
        _copy_range(tensor.path, tensor.offset or 0, length, out)
        return
    data = tensor.tobytes()
    if len(data) != length:
        raise ValueError(f"tensor '{tensor.name}': {len(data)} bytes, its stand-in says {length}")
    out.write(data)


def write_streamed(proto: onnx.ModelProto, tensors: Sequence[ir.TensorProtocol], out) -> int:
    """Write ``proto`` to the open binary file ``out`` with each stand-in's ``raw_data`` streamed from ``tensors``.

    A stand-in (:func:`stream_stand_in`) is an initializer of the main graph with ``location`` =
    :data:`STREAM_LOCATION` and ``offset`` = its index in ``tensors``. The bytes written equal
    ``SerializeToString()`` of ``proto`` with each stand-in holding ``raw_data = tensors[i].tobytes()`` (fields
    are written in field-number order, as protobuf does). At most one tensor is in this process's memory at a
    time, and a tensor mapping a data file (``ir.ExternalTensor``) is copied file to file.

    Args:
        proto: the model with stand-ins (from ``ir.serde.serialize_model``).
        tensors: the tensors the stand-ins index.
        out: a file opened for binary writing, at its start.

    Returns:
        Bytes written.

    Raises:
        OSError: writing or reading a data file failed.
        ValueError: a tensor's bytes disagree with its stand-in's length.
    """
    written = 0
    for piece in _pieces(proto.SerializeToString()):
        if isinstance(piece, tuple):
            index, length = piece
            _stream_tensor(tensors[index], length, out)
            written += length
        else:
            out.write(piece)
            written += len(piece)
    return written
