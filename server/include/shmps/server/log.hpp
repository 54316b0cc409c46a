// shmps-server's log (server_core and its main): one line per event on
// stderr, with a timestamp (local time, milliseconds, UTC offset) and a
// level.
//   YYYY-MM-DDThh:mm:ss.mmm+hhmm shmps-server info: worker 3 attached (pid 4242)
// When stderr is connected to the journal ($JOURNAL_STREAM names fd 2, as
// systemd sets it for StandardError=journal) each line starts instead with
// the syslog priority, "<6>shmps-server info: ...", which journald strips
// and stores as the entry's PRIORITY (journalctl -p warning filters on it);
// the journal stamps the time itself.
// Thread safety: every function may be called from any thread; a line is
// written with one write(2), so lines from threads do not interleave.
#pragma once

#include <string_view>

#include "shmps/server/config.hpp"

namespace shmps::server::log {

// Lines less severe than `level` are dropped. Default kInfo.
void set_level(LogLevel level) noexcept;
LogLevel level() noexcept;
inline bool enabled(LogLevel l) noexcept { return static_cast<int>(l) <= static_cast<int>(level()); }

// Writes one line (a trailing newline is added; embedded newlines and
// carriage returns are replaced by spaces so an event stays one journal
// entry). Every other control character (C0, DEL, C1) and every byte
// outside well-formed UTF-8 is written as \xNN, so that a name read from
// a file (a checkpoint's tensor names) cannot move the terminal's cursor
// or forge a line; a backslash in the text is written as it is.
void write(LogLevel level, std::string_view text);
inline void error(std::string_view text) { write(LogLevel::kError, text); }
inline void warn(std::string_view text) { write(LogLevel::kWarn, text); }
inline void info(std::string_view text) { write(LogLevel::kInfo, text); }
inline void debug(std::string_view text) { write(LogLevel::kDebug, text); }

// True when $JOURNAL_STREAM ("<device>:<inode>") matches fd 2. Re-read on
// every call; write() caches the answer from its first call.
bool stderr_is_journal() noexcept;

}  // namespace shmps::server::log
