"""The channel to one incarnation of a tier process: the process running `kvtier.tiers.runner`, the
engine's end of its socket, and the two pump threads that move typed frames (`kvtier.tiers.messages`)
between that socket and the scheduler thread.

The sender thread writes the frames queued by `send`, in order. The receiver thread decodes the
frames the process sends and hands each to the owner's inbox as `(gen_id, Inbound)`; it stops at
the end of the stream (None) or at the first malformed frame (the `MessageError` itself: nothing
after it on the stream can be trusted). Neither thread ever raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from kvtier.tiers.codec import MessageError
from kvtier.tiers.messages import Message, encode, read_message

Inbound = Message | MessageError | None
"""What the receiver thread hands the scheduler thread: a message, the malformed frame that ended
the stream, or None when the stream ended (the process closed its socket or exited)."""
Inbox = queue.SimpleQueue[tuple[int, Inbound]]


class TierChannel:
    """One started tier process and its pump threads; `gen_id` tags everything it puts in the inbox.

    `send` and `close` are called on the owner's (scheduler) thread; `ready` is the owner's to set
    once the process sent `Ready`."""

    def __init__(self, name: str, spec: Mapping[str, Any], gen_id: int, inbox: Inbox) -> None:
        """Start the process with `spec` (the JSON the runner reads on its stdin) and both threads."""
        self.gen_id = gen_id
        self.ready = False
        self._inbox = inbox
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # The tier process imports what this one can (kvtier itself, `module_path` plugins).
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.tiers.runner", str(child_sock.fileno())],
                stdin=subprocess.PIPE,
                pass_fds=(child_sock.fileno(),),
                env=env,
            )
        except BaseException:
            self.sock.close()
            raise
        finally:
            child_sock.close()
        assert self.proc.stdin is not None  # stdin=PIPE
        self.proc.stdin.write(json.dumps(dict(spec)).encode())
        self.proc.stdin.close()
        threading.Thread(target=self._send_loop, daemon=True, name=f"kvtier-{name}-send").start()
        threading.Thread(target=self._recv_loop, daemon=True, name=f"kvtier-{name}-recv").start()

    def send(self, msg: Message) -> None:
        """Queue `msg` for the sender thread, encoded here (MessageError: it cannot be framed)."""
        self._outbox.put(encode(msg))

    def close(self) -> None:
        """Stop both pump threads at once, a blocked send or receive included (the receiver reports
        the end of the stream); frames still queued are dropped. Leaves the process alone. Idempotent."""
        self._outbox.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _send_loop(self) -> None:
        while (frame := self._outbox.get()) is not None:
            try:
                self.sock.sendall(frame)
            except OSError:
                return

    def _recv_loop(self) -> None:
        while True:
            try:
                msg: Inbound = read_message(self.sock)
            except (EOFError, OSError):
                self._inbox.put((self.gen_id, None))
                return
            except MessageError as e:
                self._inbox.put((self.gen_id, e))
                return
            self._inbox.put((self.gen_id, msg))

