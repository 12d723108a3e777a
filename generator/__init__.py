"""fusegen: ahead-of-time fusion compiler for te.ops-style pipelines."""
