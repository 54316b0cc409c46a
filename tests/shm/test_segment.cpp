// Segment creation, validation and replacement rules, and shm objects.
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define BOOST_TEST_MODULE test_shm_segment
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "test_support.hpp"

using namespace shmps;
using namespace shmps::shm;

namespace {

SegmentSpec small_spec(const std::string& name) {
  SegmentSpec s;
  s.name = name;
  s.tensors = {{"fc1.weight", {4, 3}}, {"fc1.bias", {4}}};
  s.max_workers = 4;
  s.max_buffers = 2;
  s.lane_capacity = 8;
  s.config.optimizer_kind = 1;
  s.config.backend = 1;
  return s;
}

struct Cleanup {
  std::string name;
  ~Cleanup() { Segment::remove(name); }
};

// Writes raw bytes as /dev/shm/shmps.<name>.
void write_object(const std::string& name, const std::vector<char>& bytes) {
  const int fd = ::shm_open(segment_object_name(name).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  BOOST_REQUIRE(fd >= 0);
  BOOST_REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(segment)

BOOST_AUTO_TEST_CASE(create_publish_open_roundtrip) {
  const std::string name = test::unique_name("seg");
  Cleanup cleanup{name};
  auto created = Segment::create(small_spec(name), 42);
  BOOST_REQUIRE(created.ok());
  (*created)->publish();
  auto opened = Segment::open(name, true);
  BOOST_REQUIRE_MESSAGE(opened.ok(), opened.status().to_string());
  const SegmentHeader& h = (*opened)->header();
  BOOST_TEST(h.generation == 42u);
  BOOST_TEST(h.tensor_count == 2u);
  BOOST_TEST(h.total_elements == 16u);
  BOOST_TEST(h.server_pid == static_cast<uint32_t>(::getpid()));
  BOOST_TEST((*opened)->layout().tensors.at(1).element_offset == 12u);
  BOOST_TEST(std::string((*opened)->layout().tensors.at(0).name) == "fc1.weight");
}

BOOST_AUTO_TEST_CASE(unpublished_segment_is_not_opened) {
  const std::string name = test::unique_name("seg");
  Cleanup cleanup{name};
  auto created = Segment::create(small_spec(name), 1);
  BOOST_REQUIRE(created.ok());
  auto opened = Segment::open(name, true);  // waits 2 s, then gives up
  BOOST_TEST((opened.status().code() == ErrorCode::kServerNotRunning));
}

BOOST_AUTO_TEST_CASE(mode_is_exact_whatever_the_umask) {
  const mode_t old = ::umask(0);
  for (mode_t mode : {mode_t{0600}, mode_t{0660}}) {
    const std::string name = test::unique_name("mode");
    Cleanup cleanup{name};
    SegmentSpec spec = small_spec(name);
    spec.mode = mode;
    auto created = Segment::create(spec, 1);
    BOOST_REQUIRE(created.ok());
    struct stat st {};
    BOOST_REQUIRE(::stat(("/dev/shm/" + segment_object_name(name)).c_str(), &st) == 0);
    BOOST_TEST((st.st_mode & 0777) == mode);
  }
  ::umask(old);
  auto world = ShmObject::create("shmps.worldwritable", 4096, 0666);
  BOOST_TEST((world.status().code() == ErrorCode::kInvalidArgument));
}

BOOST_AUTO_TEST_CASE(missing_segment_names_the_object) {
  auto opened = Segment::open("no_such_server_here", false);
  BOOST_TEST((opened.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(opened.status().message().find("/dev/shm/shmps.no_such_server_here") != std::string::npos);
}

// An empty object is what a server creates and sizes at once: a young one
// is waited for (kSegmentStartWait), one older than that and unlocked is a
// dead start's leftover, reported at once with the command that removes
// it; the next start replaces it.
BOOST_AUTO_TEST_CASE(an_empty_object_is_waited_for_only_while_a_start_could_size_it) {
  const std::string name = test::unique_name("empty");
  Cleanup cleanup{name};
  write_object(name, {});
  auto started = std::chrono::steady_clock::now();
  auto young = Segment::open(name, false);
  const auto waited = std::chrono::steady_clock::now() - started;
  BOOST_TEST((young.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(young.status().message().find("not sized yet") != std::string::npos, young.status().message());
  // The open waited out the start (less what the object's age was at the first look).
  BOOST_TEST((waited > kSegmentStartWait / 2));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  started = std::chrono::steady_clock::now();
  auto old = Segment::open(name, false);
  BOOST_TEST((old.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(old.status().message().find(") is empty, unchanged for ") != std::string::npos, old.status().message());
  BOOST_TEST(old.status().message().find(" s, and no process holds its lock: a server start that died before sizing it "
                                         "left it, or a process that is no shmps server made it; the next start of "
                                         "server '" +
                                         name + "' by its owner replaces it, or remove it: rm /dev/shm/" +
                                         segment_object_name(name)) != std::string::npos,
             old.status().message());
  BOOST_TEST(old.status().message().find("mode 0600") != std::string::npos, old.status().message());
  BOOST_TEST((std::chrono::steady_clock::now() - started < kSegmentStartWait / 2));
  auto created = Segment::create(small_spec(name), 1);
  BOOST_TEST(created.ok(), created.status().to_string());
}

// So is an object whose header was never written (all zeros: a start
// killed between sizing and writing it), once it is older than a start's
// wait and no process holds its lock; one that a process locks (a server
// starting holds its own from the create on) is still waited for. The
// message names the object and the command that removes it.
BOOST_AUTO_TEST_CASE(an_unwritten_object_is_waited_for_only_while_a_start_could_write_it) {
  const std::string name = test::unique_name("zeros"), locked = test::unique_name("zeroslk");
  Cleanup cleanup{name}, cleanup_locked{locked};
  write_object(name, std::vector<char>(8192, 0));
  write_object(locked, std::vector<char>(8192, 0));
  const int lock = ::shm_open(segment_object_name(locked).c_str(), O_RDONLY | O_CLOEXEC, 0);
  BOOST_REQUIRE(lock >= 0);
  BOOST_REQUIRE(::flock(lock, LOCK_EX) == 0);
  std::this_thread::sleep_for(kSegmentStartWait + std::chrono::milliseconds(300));
  auto started = std::chrono::steady_clock::now();
  auto left = Segment::open(name, false);
  BOOST_TEST((std::chrono::steady_clock::now() - started < kSegmentStartWait / 2));
  BOOST_TEST((left.status().code() == ErrorCode::kServerNotRunning));
  const std::string path = "/dev/shm/" + segment_object_name(name);
  const std::string& m = left.status().message();
  BOOST_TEST(m.find(path + " (owner ") != std::string::npos, m);
  BOOST_TEST(m.find(") is not initialised (no header: its magic is zero), unchanged for ") != std::string::npos, m);
  BOOST_TEST(m.find("a server start that died before writing it left it") != std::string::npos, m);
  BOOST_TEST(m.find("or remove it: rm " + path) != std::string::npos, m);
  started = std::chrono::steady_clock::now();
  auto waited = Segment::open(locked, false);
  BOOST_TEST((std::chrono::steady_clock::now() - started > kSegmentStartWait / 2));
  BOOST_TEST((waited.status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST(waited.status().message().find("not initialised yet") != std::string::npos, waited.status().message());
  ::close(lock);
  auto created = Segment::create(small_spec(name), 1);
  BOOST_TEST(created.ok(), created.status().to_string());
}

BOOST_AUTO_TEST_CASE(foreign_object_is_refused_and_never_replaced) {
  const std::string name = test::unique_name("foreign");
  Cleanup cleanup{name};
  write_object(name, std::vector<char>(8192, 'x'));
  auto opened = Segment::open(name, true);
  BOOST_TEST((opened.status().code() == ErrorCode::kLayoutMismatch));
  BOOST_TEST(opened.status().message().find("not a shmps segment") != std::string::npos);
  auto created = Segment::create(small_spec(name), 1);
  BOOST_TEST((created.status().code() == ErrorCode::kLayoutMismatch));
}

BOOST_AUTO_TEST_CASE(other_layout_version_names_both_versions) {
  const std::string name = test::unique_name("ver");
  Cleanup cleanup{name};
  {
    auto created = Segment::create(small_spec(name), 1);
    BOOST_REQUIRE(created.ok());
    (*created)->header().layout_version.store(99);
  }
  auto opened = Segment::open(name, true);
  BOOST_TEST((opened.status().code() == ErrorCode::kLayoutMismatch));
  BOOST_TEST(opened.status().message().find("99") != std::string::npos);
  BOOST_TEST(opened.status().message().find("understands " + std::to_string(shmps::shm::kLayoutVersion)) !=
             std::string::npos);
}

BOOST_AUTO_TEST_CASE(stale_segment_of_dead_server_is_replaced_live_one_is_not) {
  const std::string name = test::unique_name("stale");
  Cleanup cleanup{name};
  // A live "server" (this process) is never clobbered.
  auto first = Segment::create(small_spec(name), 1);
  BOOST_REQUIRE(first.ok());
  (*first)->publish();
  auto second = Segment::create(small_spec(name), 2);
  BOOST_TEST((second.status().code() == ErrorCode::kInvalidArgument));
  BOOST_TEST(second.status().message().find("live shmps-server") != std::string::npos);
  // Its server dies: the header names a dead child's pid, and the
  // creator's lock goes with its descriptor (the object stays, as a
  // crashed server leaves it).
  auto child = test::Process::fork_fn([] { return 0; });
  const pid_t dead = child.pid();
  child.wait(std::chrono::seconds(5));
  (*first)->header().server_pid = static_cast<uint32_t>(dead);
  auto locked = Segment::create(small_spec(name), 3);  // still locked: a live process holds it
  BOOST_TEST(locked.status().message().find("is locked by a live process") != std::string::npos,
             locked.status().to_string());
  first->reset();
  BOOST_REQUIRE(::access(("/dev/shm/" + segment_object_name(name)).c_str(), F_OK) == 0);
  auto third = Segment::create(small_spec(name), 3);
  BOOST_REQUIRE_MESSAGE(third.ok(), third.status().to_string());
  BOOST_TEST((*third)->header().generation == 3u);
}

// What a killed server left is removed for the process that started it,
// and nothing else: not a live server's segment, not one whose header
// names another process, not one still locked.
BOOST_AUTO_TEST_CASE(remove_if_left_by_removes_only_that_dead_servers_segment) {
  const std::string name = test::unique_name("leftby");
  const std::string path = "/dev/shm/" + segment_object_name(name);
  Cleanup cleanup{name};
  auto created = Segment::create(small_spec(name), 1);
  BOOST_REQUIRE(created.ok());
  (*created)->publish();
  const uint64_t start = (*created)->header().server_start_time;
  BOOST_TEST(!Segment::remove_if_left_by(name, ::getpid(), start));  // alive
  auto child = test::Process::fork_fn([] { return 0; });
  const pid_t dead = child.pid();
  child.wait(std::chrono::seconds(5));
  (*created)->header().server_pid = static_cast<uint32_t>(dead);
  BOOST_TEST(!Segment::remove_if_left_by(name, dead, start));  // its lock is still held
  created->reset();                                            // the lock goes, the object stays
  BOOST_TEST(!Segment::remove_if_left_by(name, dead + 1, start));
  BOOST_TEST(!Segment::remove_if_left_by(name, dead, start + 1));
  BOOST_TEST(::access(path.c_str(), F_OK) == 0);
  BOOST_TEST(Segment::remove_if_left_by(name, dead, start));
  BOOST_TEST(::access(path.c_str(), F_OK) != 0);
  BOOST_TEST(!Segment::remove_if_left_by(name, dead, start));  // nothing there
}

// Any process that may write an object at the name may truncate it while
// a starting server or a launcher (remove_if_left_by) reads its header:
// the read is a pread, which comes back short, not a mapped page past the
// end, which is a SIGBUS.
BOOST_AUTO_TEST_CASE(a_header_read_races_a_truncate_without_a_sigbus) {
  const std::string name = test::unique_name("trunc");
  Cleanup cleanup{name};
  const std::string object = segment_object_name(name);
  const int fd = ::shm_open(object.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  BOOST_REQUIRE(fd >= 0);
  std::atomic<bool> stop{false};
  std::thread truncator([&] {
    SegmentHeader h{};  // a segment whose server is gone
    h.magic = kMagic;
    h.server_pid = 999999;
    h.server_start_time = 12345;
    while (!stop.load(std::memory_order_relaxed)) {  // relaxed: a stop flag
      if (::ftruncate(fd, 8192) != 0 || ::pwrite(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h) ||
          ::ftruncate(fd, 0) != 0)
        break;
    }
  });
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  long calls = 0;
  for (; calls < 200000 && std::chrono::steady_clock::now() < end; ++calls)
    BOOST_REQUIRE(!Segment::remove_if_left_by(name, 424242, 1));  // another server's: never removed
  stop.store(true, std::memory_order_relaxed);                    // relaxed: a stop flag
  truncator.join();
  ::close(fd);
  BOOST_TEST_MESSAGE(calls << " header reads raced a truncate");
}

BOOST_AUTO_TEST_CASE(full_dev_shm_fails_at_creation_with_sizes) {
  auto huge = ShmObject::create("shmps.huge_" + std::to_string(::getpid()), size_t{1} << 44, 0600);
  BOOST_TEST((huge.status().code() == ErrorCode::kNoCapacity));
  BOOST_TEST(huge.status().message().find("need 17592186044416 bytes") != std::string::npos);
  BOOST_TEST(huge.status().message().find("available") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(a_size_beyond_any_file_is_refused_and_leaves_no_object) {
  const std::string object = "shmps.beyond_" + std::to_string(::getpid());
  for (const size_t bytes : {size_t{1} << 63, ~size_t{0}}) {
    auto created = ShmObject::create(object, bytes, 0600);
    BOOST_TEST((created.status().code() == ErrorCode::kNoCapacity));
    BOOST_TEST(created.status().message().find("larger than any file") != std::string::npos);
    BOOST_TEST(::access(("/dev/shm/" + object).c_str(), F_OK) != 0);
  }
}

BOOST_AUTO_TEST_CASE(a_fifo_at_the_name_is_refused_without_blocking) {
  const std::string name = test::unique_name("fifo");
  const std::string path = "/dev/shm/" + segment_object_name(name);
  BOOST_REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  Cleanup cleanup{name};
  for (const bool read_only : {true, false}) {
    auto opened = Segment::open(name, read_only);  // would block in open() on a FIFO without a writer
    BOOST_TEST((opened.status().code() == ErrorCode::kIo));
    BOOST_TEST(opened.status().message().find("not a regular file") != std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(names_are_validated) {
  BOOST_TEST(validate_name("job-1.a_b").ok());
  BOOST_TEST(!validate_name("").ok());
  BOOST_TEST(!validate_name("a/b").ok());
  BOOST_TEST(!validate_name(".hidden").ok());
  BOOST_TEST(validate_name(std::string(32, 'a')).ok());
  BOOST_TEST(!validate_name(std::string(33, 'a')).ok());
  BOOST_TEST(!validate_name("sp ace").ok());
  // The shape of server "job"'s worker buffers, which its start would
  // remove as a dead worker's: refused, naming the part.
  for (const char* buffer_like : {"job.p999999.0", "a.b.p12.3"}) {
    const Status s = validate_name(buffer_like);
    BOOST_TEST(!s.ok(), buffer_like);
    BOOST_TEST(s.message().find("worker buffer") != std::string::npos, s.message());
  }
  // Refused whatever the numbers (an older server's sweep reads any digits).
  for (const char* buffer_like : {"job.p0.1", "job.p99999999999.1", "job.p1.123456789012345678901"})
    BOOST_TEST(!validate_name(buffer_like).ok(), buffer_like);
  for (const char* fine :
       {"job.p1", "job.p.1", "job.px.1", "p1.x", "job.q1.2", "job.p1x.2", "job.p1.x", "train.p3.8xlarge", "p1.2"})
    BOOST_TEST(validate_name(fine).ok(), fine);
  SegmentSpec spec = small_spec("ok");
  spec.tensors.push_back({"fc1.bias", {1}});
  BOOST_TEST((Segment::create(spec, 1).status().code() == ErrorCode::kInvalidArgument));  // duplicate
}

// The one reading of a buffer object's name, shared by the server's orphan
// sweep, the name check above and shmps-inspect --list.
BOOST_AUTO_TEST_CASE(buffer_object_names_parse_from_the_end) {
  BOOST_TEST(buffer_object_name("job", 42, 7) == "shmps.job.p42.7");
  BOOST_TEST(buffer_object_prefix("job", 42) == "shmps.job.p42.");
  const auto parsed = parse_buffer_object_name(buffer_object_name("a.p1", 2147483647, 18446744073709551615u));
  BOOST_REQUIRE(parsed.has_value());
  BOOST_TEST(parsed->server == "a.p1");
  BOOST_TEST(parsed->pid == 2147483647);
  BOOST_TEST(parsed->n == 18446744073709551615u);
  for (const char* not_a_buffer : {"shmps.job", "job.p1.2", "shmps..p1.2", "shmps.p1.2", "shmps.job.p0.2",
                                   "shmps.job.p2147483648.2", "shmps.job.p1.", "shmps.job.p.2", "shmps.job.q1.2",
                                   "shmps.job.p1.2x", "shmps.job.p1x.2", "shmps.job.p1.99999999999999999999"})
    BOOST_TEST(!parse_buffer_object_name(not_a_buffer).has_value(), not_a_buffer);
}

BOOST_AUTO_TEST_CASE(oversized_tensors_are_refused_before_the_object_exists) {
  // Each of 2^63 elements: the sum overflows, and must be refused before
  // the object is created, or it would stay in /dev/shm.
  const std::string name = test::unique_name("oversize");
  Cleanup cleanup{name};
  for (const auto& tensors :
       std::vector<std::vector<TensorSpec>>{{{"a", {4294967296, 2147483648}}, {"b", {4294967296, 2147483648}}},
                                            {{"a", {1048576, 1048576}}, {"b", {2}}},  // 2^40 + 2 in all
                                            {{"a", {1048576, 1048576, 2}}}}) {
    SegmentSpec spec = small_spec(name);
    spec.tensors = tensors;
    const auto created = Segment::create(spec, 1);
    BOOST_TEST((created.status().code() == ErrorCode::kInvalidArgument));
    BOOST_TEST(created.status().message().find("2^40") != std::string::npos, created.status().message());
    BOOST_TEST(::access(("/dev/shm/" + segment_object_name(name)).c_str(), F_OK) != 0);
  }
  BOOST_TEST(validate_tensors({{"a", {1048576, 1048576}}}).ok());  // 2^40 exactly
  BOOST_TEST(!validate_tensors({}).ok());
}

BOOST_AUTO_TEST_CASE(validation_catches_each_corruption) {
  const std::string name = test::unique_name("corrupt");
  Cleanup cleanup{name};
  auto created = Segment::create(small_spec(name), 1);
  BOOST_REQUIRE(created.ok());
  (*created)->publish();
  const ShmObject& obj = (*created)->object();
  std::vector<char> good(static_cast<const char*>(obj.data()), static_cast<const char*>(obj.data()) + obj.size());
  BOOST_REQUIRE(validate_segment(good.data(), good.size()).ok());
  const auto corrupt = [&](size_t offset, uint64_t value, size_t width, const std::string& expect) {
    std::vector<char> bad = good;
    std::memcpy(bad.data() + offset, &value, width);
    Status s = validate_segment(bad.data(), bad.size());
    BOOST_TEST(!s.ok());
    BOOST_TEST_MESSAGE(s.message());
    BOOST_TEST(s.message().find(expect) != std::string::npos, "'" << s.message() << "' lacks '" << expect << "'");
  };
  corrupt(offsetof(SegmentHeader, magic), 7, 8, "not a shmps segment");
  corrupt(offsetof(SegmentHeader, layout_version), 99, 4, "99");
  corrupt(offsetof(SegmentHeader, lane_capacity), 3, 4, "power of two");
  corrupt(offsetof(SegmentHeader, max_workers), 1000, 4, "max_workers");
  corrupt(offsetof(SegmentHeader, stats_offset), 12345, 8, "offsets");
  corrupt(offsetof(SegmentHeader, total_elements), 17, 8, "total_elements");
  corrupt(4096 + offsetof(TensorDesc, ndim), 9, 4, "ndim");
  corrupt(4096 + offsetof(TensorDesc, shape), 5, 8, "inconsistent");
  corrupt(4096 + 128 + offsetof(TensorDesc, element_offset), 3, 8, "inconsistent");
  corrupt(offsetof(SegmentHeader, config) + offsetof(ConfigBlock, optimizer_kind), 77, 4, "optimizer_kind");
  Status truncated = validate_segment(good.data(), good.size() - 4096);
  BOOST_TEST(truncated.message().find("segment_size") != std::string::npos);
  BOOST_TEST(!validate_segment(good.data(), 100).ok());
}

// Any process that may write the segment may change its header after a
// peer checked it: every accessor of the creator's and an opener's Segment
// keeps the addresses the validated layout gives, and the opener's tensor
// table and counts are its private copy.
BOOST_AUTO_TEST_CASE(a_header_scribbled_after_the_check_moves_no_accessor) {
  const std::string name = test::unique_name("scribble");
  Cleanup cleanup{name};
  auto created = Segment::create(small_spec(name), 5);
  BOOST_REQUIRE(created.ok());
  (*created)->publish();
  auto opened = Segment::open(name, /*read_only=*/false);
  BOOST_REQUIRE_MESSAGE(opened.ok(), opened.status().to_string());
  const auto addresses = [](const Segment& s) {
    return std::vector<const void*>{&s.worker(3),      &s.buffer(3, 1),       s.buffer_table_bytes(2),
                                    &s.lane(3),        s.lane_slots(3),       s.lane_stamps(3),
                                    &s.completions(3), s.completion_slots(3), &s.stats()};
  };
  const std::vector<const void*> before_created = addresses(**created);
  const std::vector<const void*> before_opened = addresses(**opened);
  SegmentHeader& h = (*opened)->header();
  const uint64_t garbage = 0x7fff'ffff'ffffULL;
  for (uint64_t* field : {&h.tensor_table_offset, &h.worker_table_offset, &h.lanes_offset, &h.lane_stride,
                          &h.completions_offset, &h.completion_stride, &h.stats_offset, &h.total_elements})
    *field = garbage;
  h.worker_entry_size = 0xffff'ffff;
  h.lane_capacity = 1u << 31;
  h.max_workers = 100000;
  h.max_buffers = 100000;
  h.tensor_count = 7;
  h.generation = 77;
  auto& table0 = *reinterpret_cast<TensorDesc*>(reinterpret_cast<char*>(&h) + sizeof(SegmentHeader));
  std::memset(table0.name, 'x', sizeof table0.name);  // no NUL left
  table0.ndim = 1000;
  BOOST_TEST(addresses(**created) == before_created);
  BOOST_TEST(addresses(**opened) == before_opened);
  for (const Segment* s : {created->get(), opened->get()}) {
    const SegmentLayout& l = s->layout();
    BOOST_TEST(l.tensor_count == 2u);
    BOOST_TEST(l.max_workers == 4u);
    BOOST_TEST(l.max_buffers == 2u);
    BOOST_TEST(l.lane_capacity == 8u);
    BOOST_TEST(l.total_elements == 16u);
    BOOST_TEST(l.generation == 5u);
    BOOST_REQUIRE(l.tensors.size() == 2u);
    BOOST_TEST(std::string(l.tensors[0].name) == "fc1.weight");
    BOOST_TEST(l.tensors[0].ndim == 2u);
    BOOST_TEST(l.tensors[1].element_offset == 12u);
  }
  // A newcomer checks the header as it is now.
  auto late = Segment::open(name, true);
  BOOST_TEST((late.status().code() == ErrorCode::kLayoutMismatch));
}

// header_intact() answers whether every word write_header() wrote still
// holds it (the server's periodic check), whatever else workers write, and
// write_header() + publish() make it true again.
BOOST_AUTO_TEST_CASE(header_intact_sees_the_servers_words_only) {
  const std::string name = test::unique_name("intact");
  Cleanup cleanup{name};
  const SegmentSpec spec = small_spec(name);
  auto created = Segment::create(spec, 9);
  BOOST_REQUIRE(created.ok());
  Segment& seg = **created;
  WeightsExportBlock exported{};
  exported.flags = kWeightsExportPresent;
  exported.allocation_bytes = 1u << 21;
  seg.header().weights_export = exported;
  seg.header().server_state.store(static_cast<uint32_t>(ServerState::kRunning));
  const auto intact = [&] { return seg.header_intact(spec.config, ServerState::kRunning, exported); };
  BOOST_TEST(!intact(), "unpublished");
  seg.publish();
  BOOST_TEST(intact());
  BOOST_TEST(!seg.header_intact(spec.config, ServerState::kStarting, exported), "another state");
  SegmentHeader& h = seg.header();
  // Words that are not the server's to keep: workers' doorbells and wake
  // word, the heartbeat, reserved space.
  h.doorbell[0].store(5);
  h.server_wake.waiters.store(3);
  h.heartbeat_ns.store(1);
  h.reserved0 = 7;
  BOOST_TEST(intact());
  auto& table1 =
      *reinterpret_cast<TensorDesc*>(reinterpret_cast<char*>(&h) + sizeof(SegmentHeader) + sizeof(TensorDesc));
  const std::vector<std::function<void()>> harms = {
      [&] { h.magic = 0; },
      [&] { h.layout_version.store(0); },
      [&] { h.generation ^= 1; },
      [&] { h.lanes_offset += 64; },
      [&] { h.config.lr = 1e9f; },
      [&] { h.weights_export.ipc_handle[63] ^= 1; },
      [&] { table1.element_count = 1u << 30; },
      [&] { std::memset(static_cast<void*>(&h), 0, sizeof h); },
  };
  for (size_t i = 0; i < harms.size(); ++i) {
    BOOST_TEST_CONTEXT("harm " << i) {
      harms[i]();
      BOOST_TEST(!intact());
      seg.write_header(spec.config, ServerState::kRunning, exported);
      seg.publish();
      BOOST_TEST(intact());
    }
  }
  // What the repair wrote is what a newcomer checks.
  auto opened = Segment::open(name, true);
  BOOST_REQUIRE_MESSAGE(opened.ok(), opened.status().to_string());
  BOOST_TEST((*opened)->layout().tensors.at(1).element_count == 4u);
}

BOOST_AUTO_TEST_CASE(process_identity_survives_zombies) {
  BOOST_TEST(process_alive(::getpid(), process_start_time(::getpid())));
  BOOST_TEST(!process_alive(::getpid(), process_start_time(::getpid()) + 1));  // "reused pid"
  const pid_t child = ::fork();
  if (child == 0) _exit(0);
  // Not reaped yet: a zombie, which kill(pid, 0) would call alive.
  BOOST_TEST(test::eventually([&] { return !pid_in_use(child); }));
  BOOST_TEST(::kill(child, 0) == 0);
  int status = 0;
  ::waitpid(child, &status, 0);
}

// A process out of descriptors cannot read /proc: the processes it asks
// about are not taken for gone (a server would reap a live worker, a
// worker remove a live one's buffers); the parent's pid is read too.
BOOST_AUTO_TEST_CASE(a_process_out_of_descriptors_takes_nobody_for_dead) {
  const pid_t me = ::getpid();
  const uint64_t my_start = process_start_time(me);
  BOOST_TEST(parent_pid(me) == ::getppid());
  BOOST_TEST(parent_pid(999'999'999) == -1);
  auto child = test::Process::fork_fn([me, my_start] {
    const rlimit few{16, 16};
    if (::setrlimit(RLIMIT_NOFILE, &few) != 0) return 90;
    while (::open("/dev/null", O_RDONLY) >= 0) {
    }
    if (errno != EMFILE) return 91;
    if (!pid_in_use(me) || !process_alive(me, my_start)) return 92;
    if (pid_in_use(999'999'999)) return 93;  // no such pid: the kernel says so
    return 0;
  });
  BOOST_TEST(child.wait(std::chrono::seconds(10)) == 0);
}

// A process that sees no /proc entry of another user's processes (proc
// mounted hidepid=invisible, a unit's ProtectProc=invisible) takes none of
// them for gone: the kernel says whether the pid lives (kill(pid, 0):
// EPERM). The child mounts a proc of its own so in a mount namespace of
// its own, then runs as nobody.
BOOST_AUTO_TEST_CASE(a_process_that_cannot_see_another_users_processes_takes_none_for_dead) {
  if (::geteuid() != 0) {
    BOOST_TEST_MESSAGE("skipped: needs root to mount a proc of its own and run as another user");
    return;
  }
  const pid_t me = ::getpid();
  const uint64_t my_start = process_start_time(me);
  auto child = test::Process::fork_fn([me, my_start] {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible") != 0)
      return 90;
    if (::setgid(65534) != 0 || ::setgroups(0, nullptr) != 0 || ::setuid(65534) != 0) return 91;
    if (::access(("/proc/" + std::to_string(me)).c_str(), F_OK) == 0) return 92;  // not hidden
    if (!pid_in_use(me) || !process_alive(me, my_start) || process_state(me, my_start) == ProcessState::kGone)
      return 93;
    if (pid_in_use(999'999'999)) return 94;  // no such pid: the kernel says so
    return 0;
  });
  const int rc = child.wait(std::chrono::seconds(10));
  if (rc == 90) {
    BOOST_TEST_MESSAGE("skipped: cannot mount a proc with hidepid=invisible in a mount namespace of its own");
    return;
  }
  BOOST_TEST(rc == 0);
}

// An object larger than any segment is refused before it is mapped
// (kLayoutMismatch), not as a failed mmap of terabytes (kIo, ENOMEM).
BOOST_AUTO_TEST_CASE(an_object_larger_than_any_segment_is_refused_before_its_mapping) {
  const std::string name = "oversize_" + std::to_string(::getpid());
  const std::string path = "/dev/shm/" + segment_object_name(name);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  BOOST_REQUIRE(fd >= 0);
  const bool sized = ::ftruncate(fd, off_t{0x7fffffffffff}) == 0;
  ::close(fd);
  struct Unlink {
    std::string path;
    ~Unlink() { ::unlink(path.c_str()); }
  } unlink_it{path};
  BOOST_REQUIRE(sized);
  auto opened = Segment::open(name, true);
  BOOST_REQUIRE(!opened.ok());
  BOOST_TEST((opened.status().code() == ErrorCode::kLayoutMismatch), opened.status().to_string());
  BOOST_TEST(opened.status().message().find("more than any shmps segment") != std::string::npos,
             opened.status().to_string());
}

// open_window() maps the pages of its window alone: of an object of 1 TiB
// (sparse), a window of 16 bytes that straddles a page boundary maps two
// pages from the one before it, reads and writes the object's bytes
// there, and refuses a window past the object's end or of 0 bytes.
BOOST_AUTO_TEST_CASE(a_window_maps_its_pages_alone) {
  const std::string object = "shmps.window_" + std::to_string(::getpid());
  const uint64_t bytes = uint64_t{1} << 40;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t offset = bytes - page - 8;
  const int fd = ::shm_open(object.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  BOOST_REQUIRE(fd >= 0);
  struct Removed {
    std::string object;
    ~Removed() { ShmObject::remove(object); }
  } removed{object};
  const char marks[16] = "abcdefghijklmno";
  const bool made = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 &&
                    ::pwrite(fd, marks, sizeof marks, static_cast<off_t>(offset)) == sizeof marks;
  BOOST_REQUIRE(made);
  auto window = ShmObject::open_window(object, /*read_only=*/false, offset, sizeof marks);
  BOOST_REQUIRE_MESSAGE(window.ok(), window.status().to_string());
  const auto* data = static_cast<const char*>((*window)->data());
  const auto* mapped = static_cast<const char*>((*window)->mapping());
  BOOST_TEST((*window)->size() == sizeof marks);
  BOOST_TEST(reinterpret_cast<uintptr_t>(mapped) % page == 0u);
  BOOST_TEST(static_cast<uint64_t>(data - mapped) == page - 8);
  BOOST_TEST((*window)->mapping_size() == page + 8);
  BOOST_TEST(std::memcmp(data, marks, sizeof marks) == 0);
  std::memcpy(static_cast<char*>((*window)->data()) + 8, "XY", 2);  // the second page
  char back[2] = {};
  BOOST_REQUIRE(::pread(fd, back, sizeof back, static_cast<off_t>(offset + 8)) == sizeof back);
  BOOST_TEST(std::memcmp(back, "XY", 2) == 0);
  ::close(fd);
  auto past = ShmObject::open_window(object, false, bytes - 8, 16);
  BOOST_TEST((past.status().code() == ErrorCode::kBadRange), past.status().to_string());
  BOOST_TEST(past.status().message().find(std::to_string(bytes)) != std::string::npos, past.status().to_string());
  auto beyond = ShmObject::open_window(object, false, ~uint64_t{0} - 4, 16);
  BOOST_TEST((beyond.status().code() == ErrorCode::kBadRange), beyond.status().to_string());
  auto empty = ShmObject::open_window(object, false, 0, 0);
  BOOST_TEST((empty.status().code() == ErrorCode::kInvalidArgument), empty.status().to_string());
}

// A start time of 0 is no process's identity (a segment's header without
// the server's start time, an entry before its worker wrote one): with it
// no process counts as alive, whatever lives at the pid.
BOOST_AUTO_TEST_CASE(unknown_start_time_names_no_process) {
  BOOST_TEST((process_state(::getpid(), 0) == ProcessState::kGone));
  BOOST_TEST(!process_alive(::getpid(), 0));
  BOOST_TEST((process_state(::getpid(), process_start_time(::getpid())) == ProcessState::kRunning));
}

BOOST_AUTO_TEST_SUITE_END()
