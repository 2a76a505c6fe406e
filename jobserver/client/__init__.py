"""The client library: `Client` on plain blocking sockets, `AsyncClient`
for asyncio and trio, `TrioClient` for trio alone.

    with Client("127.0.0.1", 8888) as jobs:   # or Client("127.0.0.1:8888")
        job_id = jobs.create_job("email/send", {"to": "ann@example.com"})
        job = jobs.get_job("email/*", wait=60)   # None if nothing came in 60 s

    async with AsyncClient("127.0.0.1", 8888) as jobs:   # the same, awaited
        job_id = await jobs.create_job("email/send", {"to": "ann@example.com"})

Each method is one request on one persistent connection, opened when it is
first needed. A refusal is a `JobServerError`, with a subclass per status
code, the whole status line and the server's explanation (`detail`); a
network failure is `ConnectionFailed`. An empty queue is an answer, not an
error: `get_job` returns None and `get_jobs` an empty list. The clients
share what each command sends and what its reply means (calls.py;
report_calls.py, operating_calls.py), the
encoding of requests and the sans-IO `ReplyReader` (jobserver.wire.framing);
the two async clients share their methods and reconnect rules too
(async_calls.py). Only the moving of bytes
differs (sync.py, async_client.py, trio_client.py).

The async clients. `AsyncClient` runs on anyio, so on whichever event loop
calls it, asyncio or trio. `TrioClient` has the same methods on trio
alone: the worker manager is built on it. Both are imported on first use,
so that a program of the sync client alone does not spend the tens of
milliseconds importing anyio takes.

Several servers. A queue served by several nodes on one PostgreSQL
(docs/nodes.md) is given to a client as a list of its nodes:

    jobs = Client(["10.0.0.1:8888", "10.0.0.2:8888", "10.0.0.3:8888"])
    jobs = Client("10.0.0.1:8888,10.0.0.2:8888")   # the same, as one string
    jobs = Client.from_address("10.0.0.1:8888,10.0.0.2:8888")

Up to 16 addresses (MAX_SERVERS), each "HOST:PORT", "[IPV6]:PORT" or a
(host, port) pair (a HOST without its port is at `port`); an empty list,
a longer one, one that is not an address or one listed twice is a
ValueError saying which. A client keeps one connection, to one node at a
time (`client.address` says which). Clients made one after another start
at successive nodes, from a random one, so that many workers spread over
the nodes. A new connection goes to the client's node first, then to each
other once; when none takes it, ConnectionFailed names every address and
why. A connection that breaks, or whose reply does not come in time, sends
the client's next connection to another node, picked at random among the
others (so that the clients of a dead node spread over the rest), and
that node is tried last; `switch_server()` does the same by hand, say
after a `503`. A client does
not come back to a node that returns; new clients spread over it again.

Reconnect rules. Bedrock's PHP client sends a request again after failures
that can come after the server acted on it (a `500` or `555` reply; a broken
connection, for requests it marks idempotent, FinishJob and RetryJob among
them), so work can be done twice. Here a request is sent again only when
that cannot do anything twice:

- Before sending, a kept connection that died while idle (the server was
  restarted or shut down) is replaced by a new one, to the same node first
  and then to each other. Sending that failed part-way counts the same:
  the server does nothing with a request until its final blank line has
  arrived (protocol.md 1.2).
- Once a request has been sent, a connection that breaks, or a reply that
  does not come within the timeout, raises ConnectionFailed. The request is
  not sent again: the server may have carried it out (created the job,
  finished it) and only the caller can tell whether repeating it is safe;
  the next request goes to another node, if there is one. A
  `504 Outcome unknown` reply (OutcomeUnknown) says the same: the server
  could not learn whether its database committed the request.
- Except the read-only commands QueryJob, Ping, Status, Queues, Query,
  History and RunningJobs, GetJob and GetJobs (waiting or not), and
  CreateJob and CreateJobs, which are sent once more on a new connection,
  to another node if there is one. A create carries an idempotency key
  (the caller's `idempotency_key`, else a random one: protocol.md 14.22),
  under which the server creates its jobs once however often it is sent;
  it is sent again only to a server seen to keep keys, or asked first (a
  server older than the keys would create the jobs twice). If that second
  try is refused with a 5xx, the first may still have been carried out,
  and OutcomeUnknown says so, naming the key. A GetJob sent again may
  get another job, but none is run twice: a job handed out in a reply that
  never arrived is put back by the server when it sees the reply fail
  (protocol.md 9); otherwise (its node died, or the reply was lost on the
  way) it comes back when its lease (retryAfter) or the server's
  --stale-after runs out. So a worker waiting on a node that dies goes on
  waiting on another.
- A reply with `Connection: close` closes the connection once it is read;
  so does an error or an interruption (KeyboardInterrupt, a cancellation
  on asyncio or trio) in the middle of a request, since the connection is
  then out of step. The next request opens a new connection.
- A waiting GetJob is answered only when a job comes or its wait is over, so
  its reply is awaited for the wait plus the client's timeout.

Leases. Every GetJob and GetJobs asks for the lease token (`includeLeaseID`),
so each job dict carries `leaseID`. Pass it back as `lease_id` to
finish_job, retry_job, fail_job, update_job and touch_job: if the job has
been handed to another worker since, the server refuses with `Conflict`
(`409 Lease expired`) and changes nothing. finish_jobs reports many jobs
in one request, each `Finish(job_id, lease_id, data)` with its own
`FinishResult`: a refused job is a result, not an exception. fail_jobs and
retry_jobs do the same for failures (`Fail(job_id, lease_id, error,
data)`) and jobs put back (`Retry(job_id, lease_id, delay, next_run, data,
ignore_repeat)`).

TLS. `tls=True` speaks TLS and trusts the system's certificate
authorities; `tls="ca.pem"` trusts the CA certificates in that PEM file
instead (a server certificate of your own); an `ssl.SSLContext` is used as
it is. The server's certificate must name the host the client connects to
(the host of "host:port"), unless the context turns that check off. When
TLS cannot be set up, `TLSFailed` (a ConnectionFailed) says why plainly:
the certificate is not trusted, the server does not speak TLS, or the
server requires TLS and the client was not told to use it. Nothing was
carried out then, and sending again would fail the same way.

Replies it cannot read. A reply is read only up to `max_reply_bytes`
(default 128 MiB, four times the server's own bound, `--max-reply-bytes`):
one announcing a larger body is not read at all, and, like a reply that
breaks the framing, counts as a broken connection (ConnectionFailed). A
framed reply whose body is not what its command answers (not JSON, a job
without a `name`, a `jobID` that is not a number) is a `MalformedReply`, a
ConnectionFailed too, whose connection the client closes. Either way the
request may have been carried out. So a broken or hostile server can make
a request fail, never make the client hold more than `max_reply_bytes` or
hand its caller a job it cannot use.

A client is for one thread, or one task, at a time: an async client
refuses with RuntimeError a request made while another task's is under way
(the two would take each other's replies), so a web application opens one
per request, or keeps one per task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobserver.client.batches import MAX_BATCH, Batch, BatchProgress
from jobserver.client.calls import When
from jobserver.client.endpoint import (
    DEFAULT_TIMEOUT,
    TLS,
    auth_token,
    tls_context,
)
from jobserver.client.errors import (
    Conflict,
    ConnectionFailed,
    IllegalState,
    InvalidRequest,
    JobCancelled,
    JobNotFound,
    JobServerError,
    MalformedReply,
    MalformedRequest,
    OutcomeUnknown,
    ServerError,
    TLSFailed,
    UnrecognizedCommand,
    error_for,
)
from jobserver.client.report_calls import Fail, Finish, FinishResult, Retry
from jobserver.client.servers import MAX_SERVERS, format_servers, parse_address, parse_servers
from jobserver.client.sync import Client
from jobserver.wire.client_framing import Reply, ReplyReader, encode_request, encode_value
from jobserver.wire.limits import DEFAULT_HOST, DEFAULT_PORT

if TYPE_CHECKING:
    from jobserver.client.async_client import AsyncClient
    from jobserver.client.trio_client import TrioClient

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "MAX_BATCH",
    "MAX_SERVERS",
    "TLS",
    "AsyncClient",
    "Batch",
    "BatchProgress",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "Fail",
    "Finish",
    "FinishResult",
    "IllegalState",
    "InvalidRequest",
    "JobCancelled",
    "JobNotFound",
    "JobServerError",
    "MalformedReply",
    "MalformedRequest",
    "OutcomeUnknown",
    "Reply",
    "ReplyReader",
    "Retry",
    "ServerError",
    "TLSFailed",
    "TrioClient",
    "UnrecognizedCommand",
    "When",
    "auth_token",
    "encode_request",
    "encode_value",
    "error_for",
    "format_servers",
    "parse_address",
    "parse_servers",
    "tls_context",
]


def __getattr__(name: str) -> Any:
    """The async clients, imported on first use (anyio's import is slow)."""
    if name == "AsyncClient":
        from jobserver.client.async_client import AsyncClient

        return AsyncClient
    if name == "TrioClient":
        from jobserver.client.trio_client import TrioClient

        return TrioClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
