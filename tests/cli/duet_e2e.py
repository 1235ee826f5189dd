"""What the end-to-end test scripts of tests/cli share (imported from the script's own
folder, which Python puts first on sys.path)."""
import socket
import sys


def check(cond, msg):
    """Fails the test with `msg` (on stderr, exit 1) unless cond holds."""
    if not cond:
        print("FAIL:", msg, file=sys.stderr)
        sys.exit(1)


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
