"""The functions a shared library exports, read from its ELF dynamic symbol table.

The build checks a fresh library and the cache checks a stored one against the symbols
the op must provide, before anything is dlopen'ed: a library whose C entry points came
out hidden (a visibility attribute, a type with internal linkage in the signature) or
a truncated file is caught here with a precise message, not as a ctypes AttributeError.
Only 64-bit little-endian ELF (x86-64, aarch64 Linux) is read; anything else is "not a
shared library we can check".
"""
from __future__ import annotations

import struct
from typing import Set

SHT_DYNSYM = 11
STB_GLOBAL, STB_WEAK = 1, 2
STT_FUNC = 2
STV_DEFAULT, STV_PROTECTED = 0, 3


class ElfError(ValueError):
    """The bytes are not a complete 64-bit little-endian ELF file."""


def exported_functions(data: bytes) -> Set[str]:
    """Names of the functions other objects can bind to: defined, global or weak, and of
    default or protected visibility."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    try:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        if shoff + shnum * shentsize > len(data):
            raise ElfError(f"truncated: {len(data)} bytes, but its section headers end at byte "
                           f"{shoff + shnum * shentsize}")
        sections = []
        for i in range(shnum):
            base = shoff + i * shentsize
            sh_type, = struct.unpack_from("<I", data, base + 4)
            offset, size = struct.unpack_from("<QQ", data, base + 0x18)
            link, = struct.unpack_from("<I", data, base + 0x28)
            entsize, = struct.unpack_from("<Q", data, base + 0x38)
            if sh_type != 0 and offset + size > len(data) and sh_type != 8:  # 8: NOBITS (.bss) has no bytes
                raise ElfError("truncated: a section ends past the end of the file")
            sections.append((sh_type, offset, size, link, entsize))
        names: Set[str] = set()
        for sh_type, offset, size, link, entsize in sections:
            if sh_type != SHT_DYNSYM or not entsize:
                continue
            str_off = sections[link][1]
            for pos in range(offset, offset + size, entsize):
                st_name, st_info, st_other, st_shndx = struct.unpack_from("<IBBH", data, pos)
                if st_shndx == 0 or st_info & 0xF != STT_FUNC:
                    continue
                if st_info >> 4 not in (STB_GLOBAL, STB_WEAK) or st_other & 3 not in (STV_DEFAULT, STV_PROTECTED):
                    continue
                end = data.index(b"\0", str_off + st_name)
                names.add(data[str_off + st_name:end].decode("utf-8", "replace"))
        return names
    except (struct.error, IndexError, ValueError) as e:
        if isinstance(e, ElfError):
            raise
        raise ElfError(f"truncated or malformed ELF file ({type(e).__name__})") from None
