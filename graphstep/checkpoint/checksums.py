"""CRC-32 of every stored item of a checkpoint, so that damaged bytes are refused instead of loaded.

DCP stores no checksum, and a tensor's raw bytes decode whatever they hold: a flipped bit inside a data file
of the right size would load as quietly different state. After DCP writes, each saving rank checksums its
share of the data files (rank 0 the ``.metadata`` too) into ``__checksums_<rank>_of_<n>.json``; the entry
``checkpoint.checksummed`` tells a load they must be there. A load checks that they cover every item before
reading any data, then checks every item a rank reads before decoding it.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any, Optional

from .integrity import CheckpointError

KEY = "checkpoint.checksummed"  # the checkpoint entry that says checksum files were written
_NAME = re.compile(r"__checksums_(\d+)_of_(\d+)\.json$")
_METADATA = ".metadata"
_CHUNK = 1 << 24
_RESTORE = "copy the checkpoint again from where it came from, or load an earlier one"


def file_name(rank: int, ranks: int) -> str:
    return f"__checksums_{rank}_of_{ranks}.json"


def _range(offset: int, length: int) -> str:
    return f"{offset}+{length}"


def crc_of_range(f, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of the open binary file ``f`` from ``offset``, read in chunks."""
    f.seek(offset)
    crc, left = 0, length
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            break  # a short file: the CRC of what is there cannot match
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def _items_by_file(metadata) -> dict[str, list[tuple[int, int]]]:
    items: dict[str, list[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        items.setdefault(info.relative_path, []).append((info.offset, info.length))
    return items


def write(directory: str, metadata, rank: int, ranks: int) -> None:
    """This rank's checksum file for the checkpoint DCP just wrote into ``directory`` (``metadata``: its
    metadata). Every rank of the save calls it."""
    by_file = _items_by_file(metadata)
    table: dict[str, dict[str, int]] = {}
    for name in sorted(by_file)[rank::ranks]:
        with open(os.path.join(directory, name), "rb") as f:
            table[name] = {_range(o, n): crc_of_range(f, o, n) for o, n in sorted(set(by_file[name]))}
    if rank == 0:
        path = os.path.join(directory, _METADATA)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            table[_METADATA] = {_range(0, size): crc_of_range(f, 0, size)}
    with open(os.path.join(directory, file_name(rank, ranks)), "w") as f:
        json.dump({"algorithm": "crc32", "files": table}, f)
        f.flush()
        os.fsync(f.fileno())


def read(directory: str, metadata) -> Optional[dict[str, dict[str, int]]]:
    """{file: {"offset+length": CRC}} of the checkpoint in ``directory``, checked to be complete: every
    checksum file of the save there and readable, every item of ``metadata`` covered, the ``.metadata`` file
    unchanged. None for a checkpoint saved without checksums (no ``checkpoint.checksummed`` entry)."""
    if KEY not in metadata.state_dict_metadata:
        return None
    found = {}
    for entry in os.listdir(directory):
        match = _NAME.match(entry)
        if match:
            found[entry] = (int(match.group(1)), int(match.group(2)))
    counts = {n for _, n in found.values()}
    if len(counts) != 1:
        what = "none is" if not counts else f"files of saves on {sorted(counts)} ranks are"
        raise CheckpointError(f"{directory}: the checkpoint was saved with checksum files "
                              f"({file_name(0, 1)}, ...), but {what} there: a partial copy of the checkpoint "
                              f"directory?; {_RESTORE}")
    (ranks,) = counts
    table: dict[str, dict[str, int]] = {}
    for rank in range(ranks):
        path = os.path.join(directory, file_name(rank, ranks))
        if file_name(rank, ranks) not in found:
            raise CheckpointError(f"{path}: missing: the checkpoint was saved with one checksum file per rank "
                                  f"of {ranks}; {_RESTORE}")
        for name, ranges in _parse(path).items():
            table.setdefault(name, {}).update(ranges)
    for name, items in _items_by_file(metadata).items():
        for offset, length in items:
            if _range(offset, length) not in table.get(name, {}):
                raise CheckpointError(f"{os.path.join(directory, name)}: bytes {offset}+{length}, which the "
                                      "checkpoint's metadata lists, have no checksum: the metadata or the "
                                      f"checksum files are damaged; {_RESTORE}")
    _verify_file(directory, _METADATA, table)
    return table


def _parse(path: str) -> dict[str, dict[str, int]]:
    try:
        with open(path) as f:
            saved: Any = json.load(f)
        files = saved["files"]
        if saved.get("algorithm") != "crc32" or not all(
                isinstance(ranges, dict) and all(isinstance(c, int) for c in ranges.values())
                for ranges in files.values()):
            raise ValueError("not a table of CRC-32 per byte range")
        return files
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: the checksum file is damaged ({type(err).__name__}: {err}); "
                              f"{_RESTORE}") from err


def _verify_file(directory: str, name: str, table: dict) -> None:
    ranges = table.get(name)
    if not ranges:
        raise CheckpointError(f"{os.path.join(directory, name)}: has no checksum: the checksum files are "
                              f"damaged; {_RESTORE}")
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        for key, expected in ranges.items():
            offset, length = map(int, key.split("+"))
            if offset + length != os.path.getsize(path) or crc_of_range(f, offset, length) != expected:
                raise _damaged(path, offset, length)


def verify_item(f, path: str, table: dict, relative_path: str, offset: int, length: int) -> None:
    """Before an item of a data file (``f``, open) is decoded: its bytes' CRC-32 is the saved one."""
    if crc_of_range(f, offset, length) != table[relative_path][_range(offset, length)]:
        raise _damaged(path, offset, length)


def _damaged(path: str, offset: int, length: int) -> CheckpointError:
    return CheckpointError(f"{path}: damaged: bytes {offset}+{length} do not match the checksum the save "
                           f"recorded (the file was changed after the save, or the disk returned other bytes); "
                           f"{_RESTORE}")
