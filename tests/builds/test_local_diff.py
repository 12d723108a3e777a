"""A small change to a spec gives a small diff: changing one argument of one pipeline touches only
that pipeline's files, the kernels that argument reaches (renamed: their names carry it), their
launchers in _kernels.py and their MANIFEST.json entries. No other pipeline, kernel or launcher
line changes (the custom ops are named per kernel, not per package)."""

import difflib
import io
import json
import shutil
import tokenize
from pathlib import Path

from fusegen import build

ROOT = Path(__file__).resolve().parents[2]


def logical_lines(source):
    """Each statement of ``source`` on one line (generated code wraps long ones at 100 columns,
    so a changed name can reflow lines that do not contain it)."""
    rows, lines, start = source.split("\n"), [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if start is None and token.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            start = token.start[0]
        if token.type == tokenize.NEWLINE:
            lines.append(" ".join(row.strip() for row in rows[start - 1:token.end[0]]))
            start = None
    return lines


def test_changing_one_eps_touches_only_its_pipeline_and_kernel(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("elementwise_chain.py", "te_mlp.py"):
        shutil.copy(ROOT / "specs" / name, specs / name)
    config = build.Config(tuple(sorted(specs.glob("*.py"))), tmp_path / "out", archs=("sm_90",),
                          dtypes=("float32",), root=tmp_path)
    before = build.build_package(config)
    chain = specs / "elementwise_chain.py"
    chain.write_text(chain.read_text().replace("LayerNorm(H, eps=1e-6,", "LayerNorm(H, eps=1e-5,"))
    after = build.build_package(config)

    old, new = "add_layernorm_zc_eps1em06_fwd_h768", "add_layernorm_zc_fwd_h768"  # eps=1e-5: the default
    changed = {rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel)}
    assert changed == {"MANIFEST.json", "_kernels.py", "elementwise_chain.py", "elementwise_chain.plan.md",
                       f"kernels/{old}.cu", f"kernels/{old}.sm_90.cubin", f"kernels/{new}.cu", f"kernels/{new}.sm_90.cubin"}

    # _kernels.py: only the renamed kernel's launchers and op registration change
    lines = [line for line in difflib.unified_diff(logical_lines(before["_kernels.py"].decode()),
                                                   logical_lines(after["_kernels.py"].decode()), n=0, lineterm="")
             if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    unrelated = [line for line in lines if line[1:].strip() and not any(
        word in line for word in ("add_layernorm_zc", "ADD_LAYERNORM_ZC", "1e-06", "1e-05", "residual add + LayerNorm",
                                  "if torch.compiler.is_compiling()", '"""'))]
    assert lines and not unrelated, unrelated

    # MANIFEST.json: the two kernels' entries and the file list, nothing else
    m_before, m_after = json.loads(before["MANIFEST.json"]), json.loads(after["MANIFEST.json"])
    kernels = {k for k in set(m_before["kernels"]) | set(m_after["kernels"])
               if m_before["kernels"].get(k) != m_after["kernels"].get(k)}
    assert kernels == {old, new}
    assert {k for k in set(m_before) | set(m_after) if m_before.get(k) != m_after.get(k)} <= {"kernels", "files"}
