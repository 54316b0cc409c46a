// shmps::ChildProcess and shmps::ServerProcess (server_process.hpp) with
// real processes: what a spawned child starts with (its environment,
// signal mask and dispositions, descriptors) whatever the caller's threads
// and signal state; how a child is waited for and signalled when another
// part of the program reaps it; when start() takes a segment for its
// child's; pause() of a child that has exited. (test_protocol holds the
// earlier cases: start, stop, segment removal, die_with_parent.)
#define BOOST_TEST_MODULE test_server_process
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

// A field of /proc/<pid>/status that holds a signal set in hex ("SigBlk",
// "SigIgn"), as a mask (bit signo - 1); all ones when it cannot be read.
uint64_t signal_set(pid_t pid, const std::string& field) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1), nullptr, 16);
  return ~uint64_t{0};
}

// Whether process pid runs program `comm` (/proc/<pid>/comm): past its exec.
bool runs(pid_t pid, const std::string& comm) {
  return test::read_file("/proc/" + std::to_string(pid) + "/comm") == comm + "\n";
}

// This thread's signal mask and the dispositions of a few signals, put back
// at scope exit.
class SignalStateGuard {
 public:
  SignalStateGuard() {
    ::pthread_sigmask(SIG_SETMASK, nullptr, &mask_);
    for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], nullptr, &actions_[i]);
  }
  ~SignalStateGuard() {
    for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &actions_[i], nullptr);
    ::pthread_sigmask(SIG_SETMASK, &mask_, nullptr);
  }
  SignalStateGuard(const SignalStateGuard&) = delete;
  SignalStateGuard& operator=(const SignalStateGuard&) = delete;
  static constexpr int kSignals[] = {SIGTERM, SIGUSR2, SIGHUP, SIGINT, SIGQUIT};

 private:
  sigset_t mask_{};
  struct sigaction actions_[std::size(kSignals)]{};
};

// The descriptors process pid has open (/proc/<pid>/fd), ascending.
std::vector<int> open_descriptors(pid_t pid) {
  std::vector<int> fds;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec))
    fds.push_back(std::stoi(e.path().filename().string()));
  std::sort(fds.begin(), fds.end());
  return fds;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A line a forked process leaves for the test (a page shared across fork).
struct Note {
  Note() : text(test::map_shared<std::array<char, 4096>>()->data()) {}
  void set(const std::string& s) const { std::snprintf(text, 4096, "%s", s.c_str()); }
  char* text;
};

// Runs fn() as process 1 of a new pid namespace, with a mount namespace
// of its own whose /proc is that namespace's: its processes get pids from
// 2 in order, and /proc/sys/kernel/ns_last_pid sets the next one, so that
// a test can hand a new process the pid of one that is gone. fn's exit
// code; kNoNamespace when the namespaces cannot be made (not root, a
// container that refuses them), with the reason in `note`.
constexpr int kNoNamespace = 90;
int in_pid_namespace(const std::function<int()>& fn, const Note& note) {
  test::Process outer = test::Process::fork_fn([&]() -> int {
    if (::unshare(CLONE_NEWPID | CLONE_NEWNS) != 0) {
      note.set("unshare(CLONE_NEWPID | CLONE_NEWNS): " + errno_text(errno));
      return kNoNamespace;
    }
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      note.set("mount --make-rprivate /: " + errno_text(errno));
      return kNoNamespace;
    }
    // die_with_parent: the namespace's processes end with this one (a
    // test that timed out and killed it).
    auto init = ChildProcess::fork_run(
        [&]() -> int {
          if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
            note.set("mount -t proc: " + errno_text(errno));
            return kNoNamespace;
          }
          return fn();
        },
        /*die_with_parent=*/true);
    return init.ok() ? init->wait() : kNoNamespace;
  });
  return outer.wait(60s);
}

// The next process forked in this pid namespace gets `pid` (unless one is
// forked meanwhile). False, with the reason in `note`, when it cannot be set.
bool next_pid_is(pid_t pid, const Note& note) {
  std::ofstream out("/proc/sys/kernel/ns_last_pid");
  out << pid - 1 << std::flush;
  if (!out) note.set("cannot write /proc/sys/kernel/ns_last_pid");
  return static_cast<bool>(out);
}

// Precondition: a pid namespace can be made, and the next pid in it set.
boost::test_tools::assertion_result pid_namespaces(boost::unit_test::test_unit_id) {
  Note note;
  const int rc = in_pid_namespace([&] { return ::getpid() == 1 && next_pid_is(100, note) ? 0 : kNoNamespace; }, note);
  boost::test_tools::assertion_result r(rc == 0);
  r.message() << "no pid namespace with a settable next pid: " << note.text << " (exit " << rc << ")";
  return r;
}

// A signal set of `signos`.
sigset_t signals_of(std::initializer_list<int> signos) {
  sigset_t set;
  sigemptyset(&set);
  for (const int signo : signos) sigaddset(&set, signo);
  return set;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(server_process)

// The child's environment is this process's, less env_unset, plus each of
// env_defaults not set (a set one keeps its value; a name in both is
// removed, then set to the default).
BOOST_AUTO_TEST_CASE(spawn_applies_env_unset_then_env_defaults) {
  test::TempDir dir("spawnenv");
  const std::string log = (dir.path / "env.log").string();
  ::setenv("SHMPS_T_KEEP", "kept", 1);
  ::setenv("SHMPS_T_GONE", "set", 1);
  ::setenv("SHMPS_T_OWN", "mine", 1);
  ::setenv("SHMPS_T_BOTH", "mine", 1);
  ChildProcess::SpawnOptions o;
  o.log_path = log;
  o.env_unset = {"SHMPS_T_GONE", "SHMPS_T_BOTH", "SHMPS_T_ABSENT"};
  o.env_defaults = {{"SHMPS_T_OWN", "default"}, {"SHMPS_T_NEW", "new"}, {"SHMPS_T_BOTH", "default"}};
  auto child = ChildProcess::spawn(
      {"/bin/sh", "-c", "echo \"[$SHMPS_T_KEEP][${SHMPS_T_GONE-unset}][$SHMPS_T_OWN][$SHMPS_T_NEW][$SHMPS_T_BOTH]\""},
      o);
  for (const char* key : {"SHMPS_T_KEEP", "SHMPS_T_GONE", "SHMPS_T_OWN", "SHMPS_T_BOTH"}) ::unsetenv(key);
  BOOST_REQUIRE(child.ok());
  BOOST_TEST(child->wait(10s) == 0);
  BOOST_TEST(test::read_file(log) == "[kept][unset][mine][new][default]\n");
  BOOST_TEST(std::getenv("SHMPS_T_NEW") == nullptr);  // this process's own stays as it was
}

// A thread of this process that holds glibc's environment lock at the fork
// (any setenv() or unsetenv(); here a setenv() that changes nothing, so
// that the spawns' reads of the environment race no write) must not hang
// the child: it applies env_unset without the lock. Each spawn must exec
// and exit within seconds.
BOOST_AUTO_TEST_CASE(spawn_while_another_thread_holds_the_environment_lock_does_not_hang) {
  ::setenv("SHMPS_T_CHURN", "x", 1);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load(std::memory_order_relaxed)) ::setenv("SHMPS_T_CHURN", "y", /*overwrite=*/0);  // relaxed: a flag
  });
  ChildProcess::SpawnOptions o;
  o.env_unset = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"};
  o.env_defaults = {{"SHMPS_T_DEFAULT", "1"}};
  int hung = 0;
  for (int i = 0; i < 100 && hung == 0; ++i) {
    auto child = ChildProcess::spawn({"/bin/true"}, o);
    BOOST_REQUIRE(child.ok());
    if (child->wait(5s) != 0) ++hung;  // (its destructor kills it)
  }
  stop.store(true, std::memory_order_relaxed);
  churn.join();
  ::unsetenv("SHMPS_T_CHURN");
  BOOST_TEST(hung == 0, "a child hung between fork and exec");
}

// A spawn() from a thread that blocks SIGTERM and SIGINT (a sigwait()
// loop's mask), in a process that ignores SIGTERM, SIGUSR2 and SIGHUP,
// starts a program with no signal blocked and none ignored but SIGHUP
// (nohup's), which a SIGTERM stops: as forked by this thread, with
// die_with_parent from this (the main) thread, and from another thread
// (the fork thread's child).
BOOST_AUTO_TEST_CASE(a_spawned_program_starts_with_no_signal_blocked_or_ignored) {
  SignalStateGuard restore;
  const sigset_t waited = signals_of({SIGTERM, SIGINT});
  ::pthread_sigmask(SIG_BLOCK, &waited, nullptr);
  ::signal(SIGTERM, SIG_IGN);
  ::signal(SIGUSR2, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
  // Kept ignored where the caller ignores them, as SIGHUP: at their
  // defaults here, whatever the test was started with (a shell's
  // background job ignores both).
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGQUIT, SIG_DFL);
  ChildProcess::SpawnOptions die;
  die.die_with_parent = true;
  std::vector<std::pair<std::string, ChildProcess>> children;
  for (const bool with_die : {false, true}) {
    auto c = ChildProcess::spawn({"/bin/sleep", "30"}, with_die ? die : ChildProcess::SpawnOptions{});
    BOOST_REQUIRE(c.ok());
    children.emplace_back(with_die ? "die_with_parent, main thread" : "main thread", std::move(*c));
  }
  std::thread([&] {
    ::pthread_sigmask(SIG_BLOCK, &waited, nullptr);
    auto c = ChildProcess::spawn({"/bin/sleep", "30"}, die);
    if (c.ok()) children.emplace_back("die_with_parent, another thread", std::move(*c));
  }).join();
  BOOST_REQUIRE(children.size() == 3);
  for (auto& [how, child] : children) {
    BOOST_TEST_CONTEXT(how) {
      BOOST_REQUIRE(test::eventually([&] { return runs(child.pid(), "sleep"); }, 5s));
      BOOST_TEST(signal_set(child.pid(), "SigBlk") == 0u);
      BOOST_TEST(signal_set(child.pid(), "SigIgn") == uint64_t{1} << (SIGHUP - 1));
      child.signal(SIGTERM);
      BOOST_TEST(child.wait(5s) == 128 + SIGTERM);
    }
  }
}

// A launcher that blocks SIGTERM and dies (SIGKILL) leaves no orphan: the
// death signal of its die_with_parent child (SIGTERM) ends the program,
// which does not keep the launcher's mask.
BOOST_AUTO_TEST_CASE(a_die_with_parent_child_of_a_launcher_that_blocks_sigterm_ends_with_it) {
  auto* grandchild = test::map_shared<std::atomic<pid_t>>();
  auto launcher = test::Process::fork_fn([grandchild] {
    const sigset_t waited = signals_of({SIGTERM});
    ::pthread_sigmask(SIG_BLOCK, &waited, nullptr);
    ChildProcess::SpawnOptions o;
    o.die_with_parent = true;
    auto c = ChildProcess::spawn({"/bin/sleep", "30"}, o);
    if (!c.ok()) return 2;
    if (!test::eventually([&] { return runs(c->pid(), "sleep"); }, 5s)) return 3;
    grandchild->store(c->pid());
    ::kill(::getpid(), SIGKILL);
    return 4;
  });
  BOOST_TEST(launcher.wait(10s) == 128 + SIGKILL);
  const pid_t pid = grandchild->load();
  BOOST_REQUIRE(pid > 0);
  // Reparented and reaped by init (or a subreaper).
  BOOST_TEST(test::eventually([pid] { return test::process_ended(pid); }, 5s));
  if (!test::process_ended(pid)) ::kill(pid, SIGKILL);
}

// A spawned program has stdin, stdout and stderr open, and nothing else
// of this process: not a pipe's end made without O_CLOEXEC (whose reader
// then never sees EOF while the program runs), nor the log's own
// descriptor.
BOOST_AUTO_TEST_CASE(a_spawned_program_gets_only_the_standard_descriptors) {
  test::TempDir dir("spawnfds");
  int pipe_fds[2];
  BOOST_REQUIRE(::pipe(pipe_fds) == 0);  // no O_CLOEXEC, as a careless library makes one
  ChildProcess::SpawnOptions o;
  o.log_path = (dir.path / "sleep.log").string();
  auto child = ChildProcess::spawn({"/bin/sleep", "30"}, o);
  ::close(pipe_fds[1]);
  BOOST_REQUIRE(child.ok());
  BOOST_REQUIRE(test::eventually([&] { return runs(child->pid(), "sleep"); }, 5s));
  // Eventually: sleep's dynamic loader opens its libraries after the exec
  // (one descriptor at a time, closed once mapped).
  const auto standard_only = [&] { return open_descriptors(child->pid()) == std::vector<int>{0, 1, 2}; };
  BOOST_TEST(test::eventually(standard_only, 5s));
  BOOST_TEST(open_descriptors(child->pid()) == (std::vector<int>{0, 1, 2}), boost::test_tools::per_element());
  pollfd p{pipe_fds[0], POLLIN, 0};
  BOOST_TEST(::poll(&p, 1, 5000) == 1);  // EOF: no writer left
  BOOST_TEST((p.revents & POLLHUP) != 0);
  ::close(pipe_fds[0]);
  child->signal(SIGTERM);
  BOOST_TEST(child->wait(5s) == 128 + SIGTERM);
}

// With SIGCHLD ignored the kernel reaps each child as it exits, and no
// wait finds it: its exit is still seen at once, its code unknown (-1).
// A ServerProcess whose server exits at start fails at once saying so,
// rather than after its start timeout; a stop returns as the server ends,
// rather than after its timeout and a SIGKILL. Run in a process of its
// own, which ignores SIGCHLD.
BOOST_AUTO_TEST_CASE(with_sigchld_ignored_an_exit_is_seen_at_once) {
  Note note;
  test::TempDir dir("sigchld");
  auto tester = test::Process::fork_fn([&]() -> int {
    ::signal(SIGCHLD, SIG_IGN);
    std::string failed;
    using Clock = std::chrono::steady_clock;
    ServerProcess::Options o;
    o.binary = test::program_path("shmps-server");
    o.name = test::unique_name("sigchld");
    o.spawn.log_path = (dir.path / "server.log").string();
    o.start_timeout = 10s;  // no --tensor: the server exits at once
    auto t0 = Clock::now();
    auto bad = ServerProcess::start(o);
    if (bad.ok() || Clock::now() - t0 > 3s || !contains(bad.status().message(), " exited"))
      failed += "start of a server that exits: " + (bad.ok() ? std::string("ok") : bad.status().to_string()) + "; ";
    o.args = {"--tensor", "w:4"};
    auto good = ServerProcess::start(o);
    if (!good.ok()) {
      note.set(good.status().to_string());
      return 2;
    }
    t0 = Clock::now();
    const int stopped = (*good)->stop(10s);
    if (stopped != -1 || Clock::now() - t0 > 3s) failed += "stop(): " + std::to_string(stopped) + "; ";
    if (std::filesystem::exists("/dev/shm/shmps." + o.name)) failed += "the segment is left (not a clean stop); ";
    auto child = ChildProcess::spawn({"/bin/true"});
    if (!child.ok()) return 3;
    t0 = Clock::now();
    const int code = child->wait(10s);
    if (code != -1 || child->running() || Clock::now() - t0 > 3s)
      failed += "wait() of /bin/true: " + std::to_string(code) + (child->running() ? ", running" : "") + "; ";
    ::signal(SIGCHLD, SIG_DFL);
    note.set(failed);
    return failed.empty() ? 0 : 1;
  });
  BOOST_TEST(tester.wait(60s) == 0, note.text);
}

// A fork()ed child of the process that holds a ChildProcess has a copy of
// the object (and its pidfd): dropping that copy there (a fork that
// returns and unwinds) leaves the child alone, which is the parent's to
// signal and reap; it used to SIGKILL its sibling.
BOOST_AUTO_TEST_CASE(a_forked_copy_of_the_object_leaves_its_child_alone) {
  auto child = ChildProcess::spawn({"/bin/sleep", "30"});
  BOOST_REQUIRE(child.ok());
  auto copy_holder = ChildProcess::fork_run([&]() -> int {
    ChildProcess dropped = std::move(*child);  // the destructor runs here, in the fork
    dropped.signal(SIGTERM);
    int code = 0;
    return dropped.try_wait(&code) ? 1 : 0;
  });
  BOOST_REQUIRE(copy_holder.ok());
  BOOST_TEST(copy_holder->wait(10s) == 0);
  std::this_thread::sleep_for(100ms);
  int code = 0;
  BOOST_TEST(!child->try_wait(&code), "the child ended: " << code);
  child->signal(SIGTERM);
  BOOST_TEST(child->wait(5s) == 128 + SIGTERM);
}

// A child that another wait of this process reaped (a waitpid(-1)
// elsewhere), whose pid a new process took since, is neither signalled
// nor waited for by that pid: its destructor (SIGKILL and reap), signal(),
// pause() and try_wait() leave the new process alone. Run in a pid namespace,
// where the new process can be handed the pid.
BOOST_AUTO_TEST_CASE(a_child_reaped_elsewhere_never_reaches_the_process_that_takes_its_pid,
                     *boost::unit_test::precondition(pid_namespaces)) {
  Note note;
  const int rc = in_pid_namespace(
      [&]() -> int {
        std::string failed;
        for (const bool by_destructor : {true, false}) {
          const std::string how = by_destructor ? "destructor: " : "signal(), try_wait(): ";
          auto first = ChildProcess::spawn({"/bin/sleep", "30"});
          if (!first.ok()) return 2;
          const pid_t pid = first->pid();
          ::kill(pid, SIGKILL);  // another part of the program ends it and reaps it
          int status = 0;
          if (::waitpid(-1, &status, 0) != pid) return 3;
          if (!next_pid_is(pid, note)) return 4;
          auto second = ChildProcess::spawn({"/bin/sleep", "30"});
          if (!second.ok() || second->pid() != pid) {
            note.set("the new process got another pid");
            return 5;
          }
          if (by_destructor) {
            ChildProcess dropped = std::move(*first);
          } else {
            first->signal(SIGTERM);
            const auto pause_start = std::chrono::steady_clock::now();
            first->pause();  // returns at once: no SIGSTOP to the new process, no wait for it to stop
            if (std::chrono::steady_clock::now() - pause_start > 2s) failed += how + "pause() waited; ";
            if (test::process_state(pid) == 'T') failed += how + "pause() stopped the new process; ";
            int code = 0;
            if (!first->try_wait(&code) || code != -1 || first->running())
              failed += how + "the reaped child counts as running, or its code is " + std::to_string(code) + "; ";
          }
          std::this_thread::sleep_for(100ms);
          if (test::process_ended(pid)) failed += how + "the new process at the pid ended; ";
          second->signal(SIGTERM);
          if (const int code = second->wait(5s); code != 128 + SIGTERM)
            failed += how + "the new process's own wait: " + std::to_string(code) + "; ";
        }
        note.set(failed);
        return failed.empty() ? 0 : 1;
      },
      note);
  BOOST_TEST(rc == 0, note.text);
}

// A stale segment at the name, left by a killed server whose pid the new
// child has (a pid namespace hands out low pids again: a container's
// server restarted), is not taken for the child's: start() returns once
// the segment names the child's start time too. Run in a pid namespace,
// where the new child can be handed the pid; the server is started
// through a script that waits before it execs it, so that the stale
// segment is there alone for a while.
BOOST_AUTO_TEST_CASE(start_does_not_take_a_stale_segment_under_the_childs_pid_for_its_own,
                     *boost::unit_test::precondition(pid_namespaces)) {
  test::TempDir dir("stalepid");
  const std::string late = (dir.path / "late-server.sh").string();
  std::ofstream(late) << "#!/bin/sh\nsleep 0.3\nexec " << test::shell_quote(test::program_path("shmps-server"))
                      << " \"$@\"\n";
  std::filesystem::permissions(late, std::filesystem::perms::owner_all);
  Note note;
  const std::string name = test::unique_name("stalepid");
  const int rc = in_pid_namespace(
      [&]() -> int {
        ServerProcess::Options o;
        o.binary = test::program_path("shmps-server");
        o.name = name;
        o.args = {"--tensor", "w:4"};
        auto first = ServerProcess::start(o);
        if (!first.ok()) {
          note.set(first.status().to_string());
          return 2;
        }
        const pid_t pid = (*first)->pid();
        (*first)->process().kill_and_reap();  // its segment stays, naming pid
        std::this_thread::sleep_for(50ms);    // past a clock tick: the next start time differs
        if (!next_pid_is(pid, note)) return 3;
        o.binary = late;
        auto second = ServerProcess::start(o);
        if (!second.ok()) {
          note.set(second.status().to_string());
          return 4;
        }
        if ((*second)->pid() != pid) {
          note.set("the second server got another pid");
          return 5;
        }
        uint64_t published = 0;
        if (auto seg = shm::Segment::open(name, /*read_only=*/true); seg.ok())
          published = (*seg)->layout().server_start_time;
        if (published != shm::process_start_time(pid)) {
          note.set("start() returned with the segment naming start time " + std::to_string(published) +
                   ", not the child's " + std::to_string(shm::process_start_time(pid)));
          return 1;
        }
        return (*second)->stop() == 0 ? 0 : 6;
      },
      note);
  ::unlink(("/dev/shm/shmps." + name).c_str());
  BOOST_TEST(rc == 0, note.text);
}

// pause() of a child that has exited (a zombie, not reaped yet) returns at
// once: no SIGSTOP stops it, and waiting for it to stop would take the
// whole 10 s.
BOOST_AUTO_TEST_CASE(pause_of_a_child_that_has_exited_returns_at_once) {
  auto child = ChildProcess::spawn({"/bin/true"});
  BOOST_REQUIRE(child.ok());
  BOOST_REQUIRE(test::eventually([&] { return test::process_state(child->pid()) == 'Z'; }, 5s));
  const auto t0 = std::chrono::steady_clock::now();
  child->pause();
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 2s));
  BOOST_TEST(child->wait(5s) == 0);
}

BOOST_AUTO_TEST_SUITE_END()
