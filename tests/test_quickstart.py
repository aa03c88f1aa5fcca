"""examples/quickstart.py (the README's demo) runs and reports small errors."""

import re
import subprocess
import sys

from tests._helpers import ROOT


def test_quickstart_runs_and_reports_errors():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    assert "path taken: layer 1 -> " in out
    kernel_error = float(re.search(r"dequantized weights: ([0-9.e-]+)", out).group(1))
    assert kernel_error < 0.02
    assert (
        float(re.search(r"relative difference ([0-9.e+-]+) from the spec layout", out).group(1))
        < 0.01
    )
