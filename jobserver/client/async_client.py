"""`AsyncClient`: the async client for asyncio and trio alike, on anyio."""

from __future__ import annotations

import ssl

import anyio
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.tls import TLSStream

from jobserver.client.async_calls import AsyncCalls
from jobserver.client.endpoint import CANNOT_CONNECT, CANNOT_SEND, NO_REPLY, RECEIVE_SIZE
from jobserver.wire.client_framing import Reply

# What moving bytes with anyio can raise besides cancellation. A broken
# stream says why in its cause (a reset, an SSL error).
_FAILURES = (OSError, ValueError, anyio.BrokenResourceError)


class AsyncClient(AsyncCalls[ByteStream]):
    """The methods of Client, as coroutines, on asyncio or trio (whichever
    runs the caller)."""

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await anyio.aclose_forcefully(stream)

    async def _send_on(self, stream: ByteStream, request: bytes) -> ByteStream:
        try:
            with anyio.fail_after(self.timeout):
                await stream.send(request)
        except _FAILURES as error:
            await self.aclose()
            raise self._failed(CANNOT_SEND, _why(error)) from error
        except BaseException:
            await self.aclose()
            raise
        return stream

    async def _receive(self, stream: ByteStream, patience: float) -> Reply:
        reader = self._reader()
        try:
            with anyio.fail_after(patience):
                while (reply := reader.reply()) is None:
                    reader.feed(await _receive_some(stream))
        except _FAILURES as error:
            await self.aclose()
            raise self._failed(NO_REPLY, _why(error)) from error
        except BaseException:
            await self.aclose()
            raise
        if reply.closes_connection or reader.leftover:
            await self.aclose()
        self._check_plaintext_reply(reply)
        return reply

    async def _connect(self) -> ByteStream:
        await self.aclose()
        try:
            # anyio sets TCP_NODELAY on both event loops.
            with anyio.fail_after(self.timeout):
                stream: ByteStream = await anyio.connect_tcp(self.host, self.port)
        except OSError as error:  # TimeoutError is one
            raise self._failed(CANNOT_CONNECT, error) from error
        if self.tls is not None:
            stream = await self._handshake(stream, self.tls)
        self._stream = stream
        return stream

    async def _handshake(self, tcp: ByteStream, context: ssl.SSLContext) -> TLSStream:
        """TLS over `tcp`, handshaken at once rather than on the first send,
        so that a failure is told as one of TLS rather than of the request."""
        try:
            with anyio.fail_after(self.timeout):
                return await TLSStream.wrap(tcp, hostname=self.host, ssl_context=context)
        except _FAILURES as error:
            await anyio.aclose_forcefully(tcp)
            raise self._handshake_failed(_why(error)) from error
        except BaseException:
            await anyio.aclose_forcefully(tcp)
            raise

    def _fileno(self, stream: ByteStream) -> int:
        # A TLS stream hands on its transport's attributes.
        return stream.extra(SocketAttribute.raw_socket).fileno()


async def _receive_some(stream: ByteStream) -> bytes:
    """The next bytes, or b"" at the end of the stream (as ReplyReader takes it)."""
    try:
        return await stream.receive(RECEIVE_SIZE)
    except anyio.EndOfStream:
        return b""


def _why(error: BaseException) -> BaseException:
    """What went wrong underneath: anyio raises BrokenResourceError from it,
    or, on asyncio when the peer resets the connection, with no cause at
    all (seen with anyio 4.4): that is a connection that ended."""
    if isinstance(error, anyio.BrokenResourceError):
        if error.__cause__ is not None:
            return error.__cause__
        return ConnectionResetError("the connection was reset")
    return error
