"""A pytest plugin (pyproject's addopts load it for every pytest run): notebooks run at smoke sizes
unless asked. A bare `pytest` then passes in minutes on a fresh machine, as CI runs it;
`COURSE_SMOKE=0 pytest notebooks` runs every notebook at default sizes (hours on a CPU).

It only sets a default: COURSE_SMOKE given in the environment, to anything, wins. The notebooks'
kernels, which nbmake starts after this runs, inherit the variable."""

import os


def pytest_configure(config):
    os.environ.setdefault("COURSE_SMOKE", "1")
