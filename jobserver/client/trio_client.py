"""`TrioClient`: the async client on trio alone. The worker manager, which
runs on trio, uses it; programs on asyncio, or on trio through anyio, have
`AsyncClient`."""

from __future__ import annotations

import ssl

import trio

from jobserver.client.async_calls import AsyncCalls
from jobserver.client.endpoint import CANNOT_CONNECT, CANNOT_SEND, NO_REPLY, RECEIVE_SIZE
from jobserver.wire.client_framing import Reply

# What moving bytes with trio can raise besides cancellation.
_TRIO_FAILURES = (OSError, ValueError, trio.BrokenResourceError, trio.TooSlowError)


class TrioClient(AsyncCalls[trio.abc.Stream]):
    """The methods of Client, as coroutines, for trio."""

    _timeouts = (TimeoutError, trio.TooSlowError)

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await trio.aclose_forcefully(stream)

    async def _send_on(self, stream: trio.abc.Stream, request: bytes) -> trio.abc.Stream:
        try:
            with trio.fail_after(self.timeout):
                await stream.send_all(request)
        except _TRIO_FAILURES as error:
            await self.aclose()
            raise self._failed(CANNOT_SEND, error) from error
        except BaseException:
            await self.aclose()
            raise
        return stream

    async def _receive(self, stream: trio.abc.Stream, patience: float) -> Reply:
        reader = self._reader()
        try:
            with trio.fail_after(patience):
                while (reply := reader.reply()) is None:
                    reader.feed(await stream.receive_some(RECEIVE_SIZE))
        except _TRIO_FAILURES as error:
            await self.aclose()
            raise self._failed(NO_REPLY, error) from error
        except BaseException:
            await self.aclose()
            raise
        if reply.closes_connection or reader.leftover:
            await self.aclose()
        self._check_plaintext_reply(reply)
        return reply

    async def _connect(self) -> trio.abc.Stream:
        await self.aclose()
        try:
            # trio's streams set TCP_NODELAY themselves.
            with trio.fail_after(self.timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
        except (OSError, trio.TooSlowError) as error:
            raise self._failed(CANNOT_CONNECT, error) from error
        if self.tls is not None:
            stream = await self._handshake(stream, self.tls)
        self._stream = stream
        return stream

    async def _handshake(self, tcp: trio.abc.Stream, context: ssl.SSLContext) -> trio.SSLStream:
        """TLS over `tcp`, handshaken at once rather than on the first send,
        so that a failure is told as one of TLS rather than of the request."""
        secure = trio.SSLStream(tcp, context, server_hostname=self.host)
        try:
            with trio.fail_after(self.timeout):
                await secure.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as error:
            await trio.aclose_forcefully(secure)
            raise self._handshake_failed(error.__cause__ or error) from error
        except BaseException:
            await trio.aclose_forcefully(secure)
            raise
        return secure

    def _fileno(self, stream: trio.abc.Stream) -> int:
        transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        assert isinstance(transport, trio.SocketStream)
        return transport.socket.fileno()
