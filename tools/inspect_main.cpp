// shmps-inspect: prints what a shmps control segment holds (header, config,
// tensors, workers, lanes, completion queues, stats) as text or JSON, once
// or as a live view. Read-only: the segment is mapped PROT_READ.
// Usage and exit codes: docs/inspect.md.
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>

#include "inspect_list.hpp"
#include "inspect_model.hpp"
#include "inspect_source.hpp"
#include "shmps/cli.hpp"

namespace po = boost::program_options;
using shmps::inspect::ExitCode;

namespace {

struct Options {
  std::string name;
  std::string file;
  bool json = false;            // --json, or --format json
  std::string format = "text";  // --format: text, json or prometheus
  bool watch = false;
  bool list = false;
  uint64_t interval_ms = 1000;
  uint64_t count = 0;  // refreshes in --watch; 0: until SIGINT
};

// --interval-ms's largest value: a day. Beyond it the refresh deadline
// (steady_clock's nanoseconds) could overflow.
constexpr uint64_t kMaxIntervalMs = 86'400'000;

volatile sig_atomic_t g_stop = 0;

// SIGINT, SIGTERM: stop (--watch). Installed without SA_RESTART, so a
// write to stdout that blocks (a pipe nobody reads, a paused terminal)
// returns EINTR and the watch ends (write_out). A stop also arms SIGALRM,
// which re-arms itself every second until the exit: a stop that came
// before a write began blocking (during the refresh, or just before the
// write) interrupted nothing, and the next SIGALRM interrupts that write.
extern "C" void on_signal(int signo) {
  if (signo != SIGALRM) g_stop = 1;
  ::alarm(1);
}

void install_stop_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: see on_signal
  for (const int signo : {SIGINT, SIGTERM, SIGALRM}) ::sigaction(signo, &sa, nullptr);
  // A parent may have started the tool with them blocked (the mask is
  // inherited): they must reach the handler.
  sigset_t ours;
  sigemptyset(&ours);
  for (const int signo : {SIGINT, SIGTERM, SIGALRM}) sigaddset(&ours, signo);
  ::sigprocmask(SIG_UNBLOCK, &ours, nullptr);
}

// Prints "shmps-inspect: <message>" on stderr, escaped (printable_text):
// a message may quote a --file path or a <name> as the user gave them.
void report_error(const std::string& message) {
  std::fprintf(stderr, "shmps-inspect: %s\n", shmps::inspect::printable_text(message).c_str());
}

enum class Written { kAll, kStopped, kFailed };

// Writes `text` to stdout with write(2), unbuffered: nothing is left in a
// stdio buffer for the exit to flush, which would block again on a stdout
// that blocked. kFailed when it did not all arrive: a report that did not
// get out is a failure (exit 1), not a silent 0. The error goes to stderr
// (a full disk, a closed descriptor), except EPIPE: a reader that went
// away (`| head -1`) asked for no more. kStopped: --watch's SIGINT or
// SIGTERM (g_stop) interrupted a write that blocked (on_signal); the rest
// is given up. A stop that came before the write lets it finish, so the
// refresh it came during is shown.
Written write_out(const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(STDOUT_FILENO, text.data() + done, text.size() - done);
    if (n >= 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    const int err = errno;
    if (err == EINTR) {
      if (g_stop != 0) return Written::kStopped;
      continue;
    }
    if (err != EPIPE) std::fprintf(stderr, "shmps-inspect: writing to stdout: %s\n", std::strerror(err));
    return Written::kFailed;
  }
  return Written::kAll;
}

// write_out() for a mode that has no stop handler: true when it all arrived.
bool write_all(const std::string& text) { return write_out(text) == Written::kAll; }

// What a failure to read the segment is to Prometheus (ReadError): no
// segment at all, or what a start that died left (Loaded::dead_start: a
// header naming a dead server, or an object empty or unwritten, unlocked
// and unchanged for longer than a start's wait), is a server that is
// down, not a read that failed.
shmps::inspect::ReadError read_error(ExitCode exit, shmps::ErrorCode cause, bool dead_start = false) {
  using shmps::inspect::ReadError;
  switch (exit) {
    case ExitCode::kOk:
    case ExitCode::kNoSegment:
      return ReadError::kNone;
    case ExitCode::kBadSegment:
      return ReadError::kBadSegment;
    case ExitCode::kUnpublished:
      return dead_start ? ReadError::kNone : ReadError::kUnpublished;
    case ExitCode::kError:
      break;
  }
  return cause == shmps::ErrorCode::kPermission ? ReadError::kPermission : ReadError::kIo;
}

// One look at the segment: the rendered report in *out, or the error in
// *error and, when given, what it is to Prometheus in *failure. With
// `previous` (--watch), the rates since that snapshot are added, and
// *previous becomes this one.
ExitCode inspect_once(const Options& o, std::string* out, std::string* error,
                      std::optional<shmps::inspect::Snapshot>* previous = nullptr,
                      shmps::inspect::ReadError* failure = nullptr) {
  // A <name> no server can take is a usage error (exit 1), and so it is
  // to Prometheus: no read was tried.
  if (o.file.empty())
    if (const shmps::Status s = shmps::shm::validate_name(o.name); !s.ok()) {
      *error = s.message();
      if (failure != nullptr) *failure = shmps::inspect::ReadError::kUsage;
      return ExitCode::kError;
    }
  // Prometheus exports no ring: none is read.
  const shmps::inspect::RingReading rings =
      o.format == "prometheus" ? shmps::inspect::kNoRings : shmps::inspect::RingReading{};
  shmps::inspect::Loaded loaded = o.file.empty() ? shmps::inspect::load_segment(o.name, /*wait_for_start=*/true, rings)
                                                 : shmps::inspect::load_file(o.file, rings);
  if (loaded.exit != ExitCode::kOk) {
    *error = loaded.error;
    if (failure != nullptr) *failure = read_error(loaded.exit, loaded.cause, loaded.dead_start);
    return loaded.exit;
  }
  const shmps::inspect::Image& image = loaded.image;
  auto snap = shmps::inspect::take_snapshot(image.data, image.size, image.source, rings);
  if (!snap.ok()) {
    *error = image.source + ": " + snap.status().message();
    const ExitCode exit = shmps::inspect::exit_code_for(snap.status());
    if (failure != nullptr) *failure = read_error(exit, snap.status().code());
    return exit;
  }
  snap->object = shmps::inspect::judge_object(image.source, image.owner.uid, image.owner.gid, image.owner.mode,
                                              snap->config.flags, image.owner.live);
  if (image.owner.live) shmps::inspect::judge_server_lock(&*snap, image.owner.device, image.owner.inode);
  std::optional<shmps::inspect::Rates> rates;
  if (previous != nullptr && *previous) rates = shmps::inspect::rates_between(**previous, *snap);
  if (o.format == "prometheus") {
    *out = shmps::inspect::render_prometheus(*snap, o.name.empty() ? o.file : o.name);
  } else if (o.json) {
    // replace: a user-given path need not be UTF-8; names from the segment
    // are already escaped to printable ASCII.
    const int indent = o.watch ? -1 : 2;
    nlohmann::json j = shmps::inspect::to_json(*snap);
    if (previous != nullptr) j["rates"] = rates ? shmps::inspect::rates_json(*rates) : nlohmann::json(nullptr);
    *out = j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  } else {
    *out = shmps::inspect::render_text(*snap);
    if (previous != nullptr)
      *out += rates ? shmps::inspect::render_rates_text(*rates) : "== rates: from the next refresh on ==\n";
  }
  if (previous != nullptr) *previous = std::move(snap).value();
  return ExitCode::kOk;
}

ExitCode run_list(const Options& o) {
  const auto listed = shmps::inspect::list_segments();
  if (!listed.ok()) {
    report_error(listed.status().message());
    return ExitCode::kError;
  }
  const auto& list = *listed;
  const bool written =
      o.json ? write_all(shmps::inspect::list_json(list).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) +
                         "\n")
             : write_all(shmps::inspect::render_list_text(list));
  return written ? ExitCode::kOk : ExitCode::kError;
}

ExitCode run_once(const Options& o) {
  std::string out, error;
  shmps::inspect::ReadError failure = shmps::inspect::ReadError::kNone;
  const ExitCode rc = inspect_once(o, &out, &error, nullptr, &failure);
  if (rc != ExitCode::kOk) {
    report_error(error);
    if (o.format == "prometheus" &&
        !write_all(shmps::inspect::render_prometheus_down(o.name.empty() ? o.file : o.name, failure)))
      return ExitCode::kError;
    return rc;
  }
  return write_all(out) ? rc : ExitCode::kError;
}

// Sleeps until `until`, or until SIGINT/SIGTERM (g_stop). The signals are
// blocked from the check of g_stop to ppoll, which unblocks them
// atomically for its wait: one that comes after the check is delivered
// inside ppoll and ends the wait at once, instead of being missed for a
// whole interval. Outside this wait they are not blocked, so one during a
// refresh interrupts a write that blocks (write_out).
void wait_until(std::chrono::steady_clock::time_point until) {
  sigset_t stop_signals, before;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &stop_signals, &before);
  sigset_t waiting = before;  // the mask ppoll waits under: the stop signals always open
  sigdelset(&waiting, SIGINT);
  sigdelset(&waiting, SIGTERM);
  while (g_stop == 0) {
    const auto left = until - std::chrono::steady_clock::now();
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    if (ns <= 0) break;
    const timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    ::ppoll(nullptr, 0, &ts, &waiting);  // a timeout, or EINTR from the handler
  }
  ::sigprocmask(SIG_SETMASK, &before, nullptr);
}

// Re-opens the segment at every refresh, so a restarted server (a new
// object under the same name) is followed. The exit code is the last
// refresh's, also when a stop interrupts the write of its output. The
// interval is slept exactly (steady clock), from the start of one refresh
// to the next.
ExitCode run_watch(const Options& o) {
  install_stop_handler();
  ExitCode rc = ExitCode::kOk;
  std::optional<shmps::inspect::Snapshot> previous;
  for (uint64_t n = 1; g_stop == 0 && (o.count == 0 || n <= o.count); ++n) {
    const auto started = std::chrono::steady_clock::now();
    std::string out, error;
    rc = inspect_once(o, &out, &error, &previous);
    Written written = Written::kAll;
    if (o.json) {
      if (rc != ExitCode::kOk)
        report_error(error);
      else
        written = write_out(out);
    } else {
      // ANSI: cursor home, clear screen.
      std::string screen = "\x1b[H\x1b[2J";
      screen += rc == ExitCode::kOk ? out : "shmps-inspect: " + shmps::inspect::printable_text(error) + "\n";
      screen +=
          "-- refresh " + std::to_string(n) + ", every " + std::to_string(o.interval_ms) + " ms; Ctrl-C to stop --\n";
      written = write_out(screen);
    }
    if (written == Written::kStopped) break;
    if (written == Written::kFailed) return ExitCode::kError;
    if (o.count != 0 && n == o.count) break;
    wait_until(started + std::chrono::milliseconds(o.interval_ms));
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  // A reader that went away (`| head -1`) makes a write fail with EPIPE,
  // which ends the tool with exit 1 and no message (write_out), instead of
  // killing it.
  ::signal(SIGPIPE, SIG_IGN);
  Options o;
  po::options_description visible(
      // "Usage:" and "  or:": the synopsis lines help2man makes the man
      // page's from.
      "Usage: shmps-inspect [options] <name>\n"
      "  or:  shmps-inspect --list [--json]\n"
      "\n"
      "Prints the state of the shmps segment /dev/shm/shmps.<name> (read-only),\n"
      "or one line for every shmps segment on the host.\n"
      "\n"
      "Options");
  visible.add_options()("help,h", "this help")("version", "print the version and exit")(
      "json", po::bool_switch(&o.json), "print one JSON document (with --watch: one per line)")(
      "format", po::value(&o.format)->default_value("text"),
      "text, json (as --json) or prometheus (the text exposition format, for the node exporter's textfile "
      "collector)")("watch", po::bool_switch(&o.watch), "refresh a live view until SIGINT")(
      "list", po::bool_switch(&o.list), "one line per shmps segment in /dev/shm: server pid, alive, size, workers")(
      "interval-ms", po::value(&o.interval_ms)->default_value(1000),
      "--watch: milliseconds between refreshes (1 to 86400000)")("count", po::value(&o.count)->default_value(0),
                                                                 "--watch: stop after N refreshes (0: never)")(
      "file", po::value(&o.file), "inspect a copy of a segment saved in this regular file instead");
  po::options_description hidden;
  hidden.add_options()("name", po::value(&o.name));
  po::options_description all;
  all.add(visible).add(hidden);
  po::positional_options_description positional;
  positional.add("name", 1);
  try {
    po::variables_map vm;
    const po::parsed_options parsed =
        po::command_line_parser(argc, argv).options(all).positional(positional).style(shmps::cli::kStyle).run();
    shmps::cli::refuse_misread_values(parsed);
    po::store(parsed, vm);
    if (vm.count("version") != 0)
      return write_all(shmps::cli::version_line("shmps-inspect") + "\n") ? 0 : static_cast<int>(ExitCode::kError);
    if (vm.count("help") != 0) {
      std::ostringstream help;
      help << visible
           << "\nExit codes: 0 ok, 1 error (usage, permission, I/O, writing the output), 2 no such segment,\n"
              "3 corrupt/foreign/other layout version, 4 not published yet.\n";
      return write_all(help.str()) ? 0 : static_cast<int>(ExitCode::kError);
    }
    po::notify(vm);
    if (o.format == "json") {
      o.json = true;
    } else if (o.format == "prometheus") {
      if (o.json) throw po::error("--json and --format prometheus: give one");
    } else if (o.format != "text") {
      throw po::error("--format must be text, json or prometheus, got '" + o.format + "'");
    } else if (o.json && !vm["format"].defaulted()) {
      throw po::error("--json and --format text: give one");
    }
    if (o.format == "prometheus" && (o.list || o.watch))
      throw po::error("--format prometheus takes neither --list nor --watch");
    if (o.list) {
      if (!o.name.empty() || !o.file.empty() || o.watch) throw po::error("--list takes no <name>, --file or --watch");
    } else if (o.name.empty() == o.file.empty()) {
      throw po::error("give a segment <name> or --file PATH, exactly one");
    }
    if (o.watch && o.interval_ms == 0) throw po::error("--interval-ms must be at least 1");
    if (o.interval_ms > kMaxIntervalMs)
      throw po::error("--interval-ms must be at most " + std::to_string(kMaxIntervalMs) + " (a day), got " +
                      std::to_string(o.interval_ms));
    if (!o.watch && (!vm["count"].defaulted() || !vm["interval-ms"].defaulted()))
      throw po::error("--count and --interval-ms need --watch");
  } catch (const po::error& e) {
    report_error(std::string(e.what()) + " (see --help)");
    return static_cast<int>(ExitCode::kError);
  }
  return static_cast<int>(o.list ? run_list(o) : o.watch ? run_watch(o) : run_once(o));
}
