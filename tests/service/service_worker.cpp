// shmps-service-worker: the worker that systemd_unit.sh runs inside its
// container, as a user of group shmps, against the packaged server. It
// links only shmps::worker (static) and the C++ runtime, so it runs on a
// bare Debian root that has the package's dependencies.
//   shmps-service-worker attach NAME
//       connect, pull, push a gradient of 1.0 everywhere, pull again; prints
//       the worker id, the versions and the step of weight 0 (-lr under SGD)
//   shmps-service-worker train NAME SECONDS
//       with WorkerOptions::reconnect: pull and push (about 1000 a second)
//       until it has pushed 100 times to a server of another generation than
//       the first (the server restarted under it), or SECONDS pass
// One line per event on stdout. Exit 0 on success, 1 on an error or the
// deadline, 2 on bad usage. Single-threaded.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shmps/worker.hpp"

namespace {

using shmps::ErrorCode;

// A connected worker with one gradient and one weights buffer, each holding
// every tensor (fp32).
struct Session {
  std::unique_ptr<shmps::Worker> worker;
  shmps::Buffer grad;
  shmps::Buffer weights;
};

bool open_session(const std::string& name, bool reconnect, Session* s) {
  shmps::WorkerOptions options;
  options.name = name;
  options.reconnect = reconnect;
  // Long enough to outlast a restart: watchdog timeout, RestartSec, start.
  options.timeout = std::chrono::seconds(reconnect ? 30 : 5);
  auto worker = shmps::Worker::connect(options);
  if (!worker.ok()) {
    std::printf("connect failed: %s\n", worker.status().to_string().c_str());
    return false;
  }
  s->worker = std::move(worker).value();
  const size_t bytes = s->worker->total_elements() * sizeof(float);
  auto grad = s->worker->register_buffer(bytes);
  auto weights = grad.ok() ? s->worker->register_buffer(bytes) : grad;
  if (!grad.ok() || !weights.ok()) {
    std::printf("register_buffer failed: %s\n", (grad.ok() ? weights : grad).status().to_string().c_str());
    return false;
  }
  s->grad = grad.value();
  s->weights = weights.value();
  float* g = static_cast<float*>(s->grad.data);
  for (uint64_t i = 0; i < s->worker->total_elements(); ++i) g[i] = 1.0f;
  std::printf("attached: worker %u, generation %llu, %llu elements\n", s->worker->worker_id(),
              static_cast<unsigned long long>(s->worker->generation()),
              static_cast<unsigned long long>(s->worker->total_elements()));
  return true;
}

shmps::Result<uint64_t> push_all(Session& s, uint64_t version) {
  return s.worker->push(shmps::kAllTensors, s.grad.id, 0, s.grad.size, shmps::Dtype::kF32, version);
}

int attach(const std::string& name) {
  Session s;
  if (!open_session(name, false, &s)) return 1;
  const float* w = static_cast<const float*>(s.weights.data);
  auto before = s.worker->pull(shmps::kAllTensors, s.weights.id, 0);
  if (!before.ok()) {
    std::printf("pull failed: %s\n", before.status().to_string().c_str());
    return 1;
  }
  const float w0 = w[0];
  auto pushed = push_all(s, before.value());
  if (!pushed.ok()) {
    std::printf("push failed: %s\n", pushed.status().to_string().c_str());
    return 1;
  }
  auto after = s.worker->pull(shmps::kAllTensors, s.weights.id, 0);
  if (!after.ok()) {
    std::printf("pull failed: %s\n", after.status().to_string().c_str());
    return 1;
  }
  std::printf("pushed: version %llu -> %llu, step %.4g\n", static_cast<unsigned long long>(before.value()),
              static_cast<unsigned long long>(after.value()), static_cast<double>(w[0] - w0));
  return 0;
}

// Errors a reconnecting worker rides out while its server restarts.
bool transient(ErrorCode code) {
  return code == ErrorCode::kServerRestarted || code == ErrorCode::kServerNotRunning || code == ErrorCode::kTimeout ||
         code == ErrorCode::kShuttingDown || code == ErrorCode::kStale;
}

int train(const std::string& name, int seconds) {
  constexpr uint64_t kPushesAfterRestart = 100;
  Session s;
  if (!open_session(name, true, &s)) return 1;
  const uint64_t first_generation = s.worker->generation();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  uint64_t pushes = 0, pushes_since_restart = 0;
  ErrorCode last_error = ErrorCode::kOk;
  while (std::chrono::steady_clock::now() < deadline) {
    auto version = s.worker->pull(shmps::kAllTensors, s.weights.id, 0);
    auto pushed = version.ok() ? push_all(s, version.value()) : shmps::Result<uint64_t>(version.status());
    if (!pushed.ok()) {
      const ErrorCode code = pushed.status().code();
      if (code != last_error)
        std::printf("after %llu pushes: %s\n", static_cast<unsigned long long>(pushes),
                    pushed.status().to_string().c_str());
      last_error = code;
      if (!transient(code)) return 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    last_error = ErrorCode::kOk;
    ++pushes;
    if (s.worker->generation() != first_generation && ++pushes_since_restart == kPushesAfterRestart) {
      std::printf("continued: %llu pushes to generation %llu (first %llu), version %llu, %llu pushes in all\n",
                  static_cast<unsigned long long>(pushes_since_restart),
                  static_cast<unsigned long long>(s.worker->generation()),
                  static_cast<unsigned long long>(first_generation), static_cast<unsigned long long>(pushed.value()),
                  static_cast<unsigned long long>(pushes));
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("deadline: %llu pushes, %llu since a restart, generation %llu (first %llu)\n",
              static_cast<unsigned long long>(pushes), static_cast<unsigned long long>(pushes_since_restart),
              static_cast<unsigned long long>(s.worker->generation()),
              static_cast<unsigned long long>(first_generation));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // the test reads the lines while it runs
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 2 && args[0] == "attach") return attach(args[1]);
  if (args.size() == 3 && args[0] == "train") return train(args[1], std::atoi(args[2].c_str()));
  std::fprintf(stderr, "usage: shmps-service-worker attach NAME | train NAME SECONDS\n");
  return 2;
}
