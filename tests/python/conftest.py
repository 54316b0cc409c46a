"""Fixtures of the Python tests: real shmps-server processes (shmps.Server),
segment names unique to the test and process, and a check that each test
leaves nothing of its own in /dev/shm."""

import os
import glob
import itertools
import time

import pytest

import shmps

_counter = itertools.count()

# A small model: two tensors, 8 + 8 parameters.
SMALL = [("w", (4, 2)), ("b", (8,))]


def unique_name(tag):
    """A segment name unique to this process and call (at most 32 characters)."""
    return f"p{os.getpid()}_{next(_counter)}_{tag}"[:32]


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_in_pytests_own_directory(tmp_path_factory):
    """The logs shmps.Server keeps of servers a test killed go where
    pytest prunes its old runs, not into /tmp: this process's and its
    children's (the scripts some tests run)."""
    import tempfile
    directory = str(tmp_path_factory.mktemp("tmp"))
    previous, tempfile.tempdir = tempfile.tempdir, directory
    previous_env = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = directory
    yield
    tempfile.tempdir = previous
    if previous_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous_env


def restart(server, tensors=SMALL):
    """Kills `server` (SIGKILL: its segment stays) and starts another SGD
    host server (init="uniform") under its name once the dead one's last
    heartbeat is stale, so that a worker's next call sees it dead before
    sending anything and re-attaches. Returns the new server; the caller
    stops it."""
    server.process.kill()
    server.process.wait()
    server.process = None
    time.sleep(0.2)  # the heartbeat is trusted for 100 ms
    again = shmps.Server(tensors=tensors, name=server.name, optimizer="sgd", backend="host", init="uniform")
    again.start()
    return again


@pytest.fixture
def make_server(request):
    """make_server(tensors=SMALL, **options) -> a started shmps.Server,
    stopped at the end of the test; then no shm object of it may remain."""
    servers = []

    def make(tensors=SMALL, tag=None, **options):
        options.setdefault("optimizer", "sgd")
        options.setdefault("backend", "host")
        s = shmps.Server(tensors=tensors, name=unique_name(tag or request.node.name[5:]), **options)
        s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()
        left = glob.glob(f"/dev/shm/shmps.{s.name}*")
        assert not left, f"left in /dev/shm: {left}"
