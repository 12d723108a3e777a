"""fusegen's jinja templates and CUDA headers (package data; a package so the installed copy can be found)."""
