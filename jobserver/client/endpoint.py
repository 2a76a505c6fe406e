"""Where a client connects, how it speaks TLS, and how it words a failure:
what the clients share besides the calls."""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeAlias

from jobserver.client.calls import Call, UnreadableReply
from jobserver.client.errors import ConnectionFailed, MalformedReply, TLSFailed
from jobserver.client.servers import (
    Address,
    Servers,
    ServersArgument,
    format_address,
    is_bare_ipv6,
    parse_servers,
)
from jobserver.wire.client_framing import Reply, ReplyReader, encode_request
from jobserver.wire.framing import TLS_REQUIRED
from jobserver.wire.limits import (
    DEFAULT_CLIENT_MAX_REPLY_BYTES,
    DEFAULT_HOST,
    DEFAULT_PORT,
    MAX_CLIENT_MAX_REPLY_BYTES,
    MIN_MAX_REPLY_BYTES,
)

if TYPE_CHECKING:
    import ssl

# Seconds to connect, to send, and to wait for a reply that is not a
# waiting GetJob's. Ordinary replies take milliseconds; a busy server's
# commits and a Query (5 s at most) fit well within this.
DEFAULT_TIMEOUT = 30.0
# How much of a reply to read at once.
RECEIVE_SIZE = 65536

# How a client speaks TLS (jobserver.client's docstring): None or False for
# not at all, True for the system's CAs, a CA file's path, or a ready
# SSLContext. In quotes: ssl is loaded only by a client that speaks TLS, as
# loading it is a tenth of a client command's start-up.
TLS: TypeAlias = "bool | str | os.PathLike[str] | ssl.SSLContext | None"

def servers_of(host: ServersArgument, port: int) -> tuple[Address, ...]:
    """The addresses a client's `host` and `port` name: a host alone (an
    IPv6 address without brackets among them) is at `port`; "HOST:PORT"
    and "[IPV6]:PORT" at their own port, as in a list."""
    if isinstance(host, str) and is_bare_ipv6(host):
        return ((host.strip(), port),)
    return parse_servers(host, default_port=port)


def tls_context(tls: TLS) -> ssl.SSLContext | None:
    """The SSLContext for a client's `tls` argument, or None for plain TCP.
    A CA file that cannot be read or holds no certificate raises ValueError."""
    if tls is None or tls is False:
        return None
    import ssl

    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    path = os.fspath(tls)
    try:
        return ssl.create_default_context(cafile=path)
    except OSError as error:  # ssl.SSLError too: not PEM, or no certificate in it
        reason = error.strerror or str(error)
        raise ValueError(f"cannot read CA certificates from {path}: {reason}") from error


def auth_token(path: str | None = None) -> str | None:
    """The token to send: the content of the file `path` if given, else the
    JOBSERVER_AUTH_TOKEN environment variable, which holds the token itself
    (not a file name), else none."""
    if path:
        with open(path, encoding="utf-8") as token_file:
            return token_file.read().strip() or None
    return os.environ.get("JOBSERVER_AUTH_TOKEN") or None


def idle_connection_dead(fileno: int) -> bool:
    """Whether a connection with no request outstanding is unusable.

    The server sends nothing unasked, so if there is anything to read it has
    closed the connection (end of stream, reset) or is out of step.
    """
    # poll, unlike select, works for descriptors numbered above 1023.
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    return bool(poller.poll(0))


# Why a request failed, as ConnectionFailed says it.
CANNOT_CONNECT = "cannot connect to"
CANNOT_SEND = "cannot send to"
NO_REPLY = "no reply (the request may have been carried out) from"
BAD_REPLY = "a reply that means nothing (the request may have been carried out) from"


def check_max_reply_bytes(value: int) -> int:
    """`value` if a client may take it as its max_reply_bytes, else ValueError."""
    if not (
        type(value) is int and MIN_MAX_REPLY_BYTES <= value <= MAX_CLIENT_MAX_REPLY_BYTES
    ):
        raise ValueError(
            f"max_reply_bytes must be {MIN_MAX_REPLY_BYTES:,} to "
            f"{MAX_CLIENT_MAX_REPLY_BYTES:,}, not {value!r}"
        )
    return value


class Endpoint:
    """Where a client connects, and how it words a failure."""

    # What a request that took too long raises, worded "timed out".
    _timeouts: ClassVar[tuple[type[BaseException], ...]] = (TimeoutError,)

    def __init__(
        self,
        host: ServersArgument = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str | None = None,
        tls: TLS = None,
        max_reply_bytes: int = DEFAULT_CLIENT_MAX_REPLY_BYTES,
    ) -> None:
        """`host` is one host ("localhost", "::1"), one address with its
        port ("127.0.0.1:8888", "[::1]:8888"), or the servers of a queue
        served by several nodes: a list of "HOST:PORT" (or (host, port)),
        or one string of them separated by commas; `port` is the port of an
        address that gives none. ValueError for an address or list that
        cannot be used.
        `max_reply_bytes`: a reply announcing a larger body is not read, and
        its connection is closed as a broken one (ConnectionFailed); 4 MiB
        to 2 GiB, by default 128 MiB, four times the server's default bound
        (its --max-reply-bytes)."""
        self.max_reply_bytes = check_max_reply_bytes(max_reply_bytes)
        self.servers = Servers(servers_of(host, port))
        # The servers seen to keep idempotency keys (a keyed create answered
        # without naming the key ignored): only to these is a create whose
        # reply was lost sent again. A server older than idempotency keys
        # would create its jobs a second time.
        self.keys_kept: set[Address] = set()
        self.timeout = timeout
        # The server the last new connection went to, and who is told when
        # a new one goes to another: (the one left, the one now); a worker
        # logs its failovers so.
        self.node: Address | None = None
        self.on_move: Callable[[Address, Address], None] | None = None
        # Sent with every request when the server runs with --auth-token-file.
        self.auth_token = auth_token
        self.tls = tls_context(tls)

    @classmethod
    def from_address(
        cls,
        address: str,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str | None = None,
        tls: TLS = None,
    ) -> Self:
        """A client for `host:port`, `host` (port 8888) or `[ipv6]:port`, or
        for several of them separated by commas."""
        return cls(list(parse_servers(address)), DEFAULT_PORT, timeout, auth_token, tls)

    @property
    def host(self) -> str:
        """The host of the current (or next) connection."""
        return self.servers.now[0]

    @property
    def port(self) -> int:
        return self.servers.now[1]

    @property
    def address(self) -> str:
        return format_address(self.servers.now)

    def _learn_keys(self, call: Call[Any], reply: Reply) -> None:
        """Whether the server that answered a keyed create keeps its key: a
        server that does not names it in `ignoredHeaders` (protocol.md
        5.0), even when it refuses the request."""
        if not call.keyed or reply.code >= 500:
            return
        ignored = reply.headers.get("ignoredheaders", "").lower()
        if "idempotencykey" in ignored:
            self.keys_kept.discard(self.servers.now)
        else:
            self.keys_kept.add(self.servers.now)

    def _note_connected(self) -> None:
        """A new connection went to `servers.now`: tell `on_move` if that
        is another server than the last connection's."""
        left, self.node = self.node, self.servers.now
        if left is not None and left != self.node and self.on_move is not None:
            self.on_move(left, self.node)

    def switch_server(self) -> None:
        """Have the next connection go to another of the servers (one picked
        at random), as after a node answered 5xx; the current connection
        stays until closed. Does nothing with one server."""
        self.servers.move_on()

    def _reader(self) -> ReplyReader:
        """A reader for the next reply, held to `max_reply_bytes`."""
        return ReplyReader(self.max_reply_bytes)

    def _outcome(self, call: Call[Any], reply: Reply, earlier_lost: bool) -> Any:
        """What `reply` means for `call` (Call.outcome); MalformedReply when
        its body is not what the command answers. The caller closes the
        connection then: the server is broken, or not a jobserver."""
        try:
            return call.outcome(reply, earlier_lost)
        except UnreadableReply as error:
            raise MalformedReply(f"{BAD_REPLY} {self.address}: {error}", sent=True) from error

    def _encode(self, call: Call[Any]) -> bytes:
        return encode_request(call.method, {**call.params, "authToken": self.auth_token})

    def _failed(self, what: str, error: BaseException) -> ConnectionFailed:
        message = f"{what} {self.address}: {self._describe(error)}"
        return ConnectionFailed(message, sent=what == NO_REPLY)

    def _unreachable(self, failures: Sequence[ConnectionFailed]) -> ConnectionFailed:
        """What a new connection that no server took raises: the one
        failure, or, with several servers, one naming them all."""
        if len(failures) == 1:
            return failures[0]
        return ConnectionFailed(
            f"{CANNOT_CONNECT} any of the {len(failures)} servers: "
            + "; ".join(str(failure) for failure in failures)
        )

    def _handshake_failed(self, error: BaseException) -> ConnectionFailed:
        """What a failed TLS handshake means, for a person to act on."""
        import ssl  # loaded already: the client has a TLS context

        if isinstance(error, ssl.SSLCertVerificationError):
            if error.verify_code in _NAME_MISMATCH:
                return TLSFailed(
                    f"cannot connect to {self.address}: the server's TLS certificate is not "
                    f"for {self.host} ({error.verify_message}); connect by a name or address "
                    "that the certificate lists"
                )
            return TLSFailed(
                f"cannot connect to {self.address}: the server's TLS certificate is not "
                f"trusted ({error.verify_message}); if your own CA signed it, give that CA's "
                "certificate with --tls-ca FILE"
            )
        if _speaks_no_tls(error):
            return TLSFailed(
                f"the server at {self.address} does not speak TLS (it answered the TLS "
                "handshake with something else); leave out --tls and --tls-ca"
            )
        if _connection_ended(error):
            # A server that is stopping or starting ends connections too:
            # worth trying again, so not a TLSFailed.
            return ConnectionFailed(
                f"{CANNOT_CONNECT} {self.address}: the connection ended during the TLS "
                "handshake (the server may be restarting, or may not speak TLS: then leave "
                "out --tls and --tls-ca)"
            )
        return ConnectionFailed(
            f"{CANNOT_CONNECT} {self.address}: TLS handshake failed: {self._describe(error)}"
        )

    def _describe(self, error: BaseException) -> str:
        if isinstance(error, self._timeouts):
            return "timed out"
        return str(error) or type(error).__name__

    def _check_plaintext_reply(self, reply: Reply) -> None:
        """A TLS-only port answers a plaintext client with this one reply."""
        if self.tls is None and reply.status == TLS_REQUIRED:
            raise TLSFailed(f"the server at {self.address} requires TLS: use --tls")


# OpenSSL's verify codes for a certificate that does not name the host.
_NAME_MISMATCH = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
# OpenSSL's reasons when the peer answers a ClientHello with something that
# is not TLS (a plain-text reply such as TLS_NOT_SPOKEN).
_NOT_TLS_REASONS = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNEXPECTED_RECORD"}
)


def _connection_ended(error: BaseException) -> bool:
    """Whether a handshake ended as the connection did: a server
    restarting, or one that does not speak TLS and said nothing."""
    import ssl  # loaded already: the client has a TLS context

    return isinstance(error, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError))


def _speaks_no_tls(error: BaseException) -> bool:
    """Whether a handshake failure means the peer is not a TLS server: it
    answered with something that is not TLS."""
    import ssl  # loaded already: the client has a TLS context

    if _connection_ended(error):
        return False
    return isinstance(error, ssl.SSLError) and error.reason in _NOT_TLS_REASONS
