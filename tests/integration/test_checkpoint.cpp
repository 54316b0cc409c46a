// Checkpoints and restart: periodic and final checkpoints, the newest K
// kept, restore of weights + optimizer state + steps + version, a corrupt
// or truncated newest checkpoint skipped for the previous one, a
// checkpoint of another model refused, and the file format's own checks.
#define BOOST_TEST_MODULE test_checkpoint
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace k = shmps::kernels;

namespace {

// The files in `dir` but the server's lock (kCheckpointLockName).
std::vector<std::string> checkpoint_files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != ".lock") names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string ckpt_name(uint64_t version) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "ckpt-%020llu.shmps", static_cast<unsigned long long>(version));
  return buf;
}

using test::connect;

// The Adam model of these tests: tensors a:2x2, b:3.
std::vector<std::string> adam_args(const fs::path& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--tensor",    "a:2x2", "--tensor",         "b:3",       "--optimizer", "adam",
                                "--lr",        "0.01",  "--max-staleness",  "1000",      "--init",      "uniform",
                                "--init-seed", "3",     "--checkpoint-dir", dir.string()};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

float grad_value(int step, uint64_t i) { return std::cos(static_cast<float>(step * 7 + i)) * 0.3f; }

// Pushes steps [first, last) of the gradient sequence as flat pushes.
void push_steps(Worker& w, const Buffer& g, int first, int last) {
  float* p = static_cast<float*>(g.data);
  for (int s = first; s < last; ++s) {
    for (uint64_t i = 0; i < 7; ++i) p[i] = grad_value(s, i);
    auto v = w.push(kAllTensors, g.id, 0, 28, Dtype::kF32, static_cast<uint64_t>(s));
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  }
}

std::vector<float> pull(Worker& w, const Buffer& b, uint64_t* version) {
  auto v = w.pull(kAllTensors, b.id, 0);
  BOOST_REQUIRE(v.ok());
  *version = *v;
  const float* p = static_cast<const float*>(b.data);
  return {p, p + 7};
}

// A server of `args` takes steps [first, last) from one worker and stops
// cleanly (its final checkpoint).
void run_steps(const std::string& name, const std::vector<std::string>& args, int first, int last) {
  test::ServerProcess server(name, args);
  auto w = connect(name);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, first, last);
  w.reset();
  BOOST_TEST(server.stop() == 0);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// shmps-server --name <name> <args> with its stderr in `log`; returns once
// a worker can attach (into *w). For tests that read the server's log.
test::Process spawn_logged(const std::string& name, const std::vector<std::string>& args, const fs::path& log,
                           std::unique_ptr<Worker>* w) {
  std::string command = "exec " + test::program_path("shmps-server") + " --name " + name;
  for (const std::string& a : args) command += " '" + a + "'";
  command += " 2>" + log.string();
  test::Process p = test::Process::spawn({"/bin/sh", "-c", command});
  BOOST_REQUIRE(test::eventually([&] { return (*w = test::try_connect(name, 1s)) != nullptr; }, 10s));
  return p;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(checkpoint)

BOOST_AUTO_TEST_CASE(periodic_and_final_checkpoints_keep_the_newest_k) {
  test::TempDir dir("ckpt");
  test::ServerProcess server(test::unique_name("every"),
                             adam_args(dir.path, {"--checkpoint-every", "5", "--checkpoint-keep", "2"}));
  auto w = connect(server.name());
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, 4);
  BOOST_TEST(checkpoint_files(dir.path).empty());
  push_steps(*w, *g, 4, 5);
  BOOST_TEST(
      test::eventually([&] { return checkpoint_files(dir.path) == std::vector<std::string>{ckpt_name(5)}; }, 5s));
  push_steps(*w, *g, 5, 12);
  // The second lands at 10, or a little later if the writer was still busy.
  BOOST_TEST(test::eventually(
      [&] {
        const auto files = checkpoint_files(dir.path);
        return files.size() == 2 && files[0] == ckpt_name(5) && files[1] >= ckpt_name(10);
      },
      5s));
  w.reset();
  BOOST_TEST(server.stop() == 0);
  const auto files = checkpoint_files(dir.path);
  BOOST_TEST(files.size() == 2u);
  BOOST_TEST(files.back() == ckpt_name(12));  // the final one; only the newest 2 kept
}

BOOST_AUTO_TEST_CASE(restart_restores_weights_optimizer_state_and_version) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("restore");
  std::vector<float> before;
  {
    test::ServerProcess server(name, adam_args(dir.path));
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    push_steps(*w, *g, 0, 3);
    uint64_t v = 0;
    before = pull(*w, *g, &v);
    BOOST_TEST(v == 3u);
    w.reset();
    BOOST_TEST(server.stop() == 0);  // final checkpoint at version 3
  }
  test::ServerProcess server(name, adam_args(dir.path));
  auto w = connect(name);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  uint64_t v = 0;
  BOOST_TEST(pull(*w, *g, &v) == before);
  BOOST_TEST(v == 3u);
  push_steps(*w, *g, 3, 5);
  const std::vector<float> after = pull(*w, *g, &v);
  BOOST_TEST(v == 5u);

  // Reference: five uninterrupted steps (Adam's moments and step count must
  // have survived the restart for these to match).
  std::vector<float> ref(7);
  {
    test::ServerProcess fresh(test::unique_name("ref"), adam_args(dir.path / "ref"));
    auto r = connect(fresh.name());
    auto rg = r->register_buffer(28);
    BOOST_REQUIRE(rg.ok());
    push_steps(*r, *rg, 0, 5);
    ref = pull(*r, *rg, &v);
  }
  for (size_t i = 0; i < 7; ++i) BOOST_TEST(after[i] == ref[i], "element " << i);
}

BOOST_AUTO_TEST_CASE(corrupt_or_truncated_newest_checkpoint_falls_back_to_the_previous) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("corrupt");
  std::vector<float> at_four;
  {
    test::ServerProcess server(name, adam_args(dir.path, {"--checkpoint-every", "4", "--checkpoint-keep", "5"}));
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    push_steps(*w, *g, 0, 4);
    uint64_t v = 0;
    at_four = pull(*w, *g, &v);
    BOOST_REQUIRE(test::eventually([&] { return fs::exists(dir.path / ckpt_name(4)); }));
    push_steps(*w, *g, 4, 6);
    w.reset();
    BOOST_TEST(server.stop() == 0);
  }
  const fs::path newest = dir.path / ckpt_name(6);
  BOOST_REQUIRE(fs::exists(newest));
  const std::string good = read_text(newest);
  // Newest: one flipped payload byte (checksum). Then truncated.
  std::string flipped;
  for (const char* damage : {"flip", "truncate"}) {
    BOOST_TEST_CONTEXT(damage) {
      const bool flip = std::string(damage) == "flip";
      std::string bytes = good;
      if (flip)
        bytes[64 + 2 * 112 + 8] = '\x7f';
      else
        bytes.resize(bytes.size() - 10);
      std::ofstream(newest, std::ios::binary | std::ios::trunc) << bytes;
      test::ServerProcess server(name, adam_args(dir.path, {"--checkpoint-keep", "5"}));
      auto w = connect(name);
      auto g = w->register_buffer(28);
      BOOST_REQUIRE(g.ok());
      uint64_t v = 0;
      BOOST_TEST(pull(*w, *g, &v) == at_four);
      BOOST_TEST(v == 4u);
      w.reset();
      // No update since the restore: the final checkpoint is not rewritten.
      BOOST_TEST(server.stop() == 0);
      // Set aside as it was, under a name no restore or pruning takes;
      // the second beside the first, which it does not replace.
      BOOST_TEST(!fs::exists(newest));
      BOOST_TEST(read_text(newest.string() + (flip ? ".damaged" : ".damaged.1")) == bytes);
      if (flip) flipped = bytes;
    }
  }
  BOOST_TEST(read_text(newest.string() + ".damaged") == flipped);
}

// A damaged newest checkpoint is set aside at the start, so that the
// newest --checkpoint-keep that pruning keeps are valid ones: with keep 2,
// files 4 (valid) and 6 (damaged), a restart that restores 4 and stops at
// version 10 keeps 4 and 10. Pruning that counted the damaged file (its
// header reads as this model's) kept 6 and 10 and deleted the only
// valid fallback.
BOOST_AUTO_TEST_CASE(a_damaged_checkpoint_is_set_aside_and_not_counted_by_keep) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("aside");
  run_steps(name, adam_args(dir.path, {"--checkpoint-every", "4", "--checkpoint-keep", "5"}), 0, 6);
  BOOST_REQUIRE((checkpoint_files(dir.path) == std::vector<std::string>{ckpt_name(4), ckpt_name(6)}));
  {
    std::fstream f(dir.path / ckpt_name(6), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 2 * 112 + 8);
    f.put('\x7f');
  }
  const fs::path log = dir.path / "server.log";
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, adam_args(dir.path, {"--checkpoint-keep", "2"}), log, &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 4, 10);
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  BOOST_TEST((checkpoint_files(dir.path) ==
              std::vector<std::string>{ckpt_name(4), ckpt_name(6) + ".damaged", ckpt_name(10), "server.log"}));
  const std::string text = read_text(log);
  BOOST_TEST(text.find("checksum mismatch; renamed to " + (dir.path / ckpt_name(6)).string() + ".damaged") !=
                 std::string::npos,
             text);
}

BOOST_AUTO_TEST_CASE(checkpoint_of_another_model_is_not_restored) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("other");
  run_steps(name, adam_args(dir.path), 0, 2);
  // Same tensors, other optimizer state layout (SGD without momentum).
  const fs::path log = dir.path / "server.log";
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(
      name, {"--tensor", "a:2x2", "--tensor", "b:3", "--optimizer", "sgd", "--checkpoint-dir", dir.path.string()}, log,
      &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  uint64_t v = 99;
  const std::vector<float> weights = pull(*w, *g, &v);
  BOOST_TEST(v == 0u);
  for (float x : weights) BOOST_TEST(x == 0.0f);  // --init zero, not the Adam run's weights
  // Both optimizers named; a fresh start over refused files is a warning.
  const std::string text = read_text(log);
  BOOST_TEST(text.find("(adam with 2 state array(s) in the file, sgd with 0 state array(s) in this server") !=
                 std::string::npos,
             text);
  BOOST_TEST(text.find("warn: none of the 1 checkpoint(s) in " + dir.path.string() + " could be restored") !=
                 std::string::npos,
             text);
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

BOOST_AUTO_TEST_CASE(a_failed_periodic_write_does_not_stand_for_the_final_checkpoint) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("failed");
  const fs::path log = dir.path / "server.log";
  // A directory where the writer's temp file for version 6 goes: it can
  // neither remove it nor create its file (EISDIR), as on a full or
  // read-only disk.
  const fs::path blocker = dir.path / ("." + ckpt_name(6) + ".tmp");
  fs::create_directory(blocker);
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, adam_args(dir.path, {"--checkpoint-every", "3"}), log, &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, 3);
  BOOST_REQUIRE(test::eventually([&] { return fs::exists(dir.path / ckpt_name(3)); }, 10s));
  push_steps(*w, *g, 3, 6);
  BOOST_REQUIRE(
      test::eventually([&] { return read_text(log).find("checkpoint: cannot remove") != std::string::npos; }, 10s));
  fs::remove(blocker);  // the disk is fine again
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  // Before: the failed write at 6 counted as done, so the stop wrote no
  // final checkpoint, and a restart went back to 3.
  BOOST_TEST(fs::exists(dir.path / ckpt_name(6)), read_text(log));
}

// A write that fails (every version's temp name blocked, as on a full
// disk) is not tried again at every push: the next try waits 1 s, then
// 2 s, ... (each try may fill the disk before it fails, and logs). Once
// the disk is fine the current version is written after the pause
// without another push. Before: 40 pushes made 40 failed tries, and
// nothing was written until the next push.
BOOST_AUTO_TEST_CASE(a_failing_write_is_tried_again_after_a_pause_not_at_every_push) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("retry");
  const fs::path log = dir.path / "server.log";
  constexpr int kPushes = 40;
  for (int v = 1; v <= kPushes; ++v) fs::create_directory(dir.path / ("." + ckpt_name(v) + ".tmp"));
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, adam_args(dir.path, {"--checkpoint-every", "1"}), log, &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, kPushes);
  auto view = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(view.ok(), view.status().to_string());
  const auto failed_tries = [&] { return (*view)->stats().checkpoint_failures.load(std::memory_order_relaxed); };
  BOOST_REQUIRE(test::eventually([&] { return failed_tries() >= 1; }));
  const uint64_t failures = failed_tries();
  // 1 + log2 of the seconds the pushes took, even on a slow machine.
  BOOST_TEST(failures <= 6u, failures << " failed tries: " << read_text(log));
  BOOST_TEST(read_text(log).find("; trying again in 1 s") != std::string::npos, read_text(log));
  for (int v = 1; v <= kPushes; ++v) fs::remove(dir.path / ("." + ckpt_name(v) + ".tmp"));
  BOOST_TEST(test::eventually([&] { return fs::exists(dir.path / ckpt_name(kPushes)); }, 150s), read_text(log));
  w.reset();
  view->reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

// The directory moved away and another made at its path while the server
// runs (mv D D.old; mkdir D): the server's lock guards D.old, so another
// server could lock the new D and both would write and prune there. The
// server writes nothing into the new D (a periodic write and the final
// one fail, naming the cause; the exit code says the state was not saved),
// and D.old keeps what it wrote before.
BOOST_AUTO_TEST_CASE(a_checkpoint_directory_moved_away_under_the_server_is_not_written_again) {
  test::TempDir dir("ckpt");
  const fs::path d = dir.path / "d", moved = dir.path / "d.old";
  fs::create_directory(d);
  const std::string name = test::unique_name("moved");
  const fs::path log = dir.path / "server.log";
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, adam_args(d, {"--checkpoint-every", "2"}), log, &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, 2);
  BOOST_REQUIRE(test::eventually([&] { return fs::exists(d / ckpt_name(2)); }, 10s));
  fs::rename(d, moved);
  fs::create_directory(d);
  push_steps(*w, *g, 2, 4);
  BOOST_TEST(
      test::eventually(
          [&] { return read_text(log).find("is not the one this server locked at start") != std::string::npos; }, 10s),
      read_text(log));
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 1);
  BOOST_TEST(fs::is_empty(d), read_text(log));
  BOOST_TEST((checkpoint_files(moved) == std::vector<std::string>{ckpt_name(2)}));
}

// The checkpoint directory is the server's alone: the directories it
// creates are 0700 whatever the umask (the unit's UMask=0007 would make
// them writable by the workers' group, who could delete or plant
// checkpoints); an existing one others may write is warned of; a file of
// another user is not restored.
BOOST_AUTO_TEST_CASE(checkpoints_are_the_servers_alone) {
  test::TempDir dir("ckpt");
  const fs::path d = dir.path / "new" / "job";  // both made by the server
  const std::string name = test::unique_name("own");
  const mode_t umask_before = ::umask(0007);
  run_steps(name, adam_args(d), 0, 2);
  ::umask(umask_before);
  for (const fs::path& made : {d, d.parent_path()}) {
    struct stat st {};
    BOOST_REQUIRE(::stat(made.c_str(), &st) == 0);
    BOOST_TEST((st.st_mode & 07777) == 0700u, made);
  }
  BOOST_REQUIRE(fs::exists(d / ckpt_name(2)));

  BOOST_REQUIRE(::chmod(d.c_str(), 0770) == 0);
  const fs::path log = dir.path / "server.log";
  const bool root = ::geteuid() == 0;
  if (root) BOOST_REQUIRE(::chown((d / ckpt_name(2)).c_str(), 65534, 65534) == 0);  // nobody's
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, adam_args(d), log, &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  uint64_t v = 99;
  pull(*w, *g, &v);
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  const std::string text = read_text(log);
  BOOST_TEST(text.find("(mode 0770) can be written by its group or others") != std::string::npos, text);
  if (!root) {
    BOOST_TEST_MESSAGE("not root: a file of another user cannot be made here; that part is skipped");
    return;
  }
  BOOST_TEST(v == 0u);  // not restored
  BOOST_TEST(text.find("owned by uid 65534, not by this server's user (uid 0): not trusted") != std::string::npos,
             text);
}

// A trailing slash (or a doubled one, a "." component) names the same
// directory, which the server takes in one form: its parent that others
// may write is warned of as without them (the parent of ".../job/" was
// taken for ".../job" itself), and the log names the directory without
// them.
BOOST_AUTO_TEST_CASE(a_checkpoint_dir_with_a_trailing_slash_is_the_same_directory) {
  test::TempDir dir("ckpt");
  const fs::path parent = dir.path / "shared";
  fs::create_directory(parent);
  BOOST_REQUIRE(::chmod(parent.c_str(), 0777) == 0);  // not sticky
  const std::string name = test::unique_name("slash");
  const std::vector<std::pair<std::string, fs::path>> cases = {{parent.string() + "/job/", parent / "job"},
                                                               {parent.string() + "//./job2//", parent / "job2"}};
  for (const auto& [written, normal] : cases) {
    const fs::path log = dir.path / "server.log";
    std::unique_ptr<Worker> w;
    test::Process server = spawn_logged(name, adam_args(written), log, &w);
    w.reset();
    server.signal(SIGTERM);
    BOOST_TEST(server.wait(10s) == 0);
    const std::string text = read_text(log);
    BOOST_TEST_CONTEXT(written) {
      BOOST_TEST(text.find("--checkpoint-dir " + normal.string() + ": " + parent.string() +
                           " (mode 0777) can be written by its group or others") != std::string::npos,
                 text);
      BOOST_TEST(text.find("final checkpoint written: version 0 in " + normal.string() + "\n") != std::string::npos,
                 text);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_final_checkpoint_that_cannot_be_written_fails_the_exit_code) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("nofinal");
  const fs::path log = dir.path / "server.log";
  fs::create_directory(dir.path / ("." + ckpt_name(2) + ".tmp"));
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, adam_args(dir.path), log, &w);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, 2);
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 1);  // not 0: systemd and the operator must learn of it
  BOOST_TEST(read_text(log).find("final checkpoint: cannot remove") != std::string::npos, read_text(log));
}

// Under a file size limit (LimitFSIZE=, ulimit -f) SIGXFSZ does not end
// the server: a final checkpoint past the limit fails with EFBIG, naming
// the limit, and the server exits 1 after its shutdown (the segment and
// the temp file removed); a limit below the segment's size fails the
// start, naming it, and leaves no segment. SIGXFSZ's default action
// ended both with exit 153 and a stale segment.
BOOST_AUTO_TEST_CASE(a_file_size_limit_fails_the_final_checkpoint_not_the_process) {
  test::TempDir dir("ckpt");
  const fs::path d = dir.path / "d";
  const std::string name = test::unique_name("fsize");
  const std::string segment = "/dev/shm/" + shm::segment_object_name(name);
  // A segment of about 270 KiB, a checkpoint of 3 MiB (Adam: 3 floats a weight).
  const std::vector<std::string> args = {test::program_path("shmps-server"),
                                         "--name",
                                         name,
                                         "--tensor",
                                         "w:262144",
                                         "--optimizer",
                                         "adam",
                                         "--checkpoint-dir",
                                         d.string()};
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // In the child before its exec: the limit, with SIGXFSZ at its default
  // action and unblocked, as a service manager starts a unit.
  const auto limit_to = [](rlim_t bytes) {
    ::signal(SIGXFSZ, SIG_DFL);
    sigset_t xfsz;
    sigemptyset(&xfsz);
    sigaddset(&xfsz, SIGXFSZ);
    const rlimit limit{bytes, bytes};
    return ::sigprocmask(SIG_UNBLOCK, &xfsz, nullptr) == 0 && ::setrlimit(RLIMIT_FSIZE, &limit) == 0;
  };
  const fs::path log = dir.path / "server.log";
  test::Process server = test::Process::fork_fn([&] {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ::dup2(fd, STDERR_FILENO) < 0 || !limit_to(1 << 20)) return 126;
    ::execv(argv[0], argv.data());
    return 127;
  });
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return test::try_connect(name, 1s) != nullptr; }, 10s), read_text(log));
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 1, read_text(log));
  const std::string text = read_text(log);
  BOOST_TEST(text.find("final checkpoint: write " + d.string() + "/.ckpt-00000000000000000000.shmps.tmp (for " +
                       d.string() + "/" + ckpt_name(0) +
                       "): File too large; raise the server's file size limit (LimitFSIZE= in its unit, ulimit -f)") !=
                 std::string::npos,
             text);
  BOOST_TEST(checkpoint_files(d).empty());  // the temp file removed
  BOOST_TEST(!fs::exists(segment));

  const auto start = test::run_captured(args, 10s, [&] { return limit_to(64 << 10); });
  BOOST_TEST(start.exit_code == 1, start.output);
  BOOST_TEST(start.output.find("create shm object '" + shm::segment_object_name(name) + "': File too large") !=
                 std::string::npos,
             start.output);
  BOOST_TEST(start.output.find("; raise the process's file size limit (ulimit -f; LimitFSIZE= in a systemd unit)") !=
                 std::string::npos,
             start.output);
  BOOST_TEST(!fs::exists(segment));
}

BOOST_AUTO_TEST_CASE(a_huge_file_or_a_fifo_named_like_a_checkpoint_neither_stops_nor_hangs_the_start) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("fifo");
  const auto restored_version = [&] {
    test::ServerProcess server(name, adam_args(dir.path));  // throws if not up within 10 s
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    uint64_t v = 99;
    pull(*w, *g, &v);
    w.reset();
    BOOST_TEST(server.stop() == 0);
    return v;
  };
  run_steps(name, adam_args(dir.path), 0, 2);
  // A sparse file whose header says 2^33 parameters: skipped from its
  // header, never read or allocated for (its counts would cost gigabytes).
  std::string bytes = read_text(dir.path / ckpt_name(2));
  const uint64_t huge = uint64_t{1} << 33, version = 8;
  std::memcpy(bytes.data() + 16, &version, 8);  // CheckpointHeader::version
  std::memcpy(bytes.data() + 40, &huge, 8);     // CheckpointHeader::total_elements
  const fs::path big = dir.path / ckpt_name(8);
  std::ofstream(big, std::ios::binary) << bytes.substr(0, 64);
  fs::resize_file(big, 64 + 2 * 112 + huge * 3 * 4 + 4);
  BOOST_TEST(restored_version() == 2u);                                   // from the valid one below it
  BOOST_REQUIRE(::mkfifo((dir.path / ckpt_name(9)).c_str(), 0600) == 0);  // open() for reading would wait for ever
  BOOST_TEST(restored_version() == 2u);
  // A symbolic link named like a checkpoint is not followed, not even to a
  // valid checkpoint of this model: with nothing else there, the start is
  // a fresh one.
  fs::create_directory(dir.path / "away");
  fs::rename(dir.path / ckpt_name(2), dir.path / "away" / ckpt_name(2));
  fs::create_symlink(dir.path / "away" / ckpt_name(2), dir.path / ckpt_name(2));
  BOOST_TEST(restored_version() == 0u);
}

// A FIFO at the writer's temp name (left there by hand or by another
// program) would block its open for ever, and with it every later
// checkpoint and the stop: the writer removes whatever is at that name and
// creates its own file. The stats block counts the writes.
BOOST_AUTO_TEST_CASE(a_fifo_at_the_temp_name_blocks_neither_the_writer_nor_the_stop) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("tmpfifo");
  BOOST_REQUIRE(::mkfifo((dir.path / ("." + ckpt_name(3) + ".tmp")).c_str(), 0600) == 0);
  test::ServerProcess server(name, adam_args(dir.path, {"--checkpoint-every", "3"}));
  auto w = connect(name);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, 3);
  BOOST_TEST(test::eventually([&] { return fs::exists(dir.path / ckpt_name(3)); }, 10s));
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  BOOST_TEST(test::eventually([&] {
    return (*seg)->stats().checkpoints_written.load(std::memory_order_relaxed) == 1;  // relaxed: a statistic
  }));
  BOOST_TEST((*seg)->stats().checkpoint_failures.load(std::memory_order_relaxed) == 0u);  // relaxed: as above
  push_steps(*w, *g, 3, 4);
  w.reset();
  BOOST_TEST(server.stop() == 0);
  BOOST_TEST(fs::exists(dir.path / ckpt_name(4)));
}

// An empty file at a checkpoint's name holds nothing to lose: the writer
// replaces it (the restore skipped it as truncated).
BOOST_AUTO_TEST_CASE(an_empty_file_at_a_checkpoints_name_is_replaced) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("emptyckpt");
  std::ofstream(dir.path / ckpt_name(2)).flush();
  run_steps(name, adam_args(dir.path), 0, 2);  // its final checkpoint is version 2's
  BOOST_TEST(fs::file_size(dir.path / ckpt_name(2)) > 0u);
}

// An init changes the weights, not the version: a clean stop after it
// writes the final checkpoint even though that version is on disk, and
// the restart serves the init's weights.
BOOST_AUTO_TEST_CASE(an_init_is_in_the_final_checkpoint) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("initckpt");
  const std::vector<std::string> args = {"--tensor", "w:4", "--checkpoint-dir", dir.path.string()};
  run_steps(name, {"--tensor", "w:4", "--checkpoint-dir", dir.path.string(), "--optimizer", "sgd"}, 0, 0);
  {
    test::ServerProcess server(name, args);  // restores version 0
    auto w = connect(name);
    auto b = w->register_buffer(16);
    BOOST_REQUIRE(b.ok());
    std::fill_n(static_cast<float*>(b->data), 4, 7.0f);
    BOOST_REQUIRE(w->init(b->id, 0).ok());
    w.reset();
    BOOST_TEST(server.stop() == 0);
  }
  test::ServerProcess server(name, args);
  auto w = connect(name);
  auto b = w->register_buffer(16);
  BOOST_REQUIRE(b.ok());
  BOOST_REQUIRE(w->pull(kAllTensors, b->id, 0).ok());
  BOOST_TEST(static_cast<const float*>(b->data)[3] == 7.0f);
}

// A restart whose --init-file is gone (cleaned up after the first start)
// serves the restored checkpoint, with a warning; with no checkpoint to
// restore, the missing file stops the start.
BOOST_AUTO_TEST_CASE(an_init_file_gone_is_not_needed_when_a_checkpoint_is_restored) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("initgone");
  const fs::path init = dir.path / "init.bin";
  {
    std::ofstream out(init, std::ios::binary);
    const float values[7] = {1, 2, 3, 4, 5, 6, 7};
    out.write(reinterpret_cast<const char*>(values), sizeof values);
  }
  const fs::path ckpts = dir.path / "ckpts";
  std::vector<std::string> args = adam_args(ckpts, {"--init-file", init.string()});
  // The model of adam_args, started from the file instead of --init uniform.
  args.erase(std::find(args.begin(), args.end(), "--init"), std::find(args.begin(), args.end(), "--checkpoint-dir"));
  run_steps(name, args, 0, 3);
  fs::remove(init);
  const fs::path log = dir.path / "server.log";
  std::unique_ptr<Worker> w;
  test::Process server = spawn_logged(name, args, log, &w);
  auto b = w->register_buffer(28);
  BOOST_REQUIRE(b.ok());
  uint64_t version = 0;
  pull(*w, *b, &version);
  BOOST_TEST(version == 3u);
  BOOST_TEST(read_text(log).find("--init-file " + init.string()) != std::string::npos, read_text(log));
  BOOST_TEST(
      read_text(log).find("not needed: the weights and state are the restored checkpoint's") != std::string::npos,
      read_text(log));
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
  const auto none =
      test::run_captured({test::program_path("shmps-server"), "--name", name, "--tensor", "a:2x2", "--tensor", "b:3",
                          "--init-file", init.string(), "--checkpoint-dir", (dir.path / "empty").string()});
  BOOST_TEST(none.exit_code == 1, none.output);
  BOOST_TEST(none.output.find("--init-file " + init.string()) != std::string::npos, none.output);
}

// A checkpoint directory that is a symbolic link to nothing or to a loop
// of links, or a path under one: refused by --check-config and at start, naming the link and
// its target rather than create_directories()' "File exists" or mkdir's
// ENOENT, with exit 2 (a configuration error: the unit does not restart
// it).
BOOST_AUTO_TEST_CASE(a_checkpoint_dir_that_links_to_nothing_or_a_loop_is_refused_naming_the_target) {
  test::TempDir dir("ckpt");
  const fs::path link = dir.path / "dangling";
  fs::create_symlink(dir.path / "nowhere", link);
  const std::string to = "a symbolic link to " + (dir.path / "nowhere").string() + ", which does not exist";
  std::vector<std::pair<fs::path, std::string>> cases = {
      {link, "--checkpoint-dir " + link.string() + ": " + to},
      {link / "job1", "--checkpoint-dir " + (link / "job1").string() + ": " + link.string() + " is " + to},
      {link / "job1" / "deeper",
       "--checkpoint-dir " + (link / "job1" / "deeper").string() + ": " + link.string() + " is " + to}};
  // A loop of two links: named as one, not as a link to nothing.
  const fs::path loop = dir.path / "loop";
  fs::create_symlink(dir.path / "loop_back", loop);
  fs::create_symlink(loop, dir.path / "loop_back");
  const std::string looping =
      "a symbolic link to " + (dir.path / "loop_back").string() + ", which cannot be followed: " + std::strerror(ELOOP);
  cases.push_back({loop, "--checkpoint-dir " + loop.string() + ": " + looping});
  cases.push_back(
      {loop / "job1", "--checkpoint-dir " + (loop / "job1").string() + ": " + loop.string() + " is " + looping});
  for (const auto& [path, message] : cases) {
    for (const bool check : {true, false}) {
      std::vector<std::string> argv = {test::program_path("shmps-server"),
                                       "--name",
                                       test::unique_name("dangling"),
                                       "--tensor",
                                       "w:4",
                                       "--checkpoint-dir",
                                       path.string()};
      if (check) argv.push_back("--check-config");
      const auto run = test::run_captured(argv);
      BOOST_TEST_CONTEXT(path << (check ? " --check-config" : " start")) {
        BOOST_TEST(run.exit_code == 2, run.output);
        BOOST_TEST(run.output.find(message) != std::string::npos, run.output);
      }
    }
  }
  BOOST_TEST(!fs::exists(dir.path / "nowhere"));
}

BOOST_AUTO_TEST_CASE(a_server_of_another_model_leaves_that_models_checkpoints_alone) {
  test::TempDir dir("ckpt");
  const std::string name = test::unique_name("foreign");
  const std::vector<std::string> sgd = {"--tensor",          "a:2x2", "--tensor",         "b:3",
                                        "--optimizer",       "sgd",   "--checkpoint-dir", dir.path.string(),
                                        "--checkpoint-keep", "1"};
  run_steps(name, sgd, 0, 3);
  const std::string sgd_three = read_text(dir.path / ckpt_name(3));
  BOOST_REQUIRE(!sgd_three.empty());
  {
    // The same directory by mistake, with Adam: it starts fresh (the SGD
    // checkpoint does not fit), checkpoints every push and keeps 1.
    test::ServerProcess server(name, adam_args(dir.path, {"--checkpoint-every", "1", "--checkpoint-keep", "1"}));
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    for (int s = 0; s < 5; ++s) {
      push_steps(*w, *g, s, s + 1);
      // One write at a time: the next push's trigger waits for this one.
      BOOST_REQUIRE(test::eventually([&] { return s == 2 || fs::exists(dir.path / ckpt_name(s + 1)); }, 10s));
    }
    w.reset();
    BOOST_TEST(server.stop() == 0);
  }
  // Before: its pruning deleted the SGD run's checkpoint, or its write of
  // version 3 replaced it.
  BOOST_TEST(read_text(dir.path / ckpt_name(3)) == sgd_three);
  BOOST_TEST(checkpoint_files(dir.path) == (std::vector<std::string>{ckpt_name(3), ckpt_name(5)}));
}

BOOST_AUTO_TEST_CASE(checkpoint_options_are_validated) {
  std::vector<std::string> argv{test::program_path("shmps-server"),
                                "--name",
                                test::unique_name("opt"),
                                "--tensor",
                                "w:1",
                                "--checkpoint-every",
                                "5"};
  auto p = test::Process::spawn(argv);
  BOOST_TEST(p.wait(10s) == 2);  // needs --checkpoint-dir
}

BOOST_AUTO_TEST_SUITE_END()
