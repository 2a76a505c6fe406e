"""The worker manager (`jobserver worker-manager`): takes jobs from the
server and runs each one as a process, a "worker".

Where things are:
- arguments.py   the command line: options, their checks, `run`
- manager.py     the Manager: fetching jobs, slots and load, signals, exit status
- contract.py    the worker contract: which executable, stdin and environment,
                 what exit statuses and stdout mean as reports
- supervision.py one worker process: start, output capture, timeouts, kills
- leases.py      renewing the leases of running jobs (TouchJob)
- policy.py      --policy: retry policy, timeout and lease by job-name pattern
                 (and the Python handler's checks of the same)
- reporting.py   delivering reports, and the policy for the server's answers
- connection.py  reaching the server: addresses, reconnecting, backoff
"""

from jobserver.workers.arguments import DESCRIPTION, add_arguments, run

__all__ = ["DESCRIPTION", "add_arguments", "run"]
