"""Read and write ``torch.save`` files without torch and without running their pickles.

The format, as torch 2.13 writes it (``torch/serialization.py`` ``_save``/``_load`` and
``caffe2/serialize/inline_container.cc``; checked against real files):

- A zip archive whose records all sit under one directory, the *archive name*: the file's base name
  up to its last ``.`` (``x.pt`` -> ``x/``), or ``archive`` when torch writes to a buffer. Readers take
  it from the first record's name. No record is ever compressed.
- Records in this order: ``data.pkl`` (the object, pickle protocol 2), ``.format_version`` (``1``),
  ``.storage_alignment`` (``64``), ``byteorder`` (``little``), ``data/0``, ``data/1``, ... (one per
  storage, raw bytes, keys numbered in pickling order), ``version`` (``3\\n``) and
  ``.data/serialization_id`` (40 digits that torch only logs).
- Every record's data starts at a multiple of 64 bytes in the file: the local header's extra field
  ends with a padding block, id ``FB``, filled with ``Z``.
- Each non-empty record has flag bit 3 set: its local header holds zeros for CRC-32 and sizes, and a
  16-byte data descriptor after the data (24 bytes, with a zip64 extra field in the header, when the
  record is 4 GiB or more or starts at 4 GiB or more) holds them. The archive always ends with zip64
  end records. torch's loader relies on exactly this layout when it computes storage offsets itself
  (``torch.utils.serialization.config.load.calculate_storage_offsets``), so the writer reproduces it.
- torch.load never verifies CRC-32 (PyTorch builds miniz with ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``,
  and ``torch.serialization.set_crc32_options(False)`` writes zeros). reshard checks ``data.pkl``'s
  CRC when it is not zero, and never reads storages to check theirs.
- A tensor is ``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
  OrderedDict())`` whose storage is the persistent id ``('storage', torch.<X>Storage, key, location,
  numel)``. Dtypes without a legacy storage class (float8, uint16, ...) use ``_rebuild_tensor_v3(...,
  dtype)`` with ``torch.storage.UntypedStorage``, whose numel counts bytes. A Parameter wraps its tensor
  in ``torch._utils._rebuild_parameter(tensor, requires_grad, OrderedDict())``. Offsets, sizes and
  strides count elements.

Reading maps the pickle onto plain values: containers stay containers, ``torch.Size`` becomes a
``TorchSize`` (a tuple), a dtype a ``TorchDtype``, numpy arrays/dtypes/scalars are rebuilt from their
bytes, tensors become ``TensorRef`` and instances of allowlisted framework classes become ``Opaque``.
Any other global is refused before anything is called.

The file is untrusted: every integer read from it (zip end records, central directory entries, zip64
extra fields, local headers, pickle memo indices and byte counts, storage numels, tensor offsets,
sizes and strides) is checked against the file's real size and torch's int64 before it is used, and a
bad one is a ``CheckpointFormatError`` naming the file, the field, the value and the limit
(``reshard.io.bounds``, ``reshard.io.zipdir``, ``reshard.io.pickle_scan``).
"""

from __future__ import annotations

from reshard.io.torch_read import read_torch_file
from reshard.io.torch_types import ALLOWED_PREFIXES, Opaque, TensorRef, TensorSpec, TorchDtype, TorchSize, map_tensors
from reshard.io.torch_write import TorchFileWriter, write_torch_file

__all__ = [
    "ALLOWED_PREFIXES", "Opaque", "TensorRef", "TensorSpec", "TorchDtype", "TorchFileWriter", "TorchSize",
    "map_tensors", "read_torch_file", "write_torch_file",
]
