"""The toolchain: CUDA sources in, kernel binaries and their MANIFEST.json records out.

``nvrtc`` and ``ptxas`` wrap the pinned compilers (imported only when a build compiles: importing
NVRTC loads cuda-bindings, which a CPU-only build, ``plan`` and ``--check`` never need).
"""
