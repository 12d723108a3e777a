"""A spec's node positions (frontend/source.py: node_positions) are libcst's PositionProvider's,
computed from character offsets without MetadataWrapper.resolve's extra walk of the tree: the same
range for every node, in the shipped specs and in texts made to trip a line or column count."""

import textwrap
from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from fusegen.frontend.source import NodePositions, node_positions

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.py"))
TRICKY = {
    "crlf": "import fusegen.eager as fg\r\nH = 4\r\nm = fg.Sequential(\r\n    fg.GELU(),\r\n)\r\n",
    "lone_cr": "H = 4\rm = Sequential(GELU())\r",
    "no_final_newline": "m = Sequential(RMSNorm(64), GELU())",
    "empty": "",
    "tabs_and_wide_characters": "\u00e9\u00e9 = 4  # \u00e9t\u00e9\nm = Sequential(\tRMSNorm(\u00e9\u00e9),\t"
                                "GELU(approximate='\U0001f600'))\n",
    "continuations_and_strings": ('H = 4 + \\\n    4\ns = """a\nb\nc"""; t = (1,\n  2)\n'
                                  "m = Sequential(Bias(H), GELU())\n"),
    "blocks": textwrap.dedent("""\
        # a comment

        @decorator
        def f(x):
            if x:
                return [
                    x,
                ]
            else:  # trailing
                pass


        class C:
            a: int = 1
        m = Sequential(LayerNorm((H)), (GELU()))
        """),
}


def assert_same_positions(module):
    ours = node_positions(module)
    assert isinstance(ours, NodePositions)  # the fast path, not the fallback
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    assert len(ours) == len(theirs)
    assert all(ours[node] == theirs[node] for node in theirs)
    return len(theirs)


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_node_positions_are_the_position_providers(path):
    assert assert_same_positions(cst.parse_module(path.read_text(encoding="utf-8"))) > 100


@pytest.mark.parametrize("text", list(TRICKY.values()), ids=list(TRICKY))
def test_node_positions_count_lines_and_columns_as_libcst_does(text):
    assert assert_same_positions(cst.parse_module(text)) >= 1
