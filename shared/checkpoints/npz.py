"""The arrays of an ``np.savez`` archive, memory-mapped where they are stored uncompressed.

``np.savez`` writes each array as a ``.npy`` member of a ZIP file without compression
(``ZIP_STORED``): the member's bytes sit in the archive as they are, after the ZIP local
header and the ``.npy`` header. ``NpzArrays`` finds that offset (the local header's fixed 30
bytes plus its name and extra fields, then ``np.lib.format``'s header) and returns each array
as a read-only ``np.memmap``: reading rows ``a:b`` of a member reads those pages only, so a
shard restoring a few rows of a large table does not load the table. A compressed member
(``np.savez_compressed``) cannot be mapped: it is read whole, with a warning.

Opening checks what can be checked without reading the data: the ZIP directory, every
member's ``.npy`` header (no object dtypes: nothing is unpickled), and that every member's
data lies inside the file. CRCs are not verified (that would read everything).
"""

from __future__ import annotations

import logging
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("downpour.server")

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # the ZIP local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


@dataclass(frozen=True)
class Member:
    """Where one array lives in the archive: data offset (None: compressed), shape, dtype."""

    name: str
    offset: int | None
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, f: object, size: int) -> Member:
    """The ``.npy`` header of one member, and its data offset when it is stored."""
    name = info.filename.removesuffix(".npy")
    with zf.open(info) as m:
        version = np.lib.format.read_magic(m)
        reader = _HEADER_READERS.get(version)
        if reader is None:
            raise ValueError(f"member {name}: .npy format {version} is not read here")
        shape, fortran, dtype = reader(m)
        header_len = m.tell()
    if dtype.hasobject:
        raise ValueError(f"member {name}: object arrays are refused (no pickle)")
    if info.compress_type != zipfile.ZIP_STORED:
        return Member(name, None, tuple(shape), dtype, fortran)
    f.seek(info.header_offset)  # type: ignore[attr-defined]
    fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))  # type: ignore[attr-defined]
    if fields[0] != _LOCAL_MAGIC:
        raise ValueError(f"member {name}: no ZIP local header at {info.header_offset}")
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10] + header_len
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if start + nbytes > size:
        raise ValueError(f"member {name}: {nbytes} bytes at {start} run past the file's end")
    return Member(name, start, tuple(shape), dtype, fortran)


class NpzArrays(Mapping[str, np.ndarray]):
    """The arrays of one ``.npz`` file by name, memory-mapped on access (see the module)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with zipfile.ZipFile(self.path) as zf, open(self.path, "rb") as f:
            infos = [i for i in zf.infolist() if i.filename.endswith(".npy")]
            members = [_member(zf, i, f, size) for i in infos]
        self.members = {m.name: m for m in members}
        self._warned: set[str] = set()

    def __getitem__(self, name: str) -> np.ndarray:
        return self.read_member(self.members[name])

    def read_member(self, m: Member) -> np.ndarray:
        """One member's array: a read-only memory map, or read whole when compressed."""
        if m.offset is None:
            return self._read_whole(m)
        order = "F" if m.fortran else "C"
        if int(np.prod(m.shape, dtype=np.int64)) == 0:  # mmap cannot map zero bytes
            return np.empty(m.shape, m.dtype, order=order)
        shape = m.shape or (1,)
        a = np.memmap(self.path, m.dtype, "r", m.offset, shape, order)
        return a.reshape(()) if not m.shape else a

    def _read_whole(self, m: Member) -> np.ndarray:
        """A compressed member, read and decompressed whole."""
        if m.name not in self._warned:
            self._warned.add(m.name)
            log.warning(
                "%s: member %s is compressed and cannot be memory-mapped: reading all %d bytes",
                self.path,
                m.name,
                int(np.prod(m.shape, dtype=np.int64)) * m.dtype.itemsize,
            )
        with zipfile.ZipFile(self.path) as zf, zf.open(m.name + ".npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)
