// The shmps server: owns the control segment, the weights and the optimizer
// state, and serves every worker lane from ONE consumer thread (run()).
// Thread safety: run() on one thread; request_stop() from any thread or a
// signal handler; the rest from the thread that created the Server.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "shmps/server/config.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

class Server {
 public:
  // Validates the config (optimizer hyperparameters, tensors, name),
  // allocates and initialises the weights, creates and publishes the
  // segment (state kRunning). Errors: kInvalidArgument naming the option,
  // kLayoutMismatch / kPermission / kNoCapacity from the segment, kIo for
  // an unreadable init file, kCuda when the CUDA backend cannot start.
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config);
  ~Server();  // removes the segment if run() did not

  // Serves requests until request_stop(); then fails every request still
  // queued with kShuttingDown, marks the segment kStopped and removes it.
  Status run();
  // Async-signal-safe.
  void request_stop() noexcept;

  // Copies the current weights (all tensors, flat fp32). Only while run()
  // is not running, or from tests that accept a racy copy.
  std::vector<float> weights() const;
  uint64_t version() const noexcept;

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// create() + run() with SIGINT/SIGTERM wired to request_stop(). Logs to
// stderr. Returns run()'s status.
Status run_server(const ServerConfig& config);

}  // namespace shmps::server
