"""scripts/prune_fatbin.py on a small ELF file with fatbins built here: which entries stay, byte
for byte, where every fatbin stays, and the errors that leave the file alone."""
import importlib.util
import pathlib
import struct
import sys

import pytest

_path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "prune_fatbin.py"
_spec = importlib.util.spec_from_file_location("prune_fatbin", _path)
pf = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pf  # dataclasses look their module up there
_spec.loader.exec_module(pf)

PTX, CUBIN = 1, 2
SM_A = pf.FLAG_ARCH_SPECIFIC


def entry(kind, arch, flags=0, payload=b"", header_size=64):
    """An entry header as nvcc writes it (the fields the pruner reads) and its payload."""
    head = bytearray(header_size)
    struct.pack_into("<HHIQ", head, 0, kind, 0x0101, header_size, len(payload))
    struct.pack_into("<IIHHI", head, 16, len(payload), 0, 8, 1, arch)
    struct.pack_into("<Q", head, 40, flags | 0x11)
    return bytes(head) + payload


def fatbin(*entries):
    body = b"".join(entries)
    return struct.pack("<IHHQ", pf.FATBIN_MAGIC, 1, 16, len(body)) + body


def payload(tag, n):
    return (tag.encode() * n)[:n]


def elf(sections):
    """An ELF64 little-endian file with the given (name, bytes) sections and .shstrtab."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    blob = bytearray(64)
    placed = []
    for name, data in sections + [(".shstrtab", names)]:
        blob += bytes(-len(blob) % 8)
        placed.append((names.index(name.encode() + b"\0"), len(blob), len(data)))
        blob += data
    blob += bytes(-len(blob) % 8)
    shoff = len(blob)
    blob += bytes(64)  # section 0
    for name_at, off, size in placed:
        blob += struct.pack("<IIQQQQIIQQ", name_at, 1, 2, 0x1000 + off, off, size, 0, 0, 8, 0)
    blob[:16] = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    struct.pack_into("<HHI", blob, 16, 3, 62, 1)  # ET_DYN, x86-64
    struct.pack_into("<Q", blob, 0x28, shoff)
    struct.pack_into("<HHHHHH", blob, 0x34, 64, 56, 0, 64, len(placed) + 1, len(placed))
    return bytearray(blob)


# Three fatbins with zero padding between them: cubins of four architectures, sm_90a beside sm_90
# in the second, a PTX entry, and a 112-byte entry header as sm_100a's have.
E = {
    "1/sm_80": entry(CUBIN, 80, payload=payload("a", 40)),
    "1/sm_90": entry(CUBIN, 90, payload=payload("b", 56)),
    "1/sm_100a": entry(CUBIN, 100, SM_A, payload("c", 24), header_size=112),
    "2/sm_90": entry(CUBIN, 90, payload=payload("d", 32)),
    "2/sm_75": entry(CUBIN, 75, payload=payload("e", 16)),
    "2/sm_90a": entry(CUBIN, 90, SM_A, payload("f", 48)),
    "3/ptx_90": entry(PTX, 90, payload=payload("g", 64)),
    "3/sm_120": entry(CUBIN, 120, payload=payload("h", 8)),
}
FATBINS = [
    fatbin(E["1/sm_80"], E["1/sm_90"], E["1/sm_100a"]),
    fatbin(E["2/sm_90"], E["2/sm_75"], E["2/sm_90a"]),
    fatbin(E["3/ptx_90"], E["3/sm_120"]),
]
TEXT = payload("T", 200)


def library(fatbins=FATBINS):
    section = fatbins[0] + bytes(16) + fatbins[1] + bytes(8) + fatbins[2] + bytes(24)
    return elf([(".text", TEXT), (".nv_fatbin", section), (".data", payload("D", 40))])


def fatbin_offsets(data):
    s = pf.fatbin_sections(data)[0]
    return [fb.offset for fb in pf.read_fatbins(data, s.offset, s.size)]


def test_lists_every_entry_as_cuobjdump_names_it():
    assert pf.list_entries(library()) == [
        (1, "cubin", "sm_80"), (1, "cubin", "sm_90"), (1, "cubin", "sm_100a"),
        (2, "cubin", "sm_90"), (2, "cubin", "sm_75"), (2, "cubin", "sm_90a"),
        (3, "ptx", "sm_90"), (3, "cubin", "sm_120"),
    ]


@pytest.mark.parametrize("archs, kept", [
    (["90"], [["1/sm_90"], ["2/sm_90", "2/sm_90a"], ["3/ptx_90"]]),
    (["sm_90", "120"], [["1/sm_90"], ["2/sm_90", "2/sm_90a"], ["3/ptx_90", "3/sm_120"]]),
    (["80", "75", "90a", "120"], [["1/sm_80"], ["2/sm_75", "2/sm_90a"], ["3/sm_120"]]),
])
def test_keeps_exactly_the_named_archs_in_place_and_zeroes_the_rest(archs, kept):
    original = library()
    data = bytearray(original)
    report = pf.prune(data, pf.parse_archs(archs))

    assert len(data) == len(original)
    section = pf.fatbin_sections(original)[0]
    start, end = section.offset, section.offset + section.size
    assert data[:start] == original[:start] and data[end:] == original[end:]

    # The section as it must be, byte for byte: each fatbin at its old offset, its header's size
    # field the kept entries' bytes, the kept entries verbatim, zeros to the fatbin's old end,
    # the padding between fatbins untouched.
    expected = bytearray(original[start:end])
    for at, fb, names in zip(fatbin_offsets(original), FATBINS, kept):
        body = b"".join(E[n] for n in names)
        at -= start
        expected[at:at + 16] = struct.pack("<IHHQ", pf.FATBIN_MAGIC, 1, 16, len(body))
        expected[at + 16:at + len(fb)] = body + bytes(len(fb) - 16 - len(body))
    assert data[start:end] == expected

    assert fatbin_offsets(data) == fatbin_offsets(original)
    n_kept = sum(map(len, kept))
    assert (report.fatbins, report.kept, report.dropped, report.unmatched) == (3, n_kept, 8 - n_kept, 0)
    assert report.kept_bytes == sum(len(E[n]) for names in kept for n in names)
    assert report.kept_bytes + report.zeroed_bytes == sum(len(fb) - 16 for fb in FATBINS)
    assert pf.list_entries(data) == [
        (i, "ptx" if "ptx" in n else "cubin", "sm_" + n.split("_")[-1])
        for i, names in enumerate(kept, 1) for n in names]


def test_a_fatbin_without_the_archs_is_an_error_unless_kept_whole():
    original = library()
    data = bytearray(original)
    with pytest.raises(pf.FatbinError, match=r"no code for the architectures .*sm_120, sm_90"):
        pf.prune(data, pf.parse_archs(["75", "80"]))
    assert data == original  # nothing written

    report = pf.prune(data, pf.parse_archs(["75", "80"]), keep_unmatched=True)
    assert (report.fatbins, report.kept, report.dropped, report.unmatched) == (3, 2, 4, 1)
    third = fatbin_offsets(original)[2]
    assert data[third:third + len(FATBINS[2])] == FATBINS[2]  # left whole


def test_arch_specific_cubins_are_kept_by_the_number_or_alone():
    assert pf.parse_archs(["90", "sm_90a", "compute_100"]) == {(90, None), (90, True), (100, None)}
    for bad in (["sm90x"], ["hopper"], []):
        with pytest.raises(pf.FatbinError):
            pf.parse_archs(bad)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b.__setitem__(slice(0, 4), b"\0ELF"), "not an ELF file"),
    (lambda b: b.__setitem__(4, 1), "64-bit little-endian"),
])
def test_not_an_elf64_file_is_refused(damage, message):
    data = library()
    damage(data)
    with pytest.raises(pf.FatbinError, match=message):
        pf.prune(data, pf.parse_archs(["90"]))


def test_a_library_without_device_code_is_refused():
    data = elf([(".text", TEXT)])
    with pytest.raises(pf.FatbinError, match="no .nv_fatbin or __nv_relfatbin section"):
        pf.prune(data, pf.parse_archs(["90"]))


def test_bytes_that_are_neither_fatbin_nor_padding_are_refused():
    section = FATBINS[0] + payload("x", 8) + FATBINS[1]
    data = elf([(".nv_fatbin", section)])
    original = bytes(data)
    with pytest.raises(pf.FatbinError, match="no fatbin header at file offset"):
        pf.prune(data, pf.parse_archs(["90"]))
    assert data == original


def test_an_entry_running_past_its_fatbin_is_refused():
    bad = bytearray(FATBINS[1])
    struct.pack_into("<Q", bad, 16 + 8, 10_000)  # first entry's payload size
    data = elf([(".nv_fatbin", FATBINS[0] + bytes(bad))])
    with pytest.raises(pf.FatbinError, match="runs past the fatbin"):
        pf.prune(data, pf.parse_archs(["90"]))


def test_command_line(tmp_path, capsys):
    src, dst = tmp_path / "lib.so", tmp_path / "out.so"
    src.write_bytes(library())
    src.chmod(0o755)
    assert pf.main([str(src), str(dst), "90"]) == 0
    assert "3 fatbins: kept 4 entries" in capsys.readouterr().out
    assert dst.stat().st_mode & 0o777 == 0o755
    assert pf.main(["--list", str(dst)]) == 0
    assert capsys.readouterr().out.split("\n")[:4] == [
        "fatbin    1: cubin sm_90", "fatbin    2: cubin sm_90", "fatbin    2: cubin sm_90a",
        "fatbin    3: ptx sm_90"]
    assert pf.main([str(src), str(dst), "61"]) == 1
    assert "no code for the architectures" in capsys.readouterr().err
