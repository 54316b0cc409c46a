// shmps-bench: measures shmps across real processes and prints tables.
// The server is a shmps-server child process (found beside this program),
// every worker a fork()ed process; each figure is a median over repeats,
// printed beside a reference measured in the same run (docs/benchmarks.md).
// Single-threaded apart from the memcpy references split over threads
// (ParallelCopy), which run in forked children.
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/program_options/options_description.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <thread>

#include "bench_support.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"

namespace shmps::bench {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr float kGradValue = 1e-4f;  // finite, small: weights stay finite over any run

// ------------------------------------------------------------ plan

struct Plan {
  bool quick = false;
  uint32_t repeats = 5;
  std::string server_path;
  std::string log_path;
  std::vector<std::string> server_extra;  // --server-arg: appended to every server's command line
  uint32_t pings = 10000;                 // per process and repeat, back to back
  uint32_t spaced_pings = 1000;           // per repeat, one every kSpacedGapNs
  uint32_t warmup_pings = 1000;
  std::vector<uint64_t> push_sizes{1 * kMiB, 64 * kMiB, 256 * kMiB};
  uint64_t optimizer_bytes = 64 * kMiB;
  uint32_t optimizer_samples_per_repeat = 2;
  uint64_t memory_bytes = 256 * kMiB;
  uint32_t memory_pushes = 3;
  uint64_t tail_bytes = 16 * kMiB;
  std::vector<uint32_t> tail_workers{2, 4};
  uint32_t tail_pushes = 400;  // per setting and repeat, over all its workers
  uint64_t tail_compute_ns = 20'000'000;
};

// Pings spaced this far apart find the server asleep on its futex (it spins
// 50 us by default after the last request).
constexpr long kSpacedGapNs = 200'000;

std::string mib_text(uint64_t bytes) {
  if (bytes % kMiB == 0) return std::to_string(bytes / kMiB) + " MiB";
  return std::to_string(bytes / 1024) + " KiB";
}

double gbps(double bytes, double ns) { return bytes / ns; }  // bytes/ns == GB/s

// Elementwise a[i] / b[i] over the common length (paired samples).
std::vector<double> ratios(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) r.push_back(a[i] / b[i]);
  return r;
}

std::string verdict(bool met) { return met ? "MET" : "MISSED"; }

Result<std::unique_ptr<Worker>> connect(const std::string& name) {
  WorkerOptions options;
  options.name = name;
  options.timeout = std::chrono::seconds(60);
  return Worker::connect(options);
}

Status with_context(const Status& s, const std::string& what) { return {s.code(), what + ": " + s.message()}; }

void fill(void* data, uint64_t bytes, float value) {
  auto* f = static_cast<float*>(data);
  std::fill(f, f + bytes / sizeof(float), value);
}

// The server's command line for one fp32 tensor per entry of `elements`.
std::vector<std::string> server_args(const std::vector<uint64_t>& elements, const std::vector<std::string>& extra) {
  std::vector<std::string> args;
  for (size_t i = 0; i < elements.size(); ++i) {
    args.push_back("--tensor");
    args.push_back("t" + std::to_string(i) + ":" + std::to_string(elements[i]));
  }
  // One pusher per server: staleness is always 0; never reject on it.
  args.insert(args.end(), {"--lr", "0.001", "--max-staleness", "1000000"});
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

Result<std::unique_ptr<ServerProcess>> start_server(const Plan& plan, const std::string& tag,
                                                    const std::vector<uint64_t>& elements,
                                                    const std::vector<std::string>& extra) {
  std::vector<std::string> args = server_args(elements, extra);
  args.insert(args.end(), plan.server_extra.begin(), plan.server_extra.end());
  return start_server_process(plan.server_path, segment_name(tag), args, plan.log_path);
}

// ------------------------------------------------------------ section 1: round trip

struct LatencyStats {
  double p50, p99, p999;
};

// NaN (printed "-") for a percentile of fewer than min_samples_for(q) pings.
LatencyStats latency_stats(const std::vector<double>& ns) {
  return {reported_percentile(ns, 0.50), reported_percentile(ns, 0.99), reported_percentile(ns, 0.999)};
}

// The median over repeats of a per-repeat figure; NaN when a repeat has
// none (every repeat of a row has as many samples).
double median_of_repeats(const std::vector<double>& v) {
  return std::any_of(v.begin(), v.end(), [](double x) { return std::isnan(x); }) ? NAN : median(v);
}

// A 64-byte message each way over a Unix-domain socketpair.
Result<std::vector<double>> socket_pingpong(uint32_t warmup, uint32_t n) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    return Status{ErrorCode::kIo, std::string("socketpair: ") + std::strerror(errno)};
  const timeval timeout{10, 0};  // a dead peer fails the read instead of hanging it
  for (int fd : sv) ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  auto r = run_children(2, 1, n, [&](uint32_t k, StartBarrier& barrier, Series& out) -> Status {
    const int fd = sv[k];
    ::close(sv[1 - k]);
    char buf[64] = {};
    barrier.arrive_and_wait();
    for (uint32_t i = 0; i < warmup + n; ++i) {
      if (k == 1) {
        if (!read_full(fd, buf, sizeof buf) || ::write(fd, buf, sizeof buf) != sizeof buf)
          return {ErrorCode::kIo, "socket ping-pong: echo failed"};
        continue;
      }
      const uint64_t t0 = now_ns();
      if (::write(fd, buf, sizeof buf) != sizeof buf || !read_full(fd, buf, sizeof buf))
        return {ErrorCode::kIo, "socket ping-pong: exchange failed"};
      const uint64_t t1 = now_ns();
      if (i >= warmup) out[0].push_back(static_cast<double>(t1 - t0));
    }
    return Status::Ok();
  });
  ::close(sv[0]);
  ::close(sv[1]);
  if (!r.ok()) return r.status();
  return std::move(r.value()[0]);
}

// `procs` worker processes ping concurrently, n pings each (gap_ns apart
// when > 0); returns all round trips, merged.
Result<std::vector<double>> worker_pings(const std::string& name, uint32_t procs, uint32_t warmup, uint32_t n,
                                         long gap_ns) {
  auto r = run_children(procs, 1, n, [&](uint32_t, StartBarrier& barrier, Series& out) -> Status {
    auto w = connect(name);
    if (!w.ok()) return with_context(w.status(), "connect");
    for (uint32_t i = 0; i < warmup; ++i)
      if (Status s = (*w)->ping(); !s.ok()) return with_context(s, "ping");
    barrier.arrive_and_wait();
    out[0].reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      if (gap_ns > 0) sleep_ns(gap_ns);
      const uint64_t t0 = now_ns();
      const Status s = (*w)->ping();
      const uint64_t t1 = now_ns();
      if (!s.ok()) return with_context(s, "ping");
      out[0].push_back(static_cast<double>(t1 - t0));
    }
    return Status::Ok();
  });
  if (!r.ok()) return r.status();
  return std::move(r.value()[0]);
}

// Processes that each keep a CPU busy until destroyed (SIGKILL): the
// gradient computation of other workers on a shared host.
Result<std::vector<Child>> start_bystanders(uint32_t n) {
  std::vector<Child> procs;
  for (uint32_t i = 0; i < n; ++i) {
    auto c = fork_child([] {
      const uint64_t end = now_ns() + 600'000'000'000ull;  // a safety net only
      volatile uint64_t x = 0;
      while (now_ns() < end)
        for (int k = 0; k < 100000; ++k) x = x + 1;
      return 0;
    });
    if (!c.ok()) return c.status();
    procs.push_back(std::move(c).value());
  }
  return procs;
}

Result<std::vector<double>> worker_pings_crowded(const std::string& name, uint32_t bystanders, uint32_t warmup,
                                                 uint32_t n) {
  auto busy = start_bystanders(bystanders);
  if (!busy.ok()) return busy.status();
  return worker_pings(name, 1, warmup, n, 0);  // ~busy kills them
}

struct LatencyRow {
  std::string label;
  std::string regime;
  uint32_t procs = 1;
  size_t samples = 0;
  std::vector<double> p50, p99, p999, vs_spin, vs_socket;  // one per repeat
};

Status section_round_trip(const Plan& plan, Csv& csv, std::vector<Goal>& goals) {
  std::printf("\n[1] Round trip of an empty request: Worker::ping(), submit -> completion, ns\n");
  std::printf("    server: a shmps-server process with a 1024-parameter tensor; workers: fork()ed processes\n");
  auto spin_server = start_server(plan, "ping", {1024}, {});
  if (!spin_server.ok()) return spin_server.status();
  auto futex_server = start_server(plan, "ping0", {1024}, {"--idle-spin-us", "0"});
  if (!futex_server.ok()) return futex_server.status();
  const std::string spin_name = (*spin_server)->name(), futex_name = (*futex_server)->name();
  // Busy processes that leave one CPU to the server and the pinging worker.
  const uint32_t bystanders = usable_cpus() - 1;
  const std::string crowd = std::to_string(bystanders) + " busy bystander" + (bystanders == 1 ? "" : "s");

  std::vector<LatencyRow> rows{
      {"ref: shm spin ping-pong", "-", 2, 0, {}, {}, {}, {}, {}},
      {"ref: unix socket, 64 B", "-", 2, 0, {}, {}, {}, {}, {}},
      {"ping, 1 worker", "spin (back to back)", 1, 0, {}, {}, {}, {}, {}},
      {"ping, 2 workers", "spin (back to back)", 2, 0, {}, {}, {}, {}, {}},
      {"ping, 4 workers", "spin (back to back)", 4, 0, {}, {}, {}, {}, {}},
      {"ping, 1 worker, 200 us apart", "futex (server asleep)", 1, 0, {}, {}, {}, {}, {}},
      {"ping, 1 worker, --idle-spin-us 0", "no idle spin", 1, 0, {}, {}, {}, {}, {}},
      {"ping, 1 worker, " + crowd, "spin (back to back)", 1, 0, {}, {}, {}, {}, {}},
      {"ping, 1 worker, " + crowd + ", --idle-spin-us 0", "no idle spin", 1, 0, {}, {}, {}, {}, {}},
  };
  if (bystanders == 0) rows.resize(rows.size() - 2);  // one CPU: nothing to crowd out
  for (uint32_t rep = 0; rep < plan.repeats; ++rep) {
    std::vector<Result<std::vector<double>>> runs;
    runs.push_back(spin_pingpong(plan.warmup_pings, plan.pings));
    runs.push_back(socket_pingpong(plan.warmup_pings, plan.pings));
    runs.push_back(worker_pings(spin_name, 1, plan.warmup_pings, plan.pings, 0));
    runs.push_back(worker_pings(spin_name, 2, plan.warmup_pings, plan.pings, 0));
    runs.push_back(worker_pings(spin_name, 4, plan.warmup_pings, plan.pings, 0));
    runs.push_back(worker_pings(spin_name, 1, plan.warmup_pings / 10, plan.spaced_pings, kSpacedGapNs));
    runs.push_back(worker_pings(futex_name, 1, plan.warmup_pings, plan.pings, 0));
    if (bystanders > 0) {
      runs.push_back(worker_pings_crowded(spin_name, bystanders, plan.warmup_pings / 10, plan.pings / 10));
      runs.push_back(worker_pings_crowded(futex_name, bystanders, plan.warmup_pings / 10, plan.pings / 10));
    }
    double spin_p50 = NAN, socket_p50 = NAN;
    for (size_t i = 0; i < runs.size(); ++i) {
      if (!runs[i].ok()) return with_context(runs[i].status(), rows[i].label);
      const LatencyStats st = latency_stats(*runs[i]);
      if (i == 0) spin_p50 = st.p50;
      if (i == 1) socket_p50 = st.p50;
      rows[i].samples += runs[i]->size();
      rows[i].p50.push_back(st.p50);
      rows[i].p99.push_back(st.p99);
      rows[i].p999.push_back(st.p999);
      rows[i].vs_spin.push_back(st.p50 / spin_p50);
      rows[i].vs_socket.push_back(st.p50 / socket_p50);
    }
  }

  Table table("round_trip", {"case", "server regime", "procs", "samples", "p50 ns", "p99 ns", "p999 ns", "p50/spin ref",
                             "p50/socket ref"});
  for (const LatencyRow& r : rows)
    table.add_row({r.label, r.regime, std::to_string(r.procs), std::to_string(r.samples),
                   fixed(median_of_repeats(r.p50), 0), fixed(median_of_repeats(r.p99), 0),
                   fixed(median_of_repeats(r.p999), 0), fixed(median_of_repeats(r.vs_spin), 2),
                   fixed(median_of_repeats(r.vs_socket), 2)});
  table.print(stdout);
  table.to_csv(csv);
  std::printf(
      "    p50/p99/p999: median over %u repeats of each repeat's percentile (all processes' pings merged);\n"
      "    \"-\": a repeat has fewer than 10 / (1 - q) pings for it (p99: 1,000, p99.9: 10,000), so that\n"
      "    10 at least lie above it; ratios: median of each repeat's p50 / that repeat's reference p50.\n"
      "    Regimes: spin = back-to-back pings reach the server while it polls (it spins\n"
      "    --idle-spin-us 50, the default, after its last request); futex = pings 200 us apart\n"
      "    find it asleep on its futex, so each pays a wake-up; no idle spin = a server that\n"
      "    sleeps as soon as its lanes are empty (back-to-back pings often beat it to sleep).\n"
      "    Busy bystanders: processes that keep all CPUs but one busy (other workers computing),\n"
      "    so the server and the pinging worker share one CPU.\n",
      plan.repeats);
  const double p50 = median_of_repeats(rows[2].p50);
  goals.push_back({"[1] ping p50 <= 5000 ns, one worker (spin regime)", fixed(p50, 0) + " ns", p50 <= 5000.0});
  return Status::Ok();
}

// ------------------------------------------------------------ section 2: push + apply throughput

Status section_push_throughput(const Plan& plan, Csv& csv, std::vector<Goal>& goals) {
  std::printf("\n[2] Push + apply throughput, SGD (lr 0.001, no momentum), fp32 gradients, GB/s of gradient\n");
  std::printf(
      "    one server process (one tensor per size, NaN check on), one worker process pushing\n"
      "    from its registered buffer; reference: memcpy of the same bytes from that buffer in the\n"
      "    worker process, interleaved with the pushes (one thread)\n");
  std::vector<uint64_t> elements;
  uint64_t max_bytes = 0;
  for (uint64_t b : plan.push_sizes) {
    elements.push_back(b / sizeof(float));
    max_bytes = std::max(max_bytes, b);
  }
  auto server = start_server(plan, "push", elements, {"--optimizer", "sgd"});
  if (!server.ok()) return server.status();
  const std::string name = (*server)->name();
  const size_t sizes = plan.push_sizes.size();
  // Samples per repeat: enough to reach ~64 MiB of pushes per size and repeat.
  std::vector<uint32_t> per_repeat;
  for (uint64_t b : plan.push_sizes)
    per_repeat.push_back(static_cast<uint32_t>(std::clamp<uint64_t>(64 * kMiB / b, 1, 40)));
  const uint32_t max_per_size = *std::max_element(per_repeat.begin(), per_repeat.end()) * plan.repeats;

  const auto body = [&](uint32_t, StartBarrier& barrier, Series& out) -> Status {
    auto w = connect(name);
    if (!w.ok()) return with_context(w.status(), "connect");
    auto buf = (*w)->register_buffer(max_bytes);
    if (!buf.ok()) return with_context(buf.status(), "register_buffer");
    fill(buf->data, max_bytes, kGradValue);
    std::vector<char> dst(max_bytes, 1);
    uint64_t version = 0;
    const auto push = [&](size_t j) -> Status {
      auto v = (*w)->push(static_cast<uint32_t>(j), buf->id, 0, plan.push_sizes[j], Dtype::kF32, version);
      if (!v.ok()) return with_context(v.status(), "push of " + mib_text(plan.push_sizes[j]));
      version = *v;
      return Status::Ok();
    };
    for (size_t j = 0; j < sizes; ++j) {  // warm-up: the server maps and faults the pages in
      if (Status s = push(j); !s.ok()) return s;
      std::memcpy(dst.data(), buf->data, plan.push_sizes[j]);
    }
    barrier.arrive_and_wait();
    for (uint32_t rep = 0; rep < plan.repeats; ++rep) {
      for (size_t j = 0; j < sizes; ++j) {
        for (uint32_t q = 0; q < per_repeat[j]; ++q) {
          uint64_t t0 = now_ns();
          std::memcpy(dst.data(), buf->data, plan.push_sizes[j]);
          escape(dst.data());
          uint64_t t1 = now_ns();
          out[2 * j].push_back(static_cast<double>(t1 - t0));
          t0 = now_ns();
          if (Status s = push(j); !s.ok()) return s;
          t1 = now_ns();
          out[2 * j + 1].push_back(static_cast<double>(t1 - t0));
        }
      }
    }
    return Status::Ok();
  };
  auto quiet = run_children(1, static_cast<uint32_t>(2 * sizes), max_per_size, body);
  if (!quiet.ok()) return quiet.status();
  // Again with all CPUs but one kept busy, as other workers computing would.
  const uint32_t bystanders = usable_cpus() - 1;
  Result<Series> crowded = Series{};
  if (bystanders > 0) {
    auto busy = start_bystanders(bystanders);
    if (!busy.ok()) return busy.status();
    crowded = run_children(1, static_cast<uint32_t>(2 * sizes), max_per_size, body);
    if (!crowded.ok()) return crowded.status();
  }

  Table table("push_throughput",
              {"gradient", "pushes", "push+apply ms", "push+apply GB/s", "memcpy GB/s", "push/memcpy"});
  const auto add_rows = [&](const Series& r, const std::string& suffix, bool goal) {
    for (size_t j = 0; j < sizes; ++j) {
      const auto& copy = r[2 * j];
      const auto& push = r[2 * j + 1];
      const double bytes = static_cast<double>(plan.push_sizes[j]);
      const double push_ns = median(push), copy_ns = median(copy);
      const double ratio = median(ratios(copy, push));
      table.add_row({mib_text(plan.push_sizes[j]) + suffix, std::to_string(push.size()), fixed(push_ns / 1e6, 3),
                     fixed(gbps(bytes, push_ns), 2), fixed(gbps(bytes, copy_ns), 2), fixed(100 * ratio, 1) + "%"});
      if (goal && (j == 1 || sizes == 1))
        goals.push_back({"[2] SGD push+apply at " + mib_text(plan.push_sizes[j]) + " >= 50% of memcpy",
                         fixed(100 * ratio, 1) + "%", ratio >= 0.5});
    }
  };
  add_rows(*quiet, "", true);
  if (bystanders > 0)
    add_rows(*crowded, ", " + std::to_string(bystanders) + " busy bystander" + (bystanders == 1 ? "" : "s"), false);
  table.print(stdout);
  table.to_csv(csv);
  std::printf(
      "    medians over all pushes; push/memcpy: median over pairs (a memcpy, then a push) of\n"
      "    memcpy time / push time. The push time is the worker's whole call (submit, server\n"
      "    NaN check + apply split over all cores by OpenMP, completion). Busy bystanders:\n"
      "    processes keeping all CPUs but one busy during the second set of rows.\n");
  return Status::Ok();
}

// ------------------------------------------------------------ section 3: optimizer traffic

struct OptimizerCase {
  std::string label;
  std::vector<std::string> args;
  double bytes_per_param;  // the traffic the update itself must do per fp32 parameter
};

const std::vector<OptimizerCase>& optimizer_cases() {
  static const std::vector<OptimizerCase> cases{
      {"sgd", {"--optimizer", "sgd"}, 12},
      {"sgd+momentum 0.9", {"--optimizer", "sgd", "--momentum", "0.9"}, 20},
      {"adam", {"--optimizer", "adam"}, 28},
  };
  return cases;
}

// In one process, no protocol: apply_cpu on private arrays, paired with
// memcpy. Series: 0 memcpy (one thread), 1 memcpy on usable_cpus() threads
// (apply_cpu's OpenMP team: the bound of the applies), 2 sgd, 3 all_finite
// + sgd, 4 sgd+momentum, 5 adam, 6 all_finite alone.
Result<Series> in_process_apply(const Plan& plan, uint32_t samples) {
  const uint64_t bytes = plan.optimizer_bytes;
  const uint64_t n = bytes / sizeof(float);
  return run_children(1, 7, samples, [&](uint32_t, StartBarrier& barrier, Series& out) -> Status {
    std::vector<float> grad(n, kGradValue), dst(n, 1.0f), w(n, 0.0f), buf(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
    kernels::OptimizerConfig sgd, momentum, adam;
    sgd.lr = momentum.lr = adam.lr = 0.001f;
    momentum.momentum = 0.9f;
    adam.kind = kernels::OptimizerKind::kAdam;
    kernels::TensorState plain, with_buf, with_moments;
    plain.weights = with_buf.weights = with_moments.weights = w.data();
    plain.n = with_buf.n = with_moments.n = n;
    with_buf.state[0] = buf.data();
    with_moments.state[0] = m.data();
    with_moments.state[1] = v.data();
    uint64_t step_sgd = 0, step_momentum = 0, step_adam = 0;
    bool finite = true;
    ParallelCopy copy_all(usable_cpus());  // its threads start here, untimed
    const std::vector<std::function<void()>> ops{
        [&] { std::memcpy(dst.data(), grad.data(), bytes); },
        [&] { copy_all(dst.data(), grad.data(), bytes); },
        [&] { kernels::apply_cpu(sgd, plain, grad.data(), kernels::GradDtype::kF32, ++step_sgd); },
        [&] {
          finite &= kernels::all_finite_cpu(grad.data(), kernels::GradDtype::kF32, n);
          kernels::apply_cpu(sgd, plain, grad.data(), kernels::GradDtype::kF32, ++step_sgd);
        },
        [&] { kernels::apply_cpu(momentum, with_buf, grad.data(), kernels::GradDtype::kF32, ++step_momentum); },
        [&] { kernels::apply_cpu(adam, with_moments, grad.data(), kernels::GradDtype::kF32, ++step_adam); },
        [&] { finite &= kernels::all_finite_cpu(grad.data(), kernels::GradDtype::kF32, n); },
    };
    for (const auto& op : ops) op();  // warm-up: OpenMP threads, page faults
    barrier.arrive_and_wait();
    for (uint32_t q = 0; q < samples; ++q) {
      for (size_t k = 0; k < ops.size(); ++k) {
        const uint64_t t0 = now_ns();
        ops[k]();
        escape(dst.data());
        escape(w.data());
        const uint64_t t1 = now_ns();
        out[k].push_back(static_cast<double>(t1 - t0));
      }
    }
    if (!finite) return {ErrorCode::kInternal, "all_finite_cpu reported a non-finite gradient of finite values"};
    return Status::Ok();
  });
}

// Through the protocol: one server process with `args`, one worker process
// pushing the whole tensor from its registered buffer, paired with a memcpy
// of that buffer on usable_cpus() threads (the server's apply threads: no
// worker computes here). One server at a time: an idle server's OpenMP threads
// spinning after their last update would slow the next one down.
// Series: 0 memcpy, 1 push. *server_cpu_ns: the server process's CPU time
// (all threads) over the measured loop, per push.
Result<Series> via_server(const Plan& plan, const std::string& tag, const std::vector<std::string>& args,
                          uint32_t samples, double* server_cpu_ns) {
  const uint64_t bytes = plan.optimizer_bytes;
  auto server = start_server(plan, tag, {bytes / sizeof(float)}, args);
  if (!server.ok()) return server.status();
  const std::string name = (*server)->name();
  const pid_t pid = (*server)->pid();
  uint64_t cpu_before = 0;
  auto r = run_children(
      1, 2, samples,
      [&](uint32_t, StartBarrier& barrier, Series& out) -> Status {
        auto w = connect(name);
        if (!w.ok()) return with_context(w.status(), "connect");
        auto b = (*w)->register_buffer(bytes);
        if (!b.ok()) return with_context(b.status(), "register_buffer");
        fill(b->data, bytes, kGradValue);
        std::vector<char> dst(bytes, 1);
        ParallelCopy copy_all(usable_cpus());
        uint64_t version = 0;
        const auto push = [&]() -> Status {
          auto v = (*w)->push(0, b->id, 0, bytes, Dtype::kF32, version);
          if (!v.ok()) return with_context(v.status(), "push");
          version = *v;
          return Status::Ok();
        };
        if (Status s = push(); !s.ok()) return s;  // warm-up: the server maps and faults the pages in
        copy_all(dst.data(), b->data, bytes);      // and the copy's destination
        barrier.arrive_and_wait();
        for (uint32_t q = 0; q < samples; ++q) {
          uint64_t t0 = now_ns();
          copy_all(dst.data(), b->data, bytes);
          escape(dst.data());
          uint64_t t1 = now_ns();
          out[0].push_back(static_cast<double>(t1 - t0));
          t0 = now_ns();
          if (Status s = push(); !s.ok()) return s;
          t1 = now_ns();
          out[1].push_back(static_cast<double>(t1 - t0));
        }
        return Status::Ok();
      },
      [&] { cpu_before = process_cpu_ns(pid); });
  if (r.ok()) *server_cpu_ns = static_cast<double>(process_cpu_ns(pid) - cpu_before) / samples;
  return r;
}

Status section_optimizers(const Plan& plan, Csv& csv, std::vector<Goal>& goals) {
  const uint64_t bytes = plan.optimizer_bytes;
  const double params = static_cast<double>(bytes / sizeof(float));
  std::printf("\n[3] Optimizer throughput at %s (%.0f fp32 parameters): traffic GB/s = B/param * params / time\n",
              mib_text(bytes).c_str(), params);
  std::printf(
      "    B/param is what the update must move: sgd reads w, g and writes w (12); momentum adds\n"
      "    the buffer (20); adam adds two moments (28). Reference: memcpy traffic = 2 * bytes / time\n"
      "    (read + write) of a memcpy split over %u threads (the CPUs usable, as many as the apply's),\n"
      "    measured in the same process, interleaved.\n",
      usable_cpus());
  const uint32_t samples = plan.repeats * plan.optimizer_samples_per_repeat;
  auto local = in_process_apply(plan, samples);
  if (!local.ok()) return with_context(local.status(), "in-process apply_cpu");
  std::vector<Series> remote;      // per case: NaN check, then --allow-nonfinite
  std::vector<double> server_cpu;  // ns per push, same order
  for (size_t c = 0; c < optimizer_cases().size(); ++c) {
    for (bool allow : {false, true}) {
      std::vector<std::string> args = optimizer_cases()[c].args;
      if (allow) args.push_back("--allow-nonfinite");
      double cpu = 0;
      auto r = via_server(plan, "opt" + std::to_string(remote.size()), args, samples, &cpu);
      if (!r.ok()) return with_context(r.status(), "pushes, " + optimizer_cases()[c].label);
      remote.push_back(std::move(r).value());
      server_cpu.push_back(cpu);
    }
  }

  Table table("optimizers",
              {"optimizer", "path", "B/param", "ms", "traffic GB/s", "memcpy traffic GB/s", "traffic/memcpy",
               "server CPU ms/push"},
              2);
  const auto row = [&](const std::string& label, const std::string& path, double bpp, double moved,
                       const std::vector<double>& ns, const std::vector<double>& copy_ns, double cpu_ns = NAN) {
    const double traffic = gbps(bpp * params, median(ns));
    const double ref = gbps(2.0 * static_cast<double>(bytes), median(copy_ns));
    // Per pair: (bpp * params / t) / (2 * bytes / t_copy).
    std::vector<double> r = ratios(copy_ns, ns);
    for (double& x : r) x *= bpp * params / (2.0 * static_cast<double>(bytes));
    const std::string bpp_text = moved == bpp ? fixed(bpp, 0) : fixed(bpp, 0) + " (+" + fixed(moved - bpp, 0) + ")";
    table.add_row({label, path, bpp_text, fixed(median(ns) / 1e6, 2), fixed(traffic, 2), fixed(ref, 2),
                   fixed(100 * median(r), 1) + "%", fixed(cpu_ns / 1e6, 2)});
    return median(r);
  };
  const Series& l = *local;
  const std::string threads = std::to_string(usable_cpus()) + (usable_cpus() == 1 ? " thread" : " threads");
  row("memcpy (reference)", "in-process, " + threads + ", over 1 thread", 8, 8, l[1], l[0]);
  row("all_finite_cpu", "in-process", 4, 4, l[6], l[1]);
  const size_t local_series[] = {2, 4, 5};
  for (size_t c = 0; c < optimizer_cases().size(); ++c) {
    const OptimizerCase& oc = optimizer_cases()[c];
    const double alone =
        row(oc.label, "apply_cpu in-process", oc.bytes_per_param, oc.bytes_per_param, l[local_series[c]], l[1]);
    // Issue goal 3: the apply itself at >= 90% of its memory-traffic bound,
    // a copy on as many threads as the apply.
    goals.push_back({"[3] " + oc.label + " apply itself (in-process) >= 90% of memcpy traffic",
                     fixed(100 * alone, 1) + "%", alone >= 0.9});
    if (c == 0) row(oc.label, "all_finite+apply in-process", 12, 16, l[3], l[1]);
    const Series& checked_run = remote[2 * c];
    const Series& allowed_run = remote[2 * c + 1];
    const double checked = row(oc.label, "server, NaN check", oc.bytes_per_param, oc.bytes_per_param + 4,
                               checked_run[1], checked_run[0], server_cpu[2 * c]);
    const double allowed = row(oc.label, "server, --allow-nonfinite", oc.bytes_per_param, oc.bytes_per_param,
                               allowed_run[1], allowed_run[0], server_cpu[2 * c + 1]);
    goals.push_back({"[3] " + oc.label + " via server (NaN check) >= 90% of memcpy traffic",
                     fixed(100 * checked, 1) + "%", checked >= 0.9});
    goals.push_back({"[3] " + oc.label + " via server (--allow-nonfinite) >= 90% of memcpy traffic",
                     fixed(100 * allowed, 1) + "%", allowed >= 0.9});
  }
  table.print(stdout);
  table.to_csv(csv);
  std::printf(
      "    %u samples per row. B/param (+4): the NaN/Inf check reads g once more before the update.\n"
      "    The memcpy row: its traffic on %u threads over the one-thread memcpy's. The other in-process\n"
      "    rows use that %u-thread memcpy as reference; each server row its own worker process's\n"
      "    %u-thread memcpy of its registered buffer, paired with the pushes (one server process at\n"
      "    a time). apply_cpu and the server split the update over all cores (OpenMP), the copies\n"
      "    over as many threads, started before timing. Server CPU ms/push: CPU time of all the\n"
      "    server's threads over the measured pushes (/proc/<pid>/task/*/schedstat), per push;\n"
      "    compare with ms x cores.\n",
      samples, usable_cpus(), usable_cpus(), usable_cpus());
  return Status::Ok();
}

// ------------------------------------------------------------ section 4: memory

Status section_memory(const Plan& plan, Csv& csv) {
  const uint64_t bytes = plan.memory_bytes;
  const uint64_t params = bytes / sizeof(float);
  const double p = static_cast<double>(params);
  std::printf("\n[4] Server resident memory, one tensor of %s (%llu fp32 parameters), MiB\n", mib_text(bytes).c_str(),
              static_cast<unsigned long long>(params));
  std::printf(
      "    formula = constant + segment + weights (4 B/param) + optimizer state (0/4/8 B/param);\n"
      "    constant = VmHWM of a server with a 1024-parameter tensor after one ping, minus its segment.\n"
      "    While a worker's buffer is mapped, the server's RSS also counts the gradient pages it\n"
      "    read (4 B/param, shared with the worker): \"+ gradient\" adds them.\n"
      "    Measured (server process, /proc/<pid>/status): VmHWM right after start (no worker yet),\n"
      "    VmRSS after %u pushes with the buffer still mapped, and the final VmHWM (peak).\n",
      plan.memory_pushes);

  // The constant: a tiny server's peak.
  uint64_t constant = 0;
  {
    auto tiny = start_server(plan, "memtiny", {1024}, {});
    if (!tiny.ok()) return tiny.status();
    auto pinged = worker_pings((*tiny)->name(), 1, 1, 1, 0);
    if (!pinged.ok()) return pinged.status();
    const uint64_t hwm = proc_status_bytes((*tiny)->pid(), "VmHWM");
    const uint64_t seg = segment_bytes((*tiny)->name());
    constant = hwm > seg ? hwm - seg : 0;
  }

  Table table("memory", {"optimizer", "state B/param", "segment", "formula", "+ gradient", "VmHWM at start",
                         "VmRSS loaded", "VmHWM peak", "peak/(formula+gradient)", "start - formula B/param"});
  const auto mib = [](double b) { return fixed(b / static_cast<double>(kMiB), 1); };
  const double state_bpp[] = {0, 4, 8};
  for (size_t c = 0; c < optimizer_cases().size(); ++c) {
    const OptimizerCase& oc = optimizer_cases()[c];
    auto server = start_server(plan, "mem" + std::to_string(c), {params}, oc.args);
    if (!server.ok()) return server.status();
    const pid_t pid = (*server)->pid();
    const std::string name = (*server)->name();
    const auto hwm_start = static_cast<double>(proc_status_bytes(pid, "VmHWM"));
    const auto seg = static_cast<double>(segment_bytes(name));
    double rss_loaded = 0;
    auto r = run_children(
        1, 1, 1,
        [&](uint32_t, StartBarrier& barrier, Series&) -> Status {
          auto w = connect(name);
          if (!w.ok()) return with_context(w.status(), "connect");
          auto b = (*w)->register_buffer(bytes);
          if (!b.ok()) return with_context(b.status(), "register_buffer");
          fill(b->data, bytes, kGradValue);
          uint64_t version = 0;
          for (uint32_t i = 0; i < plan.memory_pushes; ++i) {
            auto v = (*w)->push(0, b->id, 0, bytes, Dtype::kF32, version);
            if (!v.ok()) return with_context(v.status(), "push");
            version = *v;
          }
          barrier.arrive_and_wait();  // the parent reads the server's RSS now
          return Status::Ok();
        },
        [&] { rss_loaded = static_cast<double>(proc_status_bytes(pid, "VmRSS")); });
    if (!r.ok()) return r.status();
    const auto hwm = static_cast<double>(proc_status_bytes(pid, "VmHWM"));
    const double formula = static_cast<double>(constant) + seg + p * (4 + state_bpp[c]);
    const double loaded = formula + 4 * p;
    table.add_row({oc.label, fixed(state_bpp[c], 0), mib(seg), mib(formula), mib(loaded), mib(hwm_start),
                   mib(rss_loaded), mib(hwm), fixed(hwm / loaded, 2), fixed((hwm_start - formula) / p, 1)});
  }
  table.print(stdout);
  table.to_csv(csv);
  std::printf("    constant %s MiB.\n", mib(static_cast<double>(constant)).c_str());
  return Status::Ok();
}

// ------------------------------------------------------------ section 5: tail latency under load

// One server setting of section 5 with its samples, pooled over repeats.
struct TailRow {
  uint32_t workers = 0;
  std::string setting;
  std::unique_ptr<ServerProcess> server;
  std::vector<double> push_ns;       // every push of every repeat
  std::vector<double> pushes_per_s;  // one per repeat: all its workers' pushes / its wall time
  int apply_top_bucket = -1;         // the highest apply_ns bucket the timed pushes reached; -1: none
};

using ApplyBuckets = std::array<uint64_t, shm::kHistogramBuckets>;

// The bucket counts of server `name`'s apply_ns histogram (all 0 when its
// segment cannot be opened): snapshots before and after the timed pushes
// tell which buckets those pushes filled, the warm-ups left out.
ApplyBuckets apply_buckets(const std::string& name) {
  ApplyBuckets out{};
  if (auto seg = shm::Segment::open(name, /*read_only=*/true); seg.ok())
    for (uint32_t b = 0; b < shm::kHistogramBuckets; ++b)
      // relaxed: a statistic the server alone writes; read after the pushes completed.
      out[b] = (*seg)->stats().apply_ns.buckets[b].load(std::memory_order_relaxed);
  return out;
}

// "4.19-8.39": the range in ms of apply_ns bucket b ([2^(b-1), 2^b) ns).
std::string bucket_ms(int b) {
  if (b < 0) return "-";
  if (b == 0) return "0";
  const double low = std::ldexp(1.0, b - 1) / 1e6, high = std::ldexp(1.0, b) / 1e6;
  const int digits = high < 0.1 ? 3 : 2;
  return fixed(low, digits) + "-" + fixed(high, digits);
}

Status section_tail_latency(const Plan& plan, Csv& csv) {
  const uint32_t cpus = usable_cpus();
  std::printf("\n[5] Tail latency of %s pushes under load: workers computing on the server's CPUs\n",
              mib_text(plan.tail_bytes).c_str());
  std::printf(
      "    each worker process loops: %.1f ms of computation (a spin on the clock: its CPU is busy,\n"
      "    as a forward + backward pass keeps it), then one push (SGD, NaN check on); workers, server\n"
      "    and its apply threads share all %u CPUs. Server settings, one server each, interleaved per\n"
      "    repeat: --apply-threads auto (the default), %u (every CPU: what OpenMP alone would use), 1.\n",
      static_cast<double>(plan.tail_compute_ns) / 1e6, cpus, cpus);
  // As the systemd unit and shmps-train run it (docs/benchmarks.md, "OpenMP").
  const bool set_policy = std::getenv("OMP_WAIT_POLICY") == nullptr;
  if (set_policy) ::setenv("OMP_WAIT_POLICY", "passive", 1);
  std::printf("    servers run with OMP_WAIT_POLICY=%s\n", std::getenv("OMP_WAIT_POLICY"));
  std::vector<TailRow> rows;
  for (uint32_t w : plan.tail_workers)
    for (const std::string& setting : {std::string("auto"), std::to_string(cpus), std::string("1")}) {
      if (setting == "1" && cpus == 1) continue;  // the same as every CPU
      auto server = start_server(plan, "tail" + std::to_string(rows.size()), {plan.tail_bytes / sizeof(float)},
                                 {"--optimizer", "sgd", "--apply-threads", setting});
      if (!server.ok()) return server.status();
      rows.push_back({w, setting, std::move(server).value(), {}, {}});
    }
  if (set_policy) ::unsetenv("OMP_WAIT_POLICY");

  for (uint32_t rep = 0; rep < plan.repeats; ++rep) {
    for (TailRow& row : rows) {
      const std::string name = row.server->name();
      const uint32_t per_worker = std::max(1u, plan.tail_pushes / row.workers);
      const auto body = [&](uint32_t, StartBarrier& barrier, Series& out) -> Status {
        auto w = connect(name);
        if (!w.ok()) return with_context(w.status(), "connect");
        auto buf = (*w)->register_buffer(plan.tail_bytes);
        if (!buf.ok()) return with_context(buf.status(), "register_buffer");
        fill(buf->data, plan.tail_bytes, kGradValue);
        uint64_t version = 0;
        const auto push = [&]() -> Status {
          auto v = (*w)->push(0, buf->id, 0, plan.tail_bytes, Dtype::kF32, version);
          if (!v.ok()) return with_context(v.status(), "push");
          version = *v;
          return Status::Ok();
        };
        if (Status s = push(); !s.ok()) return s;  // warm-up: the server maps and faults the pages in
        barrier.arrive_and_wait();
        const uint64_t start = now_ns();
        for (uint32_t q = 0; q < per_worker; ++q) {
          const uint64_t until = now_ns() + plan.tail_compute_ns;
          while (now_ns() < until) {
          }
          const uint64_t t0 = now_ns();
          if (Status s = push(); !s.ok()) return s;
          out[0].push_back(static_cast<double>(now_ns() - t0));
        }
        out[1].push_back(static_cast<double>(now_ns() - start));
        return Status::Ok();
      };
      // Once every worker's warm-up push is applied (they wait at the
      // barrier), and again after the run.
      ApplyBuckets before{};
      auto r = run_children(row.workers, 2, per_worker, body, [&] { before = apply_buckets(name); });
      if (!r.ok())
        return with_context(r.status(), std::to_string(row.workers) + " workers, --apply-threads " + row.setting);
      const ApplyBuckets after = apply_buckets(name);
      for (int b = 0; b < static_cast<int>(shm::kHistogramBuckets); ++b)
        if (after[b] > before[b]) row.apply_top_bucket = std::max(row.apply_top_bucket, b);
      row.push_ns.insert(row.push_ns.end(), (*r)[0].begin(), (*r)[0].end());
      const double wall_ns = *std::max_element((*r)[1].begin(), (*r)[1].end());
      row.pushes_per_s.push_back(static_cast<double>((*r)[0].size()) / (wall_ns / 1e9));
    }
  }

  Table table("tail_latency",
              {"workers", "--apply-threads", "pushes", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "over 10 ms",
               "apply max ms (bucket)", "pushes/s", "pushes/s vs " + std::to_string(cpus)},
              2);
  for (const TailRow& row : rows) {
    const auto ms = [&](double q) { return fixed(reported_percentile(row.push_ns, q) / 1e6, 2); };
    const auto over = std::count_if(row.push_ns.begin(), row.push_ns.end(), [](double ns) { return ns > 10e6; });
    double reference = NAN;  // the same workers' every-CPU setting
    for (const TailRow& other : rows)
      if (other.workers == row.workers && other.setting == std::to_string(cpus)) reference = median(other.pushes_per_s);
    table.add_row({std::to_string(row.workers), row.setting, std::to_string(row.push_ns.size()), ms(0.5), ms(0.99),
                   ms(0.999), ms(1.0), std::to_string(over), bucket_ms(row.apply_top_bucket),
                   fixed(median(row.pushes_per_s), 0), fixed(median(row.pushes_per_s) / reference, 2)});
  }
  table.print(stdout);
  table.to_csv(csv);
  std::printf(
      "    percentiles and max: over every push of every repeat (%u repeats), the worker's whole call\n"
      "    (its wait behind other workers' pushes included); \"-\": fewer than 10 / (1 - q) pushes for\n"
      "    it (p99: 1,000, p99.9: 10,000), so that 10 at least lie above it; apply max: the log2 bucket\n"
      "    of the server's apply_ns histogram that holds the longest NaN check + update of the timed\n"
      "    pushes (bucket counts read after the warm-up pushes and after each repeat);\n"
      "    pushes/s: median over repeats of all the workers' pushes / the repeat's wall time (the job's\n"
      "    step rate); vs %u: over the same workers' rate with every CPU as apply threads.\n",
      plan.repeats, cpus);
  return Status::Ok();
}

// ------------------------------------------------------------ main

int run(int argc, char** argv) {
  Plan plan;
  CommonOptions common;
  namespace po = boost::program_options;
  po::options_description own("Section 5");
  double tail_compute_ms = -1;
  uint32_t tail_pushes = 0;
  own.add_options()("tail-compute-ms", po::value(&tail_compute_ms),
                    "each worker's computation between pushes (default 20, --quick 1)")(
      "tail-pushes", po::value(&tail_pushes), "pushes per server setting and repeat (default 400, --quick 40)");
  if (auto exit_code =
          parse_command_line(argc, argv, "shmps-bench",
                             "shmps-bench: round trip, push+apply and optimizer throughput, server memory\n"
                             "and tail latency under load, measured across real processes; prints tables\n"
                             "(docs/benchmarks.md). --repeats: default 5, --quick 2",
                             5, own, common))
    return *exit_code;
  if (tail_compute_ms != -1 && !(tail_compute_ms >= 0 && tail_compute_ms <= 10'000)) {
    std::fprintf(stderr, "shmps-bench: --tail-compute-ms must be in 0..10000, got %g\n", tail_compute_ms);
    return 2;
  }
  plan.quick = common.quick;
  plan.repeats = common.repeats_given ? common.repeats : (plan.quick ? 2 : 5);
  plan.server_path = common.server_path;
  plan.server_extra = common.server_args;
  const std::string& csv_path = common.csv_path;
  const std::vector<int>& sections = common.sections;
  if (plan.quick) {
    plan.pings = 300;
    plan.spaced_pings = 20;
    plan.warmup_pings = 50;
    plan.push_sizes = {256 * 1024, 1 * kMiB, 4 * kMiB};
    plan.optimizer_bytes = 1 * kMiB;
    plan.memory_bytes = 4 * kMiB;
    plan.memory_pushes = 2;
    plan.tail_bytes = 4 * kMiB;
    plan.tail_pushes = 40;
    plan.tail_compute_ns = 1'000'000;
  }
  if (tail_compute_ms >= 0) plan.tail_compute_ns = static_cast<uint64_t>(tail_compute_ms * 1e6);
  if (tail_pushes != 0) plan.tail_pushes = tail_pushes;
  plan.log_path =
      (std::filesystem::temp_directory_path() / ("shmps-bench-" + std::to_string(::getpid()) + ".log")).string();
  // From here SIGINT and SIGTERM stop the run through its cleanup: the
  // section's servers stopped and their segments removed as it returns,
  // then the buffer objects of the workers killed (main()).
  catch_stop_signals();

  std::printf("shmps-bench%s: %u CPUs usable (of %u online), %u repeats, server %s\n", plan.quick ? " --quick" : "",
              usable_cpus(), std::thread::hardware_concurrency(), plan.repeats, plan.server_path.c_str());
  if (!plan.server_extra.empty()) {
    std::string extra;
    for (const std::string& a : plan.server_extra) extra += " " + a;
    std::printf("Extra server arguments:%s\n", extra.c_str());
  }
  std::printf("Every figure is a median over repeats; reference columns were measured in this run.\n");
  std::printf("Load average (1 min) at start: %s\n", load_average().c_str());
  print_omp_environment(stdout);
  std::fflush(stdout);

  Csv csv;
  std::vector<Goal> goals;
  for (int s : sections) {
    Status st;
    switch (s) {
      case 1:
        st = section_round_trip(plan, csv, goals);
        break;
      case 2:
        st = section_push_throughput(plan, csv, goals);
        break;
      case 3:
        st = section_optimizers(plan, csv, goals);
        break;
      case 4:
        st = section_memory(plan, csv);
        break;
      case 5:
        st = section_tail_latency(plan, csv);
        break;
    }
    std::fflush(stdout);
    if (stop_signal() != 0) {
      std::fprintf(stderr, "shmps-bench: section %d: %s: its servers stopped\n", s, stopped_status().message().c_str());
      std::error_code ec;
      std::filesystem::remove(plan.log_path, ec);
      return 1;
    }
    if (!st.ok()) {
      std::fprintf(stderr, "shmps-bench: section %d: %s (server log: %s)\n", s, st.to_string().c_str(),
                   plan.log_path.c_str());
      return 1;
    }
  }

  std::printf("\nLoad average (1 min) at end: %s (other processes sharing the CPUs distort every figure)\n",
              load_average().c_str());
  if (!goals.empty()) {
    std::printf("\nGoals%s\n", plan.quick ? " (--quick sizes: not the goals' sizes; informational only)" : "");
    Table table("goals", {"goal", "measured", "verdict"});
    for (const Goal& g : goals) table.add_row({g.text, g.measured, verdict(g.met)});
    table.print(stdout);
    table.to_csv(csv);
  }
  if (!csv_path.empty()) {
    if (Status s = csv.write(csv_path); !s.ok()) {
      std::fprintf(stderr, "shmps-bench: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  std::error_code ec;
  std::filesystem::remove(plan.log_path, ec);
  return 0;
}

}  // namespace
}  // namespace shmps::bench

int main(int argc, char** argv) {
  int rc = 1;
  try {
    rc = shmps::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmps-bench: fatal: %s\n", e.what());
  }
  // The buffer objects of measuring children killed (a failure, a stop
  // signal): they could not unregister, and their servers are gone.
  shmps::bench::remove_orphan_buffers();
  shmps::bench::die_of_stop_signal();
  return rc;
}
