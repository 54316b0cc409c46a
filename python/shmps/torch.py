"""shmps.torch: a torch training loop that trains through a shmps-server.

    worker = shmps.connect("job1")
    opt = shmps.torch.RemoteOptimizer(model, worker)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()             # push .grad by buffer, pull the new weights

RemoteOptimizer makes every parameter's .data a view into one weight buffer
and its .grad a view into one gradient buffer (shared memory on the CPU, a
device allocation of its own on a GPU), so backward() writes the gradient
where the server reads it and a pull writes the weights where forward()
reads them: nothing is copied on the worker's side. The optimizer itself
(SGD, Adam, AdamW, exactly as torch.optim defines them) runs in the server.
"""

import contextlib
import os
import threading
import weakref

import torch

from . import PushOutcomes, _errors
from ._server import served_shape


class RemoteOptimizer:
    """Trains `model` through `worker`'s server. The names and shapes of the
    model's trainable parameters must be the server's tensor table (any
    order); frozen ones (requires_grad=False) stay the model's own, as
    torch.optim leaves a parameter without a gradient alone. `on_stale`:
    "skip" counts a push rejected as too stale (self.stale) and pulls fresh
    weights; "raise" raises the StaleError. `init`: first set the server's
    weights to the model's own (worker.init); the first initialiser of a job
    wins, the others' InitRefusedError is taken as "already initialised".
    close() (or leaving a `with` block) gives the model its parameters back
    and frees the two buffers on the server; the Worker stays open."""

    def __init__(self, model, worker, on_stale="skip", init=False):
        if on_stale not in ("skip", "raise"):
            raise ValueError(f"on_stale must be 'skip' or 'raise', not {on_stale!r}")
        self.worker = worker
        self.on_stale = on_stale
        self.closed = False
        # Held by zero_grad(), step(), pull() and close(): steps from
        # several threads take turns, so none waits for (and takes the
        # answer of) another's push. Reentrant: a step pulls through
        # pull(). Made anew in a fork()ed child (_new_locks_in_child).
        self._lock = threading.RLock()
        _optimizers.add(self)
        self._step_mark = 0  # the last push answer taken before the current step's push
        self._final = None   # the PushOutcomes as the buffers were unregistered (close())
        named = list(model.named_parameters())
        self._params = [(n, p) for n, p in named if p.requires_grad]
        self._frozen = [(n, p) for n, p in named if not p.requires_grad]
        self._check_table()
        devices = {p.device for _, p in self._params}
        if len(devices) != 1:
            raise ValueError(f"every parameter must be on one device, not {sorted(str(d) for d in devices)}")
        self.device = devices.pop()
        nbytes = worker.total_elements * 4
        if self.device.type == "cuda":
            def register():
                return worker.alloc_device_buffer(nbytes, self.device.index or 0)
        elif self.device.type == "cpu":
            def register():
                return worker.register_buffer(nbytes)
        else:
            raise ValueError(f"parameters on {self.device} are not supported (cpu or cuda)")
        buffers = []  # registered so far: freed again if the constructor fails
        try:
            buffers.append(register())
            buffers.append(register())
            self._grad_buf, self._weight_buf = buffers
            self._grads = torch.from_dlpack(self._grad_buf).view(torch.float32)
            self._weights = torch.from_dlpack(self._weight_buf).view(torch.float32)
            self._grads.zero_()
            views = []  # (parameter, its weights' view, its gradient's view)
            with torch.no_grad():
                for name, p in self._params:
                    info = worker.tensor(name)
                    w = self._weights[info.offset:info.offset + info.count].view(p.shape)
                    if init:
                        w.copy_(p.detach())
                    views.append((p, w, self._grads[info.offset:info.offset + info.count].view(p.shape)))
            if init:
                self._sync()
                try:
                    worker.init(self._weight_buf, stream=self._stream())
                except _errors.InitRefusedError:
                    pass  # another worker of the job initialised first
            self.pull()
        except BaseException as e:
            # The model keeps its own tensors: they are replaced only below.
            # A server's answer: the buffers are freed now. An interrupt
            # (Ctrl-C; a signal handler's exception; Worker.interrupt()),
            # which may come while the server does not answer: at the
            # Worker's next registration (an unregister waits for the
            # server, without end under timeout=inf, and cannot be
            # interrupted), as for an optimizer dropped without close().
            if isinstance(e, _errors.Error) and not isinstance(e, _errors.InterruptedError):
                _unregister(worker, *buffers)
            else:
                worker.free_later(*buffers)
            raise
        with torch.no_grad():
            for p, w, g in views:
                p.data = w
                p.grad = g
        self._grad_views = [g for _, _, g in views]
        self._grad_ptrs = [(name, p.grad.data_ptr()) for name, p in self._params]
        self._weight_ptrs = [p.data_ptr() for _, p in self._params]
        # Dropped without close(): the two buffers are freed at the Worker's
        # next registration (the model keeps its views, whose memory
        # outlives the registration). Not at exit: the server frees a
        # process's buffers when it is gone.
        self._finalizer = weakref.finalize(self, worker.free_later, self._grad_buf, self._weight_buf)
        self._finalizer.atexit = False

    def _check_table(self):
        table = {t.name: t for t in self.worker.tensors}
        names = [n for n, _ in self._params]
        problems = []
        for name, p in self._params:
            if p.is_sparse or p.dtype != torch.float32:
                problems.append(f"{name} is {'sparse' if p.is_sparse else p.dtype} (only dense float32 is supported)")
                continue
            t = table.get(name)
            if t is None:
                problems.append(f"{name} {tuple(p.shape)} is not on the server")
            elif p.numel() != t.count or tuple(t.shape) not in (tuple(p.shape), served_shape(p.shape)):
                problems.append(f"{name} is {tuple(p.shape)} here, {t.shape} on the server")
        frozen = {n for n, _ in self._frozen}
        missing = [n for n in table if n not in names]
        if missing:
            problems.append(f"the server's {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in the model"
                            + (" as trainable parameters (frozen ones, requires_grad=False, stay each process's own: "
                               "start the server from the model once it is frozen)"
                               if any(n in frozen for n in missing) else ""))
        if not self._params and not problems:
            problems.append("the model has no trainable parameters (every one has requires_grad=False)")
        if problems:
            raise ValueError(f"the model does not match server {self.worker.name!r}: " + "; ".join(problems))

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _check_open(self, what):
        if self.closed:
            raise RuntimeError(f"RemoteOptimizer.{what}() after close(): the model's parameters are its own again; "
                               "make a new RemoteOptimizer to train through the server")

    # The counts are the Worker's, kept inside wait() (Worker.push_outcomes):
    # a Ctrl-C as wait() returns takes the answer from step(), not from them.
    def _outcomes(self):
        return self._final if self._final is not None else self.worker.push_outcomes(self._grad_buf)

    @property
    def pushes(self):
        """Pushes applied."""
        return self._outcomes().applied

    @property
    def stale(self):
        """Pushes rejected as too stale."""
        return self._outcomes().stale

    @property
    def applied(self):
        """Whether the last step's push was applied: False from the step's
        start until its answer is taken (by that step, or by the call that
        waits for it after Ctrl-C or a timeout ended the step)."""
        o = self._outcomes()
        return o.last_ticket != self._step_mark and o.last_applied

    def _settle_pending(self, answered_only=False):
        """Every push from the gradient buffer not answered yet (its step()
        interrupted, even between push_async() and the ticket's return, or
        a wait for it that timed out) waited for and counted before the
        buffer is written or freed: the server may still read it. Errors
        raise, but for a StaleError, counted as step() counts it; a wait
        that timed out or was interrupted leaves its push for the next
        call (the Worker keeps the ticket). `answered_only`: those whose
        answer came, without waiting."""
        for ticket in self.worker.pushes_in_flight(self._grad_buf):
            if answered_only and not self.worker.answered(ticket):
                return  # answers come in order: none after it came either
            self._settle(ticket)

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradient buffer and makes every parameter's .grad its
        view again; .grad is never set to None."""
        del set_to_none  # accepted for torch.optim's signature; the buffer is always zeroed
        with self._lock:
            self._zero_grad()

    def _zero_grad(self):
        self._check_open("zero_grad")
        self._settle_pending()
        self._grads.zero_()
        with torch.no_grad():
            for (_, p), view in zip(self._params, self._grad_views):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view

    def _gather_grads(self):
        """Every .grad into its view of the gradient buffer: one that
        model.zero_grad() set to None (torch 2.x's default) and backward()
        then made anew is copied in, and the parameter's .grad is its view
        again; one that backward() did not reach since (None) pushes zeros,
        so the server's momentum and weight decay still move that
        parameter, as torch.optim's do after zero_grad(set_to_none=False).
        A .grad of another shape, dtype or device raises, naming it."""
        with torch.no_grad():
            for (name, p), view in zip(self._params, self._grad_views):
                g = p.grad
                if g is not None and g.data_ptr() == view.data_ptr():
                    continue
                if g is None:
                    view.zero_()
                elif g.shape != view.shape or g.dtype != view.dtype or g.device != view.device or g.is_sparse:
                    raise RuntimeError(
                        f"parameter {name!r}: .grad is {'sparse ' if g.is_sparse else ''}{tuple(g.shape)} "
                        f"{g.dtype} on {g.device}, not {tuple(view.shape)} {view.dtype} on {view.device}: it cannot "
                        "be pushed")
                else:
                    view.copy_(g)
                p.grad = view

    def close(self):
        """Gives the model its parameters back: every p.data and p.grad
        becomes a tensor of its own (on the same device) holding what the
        buffers hold (the weights last pulled, the last gradient), and the
        two buffers are unregistered from the Worker, which stays open
        (best effort: a closed Worker or a server gone has nothing left to
        free), and dropped. Idempotent; step(), pull() and zero_grad()
        after it raise. A close() that raises (no memory for the copies)
        leaves the model on the buffers, and may be called again."""
        with self._lock:
            self._close()

    def _close(self):
        if self.closed:
            return
        # A push a Ctrl-C left in flight: its answer taken (a server gone
        # has none to give).
        with contextlib.suppress(_errors.Error):
            self._settle_pending()
        if self._final is None:  # the counts go with the registration
            # (a fork()ed child's Worker answers nothing: none of them its own)
            try:
                self._final = self.worker.push_outcomes(self._grad_buf)
            except _errors.Error:
                self._final = PushOutcomes()
        # Unregistered first: a request still in flight on them is served
        # before the unregister is answered, so what is copied below is
        # final. Their memory stays valid while a view of it lives.
        self._finalizer.detach()
        _unregister(self.worker, self._grad_buf, self._weight_buf)
        self._sync()  # a gradient backward() wrote on the current stream
        # Only what still lives in this optimizer's buffers: a parameter
        # another RemoteOptimizer took over since is that one's.
        with torch.no_grad():
            for (_, p), ptr, (_, grad_ptr) in zip(self._params, self._weight_ptrs, self._grad_ptrs):
                if p.data_ptr() == ptr:
                    p.data = p.data.clone()
                if p.grad is not None and p.grad.data_ptr() == grad_ptr:
                    p.grad = p.grad.clone()
        self._grads = self._weights = self._grad_views = self._grad_buf = self._weight_buf = None
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def step(self, closure=None):
        """Pushes the gradients against the version last pulled, then pulls
        (the pull queued behind the push, so the worker waits once for
        both, and sees its own update). Returns the version pulled; a
        StaleError under on_stale="raise" comes with the weights already
        pulled. `closure` (as torch.optim's): run first, with gradients
        enabled, to compute them; then the step returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._lock:
            version = self._step()
        return version if closure is None else loss

    def _step(self):
        self._check_open("step")
        self._settle_pending()
        for (name, _), (_, p), ptr in zip(self._grad_ptrs, self._params, self._weight_ptrs):
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"parameter {name!r} no longer lives in this RemoteOptimizer's weight buffer (its .data was "
                    "reassigned, moved by model.share_memory() or .to(), or taken over by another RemoteOptimizer): "
                    "pulls would not reach it; copy into it in place instead (p.data.copy_(t))")
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} was frozen (requires_grad=False) when this RemoteOptimizer was made, so it "
                    "is not on the server and its gradient would go nowhere: make a new server and RemoteOptimizer "
                    "for the unfrozen model")
        for name, p in self._params:
            if not p.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} was trainable when this RemoteOptimizer was made and is frozen now "
                    "(requires_grad=False): the server would go on moving it (momentum, weight decay, Adam's "
                    "moments) and every pull would overwrite it: make a new server and RemoteOptimizer for the "
                    "frozen model")
        self._gather_grads()
        self._step_mark = self._outcomes().last_ticket
        try:
            ticket = self.worker.push_async(self._grad_buf, self.version, stream=self._stream())
        except _errors.ServerRestartedError:
            # The push, computed on the old server's weights, is refused.
            self._pull_after_restart()
            raise
        try:
            # Not self.pull(), which would first wait for this push.
            self.version = self.worker.pull(self._weight_buf, stream=self._stream())
        except BaseException as e:
            # The push stays in flight until its answer is taken and counted
            # (.applied tells whether to redo the minibatch): the gradient
            # buffer is not written (zero_grad(), step(), close()) before;
            # the Worker keeps its ticket (pushes_in_flight()). An answer
            # that came is counted now (a pull the server held past its
            # wait, answered kTimeout, comes after its push's answer).
            # Interrupted (Ctrl-C, a signal handler's exception,
            # Worker.interrupt()) or timed out: raised at once, an
            # unanswered push waited for by the next call, since a server
            # that stalled would hold the step for another timeout. Another
            # error of the pull: the push's answer is taken now if it comes;
            # the pull's error is the one raised.
            blocking = isinstance(e, _errors.Error) and not isinstance(
                e, (_errors.InterruptedError, _errors.TimeoutError))
            with contextlib.suppress(_errors.Error):
                self._settle_pending(answered_only=not blocking)
            if isinstance(e, _errors.ServerRestartedError):
                self._pull_after_restart()
            raise
        stale = self._settle(ticket)
        if stale is not None and self.on_stale == "raise":
            raise stale
        return self.version

    def _pull_after_restart(self):
        """After a server died or restarted under a step() (reconnect=True):
        the pull re-attaches and takes the new server's weights, so the next
        step() pushes against them (best effort: its error is the step's to
        report)."""
        with contextlib.suppress(_errors.Error):
            self.pull()

    def _settle(self, ticket):
        """Waits for the push `ticket` (the Worker counts it); returns its
        StaleError (None when applied). Any other error raises."""
        try:
            self.worker.wait(ticket)
        except _errors.StaleError as e:
            return e
        return None

    def pull(self):
        """Pulls the server's newest weights into the parameters (no push); returns their version."""
        with self._lock:
            return self._pull()

    def _pull(self):
        self._check_open("pull")
        self._settle_pending()
        self.version = self.worker.pull(self._weight_buf, stream=self._stream())
        return self.version


# Every RemoteOptimizer of the process, for a fork()ed child: a lock that
# a parent's thread held at the fork would never be released there.
_optimizers = weakref.WeakSet()


def _new_locks_in_child():
    for opt in list(_optimizers):
        opt._lock = threading.RLock()


os.register_at_fork(after_in_child=_new_locks_in_child)


def _unregister(worker, *buffers):
    """Frees a RemoteOptimizer's buffers on the server (best effort: a
    closed Worker or a server gone has nothing left to free)."""
    for buf in buffers:
        with contextlib.suppress(_errors.Error):
            worker.unregister_buffer(buf)
