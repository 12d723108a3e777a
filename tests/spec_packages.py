"""A package generated from a spec's text in a test's folder, imported for the tests of one file."""

import contextlib
import importlib
import sys

from fusegen import build, output


@contextlib.contextmanager
def imported_package(folder, spec_name, spec_text, package, dtypes=("float32",), files=None, fp8=(), fp8_min_rows=0,
                     archs=()):
    """Writes ``spec_text`` as ``folder/spec_name`` (and ``files``, name -> text: the user's own
    modules the spec imports), generates ``folder/package`` from it (without binaries by default: CPU) and
    yields it imported, with ``folder`` on sys.path for the block (a generated module imports the
    user's modules when it is built). ``archs``: the binaries' targets (a cuda test's: its GPU's).
    ``fp8``: [tool.fusegen] fp8, the FP8 recipes of every pipeline
    with a GEMM; ``fp8_min_rows``: [tool.fusegen] fp8_min_rows (0: FP8 at any size, TE's way)."""
    for name, text in {**(files or {}), spec_name: spec_text}.items():
        (folder / name).write_text(text, encoding="utf-8")
    config = build.Config((folder / spec_name,), folder / package, archs=archs, dtypes=dtypes, root=folder, fp8=fp8,
                          fp8_min_rows=fp8_min_rows)
    output.write_package(build.build_package(config), config.out)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(package)
    finally:
        sys.path.remove(str(folder))
        # forgotten, so another test's package of the same name (in another folder) imports afresh
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]
