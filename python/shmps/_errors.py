"""The exception classes of shmps: one per shmps::ErrorCode, all under Error.

The compiled module raises them through make_error(); their codes and names
are shmps::ErrorCode's (base/include/shmps/status.hpp), checked against the
extension's table when the package is imported.
"""

import builtins


class Error(Exception):
    """A shmps call failed. `code` is the ErrorCode's value, `name` its
    stable name ("stale", "timeout", ...), `message` the reason."""

    code = -1
    name = "error"

    def __init__(self, message):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return f"{self.name}: {self.message}"


def _error(class_name, code, name, doc, *bases):
    cls = type(class_name, (Error,) + bases, {"code": code, "name": name, "__doc__": doc})
    cls.__module__ = "shmps"
    return cls


class StaleError(Error):
    """A push computed against `worker_version` was more than max_staleness
    versions behind the server's `server_version`; nothing was applied."""

    code = 1
    name = "stale"

    def __init__(self, message, worker_version=0, server_version=0):
        super().__init__(message)
        self.worker_version = worker_version
        self.server_version = server_version


StaleError.__module__ = "shmps"

BadLengthError = _error("BadLengthError", 2, "bad_length", "The byte length does not match the tensor(s).")
BadDtypeError = _error("BadDtypeError", 3, "bad_dtype", "The gradient's dtype is unknown or unsupported.")
NonFiniteError = _error("NonFiniteError", 4, "non_finite", "NaN or Inf in the gradient (or initial weights).",
                        builtins.ValueError)
UnknownWorkerError = _error("UnknownWorkerError", 5, "unknown_worker",
                            "The worker is closed, detached or was evicted by the server.")
UnknownBufferError = _error("UnknownBufferError", 6, "unknown_buffer", "The buffer is not registered.")
UnknownTensorError = _error("UnknownTensorError", 7, "unknown_tensor", "No such tensor in the server's table.",
                            builtins.KeyError)
BadRangeError = _error("BadRangeError", 8, "bad_range", "Offset + length run past the registered buffer.")
BadRequestError = _error("BadRequestError", 9, "bad_request",
                         "A request the server cannot take (e.g. a version ahead of the server's).")
BusyError = _error("BusyError", 10, "busy", "The request lane stayed full for the whole timeout.")
TimeoutError = _error("TimeoutError", 11, "timeout", "No answer within the call's timeout.", builtins.TimeoutError)
ServerNotRunningError = _error("ServerNotRunningError", 12, "server_not_running",
                               "No server of that name, or it is dead or stopping.", builtins.ConnectionError)
ServerRestartedError = _error("ServerRestartedError", 13, "server_restarted",
                              "The session ended (the server restarted or evicted this worker); with reconnect the "
                              "next call attaches again.", builtins.ConnectionError)
LayoutMismatchError = _error("LayoutMismatchError", 14, "layout_mismatch",
                             "The segment has another layout version, or is not a shmps segment.")
PermissionError = _error("PermissionError", 15, "permission", "Access to the segment or a buffer was denied.",
                         builtins.PermissionError)
NoCapacityError = _error("NoCapacityError", 16, "no_capacity", "Max workers or buffers (or the server's --max-worker-buffer-bytes) reached, or /dev/shm full.")
InvalidArgumentError = _error("InvalidArgumentError", 17, "invalid_argument", "A caller-side argument error.",
                              builtins.ValueError)
IoError = _error("IoError", 18, "io", "A system call failed.", builtins.OSError)
ShuttingDownError = _error("ShuttingDownError", 19, "shutting_down", "The server is stopping.")
CudaError = _error("CudaError", 20, "cuda", "A CUDA call failed; the message names it.")
InternalError = _error("InternalError", 21, "internal", "A broken invariant inside shmps (a bug).")
InitRefusedError = _error("InitRefusedError", 22, "init_refused",
                          "init() was refused: the weights were already initialised, or pushes applied.")
InterruptedError = _error("InterruptedError", 23, "interrupted",
                          "A call ended by Worker.interrupt() or by close() from another thread, or a pull the "
                          "server held back (--staleness-policy wait) that its Worker withdrew (an interrupted "
                          "wait, or a detach; nothing was copied). A wait ended by a signal handler raises the "
                          "handler's exception instead.", builtins.InterruptedError)

BY_CODE = {
    cls.code: cls
    for cls in (StaleError, BadLengthError, BadDtypeError, NonFiniteError, UnknownWorkerError, UnknownBufferError,
                UnknownTensorError, BadRangeError, BadRequestError, BusyError, TimeoutError, ServerNotRunningError,
                ServerRestartedError, LayoutMismatchError, PermissionError, NoCapacityError, InvalidArgumentError,
                IoError, ShuttingDownError, CudaError, InternalError, InitRefusedError, InterruptedError)
}


def make_error(code, message, worker_version=0, server_version=0):
    """The exception for a shmps::Status (called by the compiled module)."""
    cls = BY_CODE.get(code)
    if cls is None:
        err = Error(message)
        err.code = code
        return err
    if cls is StaleError:
        return StaleError(message, worker_version, server_version)
    return cls(message)


def check_codes(extension_codes):
    """Fails at import when this table and the extension's disagree."""
    ours = {code: cls.name for code, cls in BY_CODE.items()}
    theirs = {code: name for code, name in extension_codes.items() if code != 0}
    if ours != theirs:
        raise ImportError(f"shmps: the exception table does not match the extension's error codes: {ours} != {theirs}")
