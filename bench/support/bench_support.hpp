// shmps_bench_support: the building blocks of the benchmark programs
// (shmps-bench, shmps-compare, shmps-gpu-bench): their common command line,
// sample statistics, aligned tables and goals that also feed a CSV file,
// anonymous MAP_SHARED memory that forked children write their samples into,
// forked measuring children with a start barrier, and shmps-server child
// processes.
// Single-threaded: use from the bench's main thread (children are processes).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <boost/program_options/options_description.hpp>

#include "shmps/server_process.hpp"
#include "shmps/status.hpp"

namespace shmps::bench {

// ------------------------------------------------------------ command line

// The options both benchmarks take (--help, --quick, --repeats, --csv,
// --section, --server, --server-arg), parsed in one place.
struct CommonOptions {
  bool quick = false;
  uint32_t repeats = 0;  // as given; 0 when not given (the program's default applies)
  bool repeats_given = false;
  std::string csv_path;                  // "" : no CSV
  std::vector<int> sections;             // every section when not given
  std::string server_path;               // beside this program (/proc/self/exe) unless --server
  std::vector<std::string> server_args;  // appended to every shmps-server's command line
};

// Parses argv: the common options plus the program's own `extra` (bound to
// its variables by the caller). Returns nullopt to go on, or the exit code
// to return: 0 after --help (printed), 2 after a bad option (printed to
// stderr after "<program>: "). Also refuses --repeats 0, a section outside
// 1..max_section and a server path that is not executable. Fills
// out.sections with 1..max_section when none is given.
std::optional<int> parse_command_line(int argc, char** argv, const std::string& program, const std::string& caption,
                                      int max_section, const boost::program_options::options_description& extra,
                                      CommonOptions& out);

// `file` in the folder of this program (/proc/self/exe), or `file` alone
// when that link cannot be read.
std::string beside_this_program(const std::string& file);

// The CPUs this process may run on (sched_getaffinity: taskset, a cgroup's
// cpuset), at least 1; std::thread::hardware_concurrency() counts every
// online CPU, usable or not. Children forked or spawned inherit the mask.
uint32_t usable_cpus() noexcept;

// The 1-minute load average (/proc/loadavg): other processes competing for
// the CPUs; "?" when unreadable.
std::string load_average();
// Prints "Environment: NAME=value" for each OpenMP variable that is set
// (OMP_NUM_THREADS, OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_PROC_BIND): the
// server children and in-process applies inherit them.
void print_omp_environment(std::FILE* out);

// ------------------------------------------------------------ time and stats

// CLOCK_MONOTONIC in nanoseconds.
uint64_t now_ns() noexcept;
// nanosleep; an interrupted sleep just ends early.
void sleep_ns(long ns) noexcept;

// Nearest-rank percentile, q in [0, 1]; NaN for an empty set.
double percentile(std::vector<double> samples, double q);
// The fewest samples a q-percentile is reported from: 10 / (1 - q), so
// that 10 samples at least lie above it (p50: 20, p99: 1,000, p99.9:
// 10,000); 1 for the maximum (q = 1). From fewer, the percentile is one of
// the few largest samples, which says little about the tail.
size_t min_samples_for(double q);
// percentile(), or NaN (printed "-") from fewer than min_samples_for(q).
double reported_percentile(std::vector<double> samples, double q);
// The middle sample (the mean of the two middle ones for an even count).
double median(std::vector<double> samples);

// "12.3", "1234" ...: `digits` after the point; "-" for NaN.
std::string fixed(double value, int digits);

// ------------------------------------------------------------ report

// Collects every printed cell as a tidy CSV row: section,row,column,value.
class Csv {
 public:
  void add(const std::string& section, const std::string& row, const std::string& column, const std::string& value);
  // Errors: kIo naming the file.
  Status write(const std::string& path) const;

 private:
  std::string text_ = "section,row,column,value\n";
};

// A plain-text table: the first column left-aligned, the others right-aligned.
class Table {
 public:
  // `key_columns`: how many leading columns name a row (its CSV label, the
  // cells joined with " / "); every row's label must differ.
  Table(std::string section, std::vector<std::string> columns, size_t key_columns = 1);
  void add_row(std::vector<std::string> cells);  // as many cells as columns
  void print(std::FILE* out) const;
  void to_csv(Csv& csv) const;

 private:
  std::string section_;
  std::vector<std::string> columns_;
  size_t key_columns_;
  std::vector<std::vector<std::string>> rows_;
};

// One goal of a benchmark: what it asks, the figure measured, and whether
// that figure meets it.
struct Goal {
  std::string text;
  std::string measured;
  bool met;
};

// ------------------------------------------------------------ shared memory

// Anonymous MAP_SHARED memory: a fork()ed child writes, the parent reads.
class SharedArena {
 public:
  SharedArena() = default;
  // Errors: kIo with errno text.
  static Result<std::unique_ptr<SharedArena>> create(size_t bytes);
  ~SharedArena();
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;
  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// ------------------------------------------------------------ processes

// read()/write() of exactly n bytes, retried after EINTR and short
// transfers; false at end of file, on an error or a receive timeout.
bool read_full(int fd, void* buf, size_t n);
bool write_full(int fd, const void* buf, size_t n);

// ------------------------------------------------------------ stopping

// A benchmark stopped by SIGINT (Ctrl-C) or SIGTERM cleans up before it
// dies: catch_stop_signals() (the parent, first thing) makes the signal a
// flag; run_children() and the other waits here see it, kill their
// children and return kInterrupted; the program unwinds (its servers
// stopped, their segments removed), calls remove_orphan_buffers() and
// then die_of_stop_signal(), so that a shell sees a process killed by the
// signal. A second signal takes its default action at once. A signal the
// benchmark was started with ignored stays ignored; children forked by
// fork_child() take the default actions again.
void catch_stop_signals();
// The signal caught, or 0.
int stop_signal() noexcept;
// kInterrupted naming the signal caught.
Status stopped_status();
// Dies of the signal caught (returns when none was).
void die_of_stop_signal();
// Removes the buffer objects of every server start_server_process() has
// started in this process that no live process owns (shm::orphan_buffers):
// those of measuring children killed before they could unregister.
void remove_orphan_buffers();

// A benchmark's child process (shmps::ChildProcess), forked running a
// function, which dies with the benchmark; it takes the default action of
// SIGINT and SIGTERM again (catch_stop_signals()).
using Child = ChildProcess;
Result<Child> fork_child(const std::function<int()>& fn);

// The start barrier of concurrent measuring children: each calls
// arrive_and_wait() once its setup is done; the parent releases all at once.
struct StartBarrier {
  std::atomic<uint32_t> arrived{0};
  std::atomic<uint32_t> go{0};
  void arrive_and_wait() noexcept;
};

// Per child, one vector of samples per series (e.g. memcpy ns, push ns).
using Series = std::vector<std::vector<double>>;

// How long run_children() lets its children run after the start barrier
// before it kills them: far beyond any section's run, so only a hang (a
// child blocked on a dead peer) reaches it.
inline constexpr uint64_t kChildrenRunLimitNs = 600'000'000'000ull;

// Forks `children` processes that run body(index, barrier, series) with
// `series` empty series each; body must call barrier.arrive_and_wait()
// exactly once, after its setup and before timing. The parent releases the
// barrier when all arrived, waits for all, and returns, per series, every
// child's samples concatenated (child 0 first). At most `max_samples` per
// series and child. `on_arrived`, when given, runs in the parent once all
// children wait at the barrier, before it releases them (e.g. to read their
// peer's /proc while they hold still). Errors: a child's Status (its
// message) or its death; kTimeout when the children are not all at the
// barrier within 300 s or not all done `run_limit_ns` after it (they are
// killed); kInterrupted on a stop signal (stopped_status()). Children still
// running when it returns are killed and reaped.
using ChildBody = std::function<Status(uint32_t index, StartBarrier& barrier, Series& out)>;
Result<Series> run_children(uint32_t children, uint32_t series, size_t max_samples, const ChildBody& body,
                            const std::function<void()>& on_arrived = {}, uint64_t run_limit_ns = kChildrenRunLimitNs);

// The physical reference of every latency figure: two processes, two
// atomics on separate cache lines of one MAP_SHARED page, bouncing a
// counter. Returns n round-trip times in ns after `warmup` untimed ones.
// Errors: kTimeout when the peer stops answering for ~10 s, run_children's.
Result<std::vector<double>> spin_pingpong(uint32_t warmup, uint32_t n);

// A memcpy split over `threads` threads, the caller's among them: the
// others start with the object and park on a futex between copies, so a
// timed copy pays their wake-up (microseconds), never a thread's start or
// join. The reference of an apply that OpenMP splits over as many threads.
// One calling thread at a time; construct it in the process that copies
// (threads do not survive a fork).
class ParallelCopy {
 public:
  explicit ParallelCopy(uint32_t threads);
  ~ParallelCopy();
  ParallelCopy(const ParallelCopy&) = delete;
  ParallelCopy& operator=(const ParallelCopy&) = delete;
  uint32_t threads() const noexcept { return threads_; }
  // Copies `bytes` from src to dst; returns once every thread's part is done.
  void operator()(void* dst, const void* src, size_t bytes);

 private:
  void help(uint32_t index);
  const uint32_t threads_;  // the helpers and the caller
  // The copy in progress: written by the caller before posted_'s release,
  // read by the helpers after its acquire.
  char* dst_ = nullptr;
  const char* src_ = nullptr;
  size_t bytes_ = 0;
  bool stop_ = false;
  std::atomic<uint32_t> posted_{0};    // copies posted (the helpers wait on it)
  std::atomic<uint32_t> finished_{0};  // helpers done with the copy posted last
  std::vector<std::thread> helpers_;
};

// Keeps the compiler from dropping stores to *p as dead (a timed loop's
// output nobody reads).
inline void escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }

// ------------------------------------------------------------ shmps-server

// A shmps-server child (shmps::ServerProcess) on segment `name`, its
// output appended to `log_path`, dying with the benchmark; returns once a
// worker can attach (120 s at most). The server is stopped (SIGTERM, then
// SIGKILL after 10 s) and its segment removed when the pointer goes.
Result<std::unique_ptr<ServerProcess>> start_server_process(const std::string& server_path, const std::string& name,
                                                            const std::vector<std::string>& args,
                                                            const std::string& log_path);

// A unique --name for this bench run: "bench_<pid>_<tag>".
std::string segment_name(const std::string& tag);

// Size in bytes of the control segment /dev/shm/shmps.<name>; 0 when absent.
uint64_t segment_bytes(const std::string& name);

// A "Vm..."/"Rss..." field of /proc/<pid>/status in bytes; 0 when absent.
uint64_t proc_status_bytes(pid_t pid, const std::string& field);

// CPU time all live threads of `pid` have run so far, ns (the sum of
// /proc/<pid>/task/*/schedstat); 0 when unreadable.
uint64_t process_cpu_ns(pid_t pid);

}  // namespace shmps::bench
