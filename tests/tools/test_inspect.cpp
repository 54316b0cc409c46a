// shmps-inspect: the real binary against a live shmps-server and its
// worker, against saved and corrupted copies of a segment, and the model's
// decoder against crafted garbage in an in-process segment image.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define BOOST_TEST_MODULE test_inspect
#include <algorithm>
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "inspect_model.hpp"
#include "inspect_source.hpp"
#include "raw_client.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/unique_fd.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using nlohmann::json;
using namespace shmps;

namespace {

// A sanitizer build keeps shadow memory for what the tool touches
// (ThreadSanitizer several times it), and --list under ctest -j2 also
// copies the segments of tests running beside it: the bounds on the tool's
// peak RSS are widened there. The failures they guard against (a whole
// 256 MiB object copied) still exceed them.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr long kRssScale = 4;
#else
constexpr long kRssScale = 1;
#endif

const std::vector<std::string> kTensorArgs{"--tensor", "fc.weight:4x3", "--tensor", "fc.bias:4"};
constexpr uint64_t kAllBytes = 16 * sizeof(float);  // both tensors, fp32

// A path under the temp folder, removed at scope exit.
struct TempFile {
  std::string path = (std::filesystem::temp_directory_path() / test::unique_name("shmps_inspect")).string();
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  BOOST_REQUIRE(out.good());
}

std::string segment_bytes(const std::string& name) {
  return shmps::test::read_file("/dev/shm/" + shm::segment_object_name(name));
}

struct Run {
  int rc = -1;  // exit code, 128 + signal, or -1 on timeout
  std::string out, err;
  long max_rss_kb = 0;  // the child's peak resident set
};

// shmps-inspect as a child, its stdout and stderr captured in files.
class Inspect {
 public:
  explicit Inspect(const std::vector<std::string>& args) {
    std::vector<std::string> argv{test::program_path("shmps-inspect")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargs;
    for (auto& a : argv) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    pid_ = ::fork();
    BOOST_REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      const int o = ::open(out_.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int e = ::open(err_.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (o < 0 || e < 0 || ::dup2(o, 1) < 0 || ::dup2(e, 2) < 0) _exit(126);
      ::execv(cargs[0], cargs.data());
      _exit(127);
    }
  }
  ~Inspect() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Inspect(const Inspect&) = delete;
  Inspect& operator=(const Inspect&) = delete;

  void signal(int signo) const { ::kill(pid_, signo); }
  std::string out_so_far() const { return shmps::test::read_file(out_.path); }
  // Waits for the exit (SIGKILL after `timeout`: rc -1).
  Run finish(std::chrono::seconds timeout = std::chrono::seconds(30)) {
    Run r;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (pid_ > 0) {
      int status = 0;
      struct rusage usage {};
      if (::wait4(pid_, &status, WNOHANG, &usage) == pid_) {
        r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        r.max_rss_kb = usage.ru_maxrss;
        pid_ = -1;
      } else if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    r.out = shmps::test::read_file(out_.path);
    r.err = shmps::test::read_file(err_.path);
    return r;
  }

 private:
  TempFile out_, err_;
  pid_t pid_ = -1;
};

Run run_inspect(const std::vector<std::string>& args) { return Inspect(args).finish(); }

json parse_json(const Run& r) {
  BOOST_REQUIRE_MESSAGE(r.rc == 0, "shmps-inspect exited " << r.rc << ": " << r.err);
  try {
    return json::parse(r.out);
  } catch (const json::exception& e) {
    BOOST_FAIL("not JSON (" << e.what() << "): " << r.out);
  }
  return {};
}

// `--list --json`'s rows by segment name.
std::map<std::string, json> list_rows() {
  const json list = parse_json(run_inspect({"--list", "--json"}));
  std::map<std::string, json> rows;
  for (const json& row : list["segments"]) rows[row["name"].get<std::string>()] = row;
  return rows;
}

using test::connect;

// Overwrites `value` at `offset` of a byte string.
template <typename T>
void poke(std::string* bytes, size_t offset, T value) {
  BOOST_REQUIRE(offset + sizeof value <= bytes->size());
  std::memcpy(bytes->data() + offset, &value, sizeof value);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// SIGSTOPs a process for the scope: SIGCONT at its end, before a
// ServerProcess declared earlier stops the server.
class StoppedFor {
 public:
  explicit StoppedFor(pid_t pid) : pid_(pid) { stopped_ = ::kill(pid_, SIGSTOP) == 0; }
  ~StoppedFor() {
    if (pid_ > 0) ::kill(pid_, SIGCONT);
  }
  // The process was reaped: its pid may be another's by the scope's end.
  void forget() { pid_ = 0; }
  StoppedFor(const StoppedFor&) = delete;
  StoppedFor& operator=(const StoppedFor&) = delete;
  // Whether the process was seen stopped (/proc) within the usual wait.
  bool seen_stopped() const {
    return stopped_ && test::eventually([this] { return shm::pid_state(pid_) == shm::ProcessState::kStopped; });
  }

 private:
  pid_t pid_;
  bool stopped_;
};

}  // namespace

// Removes an in-process test segment's name at scope exit.
struct RemoveSegment {
  std::string name;
  ~RemoveSegment() { shm::Segment::remove(name); }
};

// A published in-process segment (sgd, host backend) of `tensors`.
std::unique_ptr<shm::Segment> crafted_segment(const std::string& name, std::vector<shm::TensorSpec> tensors,
                                              uint32_t max_workers = 2, uint32_t lane_capacity = 4) {
  shm::SegmentSpec spec;
  spec.name = name;
  spec.tensors = std::move(tensors);
  spec.max_workers = max_workers;
  spec.max_buffers = 1;
  spec.lane_capacity = lane_capacity;
  spec.config.optimizer_kind = 1;  // sgd
  spec.config.backend = 1;         // host
  auto seg = shm::Segment::create(spec, 7);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  (*seg)->publish();
  return std::move(seg).value();
}

BOOST_AUTO_TEST_SUITE(inspect_tool)

BOOST_AUTO_TEST_CASE(live_segment_as_json) {
  const std::string name = test::unique_name("insp");
  // The backend pinned, so the JSON's value is known on a host with a GPU.
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--backend", "host"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE_MESSAGE(buffer.ok(), buffer.status().to_string());
  std::memset(buffer->data, 0, kAllBytes);
  auto pushed = worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 0);
  BOOST_REQUIRE_MESSAGE(pushed.ok(), pushed.status().to_string());
  BOOST_TEST(*pushed == 1u);

  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_TEST(j["source"] == "/dev/shm/shmps." + name);
  const json& h = j["header"];
  BOOST_TEST(h["magic"] == "0x31474553504d4853");
  BOOST_TEST(h["layout_version"] == shmps::shm::kLayoutVersion);
  BOOST_TEST(h["server_pid"] == server.process().pid());
  BOOST_TEST(h["server_alive"] == true);
  BOOST_TEST(h["state"] == "running");
  BOOST_TEST(h["heartbeat_age_ms"].is_number());
  char generation[24];
  std::snprintf(generation, sizeof generation, "0x%016llx", static_cast<unsigned long long>(worker->generation()));
  BOOST_TEST(h["generation"] == generation);
  BOOST_TEST(h["heartbeat_ns"].is_string());
  BOOST_TEST(std::stoull(h["heartbeat_ns"].get<std::string>()) > 0u);
  BOOST_TEST(j["config"]["optimizer"] == "sgd");
  BOOST_TEST(j["config"]["backend"] == "host");

  BOOST_REQUIRE(j["tensors"].size() == 2u);
  BOOST_TEST(j["tensors"][0]["name"] == "fc.weight");
  BOOST_TEST(j["tensors"][0]["shape"] == json({"4", "3"}));
  BOOST_TEST(j["tensors"][0]["elements"] == "12");
  BOOST_TEST(j["tensors"][1]["name"] == "fc.bias");
  BOOST_TEST(j["tensors"][1]["offset"] == "12");

  BOOST_REQUIRE(j["workers"].size() == 1u);
  const json& w = j["workers"][0];
  BOOST_TEST(w["id"] == worker->worker_id());
  BOOST_TEST(w["pid"] == ::getpid());
  BOOST_TEST(w["pid_alive"] == true);
  BOOST_TEST(w["state"] == "attached");
  // 64-bit values that may pass 2^53 are strings (jq and JavaScript round
  // numbers there): the random ones in hex, as the text shows them.
  BOOST_TEST(w["lease"].is_string());
  BOOST_TEST(w["lease"].get<std::string>().rfind("0x", 0) == 0u);
  BOOST_TEST(w["lease"] != "0x0000000000000000");
  BOOST_TEST(w["last_request_ns"].is_string());
  BOOST_TEST(std::stoull(w["last_request_ns"].get<std::string>()) > 0u);
  BOOST_TEST(w["pushes_applied"] == 1);
  BOOST_TEST(w["pushes_rejected"] == 0);
  BOOST_REQUIRE(w["buffers"].size() == 1u);
  BOOST_TEST(w["buffers"][0]["kind"] == "host_shm");
  BOOST_TEST(w["buffers"][0]["length"] == std::to_string(kAllBytes));
  BOOST_TEST(contains(w["buffers"][0]["name"].get<std::string>(), "shmps." + name + ".p"));

  BOOST_TEST(j["lanes"].empty());  // the server served everything
  BOOST_REQUIRE(j["completions"].size() == 1u);
  BOOST_TEST(j["completions"][0]["corrupt"] == false);
  BOOST_TEST(j["completions"][0]["depth"] == 0);

  const json& st = j["stats"];
  BOOST_TEST(st["version"] == 1);
  BOOST_TEST(st["gradients_applied"] == 1);
  BOOST_TEST(st["workers_attached"] == 1);
  BOOST_TEST(st["mappings_opened"] == 1);
  BOOST_TEST(st["rejected"].empty());
}

// What the staleness policy did, in JSON, text and Prometheus: a push 2
// versions old under scale, bound 1, is applied with half the lr.
BOOST_AUTO_TEST_CASE(staleness_policy_counters_in_every_format) {
  const std::string name = test::unique_name("policy");
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--staleness-policy", "scale", "--max-staleness", "1"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  std::memset(buffer->data, 0, kAllBytes);
  for (int k = 0; k < 3; ++k)  // versions 0, 0, 0: staleness 0, 1, 2
    BOOST_REQUIRE(worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 0).ok());

  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_TEST(j["config"]["staleness_policy"] == "scale");
  BOOST_TEST(j["stats"]["pushes_scaled"] == 1);
  BOOST_TEST(j["stats"]["scale_factor_sum_micro"] == 500000);
  BOOST_TEST(j["stats"]["pulls_waited"] == 0);
  BOOST_TEST(j["stats"]["pulls_held"] == 0);
  BOOST_TEST(j["stats"]["wait_ns"] == "0");      // ns: a string
  BOOST_TEST(j["stats"]["apply_threads"] == 0);  // no tensor from 4 MiB yet
  BOOST_REQUIRE(j["workers"].size() == 1u);
  BOOST_TEST(j["workers"][0]["pushes_scaled"] == 1);
  BOOST_TEST(j["workers"][0]["scale_factor_sum_micro"] == 500000);
  BOOST_TEST(j["workers"][0]["pulls_timed_out"] == 0);
  BOOST_TEST(j["workers"][0]["wait_ns"] == "0");

  const Run text = run_inspect({name});
  BOOST_TEST(contains(text.out, "max_staleness   1 (policy scale)"), text.out);
  BOOST_TEST(contains(text.out, "pushes scaled 1 (mean factor 0.5)"), text.out);
  BOOST_TEST(contains(text.out, "pulls held 0 (0 ns in all, 0 timed out), pushes scaled 1 (mean factor 0.5)\n"),
             text.out);
  BOOST_TEST(
      contains(text.out, "staleness policy pulls held 0 (0 ns in all), 0 now, pushes scaled 1 (mean factor 0.5)"),
      text.out);

  const Run prom = run_inspect({"--format", "prometheus", name});
  const std::string n = "{name=\"" + name + "\"";
  BOOST_TEST(contains(prom.out, "\nshmps_pushes_scaled_total" + n + "} 1\n"), prom.out);
  BOOST_TEST(contains(prom.out, "\nshmps_scale_factor_sum_total" + n + "} 0.5\n"), prom.out);
  BOOST_TEST(contains(prom.out, "# TYPE shmps_wait_seconds_total counter\nshmps_wait_seconds_total" + n + "} 0\n"),
             prom.out);
  BOOST_TEST(contains(prom.out, ",staleness_policy=\"scale\"} 1\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_worker_pushes_scaled_total" + n), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_worker_scale_factor_sum_total" + n), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_worker_pulls_timed_out_total" + n), prom.out);
}

// The server's histograms: apply time and staleness of every applied push,
// queueing time of every request taken, in the JSON (buckets, count, max,
// p50/p99), the text and Prometheus. A request published while the server
// is stopped (SIGSTOP) shows the stop in queue_ns's max.
BOOST_AUTO_TEST_CASE(histograms_of_apply_queue_and_staleness) {
  const std::string name = test::unique_name("hist");
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--max-staleness", "100"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  std::memset(buffer->data, 0, kAllBytes);
  for (uint64_t v = 0; v < 10; ++v)  // staleness 0 each time
    BOOST_REQUIRE(worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, v).ok());
  BOOST_REQUIRE(worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 3).ok());  // staleness 7
  // A push published while the server is stopped waits in its lane.
  BOOST_REQUIRE(::kill(server.process().pid(), SIGSTOP) == 0);
  // kill() returns before the server has stopped: publish only once it has.
  BOOST_REQUIRE(
      test::eventually([&] { return shm::pid_state(server.process().pid()) == shm::ProcessState::kStopped; }));
  auto ticket = worker->push_async(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 11);
  BOOST_REQUIRE(ticket.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  BOOST_REQUIRE(::kill(server.process().pid(), SIGCONT) == 0);
  BOOST_REQUIRE(worker->wait(*ticket).ok());

  const json j = parse_json(run_inspect({"--json", name}));
  const json& h = j["stats"]["histograms"];
  BOOST_TEST_CONTEXT(h.dump()) {
    const uint64_t applied = j["stats"]["gradients_applied"];
    BOOST_TEST(applied == 12u);
    BOOST_TEST(h["apply_ns"]["unit"] == "ns");
    BOOST_TEST(h["apply_ns"]["count"] == applied);
    // max, p50 and p99 are strings of digits, as sum (ns may pass 2^53).
    const auto digits = [](const json& v) { return std::stoull(v.get<std::string>()); };
    BOOST_TEST(digits(h["apply_ns"]["p50"]) > 0u);  // an apply takes time
    BOOST_TEST(digits(h["apply_ns"]["p99"]) >= digits(h["apply_ns"]["p50"]));
    BOOST_TEST(h["staleness"]["count"] == applied);
    BOOST_TEST(h["staleness"]["buckets"][0] == 11);  // staleness 0
    BOOST_TEST(h["staleness"]["buckets"][3] == 1);   // 7 is in [4, 8)
    BOOST_TEST(h["staleness"]["max"] == "7");
    BOOST_TEST(h["staleness"]["p50"] == "0");
    // Every request taken (attach, register, the pushes; not inspect's reads).
    BOOST_TEST(h["queue_ns"]["count"] == j["stats"]["requests"]);
    BOOST_TEST(digits(h["queue_ns"]["max"]) >= 250'000'000u);  // the 300 ms stop
    BOOST_TEST(digits(h["queue_ns"]["p50"]) < 250'000'000u);
    uint64_t sum = 0;
    for (const json& b : h["queue_ns"]["buckets"]) sum += b.get<uint64_t>();
    BOOST_TEST(sum == h["queue_ns"]["count"].get<uint64_t>());
  }
  const Run text = run_inspect({name});
  BOOST_TEST(contains(text.out, "  staleness       12, p50 <= 0, p99 <= 7, max 7\n"), text.out);
  BOOST_TEST(contains(text.out, "  apply_ns        12, p50 <= "), text.out);

  const Run prom = run_inspect({"--format", "prometheus", name});
  BOOST_REQUIRE(prom.rc == 0);
  const std::string n = "name=\"" + name + "\"";
  BOOST_TEST(contains(prom.out, "# TYPE shmps_apply_seconds histogram\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_apply_seconds_bucket{" + n + ",le=\"+Inf\"} 12\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_apply_seconds_count{" + n + "} 12\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_staleness_bucket{" + n + ",le=\"0\"} 11\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_staleness_bucket{" + n + ",le=\"7\"} 12\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_staleness_sum{" + n + "} 7\n"), prom.out);
  BOOST_TEST(contains(prom.out, "# TYPE shmps_queue_seconds histogram\n"), prom.out);
}

// --format prometheus: the text exposition format, each family with HELP
// and TYPE before its samples, counters named *_total, every sample
// labelled with the server's name; the values match the segment.
BOOST_AUTO_TEST_CASE(live_segment_in_prometheus_format) {
  const std::string name = test::unique_name("prom");
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--max-staleness", "0"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  std::memset(buffer->data, 0, kAllBytes);
  BOOST_REQUIRE(worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 0).ok());
  BOOST_REQUIRE(worker->pull(kAllTensors, buffer->id, 0).ok());
  // A push computed at version 0, now 1 behind (bound 0): one stale rejection.
  BOOST_TEST(
      (worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 0).status().code() == ErrorCode::kStale));

  const Run r = run_inspect({"--format", "prometheus", name});
  BOOST_REQUIRE_MESSAGE(r.rc == 0, r.err);
  static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} (-?[0-9.eE+-]+|NaN|[+-]Inf)$)");
  static const std::regex comment(R"(^# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$)");
  std::map<std::string, std::string> type_of;
  std::map<std::string, double> value;  // "<metric>{<labels>}" -> value
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, comment)) {
      if (m[1] == "TYPE") {
        BOOST_TEST((m[3] == "counter" || m[3] == "gauge" || m[3] == "histogram"), line);
        BOOST_TEST(type_of.count(m[2]) == 0u, "family declared twice: " << line);
        type_of[m[2]] = m[3];
        const std::string metric = m[2];
        BOOST_TEST((m[3] == "counter") == (metric.size() > 6 && metric.substr(metric.size() - 6) == "_total"), line);
      }
      continue;
    }
    BOOST_REQUIRE_MESSAGE(std::regex_match(line, m, sample), "not a sample line: '" << line << "'");
    // A histogram's samples are <family>_bucket, _sum and _count.
    std::string family = m[1];
    for (const std::string suffix : {"_bucket", "_sum", "_count"}) {
      if (type_of.count(family) != 0 || family.size() <= suffix.size() ||
          family.compare(family.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const auto base = type_of.find(family.substr(0, family.size() - suffix.size()));
      if (base != type_of.end() && base->second == "histogram") family = base->first;
    }
    BOOST_TEST(type_of.count(family) == 1u, "sample before its TYPE: " << line);
    BOOST_TEST(m[2].str().rfind("name=\"" + name + "\"", 0) == 0u, line);
    value[m[1].str() + "{" + m[2].str() + "}"] = std::stod(m[3]);
  }
  const std::string n = "{name=\"" + name + "\"";
  // at(): a series that is missing fails instead of reading as 0.
  const auto at = [&value](const std::string& series) {
    BOOST_TEST_REQUIRE(value.count(series) == 1u, "no series " << series);
    return value.at(series);
  };
  BOOST_TEST(at(std::string("shmps_up") + n + "}") == 1.0);
  BOOST_TEST(at("shmps_gradients_applied_total" + n + "}") == 1.0);
  BOOST_TEST(at("shmps_weights_pulled_total" + n + "}") == 1.0);
  BOOST_TEST(at("shmps_version" + n + "}") == 1.0);
  BOOST_TEST(at("shmps_workers_attached" + n + "}") == 1.0);
  BOOST_TEST(at("shmps_parameters" + n + "}") == 16.0);
  BOOST_TEST(at("shmps_requests_rejected_total" + n + ",cause=\"stale\"}") == 1.0);
  BOOST_TEST(at("shmps_requests_rejected_total" + n + ",cause=\"non_finite\"}") == 0.0);
  const std::string worker_labels =
      n + ",worker=\"" + std::to_string(worker->worker_id()) + "\",pid=\"" + std::to_string(::getpid()) + "\"}";
  BOOST_TEST(at("shmps_worker_pushes_applied_total" + worker_labels) == 1.0);
  BOOST_TEST(at("shmps_worker_pushes_rejected_total" + worker_labels) == 1.0);
  BOOST_TEST(at("shmps_worker_pulls_total" + worker_labels) == 1.0);
  BOOST_TEST(at("shmps_worker_last_request_age_seconds" + worker_labels) >= 0.0);
  BOOST_TEST(at("shmps_applied_bytes_total" + n + "}") == static_cast<double>(kAllBytes));
  BOOST_TEST(at("shmps_worker_applied_bytes_total" + worker_labels) == static_cast<double>(kAllBytes));
  BOOST_TEST(at("shmps_server_state" + n + "}") == 2.0);  // running
  BOOST_TEST(type_of["shmps_avg_staleness"] == "gauge");  // avg_staleness_micro, in versions

  BOOST_TEST(run_inspect({"--format", "yaml", name}).rc == 1);
  BOOST_TEST(run_inspect({"--format", "prometheus", "--json", name}).rc == 1);
  BOOST_TEST(run_inspect({"--format", "text", "--json", name}).rc == 1);
  BOOST_TEST(run_inspect({"--format", "prometheus", "--watch", name}).rc == 1);
  // No segment: shmps_up 0 alone, so a textfile scrape sees the server down.
  const std::string gone = test::unique_name("promgone");
  const Run down = run_inspect({"--format", "prometheus", gone});
  BOOST_TEST(down.rc == 2);
  BOOST_TEST(contains(down.out, "# TYPE shmps_up gauge\nshmps_up{name=\"" + gone + "\"} 0\n"), down.out);
}

BOOST_AUTO_TEST_CASE(inspect_does_not_change_the_segment) {
  const std::string name = test::unique_name("insp");
  // The backend pinned, so the JSON's value is known on a host with a GPU.
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--backend", "host"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  // The server writes the heartbeat (offset 56) and, when idle, counts
  // itself into server_wake.waiters (offset 420) around each futex sleep.
  // A doorbell bit may outlive its request for a moment (the server's lane
  // sweep can serve a request between the worker's publication and its
  // ring), so the copy is taken once the doorbells are clear and the
  // published ring depth is 0; nothing else changes while the worker is
  // quiet.
  auto settled = [&name] {
    std::string bytes;
    BOOST_REQUIRE(test::eventually([&] {
      bytes = segment_bytes(name);
      BOOST_REQUIRE(bytes.size() > sizeof(shm::SegmentHeader));
      const char* bells = bytes.data() + offsetof(shm::SegmentHeader, doorbell);
      // The server publishes the ring depth it last saw each heartbeat: 0
      // once it has seen the lanes empty.
      uint64_t stats_offset = 0, depth = 0;
      std::memcpy(&stats_offset, bytes.data() + offsetof(shm::SegmentHeader, stats_offset), sizeof stats_offset);
      BOOST_REQUIRE(stats_offset + sizeof(shm::StatsBlock) <= bytes.size());
      std::memcpy(&depth, bytes.data() + stats_offset + offsetof(shm::StatsBlock, ring_depth), sizeof depth);
      return depth == 0 &&
             std::all_of(bells, bells + sizeof(shm::SegmentHeader::doorbell), [](char c) { return c == 0; });
    }));
    std::memset(bytes.data() + offsetof(shm::SegmentHeader, heartbeat_ns), 0, 8);
    std::memset(bytes.data() + offsetof(shm::SegmentHeader, server_wake), 0, sizeof(shm::WaitWord));
    return bytes;
  };
  const std::string before = settled();
  const Run text = run_inspect({name});
  BOOST_TEST(text.rc == 0);
  // The host backend maps by shm object, never by CUDA IPC handle.
  BOOST_TEST(contains(text.out, "registered, mappings 1 opened, 0 closed, CUDA IPC handles 0 opened, 0 closed\n"),
             text.out);
  BOOST_TEST(run_inspect({"--json", name}).rc == 0);
  BOOST_TEST(run_inspect({"--watch", "--count", "2", "--interval-ms", "10", name}).rc == 0);
  const std::string after = settled();
  BOOST_REQUIRE(before.size() == after.size());
  size_t first_difference = before.size();
  for (size_t i = 0; i < before.size() && first_difference == before.size(); ++i)
    if (before[i] != after[i]) first_difference = i;
  BOOST_TEST(first_difference == before.size(), "the segment changed at byte " << first_difference);
}

BOOST_AUTO_TEST_CASE(text_output_mentions_every_section_and_a_queued_push) {
  const std::string name = test::unique_name("insp");
  // The backend pinned, so the JSON's value is known on a host with a GPU.
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--backend", "host"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  std::memset(buffer->data, 0, kAllBytes);

  // Freeze the server so a push stays queued in the lane.
  server.process().pause();
  struct Resume {
    test::ServerProcess& s;
    ~Resume() { s.process().signal(SIGCONT); }
  } resume{server};
  auto ticket = worker->push_async(1, buffer->id, 12 * sizeof(float), 4 * sizeof(float), Dtype::kF32, 0);
  BOOST_REQUIRE_MESSAGE(ticket.ok(), ticket.status().to_string());

  const Run text = run_inspect({name});
  BOOST_REQUIRE_MESSAGE(text.rc == 0, text.err);
  for (const char* section : {"== header ==", "== config ==", "== tensors (2) ==", "== workers (1 of 16",
                              "== request lanes (1 not empty) ==", "== completion queues (1) ==", "== stats =="})
    BOOST_TEST(contains(text.out, section), "missing '" << section << "' in:\n" << text.out);
  BOOST_TEST(contains(text.out, "fc.weight"));
  BOOST_TEST(contains(text.out, "4x3"));
  BOOST_TEST(contains(text.out, "attached, pid " + std::to_string(::getpid()) + " (alive)"));
  BOOST_TEST(contains(text.out, "push tensor 1 (fc.bias) buffer 0 offset 48 length 16 version 0 dtype f32"), text.out);
  BOOST_TEST(contains(text.out, "depth 1"));

  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_REQUIRE(j["lanes"].size() == 1u);
  const json& lane = j["lanes"][0];
  BOOST_TEST(lane["depth"] == 1);
  BOOST_REQUIRE(lane["slots"].size() == 1u);
  BOOST_TEST(lane["slots"][0]["opcode"] == "push");
  BOOST_TEST(lane["slots"][0]["tensor"] == 1);
  BOOST_TEST(lane["slots"][0]["tensor_name"] == "fc.bias");
  BOOST_TEST(lane["slots"][0]["length"] == "16");

  server.process().signal(SIGCONT);
  auto version = worker->wait(*ticket);
  BOOST_REQUIRE_MESSAGE(version.ok(), version.status().to_string());
  BOOST_TEST(*version == 1u);
  const json after = parse_json(run_inspect({"--json", name}));
  BOOST_TEST(after["lanes"].empty());
  BOOST_TEST(after["stats"]["gradients_applied"] == 1);
}

BOOST_AUTO_TEST_CASE(watch_stops_after_count) {
  const std::string name = test::unique_name("insp");
  test::ServerProcess server(name, kTensorArgs);
  const Run text = run_inspect({"--watch", "--count", "2", "--interval-ms", "20", name});
  BOOST_REQUIRE_MESSAGE(text.rc == 0, text.err);
  size_t clears = 0;
  for (size_t pos = 0; (pos = text.out.find("\x1b[H\x1b[2J", pos)) != std::string::npos; ++pos) ++clears;
  BOOST_TEST(clears == 2u);
  BOOST_TEST(contains(text.out, "refresh 2"));
  BOOST_TEST(!contains(text.out, "refresh 3"));

  const Run lines = run_inspect({"--watch", "--json", "--count", "3", "--interval-ms", "20", name});
  BOOST_REQUIRE_MESSAGE(lines.rc == 0, lines.err);
  std::istringstream in(lines.out);
  std::string line;
  int documents = 0;
  while (std::getline(in, line)) {
    BOOST_TEST(json::parse(line)["header"]["state"] == "running");
    ++documents;
  }
  BOOST_TEST(documents == 3);
}

// --watch shows rates from its second refresh on: pushes, pulls and bytes
// per second, in total and per worker, from a worker pushing meanwhile;
// and the server's uptime.
BOOST_AUTO_TEST_CASE(watch_shows_rates_in_total_and_per_worker) {
  const std::string name = test::unique_name("rates");
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--max-staleness", "100000000"});
  test::ServerProcess server(name, args);
  auto worker = connect(name);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  std::memset(buffer->data, 0, kAllBytes);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> pushed{0};
  std::thread pusher([&] {
    while (!stop.load()) {
      if (worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 0).ok()) pushed.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  const Run lines = run_inspect({"--watch", "--json", "--count", "3", "--interval-ms", "300", name});
  const Run text = run_inspect({"--watch", "--count", "2", "--interval-ms", "300", name});
  stop = true;
  pusher.join();
  BOOST_REQUIRE_MESSAGE(lines.rc == 0, lines.err);
  BOOST_REQUIRE(pushed.load() > 0u);
  std::istringstream in(lines.out);
  std::vector<json> docs;
  for (std::string line; std::getline(in, line);) docs.push_back(json::parse(line));
  BOOST_REQUIRE_EQUAL(docs.size(), 3u);
  BOOST_TEST(docs[0]["rates"].is_null());  // nothing to compare with yet
  BOOST_TEST(docs[0]["header"]["server_uptime_s"].get<double>() > 0.0);
  for (size_t d = 1; d < docs.size(); ++d) {
    const json& r = docs[d]["rates"];
    BOOST_TEST_CONTEXT(r.dump()) {
      BOOST_TEST(r["seconds"].get<double>() > 0.2);
      const double pushes = r["pushes_per_s"].get<double>();
      BOOST_TEST(pushes > 0.0);
      // Counters read one after another while pushes land: close, not equal.
      BOOST_TEST(std::abs(r["bytes_per_s"].get<double>() - pushes * kAllBytes) <=
                 std::max(0.2 * pushes * kAllBytes, 4.0 * kAllBytes / r["seconds"].get<double>()));
      BOOST_REQUIRE(r["workers"].size() == 1u);
      BOOST_TEST(r["workers"][0]["pid"] == ::getpid());
      BOOST_TEST(r["workers"][0]["pushes_per_s"].get<double>() > 0.0);
      BOOST_TEST(r["workers"][0]["bytes_per_s"].get<double>() > 0.0);
    }
  }
  BOOST_REQUIRE_MESSAGE(text.rc == 0, text.err);
  BOOST_TEST(contains(text.out, "== rates: from the next refresh on =="), text.out);
  BOOST_TEST(contains(text.out, "== rates (over the last "), text.out);
  BOOST_TEST(contains(text.out, "  worker " + std::to_string(worker->worker_id()) + " (pid " +
                                    std::to_string(::getpid()) + "): "),
             text.out);
  BOOST_TEST(contains(text.out, ", up "), text.out);
}

BOOST_AUTO_TEST_CASE(watch_stops_on_sigint) {
  const std::string name = test::unique_name("insp");
  test::ServerProcess server(name, kTensorArgs);
  Inspect watcher({"--watch", "--json", "--interval-ms", "20", name});
  // The first document means the handler is installed (before the loop).
  BOOST_REQUIRE(test::eventually([&] { return !watcher.out_so_far().empty(); }));
  watcher.signal(SIGINT);
  const Run r = watcher.finish(std::chrono::seconds(10));
  BOOST_TEST(r.rc == 0, r.err);
}

// A watch whose stdout blocks (a pipe nobody reads, a paused terminal)
// still ends on SIGTERM, at once and with its normal stop code: the signal
// interrupts the blocked write, which is given up.
BOOST_AUTO_TEST_CASE(watch_stops_on_sigterm_while_stdout_blocks) {
  const std::string name = test::unique_name("wblock");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  for (const bool json_lines : {false, true}) {
    BOOST_TEST_CONTEXT((json_lines ? "--json" : "text")) {
      int fds[2];
      BOOST_REQUIRE(::pipe(fds) == 0);
      std::vector<std::string> argv{test::program_path("shmps-inspect"), "--watch", "--interval-ms", "1", name};
      if (json_lines) argv.insert(argv.begin() + 1, "--json");
      std::vector<char*> cargs;
      for (auto& a : argv) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      const pid_t child = ::fork();
      BOOST_REQUIRE(child >= 0);
      if (child == 0) {
        if (::dup2(fds[1], 1) < 0) _exit(126);
        ::close(fds[0]);
        ::execv(cargs[0], cargs.data());
        _exit(127);
      }
      ::close(fds[1]);
      // Blocked: the pipe holds output and takes no more, while a refresh
      // comes every millisecond.
      int held = 0, before = -1;
      const bool blocked = test::eventually(
          [&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            before = held;
            return ::ioctl(fds[0], FIONREAD, &held) == 0 && held > 0 && held == before;
          },
          std::chrono::seconds(20));
      BOOST_TEST(blocked, "the pipe never filled: " << held << " bytes");
      ::kill(child, SIGTERM);
      const auto sent = std::chrono::steady_clock::now();
      int status = 0;
      pid_t reaped = 0;
      while ((reaped = ::waitpid(child, &status, WNOHANG)) == 0 &&
             std::chrono::steady_clock::now() - sent < std::chrono::seconds(5))
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
      if (reaped == 0) {
        ::kill(child, SIGKILL);
        ::waitpid(child, &status, 0);
      }
      ::close(fds[0]);
      BOOST_TEST(reaped == child, "--watch still running " << seconds << " s after SIGTERM");
      BOOST_TEST(seconds < 3.0);
      BOOST_TEST(WIFEXITED(status), "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
      BOOST_TEST(WEXITSTATUS(status) == 0);
    }
  }
}

BOOST_AUTO_TEST_CASE(missing_segment) {
  const std::string name = test::unique_name("absent");
  const Run r = run_inspect({name});
  BOOST_TEST(r.rc == 2);
  BOOST_TEST(contains(r.err, "'" + name + "'"), r.err);
  BOOST_TEST(contains(r.err, "/dev/shm/shmps." + name), r.err);
  BOOST_TEST(r.out.empty());

  const Run f = run_inspect({"--file", "/nonexistent/" + name});
  BOOST_TEST(f.rc == 2);
  BOOST_TEST(contains(f.err, "/nonexistent/" + name), f.err);

  BOOST_TEST(run_inspect({}).rc == 1);
  BOOST_TEST(run_inspect({name, "--file", "/tmp/x"}).rc == 1);
  BOOST_TEST(run_inspect({"--count", "2", name}).rc == 1);
  BOOST_TEST(run_inspect({"bad/name"}).rc == 1);
  // -1 wrapped to 2^32 - 1: --count -1 watched for ever.
  for (const char* option : {"--count", "--interval-ms"}) {
    const Run n = run_inspect({"--watch", option, "-1", name});
    BOOST_TEST(n.rc == 1, option);
    BOOST_TEST(contains(n.err, std::string(option) + " must be a non-negative integer"), n.err);
  }
}

// --list: one row per segment, live or dead, with its pid, size and
// workers; a worker's buffer object is not a segment; a foreign object at
// a shmps name is listed as unreadable, with the reason.
BOOST_AUTO_TEST_CASE(list_shows_live_and_dead_segments_and_foreign_objects) {
  const std::string live = test::unique_name("lslive"), dead = test::unique_name("lsdead");
  const std::string junk = test::unique_name("lsjunk");
  test::ServerProcess server(live, kTensorArgs);
  auto worker = connect(live);
  auto buffer = worker->register_buffer(kAllBytes);
  BOOST_REQUIRE(buffer.ok());
  test::ServerProcess doomed(dead, kTensorArgs);
  const pid_t doomed_pid = doomed.process().pid();
  doomed.process().kill_and_reap();  // SIGKILL: the segment stays, its server dead
  RemoveSegment remove_junk{junk};
  auto garbage = shm::ShmObject::create(shm::segment_object_name(junk), 8192, 0600);
  BOOST_REQUIRE(garbage.ok());
  std::memset((*garbage)->data(), 0x5a, 8192);

  const json j = parse_json(run_inspect({"--list", "--json"}));
  std::map<std::string, json> rows;
  for (const json& row : j["segments"]) rows[row["name"].get<std::string>()] = row;
  BOOST_REQUIRE(rows.count(live) == 1u);
  BOOST_TEST(rows[live]["server_pid"] == server.process().pid());
  BOOST_TEST(rows[live]["server_alive"] == true);
  BOOST_TEST(rows[live]["state"] == "running");
  BOOST_TEST(rows[live]["workers_attached"] == 1);
  BOOST_TEST(rows[live]["parameters"] == std::to_string(kAllBytes / 4));
  BOOST_TEST(rows[live]["mode"] == "0600");
  BOOST_REQUIRE(rows.count(dead) == 1u);
  BOOST_TEST(rows[dead]["server_pid"] == doomed_pid);
  BOOST_TEST(rows[dead]["server_alive"] == false);
  BOOST_REQUIRE(rows.count(junk) == 1u);
  BOOST_TEST(rows[junk]["exit_code"] == 3);
  BOOST_TEST(contains(rows[junk]["error"].get<std::string>(), "not a shmps segment"), rows[junk]);
  for (const auto& [name, row] : rows) BOOST_TEST(name.rfind(live + ".p", 0) != 0u, "a buffer listed: " << name);

  const Run text = run_inspect({"--list"});
  BOOST_TEST(text.rc == 0, text.err);
  std::istringstream lines(text.out);
  std::map<std::string, std::string> by_name;
  for (std::string line; std::getline(lines, line);) by_name[line.substr(0, line.find(' '))] = line;
  BOOST_TEST(contains(by_name[live], " " + std::to_string(server.process().pid()) + " "), text.out);
  BOOST_TEST(contains(by_name[live], " alive "), text.out);
  BOOST_TEST(contains(by_name[dead], " dead "), text.out);
  BOOST_TEST(contains(by_name[junk], " unreadable "), text.out);
  BOOST_TEST(contains(text.out, "not readable as a segment:\n"), text.out);
  BOOST_TEST(contains(text.out, "  " + junk + ": "), text.out);

  BOOST_TEST(run_inspect({"--list", live}).rc == 1);
  BOOST_TEST(run_inspect({"--list", "--watch"}).rc == 1);
}

// --list's workers column (workers_attached) counts the workers served
// now: attached entries whose process lives, while the server lives. A
// worker that died while the server could not reap it, and every entry
// of a dead server's segment, are not counted.
BOOST_AUTO_TEST_CASE(list_counts_only_live_workers_of_a_live_server) {
  const std::string name = test::unique_name("lswork");
  test::ServerProcess server(name, kTensorArgs);
  const test::RawClient alive(name);  // attached, from this process
  int ready[2];
  BOOST_REQUIRE(::pipe(ready) == 0);
  test::Process doomed = test::Process::fork_fn([&] {
    ::close(ready[0]);
    const test::RawClient client(name);
    const char byte = 1;
    if (::write(ready[1], &byte, 1) != 1) return 1;
    ::pause();
    return 0;
  });
  ::close(ready[1]);
  char byte = 0;
  const ssize_t n = ::read(ready[0], &byte, 1);  // EOF: the child failed to attach
  ::close(ready[0]);
  BOOST_REQUIRE(n == 1);
  // Stopped, the server cannot reap the worker about to die.
  const pid_t pid = server.process().pid();
  StoppedFor scope(pid);
  BOOST_REQUIRE(scope.seen_stopped());
  doomed.kill_and_reap();

  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_REQUIRE_EQUAL(j["workers"].size(), 2u);
  for (const json& w : j["workers"]) BOOST_TEST(w["state"] == "attached", w);
  std::map<std::string, json> rows = list_rows();
  BOOST_REQUIRE(rows.count(name) == 1u);
  BOOST_TEST(rows.at(name)["server_stopped"] == true, rows.at(name));
  BOOST_TEST(rows.at(name)["workers_attached"] == 1, rows.at(name));

  server.process().kill_and_reap();  // the segment stays, its entries as they were
  scope.forget();
  rows = list_rows();
  BOOST_REQUIRE(rows.count(name) == 1u);
  BOOST_TEST(rows.at(name)["server_alive"] == false, rows.at(name));
  BOOST_TEST(rows.at(name)["workers_attached"] == 0, rows.at(name));
}

// --list with a /dev/shm it cannot read says so and fails (exit 1,
// nothing on stdout), rather than "no shmps segments". Run in a user and
// mount namespace of its own, where /dev/shm is a fresh tmpfs of mode 0
// and the tool has no capability that would open it anyway.
boost::test_tools::assertion_result can_unshare(boost::unit_test::test_unit_id) {
  const test::Captured c = test::run_captured({"/bin/sh", "-c", "unshare -rm true && command -v setpriv"});
  boost::test_tools::assertion_result r(c.exit_code == 0);
  r.message() << "needs unshare -rm (user namespaces) and setpriv: " << c.output;
  return r;
}

BOOST_AUTO_TEST_CASE(list_of_an_unreadable_dev_shm_fails, *boost::unit_test::precondition(can_unshare)) {
  const std::string tool = test::program_path("shmps-inspect");
  for (const std::string& args : {std::string("--list"), std::string("--list --json")}) {
    BOOST_TEST_CONTEXT(args) {
      const TempFile out;
      const std::string script =
          "mount -t tmpfs none /dev/shm && chmod 000 /dev/shm && exec setpriv --inh-caps=-all --bounding-set=-all "
          "--securebits=+noroot,+noroot_locked " +
          test::shell_quote(tool) + " " + args + " > " + test::shell_quote(out.path);
      const test::Captured r = test::run_captured({"/usr/bin/env", "unshare", "-rm", "/bin/sh", "-c", script});
      BOOST_TEST(r.exit_code == 1, r.output);
      BOOST_TEST(contains(r.output, "shmps-inspect: cannot list /dev/shm: Permission denied"), r.output);
      BOOST_TEST(test::read_file(out.path).empty());
    }
  }
}

BOOST_AUTO_TEST_CASE(saved_and_corrupted_copies) {
  const std::string name = test::unique_name("insp");
  std::string good;
  {
    test::ServerProcess server(name, kTensorArgs);
    auto worker = connect(name);
    BOOST_REQUIRE(worker->ping().ok());
    good = segment_bytes(name);
  }
  TempFile copy;
  write_all(copy.path, good);
  const json j = parse_json(run_inspect({"--json", "--file", copy.path}));
  BOOST_TEST(j["source"] == copy.path);
  BOOST_TEST(j["tensors"][0]["name"] == "fc.weight");
  BOOST_TEST(j["header"]["server_alive"] == false);  // the server has exited since
  BOOST_TEST(j["workers"].size() == 1u);             // copied while the worker was attached

  uint64_t tensor_table = 0;
  std::memcpy(&tensor_table, good.data() + offsetof(shm::SegmentHeader, tensor_table_offset), sizeof tensor_table);
  struct Case {
    std::string what;
    std::function<void(std::string*)> corrupt;
    int rc;
    std::vector<std::string> message_parts;
  };
  const std::vector<Case> cases{
      {"magic",
       [](std::string* b) { poke<uint64_t>(b, 0, 0x4141414141414141ull); },
       3,
       {"not a shmps segment", "0x4141414141414141"}},
      {"layout version",
       [](std::string* b) { poke<uint32_t>(b, offsetof(shm::SegmentHeader, layout_version), 99); },
       3,
       {"layout version 99", "understands " + std::to_string(shmps::shm::kLayoutVersion)}},
      {"lane capacity",
       [](std::string* b) { poke<uint32_t>(b, offsetof(shm::SegmentHeader, lane_capacity), 3); },
       3,
       {"lane_capacity 3"}},
      {"tensor ndim",
       [&](std::string* b) { poke<uint32_t>(b, tensor_table + offsetof(shm::TensorDesc, ndim), 9); },
       3,
       {"tensor 0", "ndim 9"}},
      {"truncated", [](std::string* b) { b->resize(100); }, 3, {"100 bytes", "smaller than a shmps header"}},
      {"unpublished",
       [](std::string* b) { poke<uint32_t>(b, offsetof(shm::SegmentHeader, layout_version), 0); },
       4,
       {"not published"}},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT("corrupted " << c.what) {
      std::string bytes = good;
      c.corrupt(&bytes);
      write_all(copy.path, bytes);
      const Run r = run_inspect({"--file", copy.path});
      BOOST_TEST(r.rc == c.rc);
      BOOST_TEST(r.out.empty());
      for (const std::string& part : c.message_parts) BOOST_TEST(contains(r.err, part), r.err);
      BOOST_TEST(contains(r.err, copy.path), r.err);
      BOOST_TEST(run_inspect({"--json", "--file", copy.path}).rc == c.rc);
    }
  }
}

// The decoder on garbage that validate_segment does not cover (lanes,
// worker entries, descriptors): an in-process segment, copied and mangled.
BOOST_AUTO_TEST_CASE(decoder_treats_entries_as_untrusted) {
  const std::string name = test::unique_name("insp");
  const RemoveSegment cleanup{name};
  shm::SegmentSpec spec;
  spec.name = name;
  spec.tensors = {{"fc.weight", {4, 3}}, {"fc.bias", {4}}};
  spec.max_workers = 4;
  spec.max_buffers = 2;
  spec.lane_capacity = 8;
  spec.config.optimizer_kind = 2;
  spec.config.backend = 1;
  spec.config.flags = shm::kConfigAmsgrad | (1u << 7);
  auto seg = shm::Segment::create(spec, 7);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  shm::Segment& s = **seg;
  s.publish();

  // Worker 1: an unknown state, an unterminated buffer name, a bad kind.
  s.worker(1).owner.store(shm::make_owner(0x7fffff00u, static_cast<shm::WorkerState>(7)), std::memory_order_relaxed);
  shm::BufferDesc& d0 = s.buffer(1, 0);
  d0.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
  d0.length = 64;
  std::memset(d0.handle, 'A', sizeof d0.handle);
  d0.handle[3] = '\n';
  s.buffer(1, 1).kind = 9;
  // Its completion queue: a failure whose message has no NUL.
  shm::Completion failed{};
  failed.request_id = 4;
  failed.code = static_cast<uint32_t>(ErrorCode::kStale);
  std::memset(failed.message, 'M', sizeof failed.message);
  s.completion_slots(1)[0] = failed;
  s.completions(1).tail.store(1, std::memory_order_relaxed);
  // Lane 1: one request with garbage in every enum and id.
  shm::Request r{};
  r.request_id = 5;
  r.opcode = 77;
  r.tensor_id = 1000;
  r.dtype = 42;
  s.lane_slots(1)[3] = r;
  // Then a push with a garbage dtype.
  r.request_id = 6;
  r.opcode = static_cast<uint32_t>(shm::Opcode::kPush);
  s.lane_slots(1)[4] = r;
  s.lane(1).head.store(3, std::memory_order_relaxed);
  s.lane(1).tail.store(5, std::memory_order_relaxed);
  // Lane 2: impossible indices. Completion queue 3: likewise.
  s.lane(2).head.store(10, std::memory_order_relaxed);
  s.lane(2).tail.store(1000, std::memory_order_relaxed);
  s.completions(3).tail.store(uint64_t{1} << 40, std::memory_order_relaxed);
  s.header().server_state.store(99, std::memory_order_relaxed);

  auto snap = inspect::take_snapshot(s.object().data(), s.object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  BOOST_REQUIRE(snap->workers.size() == 1u);
  const inspect::WorkerView& w = snap->workers[0];
  BOOST_TEST(w.id == 1u);
  BOOST_TEST(inspect::worker_state_name(w.state) == "unknown(7)");
  BOOST_TEST(!w.pid_alive);
  BOOST_REQUIRE(w.buffers.size() == 2u);
  BOOST_TEST(w.buffers[0].name == "AAA\\x0a" + std::string(60, 'A') + " (unterminated)");
  BOOST_TEST(inspect::buffer_kind_name(w.buffers[1].kind) == "unknown(9)");

  BOOST_REQUIRE(snap->lanes.size() == 2u);
  BOOST_TEST(snap->lanes[0].worker == 1u);
  BOOST_TEST(snap->lanes[0].depth == 2u);
  BOOST_REQUIRE(snap->lanes[0].slots.size() == 2u);
  BOOST_TEST(snap->lanes[0].slots[0].request_id == 5u);
  BOOST_TEST(snap->lanes[1].worker == 2u);
  BOOST_TEST(snap->lanes[1].corrupt);
  BOOST_TEST(snap->lanes[1].slots.empty());
  bool queue3_corrupt = false;
  for (const auto& q : snap->completions) queue3_corrupt |= q.worker == 3 && q.corrupt && q.slots.empty();
  BOOST_TEST(queue3_corrupt);

  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(contains(text, "state           unknown(99)"), text);
  BOOST_TEST(contains(text, "optimizer       adam"), text);
  BOOST_TEST(contains(text, "flags           amsgrad,0x80"), text);
  BOOST_TEST(contains(text, "worker 1: unknown(7), pid 2147483392 (dead)"), text);
  BOOST_TEST(contains(text, "request 5 unknown(77)"), text);
  BOOST_TEST(contains(text, "lane 2: head 10, tail 1000: corrupt indices"), text);
  BOOST_TEST(contains(text, "queue 3: head 0, tail 1099511627776: corrupt indices"), text);
  // "(unterminated)" is no part of a name: outside its quotes.
  BOOST_TEST(contains(text, "name \"AAA\\x0a" + std::string(60, 'A') + "\" (unterminated)\n"), text);
  BOOST_TEST(contains(text, "-> stale version 0 value 0 \"" + std::string(64, 'M') + "\" (unterminated)\n"), text);

  const json j = inspect::to_json(*snap);
  const json& slot = j["lanes"][0]["slots"][0];
  BOOST_TEST(slot["opcode"] == "unknown(77)");
  BOOST_TEST(slot["tensor_name"] == "invalid(1000)");
  BOOST_TEST(!slot.contains("dtype"), slot);  // a push's field
  BOOST_TEST(j["lanes"][0]["slots"][1]["dtype"] == "unknown(42)");
  BOOST_TEST(j["lanes"][1]["depth"].is_null());
  BOOST_TEST(j["header"]["state"] == "unknown(99)");
  BOOST_TEST(!j.dump().empty());  // every string is valid UTF-8

  // The same through the binary, from a copy in a file.
  TempFile copy;
  write_all(copy.path, std::string(static_cast<const char*>(s.object().data()), s.object().size()));
  const Run run = run_inspect({"--file", copy.path});
  BOOST_TEST(run.rc == 0, run.err);
  BOOST_TEST(contains(run.out, "corrupt indices"));
}

// Layout 5: a successful completion writes only its first line, so the
// slot's message bytes are an earlier answer's; only a failure's is shown.
BOOST_AUTO_TEST_CASE(success_completion_shows_no_stale_message) {
  const std::string name = test::unique_name("insp");
  const RemoveSegment cleanup{name};
  shm::SegmentSpec spec;
  spec.name = name;
  spec.tensors = {{"w", {4}}};
  spec.max_workers = 2;
  spec.max_buffers = 1;
  spec.lane_capacity = 4;
  spec.config.optimizer_kind = 1;  // sgd
  spec.config.backend = 1;         // host
  auto seg = shm::Segment::create(spec, 7);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  shm::Segment& s = **seg;
  s.publish();
  shm::Completion ok{};
  ok.request_id = 1;
  ok.opcode = static_cast<uint32_t>(shm::Opcode::kPush);
  std::snprintf(ok.message, sizeof ok.message, "left by an earlier failure");
  shm::Completion failed = ok;
  failed.request_id = 2;
  failed.code = static_cast<uint32_t>(ErrorCode::kStale);
  std::snprintf(failed.message, sizeof failed.message, "staleness 9 > max_staleness 4");
  s.completion_slots(0)[0] = ok;
  s.completion_slots(0)[1] = failed;
  s.completions(0).tail.store(2, std::memory_order_relaxed);

  auto snap = inspect::take_snapshot(s.object().data(), s.object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  const json j = inspect::to_json(*snap);
  BOOST_REQUIRE(j["completions"].size() >= 1u);
  const json& q = j["completions"][0];
  BOOST_REQUIRE(q["slots"].size() == 2u);
  BOOST_TEST(q["slots"][0]["message"] == "");
  BOOST_TEST(q["slots"][1]["message"] == "staleness 9 > max_staleness 4");
  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(!contains(text, "left by an earlier failure"), text);
  BOOST_TEST(contains(text, "staleness 9 > max_staleness 4"), text);
}

BOOST_AUTO_TEST_CASE(names_of_raw_values) {
  BOOST_TEST(inspect::opcode_name(5) == "push");
  BOOST_TEST(inspect::opcode_name(0) == "unknown(0)");
  BOOST_TEST(inspect::error_name(1) == "stale");
  BOOST_TEST(inspect::error_name(31) == "unknown(31)");
  BOOST_TEST(inspect::dtype_name(3) == "bf16");
  BOOST_TEST(inspect::backend_name(0) == "unknown(0)");
  BOOST_TEST(inspect::config_flags_text(0) == "none");
  BOOST_TEST(inspect::printable_name("ab\0cd", 5) == "ab");
  BOOST_TEST(inspect::printable_name("a\\b", 4) == "a\\x5cb");
}

// A FIFO is refused at once, not opened (which would block until a
// writer came).
BOOST_AUTO_TEST_CASE(file_refuses_a_fifo_without_blocking) {
  TempFile fifo;
  BOOST_REQUIRE(::mkfifo(fifo.path.c_str(), 0600) == 0);
  const Run r = Inspect({"--file", fifo.path}).finish(std::chrono::seconds(5));
  BOOST_TEST(r.rc == 1, r.err);
  BOOST_TEST(contains(r.err, "'" + fifo.path + "' is not a regular file"), r.err);
}

// A large file is judged by its header before the rest is read: a 1 GiB
// sparse file that is no segment costs a few pages, not a GiB.
BOOST_AUTO_TEST_CASE(file_header_is_checked_before_the_body_is_read) {
  const std::string name = test::unique_name("hdr");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  const std::string header = segment_bytes(name).substr(0, sizeof(shm::SegmentHeader));
  constexpr off_t kSparse = off_t{1} << 30;
  struct Case {
    std::string what, first_bytes;
    int rc;
    std::string message;
  };
  std::string foreign = header;
  poke<uint64_t>(&foreign, 0, 0x4141414141414141ull);
  const std::vector<Case> cases{
      {"zeros", "", 4, "not initialised"},
      {"foreign magic", foreign, 3, "not a shmps segment"},
      {"a segment's header, too large", header, 3, "segment_size"},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.what) {
      TempFile file;
      write_all(file.path, c.first_bytes);
      BOOST_REQUIRE(::truncate(file.path.c_str(), kSparse) == 0);
      const Run r = run_inspect({"--file", file.path});
      BOOST_TEST(r.rc == c.rc, r.err);
      BOOST_TEST(contains(r.err, c.message), r.err);
      BOOST_TEST(contains(r.err, file.path), r.err);
      BOOST_TEST(r.max_rss_kb < kRssScale * 128 * 1024, "peak RSS " << r.max_rss_kb << " KiB");
    }
  }
}

// A live object at a segment's name that is not a published segment of its
// size (a foreign object, one still zero) is judged from its header, not
// copied whole: --list meets every worker buffer left in /dev/shm.
BOOST_AUTO_TEST_CASE(live_object_is_judged_by_its_header_before_a_copy) {
  const std::string name = test::unique_name("bigobj");
  const RemoveSegment cleanup{name};
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  constexpr off_t kSparse = off_t{256} << 20;
  // --list copies every segment on the host: what it takes before this
  // object is there (other jobs' segments) is its baseline.
  const Run before = run_inspect({"--list"});
  for (const bool foreign : {true, false}) {
    BOOST_TEST_CONTEXT((foreign ? "foreign magic" : "zeros")) {
      write_all(path, foreign ? std::string(4096, 'A') : std::string());
      BOOST_REQUIRE(::truncate(path.c_str(), kSparse) == 0);
      const Run r = run_inspect({name});
      BOOST_TEST(r.rc == (foreign ? 3 : 4), r.err);
      BOOST_TEST(r.max_rss_kb < kRssScale * 64 * 1024, "peak RSS " << r.max_rss_kb << " KiB");
      const Run listed = run_inspect({"--list"});
      BOOST_TEST(listed.rc == 0, listed.err);
      BOOST_TEST(listed.max_rss_kb < before.max_rss_kb + kRssScale * 64 * 1024,
                 "peak RSS " << listed.max_rss_kb << " KiB, " << before.max_rss_kb << " KiB without the object");
    }
  }
}

// A writer that truncates the live segment while shmps-inspect reads it
// makes a refresh fail (exit 3: "shrank while being read", or a size
// mismatch), never a SIGBUS; --watch goes on after such a refresh.
BOOST_AUTO_TEST_CASE(live_segment_shrinking_while_read_is_no_crash) {
  const std::string name = test::unique_name("shrink");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}}, /*max_workers=*/64, /*lane_capacity=*/1024);
  const std::string full = segment_bytes(name);
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  BOOST_REQUIRE(fd >= 0);
  const auto restore = [&full, fd] {
    if (::ftruncate(fd, static_cast<off_t>(full.size())) != 0) return false;
    for (size_t done = 0; done < full.size();) {
      const ssize_t n = ::pwrite(fd, full.data() + done, full.size() - done, static_cast<off_t>(done));
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  };
  // The writer: a process of its own, making only system calls.
  const pid_t writer = ::fork();
  BOOST_REQUIRE(writer >= 0);
  if (writer == 0) {
    while (::ftruncate(fd, 4096) == 0 && ::usleep(500) == 0 && restore()) ::usleep(1000);
    _exit(1);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{writer};
  const std::vector<std::vector<std::string>> commands{
      {name}, {"--json", name}, {"--watch", "--json", "--count", "5", "--interval-ms", "1", name}};
  int shrank = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(4);
  for (size_t n = 0; n < 30 || std::chrono::steady_clock::now() < until; ++n) {
    const Run r = run_inspect(commands[n % commands.size()]);
    BOOST_TEST_REQUIRE((r.rc == 0 || r.rc == 3), "exit " << r.rc << ": " << r.err);
    shrank += contains(r.err, "shrank while being read") ? 1 : 0;
  }
  BOOST_TEST_MESSAGE(shrank << " refreshes saw the segment shrink during the copy");
  ::kill(writer, SIGKILL);
  BOOST_REQUIRE(::waitpid(writer, nullptr, 0) == writer);
  reap.pid = -1;
  BOOST_REQUIRE(restore());
  ::close(fd);
  BOOST_TEST(run_inspect({name}).rc == 0);
}

// --interval-ms is bounded (a day), so the refresh deadline cannot
// overflow into no wait at all.
BOOST_AUTO_TEST_CASE(interval_above_a_day_is_refused) {
  const std::string name = test::unique_name("absent");
  const Run too_long = run_inspect({"--watch", "--count", "1", "--interval-ms", "9223372036854", name});
  BOOST_TEST(too_long.rc == 1);
  BOOST_TEST(contains(too_long.err, "--interval-ms"), too_long.err);
  BOOST_TEST(contains(too_long.err, "86400000"), too_long.err);
  BOOST_TEST(run_inspect({"--watch", "--count", "1", "--interval-ms", "86400001", name}).rc == 1);
  // A day is allowed (one refresh: no wait; the segment is absent: 2).
  BOOST_TEST(run_inspect({"--watch", "--count", "1", "--interval-ms", "86400000", name}).rc == 2);
}

// --list: a model whose byte count passes 2^64 saturates instead of
// wrapping to 0, in the JSON and the text alike.
BOOST_AUTO_TEST_CASE(list_model_bytes_saturate) {
  const std::string name = test::unique_name("huge");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  // 2^62 elements (4 * 2^62 wraps to 0): a shape validate_segment accepts.
  shm::SegmentHeader& h = seg->header();
  shm::TensorDesc& t =
      *reinterpret_cast<shm::TensorDesc*>(static_cast<char*>(seg->object().data()) + h.tensor_table_offset);
  t.shape[0] = uint64_t{1} << 62;
  t.element_count = uint64_t{1} << 62;
  h.total_elements = uint64_t{1} << 62;

  const json j = parse_json(run_inspect({"--list", "--json"}));
  json row;
  for (const json& r : j["segments"])
    if (r["name"] == name) row = r;
  BOOST_REQUIRE_MESSAGE(row.is_object(), j.dump());
  BOOST_TEST(row["parameters"] == "4611686018427387904", row);
  BOOST_TEST(row["model_bytes"] == "18446744073709551615", row);
  const Run text = run_inspect({"--list"});
  BOOST_TEST(contains(text.out, " 4611686018427387904 17592186044416.00 "), text.out);
}

// The tensor table keeps a blank between columns when a value fills its
// column.
BOOST_AUTO_TEST_CASE(tensor_table_columns_stay_apart) {
  const std::string name = test::unique_name("wide");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {10001, 1001, 10, 10}}});  // "10001x1001x10x10": 16 characters
  auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(contains(text, " 10001x1001x10x10 1001100100 "), text);
}

// A --file path that is not UTF-8 becomes a valid UTF-8 label value
// (U+FFFD for each bad byte), in the exposition and in shmps_up 0 alike.
BOOST_AUTO_TEST_CASE(prometheus_labels_are_utf8) {
  const std::string name = test::unique_name("utf8");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  TempFile base;
  const std::string path = base.path + "\xff\xfe.seg";
  const TempFile copy{path};
  write_all(path, segment_bytes(name));
  const std::string replaced = base.path + "\xef\xbf\xbd\xef\xbf\xbd.seg";
  for (const std::string& file : {path, path + ".absent"}) {
    BOOST_TEST_CONTEXT(file) {
      const Run r = run_inspect({"--format", "prometheus", "--file", file});
      BOOST_TEST((r.rc == 0 || r.rc == 2), r.err);
      BOOST_TEST(contains(r.out, "shmps_up{name=\"" + replaced), r.out);
      // nlohmann's strict dump throws on a string that is not UTF-8.
      BOOST_CHECK_NO_THROW(json(r.out).dump());
    }
  }
}

// Non-finite values (a garbage configuration) are spelled as the
// exposition format spells them: NaN, +Inf, -Inf.
BOOST_AUTO_TEST_CASE(prometheus_spells_non_finite_values) {
  const std::string name = test::unique_name("nonfinite");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  for (const auto& [value, spelled] :
       std::vector<std::pair<float, std::string>>{{std::numeric_limits<float>::quiet_NaN(), "NaN"},
                                                  {std::numeric_limits<float>::infinity(), "+Inf"},
                                                  {-std::numeric_limits<float>::infinity(), "-Inf"}}) {
    BOOST_TEST_CONTEXT(spelled) {
      seg->header().config.lr = value;
      const TempFile copy;
      write_all(copy.path, segment_bytes(name));
      const Run r = run_inspect({"--format", "prometheus", "--file", copy.path});
      BOOST_TEST(r.rc == 0, r.err);
      BOOST_TEST(contains(r.out, "} " + spelled + "\n"), r.out);
    }
  }
}

// Quantiles of garbage buckets whose sum passes 2^64 are still quantiles.
BOOST_AUTO_TEST_CASE(histogram_quantile_saturates) {
  inspect::HistogramView hv;
  hv.max = 5;
  hv.buckets.assign(shm::kHistogramBuckets, 0);
  hv.buckets[0] = uint64_t{1} << 63;
  hv.buckets[1] = uint64_t{1} << 63;  // the sum wraps to 0
  BOOST_REQUIRE(hv.quantile(0.5).has_value());
  BOOST_TEST(*hv.quantile(0.5) == 0u);
  BOOST_REQUIRE(hv.quantile(1.0).has_value());
  BOOST_TEST(*hv.quantile(1.0) == 1u);
}

// A histogram's max (a garbage stamp in ns), and so its quantiles, may
// pass 2^53, where jq rounds a number: the JSON gives them as strings of
// digits, as the sum.
BOOST_AUTO_TEST_CASE(histogram_values_past_2_53_are_strings_in_json) {
  inspect::Snapshot snap;
  inspect::HistogramView& hv = snap.stats.apply_ns;
  hv.count = 1;
  hv.sum = hv.max = (uint64_t{1} << 53) + 1;
  hv.buckets.assign(shm::kHistogramBuckets, 0);
  hv.buckets[54] = 1;  // [2^53, 2^54)
  const json h = inspect::to_json(snap)["stats"]["histograms"]["apply_ns"];
  BOOST_TEST_CONTEXT(h.dump()) {
    BOOST_TEST(h["sum"] == "9007199254740993");
    BOOST_TEST(h["max"] == "9007199254740993");
    BOOST_TEST(h["p50"] == "9007199254740993");
    BOOST_TEST(h["p99"] == "9007199254740993");
    BOOST_TEST(h["count"] == 1);
  }
  const json empty = inspect::to_json(snap)["stats"]["histograms"]["queue_ns"];
  BOOST_TEST(empty["p50"].is_null(), empty);
  BOOST_TEST(empty["max"] == "0", empty);
}

// A /dev/shm object made by hand (any name a user may give one, which
// ShmObject::create would refuse), removed at scope exit.
struct RawObject {
  std::string path;
  RawObject(const std::string& file, off_t bytes) : path("/dev/shm/" + file) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    BOOST_REQUIRE_MESSAGE(fd >= 0, path << ": " << std::strerror(errno));
    const bool sized = ::ftruncate(fd, bytes) == 0;
    ::close(fd);
    BOOST_REQUIRE(sized);
  }
  ~RawObject() { ::unlink(path.c_str()); }
  RawObject(const RawObject&) = delete;
  RawObject& operator=(const RawObject&) = delete;
};

// --list prints names other users chose: escaped as every name from the
// segment is (no terminal escape gets through), a long one cut in the
// table (the JSON keeps it whole, escaped), and no advice that a server
// removes an object no server could be named for.
BOOST_AUTO_TEST_CASE(list_escapes_names_and_caps_their_width) {
  const std::string tag = test::unique_name("lsesc");
  const std::string evil = tag + "\x1b]2;owned\x07\x1b[31m.p1.2";  // a buffer's shape, its "segment" no name
  const std::string evil_escaped = tag + "\\x1b]2;owned\\x07\\x1b[31m.p1.2";
  const std::string long_name = tag + std::string(180, 'L') + ".p1.2";
  const RawObject a("shmps." + evil, 4096), b("shmps." + long_name, 4096);

  const Run text = run_inspect({"--list"});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(text.out.find('\x1b') == std::string::npos, text.out);
  BOOST_TEST(text.out.find('\x07') == std::string::npos, text.out);
  BOOST_TEST(contains(text.out, evil_escaped), text.out);
  // The table's header: the name column is capped, whatever the names.
  const std::string header = text.out.substr(0, text.out.find('\n'));
  BOOST_TEST(header.find("server pid") <= 64u, header);
  // Its own rows only: other objects in /dev/shm are not the test's.
  std::istringstream lines(text.out);
  for (std::string line; std::getline(lines, line);)
    if (contains(line, tag)) BOOST_TEST(!contains(line, "a server started under that name removes it"), line);
  BOOST_TEST(contains(text.out, "no server can take"), text.out);

  const json j = parse_json(run_inspect({"--list", "--json"}));
  std::set<std::string> names;
  for (const json& row : j["segments"]) names.insert(row["name"].get<std::string>());
  BOOST_TEST(names.count(evil_escaped) == 1u, j.dump());
  BOOST_TEST(names.count(long_name) == 1u, j.dump());
  BOOST_TEST(names.count(evil) == 0u);
}

// A write error on stdout (a full disk, a closed descriptor) fails the
// run: exit 1, the error on stderr.
BOOST_AUTO_TEST_CASE(write_errors_on_stdout_exit_1) {
  const std::string name = test::unique_name("wfull");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  const std::string tool = test::program_path("shmps-inspect");
  const TempFile err;
  for (const std::string& args :
       {name, "--json " + name, "--format prometheus " + name, std::string("--list"), std::string("--list --json"),
        std::string("--help"), std::string("--version"), "--watch --count 2 --interval-ms 1 " + name}) {
    for (const std::string& redirect : {std::string("> /dev/full"), std::string(">&-")}) {
      BOOST_TEST_CONTEXT(args << " " << redirect) {
        const int status = std::system((tool + " " + args + " " + redirect + " 2> " + err.path).c_str());
        BOOST_TEST(WIFEXITED(status));
        BOOST_TEST(WEXITSTATUS(status) == 1);
        const std::string message = shmps::test::read_file(err.path);
        BOOST_TEST(contains(message, "stdout"), message);
      }
    }
  }
}

// A header without the server's start time (a real server always writes
// it) names no server: a live process at that pid is not shown alive.
BOOST_AUTO_TEST_CASE(server_without_start_time_is_not_alive) {
  const std::string name = test::unique_name("nostart");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});  // our pid, our start time
  seg->header().server_start_time = 0;
  auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  BOOST_TEST(!snap->header.server_alive);
  BOOST_TEST(!snap->header.server_uptime_s.has_value());
  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(contains(text, "no start time"), text);
  BOOST_TEST(inspect::to_json(*snap)["header"]["server_alive"] == false);
}

// 64-bit words that pass 2^53 are strings in the JSON: the doorbell's
// bitmaps and an attach's lease in its completion, as 0x-hex.
BOOST_AUTO_TEST_CASE(json_gives_doorbell_and_attach_lease_as_hex) {
  const std::string name = test::unique_name("hexjson");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  seg->header().doorbell[0].store((uint64_t{1} << 60) | 1, std::memory_order_relaxed);
  shm::Completion attach{};
  attach.request_id = 1;
  attach.opcode = static_cast<uint32_t>(shm::Opcode::kAttach);
  attach.value = (uint64_t{1} << 56) | 5;
  shm::Completion push{};
  push.request_id = 2;
  push.opcode = static_cast<uint32_t>(shm::Opcode::kPush);
  push.value = 3;  // staleness: a count
  seg->completion_slots(0)[0] = attach;
  seg->completion_slots(0)[1] = push;
  seg->completions(0).tail.store(2, std::memory_order_relaxed);
  auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  const json j = inspect::to_json(*snap);
  BOOST_TEST(j["header"]["doorbell"][0] == "0x1000000000000001", j["header"]);
  BOOST_REQUIRE(j["completions"].size() >= 1u);
  const json& slots = j["completions"][0]["slots"];
  BOOST_REQUIRE(slots.size() == 2u);
  BOOST_TEST(slots[0]["value"] == "0x0100000000000005", slots);
  BOOST_TEST(slots[1]["value"] == 3, slots);
  // The text as the JSON: the lease in 0x-hex, the staleness a count.
  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(contains(text, " attach -> ok version 0 value 0x0100000000000005\n"), text);
  BOOST_TEST(contains(text, " push -> ok version 0 value 3\n"), text);
}

// --interval-ms below 10 is what it says (no 10 ms steps), and the rates
// name a window below a second in ms.
BOOST_AUTO_TEST_CASE(watch_interval_is_exact_and_its_window_shown) {
  const std::string name = test::unique_name("fastw");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  const Run r = run_inspect({"--watch", "--json", "--interval-ms", "1", "--count", "10", name});
  BOOST_REQUIRE_MESSAGE(r.rc == 0, r.err);
  std::istringstream lines(r.out);
  double shortest = 1e9;
  for (std::string line; std::getline(lines, line);) {
    const json doc = json::parse(line);
    if (!doc["rates"].is_null()) shortest = std::min(shortest, doc["rates"]["seconds"].get<double>());
  }
  BOOST_TEST(shortest < 0.009, "shortest refresh " << shortest << " s");
  const Run text = run_inspect({"--watch", "--interval-ms", "2", "--count", "2", name});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(std::regex_search(text.out, std::regex(R"(over the last [0-9.]+ ms\))")), text.out);
  BOOST_TEST(!contains(text.out, "over the last 0.0 s"), text.out);
}

// --list does not wait for an object that is empty or not yet written (a
// server starting, or a start that crashed): each is reported at once.
// A single name still waits (a server mid-start is ridden out).
BOOST_AUTO_TEST_CASE(list_reports_unwritten_objects_without_waiting) {
  const std::string tag = test::unique_name("lswait");
  std::vector<std::unique_ptr<RawObject>> objects;
  for (int i = 0; i < 3; ++i)
    objects.push_back(std::make_unique<RawObject>("shmps." + tag + "e" + std::to_string(i), 0));
  objects.push_back(std::make_unique<RawObject>("shmps." + tag + "z", 8192));  // a zero header
  const auto start = std::chrono::steady_clock::now();
  const json j = parse_json(run_inspect({"--list", "--json"}));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BOOST_TEST(seconds < 1.5, "--list took " << seconds << " s");
  int seen = 0;
  for (const json& row : j["segments"]) {
    const std::string n = row["name"].get<std::string>();
    if (n.rfind(tag, 0) != 0) continue;
    ++seen;
    BOOST_TEST(row["exit_code"] == 4, row);
    BOOST_TEST(contains(row["error"].get<std::string>(), "a server starting, or"), row);
  }
  BOOST_TEST(seen == 4);
  const Run single = run_inspect({tag + "e0"});
  BOOST_TEST(single.rc == 4, single.err);
}

// An object larger than any segment is refused as one (exit 3), before
// it is mapped, live as with --file.
BOOST_AUTO_TEST_CASE(oversized_live_object_is_no_segment) {
  const std::string name = test::unique_name("big");
  const RawObject big("shmps." + name, off_t{0x7fffffffffff});
  for (const std::vector<std::string>& args : {std::vector<std::string>{name}, {"--list", "--json"}}) {
    const Run r = run_inspect(args);
    if (args.size() == 1) {
      BOOST_TEST(r.rc == 3, r.err);
      BOOST_TEST(contains(r.err, "more than any shmps segment"), r.err);
    } else {
      const json doc = parse_json(r);  // named: a range over a temporary's member outlives it
      for (const json& row : doc["segments"])
        if (row["name"] == name) {
          BOOST_TEST(row["exit_code"] == 3, row);
          BOOST_TEST(contains(row["error"].get<std::string>(), "more than any shmps segment"), row);
        }
    }
  }
}

// A 64-bit federation state is range-checked before its cast: 2^32 + 2 is
// no "in a group".
BOOST_AUTO_TEST_CASE(federation_state_out_of_range_is_unknown) {
  const std::string name = test::unique_name("fedst");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  seg->stats().fed_state.store((uint64_t{1} << 32) + 2, std::memory_order_relaxed);
  auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(contains(text, "federation      unknown(4294967298)"), text);
  BOOST_TEST(!contains(text, "hosts"), text);
}

// Rejections counted under code 0 ("ok": garbage, since nothing is refused
// with it) show in every format alike.
BOOST_AUTO_TEST_CASE(rejected_ok_shows_in_every_format) {
  const std::string name = test::unique_name("rejok");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  seg->stats().rejected[0].store(5, std::memory_order_relaxed);
  auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  BOOST_TEST(contains(inspect::render_text(*snap), "rejected        ok 5"));
  BOOST_TEST(inspect::to_json(*snap)["stats"]["rejected"]["ok"] == 5);
  const std::string prom = inspect::render_prometheus(*snap, "x");
  BOOST_TEST(contains(prom, "shmps_requests_rejected_total{name=\"x\",cause=\"ok\"} 5\n"), prom);
}

// The object's owner and mode are shown, and whether a worker of this user
// would trust it (worker_lib's rules): a world-writable one, one with
// group bits its server did not ask for, one of another user are not.
BOOST_AUTO_TEST_CASE(owner_mode_and_trust_are_shown) {
  const std::string name = test::unique_name("trust");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  struct Case {
    mode_t mode;
    bool other_user;
    bool trusted;
    std::string why;
  };
  std::vector<Case> cases{
      {0600, false, true, ""}, {0666, false, false, "world-writable"}, {0640, false, false, "--group-access"}};
  if (::geteuid() == 0) cases.push_back({0600, true, false, "not owned by a user this worker trusts"});
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT("mode " << std::oct << c.mode << std::dec << (c.other_user ? ", another user" : "")) {
      BOOST_REQUIRE(::chmod(path.c_str(), c.mode) == 0);
      BOOST_REQUIRE(::chown(path.c_str(), c.other_user ? 65534 : ::geteuid(), static_cast<gid_t>(-1)) == 0);
      const json j = parse_json(run_inspect({"--json", name}));
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(c.mode));
      BOOST_TEST(j["object"]["mode"] == mode, j["object"]);
      BOOST_TEST(j["object"]["uid"] == (c.other_user ? 65534u : ::geteuid()), j["object"]);
      BOOST_TEST(j["object"]["trusted"] == c.trusted, j["object"]);
      const Run text = run_inspect({name});
      BOOST_TEST(contains(text.out, std::string("  object          owner ")), text.out);
      BOOST_TEST(contains(text.out, std::string(", mode ") + mode), text.out);
      BOOST_TEST(contains(text.out, "NOT TRUSTED") != c.trusted, text.out);
      if (!c.trusted) BOOST_TEST(contains(text.out, c.why), text.out);
      const Run prom = run_inspect({"--format", "prometheus", name});
      BOOST_TEST(contains(prom.out, "shmps_segment_trusted{name=\"" + name + "\"} " + (c.trusted ? "1" : "0") + "\n"),
                 prom.out);
    }
  }
  BOOST_REQUIRE(::chown(path.c_str(), ::geteuid(), static_cast<gid_t>(-1)) == 0);
}

// A pending SIGTERM ends --watch even when every refresh takes longer than
// the interval (an object never published: each refresh waits 2 s for its
// server), with the last refresh's exit code.
BOOST_AUTO_TEST_CASE(watch_ends_on_sigterm_when_refreshes_outlast_the_interval) {
  const std::string name = test::unique_name("slowwatch");
  const RawObject zeros("shmps." + name, 8192);
  // Locked, as a starting server locks its object: every refresh waits for it.
  const UniqueFd lock(::open(zeros.path.c_str(), O_RDONLY | O_CLOEXEC));
  BOOST_REQUIRE(::flock(lock.fd, LOCK_EX) == 0);
  Inspect watcher({"--watch", "--interval-ms", "100", name});
  // The first screen means the handler is installed (before the loop).
  BOOST_REQUIRE(test::eventually([&] { return contains(watcher.out_so_far(), "refresh 1,"); }));
  watcher.signal(SIGTERM);
  const auto sent = std::chrono::steady_clock::now();
  const Run r = watcher.finish(std::chrono::seconds(10));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
  BOOST_TEST(r.rc == 4, r.err);
  BOOST_TEST(seconds < 3.0, "--watch ended " << seconds << " s after SIGTERM");
}

// Inspecting a sparse segment reads none of its holes (tmpfs would
// allocate every page read): only the parts outside the rings, each
// ring's header and its live slots. The object's allocated blocks stay
// where they were, and the tool's memory small; the live slots still show.
BOOST_AUTO_TEST_CASE(sparse_segment_is_not_allocated_by_a_read) {
  const std::string name = test::unique_name("sparse");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}}, /*max_workers=*/64, /*lane_capacity=*/4096);
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  const shm::Geometry& g = seg->layout().geometry;
  BOOST_REQUIRE(g.stats_offset - g.lanes_offset > (off_t{32} << 20));
  // The rings' pages back to holes (the server reserves them all at create).
  {
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    BOOST_REQUIRE(fd >= 0);
    const off_t first = static_cast<off_t>((g.lanes_offset + 4095) / 4096 * 4096);
    const off_t last = static_cast<off_t>(g.stats_offset / 4096 * 4096);
    const int punched = ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, first, last - first);
    ::close(fd);
    BOOST_REQUIRE_MESSAGE(punched == 0, std::strerror(errno));
  }
  // Two completions queued, wrapping the ring's end, in a worker's queue.
  shm::Completion c{};
  c.opcode = static_cast<uint32_t>(shm::Opcode::kPing);
  c.request_id = 41;
  seg->completion_slots(5)[4095] = c;
  c.request_id = 42;
  seg->completion_slots(5)[0] = c;
  seg->completions(5).head.store(4095, std::memory_order_relaxed);
  seg->completions(5).tail.store(4097, std::memory_order_relaxed);
  const auto blocks = [&path] {
    struct stat st {};
    BOOST_REQUIRE(::stat(path.c_str(), &st) == 0);
    return static_cast<long long>(st.st_blocks) * 512;
  };
  const long long before = blocks();
  const Run r = run_inspect({"--json", name});
  const json j = parse_json(r);
  BOOST_TEST(blocks() - before < (4ll << 20), "allocated " << (blocks() - before) << " bytes");
  BOOST_TEST(r.max_rss_kb < kRssScale * 32 * 1024, "peak RSS " << r.max_rss_kb << " KiB");
  bool seen = false;
  for (const json& q : j["completions"]) {
    if (q["worker"] != 5) continue;
    seen = true;
    BOOST_TEST(q["depth"] == 2, q);
    BOOST_REQUIRE(q["slots"].size() == 2u);
    BOOST_TEST(q["slots"][0]["request_id"] == 41, q);
    BOOST_TEST(q["slots"][1]["request_id"] == 42, q);
  }
  BOOST_TEST(seen, j["completions"]);
  const Run listed = run_inspect({"--list"});
  BOOST_TEST(listed.rc == 0, listed.err);
  BOOST_TEST(blocks() - before < (4ll << 20), "--list allocated " << (blocks() - before) << " bytes");
}

// A copy of a live server's segment under another name is no live server:
// the server holds a flock on the object it serves, not on the copy.
BOOST_AUTO_TEST_CASE(copy_of_a_live_segment_is_not_alive) {
  const std::string name = test::unique_name("orig"), copy = test::unique_name("copy");
  test::ServerProcess server(name, kTensorArgs);
  const std::string bytes = segment_bytes(name);
  const RawObject copied("shmps." + copy, 0);
  write_all(copied.path, bytes);
  const json live = parse_json(run_inspect({"--json", name}));
  BOOST_TEST(live["header"]["server_alive"] == true, live["header"]);
  BOOST_TEST(live["header"]["server_holds_object"] == true, live["header"]);
  const json j = parse_json(run_inspect({"--json", copy}));
  BOOST_TEST(j["header"]["server_pid"] == server.process().pid());
  BOOST_TEST(j["header"]["server_alive"] == false, j["header"]);
  BOOST_TEST(j["header"]["server_holds_object"] == false, j["header"]);
  BOOST_TEST(j["header"]["server_uptime_s"].is_null(), j["header"]);
  const Run text = run_inspect({copy});
  BOOST_TEST(contains(text.out, "alive, but not serving this object"), text.out);
  const Run prom = run_inspect({"--format", "prometheus", copy});
  BOOST_TEST(contains(prom.out, "shmps_up{name=\"" + copy + "\"} 0\n"), prom.out);
  BOOST_TEST(contains(run_inspect({"--format", "prometheus", name}).out, "shmps_up{name=\"" + name + "\"} 1\n"));
  std::map<std::string, json> rows = list_rows();
  BOOST_REQUIRE(rows.count(copy) == 1u);
  BOOST_TEST(rows[copy]["server_alive"] == false, rows[copy]);
  BOOST_TEST(rows[name]["server_alive"] == true, rows[name]);
  const Run listed = run_inspect({"--list"});
  std::istringstream lines(listed.out);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(copy + " ", 0) == 0) BOOST_TEST(contains(line, " copy "), line);
  // A --file copy keeps the process rule: no object to hold.
  const TempFile file;
  write_all(file.path, bytes);
  BOOST_TEST(parse_json(run_inspect({"--json", "--file", file.path}))["header"]["server_alive"] == true);
}

// A --file path and a <name> are the user's bytes: escaped in messages,
// in the text and in the Prometheus name label, as names from the segment.
BOOST_AUTO_TEST_CASE(user_given_paths_and_names_are_escaped) {
  const std::string name = test::unique_name("escpath");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  TempFile base;
  const std::string path = base.path + "\x1b[31m\r.seg";
  const std::string escaped = base.path + "\\x1b[31m\\x0d.seg";
  const TempFile file{path};
  const auto raw = [](const std::string& text) {
    return text.find('\x1b') != std::string::npos || text.find('\r') != std::string::npos;
  };
  const Run absent = run_inspect({"--file", path + ".absent"});
  BOOST_TEST(absent.rc == 2);
  BOOST_TEST(!raw(absent.err), absent.err);
  BOOST_TEST(contains(absent.err, escaped + ".absent"), absent.err);
  const Run bad_name = run_inspect({"bad\x1b[2Jname\r"});
  BOOST_TEST(bad_name.rc == 1);
  BOOST_TEST(!raw(bad_name.err), bad_name.err);
  BOOST_TEST(contains(bad_name.err, "bad\\x1b[2Jname\\x0d"), bad_name.err);
  write_all(path, segment_bytes(name));
  const Run text = run_inspect({"--file", path});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(!raw(text.out), text.out);
  BOOST_TEST(contains(text.out, "shmps segment " + escaped + "\n"), text.out);
  for (const std::string& file_arg : {path, path + ".absent"}) {
    const Run prom = run_inspect({"--format", "prometheus", "--file", file_arg});
    BOOST_TEST(!raw(prom.out), prom.out);
    // The label's backslash is the exposition format's \\.
    BOOST_TEST(contains(prom.out, "shmps_up{name=\"" + base.path + "\\\\x1b[31m\\\\x0d.seg"), prom.out);
    BOOST_TEST(!raw(prom.err), prom.err);
  }
}

// --list shows an object at a shmps name no server can take (a space, an
// escape, a newline) as not a segment, its name escaped.
BOOST_AUTO_TEST_CASE(list_shows_objects_at_names_no_server_can_take) {
  const std::string tag = test::unique_name("lsbad");
  const RawObject odd("shmps." + tag + " x\x1b[2J\ny", 4096);
  const std::string escaped = tag + " x\\x1b[2J\\x0ay";
  const json j = parse_json(run_inspect({"--list", "--json"}));
  bool seen = false;
  for (const json& row : j["segments"]) {
    if (row["name"] != escaped) continue;
    seen = true;
    BOOST_TEST(row["exit_code"] == 1, row);
    BOOST_TEST(contains(row["error"].get<std::string>(), "no server can take this name"), row);
  }
  BOOST_TEST(seen, j.dump());
  const Run text = run_inspect({"--list"});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(text.out.find('\x1b') == std::string::npos, text.out);
  BOOST_TEST(contains(text.out, "  " + escaped + ": not a segment"), text.out);
}

// An object empty for longer than a start's wait: --list's reason says
// once what left it and what replaces it.
BOOST_AUTO_TEST_CASE(list_reason_for_a_dead_start_says_it_once) {
  const std::string name = test::unique_name("lsonce");
  const RawObject empty("shmps." + name, 0);
  std::this_thread::sleep_for(shm::kSegmentStartWait + std::chrono::milliseconds(300));
  const json j = parse_json(run_inspect({"--list", "--json"}));
  bool seen = false;
  for (const json& row : j["segments"]) {
    if (row["name"] != name) continue;
    seen = true;
    const std::string error = row["error"].get<std::string>();
    BOOST_TEST(row["exit_code"] == 4, row);
    size_t said = 0;
    for (size_t pos = 0; (pos = error.find("replaces it", pos)) != std::string::npos; ++pos) ++said;
    BOOST_TEST(said == 1u, error);
  }
  BOOST_TEST(seen, j.dump());
}

// An object at a shmps name that is empty or whose magic is zero,
// that no process locks and that has not changed for longer than a
// start's wait, is what a start that died left (or another program's):
// reported at once (exit 4) with its owner and the command that removes
// it, `sudo rm` when it is another user's. One that a process locks (a
// server starting) is still waited for. --list says who replaces an
// object it did not wait for: the next start under the name only when the
// object is this user's (a server refuses another user's).
BOOST_AUTO_TEST_CASE(unwritten_object_left_behind_is_named_at_once) {
  const std::string zero = test::unique_name("zerohdr"), empty = test::unique_name("emptyobj");
  const std::string locked = test::unique_name("lockedz"), other = test::unique_name("otherz");
  const std::string other_locked = test::unique_name("otherlk");
  const RawObject z("shmps." + zero, 8192), e("shmps." + empty, 0), l("shmps." + locked, 8192);
  const UniqueFd lock(::open(l.path.c_str(), O_RDONLY | O_CLOEXEC));
  BOOST_REQUIRE(::flock(lock.fd, LOCK_EX) == 0);
  // Another user's objects, where this test may make them (before the
  // wait: chown changes the ctime).
  const bool root = ::geteuid() == 0;
  std::vector<std::unique_ptr<RawObject>> others;
  UniqueFd other_lock;
  if (root) {
    others.push_back(std::make_unique<RawObject>("shmps." + other, 8192));
    others.push_back(std::make_unique<RawObject>("shmps." + other_locked, 8192));
    for (const auto& o : others) BOOST_REQUIRE(::chown(o->path.c_str(), 65534, 65534) == 0);
    other_lock.fd = ::open(others[1]->path.c_str(), O_RDONLY | O_CLOEXEC);
    BOOST_REQUIRE(::flock(other_lock.fd, LOCK_EX) == 0);
  }
  std::this_thread::sleep_for(shm::kSegmentStartWait + std::chrono::milliseconds(300));

  const auto timed = [](const std::string& name) {
    const auto start = std::chrono::steady_clock::now();
    const Run r = run_inspect({name});
    return std::pair{r, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
  };
  for (const auto& [name, what] :
       {std::pair<std::string, std::string>{zero, "is not initialised (no header: its magic is zero)"},
        {empty, "is empty"}}) {
    BOOST_TEST_CONTEXT(name) {
      const auto [r, seconds] = timed(name);
      BOOST_TEST(r.rc == 4, r.err);
      BOOST_TEST(contains(r.err, "/dev/shm/shmps." + name + " (owner "), r.err);
      BOOST_TEST(contains(r.err, what), r.err << " (after " << seconds << " s)");  // not the start wait's message
      BOOST_TEST(contains(r.err, "unchanged for "), r.err);
      BOOST_TEST(contains(r.err, "a server start that died before"), r.err);
      BOOST_TEST(contains(r.err, "or remove it: rm /dev/shm/shmps." + name), r.err);
    }
  }
  const auto [waited, seconds] = timed(locked);
  BOOST_TEST(waited.rc == 4, waited.err);
  BOOST_TEST(seconds > 1.5, "a locked object was not waited for: " << seconds << " s");
  BOOST_TEST(contains(waited.err, "not initialised yet"), waited.err);

  const auto rows = list_rows();
  BOOST_REQUIRE(rows.count(zero) == 1u && rows.count(locked) == 1u);
  BOOST_TEST(contains(rows.at(zero)["error"].get<std::string>(), "or remove it: rm /dev/shm/shmps." + zero),
             rows.at(zero));
  BOOST_TEST(contains(rows.at(locked)["error"].get<std::string>(), "(the next start under the name replaces it)"),
             rows.at(locked));
  if (!root) {
    BOOST_TEST_MESSAGE("not root: no object of another user's made");
    return;
  }
  const std::string owner = shm::owner_text(65534, 65534);
  const auto [r, other_seconds] = timed(other);
  BOOST_TEST(r.rc == 4, r.err);
  BOOST_TEST(contains(r.err, "(owner " + owner + ", mode 0600)"), r.err);
  BOOST_TEST(contains(r.err, "or remove it: sudo rm /dev/shm/shmps." + other), r.err);
  BOOST_REQUIRE(rows.count(other_locked) == 1u);
  const std::string hint = rows.at(other_locked)["error"].get<std::string>();
  BOOST_TEST(!contains(hint, "replaces it)"), hint);
  BOOST_TEST(contains(hint, "owned by " + owner +
                                ": only a start by its owner replaces it; or remove it: sudo rm "
                                "/dev/shm/shmps." +
                                other_locked + ")"),
             hint);
}

// A counter that went back within one generation (a garbage write) has no
// rate: "-" in the text, null in the JSON, not a silent 0.
BOOST_AUTO_TEST_CASE(counter_going_back_has_no_rate) {
  inspect::Snapshot a, b;
  a.header.generation = b.header.generation = 7;
  a.taken_ns = 1'000'000'000;
  b.taken_ns = 2'000'000'000;
  a.stats.gradients_applied = 10;
  b.stats.gradients_applied = 4;
  a.stats.requests = 1;
  b.stats.requests = 3;
  a.stats.rejected.assign(shm::kRejectCauses, 0);
  b.stats.rejected.assign(shm::kRejectCauses, 0);
  a.stats.rejected[1] = 5;
  inspect::WorkerView w;
  w.id = 0;
  w.pid = 99;
  w.state = static_cast<uint32_t>(shm::WorkerState::kAttached);
  w.pulls = 8;
  a.workers.push_back(w);
  w.pulls = 2;
  b.workers.push_back(w);
  // A worker rate needs the entry attached in both: a claimed entry's
  // counters are an earlier session's.
  inspect::Snapshot claimed = b;
  claimed.workers[0].state = static_cast<uint32_t>(shm::WorkerState::kClaimed);
  const auto none = inspect::rates_between(a, claimed);
  BOOST_REQUIRE(none.has_value());
  BOOST_TEST(none->workers.empty());
  const auto r = inspect::rates_between(a, b);
  BOOST_REQUIRE(r.has_value());
  BOOST_TEST(!r->pushes.has_value());
  BOOST_TEST(r->requests.value_or(-1) == 2.0);
  const std::string text = inspect::render_rates_text(*r);
  BOOST_TEST(contains(text, "total           - pushes/s, 0.0 pulls/s"), text);
  BOOST_TEST(contains(text, "worker 0 (pid 99): 0.0 pushes/s, - pulls/s"), text);
  BOOST_TEST(contains(text, inspect::error_name(1) + " -"), text);
  const json j = inspect::rates_json(*r);
  BOOST_TEST(j["pushes_per_s"].is_null(), j);
  BOOST_TEST(j["requests_per_s"] == 2.0, j);
  BOOST_TEST(j["workers"][0]["pulls_per_s"].is_null(), j);
  BOOST_TEST(j["rejected_per_s"][inspect::error_name(1)].is_null(), j);
}

// An uptime past 11.6 days prints without an exponent: "up 1234568 s",
// not "1.23457e+06 s".
BOOST_AUTO_TEST_CASE(long_uptime_prints_without_exponent) {
  const std::string name = test::unique_name("uptime");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
  snap->header.server_alive = true;
  snap->header.server_uptime_s = 1234567.8;
  const std::string text = inspect::render_text(*snap);
  BOOST_TEST(contains(text, ", up 1234568 s\n"), text);
  BOOST_TEST(!contains(text, "e+06 s"), text);
  // Not a quantity of seconds: the scheduled lr keeps %g (docs/operations.md).
  seg->stats().scheduled_lr_pico.store(shm::kScheduledLrSaturated, std::memory_order_relaxed);
  auto saturated = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
  BOOST_REQUIRE(saturated.ok());
  const std::string lr = inspect::render_text(*saturated);
  BOOST_TEST(contains(lr, "scheduled lr    at least 1.84467e+07 "), lr);
}

// The scheduled lr in 1e-12ths passes 2^53 (its sentinels are 2^64 - 1
// and 2^64 - 2): a decimal string in the JSON, exact.
BOOST_AUTO_TEST_CASE(scheduled_lr_pico_is_a_string_in_json) {
  const std::string name = test::unique_name("lrpico");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  for (const uint64_t v : {shm::kScheduledLrSaturated, shm::kScheduledLrNotFinite, uint64_t{1'000'000'000}}) {
    seg->stats().scheduled_lr_pico.store(v, std::memory_order_relaxed);
    auto snap = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test");
    BOOST_REQUIRE_MESSAGE(snap.ok(), snap.status().to_string());
    const json j = inspect::to_json(*snap);
    BOOST_TEST(j["stats"]["scheduled_lr_pico"] == std::to_string(v), j["stats"]);
  }
}

// A planted segment whose every ring claims to be full (tail - head ==
// capacity, which is no corruption): text and JSON copy and decode only
// the first kSlotsShown pending slots of each ring and say how many more
// there are; --list and Prometheus read no ring at all. The tool's memory
// stays bounded by that cap, not by the rings' size.
BOOST_AUTO_TEST_CASE(full_rings_are_capped_and_not_read_where_not_shown) {
  const std::string name = test::unique_name("fullring");
  const RemoveSegment cleanup{name};
  constexpr uint32_t kWorkers = 16, kCapacity = 8192;
  const auto seg = crafted_segment(name, {{"w", {4}}}, kWorkers, kCapacity);
  // --list reads every segment on the host: what it takes while this
  // one's rings are empty is its baseline (full, they hold 26 MiB).
  const Run before = run_inspect({"--list"});
  BOOST_REQUIRE(before.rc == 0);
  shm::Request r{};
  r.opcode = static_cast<uint32_t>(shm::Opcode::kPing);
  shm::Completion c{};
  c.opcode = static_cast<uint32_t>(shm::Opcode::kPing);
  for (uint32_t w = 0; w < kWorkers; ++w) {
    for (uint32_t k = 0; k < kCapacity; ++k) {
      r.request_id = c.request_id = k + 1;
      seg->lane_slots(w)[k] = r;
      seg->completion_slots(w)[k] = c;
    }
    seg->lane(w).tail.store(kCapacity, std::memory_order_relaxed);
    seg->completions(w).tail.store(kCapacity, std::memory_order_relaxed);
  }

  // A child's peak RSS counts the private memory it shares with this
  // process before its exec (under TSan, the shadow of the rings written
  // above), so each run's limit is over the peak of a run
  // that reads no segment (--version), taken now; the small runs come
  // first, before a large JSON is parsed here.
  const Run floor = run_inspect({"--version"});
  BOOST_REQUIRE(floor.rc == 0);
  const auto within = [&floor](const Run& run, long mib) { return run.max_rss_kb < floor.max_rss_kb + mib * 1024; };
  const Run prom = run_inspect({"--format", "prometheus", name});
  BOOST_TEST(prom.rc == 0, prom.err);
  BOOST_TEST(within(prom, kRssScale * 16),
             "prometheus: peak RSS " << prom.max_rss_kb << " KiB, --version " << floor.max_rss_kb << " KiB");
  const Run listed = run_inspect({"--list"});
  BOOST_TEST(listed.rc == 0, listed.err);
  BOOST_TEST(listed.max_rss_kb < std::max(before.max_rss_kb, floor.max_rss_kb) + kRssScale * 8 * 1024,
             "--list: peak RSS " << listed.max_rss_kb << " KiB, " << before.max_rss_kb << " KiB before, --version "
                                 << floor.max_rss_kb << " KiB");

  const Run text = run_inspect({name});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(within(text, kRssScale * 32), "text: peak RSS " << text.max_rss_kb << " KiB");
  BOOST_TEST(contains(text.out, "  lane 3: head 0, tail 8192, depth 8192\n"), text.out.substr(0, 4000));
  BOOST_TEST(contains(text.out, "    slot 31 (#31): request 32 ping"), text.out.substr(0, 4000));
  BOOST_TEST(!contains(text.out, "(#32)"), text.out.substr(0, 4000));
  BOOST_TEST(contains(text.out, "    ... 8160 more not shown (the first 32 of each ring are)\n"),
             text.out.substr(0, 4000));

  // A --file copy is read as the live segment is (copied by the kernel,
  // not through this process's memory).
  const TempFile file;
  std::filesystem::copy_file("/dev/shm/" + shm::segment_object_name(name), file.path,
                             std::filesystem::copy_options::overwrite_existing);
  const Run from_file = run_inspect({"--file", file.path});
  BOOST_TEST(from_file.rc == 0, from_file.err);
  BOOST_TEST(within(from_file, kRssScale * 32), "--file: peak RSS " << from_file.max_rss_kb << " KiB");
  BOOST_TEST(contains(from_file.out, "    ... 8160 more not shown (the first 32 of each ring are)\n"));

  const Run js = run_inspect({"--json", name});
  BOOST_TEST(within(js, kRssScale * 32), "json: peak RSS " << js.max_rss_kb << " KiB");
  const json j = parse_json(js);
  BOOST_REQUIRE(j["lanes"].size() == kWorkers);
  for (const char* rings : {"lanes", "completions"}) {
    for (const json& q : j[rings]) {
      BOOST_TEST(q["depth"] == kCapacity);
      BOOST_TEST(q["slots"].size() == 32u);
      BOOST_TEST(q["slots_not_shown"] == kCapacity - 32, q["slots_not_shown"]);
    }
  }
}

// The model decodes what RingReading says: at most max_slots of each
// ring, the rest counted; with kNoRings no ring at all, and the JSON and
// the text say the rings were not read rather than show them empty.
BOOST_AUTO_TEST_CASE(snapshot_decodes_rings_as_ring_reading_says) {
  const std::string name = test::unique_name("ringcap");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}}, /*max_workers=*/2, /*lane_capacity=*/8);
  seg->lane(1).head.store(5, std::memory_order_relaxed);
  seg->lane(1).tail.store(13, std::memory_order_relaxed);  // full: 8 pending
  const auto capped = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test", {true, 3});
  BOOST_REQUIRE_MESSAGE(capped.ok(), capped.status().to_string());
  BOOST_REQUIRE(capped->lanes.size() == 1u);
  const inspect::LaneView& lane = capped->lanes[0];
  BOOST_TEST(lane.depth == 8u);
  BOOST_TEST(lane.slots.size() == 3u);
  BOOST_TEST(lane.indices == std::vector<uint64_t>({5, 6, 7}));
  BOOST_TEST(lane.not_shown == 5u);
  BOOST_TEST(inspect::to_json(*capped)["lanes"][0]["slots_not_shown"] == 5);
  BOOST_TEST(contains(inspect::render_text(*capped), "    ... 5 more not shown (the first 3 of each ring are)\n"));

  const auto none = inspect::take_snapshot(seg->object().data(), seg->object().size(), "test", inspect::kNoRings);
  BOOST_REQUIRE_MESSAGE(none.ok(), none.status().to_string());
  BOOST_TEST(none->lanes.empty());
  BOOST_TEST(none->completions.empty());
  const json j = inspect::to_json(*none);
  BOOST_TEST(j["lanes"].is_null(), j["lanes"]);
  BOOST_TEST(j["completions"].is_null(), j["completions"]);
  const std::string text = inspect::render_text(*none);
  BOOST_TEST(contains(text, "== request lanes, completion queues: not read ==\n"), text);
}

// A session that has made no request yet shows no last request: the
// server resets the entry's stamp with its counters at the attach, so the
// previous session's is never shown as this one's.
BOOST_AUTO_TEST_CASE(a_new_session_shows_no_last_request_before_its_first) {
  const std::string name = test::unique_name("lastreq");
  test::ServerProcess server(name, kTensorArgs);
  {
    auto worker = connect(name);
    BOOST_REQUIRE(worker->ping().ok());
  }
  BOOST_REQUIRE(test::eventually([&] { return parse_json(run_inspect({"--json", name}))["workers"].empty(); }));
  auto worker = connect(name);
  json j = parse_json(run_inspect({"--json", name}));
  BOOST_REQUIRE_EQUAL(j["workers"].size(), 1u);
  BOOST_TEST(j["workers"][0]["state"] == "attached", j["workers"][0]);
  BOOST_TEST(j["workers"][0]["last_request_age_ms"].is_null(), j["workers"][0]);
  BOOST_REQUIRE(worker->ping().ok());
  j = parse_json(run_inspect({"--json", name}));
  BOOST_TEST(!j["workers"][0]["last_request_age_ms"].is_null(), j["workers"][0]);
}

// A claimed entry (a worker attaching, the server yet to attach it)
// still holds the previous session's counters, which the server zeroes
// only at the attach: none is shown under the new claim ("-" in the text,
// null in the JSON, no per-worker series in Prometheus). The server is
// stopped (SIGSTOP) so that the claim stays a claim.
BOOST_AUTO_TEST_CASE(claimed_entry_shows_no_earlier_session_counters) {
  const std::string name = test::unique_name("claimed");
  std::vector<std::string> args = kTensorArgs;
  args.insert(args.end(), {"--max-staleness", "100000000"});
  test::ServerProcess server(name, args);
  {
    auto worker = connect(name);
    auto buffer = worker->register_buffer(kAllBytes);
    BOOST_REQUIRE(buffer.ok());
    std::memset(buffer->data, 0, kAllBytes);
    for (int i = 0; i < 3; ++i) {
      BOOST_REQUIRE(worker->push(kAllTensors, buffer->id, 0, kAllBytes, Dtype::kF32, 0).ok());
      BOOST_REQUIRE(worker->pull(kAllTensors, buffer->id, 0).ok());
    }
  }  // detached: the entry is free again, its counters left as they were
  BOOST_REQUIRE(test::eventually([&] { return parse_json(run_inspect({"--json", name}))["workers"].empty(); }));
  const pid_t pid = server.process().pid();
  const StoppedFor scope(pid);
  BOOST_REQUIRE(scope.seen_stopped());
  test::RawClient claim(name, /*attach=*/false);
  BOOST_REQUIRE(claim.entry().pushes_applied.load() == 3u);  // the earlier session's, still there

  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_REQUIRE_EQUAL(j["workers"].size(), 1u);
  const json& w = j["workers"][0];
  BOOST_TEST(w["state"] == "claimed", w);
  for (const char* key :
       {"pushes_applied", "applied_bytes", "pushes_rejected", "pulls", "pulls_waited", "wait_ns", "pulls_timed_out",
        "pushes_scaled", "scale_factor_sum_micro", "last_request_ns", "last_request_age_ms"})
    BOOST_TEST(w[key].is_null(), key << ": " << w);
  const Run text = run_inspect({name});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(contains(text.out, "  worker " + std::to_string(claim.id()) + ": claimed, pid "), text.out);
  BOOST_TEST(contains(text.out, "    pushes applied - (- bytes), rejected -, pulls -, last request -"), text.out);
  BOOST_TEST(!contains(text.out, "pushes applied 3"), text.out);
  const Run prom = run_inspect({"--format", "prometheus", name});
  BOOST_TEST(prom.rc == 0, prom.err);
  BOOST_TEST(contains(prom.out, "# TYPE shmps_worker_pushes_applied_total counter\n"), prom.out);
  BOOST_TEST(!contains(prom.out, "shmps_worker_pushes_applied_total{"), prom.out);
  BOOST_TEST(!contains(prom.out, "shmps_worker_last_request_age_seconds{"), prom.out);
  claim.release_entry();
}

// A server stopped by SIGSTOP holds its segment but serves nothing: it is
// shown stopped, not alive, in every format (Prometheus: shmps_up 1 and
// shmps_server_stopped 1; a running one has shmps_server_stopped 0).
BOOST_AUTO_TEST_CASE(stopped_server_is_shown_stopped) {
  const std::string name = test::unique_name("sigstop");
  test::ServerProcess server(name, kTensorArgs);
  const pid_t pid = server.process().pid();
  const std::string series = "{name=\"" + name + "\"} ";
  const Run running = run_inspect({"--format", "prometheus", name});
  BOOST_TEST(contains(running.out, "shmps_server_stopped" + series + "0\n"), running.out);
  BOOST_TEST(contains(running.out, "shmps_server_unseen" + series + "0\n"), running.out);
  const StoppedFor scope(pid);
  BOOST_REQUIRE(scope.seen_stopped());

  const Run text = run_inspect({name});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(contains(text.out, "  server          pid " + std::to_string(pid) + " (stopped by a signal or a debugger"),
             text.out);
  BOOST_TEST(contains(text.out, "kill -CONT " + std::to_string(pid)), text.out);
  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_TEST(j["header"]["server_alive"] == true, j["header"]);
  BOOST_TEST(j["header"]["server_stopped"] == true, j["header"]);
  const Run prom = run_inspect({"--format", "prometheus", name});
  BOOST_TEST(contains(prom.out, "shmps_up" + series + "1\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_server_stopped" + series + "1\n"), prom.out);

  const std::map<std::string, json> rows = list_rows();
  BOOST_TEST_REQUIRE(rows.count(name) == 1u);
  BOOST_TEST(rows.at(name)["server_alive"] == true, rows.at(name));
  BOOST_TEST(rows.at(name)["server_stopped"] == true, rows.at(name));
  const Run listed = run_inspect({"--list"});
  std::istringstream lines(listed.out);
  bool seen = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + " ", 0) != 0) continue;
    seen = true;
    BOOST_TEST(contains(line, " " + std::to_string(pid) + " "), line);
    BOOST_TEST(contains(line, " stopped "), line);
  }
  BOOST_TEST(seen, listed.out);
}

// --format prometheus's shmps_inspect_error samples: reason -> value.
std::map<std::string, std::string> inspect_errors(const std::string& out) {
  std::map<std::string, std::string> by_reason;
  static const std::regex sample(R"re(^shmps_inspect_error\{name="[^"]*",reason="([a-z_]+)"\} (\S+)$)re");
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, sample)) by_reason[m[1]] = m[2];
  }
  return by_reason;
}
// Every reason at 0: a read, or a server that is down.
const std::map<std::string, std::string> kNoInspectError{
    {"permission", "0"}, {"bad_segment", "0"}, {"unpublished", "0"}, {"usage", "0"}, {"io", "0"}};

// --format prometheus tells a segment it could not read (no permission,
// foreign or corrupt, not published) from a server that is down: shmps_up
// 0 in both, and shmps_inspect_error{reason} 1 for the read failure, its
// other reasons (and all of them after a good read or with no segment) 0.
BOOST_AUTO_TEST_CASE(prometheus_tells_read_failures_from_a_server_down) {
  const std::string tool = test::program_path("shmps-inspect");
  const std::map<std::string, std::string>& none = kNoInspectError;
  const auto with = [&none](const std::string& reason) {
    auto m = none;
    m[reason] = "1";
    return m;
  };

  const std::string good = test::unique_name("promok");
  const RemoveSegment remove_good{good};
  const auto seg = crafted_segment(good, {{"w", {4}}});
  const Run ok = run_inspect({"--format", "prometheus", good});
  BOOST_TEST(ok.rc == 0, ok.err);
  BOOST_TEST(contains(ok.out, "# TYPE shmps_inspect_error gauge\n"), ok.out);
  BOOST_TEST((inspect_errors(ok.out) == none), ok.out);

  const std::string absent = test::unique_name("promnone");
  const Run down = run_inspect({"--format", "prometheus", absent});
  BOOST_TEST(down.rc == 2);
  BOOST_TEST(contains(down.out, "shmps_up{name=\"" + absent + "\"} 0\n"), down.out);
  BOOST_TEST((inspect_errors(down.out) == none), down.out);

  struct Case {
    std::string what, name, reason;
    int rc;
  };
  const std::string foreign = test::unique_name("promforeign"), unpublished = test::unique_name("promunpub");
  const RawObject foreign_object("shmps." + foreign, 8192), zeros("shmps." + unpublished, 8192);
  write_all(foreign_object.path, std::string(8192, 'A'));
  for (const Case& c :
       {Case{"foreign", foreign, "bad_segment", 3}, Case{"unpublished", unpublished, "unpublished", 4},
        Case{"permission", good, "permission", 1}, Case{"a name no server can take", "bad/name", "usage", 1}}) {
    BOOST_TEST_CONTEXT(c.what) {
      // No access: as nobody where this is root (root opens any object),
      // else with the object's mode 0.
      const std::string object = "/dev/shm/" + shm::segment_object_name(c.name);
      const bool as_nobody = c.reason == "permission" && ::geteuid() == 0;
      if (c.reason == "permission" && !as_nobody) BOOST_REQUIRE(::chmod(object.c_str(), 0) == 0);
      const test::Captured r =
          test::run_captured({tool, "--format", "prometheus", c.name}, std::chrono::seconds(10), [as_nobody] {
            return !as_nobody || (::setgid(65534) == 0 && ::setgroups(0, nullptr) == 0 && ::setuid(65534) == 0);
          });
      if (c.reason == "permission" && !as_nobody) BOOST_REQUIRE(::chmod(object.c_str(), 0600) == 0);
      BOOST_TEST(r.exit_code == c.rc, r.output);
      BOOST_TEST(contains(r.output, "shmps_up{name=\"" + c.name + "\"} 0\n"), r.output);
      BOOST_TEST((inspect_errors(r.output) == with(c.reason)), r.output);
    }
  }
}

// A server that died while starting (its segment made, not published)
// leaves a segment whose header names it: with that process dead, the
// segment is reported at once as that dead server's leftover, with how to
// remove it, instead of "server starting" after a 2 s wait; Prometheus
// shows a server that is down, and a worker's open says the same at once.
BOOST_AUTO_TEST_CASE(unpublished_segment_of_a_dead_server_is_its_leftover) {
  const std::string name = test::unique_name("deadstart");
  const RemoveSegment cleanup{name};
  test::Process starter = test::Process::fork_fn([&name] {
    shm::SegmentSpec spec;
    spec.name = name;
    spec.tensors = {{"w", {4}}};
    spec.max_workers = 2;
    spec.max_buffers = 1;
    spec.lane_capacity = 4;
    spec.config.optimizer_kind = 1;                     // sgd
    spec.config.backend = 1;                            // host
    return shm::Segment::create(spec, 7).ok() ? 0 : 1;  // and exits without publishing it
  });
  const pid_t pid = starter.pid();
  BOOST_REQUIRE(starter.wait() == 0);
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  const std::string dead = "the shmps-server that made it (pid " + std::to_string(pid) + ") is dead";
  const auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };

  auto started = std::chrono::steady_clock::now();
  const Run r = run_inspect({name});
  BOOST_TEST(seconds_since(started) < 1.5, "took " << seconds_since(started) << " s");
  BOOST_TEST(r.rc == 4, r.err);
  BOOST_TEST(contains(r.err, path + " (owner "), r.err);
  BOOST_TEST(contains(r.err, dead), r.err);
  BOOST_TEST(contains(r.err, "a server start that died before publishing it left it"), r.err);
  BOOST_TEST(
      contains(r.err, "; the next start of server '" + name + "' by its owner replaces it, or remove it: rm " + path),
      r.err);
  BOOST_TEST(!contains(r.err, "server starting"), r.err);

  const Run prom = run_inspect({"--format", "prometheus", name});
  BOOST_TEST(prom.rc == 4);
  BOOST_TEST(contains(prom.out, "shmps_up{name=\"" + name + "\"} 0\n"), prom.out);
  BOOST_TEST(contains(prom.out, "shmps_inspect_error{name=\"" + name + "\",reason=\"unpublished\"} 0\n"), prom.out);

  const std::map<std::string, json> rows = list_rows();
  BOOST_TEST_REQUIRE(rows.count(name) == 1u);
  const json& row = rows.at(name);
  const std::string error = row["error"].get<std::string>();
  BOOST_TEST(row["exit_code"] == 4, row);
  BOOST_TEST(contains(error, dead), error);
  BOOST_TEST(error.find("replaces it") == error.rfind("replaces it"), error);  // said once

  // A worker's open, which the same shm code serves.
  started = std::chrono::steady_clock::now();
  const auto opened = shm::Segment::open(name, /*read_only=*/true);
  BOOST_TEST(seconds_since(started) < 1.0, "took " << seconds_since(started) << " s");
  BOOST_TEST((opened.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(contains(opened.status().message(), dead), opened.status().message());

  // A --file copy of it is no server starting either.
  const TempFile file;
  write_all(file.path, segment_bytes(name));
  const Run copy = run_inspect({"--file", file.path});
  BOOST_TEST(copy.rc == 4, copy.err);
  BOOST_TEST(contains(copy.err, "(pid " + std::to_string(pid) + ")"), copy.err);
  BOOST_TEST(contains(copy.err, "is not running on this host"), copy.err);
  BOOST_TEST(!contains(copy.err, "server starting"), copy.err);
}

// One escaping rule for every name and path the tool prints, in text and
// JSON alike: bytes outside printable ASCII, `\` and `"` as \xNN. A `"`
// (which a tensor name may hold) cannot close the text's quotes, and the
// JSON's source is the text's.
BOOST_AUTO_TEST_CASE(names_and_paths_are_escaped_alike_in_text_and_json) {
  const std::string name = test::unique_name("quote");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"a\"b", {4}}});
  const Run live = run_inspect({name});
  BOOST_TEST(live.rc == 0, live.err);
  BOOST_TEST(contains(live.out, " a\\x22b "), live.out);
  BOOST_TEST(!contains(live.out, "a\"b"), live.out);
  BOOST_TEST(parse_json(run_inspect({"--json", name}))["tensors"][0]["name"] == "a\\x22b");

  TempFile base;
  const std::string path = base.path + "\x1b\"q.seg";
  const std::string escaped = base.path + "\\x1b\\x22q.seg";
  const TempFile file{path};
  write_all(path, segment_bytes(name));
  const Run text = run_inspect({"--file", path});
  BOOST_TEST(contains(text.out, "shmps segment " + escaped + "\n"), text.out);
  const json j = parse_json(run_inspect({"--json", "--file", path}));
  BOOST_TEST(j["source"] == escaped, j["source"]);
}

// Prometheus samples are the shortest decimal that reads back as the
// value (the configured lr a float's: 0.001, not 0.0010000000474974513),
// and a histogram's _count is its +Inf bucket, whatever the segment's own
// count word says; its buckets never go down.
BOOST_AUTO_TEST_CASE(prometheus_numbers_are_shortest_and_histogram_counts_match) {
  const std::string name = test::unique_name("promnum");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  seg->header().config.lr = 0.001f;
  shm::StatsBlock& st = seg->stats();
  st.applied_bytes.store(1'000'000'000'000, std::memory_order_relaxed);
  st.apply_ns.count.store(2, std::memory_order_relaxed);  // disagrees with the buckets
  st.apply_ns.buckets[3].store(5, std::memory_order_relaxed);
  st.apply_ns.buckets[50].store(7, std::memory_order_relaxed);  // past the last le shown
  st.queue_ns.buckets[10].store(~uint64_t{0} - 1, std::memory_order_relaxed);
  st.queue_ns.buckets[11].store(9, std::memory_order_relaxed);  // the sum saturates
  const Run r = run_inspect({"--format", "prometheus", name});
  BOOST_REQUIRE_MESSAGE(r.rc == 0, r.err);
  const std::string n = "{name=\"" + name + "\"";
  BOOST_TEST(contains(r.out, "shmps_learning_rate" + n + "} 0.001\n"), r.out);
  BOOST_TEST(contains(r.out, "shmps_applied_bytes_total" + n + "} 1e+12\n"), r.out);
  for (const std::string family : {"shmps_apply_seconds", "shmps_queue_seconds", "shmps_staleness"}) {
    BOOST_TEST_CONTEXT(family) {
      std::string inf, count;
      double last = -1;
      std::istringstream lines(r.out);
      for (std::string line; std::getline(lines, line);) {
        if (line.rfind(family + "_bucket" + n, 0) == 0) {
          const double v = std::stod(line.substr(line.rfind(' ') + 1));
          BOOST_TEST(v >= last, line);
          last = v;
          if (contains(line, "le=\"+Inf\"")) inf = line.substr(line.rfind(' ') + 1);
        }
        if (line.rfind(family + "_count" + n, 0) == 0) count = line.substr(line.rfind(' ') + 1);
      }
      BOOST_TEST(!inf.empty(), r.out);
      BOOST_TEST(count == inf, r.out);
    }
  }
  BOOST_TEST(contains(r.out, "shmps_apply_seconds_count" + n + "} 12\n"), r.out);
  BOOST_TEST(contains(r.out, "shmps_queue_seconds_count" + n + "} 18446744073709551616\n"), r.out);
}

// A reader that goes away (`| head -1`) ends the tool quietly: exit 1, as
// for every output that did not all get out, but no message (the reader
// asked for less), in every mode.
BOOST_AUTO_TEST_CASE(closed_pipe_on_stdout_ends_quietly) {
  const std::string name = test::unique_name("epipe");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  const TempFile err;
  const std::string tool = test::program_path("shmps-inspect");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--watch", "--interval-ms", "10", "--count", "20", name},
        {"--watch", "--json", "--interval-ms", "10", "--count", "20", name},
        {name},
        {"--json", name},
        {"--format", "prometheus", name},
        {"--list"},
        {"--help"}}) {
    BOOST_TEST_CONTEXT(args[0] << " " << args.back()) {
      int fds[2];
      BOOST_REQUIRE(::pipe(fds) == 0);
      ::close(fds[0]);  // no reader
      std::vector<std::string> argv{tool};
      argv.insert(argv.end(), args.begin(), args.end());
      std::vector<char*> cargs;
      for (auto& a : argv) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      const pid_t child = ::fork();
      BOOST_REQUIRE(child >= 0);
      if (child == 0) {
        ::signal(SIGPIPE, SIG_DFL);  // whatever the test runner set
        const int e = ::open(err.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (e < 0 || ::dup2(fds[1], 1) < 0 || ::dup2(e, 2) < 0) _exit(126);
        ::execv(cargs[0], cargs.data());
        _exit(127);
      }
      ::close(fds[1]);
      int status = 0;
      BOOST_REQUIRE(::waitpid(child, &status, 0) == child);
      BOOST_TEST(WIFEXITED(status), "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
      BOOST_TEST(WEXITSTATUS(status) == 1);
      const std::string message = shmps::test::read_file(err.path);
      BOOST_TEST(message.empty(), message);
    }
  }
}

// What is at a segment's name and is no shm object (a symbolic link, a
// FIFO) is named as what it is, with the way to remove it; no access
// (EACCES) says how to get it: run as the segment's owner, or the group
// and --group-access.
BOOST_AUTO_TEST_CASE(odd_objects_and_no_access_are_explained) {
  const std::string target = test::unique_name("linked"), link = test::unique_name("link");
  const RemoveSegment cleanup{target};
  const auto seg = crafted_segment(target, {{"w", {4}}});
  const std::string link_path = "/dev/shm/" + shm::segment_object_name(link);
  const std::string target_path = "/dev/shm/" + shm::segment_object_name(target);
  BOOST_REQUIRE(::symlink(target_path.c_str(), link_path.c_str()) == 0);
  struct Unlink {
    std::string path;
    ~Unlink() { ::unlink(path.c_str()); }
  } unlink_link{link_path};
  const Run linked = run_inspect({link});
  BOOST_TEST(linked.rc == 1, linked.err);
  BOOST_TEST(contains(linked.err, link_path + " is a symbolic link (to " + target_path + "), not a shm object"),
             linked.err);
  BOOST_TEST(contains(linked.err, "rm " + link_path), linked.err);

  const std::string fifo = test::unique_name("fifo");
  const std::string fifo_path = "/dev/shm/" + shm::segment_object_name(fifo);
  BOOST_REQUIRE(::mkfifo(fifo_path.c_str(), 0600) == 0);
  const Unlink unlink_fifo{fifo_path};
  const Run piped = Inspect({fifo}).finish(std::chrono::seconds(5));
  BOOST_TEST(piped.rc == 1, piped.err);
  BOOST_TEST(contains(piped.err, fifo_path + " is a FIFO, not a regular file (owner "), piped.err);
  BOOST_TEST(contains(piped.err, "not a shm object any shmps process makes"), piped.err);
  BOOST_TEST(contains(piped.err, "rm " + fifo_path), piped.err);
  const std::map<std::string, json> rows = list_rows();
  BOOST_TEST_REQUIRE(rows.count(link) == 1u);
  BOOST_TEST_REQUIRE(rows.count(fifo) == 1u);
  BOOST_TEST(contains(rows.at(link)["error"].get<std::string>(), "is a symbolic link"), rows.at(link));
  BOOST_TEST(contains(rows.at(fifo)["error"].get<std::string>(), "is a FIFO"), rows.at(fifo));

  // No access: as nobody where this is root, else with the object's mode 0.
  const bool as_nobody = ::geteuid() == 0;
  if (!as_nobody) BOOST_REQUIRE(::chmod(target_path.c_str(), 0) == 0);
  const test::Captured denied =
      test::run_captured({test::program_path("shmps-inspect"), target}, std::chrono::seconds(10), [as_nobody] {
        return !as_nobody || (::setgid(65534) == 0 && ::setgroups(0, nullptr) == 0 && ::setuid(65534) == 0);
      });
  if (!as_nobody) BOOST_REQUIRE(::chmod(target_path.c_str(), 0600) == 0);
  BOOST_TEST(denied.exit_code == 1, denied.output);
  BOOST_TEST(contains(denied.output, "permission denied"), denied.output);
  // Its own owner, denied by the mode, has no one else to be.
  if (as_nobody) {
    BOOST_TEST(contains(denied.output, "--group-access"), denied.output);
    BOOST_TEST(contains(denied.output, "; or run shmps-inspect as the segment's owner: sudo shmps-inspect " + target),
               denied.output);
  }
}

// --list reads /proc/locks once, however many rows ask who holds a flock
// (objects no start will finish, a live server's segment): any user can
// leave objects at shmps names and flocks on files of their own, and a
// read per row would cost their product. Counted as the opens of a file
// bound over /proc/locks in a mount namespace of the tool's own.
BOOST_AUTO_TEST_CASE(list_reads_proc_locks_once, *boost::unit_test::precondition(can_unshare)) {
  const std::string tag = test::unique_name("lslocks");
  std::vector<std::unique_ptr<RawObject>> objects;
  for (int i = 0; i < 20; ++i)
    objects.push_back(std::make_unique<RawObject>("shmps." + tag + "e" + std::to_string(i), 0));
  const std::string live = tag + "live";
  const RemoveSegment cleanup{live};
  const auto seg = crafted_segment(live, {{"w", {4}}});  // its server: this process, alive
  std::this_thread::sleep_for(shm::kSegmentStartWait + std::chrono::milliseconds(300));

  const TempFile locks, out;
  write_all(locks.path, test::read_file("/proc/locks"));
  const UniqueFd watch(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  BOOST_REQUIRE(watch.fd >= 0);
  // A read opens the file and closes it: the events alternate, so none is
  // merged into the one before it.
  BOOST_REQUIRE(::inotify_add_watch(watch.fd, locks.path.c_str(), IN_OPEN | IN_CLOSE_NOWRITE) >= 0);
  const std::string script = "mount --bind " + test::shell_quote(locks.path) + " /proc/locks && exec " +
                             test::shell_quote(test::program_path("shmps-inspect")) + " --list --json > " +
                             test::shell_quote(out.path);
  const test::Captured r = test::run_captured({"/usr/bin/env", "unshare", "-rm", "/bin/sh", "-c", script});
  BOOST_REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  int opens = 0;
  alignas(inotify_event) char events[64 * 1024];
  for (ssize_t n; (n = ::read(watch.fd, events, sizeof events)) > 0;)
    for (ssize_t at = 0; at < n;) {
      inotify_event e{};
      std::memcpy(&e, events + at, sizeof e);
      opens += (e.mask & IN_OPEN) != 0 ? 1 : 0;
      at += static_cast<ssize_t>(sizeof e + e.len);
    }
  BOOST_TEST(opens == 1);

  // The rows that asked.
  const json j = json::parse(test::read_file(out.path));
  int unwritten = 0;
  for (const json& row : j["segments"]) {
    const std::string n = row["name"].get<std::string>();
    if (n.rfind(tag + "e", 0) == 0) {
      ++unwritten;
      BOOST_TEST(contains(row["error"].get<std::string>(), "unchanged for"), row);
    }
    if (n == live) BOOST_TEST(row["server_holds_object"].is_boolean(), row);
  }
  BOOST_TEST(unwritten == 20);
}

boost::test_tools::assertion_result can_unshare_pid(boost::unit_test::test_unit_id) {
  const test::Captured c = test::run_captured({"/bin/sh", "-c", "unshare -pf --mount-proc --kill-child=TERM true"});
  boost::test_tools::assertion_result r(c.exit_code == 0);
  r.message() << "needs unshare -pf --mount-proc --kill-child (a pid namespace; root): " << c.output;
  return r;
}

// A server in a pid namespace of its own (as in a container that shares
// /dev/shm) writes a pid that names no process here, or another one: not
// "dead" (which a start under its name would replace), but "unseen": a
// process holds the object's lock, as a serving server does.
BOOST_AUTO_TEST_CASE(list_shows_a_server_in_another_pid_namespace_as_unseen,
                     *boost::unit_test::precondition(can_unshare_pid)) {
  const std::string name = test::unique_name("lsns");
  const RemoveSegment cleanup{name};
  test::Process server = test::Process::spawn({"/usr/bin/unshare", "-pf", "--mount-proc", "--kill-child=TERM",
                                               test::program_path("shmps-server"), "--name", name, "--tensor", "w:4",
                                               "--backend", "host"});
  json row;
  BOOST_REQUIRE_MESSAGE(test::eventually([&] {
                          const json j = parse_json(run_inspect({"--list", "--json"}));
                          for (const json& r : j["segments"])
                            if (r["name"] == name && r.contains("server_pid")) row = r;
                          return !row.is_null();
                        }),
                        "no segment published");
  BOOST_TEST(row["server_pid"] != server.pid(), row);  // the namespace's pid
  BOOST_TEST(row["server_alive"] == false, row);
  BOOST_TEST(row["server_unseen"] == true, row);
  const Run text = run_inspect({"--list"});
  std::istringstream lines(text.out);
  std::string line;
  while (std::getline(lines, line) && line.rfind(name + " ", 0) != 0) {
  }
  BOOST_TEST(contains(line, " unseen "), text.out);
  const Run plain = run_inspect({name});
  BOOST_TEST(contains(plain.out, "a server in a pid namespace below this one"), plain.out);
  // Up for an exporter on the host: an alert on shmps_up == 0 stays quiet.
  const Run prom = run_inspect({"--format", "prometheus", name});
  const std::string series = "{name=\"" + name + "\"} ";
  BOOST_TEST(contains(prom.out, "\nshmps_up" + series + "1\n"), prom.out);
  BOOST_TEST(contains(prom.out, "\nshmps_server_unseen" + series + "1\n"), prom.out);
  // unshare ignores SIGTERM while it waits: the server, by its pid here.
  const std::string pid = std::to_string(server.pid());
  const std::string child = test::read_file("/proc/" + pid + "/task/" + pid + "/children");
  BOOST_REQUIRE_MESSAGE(!child.empty(), "unshare has no child");
  BOOST_REQUIRE(::kill(std::stoi(child), SIGTERM) == 0);
  BOOST_TEST(server.wait(std::chrono::seconds(10)) == 0);
}

// /proc/locks read once for the whole list is older than a server that
// (re)starts under a name before its row: such a live server that the
// table says does not hold its object has the table read again (once),
// and is "alive", not "copy". The tool's /proc/locks is a FIFO here: its
// first read gets a table without the server's lock, the second the real one.
BOOST_AUTO_TEST_CASE(list_reads_proc_locks_again_for_a_server_it_says_holds_nothing,
                     *boost::unit_test::precondition(can_unshare)) {
  const std::string live = test::unique_name("lsagain");
  test::ServerProcess server(live, kTensorArgs);
  const test::TempDir dir("lsagain");
  const std::string fifo = (dir.path / "locks").string(), out = (dir.path / "out").string();
  BOOST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string real = test::read_file("/proc/locks");
  const std::string script = "mount --bind " + test::shell_quote(fifo) + " /proc/locks && exec " +
                             test::shell_quote(test::program_path("shmps-inspect")) + " --list --json > " +
                             test::shell_quote(out);
  const UniqueFd watch(::inotify_init1(IN_CLOEXEC));
  BOOST_REQUIRE(watch.fd >= 0);
  BOOST_REQUIRE(::inotify_add_watch(watch.fd, fifo.c_str(), IN_CLOSE_NOWRITE) >= 0);
  test::Process tool = test::Process::spawn({"/usr/bin/env", "unshare", "-rm", "/bin/sh", "-c", script});
  // Each read: the FIFO opened for writing once the tool has it open to
  // read, the table written, and the tool's close of it waited for (the
  // next open for writing then finds its next read, or none).
  int reads = 0, code = -1;
  bool exited = false;
  for (const std::string& table : {std::string(), real}) {
    int fd = -1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC)) < 0 &&
           std::chrono::steady_clock::now() < deadline && !(exited = tool.try_wait(&code)))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (fd < 0) break;
    BOOST_REQUIRE(::fcntl(fd, F_SETFL, 0) == 0);  // blocking writes
    BOOST_REQUIRE(::write(fd, table.data(), table.size()) == static_cast<ssize_t>(table.size()));
    ::close(fd);
    ++reads;
    alignas(inotify_event) char event[sizeof(inotify_event) + NAME_MAX + 1];
    BOOST_REQUIRE(::read(watch.fd, event, sizeof event) > 0);  // the tool's close
  }
  if (!exited) code = tool.wait(std::chrono::seconds(10));
  BOOST_TEST(code == 0);
  BOOST_TEST(reads == 2);
  const json j = json::parse(test::read_file(out));
  json row;
  for (const json& r : j["segments"])
    if (r["name"] == live) row = r;
  BOOST_TEST(row["server_alive"] == true, row);
  BOOST_TEST(row["server_holds_object"] == true, row);
}

// A crafted sparse object at a segment's name, a header all that is
// written in it (every count at its limit: 3.4 GB of holes): no read
// allocates a page of it past what validation passed. With its section
// offsets wrong, nothing past the header is read; with them right but its
// tensor table a hole (no tensor named), nothing past the table.
BOOST_AUTO_TEST_CASE(crafted_sparse_object_is_read_no_further_than_it_validates) {
  using H = shm::SegmentHeader;
  const shm::Geometry g =
      shm::compute_geometry(shm::kMaxTensorsLimit, shm::kMaxWorkersLimit, shm::kMaxBuffersLimit, shm::kMaxLaneCapacity);
  std::string header(sizeof(H), '\0');
  poke(&header, offsetof(H, magic), shm::kMagic);
  poke(&header, offsetof(H, layout_version), shm::kLayoutVersion);
  poke(&header, offsetof(H, header_size), static_cast<uint32_t>(sizeof(H)));
  poke(&header, offsetof(H, segment_size), g.segment_size);
  poke(&header, offsetof(H, tensor_count), shm::kMaxTensorsLimit);
  poke(&header, offsetof(H, tensor_desc_size), static_cast<uint32_t>(sizeof(shm::TensorDesc)));
  poke(&header, offsetof(H, max_workers), shm::kMaxWorkersLimit);
  poke(&header, offsetof(H, max_buffers), shm::kMaxBuffersLimit);
  poke(&header, offsetof(H, lane_capacity), shm::kMaxLaneCapacity);
  poke(&header, offsetof(H, config) + offsetof(shm::ConfigBlock, optimizer_kind), uint32_t{1});
  poke(&header, offsetof(H, config) + offsetof(shm::ConfigBlock, backend), uint32_t{1});
  for (const bool offsets_right : {false, true}) {
    BOOST_TEST_CONTEXT("section offsets " << (offsets_right ? "right" : "wrong")) {
      std::string bytes = header;
      if (offsets_right) {
        poke(&bytes, offsetof(H, tensor_table_offset), g.tensor_table_offset);
        poke(&bytes, offsetof(H, worker_table_offset), g.worker_table_offset);
        poke(&bytes, offsetof(H, worker_entry_size), static_cast<uint32_t>(g.worker_entry_size));
        poke(&bytes, offsetof(H, lanes_offset), g.lanes_offset);
        poke(&bytes, offsetof(H, lane_stride), g.lane_stride);
        poke(&bytes, offsetof(H, completions_offset), g.completions_offset);
        poke(&bytes, offsetof(H, completion_stride), g.completion_stride);
        poke(&bytes, offsetof(H, stats_offset), g.stats_offset);
      }
      const std::string name = test::unique_name("crafted");
      const RawObject object("shmps." + name, static_cast<off_t>(g.segment_size));
      {
        const UniqueFd fd(::open(object.path.c_str(), O_WRONLY | O_CLOEXEC));
        BOOST_REQUIRE(fd.fd >= 0);
        BOOST_REQUIRE(::pwrite(fd.fd, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
      }
      const auto blocks = [&object] {
        struct stat st {};
        BOOST_REQUIRE(::stat(object.path.c_str(), &st) == 0);
        return static_cast<long long>(st.st_blocks) * 512;
      };
      const long long before = blocks();
      // The tensor table: 512 KiB.
      const long long allowed =
          offsets_right ? static_cast<long long>(shm::kMaxTensorsLimit * sizeof(shm::TensorDesc)) : 0;
      for (const std::vector<std::string>& args :
           {std::vector<std::string>{"--list", "--json"}, {name}, {"--json", name}, {"--format", "prometheus", name}}) {
        BOOST_TEST_CONTEXT(args.front()) {
          const Run r = run_inspect(args);
          BOOST_TEST(r.rc == (args.size() == 2 && args[0] == "--list" ? 0 : 3), r.err);
          BOOST_TEST(blocks() - before <= allowed, "allocated " << (blocks() - before) << " bytes");
        }
      }
    }
  }
}

// A lane slot's union is a push's version or a pull's wait_ns
// (layout.hpp, Request): each opcode shows its own, a pull's wait a
// string in JSON (kMaxTimeout's 3.15e18 ns passes 2^53), in the text too.
BOOST_AUTO_TEST_CASE(lane_slot_shows_a_pulls_wait_not_a_version) {
  const std::string name = test::unique_name("pullwait");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}});
  shm::Request pull{};
  pull.request_id = 7;
  pull.opcode = static_cast<uint32_t>(shm::Opcode::kPull);
  pull.byte_length = 16;
  pull.wait_ns = (uint64_t{1} << 60) + 1;
  shm::Request push{};
  push.request_id = 8;
  push.opcode = static_cast<uint32_t>(shm::Opcode::kPush);
  push.byte_length = 16;
  push.worker_version = 3;
  push.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
  seg->lane_slots(0)[0] = pull;
  seg->lane_slots(0)[1] = push;
  seg->lane(0).tail.store(2, std::memory_order_relaxed);

  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_REQUIRE(j["lanes"].size() == 1u);
  const json& slots = j["lanes"][0]["slots"];
  BOOST_REQUIRE(slots.size() == 2u);
  BOOST_TEST_CONTEXT(slots[0]) {
    BOOST_TEST(slots[0]["opcode"] == "pull");
    BOOST_TEST(!slots[0].contains("version"));
    BOOST_TEST(!slots[0].contains("dtype"));
    BOOST_TEST(slots[0]["wait_ns"] == "1152921504606846977");
  }
  BOOST_TEST_CONTEXT(slots[1]) {
    BOOST_TEST(slots[1]["opcode"] == "push");
    BOOST_TEST(slots[1]["version"] == 3);
    BOOST_TEST(slots[1]["dtype"] == "f32");
    BOOST_TEST(!slots[1].contains("wait_ns"));
  }
  const Run text = run_inspect({name});
  BOOST_TEST(text.rc == 0, text.err);
  BOOST_TEST(
      contains(text.out, "request 7 pull tensor 0 (w) buffer 0 offset 0 length 16 wait_ns 1152921504606846977 ("),
      text.out);
  BOOST_TEST(contains(text.out, "request 8 push tensor 0 (w) buffer 0 offset 0 length 16 version 3 dtype f32 ("),
             text.out);
}

// Sizes and offsets that a writer of the segment can set past 2^53, and
// validation lets through, are strings in the JSON, read back exactly: a
// tensor's 2^62 elements (its shape, its count, the next one's offset,
// the total), a buffer's and a request's byte offset and length, the
// weights export's bytes; and --list's parameters, model bytes and an
// object's size.
BOOST_AUTO_TEST_CASE(sizes_past_2_53_are_strings_in_json) {
  const std::string name = test::unique_name("bigjson");
  const RemoveSegment cleanup{name};
  const auto seg = crafted_segment(name, {{"w", {4}}, {"b", {3}}});
  constexpr uint64_t k2p62 = uint64_t{1} << 62, k2p53 = uint64_t{1} << 53;
  shm::SegmentHeader& h = seg->header();
  auto* tensors = reinterpret_cast<shm::TensorDesc*>(static_cast<char*>(seg->object().data()) + h.tensor_table_offset);
  tensors[0].shape[0] = tensors[0].element_count = k2p62;
  tensors[1].element_offset = k2p62;
  h.total_elements = k2p62 + 3;
  h.weights_export.flags = shm::kWeightsExportPresent;
  h.weights_export.allocation_bytes = k2p53 + 7;
  h.weights_export.weights_bytes = k2p53 + 9;
  seg->worker(0).owner.store(shm::make_owner(static_cast<uint32_t>(::getpid()), shm::WorkerState::kAttached),
                             std::memory_order_relaxed);
  shm::BufferDesc& d = seg->buffer(0, 0);
  d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
  d.length = k2p53 + 1;
  d.offset = k2p53 + 3;
  shm::Request push{};
  push.opcode = static_cast<uint32_t>(shm::Opcode::kPush);
  push.byte_offset = (uint64_t{1} << 63) + 5;
  push.byte_length = k2p53 + 1;
  seg->lane_slots(0)[0] = push;
  seg->lane(0).tail.store(1, std::memory_order_relaxed);
  const std::string big = test::unique_name("bigobj");
  const RawObject big_object("shmps." + big, static_cast<off_t>(k2p62));

  // nlohmann::json keeps a number's digits exact (a uint64_t): a string
  // compares equal to none.
  const json j = parse_json(run_inspect({"--json", name}));
  BOOST_TEST_CONTEXT(j.dump()) {
    BOOST_TEST(j["header"]["total_elements"] == "4611686018427387907");
    BOOST_TEST(j["tensors"][0]["shape"] == json({"4611686018427387904"}));
    BOOST_TEST(j["tensors"][0]["elements"] == "4611686018427387904");
    BOOST_TEST(j["tensors"][1]["offset"] == "4611686018427387904");
    BOOST_TEST(j["weights_export"]["allocation_bytes"] == "9007199254740999");
    BOOST_TEST(j["weights_export"]["weights_bytes"] == "9007199254741001");
    BOOST_REQUIRE(j["workers"].size() == 1u);
    BOOST_REQUIRE(j["workers"][0]["buffers"].size() == 1u);
    BOOST_TEST(j["workers"][0]["buffers"][0]["length"] == "9007199254740993");
    BOOST_TEST(j["workers"][0]["buffers"][0]["offset"] == "9007199254740995");
    BOOST_REQUIRE(j["lanes"].size() == 1u);
    BOOST_TEST(j["lanes"][0]["slots"][0]["offset"] == "9223372036854775813");
    BOOST_TEST(j["lanes"][0]["slots"][0]["length"] == "9007199254740993");
  }
  const std::map<std::string, json> rows = list_rows();
  BOOST_REQUIRE(rows.count(name) == 1u && rows.count(big) == 1u);
  BOOST_TEST(rows.at(name)["parameters"] == "4611686018427387907", rows.at(name));
  BOOST_TEST(rows.at(name)["model_bytes"] == "18446744073709551615", rows.at(name));
  BOOST_TEST(rows.at(name)["bytes"] == std::to_string(seg->object().size()), rows.at(name));
  BOOST_TEST(rows.at(big)["bytes"] == "4611686018427387904", rows.at(big));
}

// --list's exit_code for an object at a name no server can take (a
// buffer's shape without its segment, one too long) is the one a plain
// shmps-inspect <name> exits with: 1, a usage error.
BOOST_AUTO_TEST_CASE(list_exit_code_for_a_name_no_server_can_take_is_a_plain_runs) {
  const std::string tag = test::unique_name("lsrc");
  const std::string buffer_like = tag + ".p123.0", too_long = tag + std::string(40, 'A');
  const RawObject a("shmps." + buffer_like, 4096), b("shmps." + too_long, 4096);
  const std::map<std::string, json> rows = list_rows();
  for (const std::string& n : {buffer_like, too_long}) {
    BOOST_TEST_CONTEXT(n) {
      const Run plain = run_inspect({n});
      BOOST_TEST(plain.rc == 1, plain.err);
      BOOST_REQUIRE(rows.count(n) == 1u);
      BOOST_TEST(rows.at(n)["exit_code"] == plain.rc, rows.at(n));
    }
  }
}

// An object at a segment's name that is empty or whose magic is zero,
// unlocked and unchanged for longer than a start's wait, is what a start
// that died left: to Prometheus a server that is down (shmps_up 0, every
// shmps_inspect_error reason 0), with exit 4 as for a dead server's
// unpublished segment.
BOOST_AUTO_TEST_CASE(prometheus_shows_an_unwritten_leftover_as_a_server_down) {
  const std::string empty = test::unique_name("promempty"), zero = test::unique_name("promzero");
  const RawObject e("shmps." + empty, 0), z("shmps." + zero, 8192);
  std::this_thread::sleep_for(shm::kSegmentStartWait + std::chrono::milliseconds(300));
  for (const std::string& name : {empty, zero}) {
    BOOST_TEST_CONTEXT(name) {
      const Run r = run_inspect({"--format", "prometheus", name});
      BOOST_TEST(r.rc == 4, r.err);
      BOOST_TEST(contains(r.err, "a server start that died before"), r.err);
      BOOST_TEST(contains(r.out, "shmps_up{name=\"" + name + "\"} 0\n"), r.out);
      BOOST_TEST((inspect_errors(r.out) == kNoInspectError), r.out);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
