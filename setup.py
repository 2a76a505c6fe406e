"""An optional compiled build: `JOBSERVER_MYPYC=1 pip install .`.

Without the variable this is a plain setuptools build (pyproject.toml holds
the project's metadata) and the package is pure Python. With it, mypyc
compiles the modules of a request's hot path (COMPILED) into C extensions
installed beside their .py files, as black ships its wheels; mypy is then a
build requirement, asked for through setup_requires so that an isolated
build (pip, python -m build) installs it first.
"""

import os

from setuptools import setup

# The modules a CreateJob, GetJob and FinishJob on SQLite run per request
# (cProfile over 3,000 creates and takes; docs/benchmarks.md). Only modules
# that mypyc compiles as written: the rest of the package, which imports
# and calls these, stays interpreted. Left out, though hot:
# - server/connection.py: its boundary is an `except*`, which mypyc
#   cannot compile;
# - core/commands/route.py: Peer subclasses str (a compiled class cannot);
# - core/engine/context.py: mypyc leaves a dataclass field with init=False
#   and a default unset (AttributeError at the first request);
# - storage/sql_store.py, sqlite.py, sql_statements.py, sql_outcomes.py:
#   SqlStore has interpreted bases, and the backends' class-level
#   `dialect = ...` is not a default mypyc can give;
# - core/engine/alarm.py, core/commands/await_job.py: `continue` inside
#   try/finally; model/names.py: a surrogate in a string literal;
# - model/jobs.py: vars() of a job, which a compiled class has no __dict__ for.
COMPILED = [
    "jobserver/wire/framing.py",
    "jobserver/wire/jsonbody.py",
    "jobserver/core/engine/engine.py",
    "jobserver/core/engine/history.py",
    "jobserver/core/engine/batch.py",
    "jobserver/core/engine/writer.py",
    "jobserver/core/engine/durability.py",
    "jobserver/core/engine/histogram.py",
    "jobserver/core/engine/clock.py",
    "jobserver/core/engine/waiters.py",
    "jobserver/core/commands/dispatch.py",
    "jobserver/core/commands/create.py",
    "jobserver/core/commands/params.py",
    "jobserver/core/commands/get_jobs.py",
    "jobserver/core/commands/report.py",
    "jobserver/core/commands/known_headers.py",
    "jobserver/core/commands/views.py",
    "jobserver/core/commands/depends_on.py",
    "jobserver/core/commands/json_params.py",
    "jobserver/core/commands/lookup.py",
    "jobserver/core/commands/flow_params.py",
    "jobserver/core/commands/idempotency.py",
    "jobserver/core/rules/selection.py",
    "jobserver/core/rules/lifecycle.py",
    "jobserver/core/rules/creation.py",
    "jobserver/core/rules/outcomes.py",
    "jobserver/core/rules/leases.py",
    "jobserver/core/rules/moves.py",
    "jobserver/core/rules/flow.py",
    "jobserver/model/times.py",
    "jobserver/model/globmatch.py",
    "jobserver/server/peer.py",
]

# mypyc, and what it type-checks the compiled modules against: the plain
# dependencies they import (pyproject.toml) and dateutil's stubs.
BUILD_REQUIRES = [
    "mypy>=2.4,<3",
    "trio>=0.25",
    "outcome>=1.2",
    "python-dateutil>=2.8",
    "types-python-dateutil",
    "cronsim>=2.8,<3",
]

if os.environ.get("JOBSERVER_MYPYC") == "1":
    try:
        from mypyc.build import mypycify
    except ImportError:
        # An isolated build's first pass asks setup_requires what to install
        # (setuptools.build_meta stops setup() there, then builds again with
        # them). Elsewhere the build would go on uncompiled: it stops.
        setup(setup_requires=BUILD_REQUIRES)
        raise SystemExit("JOBSERVER_MYPYC=1 needs " + ", ".join(BUILD_REQUIRES)) from None
    # One group, named so that its shared library is jobserver__mypyc. The C
    # compiler's level as mypyc's own MYPYC_OPT_LEVEL says (0 builds in 40 s
    # against 65 at 3, for checking the compiled code's behaviour).
    opt_level = os.environ.get("MYPYC_OPT_LEVEL", "3")
    setup(ext_modules=mypycify(COMPILED, opt_level=opt_level, group_name="jobserver"))
else:
    setup()
