"""Writes kernels/rotated_codebooks.json: the Lloyd-Max codebooks of the rotated formats for the common head dims.

    python scripts/rotated_codebooks.py

Computed by `hf_kvplus.kernels.rotated_format.lloyd_max` (the same routine that serves other head dims at run
time), so the shipped tables and the run-time ones agree; tests check that they do.
"""

import json
from datetime import date

from hf_kvplus.kernels.rotated_format import _TABLES, SHIPPED_HEAD_DIMS, lloyd_max


def main() -> None:
    tables = {str(d): {str(b): lloyd_max(d, b) for b in (1, 2, 3, 4)} for d in SHIPPED_HEAD_DIMS}
    _TABLES.write_text(json.dumps({
        "about": "Lloyd-Max centroids for one coordinate of a random unit vector of head_dim dims, by head_dim "
                 "then bits; written by scripts/rotated_codebooks.py",
        "date": date.today().isoformat(),
        "centroids": tables,
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {_TABLES}")


if __name__ == "__main__":
    main()
