// The Gloo engine of the federation: elastic membership over Gloo's TCP
// transport, agreed through a store every host sees (Gloo's FileStore or
// RedisStore). Gloo decides no membership of its own: reform() runs the
// agreement below, then Gloo's rendezvous for the agreed (rank, size).
//
// One attempt k (docs/federation.md, "Gloo"), with keys written once, each
// by one host, under the job's prefix:
//   a<k>/want/<host>  {the last epoch it was in, that epoch's members}
//   a<k>/view/<host>  the hosts whose wants it saw (a bit mask)
//   a<k>/gloo/...     Gloo's rendezvous of the group formed at k
// A host writes its want, waits until the last epoch's members all want
// too (or a settle time passes), writes what it saw as its view, and reads
// the views of the hosts it saw: all equal, the group is those hosts (an
// epoch numbered k); any different or missing, the attempt fails and the
// next starts. The group forms only with a majority of the last epoch's
// members (at the first, of all --fed-hosts): a minority pauses instead.
// A host that wants in later writes its want at the attempt after the
// group's epoch, which the members look for once per round
// (joiner_waiting()).
//
// Used by the federation thread alone (Gloo's stores are not thread-safe).
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/socket.h>

#include <bit>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <type_traits>

#include "federation_plugin.hpp"
#include "shmps/server/federation.hpp"

namespace shmps::server {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often the agreement and the rendezvous look at the store.
constexpr milliseconds kPoll{5};
// The longest a re-forming host waits for the other members of its last
// group to want in too.
constexpr milliseconds kSettle{200};

std::string gloo_error(const char* what, const std::exception& e) {
  return std::string("federation (gloo): ") + what + ": " + e.what();
}

// The job's store with a key prefix, and a check that does not wait;
// Gloo's own waits poll once a second and its get() waits 30 s whatever
// the timeout, too slow and too long for noticing a host gone.
class JobStore {
 public:
  // "file:DIR" or "redis:HOST:PORT[/JOB]". Throws gloo's exceptions.
  static Result<std::unique_ptr<JobStore>> open(const std::string& spec) {
    auto store = std::unique_ptr<JobStore>(new JobStore());
    if (spec.rfind("file:", 0) == 0 && spec.size() > 5) {
      const std::string dir = spec.substr(5);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) return Status{ErrorCode::kIo, "--fed-store " + spec + ": " + ec.message()};
      auto file = std::make_unique<CheckableFileStore>(dir);
      store->check_ = [f = file.get()](const std::string& key) { return f->check({key}); };
      store->base_ = std::move(file);
      return store;
    }
    if (spec.rfind("redis:", 0) == 0) {
      std::string rest = spec.substr(6);
      std::string job = "shmps";
      if (const size_t slash = rest.find('/'); slash != std::string::npos) {
        job = rest.substr(slash + 1);
        rest.resize(slash);
      }
      const size_t colon = rest.rfind(':');
      int port = 0;
      try {
        port = colon == std::string::npos ? 6379 : std::stoi(rest.substr(colon + 1));
      } catch (const std::exception&) {
        port = 0;
      }
      if (port <= 0 || port > 65535 || job.empty())
        return Status{ErrorCode::kInvalidArgument, "--fed-store " + spec + ": not redis:HOST:PORT[/JOB]"};
      auto redis = std::make_unique<gloo::rendezvous::RedisStore>(rest.substr(0, colon), port);
      store->check_ = [r = redis.get()](const std::string& key) { return r->check({key}); };
      store->base_ = std::move(redis);
      store->prefix_ = job + "/";
      return store;
    }
    return Status{ErrorCode::kInvalidArgument,
                  "--fed-store must be file:DIR or redis:HOST:PORT[/JOB], got '" + spec + "'"};
  }

  bool has(const std::string& key) { return check_(prefix_ + key); }
  void set(const std::string& key, const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    base_->set(prefix_ + key, std::vector<char>(p, p + n));
  }
  std::vector<char> get(const std::string& key) { return base_->get(prefix_ + key); }
  // Until every key exists; false at the deadline.
  bool await(const std::vector<std::string>& keys, Clock::time_point deadline) {
    for (const std::string& k : keys)
      while (!has(k)) {
        if (Clock::now() >= deadline) return false;
        std::this_thread::sleep_for(kPoll);
      }
    return true;
  }

 private:
  // FileStore's check() is protected.
  class CheckableFileStore : public gloo::rendezvous::FileStore {
   public:
    using FileStore::check;
    using FileStore::FileStore;
  };
  JobStore() = default;
  std::unique_ptr<gloo::rendezvous::Store> base_;
  std::function<bool(const std::string&)> check_;
  std::string prefix_;
};

// Gloo's rendezvous over the job's store, under one attempt's prefix,
// with waits bounded by the engine's timeout (Gloo's get() would wait 30
// s for a host that never comes).
class RendezvousStore final : public gloo::rendezvous::Store {
 public:
  RendezvousStore(JobStore& job, std::string prefix, milliseconds timeout)
      : job_(job), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    job_.set(prefix_ + key, data.data(), data.size());
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    return job_.get(prefix_ + key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    if (!job_.await(full, Clock::now() + std::min(timeout, timeout_)))
      throw gloo::IoException("rendezvous: a host did not arrive within " + std::to_string(timeout_.count()) + " ms");
  }

 private:
  JobStore& job_;
  const std::string prefix_;
  const milliseconds timeout_;
};

// A host's want: the last epoch it was a member of, and that epoch's
// members (0, 0 for a host that never was).
struct Want {
  uint64_t last_epoch;
  uint64_t last_members;
};
static_assert(sizeof(Want) == 16 && std::is_trivially_copyable_v<Want>);

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
                    "--federation gloo needs --fed-store file:DIR or redis:HOST:PORT[/JOB] (where the hosts meet)"};
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
      engine->device_ = gloo::transport::tcp::CreateDevice(attr);
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
      o.setTimeout(timeout_ + milliseconds(config_.every_ms));
      gloo::allgather(o);
    });
  }

  Status broadcast(std::span<std::byte> data, uint32_t root) override {
    return collective("broadcast", [&] {
      gloo::BroadcastOptions o(context_);
      auto* p = reinterpret_cast<uint8_t*>(data.data());
      if (membership_.rank == root) o.setInput(p, data.size());
      o.setOutput(p, data.size());
      o.setRoot(static_cast<int>(root));
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  Reform reform(std::string* why) override {
    context_.reset();  // the old group's connections close: its members see it at once
    membership_.size = 0;
    try {
      return attempt(why);
    } catch (const std::exception& e) {
      *why = gloo_error("forming a group", e);
      return Reform::kFailed;
    }
  }

  bool joiner_waiting() override {
    try {
      return context_ && wants_at(membership_.epoch + 1) != 0;
    } catch (const std::exception&) {
      return false;  // the store is unreachable: nobody can join through it now
    }
  }

 private:
  explicit GlooEngine(const FederationConfig& config)
      : config_(config),
        timeout_(config.timeout_ms),
        all_hosts_(config.hosts == 64 ? ~0ull : (1ull << config.hosts) - 1) {
    membership_.host = config.host;
    membership_.size = 0;
  }

  static std::string key(uint64_t attempt, const char* kind, uint32_t host) {
    return "a" + std::to_string(attempt) + "/" + kind + "/" + std::to_string(host);
  }

  // The hosts whose `kind` key exists at `attempt`.
  uint64_t keys_at(uint64_t attempt, const char* kind) {
    uint64_t mask = 0;
    for (uint32_t h = 0; h < config_.hosts; ++h)
      if (store_->has(key(attempt, kind, h))) mask |= 1ull << h;
    return mask;
  }
  uint64_t wants_at(uint64_t attempt) { return keys_at(attempt, "want"); }

  // The highest attempt any host started (0: none). Attempts are started
  // in order, each with a want, so the started ones are 1..highest:
  // gallop, then bisect.
  uint64_t highest_attempt() {
    uint64_t lo = attempt_, hi = attempt_ + 1;
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

  Reform attempt(std::string* why) {
    // The attempt after this host's last and after any started (a group
    // that formed since, or others' attempts), but never one already
    // decided without this host.
    uint64_t k = std::max(attempt_ + 1, highest_attempt());
    if (keys_at(k, "view") != 0) ++k;
    attempt_ = k;
    const uint64_t me = 1ull << config_.host;
    const Want mine{last_epoch_, last_members_};
    store_->set(key(k, "want", config_.host), &mine, sizeof mine);

    // Settle: until every member of the last epoch (at the first, every
    // host) wants in too, another host has decided, or the settle time:
    // the engine's timeout for a first group (hosts start at their own
    // pace), else a short time, since the members of a group that broke
    // see it within milliseconds of each other (a closed connection, or
    // the same timeout). A member that comes later joins the group after
    // (as a host waiting to join).
    const uint64_t expected = (last_members_ != 0 ? last_members_ : all_hosts_) | me;
    const auto settle = Clock::now() + (last_epoch_ == 0 ? timeout_ : std::min(timeout_ / 10, kSettle));
    uint64_t seen = wants_at(k);
    while ((seen & expected) != expected && keys_at(k, "view") == 0 && Clock::now() < settle) {
      std::this_thread::sleep_for(kPoll);
      seen = wants_at(k);
    }
    store_->set(key(k, "view", config_.host), &seen, sizeof seen);

    // Agreement: every host seen saw the same hosts.
    const auto deadline = Clock::now() + timeout_;
    for (uint32_t h = 0; h < config_.hosts; ++h) {
      if (((seen >> h) & 1) == 0) continue;
      if (!store_->await({key(k, "view", h)}, deadline)) {
        *why = "federation (gloo): attempt " + std::to_string(k) + ": host " + std::to_string(h) +
               " wanted in but did not confirm within " + std::to_string(timeout_.count()) + " ms";
        return Reform::kFailed;
      }
      const std::vector<char> view = store_->get(key(k, "view", h));
      uint64_t theirs = 0;
      if (view.size() == sizeof theirs) std::memcpy(&theirs, view.data(), sizeof theirs);
      if (theirs != seen) {
        *why = "federation (gloo): attempt " + std::to_string(k) + ": host " + std::to_string(h) + " saw hosts " +
               hosts_text(theirs) + ", this host " + hosts_text(seen);
        return Reform::kFailed;
      }
    }

    // The majority: of the newest group any of them was in (all hosts
    // before the first). Every host of `seen` reads the same wants.
    Want newest{0, all_hosts_};
    for (uint32_t h = 0; h < config_.hosts; ++h) {
      if (((seen >> h) & 1) == 0) continue;
      const std::vector<char> bytes = store_->get(key(k, "want", h));
      Want w{};
      if (bytes.size() == sizeof w) std::memcpy(&w, bytes.data(), sizeof w);
      if (w.last_epoch > newest.last_epoch && w.last_members != 0) newest = w;
    }
    const int kept = std::popcount(seen & newest.last_members), of = std::popcount(newest.last_members);
    if (2 * kept <= of) {
      *why = "federation (gloo): hosts " + hosts_text(seen) + " are " + std::to_string(kept) + " of the " +
             std::to_string(of) + " hosts of " +
             (newest.last_epoch == 0 ? std::string("the job") : "epoch " + std::to_string(newest.last_epoch)) +
             ", no majority: federation pauses until more hosts are back";
      return Reform::kPaused;
    }

    // Gloo's rendezvous: ranks in host order.
    const int rank = std::popcount(seen & (me - 1)), size = std::popcount(seen);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout_);
    RendezvousStore rendezvous(*store_, "a" + std::to_string(k) + "/gloo/", timeout_);
    context->connectFullMesh(rendezvous, device_);
    context_ = std::move(context);
    membership_ = {k, static_cast<uint32_t>(rank), static_cast<uint32_t>(size), config_.host};
    last_epoch_ = k;
    last_members_ = seen;
    return Reform::kFormed;
  }

  const FederationConfig config_;
  const milliseconds timeout_;
  const uint64_t all_hosts_;
  std::unique_ptr<JobStore> store_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;  // the current group; none between groups
  Membership membership_;
  uint64_t attempt_ = 0;       // this host's last attempt
  uint64_t last_epoch_ = 0;    // the last group this host was in
  uint64_t last_members_ = 0;  // its hosts
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
