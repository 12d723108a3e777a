"""The pipelines `make bench` times (bench/bench_kernels.py), in TE's vocabulary: one per op
family and hidden size; the GLUs without a Bias take any width and get fixed-size kernels for
the swept widths (bench/pyproject.toml), except swiglu_generic, which times the size-generic
kernel itself. Generated into bench/build/sweep by `make bench`; not part of the shipped package."""

import transformer_engine.pytorch as te

rmsnorm_h1024 = te.ops.Sequential(te.ops.RMSNorm(1024))
layernorm_h1024 = te.ops.Sequential(te.ops.LayerNorm(1024))
add_rmsnorm_h1024 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.RMSNorm(1024))
add_layernorm_h1024 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.LayerNorm(1024))
bias_gelu_h1024 = te.ops.Sequential(te.ops.Bias(1024), te.ops.GELU())

rmsnorm_h2048 = te.ops.Sequential(te.ops.RMSNorm(2048))
layernorm_h2048 = te.ops.Sequential(te.ops.LayerNorm(2048))
add_rmsnorm_h2048 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.RMSNorm(2048))
add_layernorm_h2048 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.LayerNorm(2048))
bias_gelu_h2048 = te.ops.Sequential(te.ops.Bias(2048), te.ops.GELU())

rmsnorm_h4096 = te.ops.Sequential(te.ops.RMSNorm(4096))
layernorm_h4096 = te.ops.Sequential(te.ops.LayerNorm(4096))
add_rmsnorm_h4096 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.RMSNorm(4096))
add_layernorm_h4096 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.LayerNorm(4096))
bias_gelu_h4096 = te.ops.Sequential(te.ops.Bias(4096), te.ops.GELU())

rmsnorm_h8192 = te.ops.Sequential(te.ops.RMSNorm(8192))
layernorm_h8192 = te.ops.Sequential(te.ops.LayerNorm(8192))
add_rmsnorm_h8192 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.RMSNorm(8192))
add_layernorm_h8192 = te.ops.Sequential(te.ops.AddExtraInput(), te.ops.MakeExtraOutput(), te.ops.LayerNorm(8192))
bias_gelu_h8192 = te.ops.Sequential(te.ops.Bias(8192), te.ops.GELU())

bias_swiglu_n2048 = te.ops.Sequential(te.ops.Bias(2048), te.ops.SwiGLU())
bias_swiglu_n4096 = te.ops.Sequential(te.ops.Bias(4096), te.ops.SwiGLU())
bias_swiglu_n8192 = te.ops.Sequential(te.ops.Bias(8192), te.ops.SwiGLU())
bias_swiglu_n16384 = te.ops.Sequential(te.ops.Bias(16384), te.ops.SwiGLU())
bias_swiglu_n28672 = te.ops.Sequential(te.ops.Bias(28672), te.ops.SwiGLU())

swiglu = te.ops.Sequential(te.ops.SwiGLU())
geglu = te.ops.Sequential(te.ops.GEGLU())
swiglu_generic = te.ops.Sequential(te.ops.SwiGLU())
