"""An external tensor that memory-maps its own byte range of the data file, not the whole file.

onnx_ir's :class:`onnx_ir.ExternalTensor` maps the **whole** data file for each tensor it reads (``mmap(fd, 0)``)
and views its range. On Linux with large page-cache folios (6.18 here, ext4: a file freshly written by ``write()``
is cached in folios of up to 2 MiB) a page fault maps the whole folio around the touched page into that mapping,
within the mapping's bounds. So each tensor read through a whole-file map also makes its neighbours' bytes
resident in this process (up to a folio on each side), once per mapping: measured on SmolLM2-135M's optimum
export (539 MB, one file, freshly written), ``static_kv``'s scan of the small initializers for ``-inf`` (norm
weights of 2.3 KB) raised ``RssFile`` by 236 MiB, and ``fuse_matmuls``' read of its 265 MiB of q/k/v/gate/up
weights by 536 MiB.

:class:`RangeMappedTensor` maps ``[offset rounded down to mmap.ALLOCATIONGRANULARITY, offset + length)`` only:
the kernel cannot map a folio past a mapping's end, so what becomes resident is the tensor's own pages.
Everything else (``ir.ExternalTensor``'s attributes, ``release()``, serialization as an external reference,
``isinstance`` checks) is onnx_ir's. Sub-byte types (INT4, UINT4, FLOAT4E2M1, INT2, UINT2, FLOAT6*) take
onnx_ir's own path (it unpacks them into a new array anyway).

Sources: onnx_ir 1.1 ``_core.ExternalTensor._load`` / ``tobytes`` (whole-file ``mmap``, ``raw[offset:...]``);
Python ``mmap`` docs (``offset`` must be a multiple of ``ALLOCATIONGRANULARITY``); Linux ``filemap_map_pages``
(fault-around and large-folio mapping are clamped to the VMA).
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import onnx_ir as ir

__all__ = ["RangeMappedTensor", "range_mapped", "unmap"]


class RangeMappedTensor(ir.ExternalTensor):
    """An :class:`onnx_ir.ExternalTensor` whose read maps only its byte range of the file (see the module).

    Constructed like ``ir.ExternalTensor`` (``location``, ``offset``, ``length``, ``dtype``, ``shape``, ``name``,
    ``base_dir``, ...). ``numpy()`` returns a read-only little-endian view of shape ``shape`` over the mapping;
    ``tobytes()`` the range's bytes; ``release()`` unmaps (a later read maps again).

    Raises:
        OSError: the file cannot be opened or mapped (as onnx_ir's own read would).
        ValueError: the file is shorter than ``offset + length`` (``mmap`` refuses the range).
    """

    __slots__ = ("_map_delta",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._map_delta = 0

    def _load(self) -> None:
        if self.size == 0 or self.dtype.bitwidth < 8:
            super()._load()
            self._map_delta = self.offset or 0
            return
        self._check_validity()
        self._check_path_containment()
        offset = self.offset or 0
        length = self.length if self.length is not None else self.nbytes
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as fh:
            self.raw = mmap.mmap(fh.fileno(), offset + length - start, offset=start, access=mmap.ACCESS_READ)
        self._map_delta = offset - start
        dtype = np.dtype(self.dtype.numpy()).newbyteorder("<")
        array = np.frombuffer(self.raw, dtype=dtype, offset=self._map_delta, count=self.size)
        self._array = array.reshape(self.shape.numpy())

    def tobytes(self) -> bytes:
        """The tensor's bytes as stored (little-endian, sub-byte types packed), read through its range's map."""
        self._check_validity()
        if self.raw is None:
            self._load()
        assert self.raw is not None
        length = self.length if self.length is not None else self.nbytes
        return self.raw[self._map_delta : self._map_delta + length]


def range_mapped(tensor: ir.ExternalTensor, location: str | os.PathLike[str] | None = None) -> RangeMappedTensor:
    """A :class:`RangeMappedTensor` describing the same bytes as ``tensor`` (nothing is read).

    Args:
        tensor: an external tensor (its ``length`` may be None: then ``nbytes``).
        location: the data file's path to use instead of ``tensor.location`` (absolute, ``base_dir`` is "").

    Returns:
        The new tensor, with ``tensor``'s name, doc string and metadata.
    """
    return RangeMappedTensor(
        location=str(location if location is not None else tensor.location),
        offset=tensor.offset,
        length=tensor.length if tensor.length is not None else tensor.nbytes,
        dtype=tensor.dtype,
        shape=tensor.shape,
        name=tensor.name,
        doc_string=tensor.doc_string,
        metadata_props=dict(tensor.metadata_props),
        base_dir="" if location is not None else tensor.base_dir,
    )


def unmap(tensor: ir.TensorProtocol | None) -> bool:
    """Unmap an external tensor's file now (``release()``; a later read maps it again); others are left alone.

    A pass that has read a weight of its input calls this once it no longer needs the values, so the pages leave
    this process's RSS before the next weight is read (``run_stages`` unmaps the rest after the pass).

    Returns:
        True when it was unmapped; False for an in-memory tensor, or when a numpy view of the mapping is still
        alive somewhere (``BufferError``: the map stays, and goes with that view).
    """
    if not isinstance(tensor, ir.ExternalTensor):
        return False
    try:
        tensor.release()
    except BufferError:
        return False
    return True
