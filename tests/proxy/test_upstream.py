"""The relay's HTTP/1.1 client against a scripted server on loopback: chunked and sized bodies,
keep-alive reuse, a server that closed an idle connection, and one that dies mid-body."""
from __future__ import annotations

import asyncio

import pytest

from proxy.upstream import UpstreamClient, UpstreamError

CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n")
SIZED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
BROKEN = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n"


async def scripted(answers: list[bytes], close_after_each: bool = False):
    """A server that reads one request per answer; returns (port, requests seen, connections made)."""
    seen, connections = [], []

    async def handle(reader, writer):
        connections.append(writer)
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            size = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length")))
            seen.append(head + await reader.readexactly(size))
            answer = answers.pop(0)
            writer.write(answer)
            await writer.drain()
            if answer is BROKEN or close_after_each:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen, connections


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_chunked_and_sized_bodies_on_one_kept_alive_connection():
    async def go():
        server, port, seen, connections = await scripted([CHUNKED, SIZED])
        client = UpstreamClient()
        first = await client.request("127.0.0.1", port, "POST", "/v1/x?a=1", [(b"x-test", b"1")], b'{"m":1}')
        assert first.status == 200 and first.header(b"content-type") == b"text/event-stream"
        assert [c async for c in first.chunks()] == [b"data: a\n\n", b"data: b\n\n"]
        first.close()
        second = await client.request("127.0.0.1", port, "GET", "/props", [], b"")
        assert await second.read() == b"{}"
        second.close()
        client.close()
        server.close()
        assert seen[0].startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n") and seen[0].endswith(b'\r\n\r\n{"m":1}')
        assert b"x-test: 1" in seen[0] and len(connections) == 1
    run(go())


def test_an_idle_connection_the_server_closed_is_replaced():
    async def go():
        server, port, seen, connections = await scripted([SIZED, SIZED], close_after_each=True)
        client = UpstreamClient()
        for _ in range(2):
            response = await client.request("127.0.0.1", port, "GET", "/", [], b"")
            assert await response.read() == b"{}"
            response.close()
            await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
        client.close()
        server.close()
        assert len(connections) == 2 and len(seen) == 2
    run(go())


def test_a_server_dying_mid_body_raises_and_an_absent_one_cannot_be_reached():
    async def go():
        server, port, _, _ = await scripted([BROKEN])
        client = UpstreamClient()
        response = await client.request("127.0.0.1", port, "POST", "/", [], b"")
        chunks = response.chunks()
        assert await chunks.__anext__() == b"data: a\n\n"
        with pytest.raises(UpstreamError, match="RemoteProtocolError"):
            await chunks.__anext__()
        response.close()
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await client.request("127.0.0.1", port, "GET", "/", [], b"")
    run(go())
