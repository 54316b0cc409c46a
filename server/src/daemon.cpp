// run_server(): shmps-server as a daemon. create() + run() with sd_notify
// on, SIGINT/SIGTERM wired to request_stop() and SIGHUP to
// request_reload(), the reload parsing the command line again.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "service.hpp"
#include "shmps/server/log.hpp"
#include "shmps/server/options.hpp"
#include "shmps/server/server.hpp"
#include "threads.hpp"

namespace shmps::server {
namespace {

// The running server, for the signal handlers. SYNC(signal_server): the
// release store after create() pairs with the handlers' acquire load, so a
// handler that sees the pointer sees the whole Server.
std::atomic<Server*> g_server{nullptr};
extern "C" void on_stop_signal(int) {
  if (Server* s = g_server.load(std::memory_order_acquire)) s->request_stop();  // SYNC(signal_server)
}
extern "C" void on_reload_signal(int) {
  if (Server* s = g_server.load(std::memory_order_acquire)) s->request_reload();  // SYNC(signal_server)
}
// A SIGHUP during start-up (the file may have changed since it was read):
// remembered, and the reload requested once the server runs. Relaxed: the
// flag carries nothing else, and is read on the thread that installs the
// handler after it.
std::atomic<bool> g_reload_at_start{false};
extern "C" void on_early_reload_signal(int) { g_reload_at_start.store(true, std::memory_order_relaxed); }

void handle(int signo, void (*handler)(int)) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  ::sigaction(signo, &sa, nullptr);
}

// Stops the server once `parent_pid` is no longer its parent (the parent
// died: the process was re-parented), polling every 100 ms; a process
// event would need a pidfd per parent, and the poll costs nothing.
class ParentWatch {
 public:
  ParentWatch(Server& server, uint32_t parent_pid) {
    if (parent_pid == 0) return;
    // The stop and reload signals go to the thread that handles them.
    thread_ = start_helper_thread([this, &server, parent_pid] {
      std::unique_lock lock(mu_);
      while (!done_) {
        if (static_cast<uint32_t>(::getppid()) != parent_pid) {
          log::info("the parent process (pid " + std::to_string(parent_pid) + ", --parent-pid) is gone: stopping");
          server.request_stop();
          return;
        }
        wake_.wait_for(lock, std::chrono::milliseconds(100));
      }
    });
  }
  ~ParentWatch() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }
  ParentWatch(const ParentWatch&) = delete;
  ParentWatch& operator=(const ParentWatch&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable wake_;
  bool done_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace

void remember_early_reload_signal() noexcept { handle(SIGHUP, on_early_reload_signal); }

ServerExit run_server(const ServerConfig& config, const std::vector<std::string>& argv, uint32_t parent_pid) {
  if (parent_pid != 0 && static_cast<uint32_t>(::getppid()) != parent_pid)
    return {{ErrorCode::kInvalidArgument, "--parent-pid " + std::to_string(parent_pid) +
                                              " is not this server's parent (pid " + std::to_string(::getppid()) +
                                              "): the launcher is gone already, or the pid is wrong"},
            FailureKind::kConfiguration};
  // A server with a --parent-pid is a job's child (shmps-train, Python's
  // shmps.Server), not the service: a NOTIFY_SOCKET in its environment is
  // its launcher's unit's, which its READY=1, STOPPING=1 and keep-alives
  // must not drive.
  const bool service = parent_pid == 0;
  // A SIGHUP during start-up must not kill the daemon (its default action):
  // it is remembered, and the reload runs once the server serves. SIGINT and
  // SIGTERM are held back (blocked, so pending) while the server is created:
  // one that arrives after the segment is published but before the handlers
  // are in place would otherwise kill the process without its shutdown
  // (a stop right after start-up, as systemd may send). Unblocked once the
  // handlers are installed, a pending one stops run() at once, cleanly.
  // Threads started meanwhile (the checkpoint writer) keep them blocked,
  // so they are delivered to this thread. Unblocked then whatever mask
  // this thread had: a launcher that blocks them (a sigwait() loop) and
  // execs the server without unblocking them must not leave a server that
  // no stop or reload reaches.
  remember_early_reload_signal();  // main() did so first; again for an embedder's call
  // A write past the file size limit (RLIMIT_FSIZE: LimitFSIZE= in the
  // unit, ulimit -f), a checkpoint's or the segment's, fails with EFBIG,
  // which its message names with the fix (a final checkpoint: exit 1).
  // SIGXFSZ's default action would end the process instead, without its
  // shutdown: a stale segment and temp file, exit 153.
  handle(SIGXFSZ, SIG_IGN);
  sigset_t stop_signals, previous;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, &previous);
  // Restoring a large checkpoint (or reading a large --init-file) may take
  // longer than TimeoutStartSec=: up to --checkpoint-keep files are read
  // (corrupt newer ones passed over), then maybe the init file.
  if (service && (!config.checkpoint_dir.empty() || config.init.kind == InitSpec::Kind::kFile))
    ServiceNotifier::from_environment().extend_timeout(checkpoint_io_allowance(
        shm::total_elements(config.tensors), config.checkpoint_dir.empty() ? 1 : uint64_t{config.checkpoint_keep} + 1));
  FailureKind kind = FailureKind::kOther;
  auto server = Server::create(config, kind);
  if (!server.ok()) {
    ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    return {server.status(), kind};
  }
  g_server.store(server->get(), std::memory_order_release);  // SYNC(signal_server)
  // Under --parent-pid the parent stops it: a terminal's Ctrl-C (SIGINT to
  // the foreground process group, the server in it) is the parent's to
  // handle, which may still need the server (shmps.Server's script takes
  // its last answers in its KeyboardInterrupt handler). Ctrl-Z still stops
  // both, so the stopped script is not evicted as a stopped worker.
  handle(SIGINT, parent_pid != 0 ? SIG_IGN : on_stop_signal);
  handle(SIGTERM, on_stop_signal);
  handle(SIGHUP, on_reload_signal);
  // relaxed: g_reload_at_start's own value only (above).
  if (g_reload_at_start.exchange(false, std::memory_order_relaxed)) (*server)->request_reload();
  sigset_t serving = previous;
  for (const int signo : {SIGINT, SIGTERM, SIGHUP}) sigdelset(&serving, signo);
  ::pthread_sigmask(SIG_SETMASK, &serving, nullptr);
  RunOptions options;
  options.notify_service_manager = service;
  if (!argv.empty()) {
    options.reload = [argv]() -> Result<ServerConfig> {
      std::vector<const char*> args;
      for (const std::string& a : argv) args.push_back(a.c_str());
      auto parsed = parse_options(static_cast<int>(args.size()), args.data());
      if (!parsed.ok()) return parsed.status();
      if (parsed->help || parsed->version || parsed->check)
        return Status{ErrorCode::kInvalidArgument, "the command line asks for --help, --version or --check-config"};
      for (const std::string& line : parsed->shadowed) log::warn("reload: " + line);
      return std::move(parsed).value().config;
    };
  }
  Status s;
  {
    ParentWatch watch(**server, parent_pid);
    s = (*server)->run(options);
  }
  g_server.store(nullptr, std::memory_order_release);  // SYNC(signal_server)
  return {s};
}

}  // namespace shmps::server
