"""shmps's Python worker against real shmps-server processes, without torch:
errors, buffers, exact SGD, bad input, staleness, stats, the GIL, fork and
reconnect."""

import contextlib
import glob
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import shmps
from conftest import SMALL, restart, unique_name


def weights(worker, buf):
    """All weights pulled into buf, as a float32 copy, and their version."""
    version = worker.pull(buf)
    return np.asarray(buf).view(np.float32)[: worker.total_elements].copy(), version


def test_connect_to_a_missing_server_names_the_segment():
    name = unique_name("absent")
    with pytest.raises(shmps.ServerNotRunningError) as e:
        shmps.connect(name)
    assert f"/dev/shm/shmps.{name}" in str(e.value)
    assert e.value.code == 12 and e.value.name == "server_not_running"
    assert isinstance(e.value, shmps.Error) and isinstance(e.value, ConnectionError)


def test_server_user_that_no_user_has_is_invalid_argument(make_server):
    server = make_server()
    with pytest.raises(shmps.InvalidArgumentError) as e:
        shmps.connect(server.name, server_user="no_such_user_shmps")
    assert "no such user" in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the server as another user (nobody)")
def test_a_segment_of_another_user_raises_permission_error_unless_named(tmp_path):
    name = unique_name("nobody")
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([shmps.server_binary(), "--name", name, "--tensor", "w:4"], user="nobody",
                              group="nogroup", extra_groups=[], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                shmps.connect(name, server_user="nobody").close()
                break
            except shmps.ServerNotRunningError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.01)
        with pytest.raises(shmps.PermissionError) as e:
            shmps.connect(name)
        assert f"/dev/shm/shmps.{name} (owner nobody:nogroup, mode 0600) is not owned by a user" in str(e.value)
        assert "server_user" in str(e.value)
        with shmps.connect(name, server_user="nobody") as w:
            assert w.tensors[0].name == "w"
    finally:
        server.terminate()
        assert server.wait(10) == 0
        log.close()


def test_the_table_and_the_context_manager(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        assert [(t.name, t.shape, t.offset, t.count) for t in w.tensors] == [("w", (4, 2), 0, 8), ("b", (8,), 8, 8)]
        assert w.total_elements == 16
        assert w.tensor("b").id == 1
        with pytest.raises(shmps.UnknownTensorError):
            w.tensor("nope")
    assert w.closed
    with pytest.raises(shmps.UnknownWorkerError):
        w.ping()


def test_a_buffer_is_writable_shared_memory(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        buf = w.register_buffer(4096)
        view = memoryview(buf)
        assert view.nbytes == 4096 and not view.readonly
        view[:5] = b"hello"
        np.asarray(buf)[5:8] = [1, 2, 3]
        # A second mapping of the object the server maps sees the same bytes.
        (path,) = glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*")
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
            assert m[:8] == b"hello\x01\x02\x03"
            m[8:10] = b"!!"
        assert bytes(view[8:10]) == b"!!"


def _a_driver_loads():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_a_driver_loads(), reason="an NVIDIA driver loads here: the case is a host without one")
def test_a_device_buffer_without_a_driver_raises_cuda_error_and_the_worker_goes_on(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        # A library built with CUDA names the driver to install; one built
        # without it says so.
        with pytest.raises(shmps.CudaError, match="install the NVIDIA driver|built without CUDA"):
            w.alloc_device_buffer(16, 0)
        buf = w.register_buffer(w.total_elements * 4)
        np.asarray(buf).view(np.float32)[:] = 1.0
        assert w.push(buf, 0) == 1


def test_sgd_with_lr_1_gives_exactly_w0_minus_g(make_server):
    server = make_server(lr=1, init="uniform", init_seed=3)
    with shmps.connect(server.name) as w:
        out = w.register_buffer(w.total_elements * 4)
        grad = w.register_buffer(w.total_elements * 4)
        w0, v0 = weights(w, out)
        assert v0 == 0 and np.any(w0 != 0)
        g = np.linspace(-2, 3, w.total_elements, dtype=np.float32)
        np.asarray(grad).view(np.float32)[:] = g
        assert w.push(grad, v0) == 1
        w1, v1 = weights(w, out)
        assert v1 == 1
        assert np.array_equal(w1, w0 - g)


def test_each_bad_input_raises_its_own_error_and_changes_nothing(make_server):
    server = make_server(lr=0.5)
    w = shmps.connect(server.name)
    n = w.total_elements
    out = w.register_buffer(n * 4)
    grad = w.register_buffer(n * 4)
    np.asarray(grad).view(np.float32)[:] = 1.0
    before, v = weights(w, out)
    cases = [
        (shmps.BadLengthError, lambda: w.push(grad, v, nbytes=8)),
        (shmps.BadDtypeError, lambda: w.push(grad, v, dtype="int8")),
        (shmps.BadLengthError, lambda: w.push(grad, v, dtype="float16", nbytes=n * 4)),
        (shmps.BadRequestError, lambda: w.push(grad, v + 5)),
        (shmps.UnknownTensorError, lambda: w.push(grad, v, tensor="nope")),
        (shmps.UnknownTensorError, lambda: w.push(grad, v, tensor=99, nbytes=4)),
        (shmps.UnknownBufferError, lambda: w.push(77, v)),
        (shmps.BadRangeError, lambda: w.push(grad, v, offset=8)),
        (shmps.InvalidArgumentError, lambda: w.register_buffer(0)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
    np.asarray(grad).view(np.float32)[3] = np.nan
    with pytest.raises(shmps.NonFiniteError):
        w.push(grad, v)
    after, v_after = weights(w, out)
    assert v_after == v and np.array_equal(after, before)
    w.close()
    with pytest.raises(shmps.UnknownWorkerError):
        w.push(grad, v)
    w.close()  # idempotent


def test_a_stale_push_raises_stale_error_with_both_versions(make_server):
    server = make_server(max_staleness=1)
    with shmps.connect(server.name) as w:
        grad = w.register_buffer(w.total_elements * 4)
        for _ in range(3):
            w.push(grad, w.pull(grad))
        with pytest.raises(shmps.StaleError) as e:
            w.push(grad, 1)
        assert (e.value.worker_version, e.value.server_version) == (1, 3)
        assert "staleness 2 > max_staleness 1" in str(e.value)


def _inspect():
    return os.path.join(os.path.dirname(shmps.server_binary()), "shmps-inspect")


def _inspect_until(name, part, patience=5.0):
    """shmps-inspect's text for server `name` once it holds `part` (the
    stats block's gauges are refreshed every 10 ms), or the last one read
    after `patience` seconds."""
    deadline = time.monotonic() + patience
    while True:
        text = subprocess.run([_inspect(), name], capture_output=True, text=True, check=True).stdout
        if part in text or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def test_an_lr_schedule_past_the_float_range_refuses_pushes_and_changes_nothing(make_server):
    """exponential:1e30 (a GAMMA past the float range is refused at the
    start) overflows a float at the third update, lr 0.1 * 1e30^2: the push
    is refused naming the schedule, the weights stay, the stats say so."""
    server = make_server(init="uniform", lr=0.1, lr_schedule="exponential:1e30")
    with shmps.connect(server.name) as w:
        grad, out = w.register_buffer(w.total_elements * 4), w.register_buffer(w.total_elements * 4)
        np.asarray(grad).view(np.float32)[:] = 1.0
        assert w.push(grad, 0) == 1  # update 1: lr 0.1
        assert w.push(grad, 1) == 2  # update 2: lr 1e29
        before = np.asarray(out).view(np.float32).copy() if w.pull(out) == 2 else None
        with pytest.raises(shmps.NonFiniteError, match="lr-schedule"):
            w.push(grad, 2)
        assert w.pull(out) == 2
        assert np.array_equal(np.asarray(out).view(np.float32), before)
        text = _inspect_until(server.name, "scheduled lr    not finite")
        assert "scheduled lr    not finite" in text, text


def test_a_finite_lr_past_the_stats_word_is_applied_and_shown_saturated(make_server):
    """The stats block holds the scheduled lr in 1e-12ths, up to 1.8e7: a
    larger finite lr is applied, and shown as at least that, not as the
    not-finite lr that refuses pushes."""
    import json

    server = make_server(lr=1e8)
    with shmps.connect(server.name) as w:
        grad, out = w.register_buffer(w.total_elements * 4), w.register_buffer(w.total_elements * 4)
        np.asarray(grad).view(np.float32)[:] = 1.0
        assert w.push(grad, 0) == 1
        assert w.pull(out) == 1
        assert np.all(np.asarray(out).view(np.float32) == np.float32(-1e8))
        text = _inspect_until(server.name, "scheduled lr    at least ")
        assert "scheduled lr    at least 1.8" in text, text
        stats = json.loads(subprocess.run([_inspect(), server.name, "--json"], capture_output=True, text=True,
                                          check=True).stdout)["stats"]
        assert stats["scheduled_lr"] is not None and 1.8e7 < stats["scheduled_lr"] < 1.9e7, stats


def test_a_sighup_during_the_start_is_applied_once_the_server_serves(tmp_path):
    """The file may change while a large model initialises: the reload a
    SIGHUP asks for then runs once the server serves, instead of the signal
    being dropped."""
    import json

    name = unique_name("hupstart")
    conf = tmp_path / "s.conf"
    conf.write_text("lr = 0.5\n")
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([shmps.server_binary(), "--name", name, "--tensor", "w:100000000", "--init", "normal",
                               "--config", str(conf)], stdout=log, stderr=log)
    try:
        time.sleep(0.2)
        conf.write_text("lr = 0.25\n")
        os.kill(server.pid, signal.SIGHUP)
        serving_before = "serving /dev/shm" in open(tmp_path / "server.log").read()
        lr = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and lr != 0.25:
            run = subprocess.run([_inspect(), "--json", name], capture_output=True, text=True)
            if run.returncode == 0:
                lr = json.loads(run.stdout)["config"]["lr"]
            time.sleep(0.05)
        if serving_before:
            pytest.skip("the server was serving before the SIGHUP: the start was too quick to land one in it")
        assert lr == 0.25, open(tmp_path / "server.log").read()
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    assert not glob.glob(f"/dev/shm/shmps.{name}*")


def test_staleness_policies_through_python(make_server):
    """scale: a stale push is applied and counted; wait: a pull held past
    its wait raises TimeoutError naming the slowest worker."""
    server = make_server(staleness_policy="scale", max_staleness=1)
    with shmps.connect(server.name) as w:
        grad = w.register_buffer(w.total_elements * 4)
        for _ in range(3):
            w.push(grad, 0)  # staleness 0, 1, 2: the last at lr / 2
        s = w.stats()
        assert (s.pushes_scaled, s.my_pushes_scaled, s.scale_factor_sum_micro) == (1, 1, 500000)
        assert s.my_scale_factor_sum_micro == 500000
        assert s.rejected_stale == 0
    server = make_server(staleness_policy="wait", max_staleness=0, tag="ssp")
    with shmps.connect(server.name) as slow, shmps.connect(server.name, timeout=0.4) as fast:
        g_slow = slow.register_buffer(slow.total_elements * 4)
        g_fast = fast.register_buffer(fast.total_elements * 4)
        slow.push(g_slow, slow.pull(g_slow))  # slow: clock 1
        fast.push(g_fast, fast.pull(g_fast))  # fast joins at the slowest clock, 1: as many pushes, not ahead
        fast.push(g_fast, fast.pull(g_fast))  # fast: clock 2
        with pytest.raises(shmps.TimeoutError, match=r"at clock 2, more than 0 ahead of worker \d+ at 1"):
            fast.pull(g_fast)
        slow.push(g_slow, slow.pull(g_slow))  # slow: clock 2
        fast.pull(g_fast)
        s = fast.stats()
        assert s.my_pulls_waited == 1 and s.rejected_timeout == 1 and s.my_wait_ns > 0


def test_scale_applies_a_finite_scaled_lr_even_where_lr_times_the_bound_is_not(make_server):
    """scale: lr * b / t with lr 1e38 and b 4 is 8e37 for t 5, finite,
    though lr * b alone passes the float range: applied, not refused as a
    learning rate past the float range."""
    server = make_server(staleness_policy="scale", max_staleness=4, lr=1e38)
    with shmps.connect(server.name) as w:
        grad, out = w.register_buffer(w.total_elements * 4), w.register_buffer(w.total_elements * 4)
        np.asarray(grad).view(np.float32)[:] = 1e-30
        for _ in range(6):
            w.push(grad, 0)  # staleness 0..5: the last past the bound 4
        assert w.pull(out) == 6
        s = w.stats()
        assert (s.pushes_scaled, s.scale_factor_sum_micro, s.rejected_nonfinite) == (1, 800000, 0)
        expected = np.float32(-5e8) - np.float32(8e7)  # 5 full steps of 1e38 * 1e-30, then 4/5 of one
        assert np.allclose(np.asarray(out).view(np.float32), expected, rtol=1e-6)


class _Raised(Exception):
    pass


def test_a_signal_handler_that_raises_ends_a_held_pull_at_once(make_server):
    """A blocking call runs the signal handlers while it waits: a handler
    that raises ends the wait with its exception (the request stays in
    flight), one that does not leaves the call waiting, and the Worker goes
    on."""
    server = make_server(staleness_policy="wait", max_staleness=0)
    calls = []

    def handler(signum, frame):
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise _Raised("second signal")

    old = signal.signal(signal.SIGUSR1, handler)
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGUSR1)) for t in (0.2, 0.5)]
    try:
        with shmps.connect(server.name) as slow, shmps.connect(server.name, timeout=30) as fast:
            g_slow = slow.register_buffer(slow.total_elements * 4)
            g_fast = fast.register_buffer(fast.total_elements * 4)
            slow.push(g_slow, slow.pull(g_slow))  # slow: clock 1
            fast.push(g_fast, fast.pull(g_fast))  # fast joins at the slowest clock, 1
            fast.push(g_fast, fast.pull(g_fast))  # fast: clock 2, its next pull is held
            start = time.monotonic()
            for t in timers:
                t.start()
            with pytest.raises(_Raised):
                fast.pull(g_fast)
            assert len(calls) == 2 and start + 0.15 < calls[0] < calls[1]  # the first did not end the wait
            assert time.monotonic() - calls[1] < 1.0  # a 20 ms slice after the handler, not the 30 s timeout
            # The held pull was cancelled: the lane is not stuck behind it,
            # though the slow worker has not moved.
            before = time.monotonic()
            fast.ping()
            assert time.monotonic() - before < 2.0
            assert fast.stats().my_pulls_waited == 1
            slow.push(g_slow, slow.pull(g_slow))  # slow: clock 2
            assert fast.pull(g_fast) == 4  # 2 pushes of each
    finally:
        for t in timers:
            t.cancel()
        signal.signal(signal.SIGUSR1, old)


def test_an_interrupted_wait_withdraws_every_held_pull(make_server):
    """Two pulls sent ahead under wait, both to be held: interrupting the
    wait for the first withdraws both. Waiting for either again raises
    shmps.InterruptedError (the server's answer: nothing copied), and
    close() does not wait behind them."""
    server = make_server(staleness_policy="wait", max_staleness=0)

    def handler(signum, frame):
        raise _Raised("interrupt")

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        slow = shmps.connect(server.name)
        fast = shmps.connect(server.name, timeout=30)
        g_slow = slow.register_buffer(slow.total_elements * 4)
        w1 = fast.register_buffer(fast.total_elements * 4)
        w2 = fast.register_buffer(fast.total_elements * 4)
        slow.push(g_slow, slow.pull(g_slow))  # slow: clock 1
        fast.push(w1, fast.pull(w1))  # fast joins at the slowest clock, 1
        fast.push(w1, fast.pull(w1))  # fast: clock 2, its pulls are held
        tickets = [fast.pull_async(w1), fast.pull_async(w2)]
        timer.start()
        with pytest.raises(_Raised):
            fast.wait(tickets[0])
        for t in tickets:
            with pytest.raises(shmps.InterruptedError, match="withdrawn by its worker"):
                fast.wait(t)
        assert fast.stats().my_pulls_waited == 2
        before = time.monotonic()
        fast.close()
        assert time.monotonic() - before < 2.0
        slow.close()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


def _held_pull_in_a_thread(server):
    """(slow, fast, g_slow, g_fast, thread, outcome): fast is one clock ahead
    of slow under wait with max_staleness 0, and `thread` is in fast.pull,
    held until slow pushes; `outcome` gets ("ok", version) or
    ("error", exception, time.monotonic() when it was raised)."""
    slow = shmps.connect(server.name)
    fast = shmps.connect(server.name, timeout=30)
    g_slow = slow.register_buffer(slow.total_elements * 4)
    g_fast = fast.register_buffer(fast.total_elements * 4)
    slow.push(g_slow, slow.pull(g_slow))  # slow: clock 1
    fast.push(g_fast, fast.pull(g_fast))  # fast joins at the slowest clock, 1
    fast.push(g_fast, fast.pull(g_fast))  # fast: clock 2, its next pull is held
    outcome = []

    def pull():
        try:
            outcome.append(("ok", fast.pull(g_fast)))
        except Exception as e:  # noqa: BLE001 (the test inspects what was raised)
            outcome.append(("error", e, time.monotonic()))

    thread = threading.Thread(target=pull)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not outcome, f"the fast worker's pull was not held: {outcome}"
    return slow, fast, g_slow, g_fast, thread, outcome


def test_interrupt_ends_a_call_waiting_on_another_thread(make_server):
    """Worker.interrupt() from another thread ends the call that waits (a
    held pull, withdrawn) with InterruptedError within a fraction of a
    second of its 30 s timeout; a call begun after it is not affected."""
    server = make_server(staleness_policy="wait", max_staleness=0)
    slow, fast, g_slow, g_fast, thread, outcome = _held_pull_in_a_thread(server)
    try:
        # The identity answers without waiting for the held call's lock.
        before = time.monotonic()
        assert f"worker {fast.worker_id}" in repr(fast) and not fast.closed
        assert fast.generation == slow.generation and fast.server_pid == server.process.pid
        assert time.monotonic() - before < 1.0
        # Asked again until it ends: an interrupt() that comes before the
        # pull began (a loaded machine) is not this call's.
        asked = time.monotonic()
        while thread.is_alive() and time.monotonic() - asked < 10:
            fast.interrupt()
            thread.join(0.1)
        assert not thread.is_alive()
        assert outcome[0][0] == "error" and isinstance(outcome[0][1], shmps.InterruptedError), outcome
        assert outcome[0][2] - asked < 5.0  # not the 30 s timeout
        before = time.monotonic()
        fast.ping()  # the lane is not stuck behind the withdrawn pull
        assert time.monotonic() - before < 2.0
        assert fast.stats().my_pulls_waited == 1
        fast.interrupt()  # none waits: nothing to end, and nothing left for the next call
        released = threading.Timer(0.3, lambda: slow.push(g_slow, slow.pull(g_slow)))  # slow: clock 2
        released.start()
        assert fast.pull(g_fast) == 4  # served after slow's push, not interrupted
        released.join()
    finally:
        fast.close()
        slow.close()


def _signalled_during_a_held_pull(server, on_signal, raises, match):
    """The main thread's pull, held under wait (max_staleness 0), while
    SIGALRM every 0.2 s runs on_signal(fast) (every 0.2 s: one that comes
    before the pull began is not its): the pull must raise `raises`
    (matching `match`) within 5 s, and the Worker answer a ping after."""
    workers = {}
    old = signal.signal(signal.SIGALRM, lambda signum, frame: on_signal(workers["fast"]))
    try:
        with shmps.connect(server.name) as slow, shmps.connect(server.name, timeout=30) as fast:
            workers["fast"] = fast
            g_slow = slow.register_buffer(slow.total_elements * 4)
            g_fast = fast.register_buffer(fast.total_elements * 4)
            slow.push(g_slow, slow.pull(g_slow))  # slow: clock 1
            fast.push(g_fast, fast.pull(g_fast))  # fast joins at the slowest clock, 1
            fast.push(g_fast, fast.pull(g_fast))  # fast: clock 2, its next pull is held
            signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
            start = time.monotonic()
            with pytest.raises(raises, match=match):
                fast.pull(g_fast)
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert time.monotonic() - start < 5.0
            fast.ping()  # usable after
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_interrupt_from_a_signal_handler_ends_the_main_threads_call(make_server):
    """A handler that calls interrupt() and returns (raises nothing) ends
    the main thread's waiting call with InterruptedError."""
    server = make_server(staleness_policy="wait", max_staleness=0)
    _signalled_during_a_held_pull(server, lambda fast: fast.interrupt(), shmps.InterruptedError,
                                  "interrupted while waiting")


def test_close_from_another_thread_ends_a_held_pull_instead_of_waiting(make_server):
    """close() while another thread's pull is held: close returns within a
    fraction of the call's 30 s timeout, the call raises InterruptedError,
    and the thread's next call raises "closed"."""
    server = make_server(staleness_policy="wait", max_staleness=0)
    slow, fast, g_slow, g_fast, thread, outcome = _held_pull_in_a_thread(server)
    try:
        before = time.monotonic()
        fast.close()
        assert time.monotonic() - before < 2.0
        thread.join(10)
        assert not thread.is_alive()
        # Interrupted where it waited (or, had it not begun yet, refused).
        assert outcome[0][0] == "error" and isinstance(outcome[0][1],
                                                       (shmps.InterruptedError, shmps.UnknownWorkerError)), outcome
        assert fast.closed
        with pytest.raises(shmps.UnknownWorkerError, match="closed"):
            fast.ping()
        assert slow.stats().workers_attached == 1  # close() detached it
    finally:
        fast.close()
        slow.close()


def test_a_signal_handler_calling_the_waiting_worker_is_refused_not_deadlocked(make_server):
    """A handler that uses the Worker whose call waits on the same thread
    would wait for itself: it gets InvalidArgumentError (repr and closed
    still answer), which ends the wait as any exception a handler raises."""
    server = make_server(staleness_policy="wait", max_staleness=0)
    seen = []

    def handler(fast):
        seen.append(repr(fast))
        fast.ping()

    _signalled_during_a_held_pull(server, handler, shmps.InvalidArgumentError,
                                  "from a signal handler while a call of this Worker")
    assert seen and "closed" not in seen[-1]


@pytest.mark.parametrize("call", ["ping", "close"])
def test_a_signal_handler_calling_the_worker_during_close_is_refused_not_deadlocked(make_server, call):
    """close() waits for a stopped server's detach answer with the
    interpreter's handlers running: a handler that calls the same Worker
    (ping(), close()) gets InvalidArgumentError instead of waiting for the
    lock close() holds on its thread, and close() returns at the detach
    bound. Run in a child, so that a deadlock fails the test."""
    server = make_server()
    script = f"""
import os, signal, time, shmps
w = shmps.connect({server.name!r}, timeout=1.0)
def handler(signum, frame):
    try:
        w.{call}()
        print("returned", flush=True)
    except shmps.InvalidArgumentError as e:
        print("refused", "from a signal handler" in str(e), flush=True)
signal.signal(signal.SIGALRM, handler)
os.kill({server.process.pid}, signal.SIGSTOP)
signal.setitimer(signal.ITIMER_REAL, 0.2)
start = time.monotonic()
w.close()
print("closed", w.closed, round(time.monotonic() - start, 1), flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait()
        server.process.send_signal(signal.SIGCONT)
    assert child.returncode == 0, out
    lines = out.splitlines()
    assert lines[0] == "refused True", out
    word, closed, seconds = lines[1].split()
    assert word == "closed" and closed == "True" and float(seconds) < 10, out


def test_a_close_refused_in_a_signal_handler_leaves_the_worker_as_it_was(make_server):
    """close() from a handler while a call of the Worker waits on the same
    thread is refused: the Worker stays open, with the buffers free_later()
    queued still queued for its next registration."""
    server = make_server()
    w = shmps.connect(server.name, timeout=2.0)
    try:
        buf = w.register_buffer(w.total_elements * 4)
        w.free_later(buf)
        old = signal.signal(signal.SIGALRM, lambda signum, frame: w.close())
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(shmps.InvalidArgumentError, match="close\\(\\) from a signal handler"):
                w.ping()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            os.kill(server.process.pid, signal.SIGCONT)
        assert not w.closed
        assert w._dropped == [buf]
        w.register_buffer(16)  # frees it
        assert w._dropped == []
    finally:
        w.close()


def test_ctrl_c_interrupts_a_blocking_call_of_a_python_worker(make_server):
    """SIGINT, as Ctrl-C sends it, raises KeyboardInterrupt in a worker
    blocked in a held pull within a fraction of a second, not at its
    timeout."""
    server = make_server(staleness_policy="wait", max_staleness=0)
    script = f"""
import sys, time, shmps
with shmps.connect({server.name!r}) as slow, shmps.connect({server.name!r}, timeout=60) as fast:
    g_slow = slow.register_buffer(slow.total_elements * 4)
    g_fast = fast.register_buffer(fast.total_elements * 4)
    slow.push(g_slow, slow.pull(g_slow))
    fast.push(g_fast, fast.pull(g_fast))  # joins at the slow one's clock
    fast.push(g_fast, fast.pull(g_fast))
    try:
        ticket = fast.pull_async(g_fast)  # held: fast is 1 clock ahead, max 0
        print("holding", flush=True)
        fast.wait(ticket)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic(), flush=True)
        sys.exit(0)
sys.exit(3)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        time.sleep(0.3)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=20)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, out
    word, when = out.split()
    assert word == "interrupted" and float(when) - sent < 1.0


def test_push_async_wait_and_stats_move(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        grad = w.register_buffer(w.total_elements * 4)
        s0 = w.stats()
        tickets = [w.push_async(grad, 0, tensor="w"), w.push_async(grad, 0, tensor="b")]
        assert [w.wait(t) for t in tickets] == [1, 2]
        w.pull(grad)
        w.ping()
        s1 = w.stats()
        assert (s0.gradients_applied, s1.gradients_applied) == (0, 2)
        assert s1.my_pushes_applied == 2 and s1.my_pulls == 1 and s1.version == 2
        assert s1.workers_attached == 1


def test_pull_async_after_push_async_sees_the_push(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        n = w.total_elements
        buf = w.register_buffer(2 * n * 4)
        view = np.asarray(buf).view(np.float32)
        w.pull(buf, offset=n * 4)
        before = view[n:].copy()
        view[:n] = 1.0
        push = w.push_async(buf, 0)
        pull = w.pull_async(buf, offset=n * 4)
        assert w.wait(pull) == 1  # the push ahead of it answers first and waits for its own wait()
        assert w.wait(push) == 1
        assert not np.array_equal(view[n:], before)
        assert w.pull(buf) == 1 and np.array_equal(view[:n], view[n:])


def test_init_sets_the_weights_once_before_any_push(make_server):
    server = make_server()
    a, b = shmps.connect(server.name), shmps.connect(server.name)
    buf_a = a.register_buffer(a.total_elements * 4)
    buf_b = b.register_buffer(b.total_elements * 4)
    np.asarray(buf_a).view(np.float32)[:] = np.arange(a.total_elements, dtype=np.float32)
    a.init(buf_a)
    with pytest.raises(shmps.InitRefusedError) as e:
        b.init(buf_b)
    assert f"already initialised by worker {a.worker_id}" in str(e.value)
    got, version = weights(b, buf_b)
    assert version == 0 and np.array_equal(got, np.arange(a.total_elements, dtype=np.float32))
    a.close()
    b.close()


def ticks_while_stopped(server, call):
    """call() with the server SIGSTOPped and another thread appending
    time.monotonic() every 5 ms, which it can only do while the GIL is
    free: the seconds call() took, and the ticks made meanwhile."""
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    t = threading.Thread(target=count)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        t.start()
        start = time.monotonic()
        call()
        waited = time.monotonic() - start
    finally:
        done.set()
        t.join()
        os.kill(server.process.pid, signal.SIGCONT)
    return waited, sum(1 for x in ticks if start < x < start + waited)


def test_a_push_to_a_stopped_server_times_out_while_other_threads_run(make_server):
    server = make_server()
    w = shmps.connect(server.name, timeout=0.5)
    grad = w.register_buffer(w.total_elements * 4)

    def push():
        with pytest.raises(shmps.TimeoutError):
            w.push(grad, 0)

    waited, ticks = ticks_while_stopped(server, push)
    assert waited >= 0.4
    # The GIL was released: the other thread kept ticking during the wait
    # (none if the call held the GIL; a loaded machine slows the ticks, so
    # a few prove it).
    assert ticks > 5
    assert isinstance(shmps.TimeoutError("x"), TimeoutError)
    w.close()


def test_a_worker_dropped_without_close_detaches_while_other_threads_run(make_server):
    """A Worker freed by the garbage collector detaches as close() does,
    waiting for the server's answer (here its timeout: the server is
    stopped) with the GIL released; the server frees its entry."""
    server = make_server()
    held = [shmps.connect(server.name, timeout=0.5)]
    held[0].register_buffer(held[0].total_elements * 4)
    observer = shmps.connect(server.name)
    assert observer.stats().workers_attached == 2
    waited, ticks = ticks_while_stopped(server, held.clear)  # the last reference: its detach times out
    assert waited >= 0.4
    assert ticks > 5  # as in the test above
    # The detach was sent: served once the server runs again.
    deadline = time.monotonic() + 10
    while observer.stats().workers_attached != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    observer.close()


@contextlib.contextmanager
def _stopped(server):
    """The server SIGSTOPped for the block."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def _interrupting(w):
    """w.interrupt() every 0.1 s until the block ends: the call it holds
    is interrupted whenever it begins (an interrupt before it began is not
    its)."""
    done = threading.Event()

    def keep_interrupting():
        while not done.wait(0.1):
            w.interrupt()

    interrupter = threading.Thread(target=keep_interrupting)
    interrupter.start()
    try:
        yield
    finally:
        done.set()
        interrupter.join()


def test_an_interrupted_wait_for_a_push_keeps_its_ticket_and_version(make_server):
    """interrupt() ends a wait for a push the (stopped) server has not
    answered; waiting again gets the answer, here a StaleError naming the
    version the push was computed against."""
    server = make_server(max_staleness=2)
    with shmps.connect(server.name, timeout=30) as w:
        grad = w.register_buffer(w.total_elements * 4)
        for v in range(10):
            w.push(grad, v)  # the server at version 10
        with _stopped(server):
            ticket = w.push_async(grad, 1)  # 9 versions behind
            with _interrupting(w), pytest.raises(shmps.InterruptedError):
                w.wait(ticket)
        with pytest.raises(shmps.StaleError) as e:
            w.wait(ticket)
        assert (e.value.worker_version, e.value.server_version) == (1, 10)


def test_push_outcomes_count_what_wait_took_per_registration(make_server):
    """The answers wait() took of a buffer's push_async()s: applied and
    stale, and the last one; a blocking push, an interrupted wait and
    another buffer's pushes are not among them. They answer after the
    Worker's close() and go with the registration."""
    server = make_server(max_staleness=1)
    w = shmps.connect(server.name, timeout=30)
    grad = w.register_buffer(w.total_elements * 4)
    other = w.register_buffer(w.total_elements * 4)
    assert w.push_outcomes(grad) == shmps.PushOutcomes()
    w.push(grad, 0)  # blocking: not counted
    first = w.push_async(grad, w.pull(grad))
    assert w.wait(first) == 2
    w.wait(w.push_async(other, 2))  # another buffer's
    with _stopped(server):
        stale = w.push_async(grad, 0)  # 3 versions behind
        with _interrupting(w), pytest.raises(shmps.InterruptedError):
            w.wait(stale)  # not answered: not counted
        assert w.push_outcomes(grad) == shmps.PushOutcomes(applied=1, stale=0, last_ticket=first, last_applied=True)
    with pytest.raises(shmps.StaleError):
        w.wait(stale)
    assert w.push_outcomes(grad) == shmps.PushOutcomes(applied=1, stale=1, last_ticket=stale, last_applied=False)
    assert w.push_outcomes(grad.id) == w.push_outcomes(grad)  # a bare id: the live registration's
    assert w.push_outcomes(other).applied == 1
    w.unregister_buffer(other)
    assert w.push_outcomes(other) == shmps.PushOutcomes()  # gone with it
    w.close()
    assert w.push_outcomes(grad).stale == 1  # the Buffer's registration, after close()


def test_a_forked_child_cannot_use_its_parents_worker_and_connects_its_own(make_server):
    server = make_server()
    w = shmps.connect(server.name)
    grad = w.register_buffer(w.total_elements * 4)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            w.ping()
            code = 1
        except shmps.InvalidArgumentError as e:
            code = 0 if "connect its own" in str(e) else 2
        except BaseException:
            code = 3
        try:
            with shmps.connect(server.name) as own:
                own.ping()
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    w.ping()  # the parent's session is untouched
    assert w.push(grad, w.pull(grad)) == 1
    w.close()


def test_a_worker_cannot_be_pickled(make_server):
    import pickle

    server = make_server()
    with shmps.connect(server.name) as w:
        with pytest.raises(TypeError, match="connect\\(\\) in the child"):
            pickle.dumps(w)


def test_reconnect_after_the_server_is_killed_and_restarted(make_server):
    server = make_server(init="uniform")
    w = shmps.connect(server.name, timeout=10, reconnect=True)
    grad = w.register_buffer(w.total_elements * 4)
    out = w.register_buffer(w.total_elements * 4)
    w.push(grad, w.pull(out))
    generation = w.generation
    again = restart(server)
    try:
        with pytest.raises(shmps.ServerRestartedError):
            w.push(grad, 1)  # computed against the dead server's weights
        version = w.pull(out)  # re-attached, buffers registered again under their ids
        assert version == 0 and w.generation != generation and w.server_pid == again.process.pid
        assert w.push(grad, version) == 1
    finally:
        w.close()
        again.stop()


def test_a_push_after_another_call_reattached_is_refused_until_a_pull(make_server):
    """The weights the gradient was computed on decide, not the call that
    re-attached: after a ping() found the restarted server, every push
    raises ServerRestartedError (nothing applied) until a pull."""
    server = make_server(init="uniform")
    w = shmps.connect(server.name, timeout=10, reconnect=True)
    grad = w.register_buffer(w.total_elements * 4)
    out = w.register_buffer(w.total_elements * 4)
    version = w.pull(out)
    again = restart(server)
    try:
        w.ping()  # re-attaches
        for _ in range(2):
            with pytest.raises(shmps.ServerRestartedError, match="pull again"):
                w.push(grad, version)  # computed against the dead server's weights
        assert w.stats().gradients_applied == 0
        version = w.pull(out)
        assert w.push(grad, version) == 1
    finally:
        w.close()
        again.stop()


def test_closing_host_buffers_against_a_stopped_server_warns_of_nothing(make_server):
    """A detach the stopped server does not answer leaves host buffers
    nothing to hold (the server writes its own mapping of their objects):
    close() warns only for device memory, and returns after the detach
    bound."""
    import warnings

    server = make_server()
    w = shmps.connect(server.name, timeout=1)
    w.register_buffer(w.total_elements * 4)
    with _stopped(server), warnings.catch_warnings():
        warnings.simplefilter("error")
        start = time.monotonic()
        w.close()
        assert time.monotonic() - start < 5


def test_close_from_another_thread_ends_the_call_in_flight(make_server):
    # close() while another thread is inside push/pull: that call ends
    # (answered, or interrupted where it waited), the next raises "closed";
    # nothing crashes (the Worker is not freed under the call).
    server = make_server(max_staleness=1000000)
    for _ in range(20):
        w = shmps.connect(server.name)
        grad, buf = w.register_buffer(w.total_elements * 4), w.register_buffer(w.total_elements * 4)
        errors = []

        def train():
            try:
                while True:
                    w.push(grad, w.pull(buf))
            except shmps.Error as e:
                errors.append(e)

        t = threading.Thread(target=train)
        t.start()
        time.sleep(0.01)
        w.close()
        t.join(10)
        assert not t.is_alive()
        assert (isinstance(errors[0], shmps.UnknownWorkerError) and "closed" in str(errors[0])
                or isinstance(errors[0], shmps.InterruptedError)), errors


def test_threads_sharing_a_worker_take_turns(make_server):
    server = make_server(max_staleness=1000000)
    w = shmps.connect(server.name)
    counts = [0] * 4

    def run(k):
        grad = w.register_buffer(w.total_elements * 4)
        for _ in range(200):
            w.push(grad, 0)
            counts[k] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert counts == [200] * 4
    assert w.stats().gradients_applied == 800
    w.close()


def test_a_buffer_of_another_worker_or_unregistered_is_refused(make_server):
    server = make_server(lr=1.0)
    w1, w2 = shmps.connect(server.name), shmps.connect(server.name)
    n = w1.total_elements
    buf2 = w2.register_buffer(n * 4)
    g1 = w1.register_buffer(n * 4)
    np.asarray(g1).view(np.float32)[:] = 1.0
    with pytest.raises(shmps.InvalidArgumentError, match="another Worker"):
        w2.push(g1, 0)
    w1.unregister_buffer(g1)
    h = w1.register_buffer(n * 4)  # may take g1's id
    np.asarray(h).view(np.float32)[:] = 5.0
    with pytest.raises(shmps.UnknownBufferError, match="unregistered"):
        w1.push(g1, 0)
    with pytest.raises(shmps.UnknownBufferError):
        w1.pull(g1)
    values, version = weights(w2, buf2)
    assert version == 0 and np.all(values == 0.0)  # nothing was applied
    assert w1.push(h, 0) == 1  # the live buffer still works
    w1.close()
    w2.close()


def test_timeouts_beyond_any_clock_wait_and_nan_is_refused(make_server):
    server = make_server(max_staleness=1000000)
    for timeout in (1e10, 9e15, float("inf")):
        w = shmps.connect(server.name, timeout=timeout)
        grad = w.register_buffer(w.total_elements * 4)
        os.kill(server.process.pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (server.process.pid, signal.SIGCONT)).start()
        start = time.monotonic()
        w.push(grad, 0)  # waits for the server instead of timing out at once
        assert time.monotonic() - start >= 0.4
        w.close()
    # 1e-4 s rounds up to 1 ms, not to 0, which no attach could meet; on a
    # loaded machine one attach may take longer than 1 ms: one of a few
    # tries gets through.
    for attempt in range(50):
        try:
            with shmps.connect(server.name, timeout=1e-4) as w:
                w.ping()
            break
        except shmps.TimeoutError:
            if attempt == 49:
                raise
    with pytest.raises(shmps.InvalidArgumentError, match="NaN"):
        shmps.connect(server.name, timeout=float("nan"))


def test_a_failed_register_buffer_leaves_no_object(make_server):
    server = make_server()
    w = shmps.connect(server.name)
    for nbytes in (2**63, 2**64 - 1):
        with pytest.raises(shmps.NoCapacityError):
            w.register_buffer(nbytes)
    assert glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*") == []
    w.close()


def test_a_fifo_at_the_name_is_refused_without_blocking():
    name = unique_name("fifo")
    path = f"/dev/shm/shmps.{name}"
    os.mkfifo(path, 0o600)
    try:
        start = time.monotonic()
        with pytest.raises(shmps.Error, match="not a regular file"):
            shmps.connect(name)
        assert time.monotonic() - start < 5
    finally:
        os.unlink(path)


def test_server_start_fails_when_another_server_has_the_name(make_server):
    first = make_server()
    second = shmps.Server(tensors=[("other", (3,))], name=first.name, optimizer="sgd")
    with pytest.raises(shmps.ServerNotRunningError, match="already serves"):
        second.start()
    with shmps.connect(first.name) as w:
        assert w.server_pid == first.process.pid
        assert [t.name for t in w.tensors] == [n for n, _ in SMALL]


def test_a_start_that_times_out_keeps_the_log_its_error_names(tmp_path):
    """A server slower to start than start_timeout: the TimeoutError names
    its log, which is still there to read (stop() removes the log of a
    server that exits 0 only after a start that succeeded)."""
    slow = tmp_path / "slow-server"
    # As the server does, it exits 0 on the SIGTERM of stop().
    slow.write_text("#!/bin/sh\necho slow start >&2\nsleep 5 &\ntrap 'kill $!; exit 0' TERM\nwait $!\n"
                    f"exec {shmps.server_binary()} \"$@\"\n")
    slow.chmod(0o755)
    server = shmps.Server(tensors=SMALL, name=unique_name("slowlog"), optimizer="sgd", binary=str(slow),
                          start_timeout=0.3)
    with pytest.raises(shmps.TimeoutError, match="its log: ") as e:
        server.start()
    assert server.process is None
    path = server.log_path
    assert path in str(e.value)
    with open(path) as f:
        assert "slow start" in f.read()
    os.unlink(path)


def test_starting_a_started_server_again_is_refused_and_orphans_nothing(make_server):
    server = make_server()
    pid = server.process.pid
    with pytest.raises(shmps.InvalidArgumentError, match="already started"):
        server.start()
    assert server.process is not None and server.process.pid == pid
    assert server.stop() == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _gone_within(pid, seconds):
    """Whether `pid` exits within `seconds`: gone, or a zombie (exited; its
    reaping is init's business, prompt or not)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_a_launcher_that_ends_without_stop_leaves_no_server(how):
    """shmps.Server passes --parent-pid: a script killed, or one that exits
    without stop(), takes its server with it (a clean stop: nothing left
    in /dev/shm)."""
    name = unique_name("orphan" + how)
    script = f"""
import os, sys, time, shmps
s = shmps.Server(tensors=[("w", (4,))], name={name!r}, optimizer="sgd", backend="host").start()
print(s.process.pid, flush=True)
if {how!r} == "exit":
    os._exit(3)
time.sleep(60)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(child.stdout.readline())
        if how == "SIGKILL":
            child.kill()
        child.wait(10)
        assert _gone_within(server_pid, 5), "the server outlived its launcher"
    finally:
        child.kill()
        child.wait()
    assert not glob.glob(f"/dev/shm/shmps.{name}*")


def test_stop_ends_a_stopped_server_at_once_and_removes_a_killed_ones_segment(make_server):
    """stop() of a SIGSTOPped server continues it, so it handles the
    SIGTERM (not a wait for the whole timeout, then SIGKILL); after a
    server that was killed, stop() removes the segment it left (no live
    server holds its lock)."""
    server = make_server()
    os.kill(server.process.pid, signal.SIGSTOP)
    start = time.monotonic()
    assert server.stop(timeout=30) == 0
    assert time.monotonic() - start < 5
    killed = make_server()
    killed.process.kill()
    killed.process.wait()
    assert os.path.exists(f"/dev/shm/shmps.{killed.name}")
    assert killed.stop() == -signal.SIGKILL
    assert not os.path.exists(f"/dev/shm/shmps.{killed.name}")


def test_ctrl_c_while_stop_waits_kills_reaps_and_cleans_up(make_server):
    """A KeyboardInterrupt in stop()'s wait (a second Ctrl-C while the
    server writes its final checkpoint, say) is raised, and leaves no
    server behind: killed, reaped, its segment removed."""
    server = make_server()
    p = server.process
    real_wait = p.wait

    def interrupted(timeout=None):
        if timeout is not None:  # stop()'s bounded wait, not the reaping one
            raise KeyboardInterrupt
        return real_wait()

    p.wait = interrupted
    with pytest.raises(KeyboardInterrupt):
        server.stop()
    assert server.process is None
    assert p.returncode == -signal.SIGKILL  # reaped
    assert not glob.glob(f"/dev/shm/shmps.{server.name}*")


def test_a_forked_child_leaving_the_with_block_lets_the_parents_server_be(make_server):
    with shmps.Server(tensors=SMALL, name=unique_name("forkwith"), optimizer="sgd", backend="host") as server:
        pid = os.fork()
        if pid == 0:
            try:
                server.stop()  # as leaving the block would: only lets go here
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        with shmps.connect(server.name) as w:
            assert w.server_pid == server.process.pid  # still serving
    assert server.process is None and not glob.glob(f"/dev/shm/shmps.{server.name}*")


def test_a_start_whose_probe_finds_the_server_full_is_a_start(monkeypatch, make_server):
    """Workers that waited for the server may take every slot before the
    launcher's probe: the answer NoCapacityError comes from a running
    server, not a failed start."""

    def full(*args, **kwargs):
        raise shmps.NoCapacityError("no_capacity: max workers reached")

    monkeypatch.setattr(shmps, "connect", full)
    server = shmps.Server(tensors=SMALL, name=unique_name("full"), optimizer="sgd", backend="host")
    server.start()
    try:
        assert server.process.poll() is None
    finally:
        assert server.stop() == 0
    # Full, but another's: the start waits for its own server, which fails
    # at the name another server holds.
    monkeypatch.undo()
    other = make_server(max_workers=1)
    holder = shmps.connect(other.name)
    try:
        with pytest.raises(shmps.ServerNotRunningError, match="already serves"):
            shmps.Server(tensors=SMALL, name=other.name, optimizer="sgd", backend="host").start()
    finally:
        holder.close()


def test_the_launchers_table_and_options_are_checked_before_a_start():
    specs = shmps._server._tensor_specs(tensors={"w": (2, 3), "b": (3,)})
    assert specs == ["w:2x3", "b:3"]
    with pytest.raises(TypeError, match="sequence of ints"):
        shmps._server._tensor_specs(tensors=[("w", (2.7,))])
    with pytest.raises(TypeError, match="optimizer must be a name"):
        shmps.Server(tensors=SMALL, optimizer=None)
    with pytest.raises(ValueError, match="holds ':'"):
        shmps.Server(tensors=[("a:b", (2,))])
    with pytest.raises(TypeError, match="name must be a str"):
        shmps.Server(tensors=[(1, (2,))])
    with pytest.raises(TypeError, match="name must be a str"):
        shmps.Server(tensors=SMALL, name=123)
    for bad in (float("nan"), 0, -1.0, "10"):
        with pytest.raises(ValueError, match="start_timeout must be a positive number"):
            shmps.Server(tensors=SMALL, start_timeout=bad)
    with pytest.raises(TypeError, match="reconnect must be True or False"):
        shmps.connect("x", reconnect="no")


def test_ctrl_c_and_ctrl_z_in_a_terminal_are_the_scripts_not_its_servers(tmp_path):
    """A terminal's Ctrl-Z and Ctrl-C signal the whole foreground process
    group, the server a shmps.Server started included. Stopped together,
    the script is not evicted as a stopped worker (the server's timeout
    here is 300 ms); the server ignores SIGINT, so the script's
    KeyboardInterrupt handler still finds it serving (it can take the last
    step's answer and pull), and leaving the with block stops it cleanly."""
    script = f"""
import sys, time, shmps
with shmps.Server(tensors=[("w", (4,))], name={unique_name("ctrlc")!r}, optimizer="sgd", backend="host",
                  stopped_worker_timeout_ms=300, log={str(tmp_path / "server.log")!r}) as server, \\
        shmps.connect(server.name) as w:
    g = w.register_buffer(16)
    try:
        print("ready", flush=True)
        while True:
            w.push(g, w.pull(g))
    except KeyboardInterrupt:
        print("interrupted; the server answers: version", w.pull(g), flush=True)
print("stopped", flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        # Ctrl-Z (SIGSTOP: a group without a terminal ignores SIGTSTP), fg.
        os.killpg(child.pid, signal.SIGSTOP)
        time.sleep(1.0)
        os.killpg(child.pid, signal.SIGCONT)
        time.sleep(0.3)
        os.killpg(child.pid, signal.SIGINT)  # Ctrl-C
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err
    assert "interrupted; the server answers: version" in out and out.rstrip().endswith("stopped"), out + err


def test_repr_answers_in_a_forked_child(make_server):
    server = make_server()
    w = shmps.connect(server.name)
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if "not usable in this process" in repr(w) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert f"worker {w.worker_id}" in repr(w)
    w.close()


def test_a_worker_alive_at_the_interpreters_exit_prints_no_leak_warning(make_server):
    """A Worker and Buffer still global at exit, while a daemon thread
    lives, are not a leak of the binding's: nanobind's warning is off."""
    server = make_server()
    script = f"""
import threading, time, shmps
w = shmps.connect({server.name!r})
b = w.register_buffer(16)
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert "leaked" not in child.stderr, child.stderr


def test_a_daemon_thread_inside_a_call_at_exit_does_not_abort_the_interpreter(make_server):
    """The interpreter's exit while a daemon thread's call returns: the
    thread would be ended inside the GIL's reacquisition (pthread_exit
    through a noexcept destructor: std::terminate, exit 134); it waits for
    the process's end instead, and the exit is clean."""
    server = make_server()
    script = f"""
import threading, time, shmps
w = shmps.connect({server.name!r})
def loop():
    while True:
        w.ping()
threading.Thread(target=loop, daemon=True).start()
time.sleep(0.3)
"""
    for _ in range(3):
        child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        assert "terminate" not in child.stderr, child.stderr


def test_ctrl_c_during_a_blocking_call_raises_keyboard_interrupt(make_server):
    server = make_server()
    w = shmps.connect(server.name, timeout=1)
    grad = w.register_buffer(w.total_elements * 4)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            w.push(grad, 0)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    w.close()


def test_arguments_out_of_range_name_themselves(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        grad = w.register_buffer(w.total_elements * 4)
        for call, what in ((lambda: w.push(grad, -1), "version"), (lambda: w.push(grad, 0, offset=2**64), "offset"),
                           (lambda: w.push(grad, 0, nbytes=-4), "nbytes"), (lambda: w.pull(grad, offset=-1), "offset"),
                           (lambda: w.register_buffer(-1), "nbytes"), (lambda: w.wait(-1), "ticket"),
                           (lambda: w.pull(grad, tensor=2**32), "tensor"), (lambda: w.pull(2**32), "buffer")):
            with pytest.raises(shmps.InvalidArgumentError, match=what):
                call()
        with pytest.raises(TypeError, match="version must be an int"):
            w.push(grad, 1.5)
        assert w.push(grad, np.int64(0)) == 1  # anything with __index__
        assert w.pull(grad, tensor=np.int64(0)) == 1  # a tensor id too
        with pytest.raises(TypeError, match="nbytes must be an int, not bool"):
            w.register_buffer(True)
        with pytest.raises(TypeError, match="shmps.Buffer"):
            w.pull(np.zeros(4))
        with pytest.raises(shmps.InvalidArgumentError, match="stream"):
            w.pull(grad, stream=-1)
        # Refused before any CUDA call: a negative ordinal, one past a C
        # int, or True (an int to Python, never meant as device 1).
        for device in (-1, 2**31, "cuda:2147483648"):
            with pytest.raises(shmps.InvalidArgumentError, match="device"):
                w.alloc_device_buffer(16, device)
        with pytest.raises(TypeError, match="not bool"):
            w.alloc_device_buffer(16, True)
        for device in ("cpu", "cuda:\u00b2"):
            with pytest.raises(ValueError, match="must be a CUDA device"):
                w.alloc_device_buffer(16, device)
        with pytest.raises(shmps.InvalidArgumentError, match="NUL"):
            shmps.connect(server.name, server_user="root\x00x")


def test_star_import_leaves_the_builtin_errors_alone():
    scope = {}
    exec("from shmps import *", scope)
    assert "TimeoutError" not in scope and "PermissionError" not in scope
    assert "StaleError" in scope and issubclass(shmps.TimeoutError, TimeoutError)


def test_server_refuses_a_shape_given_as_text_and_a_bad_name_with_its_own_message():
    with pytest.raises(TypeError, match="sequence of ints"):
        shmps.Server(tensors=[("a", "33")])
    with pytest.raises(shmps.ServerNotRunningError, match="name"):
        shmps.Server(tensors=[("a", (1,))], name="a/b").start()


def test_a_child_forked_during_a_call_gets_an_error_not_a_hang(make_server):
    # Another thread of the parent is inside a call (its lock held) when
    # the process forks: the child's use of the parent's Worker raises at
    # once, and closing it in the child neither blocks nor detaches.
    server = make_server()
    w = shmps.connect(server.name, timeout=2)
    grad = w.register_buffer(w.total_elements * 4)
    os.kill(server.process.pid, signal.SIGSTOP)
    def push():
        try:
            w.push(grad, 0)  # answered once the server goes on, or timed out
        except shmps.Error:
            pass

    t = threading.Thread(target=push)
    try:
        t.start()
        time.sleep(0.2)  # the push is waiting for the stopped server
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                w.ping()
            except shmps.InvalidArgumentError as e:
                code = 0 if "connect its own" in str(e) else 2
            except BaseException:
                code = 3
            if code == 0 and (w.closed or w.close() is not None):
                code = 4
            os._exit(code)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on its parent's Worker")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        t.join(10)
    w.ping()  # the parent's session is untouched
    w.close()


def test_pushes_in_flight_and_answered_whatever_names_the_buffer(make_server):
    """A push_async made with a bare id is in flight from its Buffer, and
    the reverse; answered() says whether its wait would return at once."""
    server = make_server()
    with shmps.connect(server.name, timeout=5) as w:
        g = w.register_buffer(w.total_elements * 4)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            by_id = w.push_async(g.id, 0)
            by_buffer = w.push_async(g, 0)
            assert w.pushes_in_flight(g) == [by_id, by_buffer]
            assert w.pushes_in_flight(g.id) == [by_id, by_buffer]
            assert not w.answered(by_id) and not w.answered(by_buffer)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert w.pull(g) == 2  # behind both: their answers came
        assert w.answered(by_id) and w.answered(by_buffer)
        assert w.wait(by_id) == 1 and w.wait(by_buffer) == 2
        assert w.pushes_in_flight(g) == []


def test_close_against_a_stopped_server_waits_at_most_the_detach_bound(make_server):
    """close() of a Worker whose calls wait without end (timeout=inf)
    against a SIGSTOPped server: its detach gives up after the detach bound
    (5 s) instead of waiting for good; the server serves it once it runs
    again. (A watchdog continues the server after 12 s, for the code that
    waited for it.)"""
    server = make_server()
    observer = shmps.connect(server.name)
    w = shmps.connect(server.name, timeout=float("inf"))
    w.pull(w.register_buffer(w.total_elements * 4))
    os.kill(server.process.pid, signal.SIGSTOP)
    watchdog = threading.Timer(12, os.kill, (server.process.pid, signal.SIGCONT))
    watchdog.start()
    try:
        start = time.monotonic()
        w.close()
        waited = time.monotonic() - start
    finally:
        watchdog.cancel()
        os.kill(server.process.pid, signal.SIGCONT)
    assert w.closed and 4.5 <= waited < 9, waited
    deadline = time.monotonic() + 10
    while observer.stats().workers_attached != 1:  # the detach, served now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    observer.close()


def test_ctrl_c_ends_a_close_that_waits_for_a_stopped_server(make_server):
    """SIGINT during close()'s detach raises KeyboardInterrupt at once; the
    Worker is closed all the same (the server serves the detach when it
    runs again, or reaps the entry with the process)."""
    server = make_server()
    w = shmps.connect(server.name, timeout=float("inf"))
    grad = w.register_buffer(w.total_elements * 4)
    w.pull(grad)
    os.kill(server.process.pid, signal.SIGSTOP)
    watchdog = threading.Timer(12, os.kill, (server.process.pid, signal.SIGCONT))
    watchdog.start()
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            w.close()
        waited = time.monotonic() - start
    finally:
        watchdog.cancel()
        os.kill(server.process.pid, signal.SIGCONT)
    assert waited < 2, waited
    assert w.closed
    with pytest.raises(shmps.UnknownWorkerError, match="closed"):
        w.ping()
    w.close()  # again: nothing left to do
    assert glob.glob(f"/dev/shm/shmps.{server.name}.p{os.getpid()}.*") == []  # its buffer object unlinked


def test_an_exit_against_a_stopped_server_waits_at_most_the_detach_bound(make_server):
    """A script whose Worker (timeout=inf) is still open at exit, its
    server SIGSTOPped: the exit's detach gives up after the detach bound
    (5 s) instead of holding the process for good."""
    server = make_server()
    script = f"""
import os, signal, shmps
w = shmps.connect({server.name!r}, timeout=float("inf"))
w.pull(w.register_buffer(w.total_elements * 4))
os.kill({server.process.pid}, signal.SIGSTOP)
print("stopped", flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "stopped"
        start = time.monotonic()
        try:
            child.wait(timeout=12)
        except subprocess.TimeoutExpired:
            pass
        waited = time.monotonic() - start
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        child.kill()
        child.wait()
    assert child.returncode == 0 and waited < 9, (child.returncode, waited)


def test_connect_refuses_arguments_of_the_wrong_type_by_name(make_server):
    server = make_server()
    for kwargs, what in (({"name": None}, "name must be a str"), ({"name": server.name.encode()}, "name must be a str"),
                         ({"timeout": "5"}, "timeout must be a number"), ({"timeout": True}, "timeout must be a number"),
                         ({"wait_for_server": "1"}, "wait_for_server must be a number"),
                         ({"server_user": None}, "server_user must be a str"),
                         ({"server_user": 0}, "server_user must be a str")):
        kwargs = {"name": server.name, **kwargs}
        with pytest.raises(TypeError, match=what):
            shmps.connect(**kwargs)
    with shmps.connect(server.name, timeout=5, wait_for_server=0) as w:  # ints are numbers
        w.ping()


def test_an_array_is_no_buffer_or_tensor_id_even_with_zero_dimensions(make_server):
    server = make_server()
    with shmps.connect(server.name) as w:
        grad = w.register_buffer(w.total_elements * 4)
        with pytest.raises(TypeError, match="shmps.Buffer"):
            w.pull(np.array(grad.id))
        with pytest.raises(TypeError, match="tensor must be"):
            w.pull(grad, tensor=np.array(0))
        assert w.pull(np.int64(grad.id)) == 0  # numpy's integers are ids


def test_repr_says_detached(make_server):
    server = make_server(tag="repr")  # a name without the words looked for
    w = shmps.connect(server.name)
    assert f", worker {w.worker_id}," in repr(w)
    w.detach()
    assert ", detached," in repr(w)
    w.close()
    assert ", closed," in repr(w)
