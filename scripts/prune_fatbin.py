#!/usr/bin/env python3
"""Keep only the device code of chosen SM architectures in a CUDA shared library's fatbins.

A CUDA library (an ELF64 little-endian shared object) keeps its device code in the section
`.nv_fatbin` (relocatable device code: `__nv_relfatbin`): a run of fatbins, each a 16-byte
header followed by its entries, each entry an entry header and one cubin (or PTX) for one
architecture::

    fatbin header   u32 magic 0xBA55ED50 | u16 version | u16 header size | u64 size of the entries
    entry header    u16 kind (1 PTX, 2 cubin) | u16 version | u32 header size | u64 payload size
                    | ... | u32 SM arch at +28 (90 for sm_90) | u64 flags at +40
                    (flag 0x100000: the arch-specific variant, sm_90a)

The host code registers each fatbin by its address, and nothing points inside one. So each
fatbin is rewritten where it is: its header, then the kept entries one after another (the
header's size says how many bytes they take), then zeros up to the fatbin's old end. Every
fatbin keeps its address, the file keeps its size and layout, and the zeros compress away.
nvprune does this for object files and static libraries only.

    prune_fatbin.py IN.so OUT.so 90 [90a 100 ...]   keep sm_90 (plain and 90a; "90a": only 90a)
    prune_fatbin.py --list IN.so                     list the entries, as cuobjdump --list-elf does

A fatbin with none of the named architectures is an error (its kernels could not run on
them); --keep-unmatched leaves such fatbins whole and says how many there were. Plain
Python, standard library only.
"""
from __future__ import annotations

import argparse
import re
import shutil
import struct
import sys
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
KIND_NAMES = {1: "ptx", 2: "cubin"}
FLAG_ARCH_SPECIFIC = 0x100000  # cuobjdump lists such a cubin as sm_<arch>a
SHT_NOBITS = 8


class FatbinError(ValueError):
    """The file is not what this tool can rewrite safely; nothing was written."""


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int  # in the file
    size: int


@dataclass(frozen=True)
class Entry:
    offset: int  # in the file
    kind: int
    arch: int
    flags: int
    header_size: int
    payload_size: int

    @property
    def size(self) -> int:
        return self.header_size + self.payload_size

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch}{'a' if self.flags & FLAG_ARCH_SPECIFIC else ''}"

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, f"kind{self.kind}")


@dataclass(frozen=True)
class Fatbin:
    offset: int  # in the file
    header_size: int
    entries_size: int
    entries: tuple[Entry, ...]

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.entries_size


@dataclass
class Report:
    fatbins: int = 0
    kept: int = 0
    dropped: int = 0
    kept_bytes: int = 0
    zeroed_bytes: int = 0
    unmatched: int = 0  # fatbins left whole under keep_unmatched

    def __str__(self) -> str:
        s = (f"{self.fatbins} fatbins: kept {self.kept} entries ({self.kept_bytes} bytes), "
             f"zeroed {self.dropped} ({self.zeroed_bytes} bytes)")
        if self.unmatched:
            s += f"; {self.unmatched} fatbins with none of the architectures left whole"
        return s


def elf_sections(data: bytes) -> list[Section]:
    """The section headers of an ELF64 little-endian file."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise FatbinError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise FatbinError("only 64-bit little-endian ELF files are supported")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0:
        raise FatbinError("the ELF file has no section headers")
    if shentsize < 64 or shoff + shentsize > len(data):
        raise FatbinError("bad ELF section header table")

    def header(i: int) -> tuple:
        at = shoff + i * shentsize
        if at + 64 > len(data):
            raise FatbinError(f"ELF section header {i} lies past the end of the file")
        # name, type, flags, addr, offset, size, link, info, addralign, entsize
        return struct.unpack_from("<IIQQQQIIQQ", data, at)

    first = header(0)
    if shnum == 0:  # more than 0xff00 sections: the count is in section 0's size
        shnum = first[5]
    if shstrndx == 0xFFFF:  # SHN_XINDEX: the index is in section 0's link
        shstrndx = first[6]
    raw = [header(i) for i in range(shnum)]
    if not 0 < shstrndx < shnum:
        raise FatbinError("the ELF file has no section name table")
    names_at, names_size = raw[shstrndx][4], raw[shstrndx][5]
    names = data[names_at:names_at + names_size]

    sections = []
    for h in raw:
        end = names.find(b"\0", h[0])
        name = names[h[0]:end if end >= 0 else len(names)].decode("ascii", "replace")
        sections.append(Section(name, h[1], h[4], h[5]))
    return sections


def read_fatbins(data: bytes, start: int, size: int) -> list[Fatbin]:
    """The fatbins of the region [start, start + size) of data; zero padding may separate them."""
    end = start + size
    if end > len(data):
        raise FatbinError("the fatbin section lies past the end of the file")
    fatbins = []
    pos = start
    while pos < end:
        if end - pos < 16 or struct.unpack_from("<I", data, pos)[0] != FATBIN_MAGIC:
            # Only zero padding may lie between and after fatbins.
            word = data[pos:min(pos + 8, end)]
            if any(word):
                raise FatbinError(f"no fatbin header at file offset {pos:#x} (bytes {word.hex()})")
            pos += len(word)
            continue
        _, _version, header_size, entries_size = struct.unpack_from("<IHHQ", data, pos)
        if header_size < 16 or pos + header_size + entries_size > end:
            raise FatbinError(f"fatbin at {pos:#x}: header size {header_size} or entries size "
                              f"{entries_size} runs past the section")
        entries = []
        e, stop = pos + header_size, pos + header_size + entries_size
        while e < stop:
            if stop - e < 48:
                raise FatbinError(f"fatbin at {pos:#x}: truncated entry header at {e:#x}")
            kind, _ev, eh_size, payload = struct.unpack_from("<HHIQ", data, e)
            arch, = struct.unpack_from("<I", data, e + 28)
            flags, = struct.unpack_from("<Q", data, e + 40)
            if eh_size < 48 or e + eh_size + payload > stop:
                raise FatbinError(f"fatbin at {pos:#x}: entry at {e:#x} (header {eh_size}, "
                                  f"payload {payload} bytes) runs past the fatbin")
            entries.append(Entry(e, kind, arch, flags, eh_size, payload))
            e += eh_size + payload
        fatbins.append(Fatbin(pos, header_size, entries_size, tuple(entries)))
        pos = stop
    return fatbins


def parse_archs(specs: list[str]) -> set[tuple[int, bool | None]]:
    """'90' -> (90, None): every variant of sm_90; '90a' / 'sm_90a' -> (90, True): sm_90a only."""
    out = set()
    for spec in specs:
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)(a?)", spec.strip())
        if not m:
            raise FatbinError(f"bad architecture {spec!r}: expected e.g. 90, 90a or sm_90")
        out.add((int(m.group(1)), True if m.group(2) else None))
    if not out:
        raise FatbinError("name at least one architecture to keep")
    return out


def wanted(entry: Entry, archs: set[tuple[int, bool | None]]) -> bool:
    specific = bool(entry.flags & FLAG_ARCH_SPECIFIC)
    return (entry.arch, None) in archs or (specific and (entry.arch, True) in archs)


def fatbin_sections(data: bytes) -> list[Section]:
    found = [s for s in elf_sections(data) if s.name in FATBIN_SECTIONS and s.type != SHT_NOBITS]
    if not found:
        raise FatbinError(f"no {' or '.join(FATBIN_SECTIONS)} section: no device code to prune")
    return found


def prune(data: bytearray, archs: set[tuple[int, bool | None]],
          keep_unmatched: bool = False) -> Report:
    """Rewrite every fatbin of the ELF image `data` in place; nothing is changed on an error."""
    plans = []
    report = Report()
    for section in fatbin_sections(data):
        for fb in read_fatbins(data, section.offset, section.size):
            report.fatbins += 1
            keep = [e for e in fb.entries if wanted(e, archs)]
            if not keep:
                if not keep_unmatched:
                    have = ", ".join(sorted({e.arch_name for e in fb.entries})) or "no entries"
                    raise FatbinError(f"fatbin at {fb.offset:#x} has no code for the architectures "
                                      f"asked for (it has {have}); --keep-unmatched leaves such "
                                      "fatbins whole")
                report.unmatched += 1
                continue
            plans.append((fb, keep))
    for fb, keep in plans:
        body = b"".join(bytes(data[e.offset:e.offset + e.size]) for e in keep)
        struct.pack_into("<Q", data, fb.offset + 8, len(body))
        start = fb.offset + fb.header_size
        data[start:fb.end] = body + bytes(fb.entries_size - len(body))
        report.kept += len(keep)
        report.dropped += len(fb.entries) - len(keep)
        report.kept_bytes += len(body)
        report.zeroed_bytes += fb.entries_size - len(body)
    return report


def list_entries(data: bytes) -> list[tuple[int, str, str]]:
    """(fatbin number from 1, kind, arch name) for every entry, in file order."""
    rows = []
    n = 0
    for section in fatbin_sections(data):
        for fb in read_fatbins(data, section.offset, section.size):
            n += 1
            rows.extend((n, e.kind_name, e.arch_name) for e in fb.entries)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the entries of IN and exit")
    ap.add_argument("--keep-unmatched", action="store_true",
                    help="leave fatbins with none of the architectures whole instead of failing")
    ap.add_argument("input")
    ap.add_argument("output", nargs="?")
    ap.add_argument("archs", nargs="*", help="SM architectures to keep: 90, 90a, sm_90, ...")
    args = ap.parse_args(argv)
    try:
        if args.list:
            with open(args.input, "rb") as f:
                data = f.read()
            for n, kind, arch in list_entries(data):
                print(f"fatbin {n:4d}: {kind} {arch}")
            return 0
        if not args.output:
            ap.error("OUT and at least one architecture are required")
        archs = parse_archs(args.archs)
        with open(args.input, "rb") as f:
            data = bytearray(f.read())
        report = prune(data, archs, keep_unmatched=args.keep_unmatched)
    except (FatbinError, OSError) as e:
        print(f"prune_fatbin: {args.input}: {e}", file=sys.stderr)
        return 1
    with open(args.output, "wb") as f:
        f.write(data)
    if args.output != args.input:
        shutil.copymode(args.input, args.output)
    print(f"prune_fatbin: {args.output}: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
