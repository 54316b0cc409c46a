"""shmps: Python workers of a shmps parameter server.

    import shmps
    with shmps.connect("job1") as worker:
        grad = worker.register_buffer(worker.total_elements * 4)
        weights = worker.register_buffer(worker.total_elements * 4)
        version = worker.pull(weights)
        ...                      # write the gradient into grad (fp32, all tensors in order)
        version = worker.push(grad, version)

A Worker is the process's connection to one shmps-server (the C++
shmps::Worker underneath); buffers are POSIX shared memory the server maps
once, or CUDA memory it opens by IPC handle. Blocking calls release the GIL.
Calls on one Worker from several threads run one at a time (interrupt()
and close() end the one that waits); a buffer must not be written while a
push reading it (or read while a pull writing it) is in flight. The torch
layer is shmps.torch (RemoteOptimizer). docs/python.md has the whole API.
"""

import builtins
import contextlib
import dataclasses
import numbers
import operator
import os
import threading
import typing

from . import _errors
from ._errors import *  # noqa: F401,F403 (the exception classes)
from ._errors import Error, StaleError
from ._server import Server, served_shape, server_binary
from ._shmps import ALL_TENSORS, ERROR_CODES, STATS_FIELDS, Buffer
from ._shmps import _set_main_thread
from ._shmps import connect as _connect

_errors.check_codes(ERROR_CODES)


# A blocking call on the main thread runs the signal handlers while it
# waits (Ctrl-C raises KeyboardInterrupt within about 20 ms): the extension
# needs to know which thread that is, here and in a fork()ed child.
def _note_main_thread():
    _set_main_thread(threading.main_thread().ident)


_note_main_thread()
os.register_at_fork(after_in_child=_note_main_thread)

# The error classes named as builtins (TimeoutError, PermissionError,
# InterruptedError: their subclasses) are left out, so that
# `from shmps import *` does not shadow the builtins; shmps.TimeoutError
# names them.
__all__ = ["connect", "Worker", "Buffer", "TensorInfo", "PushOutcomes", "Stats", "Server", "served_shape",
           "server_binary", "ALL_TENSORS", "Error"] + [
    cls.__name__ for cls in _errors.BY_CODE.values() if not hasattr(builtins, cls.__name__)]

# Gradient dtypes as the protocol numbers them (shmps::Dtype), by name.
_DTYPES = {"float32": (1, 4), "float16": (2, 2), "bfloat16": (3, 2)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the server's table. offset and count are in elements
    of the flat fp32 parameter vector (all tensors in table order)."""
    id: int
    name: str
    shape: typing.Tuple[int, ...]
    offset: int
    count: int
    dtype: str = "float32"

    @property
    def nbytes(self):
        return self.count * 4


@dataclasses.dataclass(frozen=True)
class PushOutcomes:
    """What wait() took of the push_async()s from one buffer registration:
    pushes applied and refused as too stale, and the last answer taken
    (its ticket, 0 for none, and whether it was applied)."""
    applied: int = 0
    stale: int = 0
    last_ticket: int = 0
    last_applied: bool = False


# The server's counters, from the extension's list (shmps/server_stats.hpp
# declares them and describes each), and the mean staleness as a float.
Stats = dataclasses.make_dataclass("Stats", [(name, int) for name in STATS_FIELDS] + [("avg_staleness", float)],
                                   frozen=True)
Stats.__module__ = __name__
Stats.__doc__ = ("A racy snapshot of the server's counters (each read atomically, the set not): "
                 + ", ".join(STATS_FIELDS) + ", and avg_staleness (avg_staleness_micro / 1e6).")


def _unsigned(what, value, bits=64):
    """`value` (an int, or anything with __index__) checked to fit the
    protocol's unsigned field of `bits` bits; the error names the argument."""
    if isinstance(value, bool):  # an int to operator.index, never meant as one here
        raise TypeError(f"{what} must be an int, not bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None
    if not 0 <= value < 1 << bits:
        raise _errors.InvalidArgumentError(f"{what} must be in [0, 2**{bits}), not {value}")
    return value


def _stream_handle(stream):
    """A raw cudaStream_t (int) from None, an int, or a torch.cuda.Stream."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _unsigned("stream", stream)
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise TypeError(f"stream must be a torch.cuda.Stream, a raw cudaStream_t (int) or None, not {type(stream).__name__}")
    return int(handle)


def _device_index(device):
    """A CUDA device ordinal from an int, "cuda", "cuda:N" or a torch.device."""
    if isinstance(device, bool):
        raise TypeError("device must be a CUDA device (an ordinal, 'cuda:N' or a torch.device), not bool")
    if isinstance(device, int):
        return _unsigned("device", device, bits=31)  # a CUDA ordinal is a C int
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit():
        return _unsigned("device", int(text[5:]), bits=31)
    raise ValueError(f"device must be a CUDA device (an ordinal, 'cuda:N' or a torch.device), not {device!r}")


class _HeldStorage:
    """The storage of a tensor that register_device_buffer() registered,
    held while the registration lives, with its data pointer as
    registered. Held, so that t.set_(other) leaves the registered memory
    allocated (the server may still write a pull there); checked, because
    t.resize_() past the storage reallocates it in place (the storage is
    the same, its memory new; the old block goes back to torch's caching
    allocator, maybe to another tensor): a call on the buffer then is
    refused instead of sending the server to the old block."""

    def __init__(self, tensor):
        # torch 2.x: untyped_storage(); 1.13: storage(), a TypedStorage over it.
        self.storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
        self.ptr = self.storage.data_ptr()

    def data_ptr(self):
        return self.storage.data_ptr()

    def check(self, buffer_id):
        if self.storage.data_ptr() != self.ptr:
            raise _errors.InvalidArgumentError(
                f"buffer {buffer_id}: the tensor registered as it was reallocated (resize_() past its storage), so "
                "the registered memory is no longer its own: unregister_buffer() it, and register the tensor again")


class Worker:
    """A connection to one shmps-server; made by connect(). A context
    manager: leaving the block closes it (detaches, frees its buffers)."""

    def __init__(self, native, name):
        self._w = native
        self.name = name
        self.tensors = [TensorInfo(id=t[0], name=t[1], shape=tuple(t[2]), offset=t[3], count=t[4])
                        for t in native.tensors()]
        self.total_elements = native.total_elements
        self._by_name = {t.name: t for t in self.tensors}
        self._dropped = []  # buffers to free at the next registration (free_later())
        self._held = {}  # register_device_buffer()'s registrations -> their _HeldStorage

    # ---- identity ----
    @property
    def worker_id(self):
        return self._w.worker_id

    @property
    def generation(self):
        """The server instance attached to (changes when it restarts)."""
        return self._w.generation

    @property
    def server_pid(self):
        """The process id of the server instance attached to."""
        return self._w.server_pid

    @property
    def closed(self):
        return self._w.closed

    def tensor(self, name):
        """The TensorInfo of that name; UnknownTensorError if none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise _errors.UnknownTensorError(f"no tensor named {name!r} on server {self.name!r}") from None

    # ---- buffers ----
    def register_buffer(self, nbytes):
        """A new shared-memory buffer of `nbytes` (> 0) the server maps once.
        torch.from_dlpack(buf), numpy.asarray(buf) and memoryview(buf) see
        its bytes in place (uint8; .view(float32) for fp32)."""
        self._free_dropped()
        return self._w.register_buffer(_unsigned("nbytes", nbytes))

    def alloc_device_buffer(self, nbytes, device=0):
        """Device memory of its own (not torch's allocator), registered:
        torch.from_dlpack(buf) is a cuda tensor over it."""
        self._free_dropped()
        return self._w.alloc_device_buffer(_unsigned("nbytes", nbytes), _device_index(device))

    def register_device_buffer(self, tensor):
        """Registers the CUDA memory of a contiguous torch tensor in place
        (the tensor and its storage are kept alive until unregister_buffer
        or close; a call on the buffer after t.resize_() reallocated the
        storage is refused). Memory of torch's expandable segments cannot
        be exported: use alloc_device_buffer then."""
        if not getattr(tensor, "is_cuda", False):
            raise _errors.InvalidArgumentError("register_device_buffer takes a CUDA tensor; use register_buffer for host memory")
        if not tensor.is_contiguous():
            raise _errors.InvalidArgumentError("register_device_buffer takes a contiguous tensor")
        self._free_dropped()
        held = _HeldStorage(tensor)
        try:
            buf = self._w.register_device_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                                 tensor.device.index or 0, (tensor, held.storage))
        except _errors.CudaError as e:
            if "legacy CUDA IPC" not in e.message:
                raise
            raise _errors.CudaError(e.message + "; from Python, worker.alloc_device_buffer(nbytes, device) gives "
                                    "memory that can be exported (torch.from_dlpack(buffer) is a tensor over it)") from None
        self._held[buf.registration] = held
        return buf

    def unregister_buffer(self, buffer):
        """The server unmaps it; views of a host buffer stay valid memory
        that the server no longer reads."""
        ref = self._buffer_ref(buffer, check_storage=False)  # a reallocated tensor's buffer may go
        self._held.pop(self._w.unregister_buffer(*ref), None)

    def free_later(self, *buffers):
        """Unregisters `buffers` at this Worker's next registration, after
        their pushes in flight are answered, instead of now: for a
        finalizer (a garbage collection may run it on any thread, or in a
        signal handler while this Worker's call waits), which must not
        wait for the server."""
        self._dropped.extend(buffers)

    def _free_dropped(self):
        while True:
            try:
                buf = self._dropped.pop()
            except IndexError:  # empty, or another thread took the last one
                return
            try:
                with contextlib.suppress(Error):  # best effort: the slot is what it frees
                    for ticket in self.pushes_in_flight(buf):
                        with contextlib.suppress(Error):
                            self.wait(ticket)
                    self.unregister_buffer(buf)
            except BaseException:
                self._dropped.append(buf)  # Ctrl-C in a wait: freed by a later registration
                raise

    # ---- requests ----
    def push(self, buffer, version, tensor=None, offset=0, nbytes=None, dtype="float32", stream=None):
        """Pushes the gradient in `buffer` at byte `offset` for `tensor` (a
        name, a TensorInfo, an id, or None: all tensors as one flat range),
        computed against `version`. Returns the version after the update.
        Raises StaleError (with both versions) when it is too old, and the
        error of any other refusal; nothing is applied then."""
        return self._w.push(*self._push_args(buffer, version, tensor, offset, nbytes, dtype, stream))

    def push_async(self, buffer, version, tensor=None, offset=0, nbytes=None, dtype="float32", stream=None):
        """As push(), returning a ticket once the request is queued;
        wait(ticket) returns its result. Wait for every ticket: the Worker
        keeps each answer until it is taken."""
        return self._w.push_async(*self._push_args(buffer, version, tensor, offset, nbytes, dtype, stream))

    def wait(self, ticket):
        """The result of push_async(ticket), the version after the update,
        or of pull_async(ticket), the version pulled."""
        return self._w.wait(_unsigned("ticket", ticket))

    def answered(self, ticket):
        """Whether wait(ticket) returns at once: its answer came (kept for
        wait), or it was lost with its session."""
        return self._w.answered(_unsigned("ticket", ticket))

    def pushes_in_flight(self, buffer):
        """The tickets of the push_async()s from `buffer` not waited for
        yet (or whose wait timed out or was interrupted), oldest first:
        the buffer may be written again once each is waited for. A ticket
        whose push_async() a signal's handler interrupted as it returned
        (Ctrl-C: the ticket never reached the caller) is among them."""
        return self._w.pushes_in_flight(*self._buffer_ref(buffer))

    def push_outcomes(self, buffer):
        """PushOutcomes of the push_async()s from `buffer` (this
        registration of it) whose answers wait() took, counted inside
        wait(): a signal's handler that raises as wait() returns (Ctrl-C)
        takes the answer from its caller, not from these counts. Named by
        its Buffer, it answers while another thread's call waits, after
        close(), and from a signal handler; the counts go with the
        registration (unregister_buffer)."""
        return PushOutcomes(*self._w.push_outcomes(*self._buffer_ref(buffer)))

    def pull(self, buffer, tensor=None, offset=0, stream=None):
        """Copies a consistent snapshot of `tensor` (None: all tensors) as
        fp32 into `buffer` at byte `offset`; returns its version."""
        return self._w.pull(self._tensor_id(tensor), *self._buffer_ref(buffer), _unsigned("offset", offset),
                            _stream_handle(stream))

    def pull_async(self, buffer, tensor=None, offset=0, stream=None):
        """As pull(), returning a ticket once the request is queued; the
        buffer's range is written until wait(ticket) returns the version
        (or raises)."""
        return self._w.pull_async(self._tensor_id(tensor), *self._buffer_ref(buffer), _unsigned("offset", offset),
                                  _stream_handle(stream))

    def init(self, buffer, offset=0, stream=None):
        """Sets the server's weights at version 0 from `buffer` (all tensors,
        fp32): accepted once, before any push applied; InitRefusedError says
        why not otherwise."""
        self._w.init(*self._buffer_ref(buffer), _unsigned("offset", offset), _stream_handle(stream))

    def stats(self):
        return Stats(**self._w.stats())

    def ping(self):
        """An empty request: the ring's round trip."""
        self._w.ping()

    def detach(self):
        """Ends the session with the server; further calls raise
        UnknownWorkerError. Waits for the server's answer at most 5 s (the
        detach bound; the timeout where shorter); Ctrl-C ends the wait,
        the Worker detached all the same."""
        self._w.detach()

    def interrupt(self):
        """Ends the call of this Worker in flight, on any thread, where it
        waits (for an answer, a pull that --staleness-policy wait holds,
        room in the lane, a reconnect): it raises InterruptedError within
        about 20 ms; a held pull is withdrawn, and a push may still be
        applied, as after a timeout. Calls begun after it are not affected,
        nor registering and unregistering buffers or detach(). Safe from
        any thread and from a signal handler."""
        self._w.interrupt()

    def close(self):
        """Detaches (best effort) and releases the buffers; idempotent. A
        call waiting on another thread raises InterruptedError instead of
        being waited for; later calls raise UnknownWorkerError. `closed` is
        true from the moment it begins. The detach waits for a stopped
        server at most 5 s (the detach bound, whatever `timeout` says), and
        Ctrl-C ends it at once: closed all the same, the KeyboardInterrupt
        raised."""
        try:
            self._w.close()
        finally:
            # Not where close() was refused (a signal handler's, while a
            # call of this Worker waits on its thread): the Worker is open.
            if self._w.closed:
                self._held.clear()
                self._dropped.clear()  # no registration comes to free them

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __reduce__(self):
        raise TypeError("a shmps.Worker cannot be pickled or sent to another process: call shmps.connect() in the "
                        "child process")

    def __repr__(self):
        try:
            state = "closed" if self.closed else "detached" if self._w.detached else f"worker {self.worker_id}"
        except _errors.Error:  # a fork()ed child's copy: its identity is the parent's
            state = "not usable in this process"
        return f"shmps.Worker({self.name!r}, {state}, {len(self.tensors)} tensors, {self.total_elements} elements)"

    # ---- argument conversion ----
    def _tensor_id(self, tensor):
        if tensor is None:
            return ALL_TENSORS
        if isinstance(tensor, TensorInfo):
            return tensor.id
        if isinstance(tensor, str):
            return self.tensor(tensor).id
        if isinstance(tensor, numbers.Integral):  # an int, numpy's integers; no tensor or array, 0-d too
            return _unsigned("tensor", tensor, 32)
        raise TypeError(f"tensor must be a name, a TensorInfo, an id or None, not {type(tensor).__name__}")

    def _buffer_ref(self, buffer, check_storage=True):
        """(id, registration) for the native call, which refuses a Buffer
        unregistered since (its id may name a newer buffer); a bare id goes
        unchecked (registration 0). A registered tensor's reallocated
        storage is refused (_HeldStorage)."""
        if isinstance(buffer, Buffer):
            if buffer.worker != self._w.serial:
                raise _errors.InvalidArgumentError(f"buffer {buffer.id} was registered by another Worker")
            if check_storage and self._held:
                held = self._held.get(buffer.registration)
                if held is not None:
                    held.check(buffer.id)
            return buffer.id, buffer.registration
        # An int or numpy's integers; a tensor or an array is no id, even
        # a 0-d one that converts to an int.
        if not isinstance(buffer, numbers.Integral):
            raise TypeError(f"buffer must be a shmps.Buffer (Worker.register_buffer()'s) or a buffer id, not "
                            f"{type(buffer).__name__}")
        return _unsigned("buffer", buffer, 32), 0

    def _push_args(self, buffer, version, tensor, offset, nbytes, dtype, stream):
        try:
            code, size = _DTYPES[dtype]
        except KeyError:
            raise _errors.BadDtypeError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}") from None
        tensor_id = self._tensor_id(tensor)
        if nbytes is None:
            count = self.total_elements if tensor_id == ALL_TENSORS else (
                self.tensors[tensor_id].count if 0 <= tensor_id < len(self.tensors) else 0)
            nbytes = count * size
        return (tensor_id, *self._buffer_ref(buffer), _unsigned("offset", offset), _unsigned("nbytes", nbytes), code,
                _unsigned("version", version), _stream_handle(stream))


def connect(name, timeout=10.0, reconnect=False, wait_for_server=0.0, server_user=""):
    """Attaches to the shmps-server named `name` (its segment
    /dev/shm/shmps.<name>). `timeout`: seconds per call. `reconnect`: after
    a server restart or an eviction, the next call attaches again and
    re-registers every buffer. `wait_for_server`: seconds to wait for a
    server that is not there yet (0: raise ServerNotRunningError at once).
    `server_user`: the user the server runs as when it is neither this
    process's user nor root (default: the packaged unit's "shmps", where it
    exists); a segment owned by anyone else raises PermissionError."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if isinstance(reconnect, (str, bytes)) or reconnect not in (True, False):  # "no" would be true
        raise TypeError(f"reconnect must be True or False, not {reconnect!r}")
    if not isinstance(server_user, str):  # None would be the user "None"
        raise TypeError(f"server_user must be a str (\"\": the default), not {type(server_user).__name__}")
    return Worker(_connect(name, _seconds("timeout", timeout), bool(reconnect),
                           _seconds("wait_for_server", wait_for_server), server_user), name)


def _seconds(what, value):
    """A number of seconds as a float; text and bools are refused (float()
    would take "5" and True)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    return float(value)
