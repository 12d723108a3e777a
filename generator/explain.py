"""`fusegen explain KERNEL`: one kernel of an output package as a reviewer wants to see it: what
it was specialised for, its NVRTC options, each arch's binary with its size and, for each of its
functions (a dtype's kernel, a second entry point), the registers and stack frame the compiler gave
it (read from the cubin's .nv.info section: a stack frame above 0 bytes means local memory, i.e.
spills), then its CUDA source."""

from __future__ import annotations

import difflib
import json
import struct
from pathlib import Path

from .errors import UsageError
from .kernels import DTYPES
from .output import MANIFEST

EIATTR_FRAME_SIZE = 0x11  # bytes of local memory (stack) per thread
EIATTR_REGCOUNT = 0x2F  # registers per thread
ELF_SYMBOL_SIZE = 24  # an Elf64_Sym: name, info, other, section index, value, size
EIFMT_SIZES = {1: 0, 2: 2, 3: 2}  # attribute formats with a fixed-size value; 4: a 2-byte size, then that many bytes


SHT_NOBITS = 8  # a section that reserves memory (a kernel's shared memory) but holds no bytes in the file


def elf_sections(image: bytes) -> dict[str, bytes]:
    """{section name: contents} of a 64-bit little-endian ELF file (a cubin); a SHT_NOBITS section,
    which holds no bytes in the file, as zeros of the size it reserves."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    entry, count, names_index = struct.unpack_from("<HHH", image, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * entry) for i in range(count)]
    names = headers[names_index]

    def name(offset: int) -> str:
        start = names[4] + offset
        return image[start:image.index(b"\0", start)].decode()

    return {name(h[0]): bytes(h[5]) if h[1] == SHT_NOBITS else image[h[4]:h[4] + h[5]] for h in headers}


def symbols(sections: dict[str, bytes]) -> list[str]:
    """The names of an ELF file's symbols, by symbol index (.symtab entries, names in .strtab)."""
    table, names = sections.get(".symtab", b""), sections.get(".strtab", b"")
    found = []
    for offset in range(0, len(table) - ELF_SYMBOL_SIZE + 1, ELF_SYMBOL_SIZE):
        (start,) = struct.unpack_from("<I", table, offset)
        found.append(names[start:names.index(b"\0", start)].decode())
    return found


def resources(image: bytes) -> dict[str, dict[str, int]]:
    """{function: its registers and stack frame bytes per thread} as a cubin records them: the
    .nv.info attributes, each (symbol index, value)."""
    sections = elf_sections(image)
    info, names = sections.get(".nv.info", b""), symbols(sections)
    found: dict[str, dict[str, int]] = {}
    i = 0
    while i + 2 <= len(info):
        fmt, attr = info[i], info[i + 1]
        i += 2
        if fmt == 4:
            (size,) = struct.unpack_from("<H", info, i)
            value, i = info[i + 2:i + 2 + size], i + 2 + size
        else:
            value, i = info[i:i + EIFMT_SIZES[fmt]], i + EIFMT_SIZES[fmt]
        if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(value) == 8:  # (function index, value)
            function, number = struct.unpack("<II", value)
            found.setdefault(names[function], {})["registers" if attr == EIATTR_REGCOUNT else "stack_frame"] = number
    return found


def explain(package: Path, where: str, kernel: str) -> str:
    """The report for ``kernel`` (with or without a dtype suffix) of the package in ``package``."""
    manifest_file = package / MANIFEST
    if not manifest_file.is_file():
        raise UsageError(f"{where} holds no {MANIFEST}: generate the package first (`fusegen generate`)")
    kernels = json.loads(manifest_file.read_text())["kernels"]
    suffixes = [suffix for suffix, *_ in DTYPES.values()]
    name = next((kernel[:-len(s) - 1] for s in suffixes if kernel.endswith("_" + s)), kernel)
    if name not in kernels:
        close = difflib.get_close_matches(name, kernels, n=3)
        hint = (f"; did you mean {', '.join(close)}?" if close
                else f"; it has {len(kernels)} kernels (see {where}/kernels/)")
        raise UsageError(f"{where} has no kernel named {kernel!r}{hint}")
    entry = kernels[name]
    lines = [f"kernel {name}: {entry.get('specialisation', '')}"]
    if entry.get("full_name", name) != name:
        lines.append(f"full name: {entry['full_name']} (cut to {name})")
    binaries = entry["binaries"].values()
    options = {tuple(o for o in b["options"] if not o.startswith("--gpu-architecture")) for b in binaries}
    nvrtc = sorted({b["nvrtc"] for b in binaries})
    for opts in sorted(options):
        lines.append(f"NVRTC {', '.join(nvrtc)}: --gpu-architecture=<arch> {' '.join(opts)}")
    for arch, binary in sorted(entry["binaries"].items(), key=lambda item: int(item[0].split("_")[1])):
        if "ptxas" in binary:  # an arch assembled from another's PTX (nvrtc.ASSEMBLED_FROM)
            compiled = next(o for o in binary["options"] if o.startswith("--gpu-architecture=")).partition("=")[2]
            lines.append(f"ptxas {binary['ptxas']['version']}: {arch} assembled from the PTX of the {compiled} "
                         f"compile ({' '.join(binary['ptxas']['options'])})")
    functions = [symbol for symbols_of_dtype in entry.get("entries", {}).values() for symbol in symbols_of_dtype]
    lines += ["", f"{'binary, then its functions':44} {'bytes':>9} {'registers':>9} {'stack frame':>11}"]
    by_arch = sorted(entry["binaries"].items(),  # cubins by number, then PTX
                     key=lambda item: (item[0].startswith("compute"), int(item[0].split("_")[1])))
    for arch, binary in by_arch:
        path = package / binary["file"]
        size = path.stat().st_size if path.is_file() else 0
        found = resources(path.read_bytes()) if path.is_file() and arch.startswith("sm_") else {}
        lines.append(f"{binary['file'].split('/')[-1]:44} {size:>9}")
        for function in functions:
            own = found.get(function, {})
            frame = f"{own['stack_frame']} B" if "stack_frame" in own else "-"
            lines.append(f"  {function:42} {'':>9} {own.get('registers', '-'):>9} {frame:>11}")
    lines.append("(registers and stack frame per thread, as the cubin records them; a stack frame above 0 B "
                 "is local memory: spills or local arrays; PTX is compiled by the driver, so it has neither)")
    source = entry.get("source", f"kernels/{name}.cu")
    lines += ["", f"--- {where}/{source} ---", (package / source).read_text().rstrip() if (package / source).is_file()
              else "(missing: regenerate the package)"]
    return "\n".join(lines)
