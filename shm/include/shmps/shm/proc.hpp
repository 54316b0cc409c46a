// Process identity that survives pid reuse: (pid, start time). A pid alone
// can be reused, and a zombie still answers kill(pid, 0); /proc/<pid>/stat
// gives both the start time (field 22, clock ticks since boot) and the state.
// Who holds a flock on a file (/proc/locks). Thread-safe; reads /proc, and
// asks kill(pid, 0) where /proc shows nothing.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace shmps::shm {

// Start time of pid in clock ticks since boot; 0 when the process does not
// exist (or /proc is unreadable).
uint64_t process_start_time(pid_t pid) noexcept;
// The pid of pid's parent; -1 when the process does not exist (or /proc
// is unreadable).
pid_t parent_pid(pid_t pid) noexcept;

// True when pid exists, is not a zombie or dead, and started at
// start_time, i.e. it is the same process. A start_time of 0 is no
// process's (every process has started by a tick past boot; a header or
// entry that holds 0 names none): false, whatever lives at the pid.
bool process_alive(pid_t pid, uint64_t start_time) noexcept;

// What /proc says about a process, read once. A /proc entry this process
// cannot read (out of descriptors or memory), or does not see (proc
// mounted hidepid=invisible, a unit's ProtectProc=invisible: another
// user's processes have none), is not taken for a process gone:
// kill(pid, 0) decides then, and a living process (EPERM: another user's)
// counts as kRunning, its start time unchecked.
enum class ProcessState {
  kGone,     // no such process, a zombie, or another process that reused the pid
  kRunning,  // alive and not stopped (running, sleeping, in disk wait, ...)
  kStopped,  // stopped by a signal (SIGSTOP, SIGTSTP: 'T') or by a tracer ('t')
};
// As process_alive() (start_time 0: kGone), and whether the process is stopped.
ProcessState process_state(pid_t pid, uint64_t start_time) noexcept;

// The same for whatever process holds pid now, whenever it started: for a
// pid whose start time is not known (yet), where any process at the pid
// must count, e.g. before removing what that pid's process might use.
ProcessState pid_state(pid_t pid) noexcept;
bool pid_in_use(pid_t pid) noexcept;
// The state of a worker entry's owner `pid`, whose start time the worker
// stores after its claim (0 until then: any process at the pid counts, as
// pid_state(); after it, a pid reused since is gone, as process_state()).
ProcessState entry_owner_state(pid_t pid, uint64_t start_time) noexcept;

// CLOCK_MONOTONIC in nanoseconds (the same clock in every process).
uint64_t monotonic_ns() noexcept;

// The flocks /proc/locks lists, read once. /proc/locks holds every lock on
// the host, and any user can add thousands (a flock on files of their
// own): a reader that asks about many files (shmps-inspect --list) reads
// it once into this table and asks the table, not the file, each time.
// Read-only: reading it takes no lock (that could make a starting server
// fail). Immutable after read(); safe to share between threads.
class FlockTable {
 public:
  // Reads /proc/locks. A table that could not be read (or not whole)
  // answers every question empty.
  static FlockTable read();
  // Whether process `pid` (any process when it is empty) holds a flock on
  // the file (device, inode); empty when /proc/locks could not be read.
  std::optional<bool> holds(std::optional<pid_t> pid, uint64_t device, uint64_t inode) const;

 private:
  struct Lock {
    uint64_t device = 0;  // makedev(major, minor)
    uint64_t inode = 0;
    pid_t pid = 0;
  };
  bool readable_ = false;
  std::vector<Lock> locks_;  // sorted by (device, inode)
};

// FlockTable::read().holds(pid, device, inode): for one question, one read.
std::optional<bool> holds_flock(std::optional<pid_t> pid, uint64_t device, uint64_t inode);

}  // namespace shmps::shm
