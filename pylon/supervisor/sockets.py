"""The sockets the supervisor binds for its processes, so that they share one port pair and
`--listen host:0` still means one port for the node (learnt from the first bind).

- TCP: one *placeholder*, bound with SO_REUSEPORT and never listening, held for the
  supervisor's life (it keeps the port while every process is down, and it is where a `:0`
  port is learnt), and a fresh bound socket for each start of a process, handed over and
  closed here at once: the process's `listen` puts it in the port's reuseport group, and its
  death takes it out. While a process is down the kernel sends new connections to the live
  ones; holding its listening socket instead would queue them unanswered until the restart
  (up to the 30 s backoff).
- UDP (with --quic-listen): one socket per process slot, bound at start and held for the
  supervisor's life; a restarted process gets the *same* socket. The kernel picks a UDP socket
  by a hash of the 4-tuple over the group's members, so any change in membership would move
  the other processes' live QUIC flows to a process that does not know them. Held, the group
  never changes; datagrams for a dead process wait in its socket's buffer.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from pylon.listeners import host_port
from pylon.startup import cannot_listen


def _reuseport(kind: int, host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@dataclass
class NodeSockets:
    """The TCP placeholder, and the held UDP sockets (one per process slot)."""

    tcp_host: str
    tcp_port: int
    placeholder: socket.socket
    udp: list[socket.socket] = field(default_factory=list)

    def tcp_for_start(self) -> socket.socket:
        """A new TCP socket on the node's port, bound, not listening: for one start of one
        process (the caller closes its copy once the process has it)."""
        try:
            return _reuseport(socket.SOCK_STREAM, self.tcp_host, self.tcp_port)
        except OSError as exc:
            raise cannot_listen("--listen", host_port(self.tcp_host, self.tcp_port), exc) from None

    @property
    def quic_port(self) -> int | None:
        return int(self.udp[0].getsockname()[1]) if self.udp else None

    def close(self) -> None:
        self.placeholder.close()
        for sock in self.udp:
            sock.close()


def bind_node(
    listen: tuple[str, int], quic_listen: tuple[str, int] | None, processes: int
) -> NodeSockets:
    """Bind the placeholder (learning the TCP port) and, with `quic_listen`, one UDP socket per
    process on one port; a failure is a `StartupError` naming the flag."""
    host, port = listen
    try:
        placeholder = _reuseport(socket.SOCK_STREAM, host, port)
    except OSError as exc:
        raise cannot_listen("--listen", host_port(host, port), exc) from None
    node = NodeSockets(host, int(placeholder.getsockname()[1]), placeholder)
    if quic_listen is None:
        return node
    quic_host, quic_port = quic_listen
    try:
        for _ in range(processes):
            node.udp.append(_reuseport(socket.SOCK_DGRAM, quic_host, quic_port))
            quic_port = int(node.udp[0].getsockname()[1])  # `:0`: the first bind's port
    except OSError as exc:
        node.close()
        raise cannot_listen("--quic-listen", host_port(*quic_listen), exc) from None
    return node
