// The shmps-server a shmps-train job talks to: the one it starts and owns
// (its command line from the options, the initial weights file, the
// checkpoint folder that lets a restart resume), connecting to it, and
// checking that a running one holds this model. The parent's thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "child.hpp"
#include "mlp.hpp"
#include "options.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"
#include "shmps/worker.hpp"

namespace shmps::train {

// A shmps-server child on segment o.name, started from a He initialisation
// of o.seed with the optimizer and staleness bound of `o`. The destructor
// stops it and removes its initial weights file and checkpoints.
class OwnServer {
 public:
  OwnServer() = default;
  ~OwnServer();
  OwnServer(const OwnServer&) = delete;
  OwnServer& operator=(const OwnServer&) = delete;

  // Writes the initial weights, then starts the server; returns 0, or
  // kExitFailure with the reason printed (unwritable temp file, no
  // executable server). With o.checkpoint_every > 0 the server checkpoints
  // into a temp folder, so that restart() resumes it. The temp files are
  // named by this process's pid and start time; those of jobs gone
  // without their cleanup (killed) are removed first.
  int start(const Options& o, const MlpShape& shape);
  // Starts the server again after it died; it restores its last checkpoint
  // and the workers re-attach (WorkerOptions::reconnect). False when
  // restarts are off (no checkpoints) or kMaxRestarts were made.
  bool restart();
  // SIGTERM (and SIGCONT: a stopped server handles it once it runs), wait
  // up to 10 s (then SIGKILL); true if it exited 0. The segment of a server
  // that died without removing it (killed) goes too: only the one whose
  // header names that server's pid and start time.
  bool stop();
  // Removes the initial weights file once the server has read it, unless a
  // restart will need it.
  void release_init_file();

  // Reaps the server if it has exited; true once it has.
  bool poll() { return child_.poll(); }
  // Exit code, or 128 + signal; valid once poll() returned true.
  int status() const { return child_.status(); }
  // The pid of the server started last.
  pid_t pid() const { return child_.pid(); }
  bool restartable() const { return !checkpoint_dir_.empty(); }
  int restarts() const { return restarts_; }
  // The most restarts one run gets.
  static constexpr int kMaxRestarts = 10;

 private:
  void spawn();

  std::string name_;  // the segment's
  Child child_;
  uint64_t child_start_time_ = 0;  // /proc's, of child_: which segment is its
  std::vector<std::string> argv_;
  std::string init_file_;
  std::string checkpoint_dir_;  // with --checkpoint-every: a temp dir
  int restarts_ = 0;
};

// The server's counters that Worker::stats() does not report (its reply
// holds 32, all taken): read from a read-only mapping of the server's
// segment, as shmps-inspect reads them. Racy snapshots (each counter read
// atomically).
class ServerCounters {
 public:
  explicit ServerCounters(std::string name) : name_(std::move(name)) {}
  // Checkpoint writes that failed in server instance `generation` (a
  // Worker's generation() just after a call succeeded, so that its segment
  // is published: opening one waits for that). nullopt when its segment
  // cannot be read (another user's, or gone) or is another instance's.
  std::optional<uint64_t> checkpoint_failures(uint64_t generation);
  // The same from the segment mapped last, even after its server removed
  // it (the server's exit writes its final count there first); nullopt
  // when none is.
  std::optional<uint64_t> mapped_checkpoint_failures() const;

 private:
  std::string name_;
  std::unique_ptr<shm::Segment> segment_;
};

// Connects an evaluation worker, retrying while the server is starting (no
// segment yet). With a server of our own (`server` != nullptr) a layout
// mismatch is retried too: between the server's shm_open and its header
// write, the object is briefly empty or zero, which connect reports as a
// foreign file; and its exit ends the wait (kServerNotRunning). A segment
// that another server publishes under the name is not ours: never
// attached to (our server refuses to start beside it). A stop signal
// (stop_signals.hpp) ends the wait, and every wait of the Worker's calls,
// with kInterrupted.
Result<std::unique_ptr<Worker>> connect_with_retry(const std::string& name, OwnServer* server,
                                                   std::chrono::milliseconds patience);

// Checks that a running server holds this model's tensors, in order.
// Errors: kInvalidArgument naming both lists.
Status check_tensors(const Worker& w, const MlpShape& shape);

}  // namespace shmps::train
