// Access control: the control segment and buffer objects get an explicit
// mode whatever the umask (0600, or 0660 with --group-access) and are never
// world-accessible; a process without access gets kPermission; a name held
// by another user is never adopted; workers never create the segment;
// object names are validated; a worker cannot borrow another's buffer; a
// worker attaches only to a segment whose owner and mode it trusts.
// Cases that need a second user fork a child that becomes nobody (65534);
// they are skipped, with a message, when the test does not run as root.
#define BOOST_TEST_MODULE test_access
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>
#include <thread>

#include "raw_client.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

constexpr uid_t kNobody = 65534;
constexpr gid_t kNogroup = 65534;

bool is_root() { return ::geteuid() == 0; }

// In a forked child: become nobody, for good.
bool become_nobody() { return ::setgid(kNogroup) == 0 && ::setgroups(0, nullptr) == 0 && ::setuid(kNobody) == 0; }

struct stat stat_of(const std::string& object_name) {
  struct stat st {};
  BOOST_REQUIRE_MESSAGE(::stat(("/dev/shm/" + object_name).c_str(), &st) == 0, "no /dev/shm/" << object_name);
  return st;
}

// Sets the umask for its lifetime (children forked meanwhile inherit it).
struct ScopedUmask {
  explicit ScopedUmask(mode_t m) : old(::umask(m)) {}
  ~ScopedUmask() { ::umask(old); }
  mode_t old;
};

// A page shared with forked children, for a short message back.
struct SharedText {
  SharedText() {
    text = static_cast<char*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    BOOST_REQUIRE(text != MAP_FAILED);
  }
  ~SharedText() { ::munmap(text, 4096); }
  void set(const std::string& s) const { std::snprintf(text, 4096, "%s", s.c_str()); }
  char* text;
};

using test::connect;

// Buffer objects of `name`: "shmps.<name>.p<pid>.<n>".
std::vector<std::string> buffer_objects(const std::string& name) {
  std::vector<std::string> out;
  const std::string prefix = shm::segment_object_name(name) + ".p";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().filename().string());
  return out;
}

const std::vector<std::string> kTiny = {"--tensor", "w:4"};

}  // namespace

BOOST_AUTO_TEST_SUITE(access_control)

BOOST_AUTO_TEST_CASE(segment_mode_is_explicit_whatever_the_umask) {
  for (const mode_t mask : {mode_t{0}, mode_t{0777}}) {
    for (const bool group : {false, true}) {
      BOOST_TEST_CONTEXT("umask 0" << std::oct << mask << std::dec << (group ? ", --group-access" : "")) {
        std::vector<std::string> args = kTiny;
        if (group) args.push_back("--group-access");
        const ScopedUmask um(mask);
        test::ServerProcess server(test::unique_name("mode"), args);
        const struct stat st = stat_of(shm::segment_object_name(server.name()));
        BOOST_TEST((st.st_mode & 0777) == (group ? 0660u : 0600u), "mode 0" << std::oct << (st.st_mode & 0777));
        BOOST_TEST((st.st_mode & 0007) == 0u);  // never world-accessible
        BOOST_TEST(st.st_uid == ::geteuid());
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(buffer_objects_get_an_explicit_mode_and_the_segments_group) {
  for (const bool group : {false, true}) {
    BOOST_TEST_CONTEXT((group ? "--group-access" : "default")) {
      std::vector<std::string> args = kTiny;
      if (group) args.push_back("--group-access");
      test::ServerProcess server(test::unique_name("bufmode"), args);
      const ScopedUmask um(0);  // a umask-based mode would come out 0666
      auto w = connect(server.name());
      auto buf = w->register_buffer(64);
      BOOST_REQUIRE_MESSAGE(buf.ok(), buf.status().to_string());
      const auto objects = buffer_objects(server.name());
      BOOST_REQUIRE_EQUAL(objects.size(), 1u);
      const struct stat st = stat_of(objects[0]);
      const struct stat seg = stat_of(shm::segment_object_name(server.name()));
      BOOST_TEST((st.st_mode & 0777) == (group ? 0660u : 0600u), "mode 0" << std::oct << (st.st_mode & 0777));
      BOOST_TEST(st.st_uid == ::geteuid());
      if (group) BOOST_TEST(st.st_gid == seg.st_gid);
    }
  }
}

BOOST_AUTO_TEST_CASE(world_accessible_modes_are_refused) {
  const std::string name = "shmps." + test::unique_name("worldw");
  for (const mode_t mode : {mode_t{0666}, mode_t{0602}, mode_t{04600}}) {
    auto obj = shm::ShmObject::create(name, 4096, mode);
    BOOST_TEST((obj.status().code() == ErrorCode::kInvalidArgument), obj.status().to_string());
    BOOST_TEST(!std::filesystem::exists("/dev/shm/" + name));
  }
}

BOOST_AUTO_TEST_CASE(process_without_access_gets_kPermission_naming_the_segment) {
  if (!is_root()) {
    BOOST_TEST_MESSAGE("skipped: needs root to run a worker as another user (nobody)");
    return;
  }
  for (const bool group : {false, true}) {
    BOOST_TEST_CONTEXT((group ? "--group-access (nobody is not in the group)" : "mode 0600")) {
      std::vector<std::string> args = kTiny;
      if (group) args.push_back("--group-access");
      test::ServerProcess server(test::unique_name("noaccess"), args);
      SharedText message;
      auto child = test::Process::fork_fn([&] {
        if (!become_nobody()) return 90;
        WorkerOptions o;
        o.name = server.name();
        auto w = Worker::connect(o);
        message.set(w.ok() ? std::string("connected") : w.status().to_string());
        if (w.ok()) return 1;
        return w.status().code() == ErrorCode::kPermission ? 0 : 2;
      });
      BOOST_TEST(child.wait(10s) == 0, "worker as nobody: " << message.text);
      const std::string text = message.text;
      BOOST_TEST(text.find("permission denied") != std::string::npos, text);
      BOOST_TEST(text.find(shm::segment_object_name(server.name())) != std::string::npos, text);
      // Root's group is not one to join: the fix is a group of the server's own.
      BOOST_TEST(text.find("its group is root, which workers should not join") != std::string::npos, text);
      BOOST_TEST(text.find("adduser") == std::string::npos, text);
      // The server is unaffected.
      auto w = connect(server.name());
      BOOST_TEST(w->ping().ok());
    }
  }
}

// With /proc mounted hidepid=invisible (or a worker's unit with
// ProtectProc=invisible), a worker of another user finds no /proc entry
// for its server's process: the kernel tells (kill(pid, 0): EPERM is a
// live process), and the worker attaches to the live server instead of
// calling it dead. The worker runs in a mount namespace of its own, with a
// proc of its own mounted so, as nobody in the segment's group (root's:
// the server runs as root with --group-access).
BOOST_AUTO_TEST_CASE(a_worker_that_cannot_see_its_servers_process_takes_it_for_alive) {
  if (!is_root()) {
    BOOST_TEST_MESSAGE("skipped: needs root to mount a proc of its own and run a worker as another user (nobody)");
    return;
  }
  std::vector<std::string> args = kTiny;
  args.push_back("--group-access");
  test::ServerProcess server(test::unique_name("hidepid"), args);
  const pid_t server_pid = server.process().pid();
  SharedText message;
  auto child = test::Process::fork_fn([&] {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      message.set("unshare(CLONE_NEWNS): " + errno_text(errno));
      return 90;
    }
    // gid: the group that still sees every process, by default root's,
    // which this worker is in; here one nobody holds.
    if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible,gid=65533") != 0) {
      message.set("mount -t proc -o hidepid=invisible: " + errno_text(errno));
      return 90;
    }
    const gid_t extra[] = {0};
    if (::setgid(kNogroup) != 0 || ::setgroups(1, extra) != 0 || ::setuid(kNobody) != 0) return 91;
    if (::access(("/proc/" + std::to_string(server_pid)).c_str(), F_OK) == 0) {
      message.set("the server's /proc entry is visible");
      return 92;
    }
    WorkerOptions o;
    o.name = server.name();
    auto w = Worker::connect(o);
    if (!w.ok()) {
      message.set("connect: " + w.status().to_string());
      return 1;
    }
    auto buf = (*w)->register_buffer(16);
    const Status s = buf.ok() ? (*w)->pull(0, buf->id, 0).status() : buf.status();
    message.set(s.to_string());
    return s.ok() ? 0 : 2;
  });
  const int rc = child.wait(10s);
  if (rc == 90) {
    BOOST_TEST_MESSAGE("skipped: " << message.text);
    return;
  }
  BOOST_TEST(rc == 0, "worker as nobody under hidepid=invisible: " << message.text);
}

// The message a denied worker gets names the segment's path, owner
// user:group and mode, who the worker is, and the fix, and says "permission
// denied" once. The server runs with a throwaway group as its effective
// group (the segment gets that group); the worker runs as nobody, with or
// without that group.
BOOST_AUTO_TEST_CASE(permission_denied_names_owner_group_mode_and_the_fix) {
  if (!is_root()) {
    BOOST_TEST_MESSAGE("skipped: needs root to create a group and run a worker as another user (nobody)");
    return;
  }
  const std::string group = "shmps_t" + std::to_string(::getpid());
  const auto added = test::run_captured({"/usr/sbin/groupadd", group});
  if (added.exit_code != 0) {
    BOOST_TEST_MESSAGE("skipped: groupadd " << group << " failed (" << added.exit_code << "): " << added.output);
    return;
  }
  struct GroupGuard {
    std::string name;
    ~GroupGuard() { (void)test::run_captured({"/usr/sbin/groupdel", name}); }
  } guard{group};
  const struct group* gr = ::getgrnam(group.c_str());
  BOOST_REQUIRE(gr != nullptr);
  const gid_t gid = gr->gr_gid;
  struct Case {
    bool group_access, worker_in_group;
    std::string tail;  // after "this process runs as nobody"
  };
  const std::string join = "join group " + group + ": sudo adduser nobody " + group + ", then log in again";
  const std::string only_owner = "the mode lets only its owner in: start the server with --group-access (mode 0660)";
  for (const Case& c : std::vector<Case>{{true, false, ", not in group " + group + "; " + join},
                                         {false, false, ", not in group " + group + "; " + only_owner + " and " + join},
                                         {false, true, " in group " + group + ", but " + only_owner},
                                         {true, true, ""}}) {
    BOOST_TEST_CONTEXT((c.group_access ? "mode 0660" : "mode 0600")
                       << (c.worker_in_group ? ", worker in the group" : "")) {
      std::vector<std::string> args = kTiny;
      if (c.group_access) args.push_back("--group-access");
      // The server child inherits the group, real and effective: with only
      // the effective one changed it would run in secure-execution mode,
      // where the loader ignores $ORIGIN in DT_RPATH (the GPU check's
      // prebuilt tree finds its libraries so).
      BOOST_REQUIRE(::setregid(gid, gid) == 0);
      std::optional<test::ServerProcess> server;
      try {
        server.emplace(test::unique_name("denied"), args);
      } catch (...) {
        BOOST_REQUIRE(::setregid(0, 0) == 0);
        throw;
      }
      BOOST_REQUIRE(::setregid(0, 0) == 0);
      const std::string object = shm::segment_object_name(server->name());
      BOOST_REQUIRE(stat_of(object).st_gid == gid);
      SharedText message;
      auto child = test::Process::fork_fn([&] {
        const gid_t extra[] = {gid};
        if (::setgid(kNogroup) != 0 || ::setgroups(c.worker_in_group ? 1 : 0, extra) != 0 || ::setuid(kNobody) != 0)
          return 90;
        WorkerOptions o;
        o.name = server->name();
        auto w = Worker::connect(o);
        message.set(w.ok() ? std::string("connected") : w.status().to_string());
        if (w.ok()) return 0;
        return w.status().code() == ErrorCode::kPermission ? 1 : 2;
      });
      const int rc = child.wait(10s);
      const std::string text = message.text;
      if (c.tail.empty()) {
        BOOST_TEST(rc == 0, "the fix did not let the worker in: " << text);
        continue;
      }
      BOOST_TEST(rc == 1, text);
      BOOST_TEST(text == "permission: open /dev/shm/" + object +
                             " read-write: permission denied (errno 13): owner root:" + group + ", mode " +
                             (c.group_access ? "0660" : "0600") + "; this process runs as nobody" + c.tail);
      BOOST_TEST(text.find("Permission denied") == std::string::npos, "doubled: " << text);
    }
  }
}

BOOST_AUTO_TEST_CASE(name_held_by_another_user_is_never_adopted) {
  if (!is_root()) {
    BOOST_TEST_MESSAGE("skipped: needs root to create an object as another user (nobody)");
    return;
  }
  const std::string name = test::unique_name("foreign");
  const std::string object = shm::segment_object_name(name);
  // As garbage, as a stale-looking shmps segment of a dead server, and empty.
  for (const size_t size : {size_t{8192}, size_t{8192 + 1}, size_t{0}}) {
    const bool looks_like_ours = size == 8192 + 1;
    BOOST_TEST_CONTEXT((size == 0 ? "an empty object" : looks_like_ours ? "a shmps-looking segment" : "garbage")) {
      auto creator = test::Process::fork_fn([&] {
        if (!become_nobody()) return 90;
        if (size == 0) {
          const int fd = ::shm_open(object.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
          return fd >= 0 && ::close(fd) == 0 ? 0 : 92;
        }
        auto obj = shm::ShmObject::create(object, size, 0600);
        if (!obj.ok()) return 91;
        std::memset((*obj)->data(), 0x5a, size);
        if (looks_like_ours)
          std::memcpy((*obj)->data(), &shm::kMagic, sizeof shm::kMagic);  // server pid 0x5a5a5a5a: dead
        return 0;
      });
      BOOST_REQUIRE_EQUAL(creator.wait(10s), 0);
      const auto run = test::run_captured({test::program_path("shmps-server"), "--name", name, "--tensor", "w:4"});
      BOOST_TEST(run.exit_code == 1, run.output);
      BOOST_TEST(run.output.find("/dev/shm/" + object + " (owner nobody:nogroup, mode 0600) belongs to another user") !=
                     std::string::npos,
                 run.output);
      BOOST_TEST(run.output.find("sudo rm /dev/shm/" + object) != std::string::npos, run.output);
      const struct stat st = stat_of(object);
      BOOST_TEST(st.st_uid == kNobody);  // still theirs, untouched
      BOOST_TEST(static_cast<size_t>(st.st_size) == size);
      shm::ShmObject::remove(object);
    }
  }
}

// An object of the server's own user at the name, in each shape a server
// that died leaves it (empty: it died between creating and sizing it;
// sized with its header not written yet; a header naming no process; a
// whole segment of a dead server): while a live process holds its lock
// (a server starting or serving under the name holds it from creating the
// object to its exit) a start refuses it and leaves it alone; once that
// process is gone, the next start replaces it at once.
BOOST_AUTO_TEST_CASE(own_object_is_replaced_once_no_live_process_holds_its_lock) {
  const std::string name = test::unique_name("leftover");
  const std::string object = shm::segment_object_name(name);
  const std::string path = "/dev/shm/" + object;
  struct Shape {
    const char* what;
    size_t bytes;
    uint64_t magic;
    uint32_t pid;
  };
  for (const Shape& shape :
       {Shape{"empty", 0, 0, 0}, Shape{"unwritten", 8192, 0, 0}, Shape{"no process", 8192, shm::kMagic, 0},
        Shape{"dead server", 8192, shm::kMagic, 0x5a5a5a5a}}) {
    BOOST_TEST_CONTEXT(shape.what) {
      const int fd = ::shm_open(object.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      BOOST_REQUIRE(fd >= 0);
      if (shape.bytes != 0) {
        BOOST_REQUIRE(::ftruncate(fd, static_cast<off_t>(shape.bytes)) == 0);
        shm::SegmentHeader h{};
        h.magic = shape.magic;
        h.server_pid = shape.pid;
        h.server_start_time = 1;  // no process started at tick 1
        BOOST_REQUIRE(::pwrite(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h));
      }
      ::close(fd);
      // A process holding the object's lock, as a starting server does.
      auto holder = test::Process::fork_fn([&] {
        const int held = ::shm_open(object.c_str(), O_RDONLY, 0);
        if (held < 0 || ::flock(held, LOCK_EX) != 0) return 2;
        for (;;) ::pause();
      });
      BOOST_REQUIRE(test::eventually([&] {
        const int probe = ::shm_open(object.c_str(), O_RDONLY, 0);
        const bool busy = ::flock(probe, LOCK_EX | LOCK_NB) != 0;
        ::close(probe);
        return busy;
      }));
      const auto refused = test::run_captured({test::program_path("shmps-server"), "--name", name, "--tensor", "w:4"});
      BOOST_TEST(refused.exit_code == 1, refused.output);
      BOOST_TEST(refused.output.find("another shmps-server is starting under '" + name + "': " + path + " (owner " +
                                     shm::owner_text(::geteuid(), ::getegid()) +
                                     ", mode 0600) is locked by a live process; not replacing it") != std::string::npos,
                 refused.output);
      BOOST_TEST(stat_of(object).st_size == static_cast<off_t>(shape.bytes));  // left alone
      holder.kill_and_reap();
      test::ServerProcess server(name, kTiny);
      BOOST_TEST(stat_of(object).st_size > static_cast<off_t>(shape.bytes));
      BOOST_TEST(connect(name)->ping().ok());
    }
  }
}

// Servers started under one name at the same moment: exactly one serves,
// the others exit with a clear refusal, and the one serving is the one
// whose segment is at the name (none is left serving an object that
// another removed as a dead start's).
BOOST_AUTO_TEST_CASE(servers_started_at_once_under_one_name_leave_exactly_one_serving) {
  const std::string server_bin = test::program_path("shmps-server");
  for (int round = 0; round < 10; ++round) {
    BOOST_TEST_CONTEXT("round " << round) {
      const std::string name = test::unique_name("race");
      std::vector<test::Process> servers;
      for (int k = 0; k < 3; ++k)
        // A large segment (100 MiB): its sizing takes long enough for the
        // others to find it unwritten.
        servers.push_back(test::Process::spawn({server_bin, "--name", name, "--tensor", "w:4", "--max-workers", "256",
                                                "--ring-capacity", "2048", "--log-level", "error"}));
      std::vector<int> codes(servers.size(), -2);
      BOOST_REQUIRE(test::eventually([&] {
        size_t exited = 0;
        for (size_t k = 0; k < servers.size(); ++k) {
          if (int c = 0; codes[k] == -2 && servers[k].try_wait(&c)) codes[k] = c;
          exited += codes[k] != -2 ? 1 : 0;
        }
        return exited == servers.size() - 1;
      }));
      size_t running = servers.size();
      for (size_t k = 0; k < servers.size(); ++k)
        if (codes[k] != -2) {
          BOOST_TEST(codes[k] == 1);
        } else {
          running = k;
        }
      BOOST_REQUIRE(running < servers.size());
      BOOST_REQUIRE(test::eventually([&] {
        auto seg = shm::Segment::open(name, /*read_only=*/true);
        return seg.ok() && (*seg)->header().server_pid == static_cast<uint32_t>(servers[running].pid());
      }));
      BOOST_TEST(connect(name)->ping().ok());
      servers[running].signal(SIGTERM);
      BOOST_TEST(servers[running].wait(std::chrono::seconds(10)) == 0);
    }
  }
}

// A shmps-server run by another user (nobody), as an attacker on the host
// would run one to answer the attach: a root worker attaches only when told
// that user runs its server (WorkerOptions::server_user), and never to a
// segment that is world-writable or group-accessible without
// --group-access. Every refusal names the owner, the mode and the fix, and
// creates nothing.
BOOST_AUTO_TEST_CASE(worker_attaches_only_to_a_segment_it_trusts) {
  if (!is_root()) {
    BOOST_TEST_MESSAGE("skipped: needs root to run a server as another user (nobody)");
    return;
  }
  const std::string name = test::unique_name("planted");
  const std::string object = shm::segment_object_name(name);
  const std::string path = "/dev/shm/" + object;
  const std::string server = test::program_path("shmps-server");
  auto intruder = test::Process::fork_fn([&] {
    if (!become_nobody()) return 90;
    ::execl(server.c_str(), server.c_str(), "--name", name.c_str(), "--tensor", "w:4", static_cast<char*>(nullptr));
    return 91;
  });
  struct Unlink {
    std::string object;
    ~Unlink() { shm::ShmObject::remove(object); }
  } unlink{object};
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return shm::Segment::open(name, /*read_only=*/true).ok(); }),
                        "the server run as nobody did not publish " << path);
  BOOST_REQUIRE(stat_of(object).st_uid == kNobody);

  struct Case {
    mode_t mode;
    std::string server_user;
    ErrorCode code;  // kOk: attaches
    std::string says;
  };
  const std::string untrusted =
      path + " (owner nobody:nogroup, mode 0600) is not owned by a user this worker trusts (root";
  for (const Case& c : std::vector<Case>{
           {0600, "", ErrorCode::kPermission, untrusted},
           {0666, "", ErrorCode::kPermission, "(owner nobody:nogroup, mode 0666) is not owned by a user"},
           {0666, "nobody", ErrorCode::kPermission, "(owner nobody:nogroup, mode 0666) is world-writable"},
           {0640, "nobody", ErrorCode::kPermission, "gives its group access, but its server was not started with"},
           {0600, "no_such_user_shmps", ErrorCode::kInvalidArgument, "'no_such_user_shmps': no such user"},
           {0600, "nobody", ErrorCode::kOk, ""},
           {0600, "65534", ErrorCode::kOk, ""}}) {
    BOOST_TEST_CONTEXT("mode 0" << std::oct << c.mode << std::dec << ", server_user '" << c.server_user << "'") {
      BOOST_REQUIRE(::chmod(path.c_str(), c.mode) == 0);
      WorkerOptions o;
      o.name = name;
      o.server_user = c.server_user;
      o.timeout = 5s;
      auto w = Worker::connect(o);
      BOOST_TEST((w.status().code() == c.code), w.status().to_string());
      if (c.code == ErrorCode::kOk) {
        if (w.ok()) BOOST_TEST((*w)->ping().ok());
        continue;
      }
      const std::string text = w.status().message();
      BOOST_TEST(text.find(c.says) != std::string::npos, text);
      if (c.code == ErrorCode::kPermission) {
        BOOST_TEST(text.find("sudo rm " + path) != std::string::npos, text);
        if (c.server_user.empty())
          BOOST_TEST(text.find("name it in WorkerOptions::server_user") != std::string::npos, text);
      }
      BOOST_TEST(buffer_objects(name).empty());
    }
  }
  // An empty object of an untrusted user is refused at once, not waited for
  // as a server still starting.
  intruder.kill_and_reap();
  shm::ShmObject::remove(object);
  auto planter = test::Process::fork_fn([&] {
    if (!become_nobody()) return 90;
    const int fd = ::shm_open(object.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    return fd >= 0 && ::close(fd) == 0 ? 0 : 92;
  });
  BOOST_REQUIRE_EQUAL(planter.wait(10s), 0);
  WorkerOptions o;
  o.name = name;
  auto w = Worker::connect(o);
  BOOST_TEST((w.status().code() == ErrorCode::kPermission), w.status().to_string());
  BOOST_TEST(w.status().message().find(untrusted) != std::string::npos, w.status().to_string());
}

// /dev/shm is sticky: a server running as another user than its worker may
// not remove the buffer objects of a worker that died. It says so once per
// object (its sweep runs every second), and the next worker of that user
// removes them as it attaches.
BOOST_AUTO_TEST_CASE(a_dead_workers_buffers_the_server_may_not_remove_go_with_the_next_worker_of_their_user) {
  if (!is_root()) {
    BOOST_TEST_MESSAGE("skipped: needs root to run the server as another user (nobody) than its worker");
    return;
  }
  const std::string name = test::unique_name("orphan");
  const std::string object = shm::segment_object_name(name);
  const std::string server = test::program_path("shmps-server");
  const std::string log_path = "/tmp/" + name + ".log";
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  BOOST_REQUIRE(log_fd >= 0);
  struct Cleanup {
    std::string name, object, log;
    ~Cleanup() {  // whatever a failed check left behind too
      for (const std::string& b : buffer_objects(name)) shm::ShmObject::remove(b);
      shm::ShmObject::remove(object);
      ::unlink(log.c_str());
    }
  } cleanup{name, object, log_path};
  // Buffers of the root worker are 0660 with the segment's group, nogroup:
  // the server, nobody, may open them, and not remove them.
  auto server_process = test::Process::fork_fn([&] {
    if (::dup2(log_fd, STDERR_FILENO) < 0 || !become_nobody()) return 90;
    ::execl(server.c_str(), server.c_str(), "--name", name.c_str(), "--tensor", "w:4", "--group-access",
            static_cast<char*>(nullptr));
    return 91;
  });
  ::close(log_fd);
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return shm::Segment::open(name, /*read_only=*/true).ok(); }),
                        "the server run as nobody did not publish /dev/shm/" << object);
  WorkerOptions o;
  o.name = name;
  o.server_user = "nobody";
  o.timeout = 5s;
  auto worker = test::Process::fork_fn([&] {
    auto w = Worker::connect(o);
    if (!w.ok()) return 92;
    for (int i = 0; i < 6; ++i)  // more than a sweep's line names: the rest by the next sweep
      if (!(*w)->register_buffer(64).ok()) return 93;
    ::pause();
    return 0;
  });
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return buffer_objects(name).size() == 6; }),
                        "the worker did not register its 6 buffers");
  worker.kill_and_reap();
  // The objects named in the log as not removable (a sweep's line names
  // each with its owner).
  const auto warnings = [&] {
    std::istringstream log(test::read_file(log_path));
    size_t n = 0;
    for (std::string line; std::getline(log, line);) {
      if (line.find("cannot remove ") == std::string::npos) continue;
      for (size_t at = line.find(" (owner "); at != std::string::npos; at = line.find(" (owner ", at + 1)) ++n;
    }
    return n;
  };
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return warnings() == 6; }), test::read_file(log_path));
  std::this_thread::sleep_for(2500ms);  // two more sweeps: said once per object, and nothing removed
  BOOST_TEST(warnings() == 6u, test::read_file(log_path));
  BOOST_TEST(buffer_objects(name).size() == 6u);
  const std::string log = test::read_file(log_path);
  BOOST_TEST(log.find("(owner root:nogroup, mode 0660): Permission denied (errno 13); /dev/shm is sticky: only an "
                      "object's owner (or root) may remove it. A worker of that user removes it as it attaches to '" +
                      name + "'") != std::string::npos,
             log);
  BOOST_TEST(log.find("info: removed ") == std::string::npos, log);
  // Another user's worker's death (a sweep of its pid alone) is said once
  // too, and the first one's objects are not said again. (daemon, uid 1, in
  // the segment's group; a root worker would remove root's dead objects.)
  auto second = test::Process::fork_fn([&] {
    const gid_t groups[] = {kNogroup};
    if (::setgroups(1, groups) != 0 || ::setgid(1) != 0 || ::setuid(1) != 0) return 90;
    auto w = Worker::connect(o);
    if (!w.ok() || !(*w)->register_buffer(64).ok()) return 92;
    ::pause();
    return 0;
  });
  BOOST_REQUIRE(test::eventually([&] { return buffer_objects(name).size() == 7; }));
  second.kill_and_reap();
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return warnings() == 7; }), test::read_file(log_path));
  std::this_thread::sleep_for(2500ms);
  BOOST_TEST(warnings() == 7u, test::read_file(log_path));
  // The next root worker removes root's, and leaves daemon's to daemon.
  auto next = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(next.ok(), next.status().to_string());
  const std::vector<std::string> left = buffer_objects(name);
  BOOST_REQUIRE_EQUAL(left.size(), 1u);
  BOOST_TEST(stat_of(left[0]).st_uid == 1u);
  shm::ShmObject::remove(left[0]);
  next.value().reset();
  server_process.signal(SIGTERM);
  BOOST_TEST(server_process.wait(10s) == 0);
}

BOOST_AUTO_TEST_CASE(workers_never_create_the_control_segment) {
  const std::string name = test::unique_name("absent");
  WorkerOptions o;
  o.name = name;
  auto w = Worker::connect(o);
  BOOST_TEST((w.status().code() == ErrorCode::kServerNotRunning), w.status().to_string());
  BOOST_TEST(w.status().message().find("/dev/shm/" + shm::segment_object_name(name)) != std::string::npos);
  for (const bool read_only : {true, false}) {
    auto seg = shm::Segment::open(name, read_only);
    BOOST_TEST((seg.status().code() == ErrorCode::kServerNotRunning));
  }
  BOOST_TEST(!std::filesystem::exists("/dev/shm/" + shm::segment_object_name(name)));
}

BOOST_AUTO_TEST_CASE(object_names_are_validated) {
  // The longest name validate_name() takes (the limit lives there).
  size_t longest = 0;
  while (shm::validate_name(std::string(longest + 1, 'n')).ok()) ++longest;
  BOOST_TEST_MESSAGE("longest name: " << longest << " characters");
  BOOST_REQUIRE(longest >= 16);
  const std::string server = test::program_path("shmps-server");
  const std::vector<std::string> bad_names = {"a/b", "../x", std::string(longest + 1, 'n'), ".hidden", "sp ace", ""};
  for (const std::string& bad : bad_names) {
    BOOST_TEST_CONTEXT("name '" << bad << "'") {
      const auto run = test::run_captured({server, "--name", bad, "--tensor", "w:4"});
      BOOST_TEST(run.exit_code != 0);
      BOOST_TEST(run.output.find("name") != std::string::npos, run.output);
      BOOST_TEST(!std::filesystem::exists("/dev/shm/shmps." + bad));
      WorkerOptions o;
      o.name = bad;
      BOOST_TEST((Worker::connect(o).status().code() == ErrorCode::kInvalidArgument));
    }
  }
  // The longest name works end to end, buffer object names
  // ("shmps.<name>.p<pid>.<n>") included, past the tenth buffer.
  std::string name = test::unique_name("longest");
  name.resize(longest, 'n');
  test::ServerProcess server_process(name, kTiny);
  auto w = connect(name);
  for (int i = 0; i < 12; ++i) {
    auto buf = w->register_buffer(16);
    BOOST_TEST_REQUIRE(buf.ok(), "buffer " << i << ": " << buf.status().to_string());
  }
}

// The server maps a buffer only under a name of the requesting worker: a
// worker that writes another worker's pid into its owner word must not get
// that worker's buffer mapped for itself (and pull weights into it).
BOOST_AUTO_TEST_CASE(forged_owner_pid_does_not_lend_another_workers_buffer) {
  test::ServerProcess server(test::unique_name("borrow"),
                             {"--tensor", "w:4", "--init", "uniform", "--init-scale", "1"});
  auto victim = connect(server.name());
  auto buf = victim->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 4, 42.0f);
  const auto objects = buffer_objects(server.name());
  BOOST_REQUIRE_EQUAL(objects.size(), 1u);
  const std::string victims_object = objects[0];
  SharedText message;
  auto thief = test::Process::fork_fn([&] {
    test::RawClient raw(server.name());
    try {
      shm::BufferDesc& d = raw.segment().buffer(raw.id(), 0);
      std::memset(&d, 0, sizeof d);
      d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
      d.length = 16;
      std::memcpy(d.handle, victims_object.c_str(), victims_object.size() + 1);
      raw.entry().owner.store(shm::make_owner(static_cast<uint32_t>(::getppid()), shm::WorkerState::kAttached));
      const shm::Completion reg = raw.call(raw.request(shm::Opcode::kRegisterBuffer), 2s);
      message.set(std::string("register: code ") + std::to_string(reg.code) + " " + reg.message);
      if (reg.code != 0) return 0;
      shm::Request pull = raw.request(shm::Opcode::kPull);
      pull.tensor_id = 0;
      pull.byte_length = 16;
      (void)raw.call(pull, 2s);
      return 1;
    } catch (const std::exception& e) {  // unanswered: our entry was reaped first (not lent either)
      message.set(e.what());
      return 0;
    }
  });
  BOOST_TEST(thief.wait(10s) == 0, message.text);
  BOOST_TEST(static_cast<const float*>(buf->data)[0] == 42.0f, "the victim's buffer was overwritten");
  BOOST_TEST(victim->ping().ok());
}

BOOST_AUTO_TEST_SUITE_END()
