#include "shmps/server_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <system_error>
#include <thread>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps {
namespace {

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// fork() after flushing stdio (the child's copy of unwritten output would
// be written twice), on the calling thread; the child runs `body`, which
// ends it (exec or _exit). -1: fork failed (errno).
pid_t fork_here(const std::function<void()>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    body();
    ::_exit(127);
  }
  return pid;
}

// In a child just forked with a death signal: whether the process that
// forked it (`parent`) has ended already, before prctl(PR_SET_PDEATHSIG),
// which then never fires. A child that is the first process of a pid
// namespace (forked after unshare(CLONE_NEWPID)) has a parent outside it:
// getppid() is 0 there, and it cannot tell (the window is the few
// instructions since the fork).
bool parent_gone(pid_t parent) {
  const pid_t now = ::getppid();
  return now != parent && now != 0;
}

// The thread that forks every child made with die_with_parent.
// PR_SET_PDEATHSIG signals the child when the thread that forked it ends,
// not when the process does: a child forked by a caller's short-lived
// thread would be signalled as that thread returns. This thread starts
// with the first such spawn of a process (a fork()ed child starts its
// own), blocks every signal, and ends only with the process (its exit, a
// fatal signal, an exec()), so its children get the signal then and only
// then. The caller waits while it forks; the child takes the caller's
// signal mask, CPU affinity and name before `body`, as if the caller had
// forked it.
class ForkThread {
 public:
  // This process's thread, started on first use; nullptr (errno EAGAIN)
  // when it cannot be started.
  static ForkThread* get() {
    // Held across every fork() of the process, so a child never inherits
    // it locked by a thread it does not have.
    static const int registered =
        ::pthread_atfork([] { lock().lock(); }, [] { lock().unlock(); }, [] { lock().unlock(); });
    (void)registered;
    static ForkThread* current = nullptr;  // the process's own: a fork()ed child's copy names its parent's
    static pid_t owner = 0;
    std::lock_guard<std::mutex> guard(lock());
    if (current == nullptr || owner != ::getpid()) {
      // Never destroyed (nor the parent's, left unused in a child): the
      // thread waits on its members until the process ends.
      auto* made = new ForkThread();
      if (!made->start()) {
        delete made;
        errno = EAGAIN;
        return nullptr;
      }
      current = made;
      owner = ::getpid();
    }
    return current;
  }

  // fork() on this thread; in the child, the caller's signal mask,
  // affinity and name, the death signal `signo`, then `body` (which ends
  // the child). The pid, or -1 (errno).
  pid_t fork(int signo, const std::function<void()>& body) {
    Job job;
    job.signo = signo;
    job.body = &body;
    job.parent = ::getpid();
    ::pthread_sigmask(SIG_SETMASK, nullptr, &job.mask);
    CPU_ZERO(&job.cpus);
    job.has_cpus = ::sched_getaffinity(0, sizeof job.cpus, &job.cpus) == 0;
    ::prctl(PR_GET_NAME, job.name);
    std::lock_guard<std::mutex> one_at_a_time(calls_);
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &job;
    wake_.notify_all();
    wake_.wait(lock, [&] { return job.done; });
    errno = job.error;
    return job.pid;
  }

 private:
  struct Job {
    int signo = 0;
    const std::function<void()>* body = nullptr;
    pid_t parent = 0;
    sigset_t mask{};
    cpu_set_t cpus{};
    bool has_cpus = false;
    char name[16] = {};
    // Written by the thread under mu_:
    bool done = false;
    pid_t pid = -1;
    int error = 0;
  };

  static std::mutex& lock() {
    static auto* m = new std::mutex();  // never destroyed: a fork during static destruction finds it
    return *m;
  }

  ForkThread() = default;

  bool start() {
    // Every signal blocked from its first instruction: a process-directed
    // signal goes to the caller's threads, never runs its handler here.
    sigset_t all, before;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &before);
    bool started = true;
    try {
      std::thread([this] { run(); }).detach();
    } catch (const std::system_error&) {
      started = false;
    }
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    return started;
  }

  void run() {
    (void)::pthread_setname_np(::pthread_self(), "shmps-fork");
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [&] { return job_ != nullptr; });
      Job& job = *job_;
      job_ = nullptr;
      lock.unlock();
      std::fflush(stdout);
      std::fflush(stderr);
      const pid_t pid = ::fork();
      if (pid == 0) in_child(job);
      const int error = errno;
      lock.lock();
      job.pid = pid;
      job.error = error;
      job.done = true;
      wake_.notify_all();
    }
  }

  // The child, on its copy of this thread: the death signal first, then
  // (the process may have ended before prctl, which then never fires) its
  // parent checked; then the caller's thread attributes, and the body.
  [[noreturn]] static void in_child(const Job& job) {
    ::prctl(PR_SET_PDEATHSIG, job.signo);
    if (parent_gone(job.parent)) ::_exit(98);
    if (job.has_cpus) (void)::sched_setaffinity(0, sizeof job.cpus, &job.cpus);
    ::prctl(PR_SET_NAME, job.name);
    ::pthread_sigmask(SIG_SETMASK, &job.mask, nullptr);
    (*job.body)();
    ::_exit(127);
  }

  std::mutex calls_;  // held by a caller for its whole job
  std::mutex mu_;     // job_ and each Job's results
  std::condition_variable wake_;
  Job* job_ = nullptr;  // the job to fork, until the thread takes it
};

// A child running `body` (which ends it: exec or _exit); with
// die_with_parent it gets `signo` when this process ends. The main thread
// lives as long as the process and forks it itself; any other thread
// hands the fork to the ForkThread. A process that never spawns from
// another thread so stays single-threaded, as forking children that start
// threads of their own may need (ThreadSanitizer kills such a child of a
// multithreaded process). -1: fork failed (errno).
pid_t fork_child(bool die_with_parent, int signo, const std::function<void()>& body) {
  if (!die_with_parent) return fork_here(body);
  if (::gettid() == ::getpid()) {
    const pid_t parent = ::getpid();
    return fork_here([&] {
      ::prctl(PR_SET_PDEATHSIG, signo);
      if (parent_gone(parent)) ::_exit(98);  // the process ended before prctl, which then never fires
      body();
    });
  }
  ForkThread* thread = ForkThread::get();
  return thread != nullptr ? thread->fork(signo, body) : -1;
}

// The environment a spawned child gets, as execve() takes it: this
// process's (environ, read here), less each variable of `unset`, plus each
// of `defaults` not set by then (the first of a repeated one), built
// before the fork: setenv() and unsetenv() take glibc's environment lock,
// which another thread of this process may hold at the fork, for ever in
// the child. A name that setenv() refuses ("" or one with '=') is passed
// over, as setenv() and unsetenv() pass it over.
std::vector<std::string> child_environment(const std::vector<std::string>& unset,
                                           const std::vector<std::pair<std::string, std::string>>& defaults) {
  const auto usable = [](const std::string& key) { return !key.empty() && key.find('=') == std::string::npos; };
  const auto names = [](const std::string& entry, const std::string& key) {
    return entry.size() > key.size() && entry.compare(0, key.size(), key) == 0 && entry[key.size()] == '=';
  };
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    if (std::none_of(unset.begin(), unset.end(),
                     [&](const std::string& key) { return usable(key) && names(entry, key); }))
      env.push_back(entry);
  }
  for (const auto& [key, value] : defaults)
    if (usable(key) &&
        std::none_of(env.begin(), env.end(), [&](const std::string& entry) { return names(entry, key); }))
      env.push_back(key + "=" + value);
  return env;
}

// A pidfd for the child `pid` just forked (pidfd_open). Through it a
// signal or a wait reaches that child and never a process that takes its
// pid once another wait of this process reaped it (SIGCHLD ignored, a
// waitpid(-1) elsewhere). -1 where pidfds are refused (Linux before 5.3, a
// seccomp filter): signals and waits go by pid then. `reaped` (ESRCH): the
// child was reaped already (it exited at once, SIGCHLD ignored). Opened
// right after the fork: a child reaped before that whose pid was taken
// again meanwhile would need the pid space to wrap in those microseconds.
int open_pidfd(pid_t pid, int reaped) {
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) return static_cast<int>(fd);
  return errno == ESRCH ? reaped : -1;
}

}  // namespace

Result<ChildProcess> ChildProcess::spawn(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) return Status{ErrorCode::kInvalidArgument, "spawn: no program"};
  // Everything the child needs is made here: between fork and exec it
  // makes only async-signal-safe calls (no allocation, no environment
  // lock), which is all a child of a multithreaded process may make.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::vector<std::string> env_entries = child_environment(options.env_unset, options.env_defaults);
  std::vector<char*> env;
  for (const auto& e : env_entries) env.push_back(const_cast<char*>(e.c_str()));
  env.push_back(nullptr);
  // Where the child closes descriptors one by one when close_range() is
  // refused (a kernel before 5.9, a seccomp filter): below the limit.
  rlimit files{};
  const unsigned fd_limit = ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY
                                ? static_cast<unsigned>(std::min<rlim_t>(files.rlim_cur, 1u << 20))
                                : 1u << 20;
  // Every signal blocked from the fork on (the fork thread takes this
  // thread's mask for its child): until the dispositions are reset, a
  // signal (die_with_parent's, the parent dying at once) would run this
  // process's handler in the child, or be discarded where this process
  // ignores it; blocked, it stays pending for the program.
  sigset_t all, caller;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &caller);
  const pid_t pid = fork_child(options.die_with_parent, SIGTERM, [&] {
    // Every signal blocked while the dispositions are reset (none runs
    // this process's handlers in the child), then none: a program starts
    // with no signal blocked, whatever the caller's thread blocked (a
    // sigwait() loop's SIGTERM), and with each signal at its default
    // action, whatever this process ignored (SIGTERM, SIGCHLD, SIGPIPE);
    // either would outlive the exec, and a SIGTERM (die_with_parent's
    // too) might never stop it. An ignored SIGHUP, SIGINT or SIGQUIT stays
    // ignored: nohup and a shell ignore those to keep a whole job running
    // through a hangup or a terminal's interrupt.
    sigset_t signals;
    ::sigfillset(&signals);
    ::sigprocmask(SIG_SETMASK, &signals, nullptr);
    struct sigaction default_action {};
    default_action.sa_handler = SIG_DFL;
    ::sigemptyset(&default_action.sa_mask);
    for (int signo = 1; signo < NSIG; ++signo) {
      if (signo == SIGKILL || signo == SIGSTOP) continue;
      struct sigaction current {};
      if ((signo == SIGHUP || signo == SIGINT || signo == SIGQUIT) && ::sigaction(signo, nullptr, &current) == 0 &&
          current.sa_handler == SIG_IGN)
        continue;
      (void)::sigaction(signo, &default_action, nullptr);
    }
    if (!options.log_path.empty()) {
      const int fd = ::open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        // Opened as 1 or 2 (this process had closed it): a dup2() onto
        // itself keeps close-on-exec, which the program's stream must lose.
        if (fd <= STDERR_FILENO) ::fcntl(fd, F_SETFD, 0);
      }
    }
    // The program gets stdin, stdout and stderr only: any other descriptor
    // of this process that is not close-on-exec (a pipe's end, a socket, a
    // flock()ed file, made by a library or another thread) would stay open
    // for the program's life (a pipe never reads EOF, a lock is never
    // released).
    if (::close_range(STDERR_FILENO + 1, ~0U, 0) != 0)
      for (unsigned fd = STDERR_FILENO + 1; fd < fd_limit; ++fd) ::close(static_cast<int>(fd));
    ::sigemptyset(&signals);
    ::sigprocmask(SIG_SETMASK, &signals, nullptr);
    ::execve(args[0], args.data(), env.data());
    ::_exit(127);
  });
  const int fork_error = errno;
  ::pthread_sigmask(SIG_SETMASK, &caller, nullptr);
  if (pid < 0) return Status{ErrorCode::kIo, "fork: " + errno_text(fork_error)};
  return ChildProcess(pid, open_pidfd(pid, kReaped));
}

Result<ChildProcess> ChildProcess::fork_run(const std::function<int()>& fn, bool die_with_parent) {
  const pid_t pid = fork_child(die_with_parent, SIGKILL, [&] {
    int rc = 99;
    try {
      rc = fn();
    } catch (...) {
      rc = 99;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(rc);
  });
  if (pid < 0) return Status{ErrorCode::kIo, "fork: " + errno_text(errno)};
  return ChildProcess(pid, open_pidfd(pid, kReaped));
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_), pidfd_(other.pidfd_), owner_(other.owner_) {
  other.pid_ = -1;
  other.pidfd_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    kill_and_reap();
    pid_ = other.pid_;
    pidfd_ = other.pidfd_;
    owner_ = other.owner_;
    other.pid_ = -1;
    other.pidfd_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() { kill_and_reap(); }

void ChildProcess::signal(int signo) const noexcept {
  if (pid_ <= 0 || pidfd_ == kReaped || !ours()) return;
  if (pidfd_ >= 0)
    (void)::syscall(SYS_pidfd_send_signal, pidfd_, signo, nullptr, 0);
  else
    ::kill(pid_, signo);
}

void ChildProcess::pause() const {
  if (pid_ <= 0 || pidfd_ == kReaped || !ours()) return;
  signal(SIGSTOP);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    // Exited, which no SIGSTOP stops: the pidfd reads so (a zombie, or
    // reaped by another wait, its pid maybe another process's since);
    // without one, /proc says a zombie or no such process.
    if (pidfd_ >= 0) {
      pollfd exited{pidfd_, POLLIN, 0};
      if (::poll(&exited, 1, 0) > 0) return;
    }
    const shm::ProcessState state = shm::pid_state(pid_);
    if (state == shm::ProcessState::kStopped || (pidfd_ < 0 && state == shm::ProcessState::kGone)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ChildProcess::resume() const noexcept { signal(SIGCONT); }

int ChildProcess::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int code = 0;
    if (try_wait(&code)) return code;
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int ChildProcess::wait() {
  int code = -1;
  return reap(/*block=*/true, &code) ? code : -1;
}

bool ChildProcess::try_wait(int* code) { return reap(/*block=*/false, code); }

bool ChildProcess::reap(bool block, int* code) noexcept {
  if (pid_ <= 0 || !ours()) return false;
  int result = -1;  // stays for a child another wait reaped (ECHILD): its code is lost
  bool by_pid = pidfd_ == -1;
  while (pidfd_ != kReaped) {
    if (!by_pid) {
      siginfo_t info{};
      if (::waitid(P_PIDFD, static_cast<id_t>(pidfd_), &info, WEXITED | (block ? 0 : WNOHANG)) == 0) {
        if (info.si_pid == 0) return false;  // WNOHANG: still running
        result = info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status;
        break;
      }
      if (errno == EINTR) continue;
      if (errno != EINVAL) break;  // ECHILD
      by_pid = true;               // EINVAL: no P_PIDFD (Linux 5.3); the pid is still the child's
    }
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
    if (r == pid_) {
      result = exit_code(status);
      break;
    }
    if (r == 0) return false;
    if (errno != EINTR) break;  // ECHILD
  }
  if (pidfd_ >= 0) ::close(pidfd_);
  pidfd_ = -1;
  pid_ = -1;
  *code = result;
  return true;
}

void ChildProcess::kill_and_reap() noexcept {
  if (pid_ <= 0) return;
  if (!ours()) {  // a fork()ed copy in the child: the parent's to reap
    if (pidfd_ >= 0) ::close(pidfd_);
    pidfd_ = -1;
    pid_ = -1;
    return;
  }
  signal(SIGKILL);
  int code = 0;
  (void)reap(/*block=*/true, &code);
}

std::string server_binary() {
  std::error_code ec;
  const auto beside = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "shmps-server";
  if (!ec && ::access(beside.c_str(), X_OK) == 0) return beside.string();
  if (const char* path = std::getenv("PATH")) {
    std::string dirs = path;
    size_t start = 0;
    while (start <= dirs.size()) {
      const size_t end = std::min(dirs.find(':', start), dirs.size());
      const std::string candidate =
          (end > start ? dirs.substr(start, end - start) : std::string(".")) + "/shmps-server";
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      start = end + 1;
    }
  }
  return "";
}

Result<std::unique_ptr<ServerProcess>> ServerProcess::start(const Options& options) {
  const std::string binary = options.binary.empty() ? server_binary() : options.binary;
  if (binary.empty()) return Status{ErrorCode::kInvalidArgument, "no shmps-server beside this program or on PATH"};
  if (options.name.empty()) return Status{ErrorCode::kInvalidArgument, "a server needs a --name"};
  std::vector<std::string> argv{binary, "--name", options.name};
  argv.insert(argv.end(), options.args.begin(), options.args.end());
  // The child is a job's server, not the service: a service manager's
  // socket and watchdog in this environment are this process's unit's,
  // which the child's READY=1, STOPPING=1 and keep-alives must not drive.
  ChildProcess::SpawnOptions spawn = options.spawn;
  for (const char* key : {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}) spawn.env_unset.emplace_back(key);
  auto child = ChildProcess::spawn(argv, spawn);
  if (!child.ok()) return child.status();
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->name_ = options.name;
  server->child_ = std::move(child).value();
  // Read while the child cannot be reaped yet (only this object waits for
  // it): the header of the segment it publishes names this start time.
  server->server_pid_ = server->child_.pid();
  server->server_start_time_ = shm::process_start_time(server->server_pid_);
  const std::string log = options.spawn.log_path.empty() ? std::string() : " (log: " + options.spawn.log_path + ")";
  const auto deadline = std::chrono::steady_clock::now() + options.start_timeout;
  while (true) {
    int code = 0;
    if (server->child_.try_wait(&code))
      return Status{ErrorCode::kServerNotRunning,
                    binary + " --name " + options.name +
                        (code >= 0 ? " exited with " + std::to_string(code)
                                   : " exited (its status taken by another wait of this process: SIGCHLD ignored?)") +
                        log};
    // Published by this child: its pid and start time in a header whose
    // version is set (the segment is validated as a worker would). The pid
    // alone is not enough: a stale segment of a killed server may name the
    // same pid (a pid namespace, a container's, hands out low pids again).
    // A start time this process could not read (0) leaves the pid alone.
    if (auto seg = shm::Segment::open(options.name, /*read_only=*/true);
        seg.ok() && (*seg)->layout().server_pid == static_cast<uint32_t>(server->server_pid_) &&
        (server->server_start_time_ == 0 || (*seg)->layout().server_start_time == server->server_start_time_))
      return server;
    if (std::chrono::steady_clock::now() >= deadline) {
      server->child_.kill_and_reap();
      server->remove_segment_left();
      return Status{ErrorCode::kServerNotRunning, "server '" + options.name + "' did not publish its segment within " +
                                                      std::to_string(options.start_timeout.count()) + " ms" + log};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int ServerProcess::stop(std::chrono::milliseconds timeout) {
  if (!child_.running()) return -1;
  child_.signal(SIGTERM);
  // A paused server (pause()) handles the SIGTERM once it runs: resumed,
  // it stops as asked (a final checkpoint, exit 0) instead of being
  // killed at the end of the timeout.
  child_.resume();
  const int code = child_.wait(timeout);
  if (code >= 0 || !child_.running()) return code;  // -1: reaped by another wait, its code lost
  child_.kill_and_reap();
  return 128 + SIGKILL;
}

void ServerProcess::remove_segment_left() const {
  shm::Segment::remove_if_left_by(name_, server_pid_, server_start_time_);
}

ServerProcess::~ServerProcess() {
  stop();
  remove_segment_left();
}

}  // namespace shmps
