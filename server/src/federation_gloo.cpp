// The Gloo engine of the federation: elastic membership over Gloo's TCP
// transport, agreed through a store every host sees (a directory, or a
// Redis server). Gloo decides no membership of its own: reform() runs the
// agreement below, then Gloo's rendezvous for the agreed (rank, size).
//
// One attempt k (docs/federation.md, "Gloo"), with keys written once, each
// by one host, under the job's prefix:
//   a<k>/want/<host>  Want: the job's host count, the last epoch this
//                     host was in and that epoch's members
//   a<k>/view/<host>  the hosts whose wants it saw (a bit mask)
//   a<k>/gloo/...     Gloo's rendezvous of the group formed at k
//   a<k>/formed       the group's members, written by its rank 0 once
//                     the rendezvous went through
//   floor             the attempts up to it were decided (a group formed
//                     past them, or the store was wiped under the group
//                     of that epoch or before it formed): a set of values
//                     of which the highest counts, so that it only rises
//                     (JobStore::add_floor())
//   swept             a Swept: the attempts whose keys were erased
// A host writes its want, waits until the last epoch's members all want
// too (or a settle time passes), writes what it saw as its view, and reads
// the views of the hosts it saw: all equal, the group is those hosts (an
// epoch numbered k); any different or missing, the attempt fails and the
// next starts. The group forms only with a majority of the members of the
// newest group formed before (from the store's `formed` records, so that a
// restarted host, which remembers none, cannot help a minority to a
// group; at the first, of all --fed-hosts): a minority pauses instead. A
// host that wants in later writes its want at the attempt after the
// group's epoch, which the members look for once per round
// (joiner_waiting()); when its rendezvous with them then fails in its
// connections (a host they cannot reach), it waits before its next want,
// longer after each such failure in a row (back_off()). A store wiped
// under a running group (a Redis restarted without persistence) has lost
// the attempts a newcomer counts from: the group's rank 0, finding its
// `formed` record gone (once a round), or the first attempt's wants gone
// where the group formed past it (as it forms: a store wiped while the
// group re-formed), adds the floor and writes the record again, and a
// newcomer's first attempt is then the one after the group's epoch, as in
// a store never wiped. The group's rank 0 also moves the floor up to the
// attempts before its epoch and erases their keys
// (sweep_decided_attempts()): a long job's store stays small.
//
// Used by the federation thread alone (the store classes are not thread-safe).
#include <fcntl.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <random>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <type_traits>

#include "fed_store.hpp"
#include "federation_plugin.hpp"
#include "shmps/server/federation.hpp"
#include "shmps/unique_fd.hpp"
#include "threads.hpp"

namespace shmps::server {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often the settle, the agreement and the rendezvous look at the
// store: first after kPoll, then at twice the last wait, up to kPollMost
// (a host waits seconds for a peer that is away: each look is a store
// call per host of the job, and a partitioned half of a job looks all at
// once).
constexpr milliseconds kPoll{5};
constexpr milliseconds kPollMost{50};

class PollBackoff {
 public:
  void sleep() {
    std::this_thread::sleep_for(next_);
    next_ = std::min(2 * next_, kPollMost);
  }

 private:
  milliseconds next_ = kPoll;
};
// The longest a re-forming host waits for the other members of its last
// group to want in too.
constexpr milliseconds kSettle{200};
// How often a group's member tries to open a store that failed again.
constexpr std::chrono::seconds kStoreRetry{5};
// A newcomer that could not connect to a running group's hosts waits
// before its next want: the engine's timeout, doubled with each such
// failure in a row, up to 2^kMaxBackoffDoublings timeouts (plus up to half
// of that at random: back_off()). Each of its tries costs the group about
// one timeout (the rendezvous that fails), so at the cap a host that stays
// unreachable takes under 2% of the group's time, whatever the timeout,
// and one whose network is repaired is back within 96 timeouts (8 min at
// the default 5 s).
constexpr uint32_t kMaxBackoffDoublings = 6;
// How often the backoff looks at the stop flag.
constexpr milliseconds kBackoffPoll{20};
// Gloo's TCP pair waits this many times its context's timeout for its
// first connection (gloo/transport/tcp/pair.h, waitUntil()); the
// rendezvous gives it the engine's timeout divided by it, so that a pair
// whose peer cannot connect fails within one timeout, as every other
// wait of a re-formation does.
constexpr int64_t kGlooConnectWaitFactor = 5;
// The highest floor believed (a garbage one beyond it is ignored): far
// past any epoch, and far from the gallop's overflow.
constexpr uint64_t kMaxFloor = uint64_t{1} << 48;
// How far back newest_group() looks for a `formed` record: a group forms
// within a few attempts of the one before it; a longer search (a floor or
// wants far past the last group) would cost a store call per attempt.
constexpr uint64_t kFormedSearch = 256;
// Tags a Want ("SHFW").
constexpr uint32_t kWantMagic = 0x57464853;
// The store's key of the Swept record.
constexpr const char* kSweptKey = "swept";
// Tags a Swept ("SHFS").
constexpr uint32_t kSweptMagic = 0x53464853;
// About how many keys the group's rank 0 erases a round
// (sweep_decided_attempts()): whole attempts, at least one.
constexpr size_t kSweepKeysPerRound = 64;

std::string gloo_error(const char* what, const std::exception& e) {
  return std::string("federation (gloo): ") + what + ": " + e.what();
}

// The job's store: keys under the job's prefix, written once (set) or
// replaced whole (replace), read without waiting (get: empty when absent),
// and erased; none of Gloo's own store calls, whose get() waits 30 s for
// an absent key and whose file store remembers every key it wrote for
// the life of the process. Throws std::exception on a failed call.
class JobStore {
 public:
  // "file:DIR" or "redis:HOST[:PORT][/JOB]".
  static Result<std::unique_ptr<JobStore>> open(const std::string& spec);
  virtual ~JobStore() = default;

  bool has(const std::string& key) { return exists(prefix_ + key); }
  // Throws when the key exists.
  void set(const std::string& key, const void* data, size_t n) { put(prefix_ + key, bytes_of(data, n), /*once=*/true); }
  void replace(const std::string& key, const void* data, size_t n) {
    put(prefix_ + key, bytes_of(data, n), /*once=*/false);
  }
  std::vector<char> get(const std::string& key) { return read(prefix_ + key); }
  // The keys that exist among `keys` are gone.
  void erase(const std::vector<std::string>& keys) {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    remove(full);
  }
  // Until every key exists; false at the deadline or once cancelled.
  bool await(const std::vector<std::string>& keys, Clock::time_point deadline, const std::function<bool()>& cancelled) {
    PollBackoff backoff;
    for (const std::string& k : keys)
      while (!has(k)) {
        if (Clock::now() >= deadline || cancelled()) return false;
        backoff.sleep();
      }
    return true;
  }
  // Which of `keys` exist, in one call where the store can.
  std::vector<bool> has_each(const std::vector<std::string>& keys) {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    return exist_each(full);
  }

  // The floor: a set of values of which the highest counts. Adding one
  // never lowers it, whenever the write lands (a writer stopped, or a
  // write held in a partition, lands late): no compare-and-set is needed,
  // which a file store cannot do.
  virtual void add_floor(uint64_t value) = 0;
  // The highest value at most `limit` (0: none); higher ones are garbage.
  virtual uint64_t highest_floor(uint64_t limit) = 0;
  // Values below `value` go (they count for nothing beside it).
  virtual void prune_floors_below(uint64_t value) = 0;

 protected:
  explicit JobStore(std::string prefix) : prefix_(std::move(prefix)) {}
  const std::string& prefix() const noexcept { return prefix_; }

 private:
  static std::vector<char> bytes_of(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    return std::vector<char>(p, p + n);
  }
  virtual bool exists(const std::string& key) = 0;
  virtual std::vector<bool> exist_each(const std::vector<std::string>& keys) {
    std::vector<bool> found;
    found.reserve(keys.size());
    for (const std::string& k : keys) found.push_back(exists(k));
    return found;
  }
  virtual void put(const std::string& key, const std::vector<char>& value, bool once) = 0;
  virtual std::vector<char> read(const std::string& key) = 0;
  virtual void remove(const std::vector<std::string>& keys) = 0;

  const std::string prefix_;
};

// A directory every host sees: a file per key, named by a hash of the key
// (as Gloo's FileStore names it). A value appears whole: written to a file
// of its own, then linked (once: the link fails on an existing key, where
// Gloo's check-then-rename races) or renamed (replace) into place. Every
// host of a job runs one build: a build whose store is Gloo's would wait
// 30 s on a key the sweep erased.
class FileJobStore final : public JobStore {
 public:
  explicit FileJobStore(std::filesystem::path dir) : JobStore(""), dir_(std::move(dir)) {}

 private:
  std::string path(const std::string& key) const {
    return (dir_ / std::to_string(std::hash<std::string>{}(key))).string();
  }
  [[noreturn]] static void fail(const std::string& what, const std::string& file) {
    throw std::runtime_error("file store: " + what + " " + file + ": " + std::strerror(errno));
  }
  // Opens a key's file (`flags`: O_RDONLY, or O_WRONLY | O_CREAT), never
  // following a symbolic link and never waiting: a FIFO there would block
  // open() for as long as nobody opens its other end (O_NONBLOCK: a
  // reader's open returns at once, a writer's fails with ENXIO). What
  // opened is checked by plain_size(). -1 with errno ENOENT where the file
  // is absent (O_RDONLY); throws for any other failure, naming a symbolic
  // link or a FIFO as such.
  static int open_plain(const std::string& file, int flags, const char* what) {
    const int fd = ::open(file.c_str(), flags | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno == ENOENT) return fd;
    if (errno == ELOOP)
      throw std::runtime_error("file store: " + file + " is a symbolic link, not a value of this job (refused)");
    if (errno == ENXIO)
      throw std::runtime_error("file store: " + file + " is a FIFO or a device, not a value of this job (refused)");
    fail(what, file);
  }
  // The size of the plain file open at `fd`; anything else (a FIFO, a
  // device, a socket, a directory) is refused.
  static off_t plain_size(int fd, const std::string& file) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail("cannot stat", file);
    if (!S_ISREG(st.st_mode))
      throw std::runtime_error("file store: " + file + " is " + file_kind(st.st_mode) +
                               ", not a value of this job (refused: a value is a plain file)");
    return st.st_size;
  }
  static std::string file_kind(mode_t mode) {
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a plain file";
  }

  bool exists(const std::string& key) override {
    const std::string file = path(key);
    if (::access(file.c_str(), F_OK) == 0) return true;
    if (errno != ENOENT) fail("cannot look at", file);
    return false;
  }

  void put(const std::string& key, const std::vector<char>& value, bool once) override {
    const std::string file = path(key);
    // Unique among writers: hosts on other machines may share the
    // directory, so the name carries a random part besides the pid.
    const std::string tmp = file + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(random_());
    {
      // O_EXCL: a new file, never one already there (a FIFO, or a
      // symbolic link, which O_EXCL does not follow).
      const UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (fd.fd < 0) fail("cannot create", tmp);
      size_t done = 0;
      while (done < value.size()) {
        const ssize_t n = ::write(fd.fd, value.data() + done, value.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          const int saved = errno;
          ::unlink(tmp.c_str());
          errno = saved;
          fail("cannot write", tmp);
        }
        done += static_cast<size_t>(n);
      }
    }
    if (!once) {
      if (::rename(tmp.c_str(), file.c_str()) != 0) {
        const int saved = errno;
        ::unlink(tmp.c_str());
        errno = saved;
        fail("cannot rename into", file);
      }
      return;
    }
    int placed = ::link(tmp.c_str(), file.c_str());
    int saved = errno;
    if (placed != 0 && saved == EEXIST) {
      // Over NFS a retransmitted link can answer EEXIST for a link that
      // was made: the temporary file then has two names (open(2)).
      struct stat st {};
      if (::stat(tmp.c_str(), &st) == 0 && st.st_nlink == 2) placed = 0;
    } else if (placed != 0 && (saved == EPERM || saved == ENOTSUP || saved == EOPNOTSUPP || saved == ENOSYS)) {
      // A filesystem without hard links (vfat, some FUSE and SMB mounts):
      // a rename that refuses an existing name, else Gloo's own way, a
      // check and then a rename (two hosts racing for one key may both
      // succeed there; the last one's value stays).
      placed = ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, file.c_str(), RENAME_NOREPLACE);
      saved = errno;
      if (placed != 0 && (saved == EINVAL || saved == ENOSYS || saved == ENOTSUP || saved == EOPNOTSUPP)) {
        if (::access(file.c_str(), F_OK) == 0) {
          saved = EEXIST;
        } else {
          placed = ::rename(tmp.c_str(), file.c_str());
          saved = errno;
        }
      }
    }
    ::unlink(tmp.c_str());  // after a rename: ENOENT, nothing left
    if (placed == 0) return;
    errno = saved;
    if (saved == EEXIST) throw std::runtime_error("file store: key '" + key + "' is already set (" + file + ")");
    fail("cannot place", file);
  }

  std::vector<char> read(const std::string& key) override {
    const std::string file = path(key);
    const UniqueFd fd(open_plain(file, O_RDONLY, "cannot open"));
    if (fd.fd < 0) return {};  // absent
    // Any process that can write the directory wrote it: a value is a
    // record or a rendezvous address, never this large.
    const off_t size = plain_size(fd.fd, file);
    if (size > kMaxValue)
      throw std::runtime_error("file store: " + file + " is not a value of this job (" + std::to_string(size) +
                               " bytes, more than " + std::to_string(kMaxValue) + ")");
    std::vector<char> value(static_cast<size_t>(size));
    size_t done = 0;
    while (done < value.size()) {
      const ssize_t n = ::read(fd.fd, value.data() + done, value.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read", file);
      if (n == 0) break;  // a value is never changed in place (a new file is linked or renamed over it)
      done += static_cast<size_t>(n);
    }
    value.resize(done);
    return value;
  }

  void remove(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) {
      const std::string file = path(key);
      if (::unlink(file.c_str()) != 0 && errno != ENOENT) fail("cannot remove", file);
    }
  }

  // The floor's values: empty files named by their decimal value in
  // floors/ (an exclusive create is not needed: two writers of one value
  // agree).
  std::filesystem::path floors() const { return dir_ / "floors"; }
  void add_floor(uint64_t value) override {
    if (::mkdir(floors().c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create", floors().string());
    const std::string file = (floors() / std::to_string(value)).string();
    const UniqueFd fd(open_plain(file, O_WRONLY | O_CREAT, "cannot create"));
    if (fd.fd < 0) fail("cannot create", file);  // ENOENT: floors/ removed meanwhile
    static_cast<void>(plain_size(fd.fd, file));
  }
  // Each value of floors/, in a name of digits only (anything else is
  // garbage), passed to `each`.
  template <class Each>
  void for_each_floor(Each each) {
    std::error_code ec;
    std::filesystem::directory_iterator it(floors(), ec), end;
    if (ec) {
      if (ec == std::errc::no_such_file_or_directory) return;
      throw std::runtime_error("file store: cannot list " + floors().string() + ": " + ec.message());
    }
    for (; it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      uint64_t value = 0;
      const auto [last, err] = std::from_chars(name.data(), name.data() + name.size(), value);
      if (err == std::errc() && last == name.data() + name.size() && !name.empty() && name[0] != '+')
        each(value, it->path());
    }
    if (ec) throw std::runtime_error("file store: cannot list " + floors().string() + ": " + ec.message());
  }
  uint64_t highest_floor(uint64_t limit) override {
    uint64_t highest = 0;
    for_each_floor([&](uint64_t value, const std::filesystem::path&) {
      if (value <= limit) highest = std::max(highest, value);
    });
    return highest;
  }
  void prune_floors_below(uint64_t value) override {
    for_each_floor([&](uint64_t v, const std::filesystem::path& file) {
      if (v < value && ::unlink(file.c_str()) != 0 && errno != ENOENT) fail("cannot remove", file.string());
    });
  }

  static constexpr off_t kMaxValue = 1 << 20;
  const std::filesystem::path dir_;
  std::minstd_rand random_{std::random_device{}()};
};

// A Redis server, through Gloo's connection to it with a timeout on every
// call: hiredis would otherwise block as long as TCP retries to an
// unreachable server.
class RedisJobStore final : public JobStore {
 public:
  RedisJobStore(const std::string& host, int port, const std::string& job) : JobStore(job + "/"), redis_(host, port) {}

 private:
  // Gloo's RedisStore for its connection and its EXISTS.
  class Connection : public gloo::rendezvous::RedisStore {
   public:
    Connection(const std::string& host, int port) : RedisStore(host, port) {
      const timeval limit{5, 0};
      redisSetTimeout(redis_, limit);
    }
    // One command, its arguments binary-safe; the reply's type checked.
    std::unique_ptr<redisReply, void (*)(void*)> command(const std::vector<std::string_view>& args) {
      std::vector<const char*> argv;
      std::vector<size_t> lengths;
      for (const std::string_view a : args) {
        argv.push_back(a.data());
        lengths.push_back(a.size());
      }
      void* reply = redisCommandArgv(redis_, static_cast<int>(argv.size()), argv.data(), lengths.data());
      if (reply == nullptr) throw std::runtime_error(std::string("redis store: ") + redis_->errstr);
      std::unique_ptr<redisReply, void (*)(void*)> owned(static_cast<redisReply*>(reply), freeReplyObject);
      if (owned->type == REDIS_REPLY_ERROR)
        throw std::runtime_error("redis store: " + std::string(args[0]) + ": " + std::string(owned->str, owned->len));
      return owned;
    }
  };

  bool exists(const std::string& key) override { return redis_.check({key}); }

  // One MGET: a value or nil for each.
  std::vector<bool> exist_each(const std::vector<std::string>& keys) override {
    if (keys.empty()) return {};
    std::vector<std::string_view> args{"MGET"};
    args.insert(args.end(), keys.begin(), keys.end());
    const auto reply = redis_.command(args);
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != keys.size())
      throw std::runtime_error("redis store: MGET answered " + std::to_string(reply->elements) + " values for " +
                               std::to_string(keys.size()) + " keys");
    std::vector<bool> found;
    found.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) found.push_back(reply->element[i]->type != REDIS_REPLY_NIL);
    return found;
  }

  void put(const std::string& key, const std::vector<char>& value, bool once) override {
    const std::string_view v(value.data(), value.size());
    // SETNX answers 0 for an existing key; SET answers OK.
    const auto reply = redis_.command({once ? "SETNX" : "SET", key, v});
    if (once && (reply->type != REDIS_REPLY_INTEGER || reply->integer != 1))
      throw std::runtime_error("redis store: key '" + key + "' is already set");
  }

  std::vector<char> read(const std::string& key) override {
    const auto reply = redis_.command({"GET", key});
    if (reply->type != REDIS_REPLY_STRING) return {};  // nil: absent
    return std::vector<char>(reply->str, reply->str + reply->len);
  }

  void remove(const std::vector<std::string>& keys) override {
    if (keys.empty()) return;
    std::vector<std::string_view> args{"DEL"};
    args.insert(args.end(), keys.begin(), keys.end());
    redis_.command(args);
  }

  // The floor's values: a sorted set, each value its own score (exact:
  // values are at most 2^48).
  void add_floor(uint64_t value) override {
    const std::string v = std::to_string(value);
    redis_.command({"ZADD", floors_, v, v});
  }
  uint64_t highest_floor(uint64_t limit) override {
    const auto reply = redis_.command({"ZREVRANGEBYSCORE", floors_, std::to_string(limit), "-inf", "LIMIT", "0", "1"});
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements == 0 || reply->element[0]->type != REDIS_REPLY_STRING)
      return 0;
    const redisReply& member = *reply->element[0];
    uint64_t value = 0;
    const auto [last, err] = std::from_chars(member.str, member.str + member.len, value);
    return err == std::errc() && last == member.str + member.len && value <= limit ? value : 0;
  }
  void prune_floors_below(uint64_t value) override {
    redis_.command({"ZREMRANGEBYSCORE", floors_, "-inf", "(" + std::to_string(value)});
  }

  Connection redis_;
  const std::string floors_ = prefix() + "floors";
};

Result<std::unique_ptr<JobStore>> JobStore::open(const std::string& spec) {
  auto parsed = parse_fed_store(spec);
  if (!parsed.ok()) return parsed.status();
  const FedStoreSpec& where = *parsed;
  if (where.redis) return std::unique_ptr<JobStore>(new RedisJobStore(where.host, where.port, where.job));
  std::error_code ec;
  std::filesystem::create_directories(where.dir, ec);
  // Absolute, as Gloo's store made it: the server's working directory
  // plays no part after the start.
  std::filesystem::path dir = ec ? std::filesystem::path() : std::filesystem::canonical(where.dir, ec);
  if (ec) return Status{ErrorCode::kIo, "--fed-store " + spec + ": " + ec.message()};
  return std::unique_ptr<JobStore>(new FileJobStore(std::move(dir)));
}

// Gloo's rendezvous over the job's store, under one attempt's prefix,
// with one deadline for the whole rendezvous (Gloo's get() would wait 30
// s for a host that never comes, and each of its waits would start its
// own timeout). store_failed() tells a rendezvous that failed in the store
// (a store call threw, a host's address did not arrive in time, a stop)
// from one whose connections failed.
class RendezvousStore final : public gloo::rendezvous::Store {
 public:
  RendezvousStore(JobStore& job, std::string prefix, Clock::time_point deadline, std::function<bool()> cancelled)
      : job_(job), prefix_(std::move(prefix)), deadline_(deadline), cancelled_(std::move(cancelled)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    noting_failure([&] { job_.set(prefix_ + key, data.data(), data.size()); });
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    std::vector<char> value;
    noting_failure([&] { value = job_.get(prefix_ + key); });
    // Erased since it arrived (the group's rank 0 swept the attempt):
    // Gloo reads a value without checking its size.
    if (value.empty()) {
      store_failed_ = true;
      throw gloo::IoException("rendezvous: a host's address is gone from the store (its attempt was swept)");
    }
    return value;
  }
  void wait(const std::vector<std::string>& keys) override {
    std::vector<std::string> full;
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    bool arrived = false;
    noting_failure([&] { arrived = job_.await(full, deadline_, cancelled_); });
    if (!arrived) {
      store_failed_ = true;
      throw gloo::IoException("rendezvous: a host did not arrive in time");
    }
  }
  void wait(const std::vector<std::string>& keys, const milliseconds& /*timeout*/) override { wait(keys); }

  bool store_failed() const noexcept { return store_failed_; }

 private:
  template <class Op>
  void noting_failure(Op op) {
    try {
      op();
    } catch (...) {
      store_failed_ = true;
      throw;
    }
  }

  JobStore& job_;
  const std::string prefix_;
  const Clock::time_point deadline_;
  const std::function<bool()> cancelled_;
  bool store_failed_ = false;
};

// A host's want. Read back from the store, which any process may have
// written to: checked before use (read_want()).
struct Want {
  uint32_t magic;         // kWantMagic
  uint32_t hosts;         // the writer's --fed-hosts
  uint64_t last_epoch;    // the last epoch the writer was a member of (0: none)
  uint64_t last_members;  // that epoch's members (0: none)
  uint64_t writer;        // a random number of the writing server: two servers given one --fed-host differ in it
};
static_assert(sizeof(Want) == 32 && std::is_trivially_copyable_v<Want>);

// The store's record of its sweep (sweep_decided_attempts()), checked as
// a Want is: the attempts up to `swept` were erased, all but the `formed`
// record of attempt `kept` (0: none).
struct Swept {
  uint32_t magic;  // kSweptMagic
  uint32_t hosts;  // the writer's --fed-hosts
  uint64_t swept;
  uint64_t kept;
};
static_assert(sizeof(Swept) == 24 && std::is_trivially_copyable_v<Swept>);

// "4 s", "1.5 s".
std::string seconds_text(milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", static_cast<double>(ms.count()) / 1000);
  return text;
}

std::string hosts_text(uint64_t mask) {
  std::string text = "{";
  for (uint32_t h = 0; h < 64; ++h)
    if ((mask >> h) & 1) text += (text.size() > 1 ? "," : "") + std::to_string(h);
  return text + "}";
}

class GlooEngine final : public FederationEngine {
 public:
  static Result<std::unique_ptr<FederationEngine>> create(const FederationConfig& config) {
    if (config.hosts == 0 || config.hosts > kMaxFederationHosts || config.host >= config.hosts)
      return Status{ErrorCode::kInvalidArgument, "--federation gloo needs --fed-hosts N (1.." +
                                                     std::to_string(kMaxFederationHosts) +
                                                     ") and --fed-host I below it"};
    if (config.store.empty())
      return Status{ErrorCode::kInvalidArgument,
                    "--federation gloo needs --fed-store file:DIR or redis:HOST[:PORT][/JOB] (where the hosts meet)"};
    // A write to a peer's socket after it died must fail, not end this
    // process (the default for SIGPIPE).
    std::signal(SIGPIPE, SIG_IGN);
    auto engine = std::unique_ptr<GlooEngine>(new GlooEngine(config));
    try {
      auto store = JobStore::open(config.store);
      if (!store.ok()) return store.status();
      engine->store_ = std::move(store).value();
      gloo::transport::tcp::attr attr;
      attr.hostname = config.address;
      attr.ai_family = AF_UNSPEC;
      // The device starts its I/O thread, which wakes at every message of
      // a collective: created from a thread placed, scheduled and named as
      // it should be (lower_io_thread_priority), with the server's signals
      // blocked, it inherits all four (the federation thread sets its own).
      std::exception_ptr failed;
      start_helper_thread([&] {
        // A failure (seccomp, RLIMIT_NICE, no listed CPU usable) leaves
        // the I/O thread scheduled as the federation thread is, or
        // unlowered, or where the server runs: collectives may stall for
        // a tick, nothing is wrong. The plugin has no log; the federation
        // thread logs a failure of its own.
        (void)pin_this_thread(config.cpus);
        (void)lower_io_thread_priority(config.priority);
        name_this_thread("shmps-fed-io");
        try {
          engine->device_ = gloo::transport::tcp::CreateDevice(attr);
        } catch (...) {
          failed = std::current_exception();
        }
      }).join();
      if (failed) std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      return Status{ErrorCode::kIo, gloo_error("cannot start", e)};
    }
    return std::unique_ptr<FederationEngine>(std::move(engine));
  }

  const char* name() const noexcept override { return "gloo"; }
  Membership membership() const noexcept override { return membership_; }
  bool elastic() const noexcept override { return true; }

  Status allreduce_sum(std::span<float> data) override {
    return collective("allreduce", [&] {
      gloo::AllreduceOptions o(context_);
      o.setOutput(data.data(), data.size());
      o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      o.setTimeout(timeout_);
      gloo::allreduce(o);
    });
  }

  Status allgather(std::span<const std::byte> mine, std::span<std::byte> all) override {
    if (all.size() != mine.size() * membership_.size)
      return {ErrorCode::kInternal, "federation (gloo): allgather of a size it cannot take"};
    // The first collective of a round waits for the others' timers too.
    return collective("allgather", [&] {
      gloo::AllgatherOptions o(context_);
      // Gloo's input is not const; it only reads it.
      o.setInput(const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(mine.data())), mine.size());
      o.setOutput(reinterpret_cast<uint8_t*>(all.data()), all.size());
      o.setTimeout(timeout_ + group_period_);
      gloo::allgather(o);
    });
  }

  Status broadcast(std::span<std::byte> data, uint32_t root) override {
    return collective("broadcast", [&] {
      gloo::BroadcastOptions o(context_);
      // In place at every rank, the root's too: an input over the same
      // bytes would make Gloo copy them onto themselves while its I/O
      // thread sends them (a race tsan reports).
      auto* p = reinterpret_cast<uint8_t*>(data.data());
      o.setOutput(p, data.size());
      o.setRoot(static_cast<int>(root));
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  Reform reform(std::string* why, const std::function<bool()>& cancelled) override {
    context_.reset();  // the old group's connections close: its members see it at once
    membership_.size = 0;
    // The backoff of a newcomer that could not connect to the group
    // (back_off()): no want before it ends. Only this thread waits; the
    // consumer serves meanwhile, and a stop ends the wait.
    while (Clock::now() < next_want_) {
      if (cancelled()) {
        *why = "federation (gloo): stopping";
        return Reform::kFailed;
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(kBackoffPoll, next_want_ - Clock::now()));
    }
    try {
      if (!store_) {
        auto store = JobStore::open(config_.store);
        if (!store.ok()) {
          *why = store.status().message();
          return Reform::kFailed;
        }
        store_ = std::move(store).value();
      }
      last_result_ = attempt(why, cancelled);
    } catch (const std::exception& e) {
      // The store failed (a Redis connection lost): a new one next time.
      store_.reset();
      *why = gloo_error("forming a group", e);
      last_result_ = Reform::kFailed;
    }
    return last_result_;
  }

  bool joiner_waiting() override {
    if (!context_) return false;
    try {
      if (!store_) {
        // A store that failed (a Redis restart): reopened, at most every
        // few seconds, so that a running group goes on seeing joiners.
        if (Clock::now() < store_retry_) return false;
        store_retry_ = Clock::now() + kStoreRetry;
        auto store = JobStore::open(config_.store);
        if (!store.ok()) return false;
        store_ = std::move(store).value();
      }
      if (membership_.rank == 0) {
        restore_wiped_records(/*as_formed=*/false);
        try {
          sweep_decided_attempts();
        } catch (const std::exception&) {
          // Tried again next round; newcomers are still looked for.
        }
      }
      // Only a want of this job counts: another's, or garbage, would make
      // the group re-form every round for nothing.
      const uint64_t attempt = membership_.epoch + 1;
      const uint64_t present = wants_at(attempt);
      std::string why;
      Want w{};
      for (uint32_t h = 0; h < config_.hosts; ++h)
        if (((present >> h) & 1) != 0 && read_want(attempt, h, &w, &why)) return true;
      return false;
    } catch (const std::exception&) {
      store_.reset();
      return false;
    }
  }

  void set_group_period_ms(uint32_t ms) override { group_period_ = milliseconds(ms); }

 private:
  explicit GlooEngine(const FederationConfig& config)
      : config_(config),
        timeout_(config.timeout_ms),
        all_hosts_(config.hosts == 64 ? ~0ull : (1ull << config.hosts) - 1),
        group_period_(config.every_ms) {
    membership_.host = config.host;
    membership_.size = 0;
  }

  static std::string key(uint64_t attempt, const char* kind, uint32_t host) {
    return "a" + std::to_string(attempt) + "/" + kind + "/" + std::to_string(host);
  }

  // The hosts whose `kind` key exists at `attempt`.
  uint64_t keys_at(uint64_t attempt, const char* kind) {
    std::vector<std::string> keys;
    keys.reserve(config_.hosts);
    for (uint32_t h = 0; h < config_.hosts; ++h) keys.push_back(key(attempt, kind, h));
    const std::vector<bool> found = store_->has_each(keys);
    uint64_t mask = 0;
    for (uint32_t h = 0; h < config_.hosts; ++h)
      if (found[h]) mask |= 1ull << h;
    return mask;
  }
  uint64_t wants_at(uint64_t attempt) { return keys_at(attempt, "want"); }

  static std::string formed_key(uint64_t attempt) { return "a" + std::to_string(attempt) + "/formed"; }

  // The store's floor (0: none): the attempts up to it were decided.
  uint64_t floor_in_store() { return store_->highest_floor(kMaxFloor); }

  // The group's rank 0: when the store lost this group's `formed` record
  // (a wipe under the running group; checked once a round), or, with
  // `as_formed`, the wants of the first attempt the group's epoch is past
  // (a wipe before it formed), adds the floor at this epoch, then writes
  // the record again. Not where the floor is at or past this group's
  // epoch: a later group formed without this host, whose rank 0 swept
  // this group's record (it moves the floor first, so the floor is read
  // after the records). Throws the store's exceptions.
  void restore_wiped_records(bool as_formed) {
    const uint64_t epoch = membership_.epoch;
    const bool formed_lost = !store_->has(formed_key(epoch));
    const bool first_lost = as_formed && epoch > 1 && wants_at(1) == 0;
    if (!formed_lost && !first_lost) return;
    const uint64_t floor = floor_in_store();
    if (floor >= epoch || (!formed_lost && floor != 0)) return;
    store_->add_floor(epoch);
    if (floor == 0) {
      // A wipe: nothing below the group's epoch is left to sweep.
      swept_ = std::max(swept_, epoch - 1);
      kept_formed_ = 0;
      write_swept();
    }
    if (formed_lost) store_->set(formed_key(epoch), &last_members_, sizeof last_members_);
  }

  // The group's rank 0, once a round: the attempts before its group's
  // epoch were decided. Of their keys, only the newest `formed` record is
  // read again (newest_group(), from later attempts); a newcomer counts
  // its attempts from the floor. So the floor moves up to them, then their
  // keys are erased, a few attempts a round, oldest first, keeping that
  // one record: the store holds what later attempts read, however many
  // attempts a long job makes (a paused host makes one every
  // --fed-timeout-ms and a bit). A host still at a swept attempt (stopped,
  // or slow) finds it below the floor and starts over past it.
  // Throws the store's exceptions.
  void sweep_decided_attempts() {
    const uint64_t decided = membership_.epoch - 1;
    if (!swept_loaded_) {
      // What the rank 0 of a group before this one swept; this host's own
      // progress where the record is gone or garbage.
      Swept rec{};
      if (const std::vector<char> bytes = store_->get(kSweptKey); bytes.size() == sizeof rec)
        std::memcpy(&rec, bytes.data(), sizeof rec);
      if (rec.magic == kSweptMagic && rec.hosts == config_.hosts && rec.swept <= kMaxFloor && rec.kept <= rec.swept &&
          rec.swept > swept_) {
        swept_ = rec.swept;
        kept_formed_ = rec.kept;
      }
      swept_loaded_ = true;
    }
    if (swept_ >= decided) return;
    if (floor_in_store() < decided) {
      store_->add_floor(decided);
      store_->prune_floors_below(decided);
    }
    std::vector<std::string> keys;
    for (size_t erased = 0; swept_ < decided && erased < kSweepKeysPerRound; erased += keys.size()) {
      const uint64_t a = swept_ + 1;
      keys.clear();
      const std::string gloo = "a" + std::to_string(a) + "/gloo/";
      for (uint32_t h = 0; h < config_.hosts; ++h) {
        keys.push_back(key(a, "want", h));
        keys.push_back(key(a, "view", h));
        // Gloo's rendezvous keys of rank h (gloo/rendezvous/context.cc).
        keys.push_back(gloo + std::to_string(h));
        keys.push_back(gloo + "rank_" + std::to_string(h));
      }
      if (store_->has(formed_key(a))) {
        if (kept_formed_ != 0) keys.push_back(formed_key(kept_formed_));
        kept_formed_ = a;
      }
      store_->erase(keys);
      swept_ = a;
    }
    write_swept();
  }
  void write_swept() {
    const Swept rec{kSweptMagic, config_.hosts, swept_, kept_formed_};
    store_->replace(kSweptKey, &rec, sizeof rec);
  }

  // The highest attempt any host started since `floor` (`floor` when
  // none). Attempts are started in order, each with a want, so the
  // started ones are floor+1..highest: gallop, then bisect.
  uint64_t highest_attempt(uint64_t floor) {
    uint64_t lo = std::max(attempt_, floor), hi = lo + 1;
    while (wants_at(hi) != 0) {
      lo = hi;
      hi *= 2;
    }
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      (wants_at(mid) != 0 ? lo : hi) = mid;
    }
    return lo;
  }

  template <class Op>
  Status collective(const char* what, Op op) {
    if (!context_) return {ErrorCode::kIo, std::string("federation (gloo): ") + what + " outside a group"};
    try {
      op();
      return Status::Ok();
    } catch (const std::exception& e) {
      // The context is dead after any failure (Gloo's documentation).
      context_.reset();
      return {ErrorCode::kIo, gloo_error(what, e)};
    }
  }

  // The want of `host` at `attempt`, if it makes sense: the magic, this
  // job's host count, an earlier epoch that had the writer among hosts of
  // this job. One that does not is another job's or garbage: `why` says
  // which, and its writer is left out.
  bool read_want(uint64_t attempt, uint32_t host, Want* want, std::string* why) {
    const std::vector<char> bytes = store_->get(key(attempt, "want", host));
    std::memset(want, 0, sizeof *want);
    if (bytes.size() == sizeof *want) std::memcpy(want, bytes.data(), sizeof *want);
    const uint64_t bit = 1ull << host;
    if (want->magic == kWantMagic && want->hosts == config_.hosts && want->last_epoch < attempt &&
        (want->last_members & ~all_hosts_) == 0 &&
        (want->last_epoch == 0 ? want->last_members == 0 : (want->last_members & bit) != 0))
      return true;
    *why = "federation (gloo): attempt " + std::to_string(attempt) + ": host " + std::to_string(host) +
           "'s want in the store is not one of this job's" +
           (want->magic == kWantMagic && want->hosts != config_.hosts
                ? " (it has --fed-hosts " + std::to_string(want->hosts) + ", this host " +
                      std::to_string(config_.hosts) + ": give every host the same)"
                : " (another job's store, or garbage: use a fresh --fed-store per job)");
    return false;
  }

  // The members of the newest group formed before `attempt`, from the
  // store's records (rank 0 of each writes one); the hosts' own newest
  // epoch, and kFormedSearch, bound the search. 0 when none found.
  uint64_t newest_group(uint64_t attempt, uint64_t known_epoch) {
    const uint64_t oldest = std::max({uint64_t{1}, known_epoch, attempt > kFormedSearch ? attempt - kFormedSearch : 0});
    for (uint64_t k = attempt - 1; k >= oldest; --k) {
      if (!store_->has(formed_key(k))) continue;
      const std::vector<char> bytes = store_->get(formed_key(k));
      uint64_t members = 0;
      if (bytes.size() == sizeof members) std::memcpy(&members, bytes.data(), sizeof members);
      if (members != 0 && (members & ~all_hosts_) == 0) return members;
    }
    return 0;
  }

  // A newcomer's rendezvous with the hosts `others` at `attempt` failed
  // in its connections (`e`, Gloo's): its next want waits (reform()),
  // twice as long as the last after each such failure in a row, plus up
  // to half of that at random: two newcomers that failed together (one
  // unreachable, the other's pair to it failing too) do not meet again at
  // every try. It is in no group of theirs, so they keep their majority
  // without it.
  Reform back_off(uint64_t attempt, uint64_t others, const std::exception& e, std::string* why) {
    const milliseconds base = timeout_ * (int64_t{1} << std::min(join_failures_, kMaxBackoffDoublings));
    const milliseconds wait = base + milliseconds(std::uniform_int_distribution<int64_t>(0, base.count() / 2)(jitter_));
    ++join_failures_;
    next_want_ = Clock::now() + wait;
    *why = "federation (gloo): host " + std::to_string(config_.host) + " could not connect to the group's hosts " +
           hosts_text(others) + " at attempt " + std::to_string(attempt) + " (" + e.what() + "; " +
           std::to_string(join_failures_) + (join_failures_ == 1 ? " try" : " tries in a row") +
           "; a firewall, a network partition, or a --fed-address the others cannot reach?); trying again in " +
           seconds_text(wait);
    return Reform::kBackedOff;
  }

  static std::string below_floor(uint64_t attempt) {
    return "federation (gloo): attempt " + std::to_string(attempt) +
           " is at or below the store's floor (a group formed past it, or the store was wiped under a running group)";
  }

  Reform attempt(std::string* why, const std::function<bool()>& cancelled) {
    // The attempt after this host's last and after any started (a group
    // that formed since, or others' attempts), but never one already
    // decided without this host: then it joins a running group, whose
    // members look for it once a round. Past the floor, which was decided.
    const uint64_t floor = floor_in_store();
    uint64_t k = std::max({attempt_ + 1, highest_attempt(floor), floor + 1});
    const bool joining = keys_at(k, "view") != 0;
    if (joining) ++k;
    const uint64_t me = 1ull << config_.host;
    const Want mine{kWantMagic, config_.hosts, last_epoch_, last_members_, writer_};
    // Already there when an earlier write went through but its answer was
    // lost (a Redis timeout): keys are written once.
    if (!store_->has(key(k, "want", config_.host))) store_->set(key(k, "want", config_.host), &mine, sizeof mine);
    // Another server's: a second one given this host id, or one killed
    // after writing its want (a predecessor of this server, restarted at
    // once, finds it at the highest attempt when no other host went on
    // since). The first foreign want moves this server to the next
    // attempt, where a live second server meets this one's want in turn;
    // a foreign want found after that ends this server's federation, so
    // of two live servers one gives up and the other goes on (left to
    // both, they would take turns in the group, re-forming it on every
    // try). A dead server's wants are all at attempts below this one's.
    Want there{};
    if (const std::vector<char> bytes = store_->get(key(k, "want", config_.host)); bytes.size() == sizeof there)
      std::memcpy(&there, bytes.data(), sizeof there);
    if (there.magic == kWantMagic && there.writer != writer_) {
      if (!passed_foreign_want_) {
        passed_foreign_want_ = true;
        attempt_ = k;  // a started attempt (the foreign want's)
        *why = "federation (gloo): attempt " + std::to_string(k) + " has another server's want as host " +
               std::to_string(config_.host) + " (one killed as it re-formed, or a second server given this id)";
        return Reform::kFailed;
      }
      *why = "federation (gloo): another server wants in as host " + std::to_string(config_.host) +
             " (its want at attempt " + std::to_string(k) +
             " is not this server's): two servers were given --fed-host " + std::to_string(config_.host) +
             "; give each host its own id";
      return Reform::kRefused;
    }
    attempt_ = k;  // only now: the attempts in the store stay without gaps

    // Settle: until every member of the last epoch (at the first, every
    // host) wants in too, another host has decided, or the settle time:
    // the engine's timeout for a first group (hosts start at their own
    // pace), after a pause (the others retry at their own times) and after
    // a rendezvous that failed (the others' may go on for up to a timeout:
    // a refused connection fails at once, a pair that waits for its peer
    // at the timeout); a round period more when joining a running group
    // (its members look once a round); else a short time, since the
    // members of a group that broke see it within milliseconds of each
    // other (a closed connection, or the same timeout). A member that
    // comes later joins the group after.
    const uint64_t expected = (last_members_ != 0 ? last_members_ : all_hosts_) | me;
    milliseconds settle = std::min(timeout_ / 10, kSettle);
    if (last_epoch_ == 0 || last_result_ == Reform::kPaused || after_failed_rendezvous_) settle = timeout_;
    if (joining) settle = timeout_ + group_period_;
    after_failed_rendezvous_ = false;
    const auto settle_end = Clock::now() + settle;
    PollBackoff backoff;
    uint64_t seen = wants_at(k);
    while ((seen & expected) != expected && Clock::now() < settle_end && !cancelled()) {
      if (keys_at(k, "view") != 0) {
        seen = wants_at(k);  // another host decided: as complete as it gets
        break;
      }
      // A group's rank 0 found the store wiped and wrote a floor at or past
      // this attempt: the group looks for this host after the floor.
      if (floor_in_store() >= k) {
        *why = below_floor(k);
        return Reform::kFailed;
      }
      backoff.sleep();
      seen = wants_at(k);
    }
    if (cancelled()) {
      *why = "federation (gloo): stopping";
      return Reform::kFailed;
    }
    store_->set(key(k, "view", config_.host), &seen, sizeof seen);

    // Agreement: every host seen saw the same hosts.
    const auto deadline = Clock::now() + timeout_;
    PollBackoff agreement;
    for (uint64_t views = keys_at(k, "view"); (views & seen) != seen; views = keys_at(k, "view")) {
      if (Clock::now() >= deadline || cancelled()) {
        *why = "federation (gloo): attempt " + std::to_string(k) + ": host " +
               std::to_string(std::countr_zero(seen & ~views)) + " wanted in but did not confirm within " +
               std::to_string(timeout_.count()) + " ms";
        return Reform::kFailed;
      }
      agreement.sleep();
    }
    for (uint32_t h = 0; h < config_.hosts; ++h) {
      if (((seen >> h) & 1) == 0) continue;
      const std::vector<char> view = store_->get(key(k, "view", h));
      uint64_t theirs = 0;
      if (view.size() == sizeof theirs) std::memcpy(&theirs, view.data(), sizeof theirs);
      if (theirs != seen) {
        *why = "federation (gloo): attempt " + std::to_string(k) + ": host " + std::to_string(h) + " saw hosts " +
               hosts_text(theirs) + ", this host " + hosts_text(seen);
        return Reform::kFailed;
      }
    }

    // The majority, of the newest group formed before (all hosts before
    // the first). Every host of `seen` reads the same records.
    // A host whose want is not of this job (another --fed-hosts, garbage)
    // is left out: every host of `seen` reads the same wants and leaves
    // out the same ones.
    uint64_t known_epoch = 0, known_members = 0;
    std::string invalid;
    for (uint32_t h = 0; h < config_.hosts; ++h) {
      if (((seen >> h) & 1) == 0) continue;
      Want w{};
      if (!read_want(k, h, &w, &invalid)) {
        seen &= ~(1ull << h);
        continue;
      }
      if (w.last_epoch > known_epoch) {
        known_epoch = w.last_epoch;
        known_members = w.last_members;
      }
    }
    if ((seen & me) == 0) {
      *why = !invalid.empty() ? invalid
                              : "federation (gloo): attempt " + std::to_string(k) +
                                    ": this host's want is gone from the store (the store was wiped)";
      return Reform::kFailed;
    }
    // The newest group formed: from the store's records; else (its rank 0
    // died before writing one) the one the wanting hosts remember; all
    // hosts of the job when none ever formed.
    uint64_t last_group = newest_group(k, known_epoch);
    if (last_group == 0) last_group = known_epoch != 0 ? known_members : all_hosts_;
    const int kept = std::popcount(seen & last_group), of = std::popcount(last_group);
    if (2 * kept <= of) {
      *why = "federation (gloo): hosts " + hosts_text(seen) + " are " + std::to_string(kept) + " of " +
             (known_epoch != 0 || last_group != all_hosts_
                  ? "the " + std::to_string(of) + " hosts " + hosts_text(last_group) +
                        " of the last group, no majority: federation pauses until more of them are back"
                  : "the job's " + std::to_string(of) + " (--fed-hosts), no majority to form its first " +
                        "group: start the others, or give every host the job's true --fed-hosts") +
             "; serving the local workers alone meanwhile" + (invalid.empty() ? "" : "; left out: " + invalid);
      return Reform::kPaused;
    }

    // A group formed past this attempt meanwhile, and its rank 0 may be
    // erasing the records read above: the floor moves first.
    if (floor_in_store() >= k) {
      *why = below_floor(k);
      return Reform::kFailed;
    }

    // Gloo's rendezvous: ranks in host order. One that fails in its
    // connections at a newcomer (not a member of the newest group, of
    // which the others hold a majority without it) points at the
    // newcomer: it backs off (back_off()), and the others form again
    // without it. At a member it fails as any other attempt (a member
    // cut off is not told apart: docs/federation.md, "Gloo").
    const int rank = std::popcount(seen & (me - 1)), size = std::popcount(seen);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(std::max(milliseconds(1), timeout_ / kGlooConnectWaitFactor));
    RendezvousStore rendezvous(*store_, "a" + std::to_string(k) + "/gloo/", Clock::now() + timeout_, cancelled);
    try {
      context->connectFullMesh(rendezvous, device_);
    } catch (const std::exception& e) {
      after_failed_rendezvous_ = true;
      if ((last_group & me) != 0 || rendezvous.store_failed() || cancelled()) throw;
      return back_off(k, seen & ~me, e, why);
    }
    // The default of a collective that sets none (each of this engine's
    // sets its own).
    context->setTimeout(timeout_);
    join_failures_ = 0;
    if (rank == 0) store_->set(formed_key(k), &seen, sizeof seen);
    swept_loaded_ = false;
    context_ = std::move(context);
    membership_ = {k, static_cast<uint32_t>(rank), static_cast<uint32_t>(size), config_.host};
    last_epoch_ = k;
    last_members_ = seen;
    if (rank == 0) {
      try {
        restore_wiped_records(/*as_formed=*/true);
      } catch (const std::exception&) {
        // The group stands: without a floor, only a newcomer's first
        // attempts are slower.
      }
    }
    return Reform::kFormed;
  }

  const FederationConfig config_;
  const milliseconds timeout_;
  const uint64_t all_hosts_;
  milliseconds group_period_;  // the group's longest round period (set_group_period_ms())
  Reform last_result_ = Reform::kFormed;
  Clock::time_point store_retry_{};  // joiner_waiting(): the next try at a store that failed
  std::unique_ptr<JobStore> store_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;  // the current group; none between groups
  Membership membership_;
  const uint64_t writer_ = std::random_device{}() | uint64_t{std::random_device{}()} << 32;  // Want::writer
  uint64_t attempt_ = 0;                                                                     // this host's last attempt
  bool passed_foreign_want_ = false;  // attempt(): the next foreign want at this host's id ends its federation
  uint32_t join_failures_ = 0;        // back_off(): this host's failed rendezvous in a row as a newcomer
  std::minstd_rand jitter_{static_cast<std::minstd_rand::result_type>(writer_)};  // back_off()'s random part
  Clock::time_point next_want_{};  // reform(): the backoff's end (back_off())
  uint64_t last_epoch_ = 0;        // the last group this host was in
  uint64_t last_members_ = 0;      // its hosts
  // sweep_decided_attempts(): the attempts up to swept_ were erased, but
  // for the `formed` record of kept_formed_; the store's record is read
  // again once a group forms (another host may have swept since).
  uint64_t swept_ = 0;
  uint64_t kept_formed_ = 0;
  bool swept_loaded_ = false;
  // attempt(): the last one's rendezvous failed (the next one settles longer).
  bool after_failed_rendezvous_ = false;
};

}  // namespace

}  // namespace shmps::server

extern "C" __attribute__((visibility("default"))) void shmps_fed_gloo_make(
    const shmps::server::FederationConfig& config, std::unique_ptr<shmps::server::FederationEngine>* engine,
    shmps::Status* status) {
  auto made = shmps::server::GlooEngine::create(config);
  if (!made.ok()) {
    *status = made.status();
    return;
  }
  *engine = std::move(made).value();
}
static_assert(std::is_same_v<decltype(shmps_fed_gloo_make), FederationEngineMaker>);
