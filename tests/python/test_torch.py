"""shmps.torch against real shmps-server processes: RemoteOptimizer equals
torch.optim on the same gradients, its misuse is refused with a clear
error, and N torch processes train Fashion-MNIST. CUDA cases skip, with the
reason, where torch sees no GPU."""

import contextlib
import glob
import json
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import shmps  # noqa: E402
import shmps.torch  # noqa: E402
from conftest import restart, unique_name  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "torch", "train.py")
DATASET = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.fc2 = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def gradients(model, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(steps)]


# (shmps-server options, the torch.optim that defines them)
OPTIMIZERS = {
    "sgd_momentum_nesterov_wd": (dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                                 lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_momentum_dampening": (dict(optimizer="sgd", lr=0.05, momentum=0.8, dampening=0.1),
                               lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.1)),
    "adam": (dict(optimizer="adam", lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "adamw": (dict(optimizer="adamw", lr=0.01, weight_decay=0.05),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05)),
}


def run_remote(make_server, options, device, steps=25, backend="host", scheduler=None):
    """The model's weights after `steps` RemoteOptimizer steps on fixed gradients, and torch.optim's
    (stepping `scheduler(optimizer)` after each step, when given).
    A model on a GPU needs backend="cuda": the host backend takes only shared-memory buffers."""
    torch.manual_seed(0)
    local = Net()
    remote = Net().to(device)
    remote.load_state_dict(local.state_dict())
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in local.named_parameters()], backend=backend,
                         **options[0])
    reference = options[1](local.parameters())
    schedule = scheduler(reference) if scheduler else None
    worst = 0.0
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(remote, w, on_stale="raise", init=True)
        for step, grads in enumerate(gradients(local, steps)):
            reference.zero_grad()
            opt.zero_grad()
            for p, q, g in zip(local.parameters(), remote.parameters(), grads):
                p.grad = g.clone()
                q.grad.copy_(g)
            reference.step()
            if schedule:
                schedule.step()
            assert opt.step() == step + 1
            for (name, p), q in zip(local.named_parameters(), remote.parameters()):
                diff = (p.detach() - q.detach().cpu()).abs().max().item()
                worst = max(worst, diff / max(p.detach().abs().max().item(), 1e-30))
        return worst, [q.detach().cpu().clone() for q in remote.parameters()]


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_remote_optimizer_equals_torch_optim(make_server, which):
    worst, _ = run_remote(make_server, OPTIMIZERS[which], "cpu")
    print(f"{which}: worst relative difference from torch.optim over 25 steps: {worst:.3g}")
    # The server's kernels compute PyTorch's formulas in fp32 (docs/optimizers.md);
    # their operation order may differ by a rounding step.
    assert worst <= 1e-6


# (shmps-server --lr-schedule, the torch.optim.lr_scheduler that defines it)
SCHEDULES = {
    "step": ("step:4:0.5", lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5)),
    "exponential": ("exponential:0.9", lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9)),
    "warmup_cosine": ("linear:0.25:1:3,cosine:8:0.001", lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.25, 1.0, 3), torch.optim.lr_scheduler.CosineAnnealingLR(o, 8, 0.001)],
        milestones=[3])),
}


@pytest.mark.filterwarnings("ignore:The epoch parameter")  # SequentialLR's own call of a scheduler's step(0)
@pytest.mark.parametrize("which", sorted(SCHEDULES))
def test_the_servers_lr_schedule_equals_torchs_scheduler(make_server, which):
    text, scheduler = SCHEDULES[which]
    server_options, optim = OPTIMIZERS["adam"]
    worst, _ = run_remote(make_server, (dict(server_options, lr_schedule=text), optim), "cpu", scheduler=scheduler)
    print(f"{which}: worst relative difference from torch.optim with its scheduler over 25 steps: {worst:.3g}")
    assert worst <= 1e-6


class Branchy(torch.nn.Module):
    """A head that only odd steps reach: backward() leaves its .grad alone on even ones."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x, use_head):
        h = torch.relu(self.body(x))
        return self.head(h) if use_head else h


def test_zero_grad_set_to_none_trains_as_torch_optim_with_zeroed_gradients(make_server):
    # torch 2.x's model.zero_grad() sets .grad to None; backward() then makes
    # new tensors (and leaves those of a branch it did not reach None). The
    # step takes them in; a None one pushes zeros, so momentum and weight
    # decay move it as torch.optim's do after zero_grad(set_to_none=False).
    torch.manual_seed(0)
    local, remote = Branchy(), Branchy()
    remote.load_state_dict(local.state_dict())
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in local.named_parameters()], optimizer="sgd",
                         lr=0.05, momentum=0.9, weight_decay=0.01)
    reference = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    for p in local.parameters():
        p.grad = torch.zeros_like(p)  # zeroed from the start, never None
    g = torch.Generator().manual_seed(1)
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(remote, w, on_stale="raise", init=True)
        for step in range(8):
            x = torch.randn(4, 6, generator=g)
            reference.zero_grad(set_to_none=False)
            local(x, step % 2 == 1).sum().backward()
            reference.step()
            remote.zero_grad(set_to_none=True)
            remote(x, step % 2 == 1).sum().backward()
            assert (remote.head.weight.grad is None) == (step % 2 == 0)
            assert opt.step() == step + 1
            for (name, p), q in zip(local.named_parameters(), remote.parameters()):
                assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), f"{name} after step {step}"
            # Every .grad is its view of the buffer again: zero_grad() reaches it.
            opt.zero_grad()
            assert all(float(q.grad.abs().sum()) == 0.0 for q in remote.parameters())


def test_step_runs_a_closure_and_returns_its_loss(make_server):
    torch.manual_seed(0)
    local, remote = Net(), Net()
    remote.load_state_dict(local.state_dict())
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in local.named_parameters()], optimizer="sgd",
                         lr=0.1)
    reference = torch.optim.SGD(local.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(remote, w, init=True)

        def closure(model, optimizer):
            def run():
                optimizer.zero_grad()
                loss = model(x).square().sum()
                loss.backward()
                return loss
            return run

        with torch.no_grad():  # the closure computes its gradients all the same
            want = reference.step(closure(local, reference))
            got = opt.step(closure(remote, opt))
        assert float(got) == float(want)
        for p, q in zip(local.parameters(), remote.parameters()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        assert opt.pushes == 1


def test_a_parameter_of_five_dimensions_is_served_folded_to_four(make_server):
    # A Conv3d weight (out, in, d, h, w) is (out, in, d, h * w) on the
    # server, which serves 1 to 4 dimensions; the model keeps its shape.
    torch.manual_seed(0)
    local, remote = torch.nn.Conv3d(2, 3, 2), torch.nn.Conv3d(2, 3, 2)
    remote.load_state_dict(local.state_dict())
    with shmps.Server(remote, optimizer="adam", lr=0.01, backend="host",
                      name=unique_name("conv3d")) as server, shmps.connect(server.name) as w:
        assert [(t.name, t.shape) for t in w.tensors] == [("weight", (3, 2, 2, 4)), ("bias", (3,))]
        opt = shmps.torch.RemoteOptimizer(remote, w, init=True)
        assert remote.weight.shape == (3, 2, 2, 2, 2)
        reference = torch.optim.Adam(local.parameters(), lr=0.01)
        x = torch.randn(1, 2, 3, 3, 3)
        for _ in range(3):
            reference.zero_grad()
            local(x).sum().backward()
            reference.step()
            opt.zero_grad()
            remote(x).sum().backward()
            opt.step()
        for p, q in zip(local.parameters(), remote.parameters()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        opt.close()


def test_reassigned_data_names_the_parameter_and_in_place_copies_are_fine(make_server):
    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(model, w)
        model.load_state_dict(Net().state_dict())  # copies in place: still in the buffer
        model(torch.randn(2, 6)).sum().backward()
        assert opt.step() == 1
        model.fc2.bias.data = torch.zeros(3)  # a new tensor, outside the buffer
        model(torch.randn(2, 6)).sum().backward()
        with pytest.raises(RuntimeError, match="'fc2.bias'.*reassigned"):
            opt.step()


def test_frozen_parameters_stay_the_models_own_as_torch_optim_leaves_them(make_server):
    """requires_grad=False parameters are not on the server (shmps.Server
    leaves them out of the table) and RemoteOptimizer leaves them alone:
    AdamW's decay does not touch them and the trainable ones follow
    torch.optim.AdamW on the same gradients. Unfreezing one later is
    refused at the next step, naming it."""
    torch.manual_seed(0)
    local, remote = Net(), Net()
    remote.load_state_dict(local.state_dict())
    for m in (local, remote):
        m.fc1.requires_grad_(False)
    frozen = [p.detach().clone() for p in remote.fc1.parameters()]
    reference = torch.optim.AdamW(local.parameters(), lr=0.01, weight_decay=0.5)
    with shmps.Server(remote, name=unique_name("frozen"), optimizer="adamw", lr=0.01, weight_decay=0.5,
                      backend="host") as server, shmps.connect(server.name) as w:
        assert [t.name for t in w.tensors] == ["fc2.weight", "fc2.bias"]
        opt = shmps.torch.RemoteOptimizer(remote, w, init=True)
        x = torch.randn(4, 6)
        for _ in range(5):
            reference.zero_grad()
            opt.zero_grad()
            local(x).sum().backward()
            remote(x).sum().backward()
            reference.step()
            opt.step()
        for p, before in zip(remote.fc1.parameters(), frozen):
            assert torch.equal(p.detach(), before) and p.grad is None
        for p, q in zip(local.fc2.parameters(), remote.fc2.parameters()):
            assert torch.allclose(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
        remote.fc1.weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match="'fc1.weight' was frozen"):
            opt.step()
        remote.fc1.weight.requires_grad_(False)
        opt.close()
    # A server whose table has a parameter the model froze: named, with the fix.
    with shmps.Server(tensors=[(n, tuple(p.shape)) for n, p in Net().named_parameters()],
                      name=unique_name("frozen2"), optimizer="sgd", backend="host") as server:
        with shmps.connect(server.name) as w, pytest.raises(ValueError, match="fc1.weight.*frozen ones"):
            shmps.torch.RemoteOptimizer(remote, w)


def test_ctrl_c_during_a_step_on_a_stalled_server_raises_at_once(make_server):
    """A KeyboardInterrupt (here a signal handler's exception) ends step()
    within the handler's latency, not the Worker's timeout; the push left
    in flight is waited for and counted by the next call that touches the
    gradient buffer."""
    import signal
    import time

    class Interrupted(Exception):
        pass

    def raise_interrupted(signo, frame):
        raise Interrupted()

    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    try:
        with shmps.connect(server.name, timeout=8) as w:
            opt = shmps.torch.RemoteOptimizer(model, w, init=True)
            model(torch.randn(2, 6)).sum().backward()
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                start = time.monotonic()
                with pytest.raises(Interrupted):
                    opt.step()
                took = time.monotonic() - start
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert took < 2.0, f"step() held the interrupt for {took:.1f} s"
            assert opt.pushes == 0
            opt.zero_grad()  # waits for the push first, and counts it
            assert (opt.pushes, opt.applied) == (1, True)
            model(torch.randn(2, 6)).sum().backward()
            assert opt.step() == 2 and opt.pushes == 2
            opt.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_push_whose_wait_timed_out_or_was_interrupted_stays_pending(make_server):
    """On a stalled server, a step() that times out, or that another thread
    interrupts, raises without losing its push: the next zero_grad() waits
    for it (and, timing out again, still keeps it), so the buffer is not
    zeroed before the server read it; once answered it is counted, and the
    weights moved by the whole gradient."""
    import signal
    import threading
    import time

    model = torch.nn.Linear(2, 1, bias=False)
    server = make_server(tensors=[("weight", (1, 2))], lr=1.0)
    with shmps.connect(server.name, timeout=1) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        before = model.weight.detach().clone()
        for interrupt in (False, True):
            opt.zero_grad()
            model.weight.grad.fill_(1.0)
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                if interrupt:
                    threading.Timer(0.2, w.interrupt).start()
                    with pytest.raises(shmps.InterruptedError):
                        opt.step()
                    assert time.monotonic() - start < 0.9  # not the timeout
                else:
                    with pytest.raises(shmps.TimeoutError):
                        opt.step()
                with pytest.raises(shmps.TimeoutError):
                    opt.zero_grad()  # still unanswered: kept, the buffer untouched
                assert len(w.pushes_in_flight(opt._grad_buf)) == 1 and bool((model.weight.grad == 1.0).all())
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            opt.zero_grad()
            assert w.pushes_in_flight(opt._grad_buf) == [] and opt.applied
        assert opt.pushes == 2
        opt.pull()
        assert torch.allclose(model.weight.detach(), before - 2.0)  # both gradients whole
        opt.close()


@pytest.mark.parametrize("found_by", ["step", "ping"])
def test_a_restarted_server_costs_one_failed_step(make_server, found_by):
    """With reconnect=True, the step after a server restart raises
    ServerRestartedError (its gradient is of the old weights) having pulled
    the new server's weights, and the next step goes through; so too where
    another call (a ping(), a monitor's stats()) found the restarted server
    first and re-attached: nothing of the old gradient is pushed."""
    model = Net()
    tensors = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    server = make_server(tensors=tensors)
    with shmps.connect(server.name, timeout=10, reconnect=True) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        model(torch.randn(2, 6)).sum().backward()
        assert opt.step() == 1
        again = restart(server, tensors)
        try:
            if found_by == "ping":
                w.ping()  # re-attaches
            with pytest.raises(shmps.ServerRestartedError):
                opt.step()
            assert opt.version == 0  # the new server's weights, pulled
            assert w.stats().gradients_applied == 0
            opt.zero_grad()
            model(torch.randn(2, 6)).sum().backward()
            assert opt.step() == 1 and opt.applied
            opt.close()
        finally:
            again.stop()


def test_closing_an_older_optimizer_leaves_a_newer_ones_parameters(make_server):
    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    with shmps.connect(server.name) as w:
        first = shmps.torch.RemoteOptimizer(model, w, init=True)
        second = shmps.torch.RemoteOptimizer(model, w)
        first.close()
        model(torch.randn(2, 6)).sum().backward()
        assert second.step() == 1  # its views untouched by the first's close()
        third = shmps.torch.RemoteOptimizer(model, w)
        with pytest.raises(RuntimeError, match="taken over by another RemoteOptimizer"):
            second.step()
        second.close()
        third.close()


@pytest.mark.parametrize("on_stale", ["skip", "raise"])
def test_a_stale_step_is_counted_and_leaves_fresh_weights(make_server, on_stale):
    """Two workers at max_staleness 0: the second one's step, computed
    against version 0 after the first's applied version 1, is rejected;
    its pull (queued behind the push) still brings version 1's weights."""
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in a.named_parameters()], lr=0.1, max_staleness=0)
    with shmps.connect(server.name) as wa, shmps.connect(server.name) as wb:
        opt_a = shmps.torch.RemoteOptimizer(a, wa, init=True)
        opt_b = shmps.torch.RemoteOptimizer(b, wb, on_stale=on_stale)
        assert opt_b.version == 0
        for opt, model in ((opt_a, a), (opt_b, b)):
            opt.zero_grad()
            model(torch.randn(4, 6)).sum().backward()
        assert opt_a.step() == 1 and opt_a.applied and opt_a.pushes == 1
        if on_stale == "raise":
            with pytest.raises(shmps.StaleError) as stale:
                opt_b.step()
            assert (stale.value.worker_version, stale.value.server_version) == (0, 1)
        else:
            assert opt_b.step() == 1
        assert (opt_b.applied, opt_b.pushes, opt_b.stale, opt_b.version) == (False, 0, 1, 1)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.detach(), q.detach())
        stats = wb.stats()
        assert (stats.version, stats.rejected_stale) == (1, 1)
        # The lane holds nothing more: the next step is applied against version 1.
        opt_b.zero_grad()
        b(torch.randn(4, 6)).sum().backward()
        assert opt_b.step() == 2 and opt_b.applied


def test_a_step_whose_pull_fails_still_counts_its_push(make_server):
    """The pull's error is raised; the push queued before it is answered,
    counted (.applied) and taken from the lane, so the next step works:
    also when the pull's error is a timeout the server answered (a pull
    --staleness-policy wait held past its wait), whose push was answered
    before it."""
    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        pull = w.pull
        for error in (shmps.BusyError, shmps.TimeoutError):

            def failing_pull(*args, **kwargs):
                pull(*args, **kwargs)
                raise error("the pull failed")

            w.pull = failing_pull
            pushes = opt.pushes
            opt.zero_grad()
            model(torch.randn(2, 6)).sum().backward()
            with pytest.raises(error, match="the pull failed"):
                opt.step()
            assert (opt.applied, opt.pushes, opt.stale) == (True, pushes + 1, 0)
            assert w.pushes_in_flight(opt._grad_buf) == []
            w.pull = pull
        opt.zero_grad()
        model(torch.randn(2, 6)).sum().backward()
        assert opt.step() == 3 and opt.applied and opt.pushes == 3


def test_a_step_against_a_stalled_server_waits_one_timeout(make_server):
    """step() raises TimeoutError after the Worker's timeout, not twice it
    (the pull's, then the push's again); the push, unanswered, is counted
    by the next call once the server answers."""
    import signal
    import time

    model = torch.nn.Linear(4, 2)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    with shmps.connect(server.name, timeout=2) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        model(torch.randn(2, 4)).sum().backward()
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(shmps.TimeoutError):
                opt.step()
            assert time.monotonic() - start < 3.5
            assert not opt.applied and len(w.pushes_in_flight(opt._grad_buf)) == 1
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        opt.zero_grad()
        assert opt.applied and opt.pushes == 1
        opt.close()


def test_a_push_whose_ticket_an_interrupt_took_is_still_waited_for(make_server):
    """Ctrl-C as push_async() returns (the handler's KeyboardInterrupt comes
    before the ticket reaches step()): the Worker keeps the ticket, so the
    next zero_grad() waits for the push before it zeroes the gradient the
    server may still read, and counts it."""
    import signal

    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    server = make_server(tensors=[("weight", (1, 4))], optimizer="sgd", lr=1.0)
    with shmps.connect(server.name, timeout=5) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        push_async = w.push_async

        def interrupted(*args, **kwargs):
            push_async(*args, **kwargs)
            raise KeyboardInterrupt

        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()  # a gradient of ones
        os.kill(server.process.pid, signal.SIGSTOP)  # the push stays unread
        try:
            w.push_async = interrupted
            with pytest.raises(KeyboardInterrupt):
                opt.step()
            w.push_async = push_async
            assert len(w.pushes_in_flight(opt._grad_buf)) == 1
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        opt.zero_grad()  # waits for the push first
        assert opt.pushes == 1 and opt.applied
        opt.pull()
        assert model.weight.detach().tolist() == [[-1.0, -1.0, -1.0, -1.0]]  # the whole gradient applied
        opt.close()


def test_a_push_whose_answer_an_interrupt_took_is_still_counted(make_server):
    """Ctrl-C as the step's wait() returns (the handler's KeyboardInterrupt
    comes before step() sees the answer): the Worker counted the answer
    inside wait(), so .pushes and .applied have it."""
    model = torch.nn.Linear(4, 1, bias=False)
    server = make_server(tensors=[("weight", (1, 4))], optimizer="sgd", lr=1.0)
    with shmps.connect(server.name, timeout=5) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        wait = w.wait

        def interrupted(ticket):
            wait(ticket)
            raise KeyboardInterrupt

        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        w.wait = interrupted
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        w.wait = wait
        assert (opt.pushes, opt.stale, opt.applied) == (1, 0, True)
        assert w.pushes_in_flight(opt._grad_buf) == []
        opt.close()
        assert (opt.pushes, opt.applied) == (1, True)  # kept past close()


def test_a_forked_child_closes_its_parents_optimizer_and_keeps_the_parameters(make_server):
    """In a fork()ed child the parent's Worker answers nothing, but the
    optimizer's close() still gives the child's model its parameters (the
    weights last pulled), as after a server gone; the parent's optimizer
    goes on."""
    model = torch.nn.Linear(4, 1, bias=False)
    server = make_server(tensors=[("weight", (1, 4))], optimizer="sgd", lr=1.0)
    with shmps.connect(server.name, timeout=5) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        weights = model.weight.detach().clone()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                opt.close()
                if opt.closed and torch.equal(model.weight.detach(), weights) and opt.pushes == 0:
                    code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        assert opt.step() == 1 and opt.pushes == 1
        opt.close()


def test_a_parameter_frozen_after_the_optimizer_was_made_is_refused(make_server):
    """The server would go on moving it (momentum, weight decay): step()
    raises instead, as for one unfrozen later."""
    model = torch.nn.Linear(4, 2)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()], optimizer="sgd",
                         lr=0.1, momentum=0.9, weight_decay=0.1)
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        model.bias.requires_grad_(False)
        with pytest.raises(RuntimeError, match="'bias' was trainable when this RemoteOptimizer was made"):
            opt.step()
        opt.close()


def test_a_remote_optimizer_dropped_without_close_frees_its_buffers(make_server):
    """Made once per epoch and dropped: its two registrations go with it,
    so the Worker's buffer slots (16 by default) do not run out."""
    import gc

    model = torch.nn.Linear(4, 2)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    with shmps.connect(server.name) as w:
        for _ in range(12):  # kept, the 9th would raise NoCapacityError
            opt = shmps.torch.RemoteOptimizer(model, w)
            del opt
            gc.collect()
        w.register_buffer(16)


def _buffers_mapped(server):
    """How many mappings of this process's buffer objects of `server`
    (named shmps.NAME.pPID.*, unlinked or not) it has."""
    import gc

    gc.collect()
    with open("/proc/self/maps") as f:
        return sum(f"/dev/shm/shmps.{server.name}.p{os.getpid()}." in line for line in f)


def test_buffers_of_an_optimizer_dropped_without_close_go_at_the_workers_close(make_server):
    """A dropped RemoteOptimizer's buffers wait for the Worker's next
    registration to be unregistered (free_later()); a Worker closed first
    lets go of them, though it lives on."""
    model = torch.nn.Linear(4, 2)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    w = shmps.connect(server.name)
    opt = shmps.torch.RemoteOptimizer(model, w, init=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    del opt
    assert _buffers_mapped(server) == 2
    w.close()
    del model  # its parameters were views of the buffers
    assert _buffers_mapped(server) == 0
    assert w.closed


def test_a_constructor_whose_pull_fails_leaves_the_model_as_it_was(make_server):
    """The model's parameters and gradients are moved into the buffers only
    once the first pull went through; a failure before leaves them, and
    unregisters the buffers it made."""
    model = Net()
    model(torch.randn(2, 6)).sum().backward()
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])

    class FailingPull(shmps.torch.RemoteOptimizer):
        def pull(self):
            raise shmps.TimeoutError("no completion within the timeout")

    with shmps.connect(server.name) as w:
        with pytest.raises(shmps.TimeoutError):
            FailingPull(model, w, init=True)
        for (weights, grad), p in zip(before, model.parameters()):
            assert torch.equal(p.detach(), weights) and torch.equal(p.grad, grad)
        assert glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*") == []  # its buffers unregistered
        shmps.torch.RemoteOptimizer(model, w)  # the model still works with a new one


def test_close_gives_the_model_its_parameters_back_and_frees_the_buffers(make_server):
    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()], lr=0.1)
    with shmps.connect(server.name) as w:
        with shmps.torch.RemoteOptimizer(model, w, init=True) as opt:
            opt.zero_grad()
            model(torch.randn(2, 6)).sum().backward()
            assert opt.step() == 1
            weights = [p.detach().clone() for p in model.parameters()]
            grads = [p.grad.clone() for p in model.parameters()]
            buffers = [(t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in (opt._weights, opt._grads)]
        assert opt.closed
        for p, weight, grad in zip(model.parameters(), weights, grads):
            assert torch.equal(p.detach(), weight) and torch.equal(p.grad, grad)
            for t in (p.data, p.grad):
                assert not any(lo <= t.data_ptr() < hi for lo, hi in buffers)  # its own memory
        assert glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*") == []  # unregistered
        assert _buffers_mapped(server) == 0  # let go of while the closed optimizer lives
        opt.close()  # idempotent
        for call in (opt.step, opt.pull, opt.zero_grad):
            with pytest.raises(RuntimeError, match="after close"):
                call()
        # The model trains on its own, and through a new RemoteOptimizer.
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert w.pull(w.register_buffer(w.total_elements * 4)) == 1  # the server did not see it
        again = shmps.torch.RemoteOptimizer(model, w)
        for p, weight in zip(model.parameters(), weights):
            assert torch.equal(p.detach(), weight)  # pulled the server's
        again.close()


def test_mismatched_names_shapes_and_dtypes_are_refused_at_construction(make_server):
    model = Net()
    server = make_server(tensors=[("fc1.weight", (5, 6)), ("fc1.bias", (4,)), ("fc3.bias", (3,))])
    with shmps.connect(server.name) as w:
        with pytest.raises(ValueError) as e:
            shmps.torch.RemoteOptimizer(model, w)
        text = str(e.value)
        assert "fc1.bias is (5,) here, (4,) on the server" in text
        assert "fc2.weight (3, 5) is not on the server" in text
        assert "fc3.bias is not in the model" in text
        with pytest.raises(ValueError, match="float64"):
            shmps.torch.RemoteOptimizer(Net().double(), w)


def test_init_twice_is_refused(make_server):
    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    with shmps.connect(server.name) as a, shmps.connect(server.name) as b:
        shmps.torch.RemoteOptimizer(model, a, init=True)
        first = [p.detach().clone() for p in model.parameters()]
        other = Net()
        opt_b = shmps.torch.RemoteOptimizer(other, b, init=True)  # refused: already initialised; pulls a's
        for p, q in zip(first, other.parameters()):
            assert torch.equal(p, q.detach())
        with pytest.raises(shmps.InitRefusedError, match="already initialised by worker"):
            b.init(opt_b._weight_buf)


def test_the_server_launcher_takes_the_models_table():
    model = Net()
    with shmps.Server(model, optimizer="adam", lr=1e-3, backend="host") as server:
        with shmps.connect(server.name) as w:
            assert [(t.name, t.shape) for t in w.tensors] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        name = server.name
    assert not glob.glob(f"/dev/shm/shmps.{name}*")
    with pytest.raises(shmps.ServerNotRunningError, match="exited 2 at start"):
        shmps.Server(model, optimizer="adam", momentum=0.9).start()  # an SGD option


@pytest.mark.skipif(not os.path.exists(DATASET), reason="needs Debian's dataset-fashion-mnist")
def test_two_torch_processes_two_epochs_on_a_subset_beat_075():
    name = unique_name("example")
    out = subprocess.run([sys.executable, EXAMPLE, "--workers", "2", "--epochs", "2", "--train-limit", "12000",
                          "--test-limit", "2000", "--name", name], capture_output=True, text=True, timeout=120)
    print(out.stdout[-2000:], out.stderr[-2000:])
    assert out.returncode == 0
    final = [line for line in out.stdout.splitlines() if line.startswith("final test accuracy:")]
    assert final, out.stdout
    assert float(final[0].split()[3]) > 0.75
    assert "(agree)" in out.stdout
    assert not glob.glob(f"/dev/shm/shmps.{name}*"), "the example left shared memory behind"


def _session_processes(sid):
    """The pids of the processes of session `sid`."""
    pids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            pids.append(int(stat.split("/")[2]))
    return pids


@pytest.mark.skipif(not os.path.exists(DATASET), reason="needs Debian's dataset-fashion-mnist")
def test_the_example_killed_by_sigkill_leaves_no_process_or_shared_memory():
    """The parent SIGKILLed mid-run (the OOM killer): its server stops
    (--parent-pid), its workers end at their next call, and nothing of the
    run (in a session of its own) is left running."""
    import signal

    name = unique_name("example_kill")
    child = subprocess.Popen([sys.executable, EXAMPLE, "--workers", "2", "--epochs", "200", "--train-limit", "6000",
                              "--test-limit", "1000", "--name", name], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline().startswith("epoch "), "the example did not start training"
        child.kill()
        child.wait()
        deadline = time.monotonic() + 20
        while (_session_processes(child.pid) or glob.glob(f"/dev/shm/shmps.{name}*")) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        left = _session_processes(child.pid)
        assert not left, f"left running: {left}"
        assert not glob.glob(f"/dev/shm/shmps.{name}*"), "the example left shared memory behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


@pytest.mark.skipif(not os.path.exists(DATASET), reason="needs Debian's dataset-fashion-mnist")
def test_the_straggler_harness_runs_every_policy_and_ddp(tmp_path):
    """bench/straggler.py --smoke end to end: each policy and torch DDP, with
    and without the straggler, a summary with its goals, nothing left in /dev/shm."""
    # The harness's servers take shmps.Server's default names, "py<pid>_<n>";
    # other tests running beside this one make objects of other names.
    mine = "/dev/shm/shmps.py*"
    before = set(glob.glob(mine))
    script = os.path.join(os.path.dirname(EXAMPLE), "..", "..", "bench", "straggler.py")
    bin_dir = os.path.dirname(os.environ["SHMPS_SERVER_BIN"])
    out = subprocess.run([sys.executable, script, "--smoke", "--arms", "shmps-wait", "shmps-scale", "ddp",
                          "--bin", bin_dir, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=170, env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0
    summary = (tmp_path / "summary.md").read_text()
    for row in ("| shmps-wait |", "| shmps-scale, straggler |", "| ddp |", "| ddp, straggler |"):
        assert row in summary, row
    runs = {r["label"]: r for r in json.loads((tmp_path / "runs.json").read_text())}
    assert runs["shmps-wait, straggler"]["delay"] > 0.0  # from the straggler-free shmps-wait run
    assert runs["shmps-wait"]["delay"] == 0.0
    assert runs["ddp"]["updates"] == runs["shmps-wait"]["updates"]
    assert all(r["curve"][-1][2] > 0.5 for r in runs.values())
    assert set(glob.glob(mine)) <= before, "the harness left shared memory behind"


# ---- CUDA (the GPU machine) ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@cuda
def test_device_buffers_and_remote_optimizer_on_cuda_match_the_cpu_run(make_server):
    options = OPTIMIZERS["adam"]
    _, on_cpu = run_remote(make_server, options, "cpu")
    worst, on_gpu = run_remote(make_server, options, "cuda:0", backend="cuda")
    diff = max((a - b).abs().max().item() for a, b in zip(on_cpu, on_gpu))
    print(f"cuda vs cpu: largest difference {diff:.3g}; vs torch.optim {worst:.3g}")
    assert diff <= 1e-6


@cuda
def test_register_device_buffer_takes_a_torch_tensor(make_server):
    server = make_server(lr=1, backend="cuda")
    with shmps.connect(server.name) as w:
        grad = torch.full((w.total_elements,), 2.0, device="cuda:0")
        buf = w.register_device_buffer(grad)
        out = w.alloc_device_buffer(w.total_elements * 4, "cuda:0")
        assert w.push(buf, 0, stream=torch.cuda.current_stream()) == 1
        w.pull(out, stream=torch.cuda.current_stream())
        weights = torch.from_dlpack(out).view(torch.float32)
        assert torch.equal(weights, torch.full_like(weights, -2.0))
        w.unregister_buffer(buf)


@cuda
def test_device_memory_a_stopped_server_may_still_write_outlives_close(make_server):
    """close() against a stopped server: the detach is not answered, and the
    server may still serve a pull sent before it into the registered
    memory. The tensor given to register_device_buffer (and the memory of
    alloc_device_buffer) is then held until the process ends, with a
    RuntimeWarning, instead of going back to torch's caching allocator for
    another tensor; after an answered detach it goes."""
    import gc
    import signal
    import weakref

    server = make_server(backend="cuda")
    for stopped in (False, True):
        w = shmps.connect(server.name, timeout=1)
        t = torch.zeros(w.total_elements, device="cuda:0")
        w.register_device_buffer(t)
        w.alloc_device_buffer(w.total_elements * 4, "cuda:0")
        held = weakref.ref(t)
        if stopped:
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                with pytest.warns(RuntimeWarning, match="2 device buffer.*until this process ends"):
                    w.close()
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
        else:
            w.close()
        del t
        gc.collect()
        assert (held() is not None) == stopped


@cuda
def test_device_memory_goes_at_close_after_an_answered_detach(make_server):
    """detach() answered, then close() (or the with block's end): close's
    second detach is refused as "detached", which is no unanswered
    detach: the device memory goes, and no warning is given."""
    import gc
    import warnings
    import weakref

    server = make_server(backend="cuda")
    w = shmps.connect(server.name)
    t = torch.zeros(w.total_elements, device="cuda:0")
    w.register_device_buffer(t)
    held = weakref.ref(t)
    w.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.close()
    del t
    gc.collect()
    assert held() is None


@cuda
def test_expandable_segments_fail_with_a_pointer_to_alloc_device_buffer(make_server):
    server = make_server()
    code = (f"import torch, shmps\n"
            f"w = shmps.connect({server.name!r})\n"
            f"t = torch.zeros(w.total_elements, device='cuda:0')\n"
            f"try:\n    w.register_device_buffer(t)\nexcept shmps.CudaError as e:\n    print('REFUSED', e)\n")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "alloc_device_buffer" in out.stdout


def test_a_model_without_trainable_parameters_says_which_case():
    with pytest.raises(ValueError, match="no trainable parameters$"):
        shmps.Server(torch.nn.ReLU())  # none at all: not "every one frozen"
    with pytest.raises(ValueError, match="every one has requires_grad=False"):
        shmps.Server(torch.nn.Linear(2, 2).requires_grad_(False))


def test_a_forked_childs_backward_stays_out_of_its_parents_gradient(make_server):
    """The gradient buffer is shared memory: a fork()ed child's backward()
    writes copy-on-write pages of its own (the worker library remaps the
    buffers privately in the child), as with plain torch, instead of the
    parent's gradient, which the parent's next step() would push."""
    model = torch.nn.Linear(4, 3)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()], optimizer="sgd",
                         lr=1.0)
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        opt.zero_grad()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                model(torch.ones(1, 4)).sum().backward()
                code = 0 if torch.equal(model.bias.grad, torch.ones(3)) else 2  # the child's own gradient
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert torch.count_nonzero(model.weight.grad) == 0 and torch.count_nonzero(model.bias.grad) == 0
        model(torch.full((1, 4), 2.0)).sum().backward()  # the parent's: bias 1, weight 2
        weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
        assert opt.step() == 1
        assert torch.allclose(model.weight.detach(), weight - 2.0, rtol=0, atol=1e-6)
        assert torch.allclose(model.bias.detach(), bias - 1.0, rtol=0, atol=1e-6)
        opt.close()


def test_a_constructor_whose_second_registration_fails_frees_the_first(make_server):
    """Three buffer slots, two taken: the gradient buffer gets the third,
    the weight buffer none; the constructor's failure frees the gradient
    buffer's slot too."""
    model = torch.nn.Linear(4, 3)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()], max_buffers=3)
    with shmps.connect(server.name) as w:
        taken = [w.register_buffer(64), w.register_buffer(64)]
        with pytest.raises(shmps.NoCapacityError):
            shmps.torch.RemoteOptimizer(model, w)
        for buf in taken:
            w.unregister_buffer(buf)
        assert glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*") == []
        for buf in [w.register_buffer(8) for _ in range(3)]:  # every slot free again
            w.unregister_buffer(buf)


def test_ctrl_c_in_the_constructors_pull_leaves_its_buffers_to_the_next_registration(make_server):
    """Ctrl-C while the constructor's pull waits for a stopped server (the
    Worker's timeout infinite) raises at once: the two buffers are handed
    to Worker.free_later instead of being unregistered there, which would
    wait for the server without end; the next registration frees them.
    (A watchdog continues the server after 12 s, for the code that waited.)"""
    import signal
    import threading
    import time

    model = Net()
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()])

    class StopsTheServerFirst(shmps.torch.RemoteOptimizer):
        def pull(self):
            os.kill(server.process.pid, signal.SIGSTOP)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            return super().pull()

    with shmps.connect(server.name, timeout=float("inf")) as w:
        watchdog = threading.Timer(12, os.kill, (server.process.pid, signal.SIGCONT))
        watchdog.start()
        try:
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                StopsTheServerFirst(model, w)
            took = time.monotonic() - start
        finally:
            watchdog.cancel()
            os.kill(server.process.pid, signal.SIGCONT)
        assert took < 2.0, f"the constructor held the interrupt for {took:.1f} s"
        spare = w.register_buffer(16)  # frees the two first
        assert len(glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*")) == 1
        w.unregister_buffer(spare)


def test_steps_from_several_threads_take_turns(make_server):
    """Three threads step one RemoteOptimizer: no step takes another's
    push answer ("ticket N was already waited for"), and every push is
    counted once."""
    import threading

    model = torch.nn.Linear(4, 3)
    server = make_server(tensors=[(n, tuple(p.shape)) for n, p in model.named_parameters()], optimizer="sgd",
                         lr=0.01, max_staleness=100000)
    errors = []
    with shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)

        def train():
            for _ in range(150):
                try:
                    opt.zero_grad()
                    model(torch.ones(1, 4)).sum().backward()
                    opt.step()
                except Exception as e:  # noqa: BLE001 (every error is the test's failure)
                    errors.append(e)

        threads = [threading.Thread(target=train) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert (opt.pushes, opt.stale) == (450, 0)
        assert w.stats().gradients_applied == 450
        assert w.pushes_in_flight(opt._grad_buf) == []
        opt.close()


def test_a_forked_child_closes_an_optimizer_whose_step_another_parent_thread_was_in(make_server):
    """The optimizer's lock, held by a parent's thread in step() at the
    fork, is made anew in the child: its close() does not wait for a thread
    the child does not have."""
    import threading

    model = torch.nn.Linear(4, 1, bias=False)
    server = make_server(tensors=[("weight", (1, 4))])
    with shmps.connect(server.name, timeout=5) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        inside, leave = threading.Event(), threading.Event()

        def hold():  # as a step() in flight would
            with opt._lock:
                inside.set()
                leave.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        inside.wait()
        try:
            pid = os.fork()
            if pid == 0:
                import signal
                signal.alarm(10)  # a hang ends the child, failing the test
                code = 1
                try:
                    opt.close()
                    code = 0 if opt.closed else 2
                finally:
                    os._exit(code)
            assert os.waitpid(pid, 0)[1] == 0
        finally:
            leave.set()
            holder.join()
        assert opt.step() == 1
        opt.close()


def test_a_registered_tensors_storage_is_held_and_its_reallocation_refused():
    """register_device_buffer(tensor) holds the tensor's storage, not only
    the tensor: after t.set_(other) the registered memory stays allocated;
    after t.resize_() past its storage (which reallocates it, the old block
    going back to torch's allocator) a call on the buffer is refused. (The
    device path itself needs a GPU: this checks the part that runs on the
    CPU, shmps._HeldStorage.)"""
    t = torch.arange(4.0)
    held = shmps._HeldStorage(t)
    ptr = t.data_ptr()
    t.set_(torch.zeros(8))
    del t
    assert held.data_ptr() == ptr  # still the registered memory, held
    held.check(3)
    u = torch.zeros(4)
    held = shmps._HeldStorage(u)
    u.resize_(1 << 20)
    with pytest.raises(shmps.InvalidArgumentError, match="buffer 3: .*reallocated"):
        held.check(3)


def test_a_call_on_a_registered_tensor_reallocated_by_resize_is_refused(make_server):
    """register_device_buffer's wiring of _HeldStorage, the device part
    stubbed (no GPU needed): the extension's register_device_buffer is
    replaced by a host registration, the tensor is a CPU one that says it
    is on CUDA. A pull after resize_() reallocated its storage is refused,
    naming the buffer; unregister_buffer() still frees it."""
    class SaysCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    server = make_server()
    with shmps.connect(server.name) as w:
        native = w._w

        class HostForDevice:
            def __getattr__(self, name):
                return getattr(native, name)

            def register_device_buffer(self, ptr, nbytes, device, owner):
                self.owner = owner
                return native.register_buffer(nbytes)

        w._w = HostForDevice()
        t = torch.zeros(w.total_elements).as_subclass(SaysCuda)
        buf = w.register_device_buffer(t)
        assert w.pull(buf) == 0
        t.resize_(1 << 20)  # past its storage: reallocated
        with pytest.raises(shmps.InvalidArgumentError, match=f"buffer {buf.id}: .*reallocated"):
            w.pull(buf)
        w.unregister_buffer(buf)
        assert glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*") == []
        # Unregistered by its bare id, a registration lets go of the
        # tensor's storage as well.
        again = w.register_device_buffer(torch.zeros(w.total_elements).as_subclass(SaysCuda))
        assert len(w._held) == 1
        w.unregister_buffer(again.id)
        assert w._held == {}


def test_a_zero_dimensional_tensor_is_no_buffer_id(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        buf = w.register_buffer(w.total_elements * 4)
        with pytest.raises(TypeError, match="shmps.Buffer"):
            w.pull(torch.tensor(buf.id))
        with pytest.raises(TypeError, match="tensor must be"):
            w.pull(buf, tensor=torch.tensor(0))
