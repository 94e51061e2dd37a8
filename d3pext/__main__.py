"""``python -m d3pext``: the ``d3pext`` command line (see :mod:`d3pext.cli`)."""

from d3pext.cli import run

run()
