"""A chaos test on PostgreSQL: the node's backends are terminated again and
again (pg_terminate_backend, as a third party's harness does in its
backend-kill scenario) while clients create jobs in batches, take them
with waiting GetJobs and finish or fail them in batches; every reply is
then held against the table (pg_chaos.py says what each must mean).
`bench/pg_backend_kill.py` runs the same for longer, and more times."""

from __future__ import annotations

from collections.abc import Iterator

import pg
import pytest

from harness import ServerProcess
from pg_chaos import Chaos, new_application, with_application

# Long enough to have seen the acknowledged jobs lost and the writes behind
# a 5xx before they were mended (a few each in 20 s, killing four times a
# second), short enough for CI: 20 s of load took 36 s with the drain
# after it (118 backends ended, 26,580 jobs), a large share of CI's ten
# minutes on two cores; bench/pg_backend_kill.py runs it at length.
SECONDS = 8.0
KILL_EVERY = 0.25


@pytest.fixture
def queue_url() -> Iterator[str]:
    with pg.fresh_schema() as url:
        yield url


def test_backends_terminated_under_load_lose_nothing_acknowledged_and_do_nothing_behind_a_5xx(
    queue_url,
):
    application = new_application()
    node = ServerProcess(with_application(queue_url, application))
    try:
        assert node.port is not None, node.log
        chaos = Chaos(node.port, queue_url, application, KILL_EVERY)
        violations = chaos.run(SECONDS)
        print(chaos.summary())
        assert chaos.kills > 0 and chaos.ledger.acked
        assert not violations, "\n".join(violations)
        assert node.proc.poll() is None, node.log
        assert "Traceback" not in node.log, node.log
    finally:
        node.kill()
