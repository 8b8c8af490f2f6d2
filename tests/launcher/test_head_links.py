"""AgentLink.send: written on the caller's thread when the transport takes it at once, through
the link's sender thread when it does not, never blocking the caller, always in order.

The link is the real LocalLink (a pipe to a subprocess); its "agent" echoes stdin to stdout,
but only once told to start reading, so the pipe fills and the backlog path is taken.
"""
import os
import sys
import threading

from dslaunch.launcher.head import LocalLink
from dslaunch.launcher.protocol import AgentRequest

ECHO = r"""
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
for line in sys.stdin.buffer:
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
"""
REQUEST = AgentRequest("h", (), 0, 1.0, 1.0, 5.0, True)


class Events:
    def __init__(self):
        self.got = []
        self.ended = threading.Event()

    def __call__(self, ev):
        self.got.append(ev)
        if ev.get("ev") == "eof":
            self.ended.set()


def echo_link(tmp_path):
    link = LocalLink("h", sys.executable, str(tmp_path))
    go = tmp_path / "go"
    link._argv = [sys.executable, "-c", ECHO, str(go)]
    return link, go


def finish(link, go, events):
    go.touch()
    link.stop_sending()  # what was sent is still written
    if link._sender is not None:
        link._sender.join(60)
    link.close()
    assert events.ended.wait(60)
    link.proc.wait(60)
    return [ev for ev in events.got if ev.get("ev") != "eof"]


def test_small_sends_are_written_inline_without_a_thread(tmp_path):
    link, go = echo_link(tmp_path)
    events = Events()
    link.start(events, REQUEST)
    for i in range(5):
        link.send(b'{"n": %d}\n' % i)
    assert link._sender is None  # the pipe took every line at once: no thread per link
    got = finish(link, go, events)
    assert got == [{"request": REQUEST.to_dict()}] + [{"n": i} for i in range(5)]


def test_a_full_pipe_queues_behind_the_sender_thread_in_order(tmp_path):
    link, go = echo_link(tmp_path)
    events = Events()
    link.start(events, REQUEST)
    pad = "x" * 1000
    lines = [('{"n": %d, "pad": "%s"}\n' % (i, pad)).encode() for i in range(300)]  # ~300 kB, the pipe holds 64 kB

    def sender():
        for line in lines:
            link.send(line)

    t = threading.Thread(target=sender)
    t.start()
    t.join(60)
    assert not t.is_alive(), "send() blocked on a full pipe"
    assert link._sender is not None and link._outbox  # the rest waits for the reader
    assert not go.exists()  # ...which has not read a byte yet
    got = finish(link, go, events)
    assert got == [{"request": REQUEST.to_dict()}] + [{"n": i, "pad": pad} for i in range(300)]
    assert not link._outbox


def test_sends_to_a_dead_agent_are_dropped_quietly(tmp_path):
    link = LocalLink("h", sys.executable, str(tmp_path))
    link._argv = [sys.executable, "-c", "pass"]
    events = Events()
    link.start(events, REQUEST)
    assert events.ended.wait(60)
    link.proc.wait(60)
    for _ in range(100):  # EPIPE: the link is dead, its reader already said eof
        link.send(b'{"cmd": "ping"}\n' * 100)
    assert link._send_failed
    link.stop_sending()
    if link._sender is not None:
        link._sender.join(60)
        assert not link._sender.is_alive()
    link.close()
    assert os.get_blocking(link.proc.stdout.fileno())  # only stdin was made non-blocking


def test_one_reader_thread_cuts_many_streams_into_the_lines_file_iteration_gives(tmp_path):
    """The shared LineReader against the per-link threads it replaced, which iterated the stream
    as a file: same lines (the last one may lack its newline), then one eof per stream."""
    from dslaunch.launcher.line_reader import LineReader

    reader = LineReader(name="test-links-in")
    chunks = [b"a", b"lpha\nbe", b"ta\n", b"\n", b"gam", b"ma\ndelta"]  # lines split across writes
    pipes = [os.pipe() for _ in range(3)]
    got = {i: [] for i in range(3)}
    ended = {i: threading.Event() for i in range(3)}
    for i, (r, _) in enumerate(pipes):
        reader.add(r, got[i].append, ended[i].set)
    for chunk in chunks:
        for i, (_, w) in enumerate(pipes):
            os.write(w, b"%d:" % i + chunk)
    for _, w in pipes:
        os.close(w)
    for i, (r, _) in enumerate(pipes):
        assert ended[i].wait(60)
        os.close(r)
        reference = tmp_path / f"s{i}"
        reference.write_bytes(b"".join(b"%d:" % i + c for c in chunks))
        with open(reference, "rb") as f:
            assert got[i] == list(f)
    assert [t.name for t in threading.enumerate()].count("test-links-in") == 1


def test_a_closed_fd_whose_number_is_reused_ends_the_old_stream(tmp_path):
    """A link's fd closed under the reader (epoll forgets it, the selector's map does not) and its
    number reused by the next link: the old stream ends with its eof, the new one is read."""
    from dslaunch.launcher.line_reader import LineReader

    reader = LineReader(name="test-links-reuse")
    old_r, old_w = os.pipe()
    old_lines, old_end = [], threading.Event()
    first = threading.Event()
    reader.add(old_r, lambda raw: (old_lines.append(raw), first.set()), old_end.set)
    os.write(old_w, b"one\n")
    assert first.wait(60)  # registered and read
    os.close(old_r)  # no EOF is ever reported for it: epoll drops a closed fd silently
    os.close(old_w)  # (after the read end: the reader must never see the old pipe ready again)
    new_r, new_w = os.pipe()
    if new_r != old_r:
        os.dup2(new_r, old_r)
        os.close(new_r)
    new_lines, new_end = [], threading.Event()
    reader.add(old_r, new_lines.append, new_end.set)
    os.write(new_w, b"two\nthree")
    os.close(new_w)
    assert new_end.wait(60) and old_end.is_set()
    os.close(old_r)
    assert old_lines == [b"one\n"] and new_lines == [b"two\n", b"three"]
