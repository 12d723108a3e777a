"""The toolchain: CUDA sources in, kernel binaries and their MANIFEST.json records out.

- ``headers``: which fusegen and plugin headers a source includes, and their digests;
- ``cache``: ``compile_kernels``, every binary of a build compiled or reused from the previous
  package, and the kernels' MANIFEST.json records;
- ``jobs``: one NVRTC compile a kernel and arch, run in parallel on threads or worker processes;
- ``nvrtc``, ``ptxas``: the pinned compilers, imported only when a build compiles (importing NVRTC
  loads cuda-bindings, which a CPU-only build, ``plan`` and ``--check`` never need).

Tests replace ``jobs.run_compiles`` and ``headers.CUDA_HEADERS`` in their modules, which is where
the toolchain reads them: neither is exported here.
"""

from .cache import compile_kernels
from .headers import cuda_headers, header_files, included_headers, sha256
from .jobs import Compile, binary_name

__all__ = ["Compile", "binary_name", "compile_kernels", "cuda_headers", "header_files", "included_headers", "sha256"]
