import sys
from pathlib import Path

# The repository root (for `generated`, `generator`, `fusion_rules`) and tests/ (for helpers).
ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
