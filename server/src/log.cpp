#include "shmps/server/log.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

#include "shmps/server/options.hpp"

namespace shmps::server::log {
namespace {

// relaxed: an independent setting; a line written with the old level
// during a change is harmless.
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

// "YYYY-MM-DDThh:mm:ss.mmm+hhmm ": local time to the millisecond, with
// its UTC offset (ISO 8601), so lines from hosts in other zones compare.
void append_timestamp(std::string& line) {
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  struct tm local {};
  if (::localtime_r(&now.tv_sec, &local) == nullptr) return;
  char text[48];
  size_t n = std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%S", &local);
  n += static_cast<size_t>(std::snprintf(text + n, sizeof text - n, ".%03ld", now.tv_nsec / 1000000));
  n += std::strftime(text + n, sizeof text - n, "%z ", &local);
  line.append(text, n);
}

}  // namespace

void set_level(LogLevel l) noexcept { g_level.store(static_cast<int>(l), std::memory_order_relaxed); }
LogLevel level() noexcept { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }

bool stderr_is_journal() noexcept {
  const char* stream = std::getenv("JOURNAL_STREAM");
  if (stream == nullptr) return false;
  unsigned long long dev = 0, ino = 0;
  if (std::sscanf(stream, "%llu:%llu", &dev, &ino) != 2) return false;
  struct stat st {};
  if (::fstat(STDERR_FILENO, &st) != 0) return false;
  return static_cast<unsigned long long>(st.st_dev) == dev && static_cast<unsigned long long>(st.st_ino) == ino;
}

void write(LogLevel l, std::string_view text) {
  if (!enabled(l)) return;
  // Decided once: stderr is not re-pointed while the server runs.
  static const bool journal = stderr_is_journal();
  std::string line;
  line.reserve(text.size() + 32);
  // journald stamps each line itself and reads the priority from "<N>".
  if (journal)
    line += "<" + std::to_string(static_cast<int>(l)) + ">";
  else
    append_timestamp(line);
  line += "shmps-server ";
  line += log_level_name(l);
  line += ": ";
  for (char ch : text) line += (ch == '\n' || ch == '\r') ? ' ' : ch;
  line += '\n';
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to report it
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace shmps::server::log
