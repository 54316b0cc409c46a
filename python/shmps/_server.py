"""shmps.Server: a shmps-server process for a job that is one script.

    model = Net()
    with shmps.Server(model, optimizer="adam", lr=1e-3, init="normal") as server:
        ... # workers: shmps.connect(server.name)

It runs the shmps-server binary with the model's tensor table, waits until
the server accepts workers, and stops it (SIGTERM, then SIGKILL) on exit.
For real use the server runs on its own, under systemd (docs/operations.md).
"""

import contextlib
import fcntl
import itertools
import math
import operator
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from . import _errors

_names = itertools.count()


def server_binary():
    """The shmps-server to run: $SHMPS_SERVER_BIN, else the one this package
    was built or installed with, else shmps-server on PATH."""
    candidates = [os.environ.get("SHMPS_SERVER_BIN")]
    try:
        from . import _paths
        here = os.path.dirname(os.path.abspath(__file__))
        candidates.append(os.path.join(here, _paths.SERVER_BIN))
    except ImportError:
        pass
    candidates.append(shutil.which("shmps-server"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("no shmps-server found: set SHMPS_SERVER_BIN, install shmps (pip install . or the shmps "
                            "package), or put shmps-server on PATH")


def served_shape(shape):
    """The shape a tensor of `shape` has on the server, whose tensors have 1
    to 4 dimensions: a 0-d one is (1,), and one of more than 4 dimensions
    keeps its first three and folds the rest into the fourth (a Conv3d
    weight (out, in, d, h, w) is (out, in, d, h * w)). The elements, in
    order, are the same: a parameter is a view of its range either way."""
    dims = [operator.index(d) for d in shape] or [1]
    if len(dims) > 4:
        dims = dims[:3] + [math.prod(dims[3:])]
    return tuple(dims)


def _tensor_specs(model=None, tensors=None):
    """["name:D0xD1", ...] from model.named_parameters() or (name, shape)
    pairs, each shape as served_shape() gives it."""
    if (model is None) == (tensors is None):
        raise ValueError("give a model (a torch.nn.Module) or tensors ((name, shape) pairs), exactly one")
    if model is not None:
        pairs = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue  # frozen: each process's own (shmps.torch.RemoteOptimizer leaves it out too)
            if p.is_sparse or str(p.dtype) != "torch.float32":
                raise TypeError(f"parameter {name!r} is {'sparse' if p.is_sparse else p.dtype}: shmps serves dense "
                                "float32 parameters only")
            pairs.append((name, tuple(p.shape)))
        tensors = pairs
        if not tensors:
            raise ValueError("the model has no trainable parameters" +
                             (" (every one has requires_grad=False)" if any(True for _ in model.parameters()) else ""))
    if isinstance(tensors, dict):
        tensors = tensors.items()
    specs = []
    for name, shape in tensors:
        if not isinstance(name, str):
            raise TypeError(f"a tensor's name must be a str, not {name!r}")
        if ":" in name:
            raise ValueError(f"tensor name {name!r} holds ':', which shmps-server's --tensor NAME:SHAPE cannot carry "
                             "(names are 1..63 printable characters without blanks or ':')")
        if isinstance(shape, (str, bytes)):
            raise TypeError(f"tensor {name!r}: the shape must be a sequence of ints, not {shape!r}")
        try:
            dims = served_shape(shape)
        except TypeError:
            raise TypeError(f"tensor {name!r}: the shape must be a sequence of ints, not {shape!r}") from None
        specs.append(f"{name}:{'x'.join(str(d) for d in dims)}")
    if not specs:
        raise ValueError("the model has no parameters")
    return specs


def _option_args(options):
    """--key value for each option (underscores become dashes); True is a bare flag."""
    args = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


class Server:
    """A shmps-server child process. Keyword options are shmps-server's
    (`lr`, `max_staleness`, `weight_decay`, `init`, `checkpoint_dir`, ...;
    see `shmps-server --help`). `model` (a torch.nn.Module) or `tensors`
    ((name, shape) pairs) gives the tensor table. `name`: the segment name
    (default: a unique one). `log`: a path for the server's log (default: a
    temporary file, removed by a stop() that finds the server exited 0; one
    whose start failed is kept for the error that names it)."""

    def __init__(self, model=None, *, tensors=None, name=None, optimizer="adam", binary=None, log=None,
                 start_timeout=30.0, **options):
        if not isinstance(optimizer, str):
            raise TypeError(f"optimizer must be a name (sgd, adam or adamw), not {optimizer!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str (the segment's name), not {name!r}")
        try:
            timeout_ok = not isinstance(start_timeout, (bool, str, bytes)) and float(start_timeout) > 0  # NaN: False
        except (TypeError, ValueError):
            timeout_ok = False
        if not timeout_ok:
            raise ValueError(f"start_timeout must be a positive number of seconds, not {start_timeout!r}")
        start_timeout = float(start_timeout)
        self.name = name if name is not None else f"py{os.getpid()}_{next(_names)}"
        self.binary = binary or server_binary()
        self.args = [self.binary, "--name", self.name]
        for spec in _tensor_specs(model, tensors):
            self.args += ["--tensor", spec]
        self.args += ["--optimizer", optimizer] + _option_args(options)
        self.start_timeout = start_timeout
        self._log_path = log
        self._own_log = log is None
        self.process = None
        self._starter = None  # the pid of the process that started it: only it stops it
        self._keep_log = False  # a start that failed: its error names the log

    @property
    def log_path(self):
        return self._log_path

    def start(self):
        """Starts the server and returns once it accepts workers."""
        if self.process is not None and self.process.poll() is None:
            raise _errors.InvalidArgumentError(f"shmps-server '{self.name}' is already started (pid "
                                               f"{self.process.pid}); stop() it first")
        self._keep_log = False
        if self._own_log:
            # The name only as far as a file name takes it: the server
            # itself refuses a bad one, naming the rule.
            tag = re.sub(r"[^A-Za-z0-9._-]", "_", self.name)[:32]
            fd, self._log_path = tempfile.mkstemp(prefix=f"shmps-server-{tag}-", suffix=".log")
            os.close(fd)
        try:
            with open(self._log_path, "ab") as log:
                # --parent-pid: the server stops once this process is gone,
                # even when it ends without stop() (SIGTERM, SIGKILL, exit),
                # and ignores SIGINT: a terminal's Ctrl-C raises
                # KeyboardInterrupt here, and the server still serves the
                # handler (its last answers, a pull) until stop().
                self.process = subprocess.Popen(self.args + ["--parent-pid", str(os.getpid())],
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                self._starter = os.getpid()
        except BaseException:
            if self._own_log:  # nothing ran: no log to keep
                with contextlib.suppress(OSError):
                    os.unlink(self._log_path)
            raise
        from . import connect
        deadline = time.monotonic() + self.start_timeout
        try:
            while True:
                code = self.process.poll()
                if code is not None:
                    self.process = None
                    raise _errors.ServerNotRunningError(f"shmps-server exited {code} at start (its log: "
                                                        f"{self._log_path}): {self._log_tail()}")
                try:
                    with connect(self.name, timeout=max(0.001, min(10.0, deadline - time.monotonic()))) as probe:
                        # Another live server at the name answers too, while
                        # this one fails its start (poll() above then says so).
                        if probe.server_pid == self.process.pid:
                            return self
                except (_errors.ServerNotRunningError, _errors.LayoutMismatchError, _errors.TimeoutError):
                    pass
                except _errors.NoCapacityError:
                    # A server answered, full: workers that waited for it
                    # took every slot first. Ours, when it holds the
                    # segment's lock (another server's would be another's).
                    if self._holds_segment_lock():
                        return self
                except _errors.Error:
                    # Refused before any server is asked (a bad name): the
                    # server refuses it too, and its exit says why.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.process.wait(max(0.0, deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    raise _errors.TimeoutError(f"shmps-server '{self.name}' did not accept a worker within "
                                               f"{self.start_timeout} s (its log: {self._log_path}): "
                                               f"{self._log_tail()}")
                time.sleep(0.01)
        except BaseException:
            self._keep_log = True  # the error (or the caller) reads it
            self.stop()  # no child left behind, whatever ended the wait
            raise

    def stop(self, timeout=30.0):
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit
        code. Ctrl-C (or another exception) while it waits kills the
        server at once, reaps it and removes its segment before raising.
        In a process other than the one that started it (a fork()ed child)
        only lets go of it: returns None."""
        if self.process is None:
            return None
        p, self.process = self.process, None
        if self._starter != os.getpid():
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped server handles the SIGTERM too
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            except BaseException:
                # Not left running unreaped, its segment behind it, once
                # self.process no longer names it.
                p.kill()
                p.wait()
                self._remove_dead_segment()
                raise
        if p.returncode != 0:
            self._remove_dead_segment()
        if self._own_log and p.returncode == 0 and not self._keep_log:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._log_path)
        return p.returncode

    def _holds_segment_lock(self):
        """Whether this server's process holds the flock of the object at
        its segment's name, as a serving server does (from /proc/locks)."""
        try:
            st = os.stat(f"/dev/shm/shmps.{self.name}", follow_symlinks=False)
            with open("/proc/locks") as f:
                locks = f.read().splitlines()
        except OSError:
            return False
        inode = f":{st.st_ino}"
        for line in locks:
            fields = line.split()
            # "1: FLOCK  ADVISORY  WRITE 4242 00:1a:123 0 EOF"; waiters have "->" after the id.
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4] == str(self.process.pid) \
                    and fields[5].endswith(inode):
                return True
        return False

    def _remove_dead_segment(self):
        """After a server that did not stop cleanly (killed): its segment,
        unless a live server holds it. A server holds an exclusive flock on
        its segment while it lives; the object is removed under that lock,
        as a starting server removes a dead one's."""
        path = f"/dev/shm/shmps.{self.name}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and st.st_ino == os.stat(path, follow_symlinks=False).st_ino:
                os.unlink(path)
        except OSError:
            pass  # held by a live server, or gone meanwhile
        finally:
            os.close(fd)

    def _log_tail(self, lines=20):
        try:
            with open(self._log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:]).strip() or "(no output)"
        except OSError as e:
            return f"(log unreadable: {e})"

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        code = self.stop()
        if exc_type is None and code not in (0, None):
            raise _errors.Error(f"shmps-server '{self.name}' exited {code}: see {self._log_path}")
        return False

    def __repr__(self):
        state = f"pid {self.process.pid}" if self.process else "stopped"
        return f"shmps.Server({self.name!r}, {state})"
