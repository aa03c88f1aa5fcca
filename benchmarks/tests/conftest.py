"""The benchmark tools' tests: the scripts import each other by module name (`import bench`), as
they do when run from benchmarks/, and the tests share the package tests' helpers."""

import pathlib
import sys

_BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
for _path in (_BENCHMARKS, _BENCHMARKS.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tests.conftest import (  # noqa: E402, F401
    _cpu_unless_marked_gpu,
    _replayable_random_inputs,
    pytest_runtest_makereport,  # noqa: E402, F401
)
