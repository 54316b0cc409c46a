// An in-process federation engine for tests: N members (threads, or
// in-process servers) of one FakeGroup meet at each collective; the last to
// arrive computes the result (sums in rank order: the same bits for all)
// and releases the others. A member may be told to add a perturbation to
// its allreduce results (anchors that drift apart), to fail its k-th
// collective (before meeting the others, or after: they complete it, as
// with a host that dies at its very end), or to run a hook before each
// allreduce (a test holding a round in its exchange) or on the bytes of
// each broadcast it roots or allgather it sends (a damaged peer). A
// member's host id is its first rank unless a test sets another.
// Header-only; thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "shmps/server/federation.hpp"

namespace shmps::test {

class FakeGroup {
 public:
  explicit FakeGroup(uint32_t size) : size_(size), epoch_(++formed_), inputs_(size) {}
  // A given epoch: another job's group (a real engine's epochs count
  // again with each store), which may repeat one of this job's.
  FakeGroup(uint32_t size, uint64_t epoch) : size_(size), epoch_(epoch), inputs_(size) {}
  uint32_t size() const { return size_; }
  // An epoch of its own, for members moved into it (FakeEngine::move_to):
  // unique in the process, as a real engine's is in its job.
  uint64_t epoch() const { return epoch_; }

  // One collective step: `in` of every member, combined by `combine` (run
  // once, by the last to arrive, over all inputs in rank order) into the
  // shared result, which every member then copies out.
  template <class Combine>
  std::vector<std::byte> meet(uint32_t rank, std::span<const std::byte> in, Combine combine) {
    std::unique_lock lock(mu_);
    const uint64_t generation = generation_;
    inputs_[rank].assign(in.begin(), in.end());
    if (++arrived_ == size_) {
      result_ = combine(inputs_);
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    return result_;
  }

 private:
  inline static std::atomic<uint64_t> formed_{0};
  const uint32_t size_;
  const uint64_t epoch_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<std::vector<std::byte>> inputs_;
  std::vector<std::byte> result_;
};

class FakeEngine final : public server::FederationEngine {
 public:
  // Host id `rank` (Membership::host), kept through move_to().
  FakeEngine(std::shared_ptr<FakeGroup> group, uint32_t rank) : host(rank), group_(std::move(group)), rank_(rank) {}

  const char* name() const noexcept override { return "fake"; }
  server::Membership membership() const noexcept override { return {epoch_.load(), rank_, group_->size(), host}; }
  bool elastic() const noexcept override { return is_elastic; }
  // The same members again, under the next epoch; the waiting joiner (if
  // any) is then in. While reform_fails is set, each try fails instead,
  // its reason numbered.
  Reform reform(std::string* why, const std::function<bool()>& /*cancelled*/) override {
    if (reform_fails) {
      *why = "federation (fake): try " + std::to_string(++reform_tries) + " formed no group";
      return Reform::kFailed;
    }
    ++epoch_;
    joiner = false;
    return Reform::kFormed;
  }
  bool joiner_waiting() override { return joiner; }
  // Into another group (as `rank`), under that group's epoch: a group
  // that went on without some members, or took them back. Between
  // collectives only.
  void move_to(std::shared_ptr<FakeGroup> group, uint32_t rank) {
    group_ = std::move(group);
    rank_ = rank;
    epoch_ = group_->epoch();
  }

  Status allreduce_sum(std::span<float> data) override {
    if (failing()) return fail();
    if (before_allreduce) before_allreduce();
    const auto out = group_->meet(rank_, std::as_bytes(data), [&](const std::vector<std::vector<std::byte>>& in) {
      std::vector<float> sum(data.size(), 0.0f);
      for (const auto& member : in) {
        const auto* v = reinterpret_cast<const float*>(member.data());
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
      }
      std::vector<std::byte> bytes(sum.size() * sizeof(float));
      std::memcpy(bytes.data(), sum.data(), bytes.size());
      return bytes;
    });
    std::memcpy(data.data(), out.data(), out.size());
    for (float& v : data) v += perturbation;
    return collectives_ == fail_after_at ? fail() : Status::Ok();
  }

  Status allgather(std::span<const std::byte> mine, std::span<std::byte> all) override {
    if (failing()) return fail();
    if (before_allgather) before_allgather();
    if (fail_now.exchange(false)) return fail();
    std::vector<std::byte> sent(mine.begin(), mine.end());
    if (on_allgather) on_allgather(sent);
    const auto out = group_->meet(rank_, sent, [](const std::vector<std::vector<std::byte>>& in) {
      std::vector<std::byte> bytes;
      for (const auto& member : in) bytes.insert(bytes.end(), member.begin(), member.end());
      return bytes;
    });
    std::memcpy(all.data(), out.data(), all.size());
    return Status::Ok();
  }

  Status broadcast(std::span<std::byte> data, uint32_t root) override {
    if (failing()) return fail();
    if (rank_ == root && on_broadcast) on_broadcast(data);
    const auto out =
        group_->meet(rank_, data, [root](const std::vector<std::vector<std::byte>>& in) { return in[root]; });
    std::memcpy(data.data(), out.data(), data.size());
    return Status::Ok();
  }

  uint32_t host;              // Membership::host; a test may give two members one id (before their join)
  float perturbation = 0.0f;  // added to every allreduce result of this member
  // This member's collective number fail_at (1 = its first) fails, without
  // meeting the others; 0: none.
  uint64_t fail_at = 0;
  // This member's allreduce number fail_after_at (counted as fail_at)
  // meets the others, who complete it, and then fails here; 0: none.
  uint64_t fail_after_at = 0;
  std::function<void()> before_allreduce;  // runs before each allreduce meets the others
  std::function<void()> before_allgather;  // and before each allgather (a round's headers)
  std::atomic<bool> fail_now{false};       // set by that hook: this allgather fails without meeting the others
  // Runs on the root's data before each broadcast it roots, and on this
  // member's bytes before each allgather (a test sending damaged bytes).
  std::function<void(std::span<std::byte>)> on_broadcast;
  std::function<void(std::span<std::byte>)> on_allgather;
  std::atomic<bool> is_elastic{false};    // re-forms (as the same group) instead of ending
  std::atomic<bool> joiner{false};        // a test's "host waiting to join", seen by this member
  std::atomic<bool> reform_fails{false};  // reform() fails
  std::atomic<uint64_t> reform_tries{0};  // the tries it failed

 private:
  bool failing() { return ++collectives_ == fail_at; }
  static Status fail() { return {ErrorCode::kIo, "federation (fake): injected failure"}; }
  uint64_t collectives_ = 0;
  std::atomic<uint64_t> epoch_{0};  // read by the server's thread for its stats
  std::shared_ptr<FakeGroup> group_;
  uint32_t rank_;
};

}  // namespace shmps::test
