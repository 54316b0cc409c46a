// Removes dead workers' buffer objects ("shmps.<name>.p<pid>.<n>",
// shm::orphan_buffers()) from /dev/shm, on a thread of its own
// ("shmps-sweep"). /dev/shm is world-writable: what a sweep costs (a
// listing of the folder, a look at each pid named) and what it finds are
// any local user's to set, so the consumer thread never sweeps while the
// thread runs, and the log gets at most two lines a sweep (the objects
// removed; those it may not remove, each logged by one sweep only), each
// with a count and the first kNamedPerLine names.
// Thread safety: sweep_soon() from any thread; the rest from the thread
// that owns the sweeper (the consumer). A sweep runs on one thread at a
// time: sweep_now() only while the thread is not running.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace shmps::server {

class OrphanSweeper {
 public:
  static constexpr uint64_t kPeriodNs = 1'000'000'000;  // between two sweeps
  static constexpr uint64_t kMinGapNs = 100'000'000;    // at least, after a sweep, before the next asked for
  static constexpr size_t kNamedPerLine = 4;

  explicit OrphanSweeper(std::string server_name);
  ~OrphanSweeper();  // stop()
  OrphanSweeper(const OrphanSweeper&) = delete;
  OrphanSweeper& operator=(const OrphanSweeper&) = delete;

  // One sweep on the calling thread: at start (a crashed predecessor's
  // workers) and at stop (workers killed since the last), while the thread
  // is not running.
  void sweep_now();
  // Starts the thread, with SIGINT, SIGTERM and SIGHUP blocked in it; it
  // sweeps every kPeriodNs and soon after sweep_soon(). When it cannot
  // start (a task limit), says so, and tick() sweeps instead.
  void start();
  // Ends the thread, after the sweep in progress.
  void stop();
  // The consumer's periodic call (`now`: monotonic ns): without the
  // thread, a sweep that is due runs here.
  void tick(uint64_t now);
  // A worker died: its objects go with a sweep that runs soon (at most
  // kMinGapNs after the last), not at the next period.
  void sweep_soon();

 private:
  void loop();
  // One sweep: removes what it may, logs the rest once.
  void sweep();

  const std::string name_;
  // ---- the sweeping thread's (one at a time, above)
  // Objects a sweep could not remove (another user's in the sticky
  // /dev/shm) and logged: the next sweeps log only others.
  std::set<std::string> unremovable_;
  // ---- the owner's
  bool running_ = false;       // the thread runs
  uint64_t last_tick_ns_ = 0;  // tick()'s last sweep (without the thread)
  // ---- guarded by mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool requested_ = false;  // sweep_soon() since the last sweep
  bool quit_ = false;
  std::thread thread_;  // last: started once the members above are
};

}  // namespace shmps::server
