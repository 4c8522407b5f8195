"""What plain TCP moves through the all-reduce benchmark's links: the ceiling of any all-reduce over TCP.

`allreduce_bandwidth.py` compares its all-reduce with the physical limit 2(N−1)/N · S / B of each
peer's link. TCP does not reach that limit, whatever runs over it: the payload is 1448 bytes of
every 1514-byte frame that the shaper counts (TCP/IP headers with timestamps, and the Ethernet
header), the ACKs of what a peer receives share its sending direction, and the flows that share a
link do not finish together. This module moves the all-reduce's bytes with nothing but sockets, in
the same namespaces, on the same shaped links, so that a table can say which part of the gap is
TCP's and which is the all-reduce's:

- **all-to-all**: each peer sends 2(N−1)/N · S, split evenly, to every other peer at once: the
  butterfly all-reduce's traffic (its inputs to the reducers, and its averaged part back), as
  concurrent TCP flows that share each sender's and each receiver's link;
- **one flow per link**: each peer sends the same 2(N−1)/N · S to the next peer only (i → i+1), so
  that every link carries one flow in each direction, as in a ring all-reduce.

A probe's time runs from a common start (every connection is open by then, as the averagers'
connections are) to the last byte that any peer receives.
"""

from __future__ import annotations

import socket
import threading
import time

PORT = 29417
TAG_BYTES = 32  # every connection opens with its probe's tag, padded
CHUNK = 1 << 16
PATTERNS = ("all-to-all", "one-flow-per-link")


def destinations(pattern: str, me: int, peers: int) -> list[int]:
    """Whom peer `me` sends to in `pattern`."""
    if pattern == "all-to-all":
        return [j for j in range(peers) if j != me]
    if pattern == "one-flow-per-link":
        return [(me + 1) % peers]
    raise ValueError(f"unknown pattern {pattern!r}; valid: {', '.join(PATTERNS)}")


def bytes_per_destination(pattern: str, peers: int, s_bytes: float) -> int:
    """Each peer sends 2(N−1)/N · S in all, split evenly among its destinations."""
    return int(2 * (peers - 1) / peers * s_bytes / len(destinations(pattern, 0, peers)))


class Sink:
    """Listens on (ip, port) and drains every connection; for each tag, the bytes received and the time
    of the last byte (time.time(), comparable between namespaces on one machine)."""

    def __init__(self, ip: str, port: int = PORT):
        self._server = socket.create_server((ip, port))
        self.port = self._server.getsockname()[1]  # the one the system chose, for port 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._done: dict[str, list[tuple[int, float]]] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._drain, args=(connection,), daemon=True).start()

    def _drain(self, connection: socket.socket) -> None:
        with connection:
            tag = b""
            while len(tag) < TAG_BYTES:
                chunk = connection.recv(TAG_BYTES - len(tag))
                if not chunk:
                    return
                tag += chunk
            received, last = 0, time.time()
            while chunk := connection.recv(CHUNK):
                received, last = received + len(chunk), time.time()
        with self._arrived:
            self._done.setdefault(tag.decode().strip(), []).append((received, last))
            self._arrived.notify_all()

    def wait(self, tag: str, flows: int, timeout_s: float) -> list[tuple[int, float]]:
        """(bytes, time of the last byte) of the `flows` connections tagged `tag`; TimeoutError if they do
        not all end within timeout_s."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._done.get(tag, ())) >= flows, timeout_s):
                raise TimeoutError(f"TCP probe {tag}: {len(self._done.get(tag, ()))} of {flows} flows ended "
                                   f"within {timeout_s:.0f} s")
            return self._done.pop(tag)

    def close(self) -> None:
        self._server.close()


def probe(sink: Sink, pattern: str, me: int, addresses: list[tuple[str, int]], s_bytes: float, tag: str,
          start: float, timeout_s: float) -> dict:
    """Peer `me`'s part of one probe among the peers whose sinks listen at `addresses`: open its connections,
    send from `start` on, and wait for its own incoming flows. Returns when the last byte came in (`end`;
    `flow_ends`: of each incoming flow), and the bytes sent and received."""
    peers = len(addresses)
    nbytes = bytes_per_destination(pattern, peers, s_bytes)
    payload = memoryview(bytes(nbytes))
    header = tag.encode().ljust(TAG_BYTES)
    if len(header) != TAG_BYTES:
        raise ValueError(f"tag {tag!r} is longer than {TAG_BYTES} bytes")
    connections = [socket.create_connection(addresses[j], timeout=timeout_s) for j in destinations(pattern, me, peers)]
    errors: list[BaseException] = []

    def send(connection: socket.socket) -> None:
        try:
            with connection:
                connection.sendall(header)
                time.sleep(max(0.0, start - time.time()))
                connection.sendall(payload)
                connection.shutdown(socket.SHUT_WR)
        except OSError as e:
            errors.append(e)

    senders = [threading.Thread(target=send, args=(c,), daemon=True) for c in connections]
    for thread in senders:
        thread.start()
    incoming = sum(me in destinations(pattern, j, peers) for j in range(peers))
    flows = sink.wait(tag, incoming, timeout_s + max(0.0, start - time.time()))
    for thread in senders:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    ends = sorted(last for _, last in flows)
    return dict(pattern=pattern, start=start, end=ends[-1], flow_ends=ends,
                sent=nbytes * len(connections), received=sum(got for got, _ in flows))
