"""Makes this folder's format files importable by name (pytest runs with --import-mode=importlib, which adds no test
folder to the path), as a user's own module would be."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
