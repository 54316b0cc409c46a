// End-to-end runs of the real shmps-train (which starts its own
// shmps-server and forks its workers) on Fashion-MNIST subsets: it learns,
// bounded staleness rejects and counts pushes, the counts agree with the
// server's, --connect works and checks tensors, and failures exit non-zero;
// --in-process (the ceiling) learns and computes exactly what one worker
// through the server does; --eval-every writes its rows.
// Needs /usr/share/datasets/fashion-mnist (Debian: dataset-fashion-mnist).
#define BOOST_TEST_MODULE test_train_e2e
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "idx.hpp"
#include "mlp.hpp"
#include "shmps/shm/proc.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using shmps::test::Process;
using shmps::test::ServerProcess;
using shmps::test::unique_name;

namespace {

bool have_dataset() {
  return fs::exists(std::string(shmps::train::kDefaultFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

boost::test_tools::assertion_result dataset_installed(boost::unit_test::test_unit_id) {
  boost::test_tools::assertion_result r(have_dataset());
  r.message() << "Fashion-MNIST is not at " << shmps::train::kDefaultFashionMnistDir
              << " (apt-get install dataset-fashion-mnist)";
  return r;
}

struct CsvRow {
  double epoch = 0;
  double train_loss = 0;
  double test_acc = 0;
  double rejected = 0;
  double version = 0;
  double elapsed_s = 0;
};

// One shmps-train run: unique segment name, output and CSV files that are
// removed (with any segment left behind) when the fixture goes.
struct TrainRun {
  std::string name = unique_name("train_e2e");
  fs::path dir = fs::temp_directory_path() / name;
  std::string out = (dir / "out.txt").string();
  std::string csv = (dir / "curve.csv").string();
  std::string output;
  int rc = -1;

  TrainRun() { fs::create_directories(dir); }
  ~TrainRun() {
    ::shm_unlink(("shmps." + name).c_str());
    // Buffer objects of workers killed with a job the test killed.
    for (const auto& e : fs::directory_iterator("/dev/shm")) {
      const std::string f = e.path().filename().string();
      if (f.rfind("shmps." + name + ".", 0) == 0) ::shm_unlink(f.c_str());
    }
    std::error_code ec;
    fs::remove_all(dir, ec);
  }

  // Starts shmps-train with `args` (plus --name, unless --connect or --name
  // is among them), stdout and stderr into `out`.
  Process start(const std::vector<std::string>& args) const {
    std::string cmd = "exec " + shmps::test::shell_quote(shmps::test::program_path("shmps-train"));
    bool named = false;
    for (const std::string& a : args) {
      cmd += " " + shmps::test::shell_quote(a);
      named = named || a == "--connect" || a == "--name";
    }
    if (!named) cmd += " --name " + shmps::test::shell_quote(name);
    cmd += " >" + shmps::test::shell_quote(out) + " 2>&1";
    return Process::spawn({"/bin/sh", "-c", cmd});
  }

  // Starts shmps-train (2 workers, checkpoints every 20 updates, `args`)
  // with $TMPDIR `tmp`, after the shell command `before`, through
  // `launcher` (a command that execs its arguments, e.g. "setsid "; the
  // shell execs it); returns once training has begun (a checkpoint was
  // written).
  Process start_in_tmpdir(const fs::path& tmp, const std::string& before, const std::string& args,
                          const std::string& launcher = "") const {
    fs::create_directories(tmp);
    const std::string cmd = before + "TMPDIR=" + shmps::test::shell_quote(tmp.string()) + " exec " + launcher +
                            shmps::test::shell_quote(shmps::test::program_path("shmps-train")) + " --name " +
                            shmps::test::shell_quote(name) + " --workers 2 --test-limit 100 --checkpoint-every 20 " +
                            args + " >" + shmps::test::shell_quote(out) + " 2>&1";
    Process train = Process::spawn({"/bin/sh", "-c", cmd});
    BOOST_REQUIRE_MESSAGE(shmps::test::eventually(
                              [&] {
                                for (const auto& e : fs::recursive_directory_iterator(tmp))
                                  if (e.path().filename().string().rfind("ckpt-", 0) == 0) return true;
                                return false;
                              },
                              60s),
                          shmps::test::read_file(out));
    return train;
  }

  // Runs to the end (fails the test on timeout); keeps rc and output.
  void run(const std::vector<std::string>& args, std::chrono::seconds timeout = 150s) {
    Process p = start(args);
    rc = p.wait(timeout);
    output = shmps::test::read_file(out);
    BOOST_TEST_MESSAGE("shmps-train " << args.size() << " args -> " << rc << "\n" << output);
    BOOST_REQUIRE_MESSAGE(rc >= 0, "shmps-train did not finish within " << timeout.count() << " s:\n" << output);
  }

  double final_accuracy() const {
    std::smatch m;
    BOOST_REQUIRE_MESSAGE(std::regex_search(output, m, std::regex(R"(final test accuracy: ([0-9.]+))")), output);
    return std::stod(m[1]);
  }

  // "pushes: workers applied A rejected R; server applied SA rejected_stale SR (agree)"
  std::vector<uint64_t> push_counts() const {
    std::smatch m;
    BOOST_REQUIRE_MESSAGE(
        std::regex_search(output, m,
                          std::regex(R"(pushes: workers applied (\d+) rejected (\d+); server applied (\d+) )"
                                     R"(rejected_stale (\d+) \((\w+)\))")),
        output);
    BOOST_TEST(m[5] == "agree");
    return {std::stoull(m[1]), std::stoull(m[2]), std::stoull(m[3]), std::stoull(m[4])};
  }

  std::vector<CsvRow> curve() const {
    std::ifstream in(csv);
    std::string line;
    BOOST_REQUIRE(std::getline(in, line));
    BOOST_TEST(line == "epoch,version,train_loss,test_loss,test_acc,pushes_per_s,rejected,avg_staleness,elapsed_s");
    std::vector<CsvRow> rows;
    while (std::getline(in, line)) {
      std::vector<double> v;
      std::stringstream ss(line);
      for (std::string cell; std::getline(ss, cell, ',');) v.push_back(std::stod(cell));
      BOOST_REQUIRE_EQUAL(v.size(), 9u);
      rows.push_back(CsvRow{v[0], v[2], v[4], v[6], v[1], v[8]});
    }
    return rows;
  }
};

// The shmps-server child of shmps-train `train` (-1 when none runs).
pid_t server_child(const Process& train) {
  for (const pid_t child : shmps::test::child_pids(train.pid()))
    if (shmps::test::read_file("/proc/" + std::to_string(child) + "/cmdline").find("shmps-server") != std::string::npos)
      return child;
  return -1;
}

// Whether any shm object of segment `name` (itself or a buffer) is in /dev/shm.
bool shm_objects_left(const std::string& name) {
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    const std::string f = e.path().filename().string();
    if (f == "shmps." + name || f.rfind("shmps." + name + ".", 0) == 0) return true;
  }
  return false;
}

// Writes a He initialisation of the model for a server the test starts.
std::string write_init(const fs::path& dir) {
  const shmps::train::MlpShape shape;
  std::vector<float> p(shmps::train::mlp_parameter_count(shape));
  shmps::train::he_init(shape, p, 1);
  const std::string path = (dir / "init.bin").string();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(p.data()), static_cast<std::streamsize>(p.size() * sizeof(float)));
  return path;
}

// What run_measured() saw: the exit code (128 + signal when killed) and
// the peak resident memory of the process, in KiB (wait4's ru_maxrss).
struct Measured {
  int rc = -1;
  long max_rss_kb = 0;
};

// Runs shmps-train `args` (fork + exec, stdout and stderr into `out`) to
// its end, reaped by wait4 for its own peak memory; fails the test when
// it runs past `timeout` (then it is killed).
Measured run_measured(const std::vector<std::string>& args, const std::string& out, std::chrono::seconds timeout) {
  std::vector<std::string> argv{shmps::test::program_path("shmps-train")};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  BOOST_REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ::dup2(fd, STDOUT_FILENO) < 0 || ::dup2(fd, STDERR_FILENO) < 0) ::_exit(125);
    ::execv(cargv[0], cargv.data());
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  struct rusage usage {};
  pid_t got = 0;
  while ((got = ::wait4(pid, &status, WNOHANG, &usage)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  if (got == 0) {
    ::kill(pid, SIGKILL);
    ::wait4(pid, &status, 0, &usage);
    BOOST_FAIL("shmps-train did not finish within " << timeout.count() << " s:\n" << shmps::test::read_file(out));
  }
  BOOST_REQUIRE(got == pid);
  Measured m;
  m.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  m.max_rss_kb = usage.ru_maxrss;
  return m;
}

// An IDX header: the magic, then each dimension, big-endian.
std::string idx_header(uint32_t magic, const std::vector<uint32_t>& dims) {
  std::vector<uint32_t> words{magic};
  words.insert(words.end(), dims.begin(), dims.end());
  std::string b;
  for (const uint32_t v : words)
    for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<char>(v >> shift));
  return b;
}

// Writes `bytes` to `path`, gzipped when it ends in ".gz".
void write_file(const std::string& path, const std::string& bytes) {
  if (path.ends_with(".gz")) {
    gzFile f = gzopen(path.c_str(), "wb");
    BOOST_REQUIRE(f != nullptr);
    BOOST_REQUIRE_EQUAL(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    BOOST_REQUIRE_EQUAL(gzclose(f), Z_OK);
  } else {
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
}

std::vector<std::string> server_args(const std::string& init, const std::string& fc1 = "256x784") {
  std::vector<std::string> args{
      "--tensor",    "fc1.weight:" + fc1, "--tensor", "fc1.bias:256", "--tensor", "fc2.weight:10x256", "--tensor",
      "fc2.bias:10", "--optimizer",       "adam",     "--lr",         "0.001",    "--max-workers",     "8"};
  if (!init.empty()) args.insert(args.end(), {"--init-file", init});
  return args;
}

}  // namespace

// Two asynchronous workers for one epoch of 5,000 images: the final score
// depends on how their pushes interleave, and swings between evaluations
// ten versions apart (docs/training.md, "Reproducing").
// The check is that the run learned (it starts near 0.11; chance is
// 0.10), not a score.
constexpr double kLearnedAfterOneShortEpoch = 0.60;

BOOST_AUTO_TEST_SUITE(train_e2e, *boost::unit_test::precondition(dataset_installed))

BOOST_FIXTURE_TEST_CASE(two_workers_one_epoch_learns, TrainRun) {
  run({"--train-limit", "5000", "--epochs", "1", "--workers", "2", "--evals-per-epoch", "4", "--csv", csv});
  BOOST_REQUIRE_EQUAL(rc, 0);
  const std::vector<CsvRow> rows = curve();
  // Epoch 0, up to three quarter marks (each skipped when an evaluation
  // overran it: on a loaded machine all of them) and the end; epochs are
  // measured by applied pushes.
  BOOST_REQUIRE_GE(rows.size(), 2u);
  BOOST_TEST(rows.front().epoch == 0.0);
  BOOST_TEST(rows.back().epoch == 1.0);
  for (size_t i = 1; i < rows.size(); ++i) BOOST_TEST(rows[i].epoch > rows[i - 1].epoch);
  BOOST_TEST(rows.back().train_loss < 0.5 * rows.front().train_loss);
  BOOST_TEST(rows.back().test_acc > kLearnedAfterOneShortEpoch);
  BOOST_TEST(final_accuracy() == rows.back().test_acc, boost::test_tools::tolerance(1e-3));
  const std::vector<uint64_t> c = push_counts();
  BOOST_TEST(c[0] == 2u * 40u);  // 2 shards of 2500 in minibatches of 64
  BOOST_TEST(c[0] == c[2]);
  BOOST_TEST(c[1] == c[3]);
  BOOST_TEST(!fs::exists("/dev/shm/shmps." + name));  // the server removed its segment
}

BOOST_FIXTURE_TEST_CASE(staleness_zero_rejects_counts_and_converges, TrainRun) {
  // Four workers on a bound of 0: every push that another push overtook is
  // rejected and retried on fresh weights.
  run({"--train-limit", "10000", "--test-limit", "2000", "--epochs", "1", "--workers", "4", "--max-staleness", "0",
       "--csv", csv});
  BOOST_REQUIRE_EQUAL(rc, 0);
  const std::vector<uint64_t> c = push_counts();
  BOOST_TEST(c[0] == 4u * 40u);  // 4 shards of 2500
  BOOST_TEST(c[1] > 0u);
  BOOST_TEST(c[0] == c[2]);
  BOOST_TEST(c[1] == c[3]);
  const std::vector<CsvRow> rows = curve();
  BOOST_TEST(rows.back().rejected == static_cast<double>(c[3]));
  BOOST_TEST(final_accuracy() > 0.70);
}

BOOST_FIXTURE_TEST_CASE(connect_uses_a_running_server_and_checks_tensors, TrainRun) {
  const std::string init = write_init(dir);
  {
    ServerProcess server(name, server_args(init));
    run({"--connect", name, "--train-limit", "3000", "--test-limit", "2000", "--epochs", "1", "--workers", "2", "--lr",
         "0.5", "--max-staleness", "3"});
    BOOST_REQUIRE_EQUAL(rc, 0);
    // The server's configuration applies; ours is said to be ignored.
    BOOST_TEST(output.find("shmps-train: warning: ignoring --lr, --max-staleness: with --connect the running server's "
                           "configuration applies") != std::string::npos,
               output);
    const double trained = final_accuracy();
    BOOST_TEST(trained > 0.60);
    // --evaluate scores the same weights again and trains nothing.
    run({"--connect", name, "--test-limit", "2000", "--evaluate"});
    BOOST_REQUIRE_EQUAL(rc, 0);
    BOOST_TEST(output.find("nothing trained") != std::string::npos, output);
    BOOST_TEST(final_accuracy() == trained);
    BOOST_TEST(server.process().running());  // not ours to stop
    BOOST_TEST(server.stop() == 0);
  }
  {
    ServerProcess other(name, server_args("", "128x784"));
    run({"--connect", name, "--train-limit", "100", "--test-limit", "100", "--epochs", "1", "--workers", "1"});
    BOOST_TEST(rc == 1);
    BOOST_TEST(output.find("do not match") != std::string::npos, output);
  }
}

// A server left at shmps-server's default --init zero: a ReLU MLP never
// learns from all-zero weights, so --connect refuses it (exit 2, before any
// worker starts) and says how to start the server instead; that advice works.
BOOST_FIXTURE_TEST_CASE(connect_refuses_a_server_whose_weights_are_all_zero, TrainRun) {
  {
    ServerProcess zeros(name, server_args(""));
    run({"--connect", name, "--train-limit", "100", "--test-limit", "100", "--epochs", "1", "--workers", "1"});
    BOOST_TEST(rc == 2);
    BOOST_TEST(output.find("shmps-train: every weight of server '" + name +
                           "' is zero (version 0): a ReLU MLP started "
                           "from all-zero weights never learns") != std::string::npos,
               output);
    BOOST_TEST(output.find("Start the server with random weights, e.g. --init normal --init-scale 0.05, or --init-file "
                           "PATH") != std::string::npos,
               output);
    BOOST_TEST(output.find("epoch ") == std::string::npos, output);  // no training started
    BOOST_TEST(zeros.process().running());
    BOOST_TEST(zeros.stop() == 0);
  }
  std::vector<std::string> args = server_args("");
  args.insert(args.end(), {"--init", "normal", "--init-scale", "0.05"});
  ServerProcess normal(name, args);
  run({"--connect", name, "--train-limit", "3000", "--test-limit", "1000", "--epochs", "1", "--workers", "2"});
  BOOST_REQUIRE_EQUAL(rc, 0);
  BOOST_TEST(final_accuracy() > 0.60);
  BOOST_TEST(normal.stop() == 0);
}

// --name of a server already running: shmps-train's own server refuses to
// start beside it, and shmps-train never attaches to the other one (its
// weights, optimizer and lr are another job's).
BOOST_FIXTURE_TEST_CASE(a_name_another_server_serves_is_refused_untouched, TrainRun) {
  std::vector<std::string> args = server_args("");
  args.insert(args.end(), {"--init", "normal", "--init-scale", "0.05"});
  ServerProcess other(name, args);
  run({"--train-limit", "1000", "--test-limit", "100", "--epochs", "1", "--workers", "1"});
  BOOST_TEST(rc == 1);
  BOOST_TEST(output.find("another shmps-server (pid " + std::to_string(other.process().pid()) + ") serves '" + name +
                         "', not the one shmps-train started: choose another --name, or --connect " + name +
                         " to use it") != std::string::npos,
             output);
  BOOST_TEST(output.find("epoch ") == std::string::npos, output);
  auto w = shmps::test::connect(name);
  auto stats = w->stats();
  BOOST_REQUIRE(stats.ok());
  BOOST_TEST(stats->gradients_applied == 0u);
  BOOST_TEST(stats->version == 0u);
  w.reset();
  BOOST_TEST(other.stop() == 0);
}

// SIGTERM (or Ctrl-C's SIGINT) mid-run: the job stops its workers and its
// server and removes its temp files ($TMPDIR's init file and checkpoint
// folder) and every shm object of the job, exiting 128 + the signal.
BOOST_FIXTURE_TEST_CASE(a_signal_mid_run_stops_the_job_and_leaves_nothing, TrainRun) {
  const fs::path tmp = dir / "tmp";
  Process train = start_in_tmpdir(tmp, "", "--epochs 50 --train-limit 20000");
  train.signal(SIGTERM);
  rc = train.wait(30s);  // 128 + SIGTERM: killed by it, after the cleanup
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 128 + SIGTERM, output);
  BOOST_TEST(output.find("shmps-train: stopped by signal 15") != std::string::npos, output);
  BOOST_TEST(fs::is_empty(tmp), "temp files left in " << tmp);
  for (const auto& e : fs::directory_iterator("/dev/shm"))
    BOOST_TEST(e.path().filename().string().rfind("shmps." + name, 0) != 0, e.path() << " left behind");
}

// A signal the job was started with ignored (nohup: SIGHUP) stays ignored,
// in the parent and its workers: the job runs to its end.
BOOST_FIXTURE_TEST_CASE(an_ignored_hangup_stays_ignored, TrainRun) {
  Process train = start_in_tmpdir(dir / "tmp", "trap '' HUP; ", "--epochs 2 --train-limit 6000");
  train.signal(SIGHUP);
  rc = train.wait(120s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 0, output);
  BOOST_TEST(output.find("final test accuracy") != std::string::npos, output);
}

// SIGINT to the whole process group of a job started with SIGINT ignored
// (`trap '' INT`, as a terminal's Ctrl-C reaches every process in the
// foreground group): the job ignores it, and so does its server, a job's
// child (--parent-pid) that leaves SIGINT to its parent: the run completes.
BOOST_FIXTURE_TEST_CASE(a_group_sigint_the_job_ignores_leaves_its_server_serving, TrainRun) {
  Process train = start_in_tmpdir(dir / "tmp", "trap '' INT; ", "--epochs 6 --train-limit 10000", "setsid ");
  BOOST_REQUIRE_EQUAL(::getpgid(train.pid()), train.pid());  // a group of its own, without this test
  BOOST_REQUIRE(::kill(-train.pid(), SIGINT) == 0);
  rc = train.wait(120s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 0, output);
  BOOST_TEST(output.find("final test accuracy") != std::string::npos, output);
  BOOST_TEST(output.find("(agree)") != std::string::npos, output);
}

// Its server stopped (SIGSTOP) when the job is told to stop: the SIGTERM
// that stops the server comes with a SIGCONT, so it stops in order (its
// last log line) rather than being killed after 10 s.
BOOST_FIXTURE_TEST_CASE(a_stopped_server_is_continued_to_stop, TrainRun) {
  const fs::path tmp = dir / "tmp";
  Process train = start_in_tmpdir(tmp, "", "--epochs 50 --train-limit 20000");
  const pid_t server = server_child(train);
  BOOST_REQUIRE_MESSAGE(server > 0, shmps::test::read_file(out));
  BOOST_REQUIRE(::kill(server, SIGSTOP) == 0);
  BOOST_REQUIRE(shmps::test::eventually([&] { return shmps::test::process_state(server) == 'T'; }));
  train.signal(SIGTERM);
  rc = train.wait(60s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 128 + SIGTERM, output);
  BOOST_TEST(output.find("did not stop within 10 s") == std::string::npos, output);
  BOOST_TEST(output.find("shmps-server info: stopped: version ") != std::string::npos, output);
  BOOST_TEST(fs::is_empty(tmp), "temp files left in " << tmp);
  BOOST_TEST(!shm_objects_left(name), "shm objects of the job left in /dev/shm");
}

// A job SIGKILLed leaves its temp files (its cleanup never ran): the next
// job removes them, since they name a shmps-train process that is gone.
// Kept: those of a live process (named by this test's pid and start
// time), a name that names no process, and anything else.
BOOST_FIXTURE_TEST_CASE(the_temp_files_of_a_killed_job_are_removed_by_the_next, TrainRun) {
  const fs::path tmp = dir / "tmp";
  {
    Process killed = start_in_tmpdir(tmp, "", "--epochs 50 --train-limit 20000");
    const pid_t server = server_child(killed);
    BOOST_REQUIRE_MESSAGE(server > 0, shmps::test::read_file(out));
    killed.kill_and_reap();
    // The server stops with its parent (PR_SET_PDEATHSIG), reaped by init.
    BOOST_REQUIRE(shmps::test::eventually([&] { return shmps::test::process_ended(server); }, 30s));
  }
  size_t left = 0;
  for (const auto& e : fs::directory_iterator(tmp))
    left += e.path().filename().string().rfind("shmps-train-", 0) == 0 ? 1 : 0;
  BOOST_REQUIRE_MESSAGE(left == 2u, "the killed job's init file and checkpoint folder");
  const std::string me = std::to_string(::getpid());
  const std::string live =
      "shmps-train-init-" + me + "-" + std::to_string(shmps::shm::process_start_time(::getpid())) + "-live00";
  write_file((tmp / live).string(), "x");
  write_file((tmp / "shmps-train-init-noowner").string(), "x");
  write_file((tmp / "other").string(), "x");
  // This pid with another start time: a process that held the pid before.
  fs::create_directories(tmp / ("shmps-train-ckpt-" + me + "-1-reused"));
  write_file((tmp / ("shmps-train-ckpt-" + me + "-1-reused") / "ckpt-1").string(), "x");
  Process next = Process::spawn({"/bin/sh", "-c",
                                 "TMPDIR=" + shmps::test::shell_quote(tmp.string()) + " exec " +
                                     shmps::test::shell_quote(shmps::test::program_path("shmps-train")) + " --name " +
                                     shmps::test::shell_quote(name) +
                                     " --workers 1 --train-limit 1000 --test-limit 100 --epochs 1 >" +
                                     shmps::test::shell_quote(out) + " 2>&1"});
  rc = next.wait(60s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 0, output);
  std::set<std::string> kept;
  for (const auto& e : fs::directory_iterator(tmp)) kept.insert(e.path().filename().string());
  BOOST_TEST((kept == std::set<std::string>{live, "shmps-train-init-noowner", "other"}), output);
  BOOST_TEST(output.find("shmps-train: removed " + (tmp / ("shmps-train-ckpt-" + me + "-1-reused")).string() +
                         ", left by shmps-train pid " + me + ", which is gone") != std::string::npos,
             output);
}

BOOST_FIXTURE_TEST_CASE(worker_death_fails_the_run, TrainRun) {
  Process p = start({"--train-limit", "20000", "--test-limit", "1000", "--epochs", "20", "--workers", "2"});
  // Wait for training to start, then SIGKILL one worker (a child that is
  // not the server).
  BOOST_REQUIRE(shmps::test::eventually(
      [&] { return shmps::test::read_file(out).find("epoch 0.00 ") != std::string::npos; }, 60s));
  pid_t victim = -1;
  for (const pid_t child : shmps::test::child_pids(p.pid())) {
    if (shmps::test::read_file("/proc/" + std::to_string(child) + "/cmdline").find("shmps-server") ==
        std::string::npos) {
      victim = child;
      break;
    }
  }
  BOOST_REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  rc = p.wait(60s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 1, output);
  BOOST_TEST(output.find("failed") != std::string::npos, output);
  BOOST_TEST(shmps::test::eventually([&] { return !fs::exists("/dev/shm/shmps." + name); }, 10s));
  // Nor any worker's buffer object.
  for (const auto& e : fs::directory_iterator("/dev/shm"))
    BOOST_TEST(e.path().filename().string().rfind("shmps." + name + ".", 0) != 0, e.path() << " left behind");
}

// The server SIGKILLed mid-run, once it has written a checkpoint:
// shmps-train restarts it, it restores its last checkpoint, the workers
// re-attach, and the run completes. (The kill waits for a checkpoint file,
// not for an evaluation row: under load an evaluation can outlast an
// epoch, and the row of that epoch is then skipped.)
BOOST_FIXTURE_TEST_CASE(server_death_is_survived_through_a_checkpoint, TrainRun) {
  Process p = start_in_tmpdir(dir / "tmp", "", "--train-limit 10000 --epochs 8 --evals-per-epoch 4");
  const pid_t server = server_child(p);
  BOOST_REQUIRE_MESSAGE(server > 0, shmps::test::read_file(out));
  ::kill(server, SIGKILL);
  rc = p.wait(120s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 0, output);
  BOOST_TEST(output.find("restarting it from its last checkpoint") != std::string::npos, output);
  BOOST_TEST(output.find("restored checkpoint") != std::string::npos, output);
  BOOST_TEST(final_accuracy() > 0.70);
  BOOST_TEST(shmps::test::eventually([&] { return !fs::exists("/dev/shm/shmps." + name); }, 10s));
}

// Its own server killed while it cannot be restarted (no checkpoints):
// the run fails, and the segment the dead server left goes with it (and
// only that one: its header names the dead child).
BOOST_FIXTURE_TEST_CASE(a_dead_server_of_its_own_leaves_no_segment, TrainRun) {
  Process p = start(
      {"--train-limit", "20000", "--test-limit", "100", "--epochs", "50", "--workers", "2", "--checkpoint-every", "0"});
  BOOST_REQUIRE(shmps::test::eventually(
      [&] { return shmps::test::read_file(out).find("epoch 0.00 ") != std::string::npos; }, 60s));
  const pid_t server = server_child(p);
  BOOST_REQUIRE_MESSAGE(server > 0, shmps::test::read_file(out));
  ::kill(server, SIGKILL);
  rc = p.wait(60s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 1, output);
  BOOST_TEST(output.find("shmps-server exited with status 137 during training\n") != std::string::npos, output);
  BOOST_TEST(!shm_objects_left(name), "the dead server's segment or a buffer was left in /dev/shm");
}

// --connect to a server that is killed and started again from its
// checkpoint (as systemd restarts a unit): the workers re-attach, and the
// counts are not comparable across the restart, which is no mismatch.
BOOST_FIXTURE_TEST_CASE(connect_survives_a_restart_of_the_server, TrainRun) {
  const std::string init = write_init(dir);
  const fs::path ckpt = dir / "ckpt";
  std::vector<std::string> args = server_args(init);
  args.insert(args.end(), {"--checkpoint-dir", ckpt.string(), "--checkpoint-every", "20"});
  auto server = std::make_unique<ServerProcess>(name, args);
  Process p =
      start({"--connect", name, "--train-limit", "10000", "--test-limit", "200", "--epochs", "6", "--workers", "2"});
  BOOST_REQUIRE_MESSAGE(shmps::test::eventually(
                            [&] {
                              for (const auto& e : fs::directory_iterator(ckpt))
                                if (e.path().filename().string().rfind("ckpt-", 0) == 0) return true;
                              return false;
                            },
                            60s),
                        shmps::test::read_file(out));
  server->process().kill_and_reap();
  server.reset();                                        // removes the dead server's segment
  server = std::make_unique<ServerProcess>(name, args);  // restores the last checkpoint
  rc = p.wait(120s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 0, output);
  BOOST_TEST(output.find("server restarted during training: ") != std::string::npos, output);
  BOOST_TEST(output.find("(not comparable across restarts)") != std::string::npos, output);
  BOOST_TEST(output.find("MISMATCH") == std::string::npos, output);
  BOOST_TEST(server->stop() == 0);
}

// --connect to a server started again from weights older than the run's
// start (its initial weights here; a checkpoint written before the run
// alike): its version goes back below the one the run attached at. The
// run counts its progress from there: every epoch printed lies within the
// run, and the rates and the final version are true counts.
BOOST_FIXTURE_TEST_CASE(connect_counts_on_when_a_restart_takes_the_version_back, TrainRun) {
  const std::string init = write_init(dir);
  auto server = std::make_unique<ServerProcess>(name, server_args(init));
  // Another job first: the run attaches at version 2000, far above what
  // the restarted server reaches before the run's next look at it.
  run({"--connect", name, "--train-limit", "2000", "--test-limit", "100", "--batch", "1", "--epochs", "1", "--workers",
       "1"});
  BOOST_REQUIRE_EQUAL(rc, 0);
  fs::remove(out);  // its "epoch 0.00" line is not the run's
  Process p = start({"--connect", name, "--train-limit", "10000", "--test-limit", "200", "--epochs", "20", "--workers",
                     "2", "--evals-per-epoch", "2"});
  BOOST_REQUIRE(shmps::test::eventually(
      [&] { return shmps::test::read_file(out).find("epoch 0.00 ") != std::string::npos; }, 60s));
  server->process().kill_and_reap();
  server.reset();                                                     // removes the dead server's segment
  server = std::make_unique<ServerProcess>(name, server_args(init));  // at version 0 again
  rc = p.wait(120s);
  output = shmps::test::read_file(out);
  BOOST_TEST_MESSAGE(output);
  BOOST_TEST(rc == 0, output);
  BOOST_TEST(output.find("(not comparable across restarts)") != std::string::npos, output);
  const std::regex row(R"(epoch ([0-9.e+]+)  train_loss \S+  test_acc \S+  pushes/s ([0-9.e+]+) )");
  size_t rows = 0;
  for (std::sregex_iterator it(output.begin(), output.end(), row), end; it != end; ++it, ++rows) {
    BOOST_TEST(std::stod((*it)[1]) <= 20.0, (*it)[0]);
    BOOST_TEST(std::stod((*it)[2]) < 1e7, (*it)[0]);
  }
  BOOST_TEST(rows >= 2u, output);
  std::smatch m;
  BOOST_REQUIRE_MESSAGE(
      std::regex_search(output, m, std::regex(R"(the server's version is (\d+) of (\d+) acknowledged pushes)")),
      output);
  BOOST_TEST(std::stoull(m[1]) <= std::stoull(m[2]), m[0]);
  BOOST_TEST(server->stop() == 0);
}

// A stop signal while the workers wait for a dead --connect server to come
// back ends the job at once, not when their reconnect times out (10 s).
BOOST_FIXTURE_TEST_CASE(a_signal_while_the_server_is_gone_stops_at_once, TrainRun) {
  const std::string init = write_init(dir);
  auto server = std::make_unique<ServerProcess>(name, server_args(init));
  Process p =
      start({"--connect", name, "--train-limit", "20000", "--test-limit", "100", "--epochs", "50", "--workers", "2"});
  BOOST_REQUIRE(shmps::test::eventually(
      [&] { return shmps::test::read_file(out).find("epoch 0.00 ") != std::string::npos; }, 60s));
  server->process().kill_and_reap();
  std::this_thread::sleep_for(1s);  // the workers and the parent wait for a successor
  p.signal(SIGTERM);
  rc = p.wait(7s);  // before the 10 s reconnect timeout would end it
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 128 + SIGTERM, output);
  BOOST_TEST(output.find("shmps-train: stopped by signal 15") != std::string::npos, output);
  server.reset();  // removes the dead server's segment
  BOOST_TEST(!shm_objects_left(name), "a buffer of the job was left in /dev/shm");
}

// stdout's reader exits early (`| head -3`): SIGPIPE stops the job like
// any stop signal, through its cleanup, and it then dies of it (141).
BOOST_FIXTURE_TEST_CASE(a_closed_stdout_stops_the_job_and_leaves_nothing, TrainRun) {
  const fs::path tmp = dir / "tmp";
  fs::create_directories(tmp);
  const std::string cmd = "TMPDIR=" + shmps::test::shell_quote(tmp.string()) + " " +
                          shmps::test::shell_quote(shmps::test::program_path("shmps-train")) + " --name " +
                          shmps::test::shell_quote(name) +
                          " --workers 2 --train-limit 20000 --test-limit 100 --epochs 50 --evals-per-epoch 50 2>" +
                          shmps::test::shell_quote(out) + " | head -3 >/dev/null; exit ${PIPESTATUS[0]}";
  Process p = Process::spawn({"/bin/bash", "-c", cmd});
  rc = p.wait(60s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 128 + SIGPIPE, output);
  BOOST_TEST(output.find("shmps-train: stopped by signal 13") != std::string::npos, output);
  BOOST_TEST(fs::is_empty(tmp), "temp files left in " << tmp);
  BOOST_TEST(!shm_objects_left(name), "shm objects of the job left in /dev/shm");
}

// Checkpoint writes of its own server fail (the folder replaced by a file,
// as a full disk would fail them): shmps-train warns once during the run,
// and the final checkpoint failing too, into the temp folder removed next,
// does not fail the job.
BOOST_FIXTURE_TEST_CASE(failed_checkpoints_warn_and_the_final_one_does_not_fail_the_job, TrainRun) {
  const fs::path tmp = dir / "tmp";
  Process train = start_in_tmpdir(tmp, "", "--epochs 8 --train-limit 10000 --evals-per-epoch 1");
  fs::path folder;
  for (const auto& e : fs::directory_iterator(tmp))
    if (e.path().filename().string().rfind("shmps-train-ckpt-", 0) == 0) folder = e.path();
  BOOST_REQUIRE(!folder.empty());
  fs::remove_all(folder);
  std::ofstream(folder.string()) << "not a folder\n";
  rc = train.wait(150s);
  output = shmps::test::read_file(out);
  BOOST_TEST(rc == 0, output);
  BOOST_TEST(output.find("shmps-train: warning: shmps-server failed to write ") != std::string::npos, output);
  BOOST_TEST(output.find("shmps-train: warning: shmps-server's final checkpoint into its temp folder failed") !=
                 std::string::npos,
             output);
  BOOST_TEST(output.find("(agree)") != std::string::npos, output);
  BOOST_TEST(fs::is_empty(tmp), "temp files left in " << tmp);
}

BOOST_FIXTURE_TEST_CASE(in_process_learns_and_writes_eval_every_rows, TrainRun) {
  run({"--in-process", "--train-limit", "5000", "--epochs", "1", "--eval-every", "10", "--csv", csv});
  BOOST_REQUIRE_EQUAL(rc, 0);
  BOOST_TEST(output.find("in-process (no server)") != std::string::npos, output);
  BOOST_TEST(output.find("applied 79 in this process") != std::string::npos, output);  // ceil(5000 / 64)
  BOOST_TEST(output.find("shmps-server") == std::string::npos, output);                // none started
  // One row every 10 updates (the loop stops for each), then the end.
  const std::vector<CsvRow> rows = curve();
  BOOST_REQUIRE_EQUAL(rows.size(), 9u);
  for (size_t i = 0; i + 1 < rows.size(); ++i) BOOST_TEST(rows[i].version == 10.0 * static_cast<double>(i));
  BOOST_TEST(rows.back().version == 79.0);
  BOOST_TEST(rows.back().epoch == 1.0);
  BOOST_TEST(rows.front().elapsed_s == 0.0);
  for (size_t i = 1; i < rows.size(); ++i) BOOST_TEST(rows[i].elapsed_s >= rows[i - 1].elapsed_s);
  BOOST_TEST(rows.back().elapsed_s > 0.0);
  BOOST_TEST(rows.back().train_loss < 0.5 * rows.front().train_loss);
  BOOST_TEST(rows.back().test_acc > 0.70);
  BOOST_TEST(final_accuracy() == rows.back().test_acc, boost::test_tools::tolerance(1e-3));
}

// The ceiling is the same computation as one worker through the server
// (same initialisation, data order, batch, optimizer; a lone worker is never
// stale): the weights, hence the scores, agree exactly at every version
// both curves hold, and at the end.
BOOST_FIXTURE_TEST_CASE(in_process_computes_what_one_worker_does, TrainRun) {
  const std::vector<std::string> common{"--train-limit", "3000", "--test-limit", "1000", "--epochs", "2",
                                        "--eval-every",  "5",    "--csv"};
  std::vector<std::string> args = common;
  args.push_back(csv);
  args.push_back("--in-process");
  run(args);
  BOOST_REQUIRE_EQUAL(rc, 0);
  const std::vector<CsvRow> local = curve();
  args.back() = "--workers";
  args.push_back("1");
  run(args);
  BOOST_REQUIRE_EQUAL(rc, 0);
  const std::vector<CsvRow> served = curve();
  BOOST_TEST(local.back().version == 94.0);  // 2 x ceil(3000 / 64)
  BOOST_TEST(served.back().version == 94.0);
  size_t compared = 0;
  for (const CsvRow& s : served) {
    for (const CsvRow& l : local) {
      if (l.version != s.version) continue;
      BOOST_TEST(l.test_acc == s.test_acc, "version " << s.version);
      BOOST_TEST(l.train_loss == s.train_loss, "version " << s.version);
      ++compared;
    }
  }
  BOOST_TEST(compared >= 2u);  // at least the start and the end
}

BOOST_FIXTURE_TEST_CASE(eval_every_through_the_server, TrainRun) {
  run({"--train-limit", "5000", "--test-limit", "1000", "--epochs", "1", "--workers", "2", "--eval-every", "10",
       "--csv", csv});
  BOOST_REQUIRE_EQUAL(rc, 0);
  push_counts();
  // Snapshots are taken when the parent's poll sees a boundary passed, so
  // a row may be a few updates late (and, under load, a boundary skipped).
  const std::vector<CsvRow> rows = curve();
  BOOST_REQUIRE_GE(rows.size(), 3u);
  BOOST_TEST(rows.front().version == 0.0);
  BOOST_TEST(rows.front().elapsed_s == 0.0);
  BOOST_TEST(rows.back().version == 80.0);  // 2 shards of 2500
  for (size_t i = 1; i < rows.size(); ++i) {
    BOOST_TEST(rows[i].version > rows[i - 1].version);
    BOOST_TEST(rows[i].elapsed_s >= rows[i - 1].elapsed_s);
  }
  BOOST_TEST(rows[1].version >= 10.0);
  BOOST_TEST(rows.back().train_loss < 0.5 * rows.front().train_loss);
  BOOST_TEST(final_accuracy() > kLearnedAfterOneShortEpoch);
}

BOOST_FIXTURE_TEST_CASE(missing_dataset_exits_2, TrainRun) {
  run({"--data-dir", (dir / "nothing-here").string()});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("apt-get install dataset-fashion-mnist") != std::string::npos, output);
}

// Dataset files whose headers claim far more than they hold (a 116-byte
// file claiming 100,000 images, a 1 KB one claiming 250 million labels,
// images of 2048x2048): refused with the reason and exit 2, before any
// memory is allocated on the header's word. Each claim would take 250 MB
// or more if it were allocated; shmps-train's peak stays far below.
BOOST_FIXTURE_TEST_CASE(a_hostile_dataset_header_is_refused_without_allocating, TrainRun) {
  constexpr long kPeakLimitKb = 150 * 1024;
  const std::string zeros(100'000, '\0');
  struct Case {
    std::string what;
    std::string images;  // file name, contents
    std::string image_bytes;
    std::string labels;
    std::string label_bytes;
    std::string message;
  };
  const std::vector<Case> cases{
      {"plain images claiming 100,000", "train-images-idx3-ubyte",
       idx_header(shmps::train::kIdxImagesMagic, {100'000, 28, 28}) + std::string(100, '\0'), "train-labels-idx1-ubyte",
       idx_header(shmps::train::kIdxLabelsMagic, {100'000}) + zeros,
       "truncated: the header claims 100000 images of 28x28"},
      {"gzip images claiming 100,000", "train-images-idx3-ubyte.gz",
       idx_header(shmps::train::kIdxImagesMagic, {100'000, 28, 28}) + std::string(100, '\0'),
       "train-labels-idx1-ubyte.gz", idx_header(shmps::train::kIdxLabelsMagic, {100'000}) + zeros,
       "truncated: the pixel data ends after 100 of 78400000 bytes"},
      {"plain labels claiming 250 million", "train-images-idx3-ubyte",
       idx_header(shmps::train::kIdxImagesMagic, {1, 28, 28}), "train-labels-idx1-ubyte",
       idx_header(shmps::train::kIdxLabelsMagic, {250'000'000}) + std::string(1000, '\0'),
       "truncated: the header claims 250000000 labels"},
      {"gzip labels claiming 250 million", "train-images-idx3-ubyte.gz",
       idx_header(shmps::train::kIdxImagesMagic, {1, 28, 28}), "train-labels-idx1-ubyte.gz",
       idx_header(shmps::train::kIdxLabelsMagic, {250'000'000}) + std::string(1000, '\0'),
       "truncated: the label data ends after 1000 of 250000000 bytes"},
      {"images of 2048x2048", "train-images-idx3-ubyte", idx_header(shmps::train::kIdxImagesMagic, {20, 2048, 2048}),
       "train-labels-idx1-ubyte", idx_header(shmps::train::kIdxLabelsMagic, {20}) + std::string(20, '\0'),
       "images of 2048x2048, expected 28x28"},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.what) {
      const fs::path data = dir / "data";
      fs::remove_all(data);
      fs::create_directories(data);
      write_file((data / c.images).string(), c.image_bytes);
      write_file((data / c.labels).string(), c.label_bytes);
      const Measured m = run_measured({"--data-dir", data.string(), "--name", name}, out, 60s);
      output = shmps::test::read_file(out);
      BOOST_TEST(m.rc == 2, output);
      BOOST_TEST(output.find(c.message) != std::string::npos, output);
      BOOST_TEST(m.max_rss_kb < kPeakLimitKb, "peak " << m.max_rss_kb / 1024 << " MiB");
    }
  }
}

BOOST_FIXTURE_TEST_CASE(missing_server_binary_fails, TrainRun) {
  run({"--train-limit", "100", "--test-limit", "100", "--server-bin", (dir / "no-server").string()});
  BOOST_TEST(rc == 1);
  BOOST_TEST(output.find("no-server") != std::string::npos, output);
}

BOOST_FIXTURE_TEST_CASE(bad_options_exit_2, TrainRun) {
  run({"--optimizer", "lion"});
  BOOST_TEST(rc == 2);
  run({"--workers", "0"});
  BOOST_TEST(rc == 2);
  run({"--in-process", "--workers", "2"});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("--workers must be 1") != std::string::npos, output);
  run({"--in-process", "--connect", "x"});
  BOOST_TEST(rc == 2);
  run({"--evaluate"});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("--evaluate scores a running server's weights: it needs --connect") != std::string::npos,
             output);
  for (const char* shard : {"2/2", "1", "a/3", "1/0", "1/2x"}) {
    run({"--shard", shard});
    BOOST_TEST(rc == 2);
    BOOST_TEST(output.find("--shard must be I/N with I < N") != std::string::npos, output);
  }
  // Checked as the server checks its options, before anything starts: a
  // usage error (exit 2), never a value replaced by a default.
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--optimizer", "sgd", "--momentum=-1"},
                                             {"--in-process", "--optimizer", "sgd", "--momentum=-1"},
                                             {"--optimizer", "sgd", "--momentum", "nan"},
                                             {"--optimizer", "sgd", "--momentum", "0", "--nesterov"},
                                             {"--lr", "0"},
                                             {"--weight-decay=-1"},
                                             {"--weight-decay", "inf"},
                                             {"--shard", "0/-1"},
                                             {"--workers", "255"},
                                             {"--in-process", "--momentum", "0.5"},
                                             {"--optimizer", "adamw", "--nesterov"}}) {
    run(bad);
    BOOST_TEST(rc == 2, bad[0] << " " << bad[1]);
    BOOST_TEST(output.find("epoch ") == std::string::npos, output);
  }
  // A stray word: the parser's own complaint, not "ambiguous" and a list
  // of every option.
  run({"--workers", "2", "4"});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("unexpected argument '4': every option is --name value") != std::string::npos, output);
  BOOST_TEST(output.find("ambiguous") == std::string::npos, output);
  // The CSV cannot be written: the path and the reason, before training.
  for (const char* where : {"--in-process", "--batch=64"}) {
    run({where, "--train-limit", "100", "--test-limit", "100", "--epochs", "1", "--csv", "/nonexistent/c.csv"});
    BOOST_TEST(rc == 1);
    BOOST_TEST(
        output.find(
            "shmps-train: --csv /nonexistent/c.csv: cannot open for writing: No such file or directory (errno 2)") !=
            std::string::npos,
        output);
    BOOST_TEST(output.find("epoch ") == std::string::npos, output);
  }
  // A usage error says what is wrong and where help is, not the whole help.
  run({"--no-such-option"});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("see shmps-train --help") != std::string::npos, output);
  BOOST_TEST(output.find("shmps-train options") == std::string::npos, output);
  // epochs x pushes per epoch must not wrap (2^63 epochs of 2 pushes is 0).
  for (const char* epochs : {"1000001", "9223372036854775808"}) {
    run({"--epochs", epochs, "--train-limit", "128", "--test-limit", "10", "--workers", "1"});
    BOOST_TEST(rc == 2, epochs);
    BOOST_TEST(output.find("--epochs must be 1..1000000") != std::string::npos, output);
  }
  // 1 snapshot per update of 79 is fine; of 20 epochs of 938 it is not.
  run({"--in-process", "--eval-every", "1"});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("raise --eval-every") != std::string::npos, output);
  // --in-process scores every evaluation after training: the same bound,
  // one snapshot per update at most.
  run({"--in-process", "--train-limit", "64", "--test-limit", "10", "--batch", "1", "--epochs", "20",
       "--evals-per-epoch", "1000"});
  BOOST_TEST(rc == 2);
  BOOST_TEST(output.find("--evals-per-epoch 1000 over 20 epochs takes 1281 snapshots of the weights over 1280 "
                         "updates; at most 500 (lower --evals-per-epoch or --epochs, or use --eval-every)") !=
                 std::string::npos,
             output);
  BOOST_TEST(output.find("epoch 0.00") == std::string::npos, output);
  // A segment name the server would refuse: a usage error, before any
  // server starts.
  for (const std::string& bad : {std::string("a/b"), std::string(300, 'x'), std::string(".x"), std::string()}) {
    for (const char* option : {"--name", "--connect"}) {
      run({option, bad, "--train-limit", "100", "--test-limit", "100", "--epochs", "1", "--workers", "1"});
      BOOST_TEST(rc == 2, option << " '" << bad << "'");
      BOOST_TEST(output.find("shmps-train: " + std::string(option) + ": name ") != std::string::npos, output);
      BOOST_TEST(output.find("shmps-server") == std::string::npos, output);
    }
  }
  // -1 must not wrap to 2^64 - 1 (as lexical_cast reads it): --epochs -1
  // would train for ever, --max-staleness -1 turn the bound off.
  for (const char* option : {"--epochs", "--max-staleness", "--seed", "--train-limit"}) {
    run({option, "-1"});
    BOOST_TEST(rc == 2, option);
    BOOST_TEST(output.find(std::string(option) + " must be a non-negative integer") != std::string::npos, output);
  }
}

BOOST_AUTO_TEST_SUITE_END()
