// shmps-server as systemd runs it, with real processes: the sd_notify
// sequence on a datagram socket this test owns ($NOTIFY_SOCKET), the
// watchdog keep-alives ($WATCHDOG_USEC / $WATCHDOG_PID), SIGHUP reloading
// the config file live, config-file errors at start, and the journal's
// syslog-priority prefix ($JOURNAL_STREAM).
#define BOOST_TEST_MODULE test_service
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "shmps/shm/layout.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

using shmps::test::read_file;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The timestamp that starts a log line written outside the journal.
const std::regex kTimestamp(R"(^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} shmps-server )");
const std::regex kTimestamps(R"((^|\n)\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} (shmps-server ))");

// `text` with each line's leading timestamp taken off.
std::string without_timestamps(const std::string& text) { return std::regex_replace(text, kTimestamps, "$1$2"); }

// A path under /tmp, unique to this process, removed at scope exit.
struct TempPath {
  explicit TempPath(const std::string& tag) : path("/tmp/" + test::unique_name("shmps_" + tag)) {}
  ~TempPath() { ::unlink(path.c_str()); }
  std::string path;
};

// One datagram as the service manager would read it: newline-separated
// assignments, and the sender's pid (SCM_CREDENTIALS; NotifyAccess=main
// accepts only the main process).
struct Message {
  std::string text;
  pid_t pid = 0;
  std::chrono::steady_clock::time_point at;
  bool has(const std::string& assignment) const {
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      if (line == assignment) return true;
    return false;
  }
  std::string value(const std::string& key) const {
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      if (line.rfind(key + "=", 0) == 0) return line.substr(key.size() + 1);
    return {};
  }
};

// The service manager's end of $NOTIFY_SOCKET: an AF_UNIX datagram socket
// bound to a path, receiving the sender's credentials.
class NotifySocket {
 public:
  NotifySocket() : path_("/tmp/" + test::unique_name("shmps_notify") + ".sock") {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    BOOST_REQUIRE(fd_ >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    BOOST_REQUIRE(path_.size() < sizeof addr.sun_path);
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    ::unlink(path_.c_str());
    BOOST_REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    const int one = 1;
    BOOST_REQUIRE(::setsockopt(fd_, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) == 0);
  }
  ~NotifySocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }

  // The next datagram, or nullopt after `timeout`.
  std::optional<Message> receive(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return std::nullopt;
    char data[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
    iovec iov{data, sizeof data};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(fd_, &msg, 0);
    if (n < 0) return std::nullopt;
    Message m;
    m.text.assign(data, static_cast<size_t>(n));
    m.at = std::chrono::steady_clock::now();
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
        ucred cred{};
        std::memcpy(&cred, CMSG_DATA(c), sizeof cred);
        m.pid = cred.pid;
      }
    }
    return m;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

struct ServiceEnv {
  std::string notify_socket;    // $NOTIFY_SOCKET; empty: unset
  uint64_t watchdog_usec = 0;   // $WATCHDOG_USEC with $WATCHDOG_PID = the server; 0: unset
  bool journal_stream = false;  // $JOURNAL_STREAM = stderr file's device:inode
  // Not the environment: SIGINT, SIGTERM and SIGHUP blocked at the exec,
  // as a launcher that takes them with sigwait() leaves them.
  bool signals_blocked = false;
};

// execv(argv[0], argv) in a forked child: returns 127 only when the exec
// failed.
int exec_argv(const std::vector<std::string>& argv) {
  std::vector<char*> a;
  for (const std::string& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  ::execv(a[0], a.data());
  return 127;
}

// shmps-server <args> as systemd would start it: environment per `env`,
// stderr into `stderr_path`. The environment is set in the child, after
// fork, because $WATCHDOG_PID must name the server's own pid.
test::Process spawn_server(const std::vector<std::string>& args, const ServiceEnv& env,
                           const std::string& stderr_path) {
  std::vector<std::string> argv{test::program_path("shmps-server")};
  argv.insert(argv.end(), args.begin(), args.end());
  return test::Process::fork_fn([argv, env, stderr_path]() -> int {
    ::unsetenv("NOTIFY_SOCKET");
    ::unsetenv("WATCHDOG_USEC");
    ::unsetenv("WATCHDOG_PID");
    ::unsetenv("JOURNAL_STREAM");
    if (!env.notify_socket.empty()) ::setenv("NOTIFY_SOCKET", env.notify_socket.c_str(), 1);
    if (env.watchdog_usec != 0) {
      ::setenv("WATCHDOG_USEC", std::to_string(env.watchdog_usec).c_str(), 1);
      ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
    }
    const int fd = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::dup2(fd, STDERR_FILENO) < 0) return 126;
    ::close(fd);
    if (env.journal_stream) {
      struct stat st {};
      ::fstat(STDERR_FILENO, &st);
      const std::string stream = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
      ::setenv("JOURNAL_STREAM", stream.c_str(), 1);
    }
    if (env.signals_blocked) {
      sigset_t blocked;
      sigemptyset(&blocked);
      for (const int signo : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&blocked, signo);
      ::sigprocmask(SIG_BLOCK, &blocked, nullptr);
    }
    return exec_argv(argv);
  });
}

std::string segment_path(const std::string& name) { return "/dev/shm/shmps." + name; }

// True when /dev/shm/shmps.<name> is a published segment of process `pid`.
bool segment_published_by(const std::string& name, pid_t pid) {
  std::ifstream in(segment_path(name), std::ios::binary);
  char head[64] = {};
  if (!in.read(head, sizeof head)) return false;
  uint32_t version = 0, server_pid = 0;
  std::memcpy(&version, head + offsetof(shm::SegmentHeader, layout_version), 4);
  std::memcpy(&server_pid, head + offsetof(shm::SegmentHeader, server_pid), 4);
  return version == shm::kLayoutVersion && server_pid == static_cast<uint32_t>(pid);
}

// The segment's config block as shmps-inspect reads it.
shm::ConfigBlock segment_config(const std::string& name) {
  shm::ConfigBlock c{};
  std::ifstream in(segment_path(name), std::ios::binary);
  in.seekg(offsetof(shm::SegmentHeader, config));
  in.read(reinterpret_cast<char*>(&c), sizeof c);
  return c;
}

// Unlinks the segment at scope exit (after a failed test).
struct SegmentGuard {
  explicit SegmentGuard(std::string n) : name(std::move(n)) {}
  ~SegmentGuard() { ::unlink(segment_path(name).c_str()); }
  std::string name;
};

using test::connect;

// A worker of server `name` (tensor w:4) with a gradient buffer of ones
// and a buffer for the weights.
struct OnesWorker {
  explicit OnesWorker(const std::string& name)
      : worker(connect(name)), grad(worker->register_buffer(16)), weights(worker->register_buffer(16)) {
    BOOST_REQUIRE(grad.ok() && weights.ok());
    std::fill_n(static_cast<float*>(grad->data), 4, 1.0f);
  }
  // Pulls, and returns the first weight.
  float w0() {
    auto v = worker->pull(kAllTensors, weights->id, 0);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    return static_cast<const float*>(weights->data)[0];
  }
  std::unique_ptr<Worker> worker;
  Result<Buffer> grad;
  Result<Buffer> weights;
};

// A shmps-server started from a config file ("name = <name>" then `rest`
// then `body`), its stderr in a file, for tests that rewrite the body and
// reload it (SIGHUP).
struct ReloadableServer {
  ReloadableServer(const std::string& tag, std::string rest_of_head, const std::string& body,
                   const ServiceEnv& env = {})
      : name(test::unique_name(tag)), guard(name), head("name = " + name + "\n" + std::move(rest_of_head)) {
    write(body);
    process = spawn_server({"--config", conf.path}, env, err.path);
    BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, process.pid()); }),
                          "no segment; stderr:\n" + log());
  }
  void write(const std::string& body) const { std::ofstream(conf.path) << head << body; }
  void reload(const std::string& body) {
    write(body);
    process.signal(SIGHUP);
  }
  std::string log() const { return read_file(err.path); }
  bool log_has(const std::string& text) const {
    return test::eventually([&] { return contains(log(), text); }, 5s);
  }

  TempPath err{"stderr"};
  TempPath conf{"conf"};
  std::string name;
  SegmentGuard guard;
  std::string head;
  test::Process process;
};

}  // namespace

BOOST_AUTO_TEST_SUITE(service)

BOOST_AUTO_TEST_CASE(notify_ready_status_watchdog_reload_stopping_in_order) {
  NotifySocket socket;
  TempPath err("stderr");
  const std::string name = test::unique_name("svc_notify");
  SegmentGuard guard(name);
  ServiceEnv env;
  env.notify_socket = socket.path();
  env.watchdog_usec = 200'000;
  test::Process server = spawn_server({"--name", name, "--tensor", "w:4", "--lr", "0.5"}, env, err.path);
  const pid_t server_pid = server.pid();  // wait() forgets it
  std::vector<Message> messages;

  // READY=1 comes first, from the main process, and the segment is live.
  auto first = socket.receive(10s);
  BOOST_REQUIRE_MESSAGE(first, "no notification within 10 s; stderr:\n" + read_file(err.path));
  messages.push_back(*first);
  BOOST_TEST(first->has("READY=1"));
  BOOST_TEST(first->pid == server_pid);
  BOOST_TEST(segment_published_by(name, server_pid));
  BOOST_TEST(contains(first->value("STATUS"), "0 workers attached"), first->text);

  // Work for STATUS to report.
  auto worker = connect(name);
  auto grad = worker->register_buffer(16);
  BOOST_REQUIRE(grad.ok());
  std::fill_n(static_cast<float*>(grad->data), 4, 1.0f);
  uint64_t version = 0;
  for (int n = 0; n < 5; ++n) {
    auto v = worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, version);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    version = *v;
  }

  // STATUS every 2 s shows the worker; WATCHDOG=1 every 100 ms.
  const auto saw_worker_status = [&] {
    return std::any_of(messages.begin(), messages.end(), [](const Message& m) {
      return !m.has("READY=1") && contains(m.value("STATUS"), "1 workers attached") &&
             contains(m.value("STATUS"), "version 5");
    });
  };
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!saw_worker_status() && std::chrono::steady_clock::now() < deadline)
    if (auto m = socket.receive(100ms)) messages.push_back(*m);
  BOOST_TEST(saw_worker_status(), "no STATUS= with the worker within 10 s");

  // SIGHUP: RELOADING=1, then READY=1 again.
  server.signal(SIGHUP);
  std::optional<size_t> reloading, ready_again;
  const auto reload_deadline = std::chrono::steady_clock::now() + 5s;
  while (!ready_again && std::chrono::steady_clock::now() < reload_deadline) {
    auto m = socket.receive(100ms);
    if (!m) continue;
    messages.push_back(*m);
    if (m->has("RELOADING=1") && !reloading) {
      reloading = messages.size() - 1;
      BOOST_TEST(!m->value("MONOTONIC_USEC").empty());
    }
    if (m->has("READY=1") && reloading) ready_again = messages.size() - 1;
  }
  BOOST_TEST(reloading.has_value());
  BOOST_TEST(ready_again.has_value());

  // SIGTERM: STOPPING=1 is the last word, the exit code 0.
  worker.reset();
  server.signal(SIGTERM);
  std::optional<size_t> stopping;
  const auto stop_deadline = std::chrono::steady_clock::now() + 5s;
  while (!stopping && std::chrono::steady_clock::now() < stop_deadline) {
    auto m = socket.receive(100ms);
    if (!m) continue;
    messages.push_back(*m);
    if (m->has("STOPPING=1")) stopping = messages.size() - 1;
  }
  BOOST_REQUIRE(stopping.has_value());
  BOOST_TEST(server.wait(10s) == 0);
  while (auto m = socket.receive(0ms)) messages.push_back(*m);
  BOOST_TEST(*stopping == messages.size() - 1, "datagrams after STOPPING=1");
  BOOST_TEST(!std::ifstream(segment_path(name)).good(), "segment left behind");

  // Every datagram came from the server; keep-alives were regular.
  std::vector<std::chrono::steady_clock::time_point> pings;
  for (const Message& m : messages) {
    BOOST_TEST(m.pid == server_pid);
    if (m.has("WATCHDOG=1")) pings.push_back(m.at);
  }
  BOOST_TEST(pings.size() >= 10u, pings.size() << " WATCHDOG=1 in over 2 s");
  for (size_t i = 1; i < pings.size(); ++i)
    BOOST_TEST((pings[i] - pings[i - 1] < 1s), "keep-alive gap of " << (pings[i] - pings[i - 1]).count() << " ns");

  const std::string log = read_file(err.path);
  BOOST_TEST(contains(log, "shmps-server info: starting shmps-server"), log);
  BOOST_TEST(contains(log, "watchdog keep-alive every 100 ms"), log);
  BOOST_TEST(contains(log, "worker 0 attached"), log);
  BOOST_TEST(contains(log, "shmps-server info: stopped: version 5, gradients applied 5"), log);
}

// With checkpoints, a start (restoring one) and a stop (writing the final
// one) may outlast TimeoutStartSec=/TimeoutStopSec=: each asks for an
// allowance (EXTEND_TIMEOUT_USEC=), the start's before READY=1, the stop's
// after STOPPING=1.
BOOST_AUTO_TEST_CASE(checkpoint_io_extends_the_start_and_stop_timeouts) {
  NotifySocket socket;
  TempPath err("stderr");
  test::TempDir dir("svc_extend");
  const std::string name = test::unique_name("svc_extend");
  SegmentGuard guard(name);
  ServiceEnv env;
  env.notify_socket = socket.path();
  test::Process server =
      spawn_server({"--name", name, "--tensor", "w:4", "--checkpoint-dir", dir.path.string()}, env, err.path);
  std::vector<Message> messages;
  const auto index_of = [&](const std::string& what, std::chrono::seconds patience) -> std::optional<size_t> {
    const auto deadline = std::chrono::steady_clock::now() + patience;
    while (true) {
      for (size_t i = 0; i < messages.size(); ++i)
        if (messages[i].has(what)) return i;
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      if (auto m = socket.receive(100ms)) messages.push_back(*m);
    }
  };
  const auto ready = index_of("READY=1", 10s);
  BOOST_REQUIRE_MESSAGE(ready, read_file(err.path));
  BOOST_REQUIRE(!messages.empty());
  // (30 s + 112 B (seven arrays of 4 floats) at 20 MB/s) x (checkpoint-keep
  // 3 files + the init file)
  BOOST_TEST(messages[0].value("EXTEND_TIMEOUT_USEC") == "120000020", messages[0].text);
  BOOST_TEST(*ready > 0u);
  server.signal(SIGTERM);
  BOOST_REQUIRE(server.wait(10s) == 0);
  while (auto m = socket.receive(0ms)) messages.push_back(*m);
  const auto stopping = index_of("STOPPING=1", 0s);
  BOOST_REQUIRE(stopping);
  BOOST_REQUIRE(*stopping + 1 < messages.size());
  // x 2: a periodic write in flight, then the final one
  BOOST_TEST(messages.back().value("EXTEND_TIMEOUT_USEC") == "60000010", messages.back().text);
}

// A federated server's stop waits for its federation thread up to the
// link's bound (two periods + 5 s + two engine timeouts for Gloo), which
// may pass TimeoutStopSec=: it extends the stop timeout by that bound plus
// 5 s before it waits.
BOOST_AUTO_TEST_CASE(a_federated_stop_extends_the_stop_timeout_by_the_federations_bound,
                     *boost::unit_test::precondition(test::has_gloo_plugin)) {
  NotifySocket socket;
  TempPath err("stderr");
  test::TempDir dir("svc_fedstop");
  const std::string name = test::unique_name("svc_fedstop");
  SegmentGuard guard(name);
  ServiceEnv env;
  env.notify_socket = socket.path();
  test::Process server =
      spawn_server({"--name", name, "--tensor", "w:4", "--federation", "gloo", "--fed-hosts", "1", "--fed-store",
                    "file:" + (dir.path / "store").string(), "--fed-every-ms", "1000", "--fed-timeout-ms", "7000"},
                   env, err.path);
  std::vector<Message> messages;
  const auto received = [&](const std::string& what, std::chrono::seconds patience) {
    const auto deadline = std::chrono::steady_clock::now() + patience;
    while (std::chrono::steady_clock::now() < deadline) {
      for (const Message& m : messages)
        if (m.has(what)) return true;
      if (auto m = socket.receive(100ms)) messages.push_back(*m);
    }
    return false;
  };
  BOOST_REQUIRE_MESSAGE(received("READY=1", 10s), read_file(err.path));
  server.signal(SIGTERM);
  BOOST_REQUIRE_MESSAGE(server.wait(30s) == 0, read_file(err.path));
  while (auto m = socket.receive(0ms)) messages.push_back(*m);
  std::vector<std::string> extensions;
  bool stopping = false;
  for (const Message& m : messages) {
    stopping = stopping || m.has("STOPPING=1");
    if (stopping && !m.value("EXTEND_TIMEOUT_USEC").empty()) extensions.push_back(m.value("EXTEND_TIMEOUT_USEC"));
  }
  // (2 x 1 s + 5 s + 2 x 7 s) + 5 s; no checkpoint-dir: no other extension.
  BOOST_TEST(extensions == std::vector<std::string>{"26000000"}, boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(sighup_reloads_lr_and_max_staleness_from_the_config_file) {
  // No $NOTIFY_SOCKET: outside systemd the server runs all the same.
  ReloadableServer s("svc_hup", "# test\ntensor = w:4\noptimizer = sgd\n",
                     "lr = 0.5\nmax-staleness = 4\nlog-level = info\n");
  const std::string& name = s.name;
  test::Process& server = s.process;

  OnesWorker ones(name);
  auto& [worker, grad, weights] = ones;
  const auto w0 = [&] { return ones.w0(); };

  BOOST_REQUIRE(worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 0).ok());
  BOOST_TEST(w0() == -0.5f);

  // lr and max-staleness change live; max-workers needs a restart.
  s.reload("lr = 0.25\nmax-staleness = 1\nmax-workers = 8\nlog-level = debug\n");
  BOOST_REQUIRE_MESSAGE(s.log_has("reloaded the configuration"), s.log());
  const std::string log = s.log();
  BOOST_TEST(contains(log, "shmps-server info: reload: lr 0.5 -> 0.25"), log);
  BOOST_TEST(contains(log, "reload: max-staleness 4 -> 1"), log);
  BOOST_TEST(contains(log, "reload: log-level info -> debug"), log);
  BOOST_TEST(contains(log, "shmps-server warn: reload: max-workers 16 -> 8 needs a restart; still 16"), log);
  const shm::ConfigBlock shown = segment_config(name);  // what shmps-inspect shows
  BOOST_TEST(shown.lr == 0.25f);
  BOOST_TEST(shown.max_staleness == 1u);

  auto v2 = worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 1);
  BOOST_REQUIRE_MESSAGE(v2.ok(), v2.status().to_string());
  BOOST_TEST(w0() == -0.75f);                                               // -0.5 - 0.25 * 1
  auto stale = worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 0);  // 2 behind, limit now 1
  BOOST_TEST((stale.status().code() == ErrorCode::kStale));
  BOOST_TEST(s.log_has("rejected push from worker 0"));

  // Debug lines now appear.
  BOOST_REQUIRE(worker->register_buffer(16).ok());
  BOOST_TEST(s.log_has("shmps-server debug: worker 0 registered buffer"));

  // A broken file: an error naming the line and key; the old config stays.
  s.reload("lr = fast\n");
  BOOST_REQUIRE_MESSAGE(s.log_has("reload failed"), s.log());
  BOOST_TEST(contains(s.log(), "line 5: key 'lr': invalid value 'fast'"), s.log());
  BOOST_REQUIRE(worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 2).ok());
  BOOST_TEST(w0() == -1.0f);  // still lr 0.25

  worker.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

// --lr-schedule changes on SIGHUP, from the next update and at the
// version reached (the schedule is a function of the version); a bad one
// is refused with the option named, and the running one stays.
BOOST_AUTO_TEST_CASE(sighup_switches_the_lr_schedule_at_the_version_reached) {
  ReloadableServer s("svc_hup_sched", "tensor = w:4\noptimizer = sgd\nlr = 1\n", "lr-schedule = step:1:0.5\n");
  const std::string& name = s.name;
  test::Process& server = s.process;
  OnesWorker ones(name);
  auto& [worker, grad, weights] = ones;
  const auto push_then_w0 = [&] {
    auto v = worker->pull(kAllTensors, weights->id, 0);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    BOOST_REQUIRE(worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, *v).ok());
    return ones.w0();
  };

  BOOST_TEST(push_then_w0() == -1.0f);  // lr 1
  BOOST_TEST(push_then_w0() == -1.5f);  // lr 0.5
  s.reload("lr-schedule = constant\n");
  BOOST_TEST(s.log_has("shmps-server info: reload: lr-schedule step:1:0.5 -> constant"), s.log());
  BOOST_TEST(push_then_w0() == -2.5f);  // lr 1
  s.reload("lr-schedule = exponential:0.5\n");
  BOOST_TEST(s.log_has("reload: lr-schedule constant -> exponential:0.5"), s.log());
  BOOST_TEST(push_then_w0() == -2.625f);  // version 3: lr 0.5^3
  s.reload("lr-schedule = cosine:0\n");
  BOOST_TEST(s.log_has("reload failed, keeping the running configuration: config file " + s.conf.path +
                       " line 5: key 'lr-schedule': 'cosine:0': expected cosine:T_MAX with T_MAX at least 1"),
             s.log());
  BOOST_TEST(push_then_w0() == -2.6875f);  // still exponential: version 4, lr 0.5^4
  worker.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

// The staleness policy switches on SIGHUP without losing a request: a pull
// held under wait is answered once the policy is reject; then a stale push
// is rejected, and under scale applied.
BOOST_AUTO_TEST_CASE(sighup_switches_the_staleness_policy_without_losing_a_held_pull) {
  ReloadableServer s("svc_hup_policy", "tensor = w:4\nmax-staleness = 1\n", "staleness-policy = wait\n");
  const std::string& name = s.name;
  test::Process& server = s.process;
  auto slow = connect(name);
  auto fast = connect(name);
  auto slow_grad = slow->register_buffer(16);
  auto fast_grad = fast->register_buffer(16);
  auto fast_weights = fast->register_buffer(16);
  BOOST_REQUIRE(slow_grad.ok() && fast_grad.ok() && fast_weights.ok());
  const auto fast_step = [&] {
    auto v = fast->pull(0, fast_weights->id, 0);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    BOOST_REQUIRE(fast->push(0, fast_grad->id, 0, 16, Dtype::kF32, *v).ok());
  };
  BOOST_REQUIRE(slow->push(0, slow_grad->id, 0, 16, Dtype::kF32, 0).ok());  // slow: clock 1
  for (int k = 0; k < 3; ++k) fast_step();  // fast: joins at the slowest clock, 1; then 2, 3
  std::atomic<bool> done{false};
  Result<uint64_t> held{Status{ErrorCode::kInternal, "not returned"}};
  // The server's gauge of the pulls it holds (refreshed every 10 ms).
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  const auto held_now = [&] {
    return (*seg)->stats().pulls_held.load(std::memory_order_relaxed) == 1u;
  };  // relaxed: a gauge
  std::thread pulling([&] {
    held = fast->pull(0, fast_weights->id, 0);  // 2 ahead of the slowest, bound 1: held
    done.store(true);
  });
  BOOST_TEST(test::eventually(held_now), "the pull was not held");
  BOOST_TEST(!done.load());
  s.reload("staleness-policy = reject\n");
  BOOST_TEST(s.log_has("reload: staleness-policy wait -> reject"), s.log());
  const bool answered = test::eventually([&] { return done.load(); }, 5s);
  pulling.join();
  BOOST_TEST(answered);
  BOOST_TEST(held.ok(), held.status().to_string());
  BOOST_TEST(segment_config(name).staleness_policy == static_cast<uint32_t>(shm::StalenessPolicy::kReject));
  // reject: the slow worker's gradient of version 0 is 4 behind.
  BOOST_TEST((slow->push(0, slow_grad->id, 0, 16, Dtype::kF32, 0).status().code() == ErrorCode::kStale));
  s.reload("staleness-policy = scale\n");
  BOOST_TEST(s.log_has("reload: staleness-policy reject -> scale"), s.log());
  BOOST_TEST(slow->push(0, slow_grad->id, 0, 16, Dtype::kF32, 0).ok());  // applied with lr / 4
  auto st = slow->stats();
  BOOST_REQUIRE(st.ok());
  BOOST_TEST(st->my_pushes_scaled == 1u);
  BOOST_TEST(st->my_pushes_rejected == 1u);
  BOOST_TEST(fast->stats()->my_pulls_waited == 1u);
  // Back to wait after the fast worker ran 10 clocks ahead under scale: the
  // clocks start level at the switch, so its next pulls are held only once
  // it is again more than 1 ahead of the slow one, and not for the gap.
  for (int k = 0; k < 10; ++k) fast_step();
  s.reload("staleness-policy = wait\n");
  BOOST_TEST(s.log_has("reload: staleness-policy scale -> wait"), s.log());
  for (int k = 0; k < 2; ++k) fast_step();  // clocks 1, 2 since the switch; the slow one at 0
  BOOST_TEST(fast->stats()->my_pulls_waited == 1u);
  done.store(false);
  std::thread pulling_again([&] {
    held = fast->pull(0, fast_weights->id, 0);  // 2 ahead of the slowest, bound 1: held
    done.store(true);
  });
  BOOST_TEST(test::eventually(held_now), "the pull was not held");
  BOOST_TEST(!done.load());
  BOOST_TEST(slow->push(0, slow_grad->id, 0, 16, Dtype::kF32, 0).ok());  // the slow one catches up
  BOOST_TEST(test::eventually([&] { return done.load(); }, 5s));
  pulling_again.join();
  BOOST_TEST(held.ok(), held.status().to_string());
  BOOST_TEST(fast->stats()->my_pulls_waited == 2u);
  slow.reset();
  fast.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

// A reload that switches the optimizer logs that one change (it needs a
// restart), not each hyperparameter that comes or goes with it.
BOOST_AUTO_TEST_CASE(sighup_logs_a_switch_of_optimizer_once) {
  ReloadableServer s("svc_hup_switch", "tensor = w:4\n", "optimizer = sgd\nmomentum = 0.9\n");
  s.reload("optimizer = adam\nbeta2 = 0.99\n");
  BOOST_REQUIRE(s.log_has("reloaded the configuration: 0 change(s) applied, 1 need a restart"));
  const std::string log = s.log();
  BOOST_TEST(contains(log, "reload: optimizer sgd -> adam needs a restart; still sgd"), log);
  for (const char* key : {"momentum", "dampening", "nesterov", "beta1", "beta2", "eps", "amsgrad"})
    BOOST_TEST(!contains(log, std::string("reload: ") + key + " "), key << "\n" << log);
  s.process.signal(SIGTERM);
  BOOST_TEST(s.process.wait(10s) == 0);
}

// A reload re-parses the file: a hyperparameter the optimizer does not use
// is refused there as at start, and nothing of that file is applied.
BOOST_AUTO_TEST_CASE(sighup_refuses_a_hyperparameter_the_optimizer_does_not_use) {
  ReloadableServer s("svc_hup_opt", "tensor = w:4\noptimizer = sgd\n", "lr = 0.5\n");
  const std::string& name = s.name;
  test::Process& server = s.process;
  OnesWorker ones(name);
  auto& [worker, grad, weights] = ones;

  s.reload("lr = 0.25\nbeta1 = 0.8\n");
  BOOST_REQUIRE_MESSAGE(s.log_has("reload failed"), s.log());
  BOOST_TEST(contains(s.log(),
                      "shmps-server error: reload failed, keeping the running configuration: --optimizer sgd does not "
                      "use beta1 (config file " +
                          s.conf.path +
                          " line 5): an Adam/AdamW option; remove it, or choose "
                          "--optimizer adam or adamw\n"),
             s.log());
  BOOST_TEST(!contains(s.log(), "reload: lr"), s.log());
  BOOST_REQUIRE(worker->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 0).ok());
  BOOST_REQUIRE(worker->pull(kAllTensors, weights->id, 0).ok());
  BOOST_TEST(static_cast<const float*>(weights->data)[0] == -0.5f);  // still lr 0.5
  BOOST_TEST(segment_config(name).lr == 0.5f);

  worker.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

BOOST_AUTO_TEST_CASE(config_file_errors_stop_the_server_naming_line_and_key) {
  const auto run = [](const std::string& body, std::string* log) {
    TempPath err("stderr");
    TempPath conf("conf");
    std::ofstream(conf.path) << body;
    test::Process server = spawn_server({"--config", conf.path}, {}, err.path);
    const int code = server.wait(10s);
    *log = read_file(err.path);
    return code;
  };
  std::string log;
  BOOST_TEST(run("name = a\ntensor = w:4\n\nlearning-rate = 0.1\n", &log) == 2);
  BOOST_TEST(contains(log, "shmps-server error: config file "), log);
  BOOST_TEST(contains(log, "line 4: unknown key 'learning-rate'"), log);
  BOOST_TEST(run("name = a\ntensor = w:4\nlr = fast\n", &log) == 2);
  BOOST_TEST(contains(log, "line 3: key 'lr': invalid value 'fast'"), log);
  BOOST_TEST(run("name = a\n# comment\ntensor = w:4\nring-capacity = 48\n", &log) == 2);
  BOOST_TEST(contains(log, "line 4: key 'ring-capacity': must be a power of two"), log);
  // A path the start would take from its working directory, not the file's.
  BOOST_TEST(run("name = a\ntensor = w:4\ncheckpoint-dir = ckpt\n", &log) == 2);
  BOOST_TEST(contains(log, "line 3: key 'checkpoint-dir': 'ckpt' is a relative path"), log);
  BOOST_TEST(run("name = a\ntensor = w:4\ncheckpoint-dir = \"/tmp/x\"\n", &log) == 2);
  BOOST_TEST(contains(log, "line 3: key 'checkpoint-dir': the value \"/tmp/x\" is in quotes"), log);

  // --check-config: a valid file exits 0 and creates nothing.
  const std::string name = test::unique_name("svc_check");
  SegmentGuard guard(name);
  TempPath err("stderr");
  TempPath conf("conf");
  std::ofstream(conf.path) << "name = " << name << "\ntensor = w:4\n";
  test::Process check = spawn_server({"--config", conf.path, "--check-config"}, {}, err.path);
  BOOST_TEST(check.wait(10s) == 0, read_file(err.path));
  BOOST_TEST(!std::ifstream(segment_path(name)).good());

  // A line the command line overrides is warned of on stderr, as at start.
  std::ofstream(conf.path) << "name = " << name << "\ntensor = w:4\nlr = 0.9\n";
  test::Process shadowed = spawn_server({"--config", conf.path, "--lr", "0.1", "--check-config"}, {}, err.path);
  BOOST_TEST(shadowed.wait(10s) == 0, read_file(err.path));
  BOOST_TEST(contains(read_file(err.path), "shmps-server warn: config file " + conf.path +
                                               " line 3: key 'lr' = 0.9 is not used: the command line's --lr wins\n"),
             read_file(err.path));
  BOOST_TEST(!std::ifstream(segment_path(name)).good());
}

// --check-config reads the --init-file as the start does: what the start
// refuses, the check refuses with the same message, exiting 2 as for any
// other config error.
BOOST_AUTO_TEST_CASE(check_config_refuses_the_init_file_the_start_refuses) {
  test::TempDir dir("svc_init");
  const std::string server = test::program_path("shmps-server");
  const auto write = [&](const std::string& file, const std::vector<float>& values) {
    const std::string path = (dir.path / file).string();
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * 4));
    return path;
  };
  const std::string good = write("good.f32", {1, 2, 3, 4});
  const std::string fifo = (dir.path / "fifo").string();
  BOOST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  struct Case {
    std::string path, message;
    bool as_nobody = false;
  };
  std::vector<Case> cases{
      {"/nonexistent/init.f32", "--init-file /nonexistent/init.f32: cannot open: No such file or directory (errno 2)"},
      {dir.path.string(), "--init-file " + dir.path.string() + ": not a regular file"},
      {fifo, "--init-file " + fifo + ": not a regular file"},  // a blocking open would wait for a writer
      {write("short.f32", {1, 2, 3}), ""},
      {write("nan.f32", {1, std::nanf(""), 3, 4}), ""}};
  cases[3].message =
      "--init-file " + cases[3].path + " holds 12 bytes; the tensors need 16 (raw fp32, all tensors in order)";
  cases[4].message = "--init-file " + cases[4].path + " contains NaN or Inf";
  if (::geteuid() == 0) {
    ::chmod(dir.path.c_str(), 0755);
    ::chmod(good.c_str(), 0600);  // root's: nobody may not read it
    cases.push_back({good, "--init-file " + good + ": cannot open: Permission denied (errno 13)", true});
  } else {
    BOOST_TEST_MESSAGE("unreadable init file not checked: needs root to run the server as another user (nobody)");
  }
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.path) {
      const std::string name = test::unique_name("svc_init");
      SegmentGuard guard(name);
      const auto nobody = [&c] {
        return !c.as_nobody || (::setgid(65534) == 0 && ::setgroups(0, nullptr) == 0 && ::setuid(65534) == 0);
      };
      const std::vector<std::string> args{server, "--name", name, "--tensor", "w:4", "--init-file", c.path};
      std::vector<std::string> check_args = args;
      check_args.push_back("--check-config");
      const test::Captured check = test::run_captured(check_args, 10s, nobody);
      BOOST_TEST(check.exit_code == 2, check.output);
      BOOST_TEST(without_timestamps(check.output) == "shmps-server error: " + c.message + "\n", check.output);
      const test::Captured start = test::run_captured(args, 10s, nobody);
      BOOST_TEST(start.exit_code == 1, start.output);
      BOOST_TEST(contains(start.output, ": " + c.message + "\n"), start.output);
      BOOST_TEST(!std::filesystem::exists(segment_path(name)));
    }
  }
  // A good file passes, and the check still creates nothing.
  const std::string name = test::unique_name("svc_init");
  SegmentGuard guard(name);
  const test::Captured check =
      test::run_captured({server, "--name", name, "--tensor", "w:4", "--init-file", good, "--check-config"});
  BOOST_TEST(check.exit_code == 0, check.output);
  BOOST_TEST(contains(check.output, "init-file = " + good + "\n"), check.output);
  BOOST_TEST(!std::filesystem::exists(segment_path(name)));
}

// What --check-config prints parses back as a config file: fed back with
// --config, the check prints the same. A relative path given on the
// command line is printed made absolute (a config file refuses a relative
// one). A value that no config file line holds is refused, exit 2, naming
// the option and why.
BOOST_AUTO_TEST_CASE(check_config_output_reads_back_as_the_same_configuration) {
  test::TempDir dir("svc_roundtrip");
  const std::string server = test::program_path("shmps-server");
  const std::string d = dir.path.string();
  const std::string name = test::unique_name("svc_rt");
  SegmentGuard guard(name);
  const std::vector<std::vector<std::string>> configs{
      {"--tensor",
       "a:2x3",
       "--tensor",
       "b:7",
       "--optimizer",
       "adamw",
       "--lr",
       "0.0003",
       "--lr-schedule",
       "linear:0.01:1:5,cosine:100",
       "--beta2",
       "0.98",
       "--amsgrad",
       "--max-staleness",
       "11",
       "--staleness-policy",
       "wait",
       "--ring-capacity",
       "16",
       "--init",
       "normal",
       "--init-seed",
       "42",
       "--group-access",
       "--backend",
       "host",
       "--checkpoint-dir",
       d + "/job#1",
       "--checkpoint-keep",
       "5",
       "--log-level",
       "debug",
       "--apply-threads",
       "2"},
      {"--tensor", "w:4", "--federation", "gloo", "--fed-hosts", "2", "--fed-host", "1", "--fed-store",
       "file:" + d + "/store", "--fed-cpus", "0-1", "--fed-outer", "nesterov", "--fed-outer-lr", "0.5", "--fed-address",
       "10.0.0.2", "--fed-rank-in-name"},
      {"--tensor", "w:4", "--checkpoint-dir", "relative/ckpt", "--init-file", "w.f32"},
  };
  std::ofstream(dir.path / "w.f32", std::ios::binary).write("\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 16);
  for (const std::vector<std::string>& config : configs) {
    BOOST_TEST_CONTEXT(config[config.size() - 2] << " " << config.back()) {
      std::vector<std::string> argv{server, "--name", name, "--check-config"};
      argv.insert(argv.end(), config.begin(), config.end());
      // Run in the temp directory: the relative paths are its.
      const test::Captured first = test::run_captured(argv, 10s, [&] { return ::chdir(d.c_str()) == 0; });
      BOOST_REQUIRE_MESSAGE(first.exit_code == 0, first.output);
      if (config.back() == "w.f32") {
        BOOST_TEST(contains(first.output, "checkpoint-dir = " + d + "/relative/ckpt\n"), first.output);
        BOOST_TEST(contains(first.output, "init-file = " + d + "/w.f32\n"), first.output);
      }
      const std::string conf = d + "/printed.conf";
      std::ofstream(conf) << first.output;
      const test::Captured second = test::run_captured({server, "--config", conf, "--check-config"}, 10s);
      BOOST_TEST(second.exit_code == 0, second.output);
      BOOST_TEST(second.output == first.output);
    }
  }
  // Values the file cannot hold: refused by the check (the start takes
  // them from the command line).
  for (const std::string& bad : {d + "/ck #1", d + "/ck ", d + "/ck\t"}) {
    BOOST_TEST_CONTEXT("'" << bad << "'") {
      const test::Captured refused =
          test::run_captured({server, "--name", name, "--tensor", "w:4", "--checkpoint-dir", bad, "--check-config"});
      BOOST_TEST(refused.exit_code == 2, refused.output);
      // (The log writes the tab as \x09.)
      BOOST_TEST(contains(without_timestamps(refused.output),
                          "shmps-server error: --check-config cannot print --checkpoint-dir '" + d + "/ck"),
                 refused.output);
      BOOST_TEST(contains(refused.output, "' as a config file line: "), refused.output);
    }
  }
  BOOST_TEST(!std::filesystem::exists(segment_path(name)));
}

// --check-config on a checkpoint directory that another live server
// holds fails as the start does (exit 2, the start's message, naming the
// holder's pid), and leaves the holder's lock as it was; the live server
// of the configuration's own name (the instance a restart stops first)
// passes; once the holder stops, the check passes.
BOOST_AUTO_TEST_CASE(check_config_refuses_a_checkpoint_dir_another_live_server_holds) {
  test::TempDir dir("svc_lock");
  const std::string server = test::program_path("shmps-server");
  const std::string d = dir.path.string();
  const std::string holder_name = test::unique_name("svc_holder"), other = test::unique_name("svc_other");
  SegmentGuard guard(other);
  auto holder = std::make_unique<test::ServerProcess>(
      holder_name, std::vector<std::string>{"--tensor", "w:4", "--checkpoint-dir", d});
  const std::string lock = read_file(dir.path / ".lock");
  const std::string pid = std::to_string(holder->process().pid());
  BOOST_REQUIRE_EQUAL(lock, "pid " + pid + "\n");
  const std::string message = "--checkpoint-dir " + d + " is in use by another shmps-server (pid " + pid +
                              "), which holds " + d + "/.lock: a checkpoint directory serves one server";
  const std::vector<std::string> args{server, "--name", other, "--tensor", "w:4", "--checkpoint-dir", d};
  std::vector<std::string> check_args = args;
  check_args.push_back("--check-config");
  const test::Captured check = test::run_captured(check_args, 10s);
  BOOST_TEST(check.exit_code == 2, check.output);
  BOOST_TEST(without_timestamps(check.output).rfind("shmps-server error: " + message, 0) == 0u, check.output);
  const test::Captured start = test::run_captured(args, 10s);
  BOOST_TEST(start.exit_code == 2, start.output);
  BOOST_TEST(contains(start.output, message), start.output);
  BOOST_TEST(read_file(dir.path / ".lock") == lock);
  // The holder's own configuration: a restart stops it first.
  const test::Captured own = test::run_captured(
      {server, "--name", holder_name, "--tensor", "w:4", "--checkpoint-dir", d, "--check-config"}, 10s);
  BOOST_TEST(own.exit_code == 0, own.output);
  BOOST_TEST(contains(own.output, "checkpoint-dir = " + d + "\n"), own.output);
  BOOST_REQUIRE(holder->stop() == 0);
  holder.reset();
  const test::Captured free = test::run_captured(check_args, 10s);
  BOOST_TEST(free.exit_code == 0, free.output);
  BOOST_TEST(!std::filesystem::exists(segment_path(other)));
}

BOOST_AUTO_TEST_CASE(journal_stream_prefixes_lines_with_their_syslog_priority) {
  TempPath err("stderr");
  const std::string name = test::unique_name("svc_journal");
  SegmentGuard guard(name);
  ServiceEnv journal;
  journal.journal_stream = true;
  test::Process server = spawn_server({"--name", name, "--tensor", "w:4"}, journal, err.path);
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, server.pid()); }),
                        "no segment; stderr:\n" + read_file(err.path));
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  std::istringstream lines(read_file(err.path));
  int n = 0;
  for (std::string line; std::getline(lines, line); ++n)
    BOOST_TEST(line.rfind("<6>shmps-server info: ", 0) == 0u, line);
  BOOST_TEST(n >= 3);  // starting, serving, stopped

  // Not the journal (another file's inode): no prefix.
  TempPath plain("stderr");
  const std::string name2 = test::unique_name("svc_plain");
  SegmentGuard guard2(name2);
  test::Process other = spawn_server({"--name", name2, "--tensor", "w:4"}, {}, plain.path);
  BOOST_REQUIRE(test::eventually([&] { return segment_published_by(name2, other.pid()); }));
  other.signal(SIGTERM);
  BOOST_TEST(other.wait(10s) == 0);
  // Not the journal: every line starts with the local time, to the
  // millisecond with its UTC offset, within this test's run.
  const std::string text = read_file(plain.path);
  BOOST_TEST(without_timestamps(text).rfind("shmps-server info: starting", 0) == 0u, text);
  std::istringstream plain_lines(text);
  int stamped = 0;
  for (std::string line; std::getline(plain_lines, line); ++stamped) {
    BOOST_TEST_CONTEXT(line) {
      BOOST_TEST(std::regex_search(line, kTimestamp));
      struct tm tm {};
      const char* rest = ::strptime(line.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
      BOOST_REQUIRE(rest != nullptr);
      tm.tm_isdst = -1;  // local time: let mktime decide whether DST applies
      const time_t when = std::mktime(&tm);
      BOOST_TEST(std::abs(std::difftime(std::time(nullptr), when)) < 120.0);
    }
  }
  BOOST_TEST(stamped >= 3);
}

// A stop that arrives right after start-up (the segment just published,
// the signal handlers maybe not yet installed) must still be a clean stop:
// exit 0 and the segment removed, never death by the default action.
BOOST_AUTO_TEST_CASE(sigterm_right_after_the_segment_appears_is_a_clean_stop) {
  for (int round = 0; round < 10; ++round) {
    BOOST_TEST_CONTEXT("round " << round) {
      TempPath err("stderr");
      const std::string name = test::unique_name("svc_early");
      SegmentGuard guard(name);
      test::Process server = spawn_server({"--name", name, "--tensor", "w:4"}, {}, err.path);
      BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, server.pid()); }),
                            "no segment; stderr:\n" + read_file(err.path));
      server.signal(SIGTERM);
      BOOST_TEST(server.wait(10s) == 0, read_file(err.path));
      BOOST_TEST(!std::filesystem::exists(segment_path(name)));
    }
  }
}

// A server exec'd with SIGINT, SIGTERM and SIGHUP blocked (a launcher's
// sigwait() mask, kept across fork and exec) unblocks them once it serves:
// a SIGHUP reloads it and a SIGTERM stops it cleanly, rather than both
// staying pending for the server's life.
BOOST_AUTO_TEST_CASE(a_server_started_with_its_signals_blocked_reloads_and_stops) {
  ServiceEnv env;
  env.signals_blocked = true;
  ReloadableServer s("svc_blocked", "tensor = w:4\noptimizer = sgd\n", "lr = 0.5\n", env);
  s.reload("lr = 0.25\n");
  BOOST_TEST(s.log_has("reload: lr 0.5 -> 0.25"), s.log());
  s.process.signal(SIGTERM);
  BOOST_TEST(s.process.wait(10s) == 0, s.log());
  BOOST_TEST(!std::filesystem::exists(segment_path(s.name)));
}

// A SIGHUP while the server parses its options (a reload sent as the
// service starts; a config file of 4096 tensors takes tens of ms) must not
// end it (SIGHUP's default action): it is remembered, and the reload runs
// once the server serves. Sent as soon as the server has read the file and
// closed it (inotify), so it arrives while the lines are parsed.
BOOST_AUTO_TEST_CASE(sighup_while_the_options_are_parsed_reloads_once_serving) {
  TempPath err("stderr");
  TempPath conf("conf");
  const std::string name = test::unique_name("svc_early_hup");
  SegmentGuard guard(name);
  {
    std::ofstream out(conf.path);
    out << "name = " << name << "\n";
    for (uint32_t i = 0; i < shm::kMaxTensorsLimit; ++i) out << "tensor = layer" << i << ".weight:8\n";
  }
  const int watch = ::inotify_init1(IN_CLOEXEC);
  BOOST_REQUIRE(watch >= 0);
  BOOST_REQUIRE(::inotify_add_watch(watch, conf.path.c_str(), IN_CLOSE_NOWRITE) >= 0);
  test::Process server = spawn_server({"--config", conf.path, "--backend", "host"}, {}, err.path);
  pollfd p{watch, POLLIN, 0};
  const bool read_it = ::poll(&p, 1, 10'000) == 1;
  server.signal(SIGHUP);
  ::close(watch);
  BOOST_REQUIRE_MESSAGE(read_it, "the server did not read its config file");
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, server.pid()); }),
                        "no segment; stderr:\n" + read_file(err.path));
  BOOST_TEST(test::eventually([&] { return contains(read_file(err.path), "reloaded the configuration"); }, 10s),
             read_file(err.path));
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0, read_file(err.path));
}

// A server with --parent-pid is a job's child (Python's shmps.Server): a
// $NOTIFY_SOCKET it inherits is its launcher's unit's, and gets nothing
// from it: no READY=1, no keep-alive, no STOPPING=1.
BOOST_AUTO_TEST_CASE(a_server_with_a_parent_pid_leaves_the_notify_socket_alone) {
  NotifySocket socket;
  TempPath err("stderr");
  const std::string name = test::unique_name("svc_child");
  SegmentGuard guard(name);
  ServiceEnv env;
  env.notify_socket = socket.path();
  env.watchdog_usec = 200'000;
  test::Process server =
      spawn_server({"--name", name, "--tensor", "w:4", "--parent-pid", std::to_string(::getpid())}, env, err.path);
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, server.pid()); }),
                        "no segment; stderr:\n" + read_file(err.path));
  OnesWorker w(name);
  BOOST_TEST(w.worker->push(kAllTensors, w.grad->id, 0, 16, Dtype::kF32, 0).ok());
  const std::optional<Message> early = socket.receive(500ms);  // several keep-alive periods
  BOOST_TEST(!early.has_value(), "the child server sent: " << (early ? early->text : ""));
  w.worker.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0, read_file(err.path));
  const std::optional<Message> late = socket.receive(100ms);
  BOOST_TEST(!late.has_value(), "the child server sent: " << (late ? late->text : ""));
}

// The same for a server that shmps::ServerProcess starts (shmps-train's):
// this process's $NOTIFY_SOCKET and watchdog are not passed on.
BOOST_AUTO_TEST_CASE(a_server_process_does_not_inherit_the_notify_socket) {
  NotifySocket socket;
  ::setenv("NOTIFY_SOCKET", socket.path().c_str(), 1);
  ::setenv("WATCHDOG_USEC", "200000", 1);
  std::optional<test::ServerProcess> server;
  try {
    server.emplace(test::unique_name("svc_spawned"), std::vector<std::string>{"--tensor", "w:4"});
  } catch (...) {
    ::unsetenv("NOTIFY_SOCKET");
    ::unsetenv("WATCHDOG_USEC");
    throw;
  }
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  BOOST_TEST(OnesWorker(server->name()).worker->ping().ok());
  BOOST_TEST(server->stop() == 0);
  const std::optional<Message> sent = socket.receive(100ms);
  BOOST_TEST(!sent.has_value(), "the spawned server sent: " << (sent ? sent->text : ""));
}

// A --parent-pid that is not the server's parent is a bad option: exit 2,
// which systemd does not restart, as for any other.
BOOST_AUTO_TEST_CASE(a_parent_pid_that_is_not_the_parent_exits_as_a_bad_option) {
  const std::string name = test::unique_name("svc_notparent");
  SegmentGuard guard(name);
  const test::Captured c =
      test::run_captured({test::program_path("shmps-server"), "--name", name, "--tensor", "w:4", "--parent-pid", "1"});
  BOOST_TEST(c.exit_code == 2, c.output);
  BOOST_TEST(contains(c.output, "--parent-pid 1 is not this server's parent"), c.output);
}

// A log written into a pipe whose reader is gone (`shmps-server 2>&1 | tee
// log`, the tee killed) fails and is dropped: the server serves on, and a
// SIGTERM is a clean stop with its final checkpoint, not death by SIGPIPE.
BOOST_AUTO_TEST_CASE(a_log_pipe_without_a_reader_does_not_end_the_server) {
  const std::string name = test::unique_name("svc_pipe");
  SegmentGuard guard(name);
  test::TempDir dir("svc_pipe");
  int fds[2];
  BOOST_REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  const std::vector<std::string> argv{
      test::program_path("shmps-server"), "--name", name, "--tensor", "w:4", "--checkpoint-dir", dir.path.string()};
  test::Process server = test::Process::fork_fn([&]() -> int {
    if (::dup2(fds[1], STDERR_FILENO) < 0) return 126;
    return exec_argv(argv);
  });
  ::close(fds[1]);
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, server.pid()); }), "no segment");
  ::close(fds[0]);  // the reader is gone: the next log line meets EPIPE
  {
    OnesWorker w(name);  // its attach is logged
    BOOST_TEST(w.worker->push(kAllTensors, w.grad->id, 0, 16, Dtype::kF32, 0).ok());
    BOOST_TEST(w.worker->ping().ok());
  }
  BOOST_REQUIRE_MESSAGE(server.wait(200ms) == -1, "the server ended");
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  BOOST_TEST(std::filesystem::exists(dir.path / "ckpt-00000000000000000001.shmps"));
}

// Standard descriptors the launcher left closed (`2>&-`) are opened on
// /dev/null, so that no buffer object, checkpoint or directory the server
// opens later takes descriptor 2 and receives its log lines.
BOOST_AUTO_TEST_CASE(closed_standard_descriptors_are_opened_on_dev_null) {
  const std::string name = test::unique_name("svc_closed");
  SegmentGuard guard(name);
  test::TempDir dir("svc_closed");
  const std::vector<std::string> argv{
      test::program_path("shmps-server"), "--name", name, "--tensor", "w:4", "--checkpoint-dir", dir.path.string()};
  test::Process server = test::Process::fork_fn([&]() -> int {
    ::close(STDIN_FILENO);
    ::close(STDERR_FILENO);
    return exec_argv(argv);
  });
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return segment_published_by(name, server.pid()); }), "no segment");
  {
    OnesWorker w(name);  // a buffer object opened, and logged
    BOOST_TEST(w.worker->push(kAllTensors, w.grad->id, 0, 16, Dtype::kF32, 0).ok());
  }
  for (const int fd : {0, 2}) {
    std::error_code ec;
    const auto target =
        std::filesystem::read_symlink("/proc/" + std::to_string(server.pid()) + "/fd/" + std::to_string(fd), ec);
    BOOST_TEST(target == "/dev/null", "descriptor " << fd << " is " << target);
  }
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  BOOST_TEST(std::filesystem::exists(dir.path / "ckpt-00000000000000000001.shmps"));
}

BOOST_AUTO_TEST_SUITE_END()
