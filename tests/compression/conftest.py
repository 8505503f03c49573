"""Make the compression test helpers importable (tests/compression is not a package)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
