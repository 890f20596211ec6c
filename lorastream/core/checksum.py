"""The chunk checksum of the tensor stream: CRC-32C (Castagnoli), hardware-accelerated.

The ``crc32c`` package uses the SSE4.2/ARMv8 CRC instructions (about 25 GB/s here, against 4 GB/s
for ``zlib.crc32``), takes any buffer (so a zero-copy view of a received chunk is checked in
place) and releases the GIL on large inputs. A stream checksums every chunk on both ends.
"""

from __future__ import annotations

from crc32c import crc32c as _crc32c


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C of ``data`` as an unsigned 32-bit integer."""
    return _crc32c(data)
