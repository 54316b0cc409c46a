#include "bench_support.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <new>
#include <sstream>
#include <thread>

#include "shmps/cli.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/stop_signals.hpp"
#include "shmps/worker.hpp"

namespace shmps::bench {

uint64_t now_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

void sleep_ns(long ns) noexcept {
  timespec ts{ns / 1'000'000'000, ns % 1'000'000'000};
  ::nanosleep(&ts, nullptr);
}

std::optional<int> parse_command_line(int argc, char** argv, const std::string& program, const std::string& caption,
                                      int max_section, const boost::program_options::options_description& extra,
                                      CommonOptions& out) {
  namespace po = boost::program_options;
  const std::string section_help = "run only these sections (1.." + std::to_string(max_section) + ")";
  po::options_description desc(caption);
  desc.add_options()("help,h", "print this help and exit")("version", "print the version and exit")(
      "quick", po::bool_switch(&out.quick), "smoke mode: tiny sizes, few iterations (CI); figures meaningless")(
      "repeats", po::value(&out.repeats), "repeats per figure (medians over them)")(
      "csv", po::value(&out.csv_path), "also write every cell to FILE (section,row,column,value)")(
      "section", po::value(&out.sections)->multitoken(), section_help.c_str())(
      "server", po::value(&out.server_path), "shmps-server to run (default: beside this program)")(
      "server-arg", po::value(&out.server_args)->composing(),
      "append ARG to every shmps-server's command line (repeatable), e.g. --server-arg=--max-workers=4");
  desc.add(extra);
  po::variables_map vm;
  try {
    vm = cli::parse(argc, argv, desc);
  } catch (const po::error& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return 2;
  }
  if (vm.count("help")) {
    std::cout << desc << "\n";
    return 0;
  }
  if (vm.count("version")) {
    std::cout << cli::version_line(program) << "\n";
    return 0;
  }
  out.repeats_given = vm.count("repeats") != 0;
  if (out.repeats_given && out.repeats == 0) {
    std::fprintf(stderr, "%s: --repeats must be >= 1\n", program.c_str());
    return 2;
  }
  if (out.sections.empty())
    for (int s = 1; s <= max_section; ++s) out.sections.push_back(s);
  for (int s : out.sections) {
    if (s < 1 || s > max_section) {
      std::fprintf(stderr, "%s: --section must be 1..%d, got %d\n", program.c_str(), max_section, s);
      return 2;
    }
  }
  if (out.server_path.empty()) out.server_path = server_binary();
  if (::access(out.server_path.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "%s: no executable shmps-server at %s (use --server)\n", program.c_str(),
                 out.server_path.c_str());
    return 2;
  }
  return std::nullopt;
}

std::string beside_this_program(const std::string& file) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? file : (self.parent_path() / file).string();
}

uint32_t usable_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
    return static_cast<uint32_t>(CPU_COUNT(&set));
  // More CPUs than a cpu_set_t holds (EINVAL), or none reported: every online one.
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one.empty() ? std::string("?") : one;
}

void print_omp_environment(std::FILE* out) {
  for (const char* var : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND"})
    if (const char* value = std::getenv(var)) std::fprintf(out, "Environment: %s=%s\n", var, value);
}

namespace {

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string csv_cell(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

}  // namespace

// ------------------------------------------------------------ stats

double percentile(std::vector<double> samples, double q) {
  if (samples.empty()) return NAN;
  q = std::clamp(q, 0.0, 1.0);
  // Nearest rank: the smallest sample with at least q of all at or below it.
  auto rank = static_cast<size_t>(std::ceil(q * static_cast<double>(samples.size())));
  rank = std::clamp<size_t>(rank, 1, samples.size());
  std::nth_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(rank - 1), samples.end());
  return samples[rank - 1];
}

size_t min_samples_for(double q) {
  if (q >= 1.0) return 1;
  // 10 / (1 - q) rounded up, less a rounding error's worth: 10 / (1 - 0.99)
  // is 1000.0000000000009 in doubles.
  return static_cast<size_t>(std::ceil(10.0 / (1.0 - std::max(q, 0.0)) - 1e-6));
}

double reported_percentile(std::vector<double> samples, double q) {
  if (samples.size() < min_samples_for(q)) return NAN;
  return percentile(std::move(samples), q);
}

double median(std::vector<double> samples) {
  if (samples.empty()) return NAN;
  const size_t mid = samples.size() / 2;
  std::nth_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(mid), samples.end());
  const double upper = samples[mid];
  if (samples.size() % 2 == 1) return upper;
  return (*std::max_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

std::string fixed(double value, int digits) {
  if (std::isnan(value)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

// ------------------------------------------------------------ report

void Csv::add(const std::string& section, const std::string& row, const std::string& column, const std::string& value) {
  text_ += csv_cell(section) + "," + csv_cell(row) + "," + csv_cell(column) + "," + csv_cell(value) + "\n";
}

Status Csv::write(const std::string& path) const {
  errno = 0;
  std::ofstream out(path, std::ios::trunc);
  if (!out) return {ErrorCode::kIo, "--csv " + path + ": cannot open for writing: " + shmps::errno_text(errno)};
  out << text_;
  if (!out.flush()) return {ErrorCode::kIo, "--csv " + path + ": write failed: " + shmps::errno_text(errno)};
  return Status::Ok();
}

Table::Table(std::string section, std::vector<std::string> columns, size_t key_columns)
    : section_(std::move(section)), columns_(std::move(columns)), key_columns_(key_columns) {}

void Table::add_row(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

void Table::print(std::FILE* out) const {
  std::vector<size_t> width(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    width[c] = columns_[c].size();
    for (const auto& row : rows_) width[c] = std::max(width[c], row[c].size());
  }
  const auto line = [&](const std::vector<std::string>& cells) {
    std::string text;
    for (size_t c = 0; c < cells.size(); ++c) {
      const std::string pad(width[c] - cells[c].size(), ' ');
      text += c == 0 ? cells[c] + pad : "  " + pad + cells[c];
    }
    while (!text.empty() && text.back() == ' ') text.pop_back();
    std::fprintf(out, "%s\n", text.c_str());
  };
  line(columns_);
  size_t total = 0;
  for (size_t c = 0; c < width.size(); ++c) total += width[c] + (c == 0 ? 0 : 2);
  std::fprintf(out, "%s\n", std::string(total, '-').c_str());
  for (const auto& row : rows_) line(row);
}

void Table::to_csv(Csv& csv) const {
  for (const auto& row : rows_) {
    std::string label = row[0];
    for (size_t c = 1; c < key_columns_; ++c) label += " / " + row[c];
    for (size_t c = key_columns_; c < columns_.size(); ++c) csv.add(section_, label, columns_[c], row[c]);
  }
}

// ------------------------------------------------------------ shared memory

Result<std::unique_ptr<SharedArena>> SharedArena::create(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Status{ErrorCode::kIo, errno_text("mmap of " + std::to_string(bytes) + " shared bytes")};
  auto arena = std::make_unique<SharedArena>();
  arena->data_ = p;
  arena->size_ = bytes;
  return arena;
}

SharedArena::~SharedArena() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

// ------------------------------------------------------------ stopping

namespace {

// The names of the servers start_server_process() started (main thread only).
std::vector<std::string>& started_servers() {
  static std::vector<std::string> names;
  return names;
}

}  // namespace

void catch_stop_signals() { stop_signals::catch_signals({SIGINT, SIGTERM}); }

int stop_signal() noexcept { return stop_signals::caught(); }

Status stopped_status() {
  const int signo = stop_signal();
  return {ErrorCode::kInterrupted, "stopped by signal " + std::to_string(signo) + " (" + ::strsignal(signo) + ")"};
}

void die_of_stop_signal() { stop_signals::die_of_caught(); }

void remove_orphan_buffers() {
  for (const std::string& name : started_servers())
    for (const shm::OrphanBuffer& b : shm::orphan_buffers(name)) shm::ShmObject::remove(b.object_name);
}

// ------------------------------------------------------------ processes

Result<Child> fork_child(const std::function<int()>& fn) {
  return ChildProcess::fork_run(
      [fn] {
        stop_signals::restore_defaults();
        return fn();
      },
      /*die_with_parent=*/true);
}

bool read_full(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(fd, p + got, n - got);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

bool write_full(int fd, const void* buf, size_t n) {
  const auto* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::write(fd, p + done, n - done);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(r);
  }
  return true;
}

void StartBarrier::arrive_and_wait() noexcept {
  // Release/acquire on both words: the parent counts arrivals and releases
  // the children; nothing else is published through them.
  arrived.fetch_add(1, std::memory_order_acq_rel);                   // SYNC(bench_arrived)
  while (go.load(std::memory_order_acquire) == 0) sleep_ns(20'000);  // SYNC(bench_go)
}

namespace {

// The arena of run_children(): barrier, error text, then for every child
// and series a count and max_samples doubles.
struct ArenaHeader {
  StartBarrier barrier;
  char error[512];
};
constexpr size_t kHeaderBytes = (sizeof(ArenaHeader) + 63) / 64 * 64;

}  // namespace

Result<Series> run_children(uint32_t children, uint32_t series, size_t max_samples, const ChildBody& body,
                            const std::function<void()>& on_arrived, uint64_t run_limit_ns) {
  const size_t block = sizeof(uint64_t) + max_samples * sizeof(double);
  auto arena = SharedArena::create(kHeaderBytes + size_t{children} * series * block);
  if (!arena.ok()) return arena.status();
  char* base = static_cast<char*>((*arena)->data());
  auto* header = new (base) ArenaHeader{};
  const auto slot = [&](uint32_t child, uint32_t s) {
    return base + kHeaderBytes + (size_t{child} * series + s) * block;
  };

  std::vector<Child> procs;
  for (uint32_t k = 0; k < children; ++k) {
    auto child = fork_child([&, k]() -> int {
      Series out(series);
      Status st = body(k, header->barrier, out);
      if (!st.ok()) {
        std::snprintf(header->error, sizeof header->error, "child %u: %s", k, st.to_string().c_str());
        return 1;
      }
      for (uint32_t s = 0; s < series; ++s) {
        const size_t n = std::min(out[s].size(), max_samples);
        std::memcpy(slot(k, s), &n, sizeof n);
        if (n > 0) std::memcpy(slot(k, s) + sizeof(uint64_t), out[s].data(), n * sizeof(double));
      }
      return 0;
    });
    if (!child.ok()) return child.status();
    procs.push_back(std::move(child).value());
  }

  // Returning early, the Child destructors kill and reap the children.
  const auto failure = [&](const std::string& why) {
    const std::string text(header->error, strnlen(header->error, sizeof header->error));
    return Status{ErrorCode::kInternal, text.empty() ? why : text};
  };
  const uint64_t setup_deadline = now_ns() + 300'000'000'000ull;
  while (header->barrier.arrived.load(std::memory_order_acquire) < children) {  // SYNC(bench_arrived)
    if (stop_signal() != 0) return stopped_status();
    for (Child& p : procs) {
      int code = 0;
      if (p.try_wait(&code)) return failure("a measuring child exited with " + std::to_string(code) + " during setup");
    }
    if (now_ns() > setup_deadline)
      return Status{ErrorCode::kTimeout, "measuring children did not finish their setup within 300 s: killed"};
    sleep_ns(200'000);
  }
  if (on_arrived) on_arrived();
  header->barrier.go.store(1, std::memory_order_release);  // SYNC(bench_go)
  // Polled, not waited for: a child blocked on a dead peer (a baseline
  // server's queue, say) must not hang the benchmark. 10 ms apart: the
  // children time themselves; only the return waits for the poll.
  const uint64_t run_deadline = now_ns() + run_limit_ns;
  for (size_t running = procs.size(); running > 0;) {
    if (stop_signal() != 0) return stopped_status();
    running = 0;
    for (Child& p : procs) {
      if (!p.running()) continue;
      int code = 0;
      if (!p.try_wait(&code)) {
        ++running;
        continue;
      }
      if (code != 0) return failure("a measuring child exited with " + std::to_string(code));
    }
    if (running == 0) break;
    if (now_ns() > run_deadline)
      return Status{ErrorCode::kTimeout, std::to_string(running) + " of " + std::to_string(children) +
                                             " measuring children still running " +
                                             std::to_string(run_limit_ns / 1'000'000'000) +
                                             " s after the start barrier: killed (a peer that stopped answering?)"};
    sleep_ns(10'000'000);
  }

  Series merged(series);
  for (uint32_t k = 0; k < children; ++k) {
    for (uint32_t s = 0; s < series; ++s) {
      uint64_t n = 0;
      std::memcpy(&n, slot(k, s), sizeof n);
      const auto* samples = reinterpret_cast<const double*>(slot(k, s) + sizeof(uint64_t));
      merged[s].insert(merged[s].end(), samples, samples + n);
    }
  }
  return merged;
}

// ------------------------------------------------------------ parallel copy

namespace {
// The part of a `bytes` copy that thread `index` of `threads` does: equal
// parts on 64-byte boundaries, the last thread's taking the rest.
std::pair<size_t, size_t> copy_part(size_t bytes, uint32_t index, uint32_t threads) {
  const size_t part = bytes / threads / 64 * 64;
  const size_t begin = part * index;
  return {begin, index + 1 == threads ? bytes - begin : part};
}
}  // namespace

ParallelCopy::ParallelCopy(uint32_t threads) : threads_(std::max(threads, 1u)) {
  helpers_.reserve(threads_ - 1);
  for (uint32_t i = 0; i + 1 < threads_; ++i) helpers_.emplace_back([this, i] { help(i); });
}

ParallelCopy::~ParallelCopy() {
  stop_ = true;
  posted_.fetch_add(1, std::memory_order_release);  // SYNC(copy_posted): stop_
  posted_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

void ParallelCopy::operator()(void* dst, const void* src, size_t bytes) {
  const uint32_t n = threads_ - 1;  // helpers
  dst_ = static_cast<char*>(dst);
  src_ = static_cast<const char*>(src);
  bytes_ = bytes;
  // relaxed: no helper touches finished_ until the post below.
  finished_.store(0, std::memory_order_relaxed);
  posted_.fetch_add(1, std::memory_order_release);  // SYNC(copy_posted): the copy's arguments
  posted_.notify_all();
  const auto [begin, length] = copy_part(bytes, n, threads_);
  std::memcpy(dst_ + begin, src_ + begin, length);
  // SYNC(copy_finished): the helpers' parts are written.
  for (uint32_t done; (done = finished_.load(std::memory_order_acquire)) != n;)
    finished_.wait(done, std::memory_order_acquire);  // SYNC(copy_finished)
}

void ParallelCopy::help(uint32_t index) {
  uint32_t seen = 0;
  while (true) {
    posted_.wait(seen, std::memory_order_acquire);   // SYNC(copy_posted)
    seen = posted_.load(std::memory_order_acquire);  // SYNC(copy_posted)
    if (stop_) return;
    const auto [begin, length] = copy_part(bytes_, index, threads_);
    std::memcpy(dst_ + begin, src_ + begin, length);
    finished_.fetch_add(1, std::memory_order_release);  // SYNC(copy_finished)
    finished_.notify_one();
  }
}

// ------------------------------------------------------------ shmps-server

Result<std::unique_ptr<ServerProcess>> start_server_process(const std::string& server_path, const std::string& name,
                                                            const std::vector<std::string>& args,
                                                            const std::string& log_path) {
  ServerProcess::Options o;
  o.binary = server_path;
  o.name = name;
  o.args = args;
  o.spawn.log_path = log_path;
  o.spawn.die_with_parent = true;
  o.start_timeout = std::chrono::seconds(120);
  started_servers().push_back(name);
  return ServerProcess::start(o);
}

std::string segment_name(const std::string& tag) { return "bench_" + std::to_string(::getpid()) + "_" + tag; }

uint64_t segment_bytes(const std::string& name) {
  struct stat st {};
  if (::stat(("/dev/shm/" + shm::segment_object_name(name)).c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_size);
}

uint64_t proc_status_bytes(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::istringstream fields(line.substr(field.size() + 1));
    uint64_t value = 0;
    std::string unit;
    fields >> value >> unit;
    return unit == "kB" ? value * 1024 : value;
  }
  return 0;
}

uint64_t process_cpu_ns(pid_t pid) {
  std::error_code ec;
  uint64_t total = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    uint64_t on_cpu = 0;
    if (in >> on_cpu) total += on_cpu;
  }
  return total;
}

// ------------------------------------------------------------ references

namespace {

struct alignas(64) SpinPage {
  alignas(64) std::atomic<uint64_t> ping{0};
  alignas(64) std::atomic<uint64_t> pong{0};
};

// Spins until word == value; false after ~10 s (the peer died).
bool spin_until(const std::atomic<uint64_t>& word, uint64_t value) {
  uint64_t spins = 0;
  const uint64_t deadline = now_ns() + 10'000'000'000ull;
  // acquire: SYNC(spin_pingpong), pairs with the peer's release store of the word.
  while (word.load(std::memory_order_acquire) != value) {
    shm::cpu_relax();  // the pause of shmps's own spins: the reference polls as they do
    if ((++spins & 0xFFFF) == 0 && now_ns() > deadline) return false;
  }
  return true;
}

}  // namespace

Result<std::vector<double>> spin_pingpong(uint32_t warmup, uint32_t n) {
  auto page = SharedArena::create(sizeof(SpinPage));
  if (!page.ok()) return page.status();
  auto* p = new ((*page)->data()) SpinPage{};
  auto r = run_children(2, 1, n, [&](uint32_t k, StartBarrier& barrier, Series& out) -> Status {
    barrier.arrive_and_wait();
    for (uint64_t i = 1; i <= uint64_t{warmup} + n; ++i) {
      if (k == 1) {
        if (!spin_until(p->ping, i)) return {ErrorCode::kTimeout, "spin ping-pong: no ping"};
        p->pong.store(i, std::memory_order_release);  // SYNC(spin_pingpong)
        continue;
      }
      const uint64_t t0 = now_ns();
      p->ping.store(i, std::memory_order_release);  // SYNC(spin_pingpong)
      if (!spin_until(p->pong, i)) return {ErrorCode::kTimeout, "spin ping-pong: no pong"};
      const uint64_t t1 = now_ns();
      if (i > warmup) out[0].push_back(static_cast<double>(t1 - t0));
    }
    return Status::Ok();
  });
  if (!r.ok()) return r.status();
  return std::move(r.value()[0]);
}

}  // namespace shmps::bench
