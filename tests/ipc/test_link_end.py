"""LinkEnd: a remote EngineCore's Link behind the ring ends' contract (send_nowait, recv_nowait,
receive), as the front's EngineClient uses them: messages whole and in order both ways, the
messages before a closed Link still delivered, then BrokenResourceError for good."""

from __future__ import annotations

import socket

import anyio
import pytest

from vx.ipc.link import Link
from vx.ipc.link_end import LinkEnd

pytestmark = pytest.mark.timeout(30)


def _pair() -> tuple[LinkEnd, Link]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    end = LinkEnd("engine 1")
    end.attach(Link(a))
    return end, Link(b)


def test_messages_cross_whole_and_in_order_then_a_closed_link_is_a_dead_engine() -> None:
    end, remote = _pair()
    try:
        with pytest.raises(anyio.WouldBlock):
            end.recv_nowait()
        sent = [bytes([i]) * (1 + 7000 * i) for i in range(5)]
        for data in sent:
            end.send_nowait(data)
        assert [remote.recv(timeout=5) for _ in sent] == sent
        for data in sent:
            remote.send(data)
        remote.close()

        async def read_all() -> list[bytes]:
            got = []
            with anyio.fail_after(5):
                while True:
                    try:
                        got.append(await end.receive())
                    except anyio.BrokenResourceError as e:
                        assert "closed the link" in str(e)
                        return got

        assert anyio.run(read_all) == sent
        with pytest.raises(anyio.BrokenResourceError):
            end.recv_nowait()
        with pytest.raises(anyio.BrokenResourceError):
            end.send_nowait(b"x")
    finally:
        end.close()
        end.close()  # idempotent
        remote.close()


def test_an_ordered_close_says_goodbye_and_a_lost_peer_does_not() -> None:
    """The front's `close` (after its Shutdown) ends the remote side's reads with EndOfStream
    (an ordered end: the remote node exits 0); a peer that closes without a goodbye, as a
    killed process's socket does, is BrokenResourceError (a lost front: exit 3)."""
    end, remote = _pair()
    try:
        end.send_nowait(b"shutdown")
        end.close()
        assert remote.recv(timeout=5) == b"shutdown"
        with pytest.raises(anyio.EndOfStream):
            remote.recv(timeout=5)
    finally:
        remote.close()
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = Link(socket.create_connection(server.getsockname()))
        b = Link(server.accept()[0])
    try:
        a.send(b"x")
        a.close()  # no goodbye
        assert b.recv(timeout=5) == b"x"
        with pytest.raises(anyio.BrokenResourceError, match="without a goodbye"):
            b.recv(timeout=5)
    finally:
        b.close()


def test_a_link_that_never_came_fails_the_waiting_reader() -> None:
    end = LinkEnd("engine 1")

    async def wait_then_fail() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, end.fail, "its node did not connect")
            with anyio.fail_after(5), pytest.raises(anyio.BrokenResourceError, match="connect"):
                await end.receive()

    try:
        end.send_nowait(b"queued until attached")  # accepted while the node connects
        anyio.run(wait_then_fail)
    finally:
        end.close(flush_s=0.1)


def test_a_vanished_node_is_given_up_by_tcp_keepalive() -> None:
    """A node that vanishes sends no FIN: the kernel's probes give the Link up within
    seconds (the options asked for are the ones the socket holds)."""
    from vx.ipc import link as link_module

    end, remote = _pair()
    try:
        sock = remote._sock
        tcp = socket.IPPROTO_TCP
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(tcp, socket.TCP_KEEPIDLE) == link_module.KEEPALIVE_IDLE_S
        assert sock.getsockopt(tcp, socket.TCP_KEEPINTVL) == link_module.KEEPALIVE_INTERVAL_S
        assert sock.getsockopt(tcp, socket.TCP_KEEPCNT) == link_module.KEEPALIVE_COUNT
        assert sock.getsockopt(tcp, socket.TCP_USER_TIMEOUT) == 10_000
    finally:
        end.close()
        remote.close()
