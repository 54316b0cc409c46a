// Server crash and restart as workers see it: a Worker with reconnect on
// re-attaches to the next generation and re-registers its buffers; a call
// in flight when the server dies fails with kServerRestarted; checkpoints
// carry the weights over; a kill -9 / restart loop under load always comes
// back.
#define BOOST_TEST_MODULE test_restart
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> args(const fs::path& dir) {
  return {"--tensor",           "w:1", "--lr", "1", "--max-staleness", "4000000000", "--checkpoint-dir", dir.string(),
          "--checkpoint-every", "1"};
}

std::unique_ptr<Worker> connect(const std::string& name, bool reconnect, std::chrono::milliseconds timeout = 10s) {
  return test::connect(name, timeout, reconnect);
}

// `n` buffers of 4 bytes (ids 0 .. n-1).
std::vector<Buffer> register_buffers(Worker& w, int n) {
  std::vector<Buffer> bufs;
  for (int i = 0; i < n; ++i) {
    auto b = w.register_buffer(4);
    BOOST_REQUIRE(b.ok());
    bufs.push_back(*b);
  }
  return bufs;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(restart)

BOOST_AUTO_TEST_CASE(worker_reattaches_to_the_next_generation_and_keeps_its_buffers) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("reattach");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/true);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  float* g = static_cast<float*>(buf->data);
  for (int i = 0; i < 5; ++i) {
    *g = -1.0f;
    BOOST_REQUIRE(w->push(0, buf->id, 0, 4, Dtype::kF32, 0).ok());
  }
  const uint64_t generation = w->generation();
  BOOST_REQUIRE(server->stop() == 0);  // clean stop: final checkpoint at version 5
  server.reset();
  test::ServerProcess next(name, args(dir.path));
  // The next call re-attaches and re-registers the buffer under its id.
  auto v = w->pull(0, buf->id, 0);
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  BOOST_TEST(*v == 5u);
  BOOST_TEST(*g == 5.0f);
  BOOST_TEST(w->generation() != generation);
  *g = -1.0f;
  auto pushed = w->push(0, buf->id, 0, 4, Dtype::kF32, 5);
  BOOST_REQUIRE_MESSAGE(pushed.ok(), pushed.status().to_string());
  BOOST_TEST(*pushed == 6u);
}

// A server restarted with another tensor table is refused (kLayoutMismatch)
// at the re-attach, and the Worker still names the server it attached to.
BOOST_AUTO_TEST_CASE(a_reattach_refused_for_another_table_keeps_the_identity_attached_to) {
  const std::string name = test::unique_name("othertable");
  auto server = std::make_unique<test::ServerProcess>(name, std::vector<std::string>{"--tensor", "w:1"});
  auto w = connect(name, /*reconnect=*/true);
  BOOST_REQUIRE(w->ping().ok());
  const uint64_t generation = w->generation();
  const pid_t pid = w->server_pid();
  BOOST_REQUIRE(server->stop() == 0);
  server.reset();
  test::ServerProcess other(name, {"--tensor", "v:2"});
  const Status s = w->ping();
  BOOST_TEST((s.code() == ErrorCode::kLayoutMismatch), s.to_string());
  BOOST_TEST(w->generation() == generation);
  BOOST_TEST(w->server_pid() == pid);
}

// The tensor table is one for the Worker's life: what a caller took from
// it before a re-attach (a reference, find_tensor()'s pointer) stays valid.
// A re-attach that fails (the restarted server stopped: it did not come
// back within the timeout) leaves
// the identity of the server last attached.
BOOST_AUTO_TEST_CASE(a_reattach_keeps_the_tensor_table_and_a_failed_one_the_identity) {
  const std::string name = test::unique_name("keeptable");
  auto server = std::make_unique<test::ServerProcess>(name, std::vector<std::string>{"--tensor", "w:3"});
  auto w = connect(name, /*reconnect=*/true, 1s);
  const TensorInfo* found = w->find_tensor("w");
  BOOST_REQUIRE(found != nullptr);
  const TensorInfo* first = &w->tensors()[0];
  const uint64_t generation = w->generation();
  const pid_t pid = w->server_pid();
  BOOST_REQUIRE(server->stop() == 0);
  server.reset();
  test::ServerProcess next(name, {"--tensor", "w:3"});
  next.process().pause();
  const Status refused = w->ping();
  BOOST_TEST((refused.code() == ErrorCode::kServerNotRunning), refused.to_string());
  BOOST_TEST(w->generation() == generation);
  BOOST_TEST(w->server_pid() == pid);
  next.process().resume();
  const Status pinged = w->ping();
  BOOST_REQUIRE_MESSAGE(pinged.ok(), pinged.to_string());
  BOOST_TEST(w->generation() != generation);
  BOOST_TEST(w->server_pid() == next.process().pid());
  BOOST_TEST(&w->tensors()[0] == first);
  BOOST_TEST(w->find_tensor("w") == found);
  BOOST_TEST(found->name == "w");
}

// A server restarted with a smaller --max-buffers: the re-attach keeps the
// buffers whose ids it still has and lets go of the others (their shm
// objects unlinked, nothing leaked), and those ids are refused.
BOOST_AUTO_TEST_CASE(a_reattach_to_fewer_buffer_slots_lets_go_of_the_buffers_beyond_them) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("fewerbufs");
  std::vector<std::string> a = args(dir.path);
  a.insert(a.end(), {"--max-buffers", "4"});
  auto server = std::make_unique<test::ServerProcess>(name, a);
  auto w = connect(name, /*reconnect=*/true);
  const std::vector<Buffer> bufs = register_buffers(*w, 3);
  const std::string prefix = shm::buffer_object_prefix(name, ::getpid());
  const auto objects = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
    return n;
  };
  BOOST_TEST(objects() == 3u);
  BOOST_REQUIRE(server->stop() == 0);
  server.reset();
  a = args(dir.path);
  a.insert(a.end(), {"--max-buffers", "2"});
  test::ServerProcess next(name, a);
  auto v = w->pull(0, bufs[0].id, 0);  // re-attaches
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  BOOST_TEST(objects() == 2u);
  BOOST_TEST(bufs[2].id == 2u);
  auto refused = w->pull(0, bufs[2].id, 0);
  BOOST_TEST(!refused.ok());
  BOOST_TEST(w->pull(0, bufs[1].id, 0).ok());
}

// A buffer the restarted server refuses (its object shrank to nothing)
// does not keep the others from being registered again: the re-attaching
// call reports it, by its id, and the other buffers serve on.
BOOST_AUTO_TEST_CASE(a_buffer_the_restarted_server_refuses_leaves_the_others_registered) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("refusedbuf");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/true);
  const std::vector<Buffer> bufs = register_buffers(*w, 3);
  // Buffer 0's object: the first of this worker's names.
  const std::string prefix = shm::buffer_object_prefix(name, ::getpid());
  std::vector<std::string> objects;
  for (const auto& e : fs::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) objects.push_back(e.path().string());
  BOOST_REQUIRE(objects.size() == 3u);
  std::sort(objects.begin(), objects.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  BOOST_REQUIRE(server->stop() == 0);
  server.reset();
  BOOST_REQUIRE(::truncate(objects[0].c_str(), 0) == 0);
  test::ServerProcess next(name, args(dir.path));
  const Status first = w->ping();  // re-attaches
  BOOST_TEST((first.code() != ErrorCode::kOk));
  BOOST_TEST(first.message().find("buffer 0 registered again") != std::string::npos, first.to_string());
  // The server's reason (owner, mode) is longer than a completion holds:
  // the worker says it was cut.
  BOOST_TEST(first.message().find("... (cut at 63 bytes; the server's log has the whole reason") != std::string::npos,
             first.to_string());
  for (int i : {1, 2}) {
    auto v = w->pull(0, bufs[i].id, 0);
    BOOST_TEST(v.ok(), "buffer " << i << ": " << v.status().to_string());
  }
  BOOST_TEST((w->pull(0, bufs[0].id, 0).status().code() == ErrorCode::kUnknownBuffer));
  // The refused buffer was let go: its id serves the next registration.
  auto again = w->register_buffer(4);
  BOOST_REQUIRE_MESSAGE(again.ok(), again.status().to_string());
  BOOST_TEST(again->id == bufs[0].id);
  BOOST_TEST(w->pull(0, again->id, 0).ok());
}

// A gradient computed against the previous server's weights is refused:
// the push that finds a new generation fails with kServerRestarted,
// without being submitted; a pull then proceeds, and the next push with it.
BOOST_AUTO_TEST_CASE(a_push_that_finds_a_restarted_server_fails_with_server_restarted) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("pushgen");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/true);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  *static_cast<float*>(buf->data) = -1.0f;
  BOOST_REQUIRE(w->push(0, buf->id, 0, 4, Dtype::kF32, 0).ok());
  server->process().kill_and_reap();
  server.reset();
  // Past the dead server's last heartbeat (10 ms, trusted for 100 ms), so the
  // push sees the death before submitting rather than in its wait.
  std::this_thread::sleep_for(200ms);
  test::ServerProcess next(name, args(dir.path));
  auto pushed = w->push(0, buf->id, 0, 4, Dtype::kF32, 1);
  BOOST_TEST((pushed.status().code() == ErrorCode::kServerRestarted), pushed.status().to_string());
  BOOST_TEST(pushed.status().message().find("pull again") != std::string::npos);
  auto v = w->pull(0, buf->id, 0);
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->gradients_applied == 0u);  // the refused push never reached the new server
  *static_cast<float*>(buf->data) = -1.0f;
  BOOST_TEST(w->push(0, buf->id, 0, 4, Dtype::kF32, *v).ok());
}

// The rule is of the weights, not of the call that re-attached: after a
// ping (or any other call) re-attached to the next generation, every push
// is refused with kServerRestarted, nothing sent, until a pull from the
// new server is answered (pull_async's too, once wait() has it).
BOOST_AUTO_TEST_CASE(a_push_after_another_call_reattached_is_refused_until_a_pull) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("weightsgen");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/true);
  auto grad = w->register_buffer(4);
  auto weights = w->register_buffer(4);
  BOOST_REQUIRE(grad.ok() && weights.ok());
  *static_cast<float*>(grad->data) = -1.0f;
  for (int restart = 0; restart < 2; ++restart) {
    auto v = w->pull(0, weights->id, 0);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    server->process().kill_and_reap();
    server.reset();
    std::this_thread::sleep_for(200ms);  // past the dead server's last heartbeat: the ping sees it dead at once
    server = std::make_unique<test::ServerProcess>(name, args(dir.path));
    const Status back = w->ping();  // re-attaches
    BOOST_REQUIRE_MESSAGE(back.ok(), back.to_string());
    for (int tries = 0; tries < 2; ++tries) {
      auto pushed = w->push(0, grad->id, 0, 4, Dtype::kF32, *v);
      BOOST_TEST((pushed.status().code() == ErrorCode::kServerRestarted), pushed.status().to_string());
      BOOST_TEST(pushed.status().message().find("pull again") != std::string::npos, pushed.status().message());
      auto ticket = w->push_async(0, grad->id, 0, 4, Dtype::kF32, *v);
      BOOST_TEST((ticket.status().code() == ErrorCode::kServerRestarted), ticket.status().to_string());
    }
    auto s = w->stats();
    BOOST_REQUIRE(s.ok());
    BOOST_TEST(s->gradients_applied == 0u);  // none of them reached the new server
    if (restart == 0) {
      v = w->pull(0, weights->id, 0);
    } else {
      auto ticket = w->pull_async(0, weights->id, 0);
      BOOST_REQUIRE_MESSAGE(ticket.ok(), ticket.status().to_string());
      v = w->wait(*ticket);
    }
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    auto pushed = w->push(0, grad->id, 0, 4, Dtype::kF32, *v);
    BOOST_TEST(pushed.ok(), pushed.status().to_string());
  }
}

// A re-attach whose registrations time out (the new server stopped under
// them) leaves the buffers it has not registered pending, and the next call
// registers them before its own request: every buffer serves again. The
// worker, a process of its own, stops itself (SHMPS_FAULT) just before it
// sends the first of them, so the server can be stopped at that moment.
BOOST_AUTO_TEST_CASE(buffers_a_timed_out_reattach_left_unregistered_are_registered_by_the_next_call) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("pendingreg");
  struct Shared {
    std::atomic<int> ready, go, first_done, server_back;
    std::atomic<uint32_t> first_code;
    std::atomic<uint32_t> pulled[3];
    char first_message[512];
  };
  Shared* shared = test::map_shared<Shared>();
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  const auto wait_for = [](const std::atomic<int>& flag) {
    while (flag.load() == 0) std::this_thread::sleep_for(1ms);
  };
  auto worker = test::Process::fork_fn([&] {
    // Publish 5: 3 registrations and a ping come before the first
    // registration after the restart.
    ::setenv("SHMPS_FAULT", "before_publish:5:stop", 1);
    auto w = test::try_connect(name, 500ms, /*reconnect=*/true);
    if (!w) return 2;
    std::vector<Buffer> bufs;
    for (int i = 0; i < 3; ++i) {
      auto b = w->register_buffer(4);
      if (!b.ok()) return 3;
      bufs.push_back(*b);
    }
    if (!w->ping().ok()) return 4;
    shared->ready.store(1);
    wait_for(shared->go);
    const Status first = w->ping();  // re-attaches; its first registration times out
    shared->first_code.store(static_cast<uint32_t>(first.code()));
    std::snprintf(shared->first_message, sizeof shared->first_message, "%s", first.message().c_str());
    shared->first_done.store(1);
    wait_for(shared->server_back);
    for (int i = 0; i < 3; ++i)
      shared->pulled[i].store(static_cast<uint32_t>(w->pull(0, bufs[i].id, 0).status().code()));
    return 0;
  });
  BOOST_REQUIRE(test::eventually([&] { return shared->ready.load() != 0; }, 10s));
  server->process().kill_and_reap();
  server.reset();
  // Past the dead server's last heartbeat: the worker's next call sees it
  // dead before sending anything, and re-attaches.
  std::this_thread::sleep_for(200ms);
  test::ServerProcess next(name, args(dir.path));
  shared->go.store(1);
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return test::process_state(worker.pid()) == 'T'; }, 10s),
                        "the worker never reached its first registration");
  next.process().pause();
  worker.resume();
  BOOST_TEST(test::eventually([&] { return shared->first_done.load() != 0; }, 10s));
  next.process().resume();
  shared->server_back.store(1);
  BOOST_REQUIRE(worker.wait(20s) == 0);
  BOOST_TEST((static_cast<ErrorCode>(shared->first_code.load()) == ErrorCode::kTimeout), shared->first_message);
  for (int i = 0; i < 3; ++i)
    BOOST_TEST((static_cast<ErrorCode>(shared->pulled[i].load()) == ErrorCode::kOk),
               "buffer " << i << ": " << error_code_name(static_cast<ErrorCode>(shared->pulled[i].load())));
}

// A server that stops under a re-attach's registrations (it answers the
// one in its lane kShuttingDown, and takes nothing after: kServerNotRunning)
// refuses no buffer: every buffer stays, its object too, and the next
// server registers them all. The worker, a process of its own, stops
// itself (SHMPS_FAULT) right after it sent the first of them, so the
// server can be stopped with it in the lane.
BOOST_AUTO_TEST_CASE(a_server_stopping_under_the_registrations_lets_go_of_no_buffer) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("stopreg");
  struct Shared {
    std::atomic<int> ready, go, first_done, next_up;
    std::atomic<uint32_t> first_code;
    std::atomic<uint64_t> objects_after_first;
    std::atomic<uint32_t> pulled[3];
    char first_message[512];
  };
  Shared* shared = test::map_shared<Shared>();
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  const auto wait_for = [](const std::atomic<int>& flag) {
    while (flag.load() == 0) std::this_thread::sleep_for(1ms);
  };
  auto worker = test::Process::fork_fn([&] {
    // Publish 4: 3 registrations come before the first one after the restart.
    ::setenv("SHMPS_FAULT", "after_publish:4:stop", 1);
    auto w = test::try_connect(name, 1s, /*reconnect=*/true);
    if (!w) return 2;
    std::vector<Buffer> bufs;
    for (int i = 0; i < 3; ++i) {
      auto b = w->register_buffer(4);
      if (!b.ok()) return 3;
      bufs.push_back(*b);
    }
    shared->ready.store(1);
    wait_for(shared->go);
    const Status first = w->ping();  // re-attaches; the server stops under its registrations
    shared->first_code.store(static_cast<uint32_t>(first.code()));
    std::snprintf(shared->first_message, sizeof shared->first_message, "%s", first.message().c_str());
    shared->objects_after_first.store(shm::orphan_buffers(name, ::getpid()).size());
    shared->first_done.store(1);
    wait_for(shared->next_up);
    for (int i = 0; i < 3; ++i)
      shared->pulled[i].store(static_cast<uint32_t>(w->pull(0, bufs[i].id, 0).status().code()));
    return 0;
  });
  BOOST_REQUIRE(test::eventually([&] { return shared->ready.load() != 0; }, 10s));
  server->process().kill_and_reap();
  server.reset();
  // Past the dead server's last heartbeat: the worker's next call sees it
  // dead before sending anything, and re-attaches.
  std::this_thread::sleep_for(200ms);
  auto stopping = std::make_unique<test::ServerProcess>(name, args(dir.path));
  shared->go.store(1);
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return test::process_state(worker.pid()) == 'T'; }, 10s),
                        "the worker never sent its first registration");
  BOOST_REQUIRE(stopping->stop() == 0);  // a clean stop, the registration in its lane
  stopping.reset();
  worker.resume();
  BOOST_REQUIRE(test::eventually([&] { return shared->first_done.load() != 0; }, 10s));
  test::ServerProcess next(name, args(dir.path));
  shared->next_up.store(1);
  BOOST_REQUIRE(worker.wait(20s) == 0);
  BOOST_TEST((static_cast<ErrorCode>(shared->first_code.load()) != ErrorCode::kOk), shared->first_message);
  BOOST_TEST(shared->objects_after_first.load() == 3u, shared->first_message);
  for (int i = 0; i < 3; ++i)
    BOOST_TEST((static_cast<ErrorCode>(shared->pulled[i].load()) == ErrorCode::kOk),
               "buffer " << i << ": " << error_code_name(static_cast<ErrorCode>(shared->pulled[i].load())));
}

// A call that re-attaches waits at most its one timeout in all: the wait
// for the next server, the attach and the registrations share it. Here the
// next server comes 700 ms into a 3000 ms call and stops before it answers
// the registration; the call ends at its timeout, not a timeout after the
// attach. The worker, a process of its own, stops itself (SHMPS_FAULT)
// just before it sends the registration, so the server can be stopped
// first.
BOOST_AUTO_TEST_CASE(a_call_that_reattaches_waits_at_most_its_timeout_in_all) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("onetimeout");
  struct Shared {
    std::atomic<int> ready, go;
    std::atomic<uint32_t> code;
    std::atomic<int64_t> took_ms;
    char message[512];
  };
  Shared* shared = test::map_shared<Shared>();
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto worker = test::Process::fork_fn([&] {
    // Publish 3: a registration and a ping come before the registration
    // after the restart.
    ::setenv("SHMPS_FAULT", "before_publish:3:stop", 1);
    auto w = test::try_connect(name, 3000ms, /*reconnect=*/true);
    if (!w || !w->register_buffer(4).ok() || !w->ping().ok()) return 2;
    shared->ready.store(1);
    while (shared->go.load() == 0) std::this_thread::sleep_for(1ms);
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = w->ping();
    shared->took_ms.store(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count());
    shared->code.store(static_cast<uint32_t>(s.code()));
    std::snprintf(shared->message, sizeof shared->message, "%s", s.message().c_str());
    return 0;
  });
  BOOST_REQUIRE(test::eventually([&] { return shared->ready.load() != 0; }, 10s));
  server->process().kill_and_reap();
  server.reset();
  std::this_thread::sleep_for(200ms);  // past the dead server's last heartbeat
  shared->go.store(1);
  std::this_thread::sleep_for(700ms);
  test::ServerProcess next(name, args(dir.path));
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return test::process_state(worker.pid()) == 'T'; }, 10s),
                        "the worker never reached its registration");
  next.process().pause();
  worker.resume();
  const int rc = worker.wait(20s);
  next.process().resume();
  BOOST_REQUIRE(rc == 0);
  BOOST_TEST((static_cast<ErrorCode>(shared->code.load()) == ErrorCode::kTimeout), shared->message);
  // A timeout of its own after the attach would end past 3.7 s.
  BOOST_TEST(shared->took_ms.load() < 3500, shared->took_ms.load() << " ms: " << shared->message);
}

// A re-attach that finds no server to attach to within the call's timeout
// says what it found last, and waits no longer than that timeout, nor
// than the interrupted hook lets it, whatever the object at the name:
// here a segment a live process created and has not published (a server
// starting: the opener's own wait for a start is not the call's), and a
// foreign object.
BOOST_AUTO_TEST_CASE(a_reattach_that_finds_no_server_says_what_it_found_within_the_timeout) {
  const std::string name = test::unique_name("lastcause");
  const std::string object = shm::segment_object_name(name);
  struct Cleanup {
    std::string object;
    ~Cleanup() { shm::ShmObject::remove(object); }
  } cleanup{object};
  // Stands for the server that made the unpublished segment: alive, never
  // publishing.
  auto starting = test::Process::fork_fn([] {
    ::pause();
    return 0;
  });
  const auto unpublished = [&] {
    const int fd = ::shm_open(object.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    BOOST_REQUIRE(fd >= 0);
    BOOST_REQUIRE(::ftruncate(fd, 1 << 20) == 0);
    void* p = ::mmap(nullptr, sizeof(shm::SegmentHeader), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    BOOST_REQUIRE(p != MAP_FAILED);
    auto* h = static_cast<shm::SegmentHeader*>(p);
    h->magic = shm::kMagic;
    h->server_pid = static_cast<uint32_t>(starting.pid());
    h->server_start_time = shm::process_start_time(starting.pid());
    ::munmap(p, sizeof(shm::SegmentHeader));
  };
  const auto foreign = [&] {
    const int fd = ::shm_open(object.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    BOOST_REQUIRE(fd >= 0);
    const std::vector<char> bytes(8192, 'x');
    BOOST_REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  };
  struct Case {
    const char* what;
    std::function<void()> make;
    std::string cause;
  };
  for (const Case& c : {Case{"unpublished", unpublished, "segment not published yet (server starting)"},
                        Case{"foreign", foreign, "not a shmps segment"}}) {
    BOOST_TEST_CONTEXT(c.what) {
      std::atomic<bool> stop{false};
      WorkerOptions o = test::worker_options(name, 300ms, /*reconnect=*/true);
      o.interrupted = [&] { return stop.load(); };
      auto server = std::make_unique<test::ServerProcess>(name, std::vector<std::string>{"--tensor", "w:1"});
      auto quick = Worker::connect(o);
      o.timeout = 20s;
      auto patient = Worker::connect(o);
      BOOST_REQUIRE_MESSAGE(quick.ok() && patient.ok(), quick.status().to_string() << patient.status().to_string());
      BOOST_REQUIRE((*quick)->ping().ok() && (*patient)->ping().ok());
      server->process().kill_and_reap();
      server.reset();  // (unlinks the dead server's segment)
      c.make();
      std::this_thread::sleep_for(200ms);  // past the dead server's last heartbeat: a ping re-attaches at once
      auto t0 = std::chrono::steady_clock::now();
      const Status timed_out = (*quick)->ping();
      BOOST_TEST((std::chrono::steady_clock::now() - t0 < 1s));
      BOOST_TEST((timed_out.code() == ErrorCode::kServerNotRunning), timed_out.to_string());
      BOOST_TEST(timed_out.message().find("did not come back within the timeout (300 ms)") != std::string::npos,
                 timed_out.message());
      BOOST_TEST(timed_out.message().find(c.cause) != std::string::npos, timed_out.message());
      BOOST_TEST(timed_out.message().find("/dev/shm/" + object) != std::string::npos, timed_out.message());
      // With its timeout far off, the hook ends the wait.
      stop.store(true);
      t0 = std::chrono::steady_clock::now();
      const Status interrupted = (*patient)->ping();
      BOOST_TEST((std::chrono::steady_clock::now() - t0 < 1s));
      BOOST_TEST((interrupted.code() == ErrorCode::kInterrupted), interrupted.to_string());
      shm::ShmObject::remove(object);
    }
  }
}

BOOST_AUTO_TEST_CASE(call_in_flight_when_the_server_dies_fails_with_server_restarted) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("inflight");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/true, 3s);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  server->process().pause();
  auto ticket = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
  BOOST_REQUIRE(ticket.ok());
  server->process().kill_and_reap();
  auto r = w->wait(*ticket);
  BOOST_TEST((r.status().code() == ErrorCode::kServerRestarted), r.status().to_string());
  BOOST_TEST(r.status().message().find("not acknowledged") != std::string::npos);
  // No server comes back within the timeout: a clear error, no hang.
  const auto t0 = std::chrono::steady_clock::now();
  const Status gone = w->ping();
  BOOST_TEST((gone.code() == ErrorCode::kServerNotRunning), gone.to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 5s));
  server.reset();
  test::ServerProcess next(name, args(dir.path));
  const Status back = w->ping();
  BOOST_TEST(back.ok(), back.to_string());
  BOOST_TEST((w->wait(*ticket).status().code() == ErrorCode::kServerRestarted));  // still reported as lost
}

// A ticket outlives two sessions (push_async, then calls that see this
// server die, re-attach to the next and see that one die too): wait()
// still reports it lost, as it does the second session's ticket.
BOOST_AUTO_TEST_CASE(a_ticket_in_flight_across_two_server_deaths_is_reported_lost) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("twodeaths");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/true, 3s);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  std::vector<Worker::Ticket> tickets;
  for (int death = 0; death < 2; ++death) {
    server->process().pause();
    auto ticket = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
    BOOST_REQUIRE(ticket.ok());
    tickets.push_back(*ticket);
    server->process().kill_and_reap();
    server.reset();
    const Status gone = w->ping();  // ends the session: the ticket is lost
    BOOST_TEST((gone.code() == ErrorCode::kServerRestarted || gone.code() == ErrorCode::kServerNotRunning),
               gone.to_string());
    server = std::make_unique<test::ServerProcess>(name, args(dir.path));
    const Status back = w->ping();
    BOOST_REQUIRE_MESSAGE(back.ok(), back.to_string());
    BOOST_REQUIRE(w->pull(0, buf->id, 0).ok());  // the next push needs the new server's weights
  }
  for (const Worker::Ticket t : tickets) {
    for (int ask = 0; ask < 2; ++ask) {
      auto r = w->wait(t);
      BOOST_TEST((r.status().code() == ErrorCode::kServerRestarted), r.status().to_string());
      BOOST_TEST(r.status().message().find("request " + std::to_string(t) + " was not acknowledged") !=
                 std::string::npos);
    }
  }
}

BOOST_AUTO_TEST_CASE(without_reconnect_a_dead_server_is_final) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("noreconnect");
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto w = connect(name, /*reconnect=*/false);
  server->process().kill_and_reap();
  server.reset();
  test::ServerProcess next(name, args(dir.path));
  BOOST_TEST((w->ping().code() == ErrorCode::kServerNotRunning));
}

// A checkpoint directory serves one server. A second server (another
// name) started on the directory of a running one is refused, naming the
// directory and the holder's pid, with exit status 2: a configuration
// error, which the unit does not restart (RestartPreventExitStatus=2).
// It leaves the files there as they were; the first goes on
// checkpointing. Once the first has stopped (its final checkpoint written
// under the lock), the second starts and restores that checkpoint: what
// a second unit restarted every 2 s would do, silently taking over the
// other job's checkpoints if its exit status let systemd restart it.
// Without the lock the second would start, restore the first's
// checkpoint, and both would write and prune one set of files.
BOOST_AUTO_TEST_CASE(a_second_server_on_a_checkpoint_directory_in_use_is_refused) {
  test::TempDir dir("restart");
  const std::string first_name = test::unique_name("holder"), second_name = test::unique_name("second");
  auto first = std::make_unique<test::ServerProcess>(first_name, args(dir.path));
  const auto checkpoints = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir.path))
      if (e.path().filename() != ".lock")
        names.push_back(e.path().filename().string() + " " + test::read_file(e.path()));
    std::sort(names.begin(), names.end());
    return names;
  };
  {
    auto w = connect(first_name, false);
    auto buf = w->register_buffer(4);
    BOOST_REQUIRE(buf.ok());
    for (int i = 0; i < 3; ++i) {
      *static_cast<float*>(buf->data) = -1.0f;
      BOOST_REQUIRE(w->push(0, buf->id, 0, 4, Dtype::kF32, 0).ok());
    }
    BOOST_REQUIRE(test::eventually([&] { return fs::exists(dir.path / "ckpt-00000000000000000003.shmps"); }));
  }
  const std::vector<std::string> before = checkpoints();
  std::vector<std::string> argv = {test::program_path("shmps-server"), "--name", second_name};
  for (const std::string& a : args(dir.path)) argv.push_back(a);
  const test::Captured refused = test::run_captured(argv, 5s);
  BOOST_TEST(refused.exit_code == 2, refused.output);
  BOOST_TEST(refused.output.find("--checkpoint-dir " + dir.path.string() + " is in use by another shmps-server (pid " +
                                 std::to_string(first->process().pid()) + ")") != std::string::npos,
             refused.output);
  BOOST_TEST(!fs::exists("/dev/shm/shmps." + second_name));  // its segment removed
  BOOST_TEST(checkpoints() == before);
  {
    auto w = connect(first_name, false);  // the first serves on, and checkpoints
    auto buf = w->register_buffer(4);
    BOOST_REQUIRE(buf.ok());
    *static_cast<float*>(buf->data) = -1.0f;
    BOOST_REQUIRE(w->push(0, buf->id, 0, 4, Dtype::kF32, 0).ok());
    BOOST_TEST(test::eventually([&] { return fs::exists(dir.path / "ckpt-00000000000000000004.shmps"); }));
  }
  BOOST_REQUIRE(first->stop() == 0);
  first.reset();
  test::ServerProcess second(second_name, args(dir.path));
  auto w = connect(second_name, false);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  auto v = w->pull(0, buf->id, 0);
  BOOST_REQUIRE(v.ok());
  BOOST_TEST(*v == 4u);
  BOOST_TEST(*static_cast<float*>(buf->data) == 4.0f);
}

// kill -9 the server under load and start it again, 50 times: it always
// comes back (the stale segment is replaced), the pushing worker always
// resumes, nothing is left in /dev/shm, and the version never goes back
// past the last checkpoint.
BOOST_AUTO_TEST_CASE(kill_and_restart_fifty_times_under_load) {
  test::TempDir dir("restart");
  const std::string name = test::unique_name("loop");
  auto* shared = static_cast<std::atomic<uint64_t>*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  std::atomic<uint64_t>& stop = shared[0];
  std::atomic<uint64_t>& acked = shared[1];
  std::atomic<uint64_t>& lost = shared[2];
  std::atomic<uint64_t>& other_errors = shared[3];
  auto server = std::make_unique<test::ServerProcess>(name, args(dir.path));
  auto pusher = test::Process::fork_fn([&] {
    WorkerOptions o;
    o.name = name;
    o.reconnect = true;
    o.timeout = 10s;
    auto w = Worker::connect(o);
    if (!w.ok()) return 2;
    auto buf = (*w)->register_buffer(4);
    auto weights = (*w)->register_buffer(4);
    if (!buf.ok() || !weights.ok()) return 3;
    // After a restart, pushes need the new server's weights: a pull first.
    bool pulled = true;
    while (stop.load() == 0) {
      if (!pulled) {
        pulled = (*w)->pull(0, weights->id, 0).ok();
        continue;
      }
      *static_cast<float*>(buf->data) = -1.0f;
      auto v = (*w)->push(0, buf->id, 0, 4, Dtype::kF32, 0);
      if (v.ok()) {
        acked.fetch_add(1);
      } else if (v.status().code() == ErrorCode::kServerRestarted) {
        lost.fetch_add(1);
        pulled = false;
      } else {
        other_errors.fetch_add(1);
      }
    }
    return 0;
  });
  for (int round = 0; round < 50; ++round) {
    const uint64_t before = acked.load();
    BOOST_REQUIRE_MESSAGE(test::eventually([&] { return acked.load() > before + 3; }, 10s),
                          "the pusher made no progress after restart " << round);
    server->process().kill_and_reap();
    server.reset();
    server = std::make_unique<test::ServerProcess>(name, args(dir.path));  // throws if it does not come back
  }
  const uint64_t before = acked.load();
  BOOST_TEST(test::eventually([&] { return acked.load() > before + 3; }, 10s));
  stop.store(1);
  BOOST_TEST(pusher.wait(20s) == 0);
  BOOST_TEST(other_errors.load() == 0u);
  BOOST_TEST_MESSAGE("acknowledged " << acked.load() << ", lost in flight " << lost.load());
  auto w = connect(name, false);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  auto v = w->pull(0, buf->id, 0);
  BOOST_REQUIRE(v.ok());
  // Each restart may lose the updates after its last checkpoint; what is
  // there is exactly the version (lr 1, gradient -1: w == version).
  BOOST_TEST(*static_cast<float*>(buf->data) == static_cast<float>(*v));
  BOOST_TEST(*v > 0u);
  BOOST_TEST(*v <= acked.load() + lost.load());
  w.reset();
  server.reset();
  size_t left = 0;
  for (const auto& e : fs::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind("shmps." + name, 0) == 0) ++left;
  BOOST_TEST(left == 0u);
  ::munmap(shared, 4096);
}

BOOST_AUTO_TEST_SUITE_END()
