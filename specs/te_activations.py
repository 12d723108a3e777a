"""MLPs with the rest of TE's activations: quick GELU, and the GLU family's other gates (sigmoid,
quick GELU, ReLU, squared ReLU, SiTU). Their kernels put each functor through every path."""

import transformer_engine.pytorch as te

HIDDEN = 256
FFN = 512

qgelu_mlp = te.ops.Sequential(te.ops.Linear(HIDDEN, FFN), te.ops.QGELU(), te.ops.Linear(FFN, HIDDEN))
glu_mlp = te.ops.Sequential(te.ops.Linear(HIDDEN, 2 * FFN), te.ops.GLU(), te.ops.Linear(FFN, HIDDEN))
qgeglu_mlp = te.ops.Sequential(te.ops.Linear(HIDDEN, 2 * FFN), te.ops.QGEGLU(), te.ops.Linear(FFN, HIDDEN))
reglu_mlp = te.ops.Sequential(te.ops.Linear(HIDDEN, 2 * FFN), te.ops.ReGLU(), te.ops.Linear(FFN, HIDDEN))
sreglu_mlp = te.ops.Sequential(te.ops.Linear(HIDDEN, 2 * FFN), te.ops.SReGLU(), te.ops.Linear(FFN, HIDDEN))
# Non-default betas, so the kernels are built from them.
situglu_mlp = te.ops.Sequential(
    te.ops.Linear(HIDDEN, 2 * FFN), te.ops.SiTUGLU(beta1=2.0, beta2=8.0), te.ops.Linear(FFN, HIDDEN),
)
