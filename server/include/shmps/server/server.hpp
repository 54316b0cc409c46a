// The shmps server: owns the control segment, the weights and the optimizer
// state, and serves every worker lane from ONE consumer thread (run()).
// Thread safety: run() on one thread; request_stop() and request_reload()
// from any thread or a signal handler; the rest from the thread that created
// the Server.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shmps/server/config.hpp"
#include "shmps/server/federation.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

class Backend;  // server/src/backend.hpp: the memory that holds the weights

// The kind of a failed start (create()) or run (run_server()), for
// shmps-server's exit status: main() exits 2 for a configuration error,
// as for a bad option (the unit's RestartPreventExitStatus=2 does not
// restart it: a restart cannot fix it), and 1 for any other failure
// (restarted).
enum class FailureKind {
  kOther,
  // The configuration must change before a start can succeed: its
  // --checkpoint-dir is held by another live server (a copied config file
  // that kept it; restarted, the server would fail until that server
  // stopped, then take over that job's checkpoints), or is one the
  // server cannot use, which --check-config refuses too (not a
  // directory, not writable, on a kernel file system, a symbolic link
  // to nothing or a path under one).
  kConfiguration,
};

// What run() does besides serving, for a daemon under a service manager.
struct RunOptions {
  // Speak sd_notify (service.hpp) when $NOTIFY_SOCKET is set: READY=1 as
  // run() starts (the segment is live and the weights are loaded), STATUS=
  // every few seconds, WATCHDOG=1 from the consumer loop at half of
  // WatchdogSec, RELOADING=1 / READY=1 around a reload, STOPPING=1 when
  // the shutdown begins.
  bool notify_service_manager = false;
  // Called after request_reload() on a thread of run()'s own
  // ("shmps-reload"), one call at a time, while the server serves: the
  // configuration to switch to. It must not call the Server but for
  // request_stop() and request_reload(). The consumer thread then applies
  // it between two requests: what can change live (lr, lr_schedule,
  // max_staleness, staleness_policy, apply_threads, log level) is applied
  // and logged old -> new; any other difference is logged as needing a
  // restart. An error is logged and the running configuration kept.
  // Empty: a reload request is logged and ignored.
  std::function<Result<ServerConfig>()> reload;
};

class Server {
 public:
  // Validates the config (optimizer hyperparameters, tensors, name),
  // allocates and initialises the weights, creates and publishes the
  // segment (state kRunning). Errors: kInvalidArgument naming the option,
  // kLayoutMismatch / kPermission / kNoCapacity from the segment, kIo for
  // an unreadable init file, kCuda when the CUDA backend cannot start.
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config);
  // The same, and the kind of a failure in `kind` (kOther unless it is a
  // configuration error: FailureKind).
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config, FailureKind& kind);
  // The same on `backend` instead of the one config.backend selects (tests
  // inject a backend that defers completions, to exercise that path
  // without a GPU). Null: the configured one.
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config, std::unique_ptr<Backend> backend);
  // The same federated over `engine` (tests inject an in-process one)
  // instead of the one config.federation.kind names, with
  // config.federation's rounds. With rank_in_name the segment is
  // <name>.r<rank>.
  static Result<std::unique_ptr<Server>> create_federated(const ServerConfig& config,
                                                          std::unique_ptr<FederationEngine> engine);
  ~Server();  // removes the segment if run() did not

  // Serves requests until request_stop(); then fails every request still
  // queued with kShuttingDown, marks the segment kStopped and removes it.
  Status run(const RunOptions& options = {});
  // Async-signal-safe.
  void request_stop() noexcept;

  // For fuzzers and tests that drive the consumer by hand instead of run():
  // serves every lane whose doorbell is set, then sweeps every non-free
  // entry (the housekeeping pass: dead owners reaped, lanes polled). Never
  // sleeps. Not while run() is running.
  void poll_once();
  // Asks run() to reload its configuration (RunOptions::reload) within
  // ~10 ms. Async-signal-safe.
  void request_reload() noexcept;

  // Copies the current weights (all tensors, flat fp32). Only while run()
  // is not running, or from tests that accept a racy copy. Errors: the
  // device's.
  Result<std::vector<float>> weights() const;
  // Updates applied so far. Only while run() is not running (another
  // thread reads the shared stats block's version instead).
  uint64_t version() const noexcept;

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  // `kind`, when given, gets a failure's kind (it is left alone otherwise).
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config, std::unique_ptr<Backend> backend,
                                                std::unique_ptr<FederationEngine> engine, FailureKind* kind = nullptr);
  static Result<std::unique_ptr<Server>> create_unguarded(const ServerConfig& config, std::unique_ptr<Backend> backend,
                                                          std::unique_ptr<FederationEngine> engine, FailureKind* kind);
  std::unique_ptr<Impl> impl_;
};

// The daemon: create() + run() with sd_notify on, SIGINT/SIGTERM wired to
// request_stop() and SIGHUP to request_reload(). `argv` is the command line
// parse_options() turned into `config`: a reload parses it again, which
// re-reads its --config file (the command line still wins over the file).
// Empty argv: SIGHUP is logged and ignored. `parent_pid` (--parent-pid;
// 0: none): the server stops, as on SIGTERM, once that process is no
// longer its parent (checked every 100 ms), so that a launcher killed
// without stopping it leaves no server behind. The calling thread serves
// with SIGINT, SIGTERM and SIGHUP unblocked, also when it was started with
// them blocked (a launcher's sigwait() mask kept across its exec). SIGXFSZ
// is ignored, so that a checkpoint or segment past the file size limit
// fails with EFBIG, named in its error, rather than end the process; an
// embedder of create() and run() that sets a file size limit should do
// the same. Logs to stderr (log.hpp). Returns create()'s failure, or
// run()'s status, with the failure's kind.
struct ServerExit {
  Status status;
  FailureKind kind = FailureKind::kOther;  // of a failure
};
ServerExit run_server(const ServerConfig& config, const std::vector<std::string>& argv = {}, uint32_t parent_pid = 0);

// Makes SIGHUP harmless until run_server() wires it to request_reload():
// a SIGHUP from now on is remembered, and run_server() requests the reload
// once the server serves, instead of the default action ending the
// process. shmps-server's main() calls it first, before the options are
// parsed (a 1 MiB config file takes tens of ms). Installs a handler with
// sigaction(): call it from the main thread before starting others.
void remember_early_reload_signal() noexcept;

}  // namespace shmps::server
