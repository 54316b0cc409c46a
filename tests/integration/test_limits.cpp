// Resource limits: every configured or physical limit answers with a clear
// error (kNoCapacity, kBusy) naming the limit, and leaves the server, the
// other workers and the caller itself working: max workers, max buffers per
// worker, a full request lane, /dev/shm too small for a buffer, a buffer
// past the file size limit, and weights too large for the server's memory.
#define BOOST_TEST_MODULE test_limits
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <filesystem>

#include "raw_client.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

Result<std::unique_ptr<Worker>> try_connect(const std::string& name, std::chrono::milliseconds timeout = 5s) {
  WorkerOptions o;
  o.name = name;
  o.timeout = timeout;
  return Worker::connect(o);
}

std::unique_ptr<Worker> connect(const std::string& name, std::chrono::milliseconds timeout = 5s) {
  auto w = try_connect(name, timeout);
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  return std::move(w).value();
}

// Buffer objects of `name` in /dev/shm ("shmps.<name>.p<pid>.<n>").
size_t buffer_objects(const std::string& name) {
  size_t n = 0;
  const std::string prefix = shm::segment_object_name(name) + ".p";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
  return n;
}

// Pushes -1 into tensor 0 of one element; true when acknowledged.
bool push_one(Worker& w, const Buffer& b) {
  *static_cast<float*>(b.data) = -1.0f;
  return w.push(0, b.id, 0, 4, Dtype::kF32, w.stats()->version).ok();
}

const std::vector<std::string> kCounting = {"--tensor", "w:1", "--lr", "1", "--max-staleness", "1000000"};

}  // namespace

BOOST_AUTO_TEST_SUITE(limits)

BOOST_AUTO_TEST_CASE(max_workers_reached_is_kNoCapacity_and_the_others_go_on) {
  std::vector<std::string> args = kCounting;
  args.insert(args.end(), {"--max-workers", "3"});
  test::ServerProcess server(test::unique_name("maxw"), args);
  std::vector<std::unique_ptr<Worker>> workers;
  std::vector<Buffer> buffers;
  for (int i = 0; i < 3; ++i) {
    workers.push_back(connect(server.name()));
    auto b = workers.back()->register_buffer(4);
    BOOST_REQUIRE(b.ok());
    buffers.push_back(*b);
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto extra = try_connect(server.name());
    BOOST_TEST((extra.status().code() == ErrorCode::kNoCapacity), extra.status().to_string());
    BOOST_TEST(extra.status().message().find("all 3 worker slots") != std::string::npos, extra.status().message());
  }
  for (int i = 0; i < 3; ++i) BOOST_TEST(push_one(*workers[i], buffers[i]));
  // One leaves: its slot serves a newcomer at once.
  workers.pop_back();
  auto newcomer = connect(server.name());
  BOOST_TEST(newcomer->ping().ok());
  auto s = newcomer->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->workers_attached == 3u);
  BOOST_TEST(s->gradients_applied == 3u);
}

BOOST_AUTO_TEST_CASE(too_many_buffers_is_kNoCapacity_and_a_freed_slot_is_reused) {
  std::vector<std::string> args = kCounting;
  args.insert(args.end(), {"--max-buffers", "3"});
  test::ServerProcess server(test::unique_name("maxb"), args);
  auto w = connect(server.name());
  std::vector<Buffer> buffers;
  for (int i = 0; i < 3; ++i) {
    auto b = w->register_buffer(4);
    BOOST_REQUIRE_MESSAGE(b.ok(), b.status().to_string());
    buffers.push_back(*b);
  }
  auto extra = w->register_buffer(4);
  BOOST_TEST((extra.status().code() == ErrorCode::kNoCapacity), extra.status().to_string());
  BOOST_TEST(extra.status().message().find("all 3 buffer slots") != std::string::npos, extra.status().message());
  BOOST_TEST(buffer_objects(server.name()) == 3u);  // the refused one left nothing behind
  BOOST_TEST(push_one(*w, buffers[0]));
  BOOST_REQUIRE(w->unregister_buffer(buffers[1].id).ok());
  auto again = w->register_buffer(4);
  BOOST_REQUIRE_MESSAGE(again.ok(), again.status().to_string());
  BOOST_TEST(again->id == buffers[1].id);
  BOOST_TEST(push_one(*w, *again));
}

// The server's own bound, whatever a client library does: buffer ids at or
// past max_buffers are refused by number.
BOOST_AUTO_TEST_CASE(server_refuses_buffer_ids_past_max_buffers) {
  std::vector<std::string> args = kCounting;
  args.insert(args.end(), {"--max-buffers", "2"});
  test::ServerProcess server(test::unique_name("maxbid"), args);
  test::RawClient raw(server.name());
  for (const uint32_t id : {2u, 3u, 64u, 0xFFFFFFFFu}) {
    shm::Request r = raw.request(shm::Opcode::kRegisterBuffer);
    r.buffer_id = id;
    const shm::Completion c = raw.call(r);
    BOOST_TEST((static_cast<ErrorCode>(c.code) == ErrorCode::kUnknownBuffer), "buffer id " << id << ": " << c.message);
    BOOST_TEST(std::string(c.message).find(">= max_buffers 2") != std::string::npos, c.message);
  }
  BOOST_TEST(raw.call(raw.request(shm::Opcode::kPing)).code == 0u);
}

// A full lane: requests up to the capacity are queued, the next one waits
// the call's timeout and fails with kBusy, and nothing queued is lost.
BOOST_AUTO_TEST_CASE(full_lane_is_kBusy_after_the_timeout_and_nothing_queued_is_lost) {
  std::vector<std::string> args = kCounting;
  args.insert(args.end(), {"--ring-capacity", "4"});
  test::ServerProcess server(test::unique_name("busy"), args);
  auto w = connect(server.name(), 300ms);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  *static_cast<float*>(buf->data) = -1.0f;
  server.process().pause();
  std::vector<Worker::Ticket> tickets;
  for (int i = 0; i < 4; ++i) {
    auto t = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
    BOOST_REQUIRE_MESSAGE(t.ok(), t.status().to_string());
    tickets.push_back(*t);
  }
  for (int i = 0; i < 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto busy = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
    BOOST_TEST((busy.status().code() == ErrorCode::kBusy), busy.status().to_string());
    BOOST_TEST(busy.status().message().find("4 requests in flight") != std::string::npos, busy.status().message());
    BOOST_TEST((std::chrono::steady_clock::now() - t0 >= 290ms));
  }
  server.process().resume();
  for (size_t i = 0; i < tickets.size(); ++i) {
    auto v = w->wait(tickets[i]);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    BOOST_TEST(*v == i + 1);  // in order, each applied once
  }
  auto pulled = w->pull(0, buf->id, 0);
  BOOST_REQUIRE(pulled.ok());
  BOOST_TEST(*pulled == 4u);
  BOOST_TEST(*static_cast<const float*>(buf->data) == 4.0f);  // the refused pushes were never applied
}

// /dev/shm cannot hold the buffer: kNoCapacity with both numbers, nothing
// left behind, and the worker goes on as before.
BOOST_AUTO_TEST_CASE(dev_shm_too_small_for_a_buffer_is_kNoCapacity_and_the_worker_goes_on) {
  test::ServerProcess server(test::unique_name("huge"), kCounting);
  auto w = connect(server.name());
  auto huge = w->register_buffer(size_t{1} << 44);
  BOOST_TEST((huge.status().code() == ErrorCode::kNoCapacity), huge.status().to_string());
  BOOST_TEST(huge.status().message().find("need 17592186044416 bytes") != std::string::npos, huge.status().message());
  BOOST_TEST(huge.status().message().find("available") != std::string::npos, huge.status().message());
  BOOST_TEST(buffer_objects(server.name()) == 0u);
  BOOST_TEST(w->ping().ok());
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE_MESSAGE(buf.ok(), buf.status().to_string());
  BOOST_TEST(buf->id == 0u);  // the refused buffer took no slot
  BOOST_TEST(push_one(*w, *buf));
}

// A buffer past the process's file size limit (RLIMIT_FSIZE, which
// /dev/shm counts), in a process that ignores SIGXFSZ (Python does; a C++
// program must, or the kernel's SIGXFSZ ends it): kIo naming the limit and
// its fix, nothing left behind, and the worker goes on.
BOOST_AUTO_TEST_CASE(a_buffer_past_the_file_size_limit_is_kIo_naming_the_limit) {
  test::ServerProcess server(test::unique_name("fsize"), kCounting);
  auto w = connect(server.name());
  struct sigaction ignore {
  }, previous{};
  ignore.sa_handler = SIG_IGN;
  BOOST_REQUIRE(::sigaction(SIGXFSZ, &ignore, &previous) == 0);
  rlimit saved{};
  BOOST_REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
  rlimit low = saved;
  low.rlim_cur = 64 << 10;
  BOOST_REQUIRE(::setrlimit(RLIMIT_FSIZE, &low) == 0);
  auto big = w->register_buffer(size_t{1} << 20);
  BOOST_REQUIRE(::setrlimit(RLIMIT_FSIZE, &saved) == 0);
  BOOST_REQUIRE(::sigaction(SIGXFSZ, &previous, nullptr) == 0);
  BOOST_TEST((big.status().code() == ErrorCode::kIo), big.status().to_string());
  BOOST_TEST(big.status().message().find("file size limit (ulimit -f") != std::string::npos, big.status().message());
  BOOST_TEST(buffer_objects(server.name()) == 0u);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE_MESSAGE(buf.ok(), buf.status().to_string());
  BOOST_TEST(buf->id == 0u);
  BOOST_TEST(push_one(*w, *buf));
}

// Weights and optimizer state that cannot be allocated: the server says
// how much it needed and exits, leaving no segment behind.
BOOST_AUTO_TEST_CASE(weights_too_large_for_memory_fail_cleanly) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  BOOST_TEST_MESSAGE("skipped: a sanitizer's allocator aborts on an impossible allocation instead of throwing");
  return;
#endif
  const std::string name = test::unique_name("toolarge");
  // 10^12 fp32 parameters: 4 TB of weights, more than any host here has.
  const auto run =
      test::run_captured({test::program_path("shmps-server"), "--name", name, "--tensor", "w:1000000x1000000"}, 60s);
  BOOST_TEST(run.exit_code == 1, run.output);
  BOOST_TEST(run.output.find("bytes") != std::string::npos, "no size in: " << run.output);
  BOOST_TEST(!std::filesystem::exists("/dev/shm/" + shm::segment_object_name(name)), "segment left behind");
  shm::Segment::remove(name);
}

BOOST_AUTO_TEST_SUITE_END()
