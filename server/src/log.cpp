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

// The length of the well-formed UTF-8 sequence at the start of `s` (2 to
// 4 bytes: no overlong form, no surrogate, nothing past U+10FFFF), or 0.
size_t utf8_sequence(std::string_view s) noexcept {
  const auto byte = [&s](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = byte(0);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i)
    if (byte(i) < 0x80 || byte(i) > 0xbf) return 0;
  return n;
}

// `text` as one line a terminal and the journal show as text: a newline
// or carriage return becomes a space (an event stays one entry); every
// other control character (C0, DEL, and C1 as UTF-8) and every byte that
// is not part of well-formed UTF-8 becomes \xNN. Names from files and
// peers (a checkpoint's tensor names, a path) reach the log through here.
void append_escaped(std::string& line, std::string_view text) {
  const auto escape = [&line](unsigned char c) {
    static constexpr char kHex[] = "0123456789abcdef";
    line += "\\x";
    line += kHex[c >> 4];
    line += kHex[c & 0xf];
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n' || c == '\r') {
      line += ' ';
      ++i;
    } else if (c < 0x20 || c == 0x7f) {
      escape(c);
      ++i;
    } else if (c < 0x80) {
      line += static_cast<char>(c);
      ++i;
    } else if (const size_t n = utf8_sequence(text.substr(i));
               n == 0 || (c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0)) {
      // Not UTF-8, or a C1 control (U+0080..U+009F): its bytes one by one.
      const size_t bytes = n == 0 ? 1 : n;
      for (size_t k = 0; k < bytes; ++k) escape(static_cast<unsigned char>(text[i + k]));
      i += bytes;
    } else {
      line.append(text.substr(i, n));
      i += n;
    }
  }
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
  append_escaped(line, text);
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
