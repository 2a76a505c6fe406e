"""The protocol's numbers (protocol.md section 3), defined once.

The server enforces them, the client library and the command line check
against them before sending, so each lives here and nowhere else.
"""

from __future__ import annotations

# Where a server listens, and a client looks, unless told otherwise.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8888

# Framing. Each limit bounds what a single connection can make the server hold.
#
# Job data travels in a header value, as in Bedrock, whose own limit for a
# `data` value is 1 MiB; CreateJobs carries a whole batch in one `jobs`
# line, and 2 MiB is a thousand jobs of ordinary size.
MAX_LINE = 2 * 1024 * 1024
# A whole head: room for one maximal line and ordinary headers beside it.
MAX_HEAD = 4 * 1024 * 1024
# Bedrock requests carry about a dozen headers; 100 leaves room for any real
# client while a header flood is cut off early.
MAX_HEADERS = 100
# Commands take their parameters from headers, so a body is never needed;
# 1 MiB lets a client send one without letting it fill memory.
MAX_BODY = 1024 * 1024

# Any JSON text a request carries (a `data` value, a `jobs` list, an HTTP
# body) nests at most this many arrays and objects: far deeper than any job
# data Bedrock's own tests hold (two), and far below the depth at which
# Python's parser and encoder would exhaust the stack (about 1,000).
MAX_JSON_DEPTH = 100

# A job's name, in bytes of UTF-8.
MAX_NAME = 255
# GetJobs hands out at most this many jobs at once: a batch larger than a
# worker pool can start only holds jobs back from other workers.
MAX_RESULTS = 1000

# Retry policies (protocol.md 14.1).
BACKOFFS = ("fixed", "exponential")
DEFAULT_BACKOFF = "exponential"
DEFAULT_RETRY_DELAY = 1.0
# An hour: long enough to ride out most outages, short enough that a job
# still runs the same day once its cause is fixed.
DEFAULT_MAX_RETRY_DELAY = 3600.0
# More tries than this is a loop, not a retry policy.
MAX_ATTEMPTS = 10_000

# A job's cost against concurrency limits (protocol.md 14.7): a million
# is far above any sensible capacity, and keeps sums of costs small.
MAX_COST = 1_000_000
# A concurrency limit's capacity, likewise.
MAX_CAPACITY = 1_000_000_000

# Bedrock's priorities, highest first: the order in which jobs are handed out.
PRIORITIES = (1000, 850, 750, 500, 250, 0)
DEFAULT_PRIORITY = 500

# The largest jobID: SQLite's largest integer, Bedrock's int64.
MAX_JOB_ID = 2**63 - 1

# RetryJob's delay has at most 8 digits of seconds (three years), as in Bedrock.
MAX_DELAY_DIGITS = 8
MAX_DELAY = 10**MAX_DELAY_DIGITS - 1
# The lease a worker may ask for on GetJob and GetJobs (`lease`, seconds,
# protocol.md 14.24): a second at least, so a job is not due again before
# its reply arrives; a day at most, past which --stale-after's net is the
# better tool.
MIN_LEASE = 1
MAX_LEASE = 86400

# How long a GetJob with `Connection: wait` waits when it names no timeout:
# Bedrock's default, chosen so clients can use a two-minute socket timeout.
DEFAULT_WAIT_MS = 110_000
# A longer wait is cut to this: an hour is longer than any client should
# hold a socket without hearing back.
MAX_WAIT_MS = 3_600_000

# FinishJobs takes at most this many jobs: as many as one GetJobs hands out
# (MAX_RESULTS), so a worker reports a whole batch at once, and
# few enough that one request holds the writer for tens of milliseconds
# (about 30 for a thousand), not seconds.
MAX_FINISH_JOBS = 1000

# A bulk action (RequeueFailedJobs, DeleteFailedJobs, CancelQueuedJobs)
# acts on at most this many jobs, and takes at most this many jobIDs: a
# thousand moves hold the writer for tens of milliseconds, as FinishJobs'
# thousand reports do; a client repeats it for more.
MAX_BULK = 1000
# The jobIDs one CancelledJobs may ask about (protocol.md 14.26): a worker's
# running jobs, asked about together.
MAX_CANCEL_CHECK = 1000
# ... and examines at most this many jobs of its state to find them (those
# whose names could match: the names, the queue's, or those that begin as
# the pattern does, through the state's index of names), in the writer:
# past them it stops and says so (protocol.md 14.19). The bound counted
# matches before, so a pattern that matched none read every queued job.
# 100,000 is what that count went to; passing over as many takes 25 ms on
# SQLite and 45 ms on PostgreSQL, 0.15 s and 0.25 s if all match (the
# state of each read again by its jobID).
MAX_BULK_EXAMINED = 100_000
# ... fewer for a costly pattern: at most this over what testing a name
# against it may cost, in units of a plain test of about 50 ns
# (globmatch.match_cost), about 50 ms of tests at worst beside the 25 ms of
# reading 100,000 rows: a plain pattern examines all 100,000, `*zz` (16
# units) 62,500, `*?` and 11 letters (66) 15,151, `*` and 12,749 letters
# (63,746) 15.
# Weighed by its bytes alone, `*?aaaaaaaaaab` examined 76,923 names of 255
# `a`s and held the writer 0.3 to 0.9 s.
BULK_TEST_BUDGET = 1_000_000

# FailedJobs lists at most this many jobs, as Query returns at most this
# many rows, and this many when it names no limit.
MAX_LISTED = 10_000
DEFAULT_LISTED = 1000

# Queues lists this many queues, the largest first, unless its `limit`
# asks for more, up to the most.
DEFAULT_QUEUES = 50
MAX_QUEUES = 1000

# AwaitReply and DeliverReply (protocol.md 14.12). A key is long enough for
# an order id, a URL or a UUID with a prefix; the same as a job name, so a
# key is never the thing that makes a request too big.
MAX_REPLY_KEY = 255
# Idempotency keys of CreateJob and CreateJobs (protocol.md 14.22): room
# for a UUID with a prefix, a hash, or a request ID from elsewhere.
MAX_IDEMPOTENCY_KEY = 255
# How long a key is kept after its request (--idempotency-keep): a day
# covers any client's retries and a worker restarted the next morning;
# at least a minute, at most thirty days.
DEFAULT_IDEMPOTENCY_KEEP = 86400.0
MIN_IDEMPOTENCY_KEEP = 60.0
MAX_IDEMPOTENCY_KEEP = 30 * 86400.0
# How long a job waits for its reply: a day unless it says otherwise (a
# human approval or a slow partner answers within it); thirty days at most,
# past which a job waiting is more likely forgotten than slow.
DEFAULT_REPLY_TIMEOUT = 86400
MAX_REPLY_TIMEOUT = 30 * 86400

# The largest reply the server builds (--max-reply-bytes): a Query or a
# GetJobs past it would make the server hold, and the client read, hundreds
# of megabytes. Tens of MiB is far beyond what a person reads or a worker
# takes at once; the least allowed still fits one job of the largest size
# (1 MiB of data, 1 MiB of other text) with room to spare.
DEFAULT_MAX_REPLY_BYTES = 32 * 1024 * 1024
MIN_MAX_REPLY_BYTES = 4 * 1024 * 1024
MAX_MAX_REPLY_BYTES = 1024 * 1024 * 1024
# The largest reply a client reads (the clients' `max_reply_bytes`, the
# workers' --max-reply-bytes): a reply's body announced larger is refused
# before a byte of it is read, so a broken or hostile server cannot make a
# worker hold more (one announcing 100 GB grew a worker by 4.8 GB in 25 s).
# Four times the server's default: a server at its default never comes
# near it, one raised a little still gets through, and a worker holds at
# most a few such replies. Up to twice the server's largest, so that a
# client can follow any server (one job past the server's bound included).
DEFAULT_CLIENT_MAX_REPLY_BYTES = 4 * DEFAULT_MAX_REPLY_BYTES
MAX_CLIENT_MAX_REPLY_BYTES = 2 * MAX_MAX_REPLY_BYTES

# Concurrency limits, and paused patterns, at most (--max-limits): every
# job a GetJob considers is matched against them, so their number bounds
# what one name costs (core/rules/flow.py). A thousand is far more than any
# deployment names queues for.
DEFAULT_MAX_LIMITS = 1000
MAX_MAX_LIMITS = 10_000

# Dependencies (protocol.md 14.25). A job depends on at most this many
# jobs: a batch of a thousand needs a fan-in of a thousand, and the
# hand-out lists every one.
MAX_DEPENDENCIES = 1000
# One CreateJobs holds at most this many edges in all (each element's
# dependsOn summed): a fan-out and fan-in of a thousand is two thousand,
# and each edge costs a row and a check in the request's transaction.
MAX_REQUEST_DEPENDENCIES = 20_000
# The bytes of its dependencies' data a hand-out carries at most, per job:
# past them, a dependency's entry has `"dataOmitted": true` in place of its
# data. With a job's own data (1 MiB at most) it stays within the least
# --max-reply-bytes.
MAX_DEPENDENCY_DATA = 1024 * 1024
# onDependencyFailure's values; "fail" is the default.
ON_DEPENDENCY_FAILURE = ("fail", "cancel", "run")
# AwaitJob (protocol.md 14.27). An ended job's outcome is kept an hour by
# default (--keep-outcomes): long enough for a caller that lost its
# connection to ask again, short enough that a busy queue's outcomes stay
# a fraction of its jobs; at most a year, as a number of seconds that any
# date arithmetic takes.
DEFAULT_KEEP_OUTCOMES = 3600
MAX_KEEP_OUTCOMES = 366 * 86400
# AwaitJobs waiting at once on one server, over both ports: each holds a
# connection (bounded by --max-connections and --max-http-connections)
# and a few hundred bytes; past it, `503 Too many AwaitJobs waiting`.
MAX_AWAITING = 10_000
# A handler's or worker's timeout (@worker.handler, --timeout, --policy):
# up to a week, as far as a lease goes usefully.
MAX_TIMEOUT = 7 * 86400.0
