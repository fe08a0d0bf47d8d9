"""One array out of an NPZ file held in memory, without copying it.

`np.load(io.BytesIO(data))` reads the member out of the zip into a new
buffer and builds the array from that: for DLIO's UNet3D samples (146 MB
each) a second and third copy of every sample beside the bytes the client
returned, which pushed the Python-client reader's DataLoader workers past
their memory cap. `np.savez` stores members uncompressed, so the array
can be a read-only view of `data` itself; compressed members fall back to
`np.load`.
"""

from __future__ import annotations

import io
import struct
import zipfile

import numpy as np

# A zip local file header: signature, then fixed fields up to the name's
# and the extra field's lengths (at offsets 26 and 28), 30 bytes in all.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"


def array(data: bytes, name: str = "x") -> np.ndarray:
    """The array `name` of the NPZ file `data`: a view of `data` where the
    member is stored uncompressed, otherwise a decoded copy."""
    view = memoryview(data)
    with zipfile.ZipFile(io.BytesIO(view)) as z:
        try:
            info = z.getinfo(f"{name}.npy")
        except KeyError:
            raise KeyError(f"{name} is not an array in this NPZ file") from None
        if info.compress_type != zipfile.ZIP_STORED:
            return np.load(io.BytesIO(data), allow_pickle=False)[name]
    at = info.header_offset
    sig, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, at)
    if sig != _LOCAL_SIGNATURE:
        raise ValueError(f"no zip local header at {at} for {info.filename}")
    start = at + _LOCAL_HEADER.size + name_len + extra_len
    member = view[start : start + info.file_size]
    # The .npy header: magic, version, then a dict of dtype, order, shape.
    head = io.BytesIO(member[:65536])
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    if dtype.hasobject:
        raise ValueError(f"{name} holds Python objects; not read from a shared buffer")
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(member, dtype=dtype, count=count, offset=head.tell())
    return flat.reshape(shape, order="F" if fortran else "C")
