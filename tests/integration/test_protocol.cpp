// The protocol end to end: a real shmps-server process and real worker
// processes. The seed's two tests, every bad input of the core issue, and
// dying peers (worker SIGKILLed mid-run, server killed while a worker waits).
#define BOOST_TEST_MODULE test_protocol
#include <grp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
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

using test::connect;

std::vector<float> pull_all(Worker& w, const Buffer& b, uint64_t* version = nullptr) {
  auto v = w.pull(kAllTensors, b.id, 0);
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  if (version) *version = *v;
  const float* p = static_cast<const float*>(b.data);
  return std::vector<float>(p, p + w.total_elements());
}

// Shared counters for forked children.
struct SharedCounters {
  SharedCounters() {
    mem = static_cast<std::atomic<uint64_t>*>(
        ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  }
  ~SharedCounters() { ::munmap(mem, 4096); }
  std::atomic<uint64_t>* mem;
};

const std::vector<std::string> kSmall = {"--tensor",        "w:4x2", "--tensor", "b:8",     "--lr",        "0.5",
                                         "--max-staleness", "1",     "--init",   "uniform", "--init-seed", "7"};

}  // namespace

BOOST_AUTO_TEST_SUITE(protocol)

// Seed test 1: a push against version 0 returns version 1 and w = w - lr * g.
BOOST_AUTO_TEST_CASE(seed_push_at_version_0_returns_1_and_applies_sgd) {
  test::ServerProcess server(test::unique_name("seed1"), kSmall);
  auto w = connect(server.name());
  auto buf = w->register_buffer(w->total_elements() * 4);
  BOOST_REQUIRE(buf.ok());
  uint64_t v = 99;
  const std::vector<float> before = pull_all(*w, *buf, &v);
  BOOST_TEST(v == 0u);
  float* g = static_cast<float*>(buf->data);
  for (uint64_t i = 0; i < w->total_elements(); ++i) g[i] = 0.25f * static_cast<float>(i) - 1.0f;
  const std::vector<float> grad(g, g + w->total_elements());
  auto pushed = w->push(kAllTensors, buf->id, 0, w->total_elements() * 4, Dtype::kF32, 0);
  BOOST_REQUIRE_MESSAGE(pushed.ok(), pushed.status().to_string());
  BOOST_TEST(*pushed == 1u);
  const std::vector<float> after = pull_all(*w, *buf, &v);
  BOOST_TEST(v == 1u);
  for (size_t i = 0; i < after.size(); ++i) BOOST_TEST(after[i] == before[i] - 0.5f * grad[i]);
}

// A push_async, then a pull_async into another range of the
// same buffer; the pull is served after the push (it sees the update), its
// range stays unwritten until the server serves it, and wait() returns each
// result. A pull_async of a buffer never registered fails at wait().
BOOST_AUTO_TEST_CASE(pull_async_after_push_async_sees_the_update_and_answers_at_wait) {
  test::ServerProcess server(test::unique_name("pullasync"), kSmall);
  auto w = connect(server.name());
  const uint64_t n = w->total_elements();
  auto buf = w->register_buffer(2 * n * 4);
  BOOST_REQUIRE(buf.ok());
  uint64_t v = 99;
  const std::vector<float> before = pull_all(*w, *buf, &v);
  float* grad = static_cast<float*>(buf->data);
  float* pulled = grad + n;
  for (uint64_t i = 0; i < n; ++i) grad[i] = 1.0f;
  std::fill_n(pulled, n, -7.0f);
  server.process().pause();
  auto push = w->push_async(kAllTensors, buf->id, 0, n * 4, Dtype::kF32, 0);
  auto pull = w->pull_async(kAllTensors, buf->id, n * 4);
  BOOST_REQUIRE(push.ok() && pull.ok());
  BOOST_TEST(std::all_of(pulled, pulled + n, [](float x) { return x == -7.0f; }));  // not served yet
  server.process().resume();
  auto pull_version = w->wait(*pull);  // the push completes first, kept for its wait
  BOOST_REQUIRE_MESSAGE(pull_version.ok(), pull_version.status().to_string());
  BOOST_TEST(*pull_version == 1u);
  for (uint64_t i = 0; i < n; ++i) BOOST_TEST(pulled[i] == before[i] - 0.5f);
  auto push_version = w->wait(*push);
  BOOST_REQUIRE(push_version.ok());
  BOOST_TEST(*push_version == 1u);
  auto bad = w->pull_async(kAllTensors, buf->id + 1, 0);
  BOOST_REQUIRE(bad.ok());
  BOOST_TEST((w->wait(*bad).status().code() == ErrorCode::kUnknownBuffer));
}

// Seed test 2: a gradient more than max_staleness behind is rejected and
// nothing is applied; the error states both numbers.
BOOST_AUTO_TEST_CASE(seed_stale_push_is_rejected_and_nothing_applied) {
  test::ServerProcess server(test::unique_name("seed2"), kSmall);
  auto w = connect(server.name());
  auto buf = w->register_buffer(w->total_elements() * 4);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), w->total_elements(), 1.0f);
  const uint64_t bytes = w->total_elements() * 4;
  BOOST_REQUIRE(w->push(kAllTensors, buf->id, 0, bytes, Dtype::kF32, 0).ok());  // staleness 0
  BOOST_REQUIRE(w->push(kAllTensors, buf->id, 0, bytes, Dtype::kF32, 0).ok());  // staleness 1
  auto grad_buf = w->register_buffer(bytes);
  BOOST_REQUIRE(grad_buf.ok());
  const std::vector<float> before = pull_all(*w, *grad_buf);
  std::fill_n(static_cast<float*>(buf->data), w->total_elements(), 1.0f);
  auto stale = w->push(kAllTensors, buf->id, 0, bytes, Dtype::kF32, 0);  // staleness 2 > 1
  BOOST_TEST((stale.status().code() == ErrorCode::kStale));
  BOOST_TEST(stale.status().message().find("staleness 2 > max_staleness 1") != std::string::npos);
  uint64_t v = 0;
  BOOST_TEST(pull_all(*w, *grad_buf, &v) == before);
  BOOST_TEST(v == 2u);
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->rejected_stale == 1u);
  BOOST_TEST(s->my_pushes_rejected == 1u);
  BOOST_TEST(s->gradients_applied == 2u);
  BOOST_TEST(s->avg_staleness == 0.5);
}

// A stale push's answer carries the version it was behind (last_version()).
BOOST_AUTO_TEST_CASE(last_version_is_the_servers_version_in_a_stale_answer) {
  test::ServerProcess server(test::unique_name("lastv"), kSmall);
  auto w = connect(server.name());
  const uint64_t bytes = w->total_elements() * 4;
  auto buf = w->register_buffer(bytes);
  BOOST_REQUIRE(buf.ok());
  BOOST_TEST(w->last_version() == 0u);
  for (int k = 0; k < 3; ++k)
    BOOST_REQUIRE(w->push(kAllTensors, buf->id, 0, bytes, Dtype::kF32, *w->pull(kAllTensors, buf->id, 0)).ok());
  BOOST_TEST(w->last_version() == 3u);
  std::fill_n(static_cast<float*>(buf->data), w->total_elements(), 0.0f);
  auto stale = w->push(kAllTensors, buf->id, 0, bytes, Dtype::kF32, 1);  // staleness 2 > 1
  BOOST_TEST((stale.status().code() == ErrorCode::kStale));
  BOOST_TEST(w->last_version() == 3u);
  // Every answer carries the server's version: registering and
  // unregistering a buffer, or a ping, keep it.
  auto other = w->register_buffer(bytes);
  BOOST_REQUIRE(other.ok());
  BOOST_TEST(w->last_version() == 3u);
  BOOST_REQUIRE(w->unregister_buffer(other->id).ok());
  BOOST_TEST(w->last_version() == 3u);
  BOOST_REQUIRE(w->ping().ok());
  BOOST_TEST(w->last_version() == 3u);
}

// A buffer object's name may be taken by an object of this pid that this
// Worker did not make (the process's image before an exec(), another copy
// of worker_lib in the process): the registration takes the next free
// number, and leaves the other objects alone.
BOOST_AUTO_TEST_CASE(a_buffer_name_taken_by_another_object_of_this_pid_is_passed_over) {
  test::ServerProcess server(test::unique_name("taken"), kSmall);
  auto w = connect(server.name());
  const uint64_t bytes = w->total_elements() * 4;
  const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
  // The numbers of this worker's buffer objects, from /dev/shm.
  const auto numbers = [&] {
    std::vector<uint64_t> n;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      const std::string object = e.path().filename().string();
      if (object.rfind(prefix, 0) != 0) continue;
      if (auto parsed = shm::parse_buffer_object_name(object); parsed.has_value()) n.push_back(parsed->n);
    }
    std::sort(n.begin(), n.end());
    return n;
  };
  auto first = w->register_buffer(bytes);
  BOOST_REQUIRE(first.ok());
  BOOST_REQUIRE(numbers().size() == 1u);
  const uint64_t n0 = numbers()[0];
  // The next 500 names taken, as another image of this pid would.
  constexpr uint64_t kTaken = 500;
  struct Taken : std::vector<std::unique_ptr<shm::ShmObject>> {
    ~Taken() {
      for (const auto& o : *this) shm::ShmObject::remove(o->name());
    }
  } taken;
  for (uint64_t n = n0 + 1; n <= n0 + kTaken; ++n) {
    auto o = shm::ShmObject::create(shm::buffer_object_name(server.name(), ::getpid(), n), 8, 0600);
    BOOST_REQUIRE_MESSAGE(o.ok(), o.status().to_string());
    static_cast<float*>((*o)->data())[0] = 42.0f;
    taken.push_back(std::move(o).value());
  }
  auto second = w->register_buffer(bytes);
  BOOST_REQUIRE_MESSAGE(second.ok(), second.status().to_string());
  BOOST_TEST(w->push(kAllTensors, second->id, 0, bytes, Dtype::kF32, w->last_version()).ok());
  BOOST_TEST(numbers().back() == n0 + kTaken + 1);
  for (auto& o : taken) {
    BOOST_TEST(o->size() == 8u);
    BOOST_TEST(static_cast<float*>(o->data())[0] == 42.0f);
  }
}

BOOST_AUTO_TEST_CASE(init_sets_the_weights_once_and_only_before_the_first_push) {
  test::ServerProcess server(test::unique_name("init"), kSmall);
  auto first = connect(server.name());
  auto second = connect(server.name());
  const uint64_t n = first->total_elements();
  auto a = first->register_buffer(n * 4);
  auto b = second->register_buffer(n * 4);
  auto out = second->register_buffer(n * 4);
  BOOST_REQUIRE(a.ok() && b.ok() && out.ok());
  const std::vector<float> server_init = pull_all(*second, *out);
  // Refused without effect: NaN, a buffer too short, a tensor id.
  float* pa = static_cast<float*>(a->data);
  for (uint64_t i = 0; i < n; ++i) pa[i] = 0.5f + static_cast<float>(i);
  pa[3] = std::numeric_limits<float>::quiet_NaN();
  BOOST_TEST((first->init(a->id).code() == ErrorCode::kNonFinite));
  pa[3] = 3.5f;
  BOOST_TEST((first->init(a->id, 4).code() == ErrorCode::kBadRange));
  BOOST_TEST(pull_all(*second, *out) == server_init);
  // The first init wins; the second is refused naming the first.
  BOOST_REQUIRE(first->init(a->id).ok());
  std::vector<float> expected(pa, pa + n);
  std::fill_n(static_cast<float*>(b->data), n, 7.0f);
  const Status again = second->init(b->id);
  BOOST_TEST((again.code() == ErrorCode::kInitRefused));
  BOOST_TEST(
      again.message().find("already initialised by worker " + std::to_string(first->worker_id())) != std::string::npos,
      again.message());
  uint64_t v = 99;
  BOOST_TEST(pull_all(*second, *out, &v) == expected);
  BOOST_TEST(v == 0u);
  // After a push, not even a fresh server's first init is taken.
  test::ServerProcess pushed(test::unique_name("initlate"), kSmall);
  auto w = connect(pushed.name());
  auto g = w->register_buffer(n * 4);
  BOOST_REQUIRE(g.ok());
  BOOST_REQUIRE(w->push(kAllTensors, g->id, 0, n * 4, Dtype::kF32, 0).ok());
  const std::vector<float> at_1 = pull_all(*w, *g);
  std::fill_n(static_cast<float*>(g->data), n, 1.0f);
  const Status late = w->init(g->id);
  BOOST_TEST((late.code() == ErrorCode::kInitRefused));
  BOOST_TEST(late.message().find("version is 1") != std::string::npos, late.message());
  BOOST_TEST(pull_all(*w, *g) == at_1);
}

namespace {

bool refused_as_inherited(const Status& s) {
  return s.code() == ErrorCode::kInvalidArgument && s.message().find("connect its own") != std::string::npos;
}

// A child made by `fork_child` (its pid, 0 in the child) runs `in_child`
// on the parent's Worker and buffer (the exit code says what it saw: no
// Boost.Test in the child); then the parent's session and buffer still
// work.
void parent_session_survives_a_child(
    const std::string& tag, const std::function<pid_t()>& fork_child,
    const std::function<int(std::unique_ptr<Worker>&, const Buffer&, const std::string& name)>& in_child) {
  test::ServerProcess server(test::unique_name(tag), kSmall);
  auto w = connect(server.name());
  const uint64_t bytes = w->total_elements() * 4;
  auto buf = w->register_buffer(bytes);
  BOOST_REQUIRE(buf.ok());
  const pid_t child = fork_child();
  BOOST_REQUIRE(child >= 0);
  if (child == 0) ::_exit(in_child(w, *buf, server.name()));
  int status = 0;
  BOOST_REQUIRE(::waitpid(child, &status, 0) == child);
  BOOST_TEST((WIFEXITED(status) && WEXITSTATUS(status) == 0), "child exit status " << status);
  BOOST_TEST(w->ping().ok());
  BOOST_TEST(w->push(kAllTensors, buf->id, 0, bytes, Dtype::kF32, *w->pull(kAllTensors, buf->id, 0)).ok());
}

}  // namespace

// A fork()ed child that calls its parent's Worker is refused, and its
// exit leaves the parent's session and buffers alone.
BOOST_AUTO_TEST_CASE(a_forked_child_cannot_use_its_parents_worker_or_end_its_session) {
  parent_session_survives_a_child(
      "fork", [] { return ::fork(); },
      [](std::unique_ptr<Worker>& w, const Buffer& buf, const std::string& name) {
        int code = refused_as_inherited(w->ping()) ? 0 : 1;
        if (w->push(kAllTensors, buf.id, 0, w->total_elements() * 4, Dtype::kF32, 0).ok()) code = 2;
        if (w->detach().ok()) code = 3;
        w.reset();  // the destructor must not detach the parent's session
        auto own = Worker::connect(test::worker_options(name, std::chrono::seconds(5), false));
        if (!own.ok() || !(*own)->ping().ok()) code = 4;
        return code;
      });
}

// A child made without the atfork handlers (the raw fork system call, as
// _Fork() and clone() do): its detach() is refused and its destructor lets
// go, so the parent's session and buffers stay.
BOOST_AUTO_TEST_CASE(a_child_forked_without_atfork_handlers_leaves_the_parents_session) {
  parent_session_survives_a_child(
      "rawfork", [] { return static_cast<pid_t>(::syscall(SYS_fork)); },
      [](std::unique_ptr<Worker>& w, const Buffer&, const std::string&) {
        const int code = refused_as_inherited(w->detach()) ? 0 : 1;
        w.reset();
        return code;
      });
}

// A fork()ed child's writes into its parent's registered buffers stay its
// own (the atfork child handler maps them copy-on-write): the parent's
// gradient is unchanged, and its push applies only its own gradient. A
// page the child has not written shows what the parent's pulls write
// afterwards (MAP_PRIVATE of a shared object: no snapshot); one it wrote
// keeps the child's bytes.
BOOST_AUTO_TEST_CASE(a_forked_childs_writes_into_its_parents_buffers_stay_its_own) {
  test::ServerProcess server(test::unique_name("forkcow"), kSmall);  // lr 0.5
  auto w = connect(server.name());
  const uint64_t n = w->total_elements();
  constexpr uint64_t kPage = 4096;
  auto grad = w->register_buffer(n * 4);
  auto weights = w->register_buffer(2 * kPage);  // the first page the child writes, the second it only reads
  BOOST_REQUIRE(grad.ok() && weights.ok());
  float* g = static_cast<float*>(grad->data);
  std::fill_n(g, n, 1.0f);
  float* first = static_cast<float*>(weights->data);
  const float* second = first + kPage / 4;
  uint64_t v = 0;
  const std::vector<float> before = pull_all(*w, *weights, &v);
  int to_child[2];
  int to_parent[2];
  BOOST_REQUIRE(::pipe(to_child) == 0 && ::pipe(to_parent) == 0);
  const pid_t child = ::fork();
  BOOST_REQUIRE(child >= 0);
  if (child == 0) {
    std::fill_n(g, n, 100.0f);
    first[0] = -42.0f;
    float pulled = 0.0f;
    if (::write(to_parent[1], "w", 1) != 1 || ::read(to_child[0], &pulled, sizeof pulled) != sizeof pulled) ::_exit(10);
    if (g[0] != 100.0f) ::_exit(11);       // its own copy stays
    if (first[0] != -42.0f) ::_exit(12);   // a page it wrote is not overwritten by the parent's pull
    if (second[0] != pulled) ::_exit(13);  // one it did not write shows the pull
    ::_exit(0);
  }
  char c = 0;
  BOOST_REQUIRE(::read(to_parent[0], &c, 1) == 1);
  BOOST_TEST(std::all_of(g, g + n, [](float x) { return x == 1.0f; }));
  BOOST_TEST(first[0] == before[0]);
  auto pushed = w->push(kAllTensors, grad->id, 0, n * 4, Dtype::kF32, v);
  BOOST_REQUIRE_MESSAGE(pushed.ok(), pushed.status().to_string());
  const std::vector<float> after = pull_all(*w, *weights);
  for (uint64_t i = 0; i < n; ++i) BOOST_TEST(after[i] == before[i] - 0.5f);
  BOOST_REQUIRE(w->pull(kAllTensors, weights->id, kPage).ok());
  BOOST_REQUIRE(::write(to_child[1], &second[0], sizeof(float)) == sizeof(float));
  int status = 0;
  BOOST_REQUIRE(::waitpid(child, &status, 0) == child);
  BOOST_TEST((WIFEXITED(status) && WEXITSTATUS(status) == 0), "child exit status " << status);
  for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) ::close(fd);
}

BOOST_AUTO_TEST_CASE(every_bad_push_gets_its_error_and_changes_nothing) {
  test::ServerProcess server(test::unique_name("bad"), kSmall);
  auto w = connect(server.name());
  const uint64_t n = w->total_elements();
  auto buf = w->register_buffer(n * 4);
  auto out = w->register_buffer(n * 4);
  BOOST_REQUIRE(buf.ok() && out.ok());
  float* g = static_cast<float*>(buf->data);
  std::fill_n(g, n, 1.0f);
  const std::vector<float> before = pull_all(*w, *out);
  const auto expect = [&](Result<uint64_t> r, ErrorCode code, const std::string& text) {
    BOOST_TEST((r.status().code() == code), "got " << r.status().to_string());
    BOOST_TEST(r.status().message().find(text) != std::string::npos,
               "'" << r.status().message() << "' lacks '" << text << "'");
  };
  expect(w->push(kAllTensors, buf->id, 0, n * 4 - 4, Dtype::kF32, 0), ErrorCode::kBadLength, "needs 64");
  expect(w->push(0, buf->id, 0, 8 * 4 + 4, Dtype::kF32, 0), ErrorCode::kBadLength, "w needs 32");
  expect(w->push(0, buf->id, 0, 8 * 4, Dtype::kF16, 0), ErrorCode::kBadLength, "needs 16 (f16)");
  expect(w->push(0, buf->id, 0, 8 * 4, static_cast<Dtype>(9), 0), ErrorCode::kBadDtype, "dtype 9");
  expect(w->push(5, buf->id, 0, 8 * 4, Dtype::kF32, 0), ErrorCode::kUnknownTensor, "tensor id 5");
  expect(w->push(0, 7, 0, 8 * 4, Dtype::kF32, 0), ErrorCode::kUnknownBuffer, "buffer 7");
  expect(w->push(0, 99, 0, 8 * 4, Dtype::kF32, 0), ErrorCode::kUnknownBuffer, "buffer 99");
  expect(w->push(0, buf->id, n * 4 - 16, 8 * 4, Dtype::kF32, 0), ErrorCode::kBadRange, "> buffer 64");
  expect(w->push(0, buf->id, ~uint64_t{0} - 8, 8 * 4, Dtype::kF32, 0), ErrorCode::kBadRange, "offset");
  expect(w->push(0, buf->id, 0, 8 * 4, Dtype::kF32, 5), ErrorCode::kBadRequest, "ahead of version 0");
  g[3] = std::numeric_limits<float>::quiet_NaN();
  expect(w->push(0, buf->id, 0, 8 * 4, Dtype::kF32, 0), ErrorCode::kNonFinite, "NaN or Inf");
  g[3] = 1.0f;
  g[15] = std::numeric_limits<float>::infinity();
  expect(w->push(kAllTensors, buf->id, 0, n * 4, Dtype::kF32, 0), ErrorCode::kNonFinite, "NaN or Inf");
  expect(w->pull(9, out->id, 0), ErrorCode::kUnknownTensor, "tensor id 9");
  expect(w->pull(kAllTensors, out->id, 8), ErrorCode::kBadRange, "offset 8");
  uint64_t v = 99;
  BOOST_TEST(pull_all(*w, *out, &v) == before);
  BOOST_TEST(v == 0u);
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->gradients_applied == 0u);
  BOOST_TEST(s->rejected_nonfinite == 2u);
  BOOST_TEST(s->my_pushes_rejected == 12u);
  BOOST_TEST(w->push(kAllTensors, buf->id, 0, n * 4, Dtype::kF32, 0).status().code() == ErrorCode::kNonFinite);
  g[15] = 1.0f;
  BOOST_TEST(w->push(kAllTensors, buf->id, 0, n * 4, Dtype::kF32, 0).ok());  // still serving
}

// The rejected_* counters count refused requests of every kind by cause
// (shmps/server_stats.hpp): three bad pulls are three rejected_invalid,
// an init of NaN weights a rejected_nonfinite, and none
// is a push the worker's own my_pushes_rejected counts.
BOOST_AUTO_TEST_CASE(rejected_counters_count_refused_requests_of_every_kind) {
  test::ServerProcess server(test::unique_name("rejcount"), kSmall);
  auto w = connect(server.name());
  auto out = w->register_buffer(w->total_elements() * 4);
  BOOST_REQUIRE(out.ok());
  BOOST_TEST((w->pull(kAllTensors, out->id, 8).status().code() == ErrorCode::kBadRange));
  BOOST_TEST((w->pull(9, out->id, 0).status().code() == ErrorCode::kUnknownTensor));
  BOOST_TEST((w->pull(0, 7, 0).status().code() == ErrorCode::kUnknownBuffer));
  std::fill_n(static_cast<float*>(out->data), w->total_elements(), std::numeric_limits<float>::quiet_NaN());
  BOOST_TEST((w->init(out->id).code() == ErrorCode::kNonFinite));
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->rejected_invalid == 3u);
  BOOST_TEST(s->rejected_nonfinite == 1u);
  BOOST_TEST(s->rejected_stale == 0u);
  BOOST_TEST(s->rejected_timeout == 0u);
  BOOST_TEST(s->my_pushes_rejected == 0u);
}

BOOST_AUTO_TEST_CASE(nonfinite_gradients_apply_when_allowed) {
  std::vector<std::string> args = kSmall;
  args.push_back("--allow-nonfinite");
  test::ServerProcess server(test::unique_name("nan"), args);
  auto w = connect(server.name());
  auto buf = w->register_buffer(w->total_elements() * 4);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 8, std::numeric_limits<float>::quiet_NaN());
  BOOST_TEST(w->push(0, buf->id, 0, 32, Dtype::kF32, 0).ok());
  BOOST_TEST(std::isnan(pull_all(*w, *buf)[0]));
}

BOOST_AUTO_TEST_CASE(garbage_descriptors_and_buffers_from_a_raw_client) {
  test::ServerProcess server(test::unique_name("raw"), kSmall);
  test::RawClient raw(server.name());
  const auto code = [](const shm::Completion& c) { return static_cast<ErrorCode>(c.code); };
  shm::Request r = raw.request(shm::Opcode::kPing);
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kOk));
  r.opcode = 0;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  r.opcode = 12345;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  r = raw.request(shm::Opcode::kPing);
  r.flags = 1;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  r = raw.request(shm::Opcode::kPing);
  r.lease ^= 1;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  r = raw.request(shm::Opcode::kPing);
  r.worker_id = raw.id() + 1;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  r = raw.request(shm::Opcode::kAttach);
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  // Buffer descriptors: unterminated name, the control segment itself, a
  // missing object, a range past the object.
  shm::BufferDesc& d = raw.segment().buffer(raw.id(), 0);
  r = raw.request(shm::Opcode::kRegisterBuffer);
  d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
  d.length = 16;
  std::memset(d.handle, 'A', sizeof d.handle);
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  std::snprintf(reinterpret_cast<char*>(d.handle), sizeof d.handle, "%s",
                shm::segment_object_name(server.name()).c_str());
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  // Objects that start as this worker's buffer names do but are not one:
  // the control segment of a server named "<name>.p<pid>.x", and worker
  // 1's buffer of a server named "<name>.p<pid>".
  const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
  for (const std::string& foreign : {prefix + "x", prefix + "p1.0", prefix + "1.2"}) {
    auto planted = shm::ShmObject::create(foreign, 4096, 0600);
    BOOST_REQUIRE(planted.ok());
    std::snprintf(reinterpret_cast<char*>(d.handle), sizeof d.handle, "%s", foreign.c_str());
    BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest), foreign);
    shm::ShmObject::remove(foreign);
  }
  const std::string own = shm::buffer_object_name(server.name(), ::getpid(), 7);
  std::snprintf(reinterpret_cast<char*>(d.handle), sizeof d.handle, "%s", own.c_str());
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kUnknownBuffer));
  auto obj = shm::ShmObject::create(own, 4096, 0600);
  BOOST_REQUIRE(obj.ok());
  d.length = 4096;
  d.offset = 8;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRange));
  d.offset = 0;
  d.kind = 77;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));
  d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
  r.buffer_id = 1000;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kUnknownBuffer));
  r.buffer_id = 0;
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kOk));
  BOOST_TEST((code(raw.call(r)) == ErrorCode::kBadRequest));  // registered twice
  shm::ShmObject::remove(own);
  // A well-behaved worker is served all along, and after the raw client
  // corrupts its lane indices and gets evicted.
  auto w = connect(server.name());
  BOOST_TEST(w->ping().ok());
  raw.segment().lane(raw.id()).tail.store(raw.lane().tail() + 100000);
  raw.segment().header().doorbell[0].fetch_or(uint64_t{1} << raw.id());
  shm::notify(raw.segment().header().server_wake);
  BOOST_TEST(test::eventually([&] {
    return shm::owner_state(raw.segment().worker(raw.id()).owner.load()) ==
           static_cast<uint32_t>(shm::WorkerState::kDetached);
  }));
  BOOST_TEST(w->ping().ok());
  BOOST_TEST(raw.segment().stats().lanes_corrupt.load() == 1u);
}

BOOST_AUTO_TEST_CASE(full_lane_waits_then_reports_busy_and_loses_nothing) {
  const std::vector<std::string> args = {"--tensor", "w:4x2", "--ring-capacity", "2", "--max-staleness", "100"};
  test::ServerProcess server(test::unique_name("busy"), args);
  auto w = connect(server.name(), 300ms);
  auto buf = w->register_buffer(32);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 8, 1.0f);
  server.process().pause();
  auto t1 = w->push_async(0, buf->id, 0, 32, Dtype::kF32, 0);
  auto t2 = w->push_async(0, buf->id, 0, 32, Dtype::kF32, 0);
  BOOST_REQUIRE(t1.ok() && t2.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto t3 = w->push_async(0, buf->id, 0, 32, Dtype::kF32, 0);
  BOOST_TEST((t3.status().code() == ErrorCode::kBusy), t3.status().to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 >= 290ms));
  server.process().resume();
  auto v1 = w->wait(*t1);
  auto v2 = w->wait(*t2);
  BOOST_REQUIRE(v1.ok() && v2.ok());
  BOOST_TEST(*v1 == 1u);
  BOOST_TEST(*v2 == 2u);
  BOOST_TEST((w->wait(*t1).status().code() == ErrorCode::kInvalidArgument));  // already waited
  BOOST_TEST(w->stats()->gradients_applied == 2u);
}

// answered(ticket) is true once the answer is in the completion queue,
// before wait() takes it: wait() then returns at once.
BOOST_AUTO_TEST_CASE(answered_is_true_once_the_answer_is_posted) {
  test::ServerProcess server(test::unique_name("answered"), kSmall);
  auto w = connect(server.name(), 10s);
  auto buf = w->register_buffer(32);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 8, 1.0f);
  auto t = w->push_async(0, buf->id, 0, 32, Dtype::kF32, 0);
  BOOST_REQUIRE(t.ok());
  BOOST_TEST(test::eventually([&] { return w->answered(*t); }, 5s));
  BOOST_TEST(!w->answered(*t + 1));  // never issued
  server.process().pause();          // wait() has nothing more to wait for
  const auto t0 = std::chrono::steady_clock::now();
  auto v = w->wait(*t);
  server.process().resume();
  BOOST_TEST(v.ok(), v.status().to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 1s));
  BOOST_TEST(w->answered(*t));
}

// The answer to a synchronous call that timed out has no ticket to claim
// it: it is let go when it comes, not kept. Request ids are the tickets'
// numbers, so each such call's id is known here: wait() on it finds no
// answer kept (kInvalidArgument, "already waited for").
BOOST_AUTO_TEST_CASE(answers_of_timed_out_synchronous_calls_are_not_kept) {
  test::ServerProcess server(test::unique_name("abandoned"), kSmall);
  // The pings against the paused server give up through the interrupted
  // hook, as through a timeout (the calls around them keep a long one).
  std::atomic<bool> paused{false};
  WorkerOptions o = test::worker_options(server.name(), 10s, false);
  o.interrupted = [&] { return paused.load(); };
  auto made = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(made.ok(), made.status().to_string());
  std::unique_ptr<Worker> w = std::move(made).value();
  auto buf = w->register_buffer(32);
  BOOST_REQUIRE(buf.ok());
  auto before = w->pull_async(0, buf->id, 0);
  BOOST_REQUIRE(before.ok());
  BOOST_REQUIRE(w->wait(*before).ok());
  server.process().pause();
  paused = true;
  constexpr int kCalls = 10;
  for (int i = 0; i < kCalls; ++i) {
    const Status s = w->ping();
    BOOST_REQUIRE_MESSAGE((s.code() == ErrorCode::kInterrupted), s.to_string());
  }
  paused = false;
  server.process().resume();
  auto after = w->pull_async(0, buf->id, 0);
  BOOST_REQUIRE(after.ok());
  BOOST_REQUIRE(*after == *before + kCalls + 1);
  BOOST_REQUIRE(w->wait(*after).ok());  // takes the pings' answers first, in request order
  for (Worker::Ticket id = *before + 1; id < *after; ++id) {
    auto kept = w->wait(id);
    BOOST_TEST((kept.status().code() == ErrorCode::kInvalidArgument),
               "request " << id << ": " << kept.status().to_string());
  }
}

BOOST_AUTO_TEST_CASE(no_server_fails_at_once_naming_the_segment) {
  const auto t0 = std::chrono::steady_clock::now();
  WorkerOptions o;
  o.name = test::unique_name("absent");
  auto w = Worker::connect(o);
  BOOST_TEST((w.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(w.status().message().find("/dev/shm/shmps." + o.name) != std::string::npos);
  // At once: a wait would be a start's 2 s at least (a loaded machine can
  // take tens of ms for the call itself).
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 1s));
}

// The README's snippet calls value() without checking ok(): on an error it
// must throw the error, never hand back an empty value.
BOOST_AUTO_TEST_CASE(value_of_an_error_throws_the_status) {
  WorkerOptions o;
  o.name = test::unique_name("absent");
  auto w = Worker::connect(o);
  BOOST_REQUIRE(!w.ok());
  try {
    (void)w.value();
    BOOST_FAIL("value() of an error returned");
  } catch (const BadResultAccess& e) {
    BOOST_TEST((e.status().code() == ErrorCode::kServerNotRunning));
    BOOST_TEST(std::string(e.what()).find("server_not_running: no shmps server named '" + o.name + "'") == 0, e.what());
  }
  BOOST_CHECK_THROW((void)w->get(), BadResultAccess);
  BOOST_CHECK_THROW((void)*std::move(w), BadResultAccess);
  Result<int> fine(7);
  BOOST_TEST(fine.value() == 7);
}

// A worker started before its server waits up to wait_for_server for it.
BOOST_AUTO_TEST_CASE(wait_for_server_attaches_to_a_server_that_starts_later) {
  const std::string name = test::unique_name("late");
  WorkerOptions o;
  o.name = name;
  o.wait_for_server = 20s;
  std::unique_ptr<test::ServerProcess> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<test::ServerProcess>(name, kSmall);
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto w = Worker::connect(o);
  const auto waited = std::chrono::steady_clock::now() - t0;
  starter.join();
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  BOOST_TEST((waited >= 300ms));
  BOOST_TEST((*w)->ping().ok());
}

// ... and over a dead server's segment until its replacement runs (a
// systemd restart); without a server it gives up after the wait, saying so.
BOOST_AUTO_TEST_CASE(wait_for_server_rides_out_a_restart_and_gives_up_after_the_wait) {
  const std::string name = test::unique_name("restartwait");
  auto first = std::make_unique<test::ServerProcess>(name, kSmall);
  first->process().kill_and_reap();  // SIGKILL: the segment stays, its server is dead
  BOOST_REQUIRE(std::filesystem::exists("/dev/shm/shmps." + name));
  WorkerOptions o;
  o.name = name;
  o.wait_for_server = 250ms;
  auto t0 = std::chrono::steady_clock::now();
  auto none = Worker::connect(o);
  BOOST_TEST((none.status().code() == ErrorCode::kServerNotRunning), none.status().to_string());
  BOOST_TEST(none.status().message().find("after waiting 250 ms") != std::string::npos, none.status().message());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 >= 250ms));
  o.wait_for_server = 20s;
  std::unique_ptr<test::ServerProcess> second;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    second = std::make_unique<test::ServerProcess>(name, kSmall);
  });
  auto w = Worker::connect(o);
  starter.join();
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  BOOST_TEST((*w)->ping().ok());
  o.wait_for_server = -1ms;
  BOOST_TEST((Worker::connect(o).status().code() == ErrorCode::kInvalidArgument));
}

// The interrupted hook calling the Worker it interrupts is refused
// (kInvalidArgument): the inner call would take the waiting call's
// answers. The outer call ends as the hook says, and the Worker goes on.
BOOST_AUTO_TEST_CASE(a_call_from_the_interrupted_hook_is_refused) {
  test::ServerProcess server(test::unique_name("hookcall"), kSmall);
  WorkerOptions o = test::worker_options(server.name(), 10s, /*reconnect=*/false);
  Worker* self = nullptr;
  Status inner = Status::Ok();
  o.interrupted = [&] {
    if (self == nullptr) return false;
    inner = self->ping();
    return true;
  };
  auto w = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  BOOST_REQUIRE((*w)->ping().ok());
  self = w->get();
  server.process().pause();
  const Status outer = (*w)->ping();  // waits; the hook calls the Worker, then says stop
  server.process().resume();
  self = nullptr;
  BOOST_TEST((outer.code() == ErrorCode::kInterrupted), outer.to_string());
  BOOST_TEST((inner.code() == ErrorCode::kInvalidArgument), inner.to_string());
  BOOST_TEST(inner.message().find("interrupted hook") != std::string::npos, inner.message());
  BOOST_TEST((*w)->ping().ok());
}

// WorkerOptions::interrupted is asked while connect() waits for a server
// (wait_for_server) and while a reconnecting call waits for one to come
// back: true ends either wait with kInterrupted, long before its timeout.
BOOST_AUTO_TEST_CASE(an_interrupted_wait_for_a_server_gives_up_at_once) {
  const std::string name = test::unique_name("interrupted");
  WorkerOptions o = test::worker_options(name, 20s, /*reconnect=*/true);
  o.wait_for_server = 20s;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> asked{0};
  o.interrupted = [&] {
    asked.fetch_add(1);
    return stop.load();
  };
  std::thread stopper([&] {
    std::this_thread::sleep_for(200ms);
    stop.store(true);
  });
  auto t0 = std::chrono::steady_clock::now();
  auto none = Worker::connect(o);
  stopper.join();
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 2s));
  BOOST_REQUIRE(!none.ok());
  BOOST_TEST((none.status().code() == ErrorCode::kInterrupted), none.status().to_string());
  BOOST_TEST(none.status().message().find("no shmps server named") != std::string::npos, none.status().message());
  BOOST_TEST(asked.load() > 1u);  // asked between polls, not only at the end

  stop.store(false);
  auto server = std::make_unique<test::ServerProcess>(name, kSmall);
  auto w = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  BOOST_REQUIRE((*w)->ping().ok());
  server->process().kill_and_reap();  // the segment stays, its server is dead
  Status lost = (*w)->ping();         // the call that finds it dead: reconnect waits for the next call
  BOOST_TEST((lost.code() == ErrorCode::kServerRestarted || lost.code() == ErrorCode::kServerNotRunning),
             lost.to_string());
  stop.store(true);
  t0 = std::chrono::steady_clock::now();
  Status waited = (*w)->ping();  // waits for a server that is not coming, then is asked to stop
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 2s));
  BOOST_TEST((waited.code() == ErrorCode::kInterrupted), waited.to_string());
  stop.store(false);
  server.reset();  // (its end unlinks the dead server's segment)
  server = std::make_unique<test::ServerProcess>(name, kSmall);
  BOOST_TEST((*w)->ping().ok());  // the Worker re-attaches on its next call
}

// shmps::ServerProcess (server_process.hpp): a server that exits at start
// is reported with its code; one that starts returns once a worker can
// attach, and its end removes the segment.
BOOST_AUTO_TEST_CASE(server_process_starts_reports_and_cleans_up) {
  ServerProcess::Options o;
  o.binary = test::program_path("shmps-server");
  o.name = test::unique_name("launch");
  o.args = {"--tensor", "w:4", "--optimizer", "adam", "--momentum", "0.9"};  // an SGD option: refused
  auto bad = ServerProcess::start(o);
  BOOST_TEST((bad.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(bad.status().message().find("exited with 2") != std::string::npos, bad.status().message());
  o.args = {"--tensor", "w:4"};
  {
    auto server = ServerProcess::start(o);
    BOOST_REQUIRE_MESSAGE(server.ok(), server.status().to_string());
    auto w = connect(o.name);  // attaches at once
    BOOST_TEST(w->ping().ok());
    BOOST_TEST((*server)->stop() == 0);
  }
  BOOST_TEST(!std::filesystem::exists("/dev/shm/shmps." + o.name));
  o.binary = "/nonexistent/shmps-server";
  BOOST_TEST((ServerProcess::start(o).status().code() == ErrorCode::kServerNotRunning));
}

// stop() of a paused server (ServerProcess::pause()) resumes it, so the
// server handles its SIGTERM (a final checkpoint, exit 0) at once rather
// than being killed at the end of the timeout.
BOOST_AUTO_TEST_CASE(stop_of_a_paused_server_process_exits_cleanly_at_once) {
  ServerProcess::Options o;
  o.binary = test::program_path("shmps-server");
  o.name = test::unique_name("pausedstop");
  o.args = {"--tensor", "w:4"};
  auto server = ServerProcess::start(o);
  BOOST_REQUIRE_MESSAGE(server.ok(), server.status().to_string());
  (*server)->process().pause();
  const auto t0 = std::chrono::steady_clock::now();
  BOOST_TEST((*server)->stop(5s) == 0);
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 3s));
  BOOST_TEST(!std::filesystem::exists("/dev/shm/shmps." + o.name));
}

// A ServerProcess removes only the segment its own child left: a successor
// under the same name, started before the dead server's handle is dropped
// (a supervisor's restart), keeps its live segment; and a start that times
// out (a child that never publishes) leaves the live server's segment at
// the name alone.
BOOST_AUTO_TEST_CASE(a_server_process_removes_only_the_segment_its_child_left) {
  ServerProcess::Options o;
  o.binary = test::program_path("shmps-server");
  o.name = test::unique_name("successor");
  o.args = {"--tensor", "w:4"};
  auto first = ServerProcess::start(o);
  BOOST_REQUIRE_MESSAGE(first.ok(), first.status().to_string());
  (*first)->process().kill_and_reap();  // SIGKILL: its segment stays
  auto second = ServerProcess::start(o);
  BOOST_REQUIRE_MESSAGE(second.ok(), second.status().to_string());
  first->reset();
  const std::string path = "/dev/shm/shmps." + o.name;
  BOOST_TEST(std::filesystem::exists(path));
  BOOST_TEST(connect(o.name, 2s)->ping().ok());

  // A child that never publishes: its start times out with the second
  // server live under the name.
  test::TempDir dir("silent");
  const std::string silent = (dir.path / "silent.sh").string();
  {
    std::ofstream script(silent);
    script << "#!/bin/sh\nexec sleep 30\n";
  }
  std::filesystem::permissions(silent, std::filesystem::perms::owner_all);
  ServerProcess::Options s = o;
  s.binary = silent;
  s.start_timeout = 200ms;
  auto timed_out = ServerProcess::start(s);
  BOOST_TEST((timed_out.status().code() == ErrorCode::kServerNotRunning), timed_out.status().to_string());
  BOOST_TEST(timed_out.status().message().find("did not publish") != std::string::npos);
  BOOST_TEST(std::filesystem::exists(path));
  BOOST_TEST(connect(o.name, 2s)->ping().ok());

  BOOST_TEST((*second)->stop() == 0);
  second->reset();
  BOOST_TEST(!std::filesystem::exists(path));
}

// A child spawned with die_with_parent lives as long as the process that
// spawned it, not as long as the thread: one spawned (or fork_run) from a
// thread that has returned runs to its own end; it still takes SIGTERM
// (the caller's signal mask, not the forking thread's); and it is
// signalled once its parent process ends (checked in a process of its own,
// which forks from a thread that returns, then exits).
BOOST_AUTO_TEST_CASE(a_child_that_dies_with_its_parent_outlives_the_thread_that_spawned_it) {
  // First, while this process has one thread: its child starts threads
  // (a multithreaded process's child may not under ThreadSanitizer).
  auto* grandchild = test::map_shared<std::atomic<pid_t>>();
  auto parent = test::Process::fork_fn([grandchild] {
    ChildProcess kept;
    std::thread([&] {
      ChildProcess::SpawnOptions o;
      o.die_with_parent = true;
      auto s = ChildProcess::spawn({"/bin/sleep", "30"}, o);
      if (s.ok()) kept = std::move(*s);
      std::this_thread::sleep_for(100ms);  // the child is past setting its death signal
    }).join();
    if (!kept.running()) return 2;
    grandchild->store(kept.pid());
    std::this_thread::sleep_for(300ms);
    int code = 0;
    const bool ended = kept.try_wait(&code);
    ::_exit(ended ? 3 : 0);  // leaves `kept` running: only this process's end may signal it
  });
  BOOST_TEST(parent.wait(10s) == 0);
  const pid_t pid = grandchild->load();
  BOOST_REQUIRE(pid > 0);
  // Reparented and reaped by init (or a subreaper).
  BOOST_TEST(test::eventually([pid] { return test::process_ended(pid); }, 5s));
  if (!test::process_ended(pid)) ::kill(pid, SIGKILL);

  ChildProcess::SpawnOptions die;
  die.die_with_parent = true;
  ChildProcess spawned, forked;
  std::thread([&] {
    auto s = ChildProcess::spawn({"/bin/sh", "-c", "sleep 0.5; exit 5"}, die);
    if (s.ok()) spawned = std::move(*s);
    auto f = ChildProcess::fork_run(
        [] {
          std::this_thread::sleep_for(500ms);
          return 7;
        },
        /*die_with_parent=*/true);
    if (f.ok()) forked = std::move(*f);
    std::this_thread::sleep_for(100ms);  // both children are past setting their death signal
  }).join();
  BOOST_REQUIRE(spawned.running() && forked.running());
  BOOST_TEST(spawned.wait(10s) == 5);  // 128 + SIGTERM if the thread's end had signalled it
  BOOST_TEST(forked.wait(10s) == 7);   // 128 + SIGKILL likewise

  auto sleeper = ChildProcess::spawn({"/bin/sleep", "30"}, die);
  BOOST_REQUIRE(sleeper.ok());
  std::this_thread::sleep_for(50ms);  // past the exec
  sleeper->signal(SIGTERM);
  BOOST_TEST(sleeper->wait(5s) == 128 + SIGTERM);
}

BOOST_AUTO_TEST_CASE(server_killed_while_a_worker_waits_returns_an_error_not_a_hang) {
  test::ServerProcess server(test::unique_name("killsrv"), kSmall);
  auto w = connect(server.name(), 10s);
  auto buf = w->register_buffer(32);
  BOOST_REQUIRE(buf.ok());
  server.process().pause();
  auto t = w->push_async(0, buf->id, 0, 32, Dtype::kF32, 0);
  BOOST_REQUIRE(t.ok());
  std::thread killer([&] {
    std::this_thread::sleep_for(100ms);
    server.process().kill_and_reap();
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto r = w->wait(*t);
  killer.join();
  BOOST_TEST((r.status().code() == ErrorCode::kServerNotRunning), r.status().to_string());
  BOOST_TEST(r.status().message().find("died") != std::string::npos);
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 2s));
  BOOST_TEST((w->ping().code() == ErrorCode::kServerNotRunning));
}

BOOST_AUTO_TEST_CASE(foreign_object_or_other_layout_fails_at_attach) {
  const std::string name = test::unique_name("foreign");
  {
    auto obj = shm::ShmObject::create(shm::segment_object_name(name), 8192, 0600);
    BOOST_REQUIRE(obj.ok());
    std::memset((*obj)->data(), 0x5a, 8192);
  }
  WorkerOptions o;
  o.name = name;
  auto w = Worker::connect(o);
  BOOST_TEST((w.status().code() == ErrorCode::kLayoutMismatch));
  BOOST_TEST(w.status().message().find("not a shmps segment") != std::string::npos);
  shm::Segment::remove(name);
}

// An object at the name whose header was never written (all zeros: a
// start killed between sizing and writing it), unchanged for longer than a
// start's wait and locked by no process, is no start in progress: connect()
// says so at once, naming the object and the command that removes it.
BOOST_AUTO_TEST_CASE(an_unwritten_segment_left_by_a_dead_start_fails_at_once) {
  const std::string name = test::unique_name("zeros");
  {
    auto obj = shm::ShmObject::create(shm::segment_object_name(name), 8192, 0600);
    BOOST_REQUIRE(obj.ok());
  }
  std::this_thread::sleep_for(shm::kSegmentStartWait + 300ms);
  WorkerOptions o;
  o.name = name;
  const auto t0 = std::chrono::steady_clock::now();
  auto w = Worker::connect(o);
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 1s));
  BOOST_TEST((w.status().code() == ErrorCode::kServerNotRunning), w.status().to_string());
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  BOOST_TEST(w.status().message().find(path + " (owner ") != std::string::npos, w.status().message());
  BOOST_TEST(w.status().message().find("is not initialised (no header: its magic is zero)") != std::string::npos,
             w.status().message());
  BOOST_TEST(w.status().message().find("or remove it: rm " + path) != std::string::npos, w.status().message());
  shm::Segment::remove(name);
}

BOOST_AUTO_TEST_CASE(sigterm_fails_queued_requests_removes_segment_exits_0) {
  test::ServerProcess server(test::unique_name("term"), kSmall);
  auto w = connect(server.name(), 5s);
  auto buf = w->register_buffer(32);
  BOOST_REQUIRE(buf.ok());
  server.process().pause();
  auto t = w->push_async(0, buf->id, 0, 32, Dtype::kF32, 0);
  BOOST_REQUIRE(t.ok());
  server.process().signal(SIGTERM);
  server.process().resume();
  auto r = w->wait(*t);
  // Either it was served before the stop flag was seen, or it was failed.
  BOOST_TEST((r.ok() || r.status().code() == ErrorCode::kShuttingDown), r.status().to_string());
  BOOST_TEST(server.process().wait(10s) == 0);
  BOOST_TEST(!std::filesystem::exists("/dev/shm/shmps." + server.name()));
  BOOST_TEST((w->ping().code() == ErrorCode::kServerNotRunning));
}

BOOST_AUTO_TEST_CASE(crashed_server_segment_is_replaced_live_one_is_not) {
  const std::string name = test::unique_name("restart");
  auto first = std::make_unique<test::ServerProcess>(name, kSmall);
  auto w = connect(name);
  // A second server of the same name refuses to start.
  std::vector<std::string> argv{test::program_path("shmps-server"), "--name", name};
  argv.insert(argv.end(), kSmall.begin(), kSmall.end());
  auto second = test::Process::spawn(argv);
  BOOST_TEST(second.wait(10s) == 1);
  BOOST_TEST(w->ping().ok());
  const uint64_t old_generation = w->generation();
  first->process().kill_and_reap();  // SIGKILL: the segment stays behind
  BOOST_TEST(std::filesystem::exists("/dev/shm/shmps." + name));
  test::ServerProcess replacement(name, kSmall);
  auto w2 = connect(name);
  BOOST_TEST(w2->generation() != old_generation);
  BOOST_TEST(w2->ping().ok());
  BOOST_TEST((w->ping().code() == ErrorCode::kServerNotRunning));
}

BOOST_AUTO_TEST_CASE(sigkilled_worker_is_reaped_while_others_keep_pushing) {
  std::vector<std::string> args = {"--tensor",        "w:1",        "--lr",          "1",
                                   "--max-staleness", "4000000000", "--max-workers", "3"};
  test::ServerProcess server(test::unique_name("killwrk"), args);
  SharedCounters counters;  // [i]: pushes acknowledged to worker i
  std::vector<test::Process> workers;
  for (int i = 0; i < 3; ++i) {
    workers.push_back(test::Process::fork_fn([&, i] {
      WorkerOptions o;
      o.name = server.name();
      auto w = Worker::connect(o);
      if (!w.ok()) return 2;
      auto buf = (*w)->register_buffer(4);
      if (!buf.ok()) return 3;
      *static_cast<float*>(buf->data) = -1.0f;
      const auto end = std::chrono::steady_clock::now() + 1500ms;
      while (std::chrono::steady_clock::now() < end) {
        auto v = (*w)->push(0, buf->id, 0, 4, Dtype::kF32, 0);
        if (!v.ok()) return 4;
        counters.mem[i].fetch_add(1);
      }
      return 0;
    }));
  }
  BOOST_REQUIRE(test::eventually([&] { return counters.mem[0].load() > 100; }));
  workers[0].kill_and_reap();
  BOOST_TEST(workers[1].wait(20s) == 0);
  BOOST_TEST(workers[2].wait(20s) == 0);
  // The dead worker's entry is free again: all three slots can be taken.
  std::vector<std::unique_ptr<Worker>> fresh;
  BOOST_REQUIRE(test::eventually([&] {
    WorkerOptions o;
    o.name = server.name();
    auto w = Worker::connect(o);
    if (w.ok()) fresh.push_back(std::move(w).value());
    return fresh.size() == 3;
  }));
  auto s = fresh[0]->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->workers_died == 1u);
  BOOST_TEST(s->workers_attached == 3u);
  const uint64_t acked = counters.mem[0] + counters.mem[1] + counters.mem[2];
  // Every acknowledged push was applied once; the dead worker may have had
  // one more applied but unacknowledged.
  BOOST_TEST(s->gradients_applied >= acked);
  BOOST_TEST(s->gradients_applied <= acked + 1);
  auto buf = fresh[0]->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  BOOST_TEST(pull_all(*fresh[0], *buf)[0] == static_cast<float>(s->gradients_applied));
}

BOOST_AUTO_TEST_CASE(four_processes_many_pushes_each_applied_exactly_once) {
  std::vector<std::string> args = {"--tensor", "w:1", "--lr", "1", "--max-staleness", "100000000"};
  test::ServerProcess server(test::unique_name("many"), args);
  constexpr int kWorkers = 4;
  constexpr int kPushes = 25000;
  std::vector<test::Process> workers;
  for (int i = 0; i < kWorkers; ++i) {
    workers.push_back(test::Process::fork_fn([&] {
      WorkerOptions o;
      o.name = server.name();
      auto w = Worker::connect(o);
      if (!w.ok()) return 2;
      auto buf = (*w)->register_buffer(4);
      if (!buf.ok()) return 3;
      *static_cast<float*>(buf->data) = -1.0f;
      uint64_t last = 0;
      std::vector<Worker::Ticket> tickets;
      for (int n = 0; n < kPushes; n += 8) {  // async batches of 8, in order
        tickets.clear();
        for (int k = 0; k < 8; ++k) {
          auto t = (*w)->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
          if (!t.ok()) return 4;
          tickets.push_back(*t);
        }
        for (auto t : tickets) {
          auto v = (*w)->wait(t);
          if (!v.ok() || *v <= last) return 5;  // versions strictly increase per worker
          last = *v;
        }
      }
      return 0;
    }));
  }
  for (auto& p : workers) BOOST_TEST(p.wait(120s) == 0);
  auto w = connect(server.name());
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->gradients_applied == uint64_t{kWorkers} * kPushes);
  BOOST_TEST(s->version == uint64_t{kWorkers} * kPushes);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  BOOST_TEST(pull_all(*w, *buf)[0] == static_cast<float>(kWorkers * kPushes));  // exact in fp32
}

BOOST_AUTO_TEST_CASE(detach_frees_the_entry_at_once_for_a_living_process) {
  test::ServerProcess server(test::unique_name("detach"), {"--tensor", "w:1", "--max-workers", "1"});
  for (int round = 0; round < 5; ++round) {
    auto w = connect(server.name(), 2s);  // the only entry: free again each round
    BOOST_TEST(w->ping().ok());
    BOOST_TEST(w->detach().ok());
    BOOST_TEST((w->ping().code() == ErrorCode::kUnknownWorker));
  }
  auto w = connect(server.name());
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->workers_died == 0u);
  BOOST_TEST(s->workers_attached == 1u);
}

// An entry held by a process that is gone is the server's to free, within
// its housekeeping period: a connect meanwhile waits for it rather than
// answering kNoCapacity.
BOOST_AUTO_TEST_CASE(a_connect_waits_for_the_entry_of_a_process_gone) {
  test::ServerProcess server(test::unique_name("gone"), {"--tensor", "w:1", "--max-workers", "1"});
  for (int round = 0; round < 5; ++round) {
    test::Process child = test::Process::fork_fn([&] {
      auto w = Worker::connect(test::worker_options(server.name(), 5s, false));
      if (!w.ok() || !(*w)->ping().ok()) return 1;
      (void)std::move(w).value().release();  // no detach: the entry stays taken
      return 0;
    });
    BOOST_REQUIRE(child.wait(10s) == 0);
    auto w = Worker::connect(test::worker_options(server.name(), 5s, false));
    BOOST_REQUIRE_MESSAGE(w.ok(), "round " << round << ": " << w.status().to_string());
    BOOST_TEST((*w)->ping().ok());
  }
  // Held by a living process, the entry is no one else's: kNoCapacity
  // without waiting for the timeout.
  auto holder = connect(server.name());
  const auto t0 = std::chrono::steady_clock::now();
  auto refused = Worker::connect(test::worker_options(server.name(), 5s, false));
  BOOST_TEST((refused.status().code() == ErrorCode::kNoCapacity), refused.status().to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 4s));
}

BOOST_AUTO_TEST_CASE(ring_depth_high_water_counts_queued_requests) {
  test::ServerProcess server(test::unique_name("depth"), {"--tensor", "w:1", "--max-staleness", "100"});
  auto w = connect(server.name());
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  server.process().pause();
  std::vector<Worker::Ticket> tickets;
  for (int i = 0; i < 10; ++i) tickets.push_back(*w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0));
  server.process().resume();
  for (auto t : tickets) BOOST_TEST(w->wait(t).ok());
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->ring_high_water >= 10u);
  BOOST_TEST(s->ring_depth <= 1u);  // only the stats request itself may be queued
}

// The server as an unprivileged user sharing its segment with a group; the
// worker (another user) must get group-shared buffers the server can map.
BOOST_AUTO_TEST_CASE(server_of_another_user_maps_group_shared_buffers) {
  if (::geteuid() != 0) {
    BOOST_TEST_MESSAGE("skipped: needs root to run the server as another user");
    return;
  }
  const std::string name = test::unique_name("xuser");
  const uid_t nobody = 65534;
  const gid_t nogroup = 65534;
  auto server = test::Process::fork_fn([&] {
    if (::setgid(nogroup) != 0 || ::setgroups(0, nullptr) != 0 || ::setuid(nobody) != 0) return 90;
    const std::string bin = test::program_path("shmps-server");
    ::execl(bin.c_str(), bin.c_str(), "--name", name.c_str(), "--tensor", "w:4", "--lr", "1", "--group-access",
            static_cast<char*>(nullptr));
    return 91;
  });
  BOOST_REQUIRE(test::eventually([&] { return std::filesystem::exists("/dev/shm/shmps." + name); }));
  std::unique_ptr<Worker> w;
  BOOST_REQUIRE(test::eventually([&] {
    WorkerOptions o;
    o.name = name;
    o.server_user = "nobody";  // the server's user: trusted only when named
    auto r = Worker::connect(o);
    if (r.ok()) w = std::move(r).value();
    return w != nullptr;
  }));
  auto buf = w->register_buffer(16);
  BOOST_REQUIRE_MESSAGE(buf.ok(), buf.status().to_string());
  std::fill_n(static_cast<float*>(buf->data), 4, 2.0f);
  BOOST_TEST(w->push(0, buf->id, 0, 16, Dtype::kF32, 0).ok());
  BOOST_REQUIRE(w->pull(0, buf->id, 0).ok());
  BOOST_TEST(static_cast<float*>(buf->data)[0] == -2.0f);
  w.reset();
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);
}

// A registration that times out (the server stopped) is still in the lane
// and is served when the server resumes. The worker holds its id free
// again; whether the caller registers anew at once or later, the Worker
// and the server stay in step: the late registration never takes the new
// descriptor (it names its request), and a new one at an id the server
// still holds replaces it. Likewise an unregister that timed out and was
// served after all: unregistering again lets the buffer go.
BOOST_AUTO_TEST_CASE(registrations_that_timed_out_leave_worker_and_server_in_step) {
  test::ServerProcess server(test::unique_name("regto"), kSmall);
  auto w = connect(server.name(), 1s);
  const uint64_t bytes = 16 * sizeof(float);
  auto first = w->register_buffer(bytes);
  BOOST_REQUIRE(first.ok());
  const pid_t pid = server.process().pid();
  const auto stopped_for = [&](auto&& call) {
    BOOST_REQUIRE(::kill(pid, SIGSTOP) == 0);
    auto result = call();
    BOOST_REQUIRE(::kill(pid, SIGCONT) == 0);
    return result;
  };
  const auto usable = [&](uint32_t id) {
    auto pulled = w->pull(shm::kAllTensors, id, 0);
    return pulled.ok();
  };
  // Retried at once: the timed-out request is served after the new
  // descriptor is written, before the retry.
  BOOST_REQUIRE(::kill(pid, SIGSTOP) == 0);
  auto timed_out = w->register_buffer(bytes);
  BOOST_TEST((timed_out.status().code() == ErrorCode::kTimeout), timed_out.status().to_string());
  std::thread resume([pid] {
    std::this_thread::sleep_for(300ms);
    ::kill(pid, SIGCONT);
  });
  auto retried = w->register_buffer(bytes);
  resume.join();
  BOOST_REQUIRE_MESSAGE(retried.ok(), retried.status().to_string());
  BOOST_TEST(usable(retried->id));
  // Retried later: the timed-out registration was served first.
  auto late = stopped_for([&] { return w->register_buffer(bytes); });
  BOOST_TEST((late.status().code() == ErrorCode::kTimeout), late.status().to_string());
  BOOST_REQUIRE(w->ping().ok());  // served, in order, after the registration
  auto again = w->register_buffer(bytes);
  BOOST_REQUIRE_MESSAGE(again.ok(), again.status().to_string());
  BOOST_TEST(usable(again->id));
  // An unregister that timed out, then was served.
  const Status gone = stopped_for([&] { return w->unregister_buffer(again->id); });
  BOOST_TEST((gone.code() == ErrorCode::kTimeout), gone.to_string());
  BOOST_REQUIRE(w->ping().ok());
  BOOST_TEST(w->unregister_buffer(again->id).ok());
  BOOST_TEST((w->unregister_buffer(again->id).code() == ErrorCode::kUnknownBuffer));
  auto reused = w->register_buffer(bytes);
  BOOST_REQUIRE_MESSAGE(reused.ok(), reused.status().to_string());
  BOOST_TEST(usable(reused->id));
  BOOST_TEST(usable(first->id));
  w.reset();
  BOOST_TEST(server.stop() == 0);
}

BOOST_AUTO_TEST_SUITE_END()
