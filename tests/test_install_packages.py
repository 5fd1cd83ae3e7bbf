"""scripts/install_packages.sh: uv gets the sources pip is configured with, each once, and pip installs when uv fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """:env:.cert='/etc/ssl/certs/ca.crt'
:env:.find-links='/opt/wheels'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/wheels'
global.index-url='https://mirror.example/simple'
"""


def fake_python(folder: Path, uv_exit: int) -> Path:
    """A `python` whose `-m pip config list` prints CONFIG and whose `-m pip install` logs its arguments, beside a
    `uv` that logs its arguments and exits with `uv_exit`."""
    folder.mkdir()
    log = folder / "calls.log"
    python = folder / "python"
    python.write_text(f"""#!/bin/sh
if [ "$3" = config ]; then printf '%s' "{CONFIG}"; else echo "pip $*" >> {log}; fi
""")
    uv = folder / "uv"
    uv.write_text(f'#!/bin/sh\necho "uv $*" >> {log}\nexit {uv_exit}\n')
    for path in (python, uv):
        path.chmod(0o755)
    return python


def install(python: Path, *args: str) -> list[str]:
    script = f"source {ROOT / 'scripts' / 'install_packages.sh'}; install_packages {python} {python} {' '.join(args)}"
    subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True)
    return (python.parent / "calls.log").read_text().splitlines()


def test_uv_gets_each_configured_source_once_and_picks_the_best_version_of_any_index(tmp_path):
    (call,) = install(fake_python(tmp_path / "bin", uv_exit=0), "torch==2.13.0")
    assert call == (
        "uv pip install --quiet --python {py} --index-strategy unsafe-best-match --find-links /opt/wheels "
        "--constraint /etc/pip/constraints.txt --extra-index-url file:///opt/a/simple "
        "--extra-index-url file:///opt/b/simple --index-url https://mirror.example/simple torch==2.13.0"
    ).format(py=tmp_path / "bin" / "python")


def test_pip_installs_when_uv_fails(tmp_path):
    uv, pip = install(fake_python(tmp_path / "bin", uv_exit=2), "-e", ".[tests]")
    assert uv.startswith("uv pip install") and uv.endswith("-e .[tests]")
    assert pip == "pip -m pip install --quiet --disable-pip-version-check --no-compile -e .[tests]"
