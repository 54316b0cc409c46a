#include "shmps/server/options.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "backend.hpp"
#include "checkpoint.hpp"
#include "federation.hpp"
#include "shmps/cli.hpp"
#include "shmps/shm/segment.hpp"

namespace po = boost::program_options;

#ifndef SHMPS_VERSION
#define SHMPS_VERSION "unknown"
#endif

namespace shmps::server {
namespace {

// One "key = value" line of a config file.
struct FileEntry {
  std::string key;
  std::string value;
  int line = 0;
};

std::string trim(std::string_view s) {
  const size_t first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const size_t last = s.find_last_not_of(" \t\r");
  return std::string(s.substr(first, last - first + 1));
}

// A config file line without its comment: '#' at the start of the line
// or after a blank begins one; a '#' inside a value (a path such as
// /srv/job#1) is the value's.
std::string_view without_comment(std::string_view text) {
  for (size_t hash = text.find('#'); hash != std::string_view::npos; hash = text.find('#', hash + 1))
    if (hash == 0 || text[hash - 1] == ' ' || text[hash - 1] == '\t') return text.substr(0, hash);
  return text;
}

// A value in quotes, which a config file refuses: the quotes would be
// part of it (checkpoint-dir = "/srv/x" would name a directory '"' under
// the working directory). No option's value begins and ends with one (a
// tensor name may hold a quote, but a tensor ends with its shape).
bool in_quotes(std::string_view value) {
  return value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front();
}

// Why the config file line "key = <value>" would not give back `value`
// (read_config_file()), or empty when it would: --check-config prints the
// configuration as such lines, and prints none that reads back otherwise.
std::string why_no_file_line_holds(const std::string& value) {
  if (value.find('\n') != std::string::npos) return "a line break ends a config file's line";
  const std::string line = "key = " + value;
  const std::string_view kept = without_comment(line);
  const std::string read = trim(kept.substr(kept.find('=') + 1));
  if (read != value)
    return std::string(kept.size() < line.size() ? "'#' at the start of a value or after a blank begins a comment there"
                                                 : "a config file trims the blanks at the ends of a value") +
           " (it would read back as '" + read + "')";
  if (in_quotes(value)) return "a config file refuses a value in quotes";
  return {};
}

std::string file_line(const std::string& file, int line) {
  return "config file " + file + " line " + std::to_string(line);
}

Status invalid(std::string message) { return Status{ErrorCode::kInvalidArgument, std::move(message)}; }

// The options whose values are paths: the whole value, or (fed-store) what
// follows a prefix. A relative one is refused in a config file: the
// service's working directory (/) is neither the file's directory nor
// that of an admin who runs --check-config by hand, so the check and the
// start would judge different paths. One on the command line means the
// working directory's, and parse_options() makes it absolute.
struct PathOption {
  const char* key;
  const char* prefix;  // the path is what follows it; a value without it names none
};
constexpr PathOption kPathOptions[] = {{"checkpoint-dir", ""}, {"init-file", ""}, {"fed-store", "file:"}};

// The value of path option `key` (one of kPathOptions) in `c`.
std::string& path_value(ServerConfig& c, std::string_view key) {
  return key == "checkpoint-dir" ? c.checkpoint_dir : key == "init-file" ? c.init.file : c.federation.store;
}

// The relative path that `value` of path option `p` names, or empty (an
// absolute one, an empty one, or a value that names none).
std::string_view relative_path(const PathOption& p, std::string_view value) {
  if (!value.starts_with(p.prefix)) return {};
  const std::string_view path = value.substr(std::strlen(p.prefix));
  return path.empty() || path.front() == '/' ? std::string_view() : path;
}

// Directory `path` in one form: without "." components, repeated
// separators or a trailing one, which name the same directory. ".." is
// kept: taken out lexically it would name another directory where the
// component before it is a symbolic link. "" stays "".
std::string one_form_dir(const std::string& path) {
  std::filesystem::path tidy;
  for (const std::filesystem::path& part : std::filesystem::path(path))
    if (!part.empty() && part != ".") tidy /= part;
  return tidy.empty() ? path : tidy.string();
}

// Reads a config file with program_options' syntax ('#' at the start of a
// line or after a blank begins a comment to the end of the line, blank
// lines are skipped, "key = value" with blanks around both trimmed; a
// leading UTF-8 byte order mark is skipped) but checks every key itself,
// so that an error can
// name its line: program_options reports neither lines nor, for a file,
// which occurrence was wrong.
Result<std::vector<FileEntry>> read_config_file(const std::string& file, const po::options_description& allowed) {
  // A regular file of sane size, judged on the descriptor that is read
  // (a check of the path, then an open of it, could meet another object
  // swapped in between): a FIFO would block the start, or a reload on
  // the serving thread; /dev/zero would be read until memory ran out.
  // Non-blocking: the open of a FIFO returns at once.
  constexpr off_t kMaxConfigBytes = 1 << 20;
  int fd = -1;
  do {
    fd = ::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return invalid("--config " + file + ": cannot open: " + errno_text(errno));
  std::string contents;
  {
    struct stat st {};
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    if (!regular || st.st_size > kMaxConfigBytes) {
      ::close(fd);
      return invalid("--config " + file + ": " +
                     (!regular ? std::string("not a regular file")
                               : std::to_string(st.st_size) + " bytes; a config file is at most 1 MiB"));
    }
    // Up to one byte past the limit: a file that grew after the fstat is
    // refused as one that was too large.
    contents.resize(static_cast<size_t>(kMaxConfigBytes) + 1);
    size_t got = 0;
    while (got < contents.size()) {
      const ssize_t n = ::read(fd, contents.data() + got, contents.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const std::string why = errno_text(errno);
        ::close(fd);
        return Status{ErrorCode::kIo, "--config " + file + ": read failed: " + why};
      }
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fd);
    if (got > static_cast<size_t>(kMaxConfigBytes))
      return invalid("--config " + file + ": more than 1 MiB; a config file is at most 1 MiB");
    contents.resize(got);
  }
  // A UTF-8 byte order mark (an editor's) is no part of the first key.
  if (contents.rfind("\xEF\xBB\xBF", 0) == 0) contents.erase(0, 3);
  std::istringstream in(contents);
  std::vector<FileEntry> entries;
  std::map<std::string, int> first_line;
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    // A NUL would cut a path short without a word (C strings downstream).
    if (text.find('\0') != std::string::npos) return invalid(file_line(file, line) + ": holds a NUL byte");
    const std::string s = trim(without_comment(text));
    if (s.empty()) continue;
    if (s.front() == '[')
      return invalid(file_line(file, line) + ": sections ('" + s + "') are not supported; write key = value lines");
    const size_t eq = s.find('=');
    if (eq == std::string::npos) return invalid(file_line(file, line) + ": expected 'key = value', got '" + s + "'");
    FileEntry e{trim(std::string_view(s).substr(0, eq)), trim(std::string_view(s).substr(eq + 1)), line};
    if (e.key.empty()) return invalid(file_line(file, line) + ": no key before '='");
    const po::option_description* d = allowed.find_nothrow(e.key, /*approx=*/false);
    if (d == nullptr) {
      const bool command_line_only = e.key == "config" || e.key == "help" || e.key == "version" ||
                                     e.key == "check-config" || e.key == "parent-pid";
      return invalid(file_line(file, line) + ": unknown key '" + e.key + "'" +
                     (command_line_only ? " (valid on the command line only)" : ""));
    }
    if (in_quotes(e.value))
      return invalid(file_line(file, line) + ": key '" + e.key + "': the value " + e.value +
                     " is in quotes, which a config file keeps as part of it; write it without them: " + e.key + " = " +
                     e.value.substr(1, e.value.size() - 2));
    for (const PathOption& p : kPathOptions)
      if (const std::string_view path = relative_path(p, e.value); e.key == p.key && !path.empty())
        return invalid(file_line(file, line) + ": key '" + e.key + "': '" + std::string(path) + "'" +
                       (*p.prefix != '\0' ? " (after " + std::string(p.prefix) + ")" : std::string()) +
                       " is a relative path, which would be taken from the server's working directory (/ under "
                       "systemd), not from this file's; write an absolute path");
    if (cli::negative_for_unsigned(*d, e.value))
      return invalid(file_line(file, line) + ": key '" + e.key + "': must be a non-negative integer, got '" + e.value +
                     "'");
    if (cli::beyond_fp32(*d, e.value))
      return invalid(file_line(file, line) + ": key '" + e.key + "': must be " + cli::kFp32Range + ", got '" + e.value +
                     "'");
    if (!d->semantic()->is_composing()) {
      const auto [it, inserted] = first_line.emplace(e.key, line);
      if (!inserted)
        return invalid(file_line(file, line) + ": key '" + e.key + "' is already set on line " +
                       std::to_string(it->second));
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

// "--lr must be > 0, got -1" -> "<where>: key 'lr': must be > 0, got -1".
// `message` must start with the option it is about.
std::string relocate(const std::string& message, const std::string& where) {
  const size_t end = message.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-", 2);
  const std::string key = message.substr(2, end == std::string::npos ? std::string::npos : end - 2);
  std::string rest = end == std::string::npos ? std::string() : message.substr(end);
  rest.erase(0, std::min(rest.size(), rest.find_first_not_of(": ")));
  return where + ": key '" + key + "': " + rest;
}

constexpr const char* kInitNames[] = {"zero", "normal", "uniform", "file"};

const char* backend_name(BackendKind kind) {
  return kind == BackendKind::kHost ? "host" : kind == BackendKind::kCuda ? "cuda" : "auto";
}

// What an option is read under. An option given where the rest of the
// configuration does not read it (--momentum with adam, --init-seed with
// --init zero, --fed-store without --federation gloo) is refused rather
// than silently ignored, and --check-config prints only what is read, so
// that its output parses back.
struct Reader {
  // The options only this setting makes read; a key may need several
  // readers (every --fed-* option needs a federation). Every option in no
  // reader's list is always read.
  std::initializer_list<const char*> keys;
  bool (*reads)(const ServerConfig&);
  // How a refusal names it: "<setting> does not use --x: <one>; remove it,
  // or <fix>".
  std::string (*setting)(const ServerConfig&);
  const char* one;   // what one such option is
  const char* many;  // what several are
  const char* fix;
};

std::string optimizer_setting(const ServerConfig& c) {
  return "--optimizer " + std::string(kernels::optimizer_kind_name(c.optimizer.kind));
}
std::string init_setting(const ServerConfig& c) {
  return "--init " + std::string(kInitNames[static_cast<int>(c.init.kind)]);
}
std::string federation_setting(const ServerConfig& c) {
  return "--federation " + std::string(federation_kind_name(c.federation.kind));
}

// In the order refusals are reported: the federation's before Gloo's and
// the outer step's, so that --fed-store without a federation names
// --federation none.
const Reader kReaders[] = {
    {{"momentum", "dampening", "nesterov"},
     [](const ServerConfig& c) { return c.optimizer.kind == kernels::OptimizerKind::kSgd; },
     optimizer_setting,
     "an SGD option",
     "SGD options",
     "choose --optimizer sgd"},
    {{"beta1", "beta2", "eps", "amsgrad"},
     [](const ServerConfig& c) { return c.optimizer.kind != kernels::OptimizerKind::kSgd; },
     optimizer_setting,
     "an Adam/AdamW option",
     "Adam/AdamW options",
     "choose --optimizer adam or adamw"},
    {{"init-scale", "init-seed"},
     [](const ServerConfig& c) {
       return c.init.kind == InitSpec::Kind::kNormal || c.init.kind == InitSpec::Kind::kUniform;
     },
     init_setting,
     "an option of --init normal and uniform",
     "options of --init normal and uniform",
     "choose --init normal or uniform"},
    {{"init-file"},
     [](const ServerConfig& c) { return c.init.kind == InitSpec::Kind::kFile; },
     init_setting,
     "an option of --init file",
     "options of --init file",
     "choose --init file"},
    {{"device"},
     [](const ServerConfig& c) { return c.backend != BackendKind::kHost; },
     [](const ServerConfig& c) { return "--backend " + std::string(backend_name(c.backend)); },
     "an option of --backend cuda and auto",
     "options of --backend cuda and auto",
     "choose --backend cuda or auto"},
    {{"fed-every-ms", "fed-every-versions", "fed-outer", "fed-outer-lr", "fed-outer-momentum", "fed-unweighted",
      "fed-no-overlap", "fed-priority", "fed-cpus", "fed-max-drift", "fed-rank-in-name", "fed-store", "fed-hosts",
      "fed-host", "fed-address", "fed-timeout-ms"},
     [](const ServerConfig& c) { return c.federation.kind != FederationKind::kNone; },
     federation_setting,
     "a federation option",
     "federation options",
     "choose --federation mpi or gloo"},
    {{"fed-store", "fed-hosts", "fed-host", "fed-address", "fed-timeout-ms"},
     [](const ServerConfig& c) { return c.federation.kind == FederationKind::kGloo; },
     federation_setting,
     "an option of --federation gloo",
     "options of --federation gloo",
     "choose --federation gloo"},
    {{"fed-outer-lr", "fed-outer-momentum"},
     [](const ServerConfig& c) { return c.federation.outer == OuterStep::kNesterov; },
     [](const ServerConfig& c) { return "--fed-outer " + std::string(outer_step_name(c.federation.outer)); },
     "an option of --fed-outer nesterov",
     "options of --fed-outer nesterov",
     "choose --fed-outer nesterov"},
    {{"checkpoint-every", "checkpoint-interval-s", "checkpoint-keep"},
     [](const ServerConfig& c) { return !c.checkpoint_dir.empty(); },
     [](const ServerConfig&) { return std::string("a server without --checkpoint-dir"); },
     "a checkpoint option",
     "checkpoint options",
     "give --checkpoint-dir DIR"},
};

std::string number_text(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// "--lr must be > 0, got 0" for lr = 1e-50 -> "--lr must be > 0, got 1e-50,
// which rounds to 0 in fp32": a message that ends with an option's fp32
// value, where the value as written reads as another number, shows both.
std::string with_written_value(std::string message, const std::string& written, float value) {
  const std::string shown = number_text(value);
  if (!message.ends_with("got " + shown)) return message;
  const double as_written = std::strtod(written.c_str(), nullptr);
  if (!std::isfinite(value) || !std::isfinite(as_written) || static_cast<double>(value) == as_written ||
      std::strtod(shown.c_str(), nullptr) == as_written)
    return message;
  message.resize(message.size() - shown.size());
  return message + written + ", which rounds to " + shown + " in fp32";
}

// "auto" (0), or a number in 1..max: an option whose 0 means auto.
template <class T>
bool parse_auto_or_number(std::string_view text, T max, T* out) noexcept {
  if (text == "auto") {
    *out = 0;
    return true;
  }
  T n = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, n);
  if (ec != std::errc() || ptr != end || n == 0 || n > max) return false;
  *out = n;
  return true;
}

}  // namespace

const char* version_text() noexcept { return SHMPS_VERSION; }

const char* log_level_name(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
  }
  return "unknown";
}

float default_weight_decay(kernels::OptimizerKind kind) noexcept {
  return kind == kernels::OptimizerKind::kAdamW ? 0.01f : 0.0f;
}

bool parse_staleness_policy(std::string_view text, shm::StalenessPolicy* out) noexcept {
  for (uint32_t p = 0; p <= shm::kStalenessPolicyMax; ++p)
    if (text == shm::staleness_policy_name(p)) {
      *out = static_cast<shm::StalenessPolicy>(p);
      return true;
    }
  return false;
}

bool parse_log_level(std::string_view text, LogLevel* out) noexcept {
  for (LogLevel l : {LogLevel::kError, LogLevel::kWarn, LogLevel::kInfo, LogLevel::kDebug}) {
    if (text == log_level_name(l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

Result<shm::TensorSpec> parse_tensor(const std::string& text) {
  const auto bad = [&](const std::string& why) {
    return Status{ErrorCode::kInvalidArgument,
                  "--tensor '" + text + "': " + why + "; expected NAME:D0xD1x... such as fc1.weight:256x784"};
  };
  const size_t c1 = text.find(':');
  if (c1 == std::string::npos) return bad(text.empty() ? "empty" : "no shape");
  if (c1 == 0) return bad("no name before ':'");
  shm::TensorSpec t;
  t.name = text.substr(0, c1);
  const size_t c2 = text.find(':', c1 + 1);
  const std::string shape = text.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
  if (shape.empty()) return bad("no shape after ':'");
  // "w:4,v:5": a list, where the option takes one tensor.
  if (shape.find(',') != std::string::npos)
    return bad("one --tensor takes one tensor: give each its own --tensor (in a config file, its own tensor line)");
  if (c2 != std::string::npos) {
    const std::string dtype = text.substr(c2 + 1);
    if (dtype.empty()) return bad("empty dtype after the second ':' (weights are f32)");
    if (dtype != "f32" && dtype != "float32") return bad("weights are fp32 only, got dtype '" + dtype + "'");
  }
  // Split by hand: std::getline would drop an empty last piece ("256x"
  // read as 256).
  for (size_t start = 0;;) {
    const size_t x = shape.find('x', start);
    const std::string dim = shape.substr(start, x == std::string::npos ? std::string::npos : x - start);
    if (dim.empty()) {
      if (start == 0) return bad("shape '" + shape + "' starts with 'x'");
      if (x == std::string::npos) return bad("shape '" + shape + "' ends with 'x'");
      return bad("shape '" + shape + "' has an empty dimension between two 'x'");
    }
    if (dim.find_first_not_of("0123456789") != std::string::npos)
      return bad("dimension '" + dim + "' is not a positive integer (dimensions are separated by 'x')");
    if (dim.size() > 12) return bad("dimension " + dim + " is too large");
    const uint64_t d = std::stoull(dim);  // at most 12 digits: no overflow
    if (d == 0) return bad("dimension 0 in shape '" + shape + "' (every dimension must be at least 1)");
    t.shape.push_back(d);
    if (x == std::string::npos) break;
    start = x + 1;
  }
  if (t.shape.size() > shm::kMaxDims)
    return bad(std::to_string(t.shape.size()) + " dimensions in shape '" + shape + "'; at most " +
               std::to_string(shm::kMaxDims));
  return t;
}

Result<ParsedOptions> parse_options(int argc, const char* const* argv) {
  ParsedOptions out;
  ServerConfig& c = out.config;
  kernels::OptimizerConfig& o = c.optimizer;
  std::string config_file, optimizer = "sgd", backend = "auto", init = "zero", log_level = "info",
                           apply_threads = "auto", max_worker_buffer_bytes = "auto", staleness_policy = "reject",
                           federation = "none", fed_outer = "average", fed_priority = "normal", fed_cpus,
                           lr_schedule = "constant";
  bool fed_unweighted = false, fed_no_overlap = false;
  std::vector<std::string> tensors;
  float weight_decay = 0.0f;

  po::options_description generic("General (command line only)");
  generic.add_options()("help,h", "print this help and exit")("version", "print the version and exit")(
      "check-config", "check the options and the --config file, print the effective configuration, exit")(
      "config", po::value(&config_file), "read options from this file (key = value lines, '#' comments)")(
      "parent-pid", po::value(&out.parent_pid),
      "stop, as on SIGTERM, once process PID is no longer this server's parent (the launcher exited or was "
      "killed), ignore SIGINT (a terminal's Ctrl-C is the launcher's to handle) and send systemd nothing (a "
      "NOTIFY_SOCKET inherited is the launcher's unit's); shmps.Server passes its own pid");
  po::options_description server("Server (also valid in the config file, as key = value)");
  server.add_options()("name", po::value(&c.name), "instance name: the segment is /dev/shm/shmps.<name> (required)")(
      "tensor", po::value(&tensors)->composing(),
      "NAME:SHAPE[:f32], e.g. fc1.weight:256x784; repeatable, in order (required)")(
      "optimizer", po::value(&optimizer)->default_value("sgd"), "sgd | adam | adamw")(
      "lr", po::value(&o.lr)->default_value(0.001f, "0.001"), "learning rate (> 0); changes live on SIGHUP")(
      "lr-schedule", po::value(&lr_schedule)->default_value("constant"),
      "the lr of each update from lr and the updates before it, as torch.optim.lr_scheduler's: constant | "
      "step:SIZE:GAMMA | exponential:GAMMA | cosine:T_MAX[:ETA_MIN] | linear:START:END:ITERS, phases joined "
      "by commas run in turn (linear:0.01:1:500,cosine:9500: a warm-up, then cosine); changes live on SIGHUP")(
      "momentum", po::value(&o.momentum)->default_value(0.0f), "SGD momentum (>= 0)")(
      "dampening", po::value(&o.dampening)->default_value(0.0f), "SGD dampening (>= 0)")(
      "nesterov", po::bool_switch(&o.nesterov), "SGD Nesterov momentum (needs momentum > 0, dampening 0)")(
      "weight-decay", po::value(&weight_decay),
      "L2 penalty (SGD, Adam) or decoupled decay (AdamW); default 0, AdamW 0.01")(
      "beta1", po::value(&o.beta1)->default_value(0.9f, "0.9"), "Adam beta1 in [0, 1)")(
      "beta2", po::value(&o.beta2)->default_value(0.999f, "0.999"), "Adam beta2 in [0, 1)")(
      "eps", po::value(&o.eps)->default_value(1e-8f, "1e-08"), "Adam epsilon (> 0)")(
      "amsgrad", po::bool_switch(&o.amsgrad), "Adam/AdamW AMSGrad variant")(
      "max-staleness", po::value(&c.max_staleness)->default_value(4),
      "the staleness bound: versions (reject), clocks ahead of the slowest worker (wait); changes live on SIGHUP")(
      "staleness-policy", po::value(&staleness_policy)->default_value("reject"),
      "reject (stale pushes) | wait (hold pulls of workers more than max-staleness clocks ahead: SSP) | scale "
      "(apply every push, past max-staleness versions with lr * max(1, max-staleness) / staleness); changes live "
      "on SIGHUP")("allow-nonfinite", po::bool_switch(&c.allow_nonfinite),
                   "apply gradients holding NaN or Inf (rejected by default)")(
      "ring-capacity", po::value(&c.lane_capacity)->default_value(64), "slots per worker request lane (power of two)")(
      "max-workers", po::value(&c.max_workers)->default_value(16), "worker table size (1..256)")(
      "max-buffers", po::value(&c.max_buffers)->default_value(16), "registered buffers per worker (1..64)")(
      "max-worker-buffer-bytes", po::value(&max_worker_buffer_bytes)->default_value("auto"),
      "the most bytes one worker's registered buffers may span together (the server maps each): auto (8 x the "
      "model's fp32 bytes, at least 1 GiB) or N")("backend", po::value(&backend)->default_value("auto"),
                                                  "host | cuda | auto (cuda when a device is present)")(
      "device", po::value(&c.device),
      "CUDA device: UUID (GPU-..., as nvidia-smi -L prints) or PCI bus id (0000:3b:00.0); default: the first visible")(
      "init", po::value(&init)->default_value("zero"), "initial weights: zero | normal | uniform | file")(
      "init-scale", po::value(&c.init.scale)->default_value(0.01f, "0.01"), "normal: stddev; uniform: half-width")(
      "init-seed", po::value(&c.init.seed)->default_value(1), "seed of normal/uniform init")(
      "init-file", po::value(&c.init.file), "raw little-endian fp32, all tensors in order (implies --init file)")(
      "group-access", po::bool_switch(&c.group_access), "create the segment with mode 0660 instead of 0600")(
      "idle-spin-us", po::value(&c.idle_spin_us)->default_value(50),
      "spin this long on an empty ring before sleeping (at most 1000000: 1 s)")(
      "apply-threads", po::value(&apply_threads)->default_value("auto"),
      "threads of one update of a tensor from 4 MiB: auto (the affinity mask's CPUs that no computing worker "
      "shares, at least 1) or N; changes live on SIGHUP")(
      "stopped-worker-timeout-ms", po::value(&c.stopped_worker_timeout_ms)->default_value(5000),
      "evict a worker stopped (SIGSTOP, a debugger) this long (0: never)")(
      "checkpoint-dir", po::value(&c.checkpoint_dir),
      "write checkpoints here and restore the newest valid one at start")(
      "checkpoint-every", po::value(&c.checkpoint_every)->default_value(0),
      "checkpoint every N applied updates (0: off)")("checkpoint-interval-s",
                                                     po::value(&c.checkpoint_interval_s)->default_value(0),
                                                     "checkpoint every S seconds when weights changed (0: off)")(
      "checkpoint-keep", po::value(&c.checkpoint_keep)->default_value(3), "keep the newest K checkpoints (1..1000)")(
      "log-level", po::value(&log_level)->default_value("info"), "error | warn | info | debug; changes live on SIGHUP");
  FederationConfig& fc = c.federation;
  po::options_description fed("Federation: hosts' servers averaging their weight deltas (docs/federation.md)");
  fed.add_options()("federation", po::value(&federation)->default_value("none"),
                    "none | mpi (one server per host, launched by mpirun or srun) | gloo (elastic: hosts meet "
                    "through --fed-store)")("fed-every-ms", po::value(&fc.every_ms)->default_value(250),
                                            "a round every this many ms")(
      "fed-every-versions", po::value(&fc.every_versions)->default_value(0),
      "and a round once this many local updates were applied since the last (0: off)")(
      "fed-outer", po::value(&fed_outer)->default_value("average"),
      "the outer step: average (Local SGD) | nesterov (SGD with Nesterov momentum on the mean delta: DiLoCo)")(
      "fed-outer-lr", po::value(&fc.outer_lr)->default_value(0.7f, "0.7"), "nesterov: the outer learning rate")(
      "fed-outer-momentum", po::value(&fc.outer_momentum)->default_value(0.9f, "0.9"), "nesterov: the outer momentum")(
      "fed-unweighted", po::bool_switch(&fed_unweighted),
      "average the hosts' deltas plainly (default: weighted by each host's local updates of the round)")(
      "fed-no-overlap", po::bool_switch(&fed_no_overlap),
      "hold local pushes while a round exchanges (default: apply them; the merge keeps them)")(
      "fed-priority", po::value(&fed_priority)->default_value("normal"),
      "the federation's threads against local serving: normal | low (nice 19) | idle (SCHED_IDLE: CPU time "
      "serving leaves)")("fed-cpus", po::value(&fed_cpus),
                         "the CPUs of the federation's threads, as taskset lists them (3, 0,2-5); default (or "
                         "empty): the server's")(
      "fed-max-drift", po::value(&fc.max_drift)->default_value(0),
      "hold local pushes once this many updates are not yet in a merged round (0: no cap)")(
      "fed-rank-in-name", po::bool_switch(&fc.rank_in_name),
      "append .r<host> to --name and /r<host> to --checkpoint-dir (several federated servers on one machine)")(
      "fed-store", po::value(&fc.store),
      "gloo: where the hosts meet, file:DIR (a directory all hosts see) or redis:HOST[:PORT][/JOB]; fresh per job")(
      "fed-hosts", po::value(&fc.hosts)->default_value(0), "gloo: the job's hosts, ids 0..N-1 (at most 64)")(
      "fed-host", po::value(&fc.host)->default_value(0), "gloo: this host's id")(
      "fed-address", po::value(&fc.address)->default_value("127.0.0.1"),
      "gloo: the address this host's collectives listen on (one the other hosts reach)")(
      "fed-timeout-ms", po::value(&fc.timeout_ms)->default_value(5000),
      "gloo: a collective or rendezvous waiting longer fails, and the group re-forms without the host it waited for");
  server.add(fed);
  po::options_description all;
  all.add(generic).add(server);

  // Where each value came from, for errors: keys the file set (and the
  // command line did not), and every tensor in the composed order.
  std::string file;
  std::map<std::string, int> line_of;
  std::vector<int> tensor_line;  // 0: --tensor
  // Each float option's value as written (the command line's, else the
  // file's), for a refusal of the value fp32 made of it.
  std::map<std::string, std::string> written;
  // An integer past its option's type (2^32 for a 32-bit count, which
  // program_options refuses without the reason) is stored as the type's
  // largest, for the option's own rule (validate()) to judge, and its
  // refusal then quotes the value as written; one the rule takes is
  // refused with the type's range. Key -> {as written, as stored}.
  std::map<std::string, std::pair<std::string, std::string>> past_type;
  const auto store_within_type = [&past_type](const po::option_description& d, const std::string& key,
                                              std::string& value) {
    if (!cli::past_unsigned_max(d, value)) return;
    const std::string most = std::to_string(cli::unsigned_max(d));
    past_type.emplace(key, std::pair{value, most});
    value = most;
  };
  po::variables_map vm;
  try {
    const po::parsed_options cmdline = po::command_line_parser(argc, argv).options(all).style(cli::kStyle).run();
    cli::refuse_misread_values(cmdline);
    po::parsed_options stored = cmdline;
    for (po::option& opt : stored.options)
      if (const po::option_description* d = all.find_nothrow(opt.string_key, false); d != nullptr)
        for (std::string& value : opt.value) store_within_type(*d, opt.string_key, value);
    po::store(stored, vm);
    // Each key the command line gave, with its value as written (a switch
    // has none): a file line giving the same value is no override.
    std::map<std::string, std::vector<std::string>> on_cmdline;
    for (const po::option& opt : cmdline.options) {
      on_cmdline.emplace(opt.string_key, opt.value);
      if (opt.string_key == "tensor") tensor_line.push_back(0);
      if (const po::option_description* d = all.find_nothrow(opt.string_key, false);
          d != nullptr && cli::stores_float(*d) && !opt.value.empty())
        written.emplace(opt.string_key, opt.value.front());
    }
    if (vm.count("help")) {
      std::ostringstream text;
      text << "shmps-server " << version_text() << ": a parameter server for the workers of one host\n\n" << all;
      out.help = true;
      out.help_text = text.str();
      return out;
    }
    if (vm.count("version")) {
      out.version = true;
      return out;
    }
    if (vm.count("config")) {
      file = vm["config"].as<std::string>();
      auto entries = read_config_file(file, server);
      if (!entries.ok()) return entries.status();
      // One store per line, so a bad value is pinned to its line. Values
      // the command line gave stay (program_options keeps the first store
      // of a non-composing key); `tensor` lines compose after the command
      // line's.
      for (const FileEntry& e : *entries) {
        // program_options reads an empty value as true for a switch: a
        // line blanked to unset allow-nonfinite would turn it on.
        if (const auto* option = server.find_nothrow(e.key, false);
            e.value.empty() && option != nullptr && option->semantic()->max_tokens() == 0)
          return invalid(file_line(file, e.line) + ": key '" + e.key +
                         "' has no value: give true or false (or remove the line to leave it off)");
        // (A key the command line gave is not stored again: its value is
        // the command line's.)
        std::string value = e.value;
        if (on_cmdline.count(e.key) == 0) store_within_type(*server.find_nothrow(e.key, false), e.key, value);
        po::parsed_options one(&server);
        one.options.emplace_back(e.key, std::vector<std::string>{value});
        try {
          po::store(one, vm);
        } catch (const po::error&) {
          return invalid(file_line(file, e.line) + ": key '" + e.key + "': invalid value '" + e.value + "'");
        }
        if (e.key == "tensor") {
          tensor_line.push_back(e.line);
        } else if (const auto given = on_cmdline.find(e.key); given == on_cmdline.end()) {
          line_of[e.key] = e.line;
          if (cli::stores_float(*server.find_nothrow(e.key, false))) written[e.key] = e.value;
        } else if (given->second != std::vector<std::string>{e.value}) {
          out.shadowed.push_back(file_line(file, e.line) + ": key '" + e.key + "' = " + e.value +
                                 " is not used: the command line's --" + e.key + " wins");
        }
      }
    }
    po::notify(vm);
  } catch (const po::error& e) {
    return invalid(e.what());
  }

  // A message that starts with "--key" is pointed at the file's line when
  // the file set that key, and quotes a float's value as written where
  // fp32 rounded it to another number. One that ends with the value an
  // option past its type was stored as ("--ring-capacity must be ...,
  // got 4294967295") quotes it as written.
  const auto fail = [&](std::string message) {
    for (const auto& [key, values] : past_type) {
      const auto& [as_written, as_stored] = values;
      const size_t at = message.find("--" + key);
      const size_t after = at == std::string::npos ? at : at + 2 + key.size();
      const bool names_key =
          at != std::string::npos &&
          (after == message.size() || std::strchr("abcdefghijklmnopqrstuvwxyz0123456789-", message[after]) == nullptr);
      if (names_key && message.ends_with("got " + as_stored)) {
        message.replace(message.size() - as_stored.size(), as_stored.size(), as_written);
        break;
      }
    }
    if (message.rfind("--", 0) == 0) {
      const size_t end = message.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-", 2);
      const std::string key = message.substr(2, end == std::string::npos ? std::string::npos : end - 2);
      if (const auto w = written.find(key); w != written.end())
        message = with_written_value(std::move(message), w->second, vm[key].as<float>());
      const auto it = line_of.find(key);
      if (it != line_of.end()) return invalid(relocate(message, file_line(file, it->second)));
    }
    return invalid(message);
  };

  // An empty path would quietly turn the feature off (or name the cwd).
  for (const char* key : {"checkpoint-dir", "init-file"})
    if (vm.count(key) && vm[key].as<std::string>().empty()) return fail(std::string("--") + key + " is an empty path");
  // The command line's relative paths are the working directory's (the
  // file's are absolute): made absolute here, so that the configuration
  // names the directory the server uses (what --check-config prints parses
  // back as a config file, and a start-up log line names it).
  for (const PathOption& p : kPathOptions) {
    std::string& value = path_value(c, p.key);
    const std::string_view path = relative_path(p, value);
    if (path.empty()) continue;
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(path, ec);
    if (ec)
      return fail(std::string("--") + p.key + " '" + value +
                  "' is a relative path, and the working directory cannot be read (" + ec.message() +
                  "); give an absolute path");
    value = p.prefix + absolute.string();
  }
  // Every later use takes the checkpoint directory in one form: the
  // parent the start checks (that of ".../job/" would be ".../job"), the
  // lock's path, a rank's subdirectory, the log and --check-config.
  c.checkpoint_dir = one_form_dir(c.checkpoint_dir);
  if (c.name.empty())
    return vm.count("name") ? fail("--name is empty; the instance name is required") : invalid("--name is required");
  if (Status s = shm::validate_name(c.name); !s.ok()) return fail("--name: " + s.message());
  if (tensors.empty()) return invalid("at least one --tensor is required");
  // A tensor's error names its line when the file gave it.
  const auto tensor_fail = [&](size_t i, const std::string& message) {
    const int line = i < tensor_line.size() ? tensor_line[i] : 0;
    return invalid(line != 0 ? relocate(message, file_line(file, line)) : message);
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto spec = parse_tensor(tensors[i]);
    if (!spec.ok()) return tensor_fail(i, spec.status().message());
    c.tensors.push_back(std::move(spec).value());
  }
  // The table's rules (shm::validate_tensors(), which validate() applies
  // again for an embedder's config), each error at the tensor it is
  // found at: the tensor alone, a name given before, the count, the total.
  std::map<std::string, size_t> first_of;
  uint64_t total = 0;
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const shm::TensorSpec& t = c.tensors[i];
    if (Status s = shm::validate_tensors({t}); !s.ok()) return tensor_fail(i, "--tensor: " + s.message());
    if (const auto [it, inserted] = first_of.emplace(t.name, i); !inserted) {
      const int first = it->second < tensor_line.size() ? tensor_line[it->second] : 0;
      const int here = i < tensor_line.size() ? tensor_line[i] : 0;
      return tensor_fail(i, "--tensor: tensor name '" + t.name + "' given twice" +
                                (first != 0  ? " (first on line " + std::to_string(first) + ")"
                                 : here != 0 ? " (first by --tensor)"
                                             : ""));
    }
    if (i == shm::kMaxTensorsLimit)
      return tensor_fail(i, "--tensor: a model needs 1.." + std::to_string(shm::kMaxTensorsLimit) + " tensors, got " +
                                std::to_string(c.tensors.size()));
    total += shm::total_elements({t});  // both at most 2^40: no overflow
    if (total > shm::kMaxTotalElements)
      return tensor_fail(i, "--tensor: the tensors hold over 2^40 elements in total (at '" + t.name + "')");
  }
  if (!kernels::parse_optimizer_kind(optimizer, &o.kind))
    return fail("--optimizer must be sgd, adam or adamw, got '" + optimizer + "'");
  o.weight_decay = vm.count("weight-decay") ? weight_decay : default_weight_decay(o.kind);
  if (backend == "host")
    c.backend = BackendKind::kHost;
  else if (backend == "cuda")
    c.backend = BackendKind::kCuda;
  else if (backend == "auto")
    c.backend = BackendKind::kAuto;
  else
    return fail("--backend must be host, cuda or auto, got '" + backend + "'");
  if (vm.count("init-file") && vm["init"].defaulted()) init = "file";
  if (init == "zero")
    c.init.kind = InitSpec::Kind::kZero;
  else if (init == "normal")
    c.init.kind = InitSpec::Kind::kNormal;
  else if (init == "uniform")
    c.init.kind = InitSpec::Kind::kUniform;
  else if (init == "file") {
    if (c.init.file.empty()) return fail("--init file needs --init-file PATH");
    c.init.kind = InitSpec::Kind::kFile;
  } else {
    return fail("--init must be zero, normal, uniform or file, got '" + init + "'");
  }
  if (Result<kernels::LrSchedule> schedule = kernels::parse_lr_schedule(lr_schedule); schedule.ok())
    c.lr_schedule = std::move(schedule).value();
  else
    return fail(schedule.status().message());
  if (!parse_staleness_policy(staleness_policy, &c.staleness_policy))
    return fail("--staleness-policy must be reject, wait or scale, got '" + staleness_policy + "'");
  if (!parse_auto_or_number(apply_threads, uint32_t{kMaxApplyThreads}, &c.apply_threads))
    return fail("--apply-threads must be auto or a number in 1.." + std::to_string(kMaxApplyThreads) + ", got '" +
                apply_threads + "'");
  constexpr uint64_t kMaxBytes = std::numeric_limits<uint64_t>::max();
  if (!parse_auto_or_number(max_worker_buffer_bytes, kMaxBytes, &c.max_worker_buffer_bytes))
    return fail("--max-worker-buffer-bytes must be auto or a number of bytes in 1.." + std::to_string(kMaxBytes) +
                ", got '" + max_worker_buffer_bytes + "'");
  if (!parse_federation_kind(federation, &fc.kind))
    return fail("--federation must be none, mpi or gloo, got '" + federation + "'");
  if (!parse_outer_step(fed_outer, &fc.outer))
    return fail("--fed-outer must be average or nesterov, got '" + fed_outer + "'");
  if (!parse_federation_priority(fed_priority, &fc.priority))
    return fail("--fed-priority must be normal, low or idle, got '" + fed_priority + "'");
  if (!fed_cpus.empty() && !parse_cpu_list(fed_cpus, &fc.cpus))
    return fail("--fed-cpus must list CPUs below " + std::to_string(kMaxCpus) + " as taskset does (3, 0,2-5), got '" +
                fed_cpus + "'");
  fc.weight_by_updates = !fed_unweighted;
  fc.overlap = !fed_no_overlap;
  if (!parse_log_level(log_level, &c.log_level))
    return fail("--log-level must be error, warn, info or debug, got '" + log_level + "'");
  // An option given where nothing reads it would be silently ignored:
  // refuse each, on the command line or in the file. Defaults are not
  // given (variables_map::defaulted()).
  for (const Reader& r : kReaders) {
    if (r.reads(c)) continue;
    std::vector<std::string> unused;
    for (const std::string key : r.keys) {
      if (vm.count(key) == 0 || vm[key].defaulted()) continue;
      const auto line = line_of.find(key);
      unused.push_back(line == line_of.end() ? "--" + key : key + " (" + file_line(file, line->second) + ")");
    }
    if (unused.empty()) continue;
    std::string list;
    for (size_t i = 0; i < unused.size(); ++i)
      list += (i == 0 ? "" : i + 1 == unused.size() ? " and " : ", ") + unused[i];
    const bool one = unused.size() == 1;
    return invalid(r.setting(c) + " does not use " + list + ": " + (one ? r.one : r.many) + "; remove " +
                   (one ? "it" : "them") + ", or " + r.fix);
  }
  if (Status s = validate(c); !s.ok()) return fail(s.message());
  // An option past its type whose rule took the type's largest: the
  // type's range is the rule.
  if (!past_type.empty()) {
    const auto& [key, values] = *past_type.begin();
    return fail("--" + key + " must be an integer in 0.." + values.second + ", got " + values.first);
  }
  out.check = vm.count("check-config") != 0;
  // The start reads the init file; a check that passed it would promise a
  // start that fails. Same reader, so the same message. With a checkpoint
  // directory the start needs it only when no checkpoint is restored,
  // which a check cannot know: not refused then.
  if (out.check && c.init.kind == InitSpec::Kind::kFile && c.checkpoint_dir.empty())
    if (Status s = read_init_file(c.init.file, shm::total_elements(c.tensors)); !s.ok()) return s;
  // --backend cuda starts only where a device is; auto falls back to host.
  if (std::string why; out.check && c.backend == BackendKind::kCuda && !cuda_backend_available(&why))
    return fail("--backend cuda needs a usable CUDA device, and none is usable here (" + why +
                "); use --backend host, or auto (the host backend where no device is present)");
  // The start creates the checkpoint directory, or fails as this says.
  if (out.check && !c.checkpoint_dir.empty())
    if (Status s = check_checkpoint_dir(c.checkpoint_dir); !s.ok()) return s;
  // And locks it (CheckpointDirLock): a directory another live server
  // holds fails the check as it fails the start. Not when the holder is
  // the live server of this configuration's own name: that is the
  // instance a restart stops first (the postinst, and an admin, check a
  // running instance's file before restarting it). --fed-rank-in-name
  // appends the host's rank to both: known here under gloo (--fed-host),
  // not under mpi (mpirun's), where the lock is left to the start.
  if (out.check && !c.checkpoint_dir.empty() && !(fc.rank_in_name && fc.kind == FederationKind::kMpi)) {
    ServerConfig started = c;
    if (fc.kind == FederationKind::kGloo) apply_rank_in_name(started, fc.host);
    uint32_t holder = 0;
    if (Status s = CheckpointDirLock::probe(started.checkpoint_dir, &holder);
        !s.ok() && (holder == 0 || shm::live_server_of(started.name) != holder))
      return s;
  }
  // The check prints the configuration as a config file, which must read
  // back as this configuration: a value no line holds as written (one
  // the command line gave) is refused, since printed it would mislead.
  if (out.check)
    for (const auto& [key, value] : config_entries(c))
      if (const std::string why = why_no_file_line_holds(value); !why.empty())
        return invalid("--check-config cannot print --" + key + " '" + value + "' as a config file line: " + why);
  return out;
}

bool config_reads(const ServerConfig& c, std::string_view key) {
  for (const Reader& r : kReaders)
    if (!r.reads(c) && std::find(r.keys.begin(), r.keys.end(), key) != r.keys.end()) return false;
  return true;
}

std::vector<std::pair<std::string, std::string>> config_entries(const ServerConfig& c) {
  const kernels::OptimizerConfig& o = c.optimizer;
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  std::vector<std::pair<std::string, std::string>> e;
  e.emplace_back("name", c.name);
  for (const shm::TensorSpec& t : c.tensors) {
    std::string shape;
    for (uint64_t d : t.shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    e.emplace_back("tensor", t.name + ":" + shape);
  }
  e.emplace_back("optimizer", kernels::optimizer_kind_name(o.kind));
  e.emplace_back("lr", number_text(o.lr));
  e.emplace_back("lr-schedule", kernels::lr_schedule_text(c.lr_schedule));
  e.emplace_back("momentum", number_text(o.momentum));
  e.emplace_back("dampening", number_text(o.dampening));
  e.emplace_back("nesterov", flag(o.nesterov));
  e.emplace_back("weight-decay", number_text(o.weight_decay));
  e.emplace_back("beta1", number_text(o.beta1));
  e.emplace_back("beta2", number_text(o.beta2));
  e.emplace_back("eps", number_text(o.eps));
  e.emplace_back("amsgrad", flag(o.amsgrad));
  e.emplace_back("max-staleness", std::to_string(c.max_staleness));
  e.emplace_back("staleness-policy", shm::staleness_policy_name(static_cast<uint32_t>(c.staleness_policy)));
  e.emplace_back("allow-nonfinite", flag(c.allow_nonfinite));
  e.emplace_back("ring-capacity", std::to_string(c.lane_capacity));
  e.emplace_back("max-workers", std::to_string(c.max_workers));
  e.emplace_back("max-buffers", std::to_string(c.max_buffers));
  e.emplace_back("max-worker-buffer-bytes",
                 c.max_worker_buffer_bytes == 0 ? "auto" : std::to_string(c.max_worker_buffer_bytes));
  e.emplace_back("backend", backend_name(c.backend));
  if (!c.device.empty()) e.emplace_back("device", c.device);
  e.emplace_back("init", kInitNames[static_cast<int>(c.init.kind)]);
  e.emplace_back("init-scale", number_text(c.init.scale));
  e.emplace_back("init-seed", std::to_string(c.init.seed));
  if (!c.init.file.empty()) e.emplace_back("init-file", c.init.file);
  e.emplace_back("group-access", flag(c.group_access));
  e.emplace_back("idle-spin-us", std::to_string(c.idle_spin_us));
  e.emplace_back("apply-threads", c.apply_threads == 0 ? "auto" : std::to_string(c.apply_threads));
  e.emplace_back("stopped-worker-timeout-ms", std::to_string(c.stopped_worker_timeout_ms));
  if (!c.checkpoint_dir.empty()) e.emplace_back("checkpoint-dir", c.checkpoint_dir);
  e.emplace_back("checkpoint-every", std::to_string(c.checkpoint_every));
  e.emplace_back("checkpoint-interval-s", std::to_string(c.checkpoint_interval_s));
  e.emplace_back("checkpoint-keep", std::to_string(c.checkpoint_keep));
  e.emplace_back("log-level", log_level_name(c.log_level));
  const FederationConfig& fed = c.federation;
  e.emplace_back("federation", federation_kind_name(fed.kind));
  e.emplace_back("fed-every-ms", std::to_string(fed.every_ms));
  e.emplace_back("fed-every-versions", std::to_string(fed.every_versions));
  e.emplace_back("fed-outer", outer_step_name(fed.outer));
  e.emplace_back("fed-outer-lr", number_text(fed.outer_lr));
  e.emplace_back("fed-outer-momentum", number_text(fed.outer_momentum));
  e.emplace_back("fed-unweighted", flag(!fed.weight_by_updates));
  e.emplace_back("fed-no-overlap", flag(!fed.overlap));
  e.emplace_back("fed-priority", federation_priority_name(fed.priority));
  e.emplace_back("fed-cpus", cpu_list_text(fed.cpus));
  e.emplace_back("fed-max-drift", std::to_string(fed.max_drift));
  e.emplace_back("fed-rank-in-name", flag(fed.rank_in_name));
  e.emplace_back("fed-store", fed.store);
  e.emplace_back("fed-hosts", std::to_string(fed.hosts));
  e.emplace_back("fed-host", std::to_string(fed.host));
  e.emplace_back("fed-address", fed.address);
  e.emplace_back("fed-timeout-ms", std::to_string(fed.timeout_ms));
  // What the configuration reads, so that the entries parse back.
  std::erase_if(e, [&](const auto& entry) { return !config_reads(c, entry.first); });
  return e;
}

}  // namespace shmps::server
