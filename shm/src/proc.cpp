#include "shmps/shm/proc.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

namespace shmps::shm {
namespace {

// What read_stat() found.
enum class Stat { kRead, kGone, kUnknown };

// Reads /proc/<pid>/stat; fills state, parent pid and start time. kGone
// when no such process is there; kUnknown when this process could not
// read it (EMFILE, ENOMEM...), or finds no entry (ENOENT): not a sign that
// the process is gone. A /proc mounted hidepid=invisible (a unit's
// ProtectProc=invisible) shows no entry for another user's processes,
// alive or not; state_of() asks the kernel then.
Stat read_stat(pid_t pid, char* state, pid_t* parent, uint64_t* start_time) noexcept {
  if (pid <= 0) return Stat::kGone;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ESRCH ? Stat::kGone : Stat::kUnknown;
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  const int read_errno = errno;
  ::close(fd);
  if (n < 0) return read_errno == ESRCH ? Stat::kGone : Stat::kUnknown;  // ESRCH: it exited since the open
  if (n == 0) return Stat::kGone;
  buf[n] = '\0';
  // comm (field 2) may contain spaces and parentheses: parse after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] == '\0') return Stat::kUnknown;
  p += 2;  // field 3: state
  *state = *p;
  // Field 4 is the parent's pid; fields 5..21 are skipped; field 22 is starttime.
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return Stat::kUnknown;
    ++p;
    if (field == 3) *parent = static_cast<pid_t>(std::strtol(p, nullptr, 10));
  }
  *start_time = std::strtoull(p, nullptr, 10);
  return Stat::kRead;
}

// The Threads: count of /proc/<pid>/status (the thread group, the zombie
// leader included); 0 when unreadable.
long live_threads(pid_t pid) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/status", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[4096];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char* p = std::strstr(buf, "\nThreads:");
  return p == nullptr ? 0 : std::strtol(p + 9, nullptr, 10);
}

}  // namespace

uint64_t process_start_time(pid_t pid) noexcept {
  char state = 0;
  pid_t parent = 0;
  uint64_t start = 0;
  return read_stat(pid, &state, &parent, &start) == Stat::kRead ? start : 0;
}

pid_t parent_pid(pid_t pid) noexcept {
  char state = 0;
  pid_t parent = 0;
  uint64_t start = 0;
  return read_stat(pid, &state, &parent, &start) == Stat::kRead ? parent : -1;
}

namespace {

// The state of the process at pid; with `start_time`, only if it started then.
ProcessState state_of(pid_t pid, const uint64_t* start_time) noexcept {
  char state = 0;
  pid_t parent = 0;
  uint64_t start = 0;
  switch (read_stat(pid, &state, &parent, &start)) {
    case Stat::kRead:
      break;
    case Stat::kGone:
      return ProcessState::kGone;
    case Stat::kUnknown:
      // Unreadable or hidden here: alive unless the kernel says no such
      // process (ESRCH; EPERM is another user's live process), its start
      // time unchecked. A live one is never taken for dead: it would be
      // reaped, its buffers removed, its server called gone.
      return ::kill(pid, 0) == 0 || errno == EPERM ? ProcessState::kRunning : ProcessState::kGone;
  }
  // A zombie main thread (it called pthread_exit) with other threads still
  // running is a living process: they may still write its lane.
  if (state == 'Z' && live_threads(pid) > 1) state = 'S';
  if (state == 'Z' || state == 'X' || state == 'x') return ProcessState::kGone;
  if (start_time != nullptr && start != *start_time) return ProcessState::kGone;
  return state == 'T' || state == 't' ? ProcessState::kStopped : ProcessState::kRunning;
}

}  // namespace

ProcessState process_state(pid_t pid, uint64_t start_time) noexcept {
  // 0 is no start time: no process is "the one that started at 0".
  if (start_time == 0) return ProcessState::kGone;
  return state_of(pid, &start_time);
}

bool process_alive(pid_t pid, uint64_t start_time) noexcept {
  return process_state(pid, start_time) != ProcessState::kGone;
}

ProcessState pid_state(pid_t pid) noexcept { return state_of(pid, nullptr); }

bool pid_in_use(pid_t pid) noexcept { return pid_state(pid) != ProcessState::kGone; }

ProcessState entry_owner_state(pid_t pid, uint64_t start_time) noexcept {
  return start_time != 0 ? process_state(pid, start_time) : pid_state(pid);
}

uint64_t monotonic_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

FlockTable FlockTable::read() {
  FlockTable table;
  std::ifstream locks("/proc/locks");
  if (!locks) return table;
  // "1: FLOCK  ADVISORY  WRITE 4242 00:1a:123 0 EOF" (proc(5)): the
  // device's major and minor in hex, the inode in decimal. A waiter's line
  // has "->" after the id, so its second field is not FLOCK.
  for (std::string line; std::getline(locks, line);) {
    std::istringstream fields(line);
    std::string id, kind, mode, access, holder, file;
    if (!(fields >> id >> kind >> mode >> access >> holder >> file)) continue;
    if (kind != "FLOCK") continue;
    unsigned major_id = 0, minor_id = 0;
    unsigned long long ino = 0;
    if (std::sscanf(file.c_str(), "%x:%x:%llu", &major_id, &minor_id, &ino) != 3) continue;
    // A holder this reader cannot name (another pid namespace's, shown as
    // 0, or no number) is kept as pid 0, which no question names: it
    // still counts as "any process".
    char* end = nullptr;
    const long pid = std::strtol(holder.c_str(), &end, 10);
    const bool named = end != holder.c_str() && *end == '\0' && pid > 0 && pid <= INT32_MAX;
    table.locks_.push_back(Lock{makedev(major_id, minor_id), ino, named ? static_cast<pid_t>(pid) : 0});
  }
  if (locks.bad()) return FlockTable{};
  std::sort(table.locks_.begin(), table.locks_.end(),
            [](const Lock& a, const Lock& b) { return std::pair(a.device, a.inode) < std::pair(b.device, b.inode); });
  table.readable_ = true;
  return table;
}

std::optional<bool> FlockTable::holds(std::optional<pid_t> pid, uint64_t device, uint64_t inode) const {
  if (!readable_) return std::nullopt;
  // The device as /proc/locks gives it: its major and minor.
  const Lock wanted{makedev(major(device), minor(device)), inode, 0};
  const auto [first, last] = std::equal_range(locks_.begin(), locks_.end(), wanted, [](const Lock& a, const Lock& b) {
    return std::pair(a.device, a.inode) < std::pair(b.device, b.inode);
  });
  return std::any_of(first, last, [&pid](const Lock& l) { return !pid || l.pid == *pid; });
}

std::optional<bool> holds_flock(std::optional<pid_t> pid, uint64_t device, uint64_t inode) {
  return FlockTable::read().holds(pid, device, inode);
}

}  // namespace shmps::shm
