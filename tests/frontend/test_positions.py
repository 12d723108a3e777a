"""A spec's node positions (frontend/source.py: node_positions) are libcst's PositionProvider's,
computed without MetadataWrapper.resolve's extra walk of the tree: the same range for every node."""

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from fusegen.frontend.source import node_positions

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.py"))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_node_positions_are_the_position_providers(path):
    module = cst.parse_module(path.read_text(encoding="utf-8"))
    ours = node_positions(module)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    assert len(ours) == len(theirs) > 100
    assert all(ours[node] == theirs[node] for node in theirs)
