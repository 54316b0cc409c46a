// The federation without an engine: N in-process "hosts" (threads, then
// in-process servers) over FakeEngine. The rounds' math against float64
// references, anchors bitwise equal on every host after every round, the
// checks that refuse mismatched hosts, a leave, a repair of anchors that
// drifted apart; then whole servers: pushes at one host reach the other
// through the rounds (with the exchange overlapped and not), and the drift
// cap holding pushes until a round merges.
#define BOOST_TEST_MODULE federation
#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "checkpoint.hpp"
#include "fake_federation.hpp"
#include "fed_store.hpp"
#include "federation.hpp"
#include "server_support.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "threads.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace shmps::server;
using shmps::test::FakeEngine;
using shmps::test::FakeGroup;

namespace {

constexpr uint64_t kN = 1000;

ModelFingerprint fingerprint(uint64_t n = kN, uint32_t optimizer = 2) {
  ModelFingerprint f;
  f.hash = 0x1234;
  f.total_elements = n;
  f.tensors = 1;
  f.optimizer = optimizer;
  return f;
}

// Runs body(rank, federator) on one thread per host, all over one group.
// Bodies must not use Boost.Test macros (not thread-safe): they return
// what the test checks afterwards.
struct Hosts {
  Hosts(uint32_t n, FederationConfig config, std::vector<ModelFingerprint> prints = {})
      : group(std::make_shared<FakeGroup>(n)) {
    for (uint32_t r = 0; r < n; ++r) {
      engines.push_back(std::make_unique<FakeEngine>(group, r));
      ModelFingerprint f = prints.empty() ? fingerprint() : prints[r];  // a test's own: mismatched on purpose
      if (prints.empty()) f.outer = outer_code(config);
      feds.push_back(std::make_unique<Federator>(config, *engines.back(), f));
    }
  }
  void run(const std::function<void(uint32_t, Federator&)>& body) {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < feds.size(); ++r) threads.emplace_back([&, r] { body(r, *feds[r]); });
    for (auto& t : threads) t.join();
  }
  std::shared_ptr<FakeGroup> group;
  std::vector<std::unique_ptr<FakeEngine>> engines;
  std::vector<std::unique_ptr<Federator>> feds;
};

std::vector<float> random_vector(uint64_t seed, uint64_t n = kN, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void check_close(std::span<const float> got, const std::vector<double>& want, double tol, const char* what) {
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::abs(got[i] - want[i]) > worst) {
      worst = std::abs(got[i] - want[i]);
      at = i;
    }
  BOOST_TEST(worst <= tol, what << ": element " << at << " is " << got[at] << ", the float64 reference " << want[at]
                                << " (|diff| " << worst << " > " << tol << ")");
}

// Each host's snapshots and update counts for `rounds` rounds.
struct Plan {
  std::vector<std::vector<std::vector<float>>> snapshots;  // [round][rank]
  std::vector<std::vector<uint64_t>> updates;              // [round][rank]
};

}  // namespace

BOOST_AUTO_TEST_SUITE(federation)

BOOST_AUTO_TEST_CASE(join_makes_rank_0s_weights_every_hosts_anchor) {
  Hosts hosts(3, FederationConfig{});
  std::vector<std::vector<float>> weights = {random_vector(1), random_vector(2), random_vector(3)};
  std::vector<std::vector<float>> corrections = weights;
  std::vector<Status> status(3);
  hosts.run([&](uint32_t r, Federator& f) { status[r] = f.join(corrections[r]).status(); });
  for (uint32_t r = 0; r < 3; ++r) {
    BOOST_TEST_REQUIRE(status[r].ok(), status[r].to_string());
    BOOST_TEST(std::equal(hosts.feds[r]->anchor().begin(), hosts.feds[r]->anchor().end(), weights[0].begin()));
    // The consumer adds the correction: W + (A - W) is rank 0's weights,
    // to the rounding of the subtraction and the addition.
    for (size_t i = 0; i < kN; i += 97)
      BOOST_TEST(std::abs(weights[r][i] + corrections[r][i] - weights[0][i]) <= 1e-6f);
    BOOST_TEST(hosts.feds[r]->anchor_hash() == hosts.feds[0]->anchor_hash());
  }
}

// The weighted average (Local SGD): A' = A + sum n_h (S_h - A) / sum n_h,
// over rounds where one host is idle in one of them, against float64; the
// anchors the same bits everywhere after every round.
BOOST_AUTO_TEST_CASE(weighted_average_matches_float64_with_anchors_bitwise_equal) {
  constexpr uint32_t kHosts = 3, kRounds = 5;
  Hosts hosts(kHosts, FederationConfig{});
  const std::vector<float> init = random_vector(10);
  Plan plan;
  for (uint32_t k = 0; k < kRounds; ++k) {
    plan.snapshots.emplace_back();
    plan.updates.emplace_back();
    for (uint32_t r = 0; r < kHosts; ++r) {
      plan.snapshots[k].push_back(random_vector(100 + k * 10 + r, kN, 0.1f));  // a delta, made a snapshot below
      plan.updates[k].push_back(k == 2 && r == 1 ? 0 : 1 + (k + r) % 4);
    }
  }
  std::vector<std::vector<uint64_t>> hashes(kRounds, std::vector<uint64_t>(kHosts));
  std::vector<std::vector<std::vector<float>>> anchors(kRounds, std::vector<std::vector<float>>(kHosts));
  std::vector<Status> status(kHosts);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex = init;
    if (auto j = f.join(ex); !j.ok()) {
      status[r] = j.status();
      return;
    }
    for (uint32_t k = 0; k < kRounds; ++k) {
      // S = A + this round's local change (zero for an idle host).
      for (size_t i = 0; i < kN; ++i)
        ex[i] = f.anchor()[i] + (plan.updates[k][r] == 0 ? 0.0f : plan.snapshots[k][r][i]);
      if (auto res = f.round(ex, plan.updates[k][r]); !res.ok()) {
        status[r] = res.status();
        return;
      }
      hashes[k][r] = f.anchor_hash();
      anchors[k][r].assign(f.anchor().begin(), f.anchor().end());
    }
  });
  std::vector<double> ref(init.begin(), init.end());
  for (uint32_t k = 0; k < kRounds; ++k) {
    for (uint32_t r = 0; r < kHosts; ++r) BOOST_TEST_REQUIRE(status[r].ok(), status[r].to_string());
    uint64_t total = 0;
    for (uint32_t r = 0; r < kHosts; ++r) total += plan.updates[k][r];
    for (size_t i = 0; i < kN; ++i) {
      double sum = 0.0;
      for (uint32_t r = 0; r < kHosts; ++r)
        if (plan.updates[k][r] != 0) sum += static_cast<double>(plan.updates[k][r]) * plan.snapshots[k][r][i];
      ref[i] += sum / static_cast<double>(total);
    }
    check_close(anchors[k][0], ref, 1e-5, "anchor");
    for (uint32_t r = 1; r < kHosts; ++r) {
      BOOST_TEST(hashes[k][r] == hashes[k][0]);
      BOOST_TEST(std::memcmp(anchors[k][r].data(), anchors[k][0].data(), kN * sizeof(float)) == 0);
    }
  }
}

// An idle host (no updates, S = A) does not pull the weighted mean toward
// the anchor; the plain mean does, by design (1/members each).
BOOST_AUTO_TEST_CASE(an_idle_host_does_not_dilute_the_weighted_average) {
  for (bool weighted : {true, false}) {
    FederationConfig config;
    config.weight_by_updates = weighted;
    Hosts hosts(2, config);
    std::vector<float> moved(2);
    hosts.run([&](uint32_t r, Federator& f) {
      std::vector<float> ex(kN, 0.0f);
      (void)f.join(ex);
      for (size_t i = 0; i < kN; ++i) ex[i] = r == 0 ? 1.0f : 0.0f;  // host 0 moved every weight by 1
      (void)f.round(ex, r == 0 ? 8 : 0);
      moved[r] = f.anchor()[0];
    });
    BOOST_TEST(moved[0] == (weighted ? 1.0f : 0.5f));
    BOOST_TEST(moved[1] == moved[0]);
  }
}

// The outer step of DiLoCo: PyTorch's SGD (nesterov, dampening 0) on the
// pseudo-gradient g = -mean delta, over several rounds, against float64.
BOOST_AUTO_TEST_CASE(nesterov_outer_step_matches_pytorch_sgd_in_float64) {
  constexpr uint32_t kHosts = 2, kRounds = 4;
  FederationConfig config;
  config.outer = OuterStep::kNesterov;
  config.outer_lr = 0.7f;
  config.outer_momentum = 0.9f;
  config.weight_by_updates = false;
  Hosts hosts(kHosts, config);
  const std::vector<float> init = random_vector(20);
  std::vector<std::vector<std::vector<float>>> deltas(kRounds);
  for (uint32_t k = 0; k < kRounds; ++k)
    for (uint32_t r = 0; r < kHosts; ++r) deltas[k].push_back(random_vector(200 + 10 * k + r, kN, 0.05f));
  std::vector<std::vector<float>> final_anchor(kHosts);
  std::vector<std::vector<float>> final_correction(kHosts);
  std::vector<std::vector<float>> final_snapshot(kHosts);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex = init;
    (void)f.join(ex);
    for (uint32_t k = 0; k < kRounds; ++k) {
      for (size_t i = 0; i < kN; ++i) ex[i] = f.anchor()[i] + deltas[k][r][i];
      final_snapshot[r] = ex;
      (void)f.round(ex, 1);
    }
    final_anchor[r].assign(f.anchor().begin(), f.anchor().end());
    final_correction[r] = ex;
  });
  // float64 reference, the snapshots as the hosts took them (S = A + delta
  // in float, so the reference follows the hosts' anchors' rounding).
  std::vector<double> a(init.begin(), init.end()), buf(kN, 0.0);
  for (uint32_t k = 0; k < kRounds; ++k)
    for (size_t i = 0; i < kN; ++i) {
      double mean = 0.0;
      for (uint32_t r = 0; r < kHosts; ++r) mean += deltas[k][r][i];
      mean /= kHosts;
      const double g = -mean;
      buf[i] = k == 0 ? g : 0.9 * buf[i] + g;
      a[i] -= 0.7 * (g + 0.9 * buf[i]);
    }
  check_close(final_anchor[0], a, 1e-5, "nesterov anchor");
  BOOST_TEST(std::memcmp(final_anchor[0].data(), final_anchor[1].data(), kN * sizeof(float)) == 0);
  // The correction is A' - S of the last snapshot.
  for (size_t i = 0; i < kN; i += 101) BOOST_TEST(final_correction[1][i] == final_anchor[1][i] - final_snapshot[1][i]);
}

// The outer step hashes the new anchor block by block as it writes it:
// the same value hash_floats() gives for the whole anchor, at lengths that
// end inside a block and on an odd element, for both outer steps.
BOOST_AUTO_TEST_CASE(the_outer_steps_hash_is_the_anchors_hash) {
  for (OuterStep outer : {OuterStep::kAverage, OuterStep::kNesterov})
    for (uint64_t n : {uint64_t{1}, uint64_t{9}, uint64_t{4096}, uint64_t{2 * 4096 + 13}}) {
      BOOST_TEST_CONTEXT(outer_step_name(outer) << ", " << n << " elements") {
        FederationConfig config;
        config.outer = outer;
        ModelFingerprint f = fingerprint(n);
        f.outer = outer_code(config);
        Hosts hosts(2, config, {f, f});
        std::vector<Status> status(2);
        hosts.run([&](uint32_t r, Federator& fed) {
          std::vector<float> ex = random_vector(30, n);
          if (auto j = fed.join(ex); !j.ok()) status[r] = j.status();
          for (int k = 0; k < 2 && status[r].ok(); ++k) {
            ex = random_vector(31 + k * 2 + r, n);
            status[r] = fed.round(ex, 1).status();
          }
        });
        for (uint32_t r = 0; r < 2; ++r) {
          BOOST_TEST_REQUIRE(status[r].ok(), status[r].to_string());
          BOOST_TEST(hosts.feds[r]->anchor_hash() == hash_floats(hosts.feds[r]->anchor()));
        }
        BOOST_TEST(hosts.feds[0]->anchor_hash() == hosts.feds[1]->anchor_hash());
      }
    }
}

// The anchors' hash tells anchors apart that differ in one bit of any
// element, in the order of elements (its chains each take every fourth
// pair, and are folded in order), or in their length.
BOOST_AUTO_TEST_CASE(the_anchor_hash_sees_every_bit_and_the_order) {
  for (uint64_t n : {1, 2, 7, 8, 9, 16, 17, 33}) {
    BOOST_TEST_CONTEXT(n << " elements") {
      const std::vector<float> base = random_vector(40, n);
      const uint64_t h = hash_floats(base);
      for (uint64_t i = 0; i < n; ++i)
        for (int bit : {0, 22, 31}) {
          std::vector<float> v = base;
          uint32_t word;
          std::memcpy(&word, &v[i], sizeof word);
          word ^= 1u << bit;
          std::memcpy(&v[i], &word, sizeof word);
          BOOST_TEST(hash_floats(v) != h, "bit " << bit << " of element " << i);
        }
      for (uint64_t i = 0; i + 2 < n; ++i) {  // an element swapped with one of the next pair (the next chain's)
        std::vector<float> v = base;
        std::swap(v[i], v[i + 2]);
        BOOST_TEST(hash_floats(v) != h, "elements " << i << " and " << i + 2 << " swapped");
      }
      std::vector<float> longer = base;
      longer.push_back(0.0f);
      BOOST_TEST(hash_floats(longer) != h);
    }
  }
}

// When no host has updates, only the headers travel, and neither the
// anchor nor the outer momentum moves (a Nesterov step with momentum left
// from an earlier round would still move it).
BOOST_AUTO_TEST_CASE(a_round_with_no_updates_anywhere_moves_no_anchor) {
  for (OuterStep outer : {OuterStep::kAverage, OuterStep::kNesterov}) {
    FederationConfig config;
    config.outer = outer;
    Hosts hosts(2, config);
    std::vector<uint64_t> bytes(2);
    std::vector<uint64_t> hash_before(2), hash_after(2);
    hosts.run([&](uint32_t r, Federator& f) {
      std::vector<float> ex(kN, 3.0f);
      (void)f.join(ex);
      std::fill(ex.begin(), ex.end(), 3.5f);  // a round with updates: the momentum is not zero after it
      (void)f.round(ex, 2);
      hash_before[r] = f.anchor_hash();
      // No update; W differs from A by the merge's rounding only.
      for (size_t i = 0; i < kN; ++i) ex[i] = r == 0 ? f.anchor()[i] : std::nextafter(f.anchor()[i], 9.0f);
      auto res = f.round(ex, 0);
      bytes[r] = res.ok() ? res->bytes : 0;
      hash_after[r] = f.anchor_hash();
    });
    for (uint32_t r = 0; r < 2; ++r) {
      BOOST_TEST(hash_after[r] == hash_before[r], "outer " << outer_step_name(outer));
      BOOST_TEST(bytes[r] == Federator::kHeaderBytes);  // the header only: no delta travelled
    }
  }
}

// A join after a restart: host 0 restored round 5, hosts 1 and 3 round 7
// (host 3 with weights of its own since), host 2 nothing. Round 7's anchor
// and outer momentum become everybody's; hosts 1 and 3 keep their drift
// (W - their anchor) exactly; host 0's drift may have gone into rounds 6
// and 7 (the source's record, empty, cannot show otherwise), so it takes
// W = A, as host 2 does; a failed restore changes nothing; the next round
// is 8 everywhere.
BOOST_AUTO_TEST_CASE(a_join_resumes_from_the_newest_anchor_keeping_the_drift_of_its_round) {
  FederationConfig config;
  config.outer = OuterStep::kNesterov;
  config.outer_lr = 0.7f;
  config.outer_momentum = 0.9f;
  Hosts hosts(4, config);
  const std::vector<float> a5 = random_vector(50), a7 = random_vector(70), m5 = random_vector(51, kN, 0.1f),
                           m7 = random_vector(71, kN, 0.1f);
  BOOST_TEST_REQUIRE(hosts.feds[0]->restore({5, true, a5, m5, 0, {}}).ok());
  BOOST_TEST_REQUIRE(hosts.feds[1]->restore({7, true, a7, m7, 0, {}}).ok());
  BOOST_TEST_REQUIRE(hosts.feds[3]->restore({7, true, a7, m7, 0, {}}).ok());
  BOOST_TEST(hosts.feds[2]->restore({1, false, std::vector<float>(kN + 1), {}, 0, {}}).code() ==
             ErrorCode::kInvalidArgument);  // another model's size: refused, nothing restored
  std::vector<std::vector<float>> weights = {random_vector(1), random_vector(2), random_vector(3), random_vector(4)};
  std::vector<std::vector<float>> corrections = weights;
  std::vector<Result<RoundResult>> joined(4, Status{ErrorCode::kInternal, "not run"});
  std::vector<uint64_t> next_round(4);
  hosts.run([&](uint32_t r, Federator& f) {
    joined[r] = f.join(corrections[r]);
    std::vector<float> ex(f.anchor().begin(), f.anchor().end());
    ex[0] += 0.25f;
    auto res = f.round(ex, 1);
    next_round[r] = res.ok() ? res->round : 0;
  });
  for (uint32_t r = 0; r < 4; ++r) {
    BOOST_TEST_REQUIRE(joined[r].ok(), joined[r].status().to_string());
    BOOST_TEST(joined[r]->resumed);
    BOOST_TEST(joined[r]->drift_kept == (r == 1 || r == 3));
    BOOST_TEST(joined[r]->source_rank == 1u);
    BOOST_TEST(joined[r]->round == 7u);
    BOOST_TEST(next_round[r] == 8u);
    BOOST_TEST(hosts.feds[r]->anchor_hash() == hosts.feds[1]->anchor_hash());
  }
  for (size_t i = 0; i < kN; i += 37) {
    BOOST_TEST(std::abs(weights[0][i] + corrections[0][i] - a7[i]) <= 1e-6f);
    BOOST_TEST(corrections[1][i] == 0.0f);
    BOOST_TEST(corrections[3][i] == 0.0f);
    BOOST_TEST(std::abs(weights[2][i] + corrections[2][i] - a7[i]) <= 1e-6f);
  }
  // Round 8 started from round 7's momentum everywhere: host 2 (which
  // restored none) stepped from m7 too, so the anchors agree (above), and
  // match the one step from a7 with m7 in float64.
  std::vector<double> want(kN);
  for (size_t i = 0; i < kN; ++i) {
    const double g = i == 0 ? -0.25 : 0.0;
    const double buf = 0.9 * double{m7[i]} + g;
    want[i] = double{a7[i]} - 0.7 * (g + 0.9 * buf);
  }
  check_close(hosts.feds[2]->anchor(), want, 1e-5, "the round after the resumed join");
  const std::optional<FederationState> state = hosts.feds[2]->state();
  BOOST_TEST_REQUIRE(state.has_value());
  BOOST_TEST(state->round == 8u);
  BOOST_TEST(state->momentum_started);
  BOOST_TEST(std::equal(state->anchor.begin(), state->anchor.end(), hosts.feds[2]->anchor().begin()));
}

// A host waiting to join, seen by one member's engine, makes every member
// drop the round (nothing exchanged, anchor and round unchanged) and join
// again, resuming at the same round with the same anchor.
BOOST_AUTO_TEST_CASE(a_host_waiting_to_join_makes_every_member_regroup) {
  Hosts hosts(2, FederationConfig{});
  std::vector<RoundResult> dropped(2), rejoined(2), next(2);
  std::vector<uint64_t> hash_before(2), hash_after(2);
  std::vector<std::vector<float>> dropped_exchange(2);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    (void)f.join(ex);
    std::fill(ex.begin(), ex.end(), 1.5f);
    (void)f.round(ex, 3);
    hash_before[r] = f.anchor_hash();
    if (r == 1) hosts.engines[1]->joiner = true;  // seen at host 1's next header only
    std::fill(ex.begin(), ex.end(), 2.0f);
    dropped[r] = f.round(ex, 3).value();
    dropped_exchange[r] = ex;
    hash_after[r] = f.anchor_hash();
    hosts.engines[r]->joiner = false;
    f.rejoin();
    std::fill(ex.begin(), ex.end(), 2.0f);
    rejoined[r] = f.join(ex).value();
    next[r] = f.round(ex, 1).value();
  });
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST(dropped[r].regroup);
    BOOST_TEST(dropped[r].round == 0u);  // no round completed
    BOOST_TEST(std::all_of(dropped_exchange[r].begin(), dropped_exchange[r].end(), [](float v) { return v == 0.0f; }));
    BOOST_TEST(hash_after[r] == hash_before[r]);
    BOOST_TEST(rejoined[r].resumed);
    BOOST_TEST(rejoined[r].round == 1u);
    BOOST_TEST(next[r].round == 2u);
    BOOST_TEST(hosts.feds[r]->anchor_hash() == hosts.feds[0]->anchor_hash());
  }
}

namespace {

// The joins of hosts serving `models`, one each, over an elastic engine
// or not.
std::vector<Status> joins_of(const std::vector<ModelFingerprint>& models, bool elastic = false) {
  Hosts hosts(static_cast<uint32_t>(models.size()), FederationConfig{}, models);
  for (auto& engine : hosts.engines) engine->is_elastic = elastic;
  std::vector<Status> status(models.size());
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 0.0f);
    status[r] = f.join(ex).status();
  });
  return status;
}
std::vector<Status> joins_of(const ModelFingerprint& a, const ModelFingerprint& b) { return joins_of({a, b}); }

}  // namespace

// Each host names both models, and the hosts outside a strict majority
// of one model are told the fix and end their federation
// (kInvalidArgument). The majority, over an elastic engine, leaves them
// out (kIo: the group re-forms without them, so one host's mistake does
// not end federation for all); over a static one it ends too. Without a
// majority (two hosts, one each), every host ends.
BOOST_AUTO_TEST_CASE(hosts_serving_other_models_are_refused_naming_both) {
  ModelFingerprint other = fingerprint(kN, 3);
  other.hash = 0x9999;
  for (const bool elastic : {false, true}) {
    BOOST_TEST_CONTEXT("elastic " << elastic) {
      const std::vector<Status> status = joins_of({fingerprint(), other}, elastic);
      for (uint32_t r = 0; r < 2; ++r) {
        BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
        const std::string& m = status[r].message();
        BOOST_TEST(m.find("serves another model") != std::string::npos, m);
        BOOST_TEST(m.find("optimizer adam,") != std::string::npos, m);   // kind 2
        BOOST_TEST(m.find("optimizer adamw,") != std::string::npos, m);  // kind 3
        BOOST_TEST(m.find("--tensor") != std::string::npos, m);          // the fix
        BOOST_TEST(m.find("no model has a majority") != std::string::npos, m);
      }
      // Two against one: the majority leaves rank 0 out when it can re-form.
      const std::vector<Status> three = joins_of({other, fingerprint(), fingerprint()}, elastic);
      BOOST_TEST(three[0].code() == ErrorCode::kInvalidArgument);
      BOOST_TEST(three[0].message().find("no model has a majority") == std::string::npos, three[0].message());
      for (uint32_t r : {1u, 2u}) {
        BOOST_TEST(three[r].code() == (elastic ? ErrorCode::kIo : ErrorCode::kInvalidArgument));
        BOOST_TEST((three[r].message().find("leaving it out") != std::string::npos) == elastic, three[r].message());
      }
    }
  }
}

// The outer step is part of what hosts must agree on, with its weighting
// and its hyperparameters: servers configured apart in any one of them
// are refused, each named (model_fingerprint() of each configuration).
BOOST_AUTO_TEST_CASE(hosts_with_other_outer_steps_are_refused_naming_both) {
  ServerConfig base;
  base.tensors = {shm::TensorSpec{"w", {kN}}};
  base.federation.outer = OuterStep::kNesterov;
  ServerConfig average = base, unweighted = base, other_lr = base;
  average.federation.outer = OuterStep::kAverage;
  unweighted.federation.weight_by_updates = false;
  other_lr.federation.outer_lr = 0.5f;
  const std::vector<std::pair<ServerConfig, std::string>> others = {{average, "outer average weighted ("},
                                                                    {unweighted, "outer nesterov unweighted (lr 0.7,"},
                                                                    {other_lr, "(lr 0.5,"}};
  for (const auto& [other, named] : others) {
    const std::vector<Status> status = joins_of(model_fingerprint(base), model_fingerprint(other));
    for (uint32_t r = 0; r < 2; ++r) {
      BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
      const std::string& m = status[r].message();
      BOOST_TEST(m.find("outer nesterov weighted (lr 0.7, momentum 0.9)") != std::string::npos, m);
      BOOST_TEST(m.find(named) != std::string::npos, m);
    }
  }
}

namespace {

// A state at `round` of lineage `lineage` (0: unknown), its anchor all `a`.
// A state as host `host` checkpointed it (the fake engine's host ids are
// the ranks).
FederationState state_of(uint64_t lineage, uint64_t round, float a, uint32_t host = 0) {
  FederationState s;
  s.round = round;
  s.anchor.assign(kN, a);
  s.lineage = lineage;
  s.host = host;
  return s;
}

// The joins of hosts restored from `states` (none: a fresh host), each
// weights all 9, over an elastic engine or not; each host's state after.
struct Joins {
  std::vector<Result<RoundResult>> joined;
  std::vector<std::optional<FederationState>> after;
  std::vector<std::vector<float>> corrections;
};
Joins joins_from(const std::vector<std::optional<FederationState>>& states, bool elastic) {
  const auto n = static_cast<uint32_t>(states.size());
  Hosts hosts(n, FederationConfig{});
  Joins j{std::vector<Result<RoundResult>>(n, Status{ErrorCode::kInternal, "not run"}),
          std::vector<std::optional<FederationState>>(n), std::vector<std::vector<float>>(n)};
  for (uint32_t r = 0; r < n; ++r) {
    hosts.engines[r]->is_elastic = elastic;
    if (states[r]) BOOST_TEST_REQUIRE(hosts.feds[r]->restore(*states[r]).ok());
  }
  hosts.run([&](uint32_t r, Federator& f) {
    j.corrections[r].assign(kN, 9.0f);
    j.joined[r] = f.join(j.corrections[r]);
  });
  for (uint32_t r = 0; r < n; ++r) j.after[r] = hosts.feds[r]->state();
  return j;
}

bool mentions(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

}  // namespace

// Hosts whose anchors belong to unrelated lineages (a job restarted
// without checkpoints, met by a host of the old one that paused through
// it; a checkpoint of another job) are refused at the join, naming every
// lineage, rather than one anchor replacing the others and every round
// merged into them. As for a model mismatch, the hosts outside a strict
// majority of the states end their federation with their state as it was;
// the majority (and hosts without a state) leave them out where the
// engine re-forms; without a majority every host with a state ends.
BOOST_AUTO_TEST_CASE(hosts_of_unrelated_lineages_are_refused_keeping_their_state) {
  const FederationState old_job = state_of(0xa1, 50, 1.0f), new_job = state_of(0xb2, 12, 2.0f);
  for (const bool elastic : {false, true}) {
    BOOST_TEST_CONTEXT("elastic " << elastic) {
      // The old job's host (round 50, the highest) against two of the new job's.
      const Joins three = joins_from({old_job, new_job, new_job}, elastic);
      BOOST_TEST(three.joined[0].status().code() == ErrorCode::kInvalidArgument);
      BOOST_TEST(mentions(three.joined[0].status(), "lineage 0x00000000000000a1 at round 50 (rank 0)"),
                 three.joined[0].status().message());
      BOOST_TEST(mentions(three.joined[0].status(), "lineage 0x00000000000000b2 at round 12 (rank 1 2)"),
                 three.joined[0].status().message());
      BOOST_TEST(mentions(three.joined[0].status(), "outside the majority"), three.joined[0].status().message());
      BOOST_TEST(mentions(three.joined[0].status(), "--checkpoint-dir"), three.joined[0].status().message());
      for (uint32_t r : {1u, 2u}) {
        BOOST_TEST(three.joined[r].status().code() == (elastic ? ErrorCode::kIo : ErrorCode::kInvalidArgument));
        BOOST_TEST(
            mentions(three.joined[r].status(), elastic ? "leaving out the hosts outside lineage 0x00000000000000b2"
                                                       : "restart the hosts outside lineage 0x00000000000000b2"),
            three.joined[r].status().message());
      }
      // Nothing changed: each state is the one restored, and no correction.
      for (uint32_t r = 0; r < 3; ++r) {
        const FederationState& want = r == 0 ? old_job : new_job;
        BOOST_TEST_REQUIRE(three.after[r].has_value());
        BOOST_TEST(three.after[r]->round == want.round);
        BOOST_TEST(three.after[r]->lineage == want.lineage);
        BOOST_TEST((three.after[r]->anchor == want.anchor));
        BOOST_TEST(
            std::all_of(three.corrections[r].begin(), three.corrections[r].end(), [](float v) { return v == 9.0f; }));
      }
      // One of each, and a fresh host: no majority; the states' hosts end,
      // the fresh one re-forms where the engine can.
      const Joins split = joins_from({old_job, new_job, std::nullopt}, elastic);
      for (uint32_t r : {0u, 1u}) {
        BOOST_TEST(split.joined[r].status().code() == ErrorCode::kInvalidArgument);
        BOOST_TEST(mentions(split.joined[r].status(), "no lineage has a majority"), split.joined[r].status().message());
      }
      BOOST_TEST(split.joined[2].status().code() == (elastic ? ErrorCode::kIo : ErrorCode::kInvalidArgument));
      BOOST_TEST(!split.after[2].has_value());
    }
  }
}

// A host whose weights (or restored anchor or outer momentum) hold NaN or
// Inf at the join stays out: at a fresh group's join rank 0's weights
// become every host's anchor, at a resumed one the source's anchor and
// momentum do (a NaN momentum makes every host's next anchor NaN). It is
// refused; the others leave it out where the engine re-forms (kIo) and end
// where it cannot; no state changes.
BOOST_AUTO_TEST_CASE(a_host_whose_weights_are_not_finite_at_the_join_stays_out) {
  enum class Where { kWeights, kAnchor, kMomentum };
  for (const bool elastic : {false, true}) {
    for (const Where where : {Where::kWeights, Where::kAnchor, Where::kMomentum}) {
      BOOST_TEST_CONTEXT("elastic " << elastic << ", in " << static_cast<int>(where)) {
        FederationConfig config;
        config.outer = OuterStep::kNesterov;
        config.outer_lr = 0.7f;
        config.outer_momentum = 0.9f;
        Hosts hosts(3, config);
        for (auto& engine : hosts.engines) engine->is_elastic = elastic;
        if (where != Where::kWeights) {
          FederationState state = state_of(0x5, 4, 1.0f);
          state.momentum.assign(kN, 0.25f);
          state.momentum_started = true;
          (where == Where::kAnchor ? state.anchor : state.momentum)[7] = std::numeric_limits<float>::quiet_NaN();
          BOOST_TEST_REQUIRE(hosts.feds[0]->restore(std::move(state)).ok());
        }
        std::vector<Status> status(3);
        hosts.run([&](uint32_t r, Federator& f) {
          std::vector<float> ex(kN, 1.0f);
          if (r == 0 && where == Where::kWeights) ex[5] = std::numeric_limits<float>::infinity();
          status[r] = f.join(ex).status();
        });
        BOOST_TEST(status[0].code() == ErrorCode::kInvalidArgument);
        BOOST_TEST(
            mentions(status[0], "this host's weights (or the anchor or outer momentum it restored) hold NaN or Inf"),
            status[0].message());
        for (uint32_t r : {1u, 2u}) {
          BOOST_TEST(status[r].code() == (elastic ? ErrorCode::kIo : ErrorCode::kInvalidArgument));
          BOOST_TEST(mentions(status[r], "host rank 0's weights"), status[r].message());
          BOOST_TEST(!hosts.feds[r]->state().has_value());  // not joined
        }
        BOOST_TEST(hosts.feds[0]->state().has_value() == (where != Where::kWeights));
      }
    }
  }
}

// A host restored from a checkpoint of round 5, older than the group's
// round 7, whose drift W - A_ckpt no round may have merged. The source's
// record of groups decides: this host (host 0) a member of a group that
// completed round 6 or 7 (its drift went into it): W = A7, dropped and
// said merged; every round after 5 completed by groups without it: the
// drift is kept, rebased onto A7 (W + A7 - A5); neither shown (members
// unknown, as in a format-3 record; the record starting after round 6; a
// state of unknown lineage): W = A7, dropped, and said merged only when
// round 6 completed in the checkpoint's own group of round 5.
BOOST_AUTO_TEST_CASE(a_join_over_an_older_checkpoint_tells_whether_its_drift_was_merged) {
  constexpr uint64_t kUnknown = RoundGroups::kMembersUnknown, kAll = 0b111, kOthers = 0b110;
  enum class Drift { kMerged, kRebased, kNotShown };
  struct Case {
    const char* what;
    uint64_t group6, members6, group7, members7;
    Drift want;
    bool merged;  // restored_drift_merged
    uint64_t lineage = 0x77;
    bool record_from_7 = false;  // the source's record starts at round 7
    uint32_t writer = 0;         // the host id that wrote the checkpoint (this host's: 0)
  };
  const Case cases[] = {
      {"members unknown, round 6 in the checkpoint's group", 0x11, kUnknown, 0x11, kUnknown, Drift::kNotShown, true},
      {"members unknown, round 6 in another group", 0x22, kUnknown, 0x22, kUnknown, Drift::kNotShown, false},
      {"a member of round 6's group", 0x11, kAll, 0x11, kAll, Drift::kMerged, true},
      {"a member of round 7's group only", 0x22, kOthers, 0x33, 0b011, Drift::kMerged, true},
      {"a member of neither group", 0x22, kOthers, 0x22, kOthers, Drift::kRebased, false},
      {"round 7's members unknown", 0x22, kOthers, 0x33, kUnknown, Drift::kNotShown, false},
      {"the record starts at round 7", 0x22, kOthers, 0x22, kOthers, Drift::kNotShown, false, 0x77, true},
      {"a checkpoint of unknown lineage", 0x22, kOthers, 0x22, kOthers, Drift::kNotShown, false, 0},
      // Written as host 1, a member of both (its drift merged), restored as
      // host 0, a member of neither: the record tells nothing of it.
      {"a checkpoint written under another host id", 0x22, kOthers, 0x22, kOthers, Drift::kNotShown, false, 0x77, false,
       1},
      {"a checkpoint of a state that never joined", 0x22, kOthers, 0x22, kOthers, Drift::kNotShown, false, 0x77, false,
       kUnknownFederationHost},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.what) {
      FederationState older = state_of(c.lineage, 5, 1.0f, c.writer), newer = state_of(0x77, 7, 2.0f);
      for (uint64_t k = 1; k <= 5; ++k) {
        older.history.completed(k, 0x11, c.members6 == kUnknown ? kUnknown : kAll);
        if (!c.record_from_7) newer.history.completed(k, 0x11, c.members6 == kUnknown ? kUnknown : kAll);
      }
      if (!c.record_from_7) newer.history.completed(6, c.group6, c.members6);
      newer.history.completed(7, c.group7, c.members7);
      const Joins j = joins_from({older, newer}, false);
      for (uint32_t r = 0; r < 2; ++r) BOOST_TEST_REQUIRE(j.joined[r].ok(), j.joined[r].status().to_string());
      BOOST_TEST(j.joined[0]->restored_round == 5u);
      BOOST_TEST(j.joined[0]->restored_drift_dropped == (c.want != Drift::kRebased));
      BOOST_TEST(j.joined[0]->restored_drift_rebased == (c.want == Drift::kRebased));
      BOOST_TEST(j.joined[0]->drift_kept == (c.want == Drift::kRebased));
      BOOST_TEST(j.joined[0]->restored_drift_merged == c.merged);
      BOOST_TEST(!j.joined[0]->restart_updates_kept);    // restored without its weights
      BOOST_TEST(!j.joined[1]->restored_drift_dropped);  // the source: its drift kept
      BOOST_TEST(!j.joined[1]->restored_drift_rebased);
      BOOST_TEST(j.joined[1]->drift_kept);
      // W = 9 everywhere: W = A7 = 2, or W + A7 - A5 = 10 (the correction A7 - A5).
      const float want = c.want == Drift::kRebased ? 10.0f : 2.0f;
      BOOST_TEST(
          std::all_of(j.corrections[0].begin(), j.corrections[0].end(), [&](float v) { return 9.0f + v == want; }));
      BOOST_TEST_REQUIRE(j.after[0].has_value());
      BOOST_TEST(j.after[0]->round == 7u);
      BOOST_TEST((j.after[0]->history == newer.history));  // the source's record, handed on
    }
  }
}

// A lineage is drawn at a fresh group's join, the same on every member and
// another for another group; joins that continue it keep it (an older
// checkpoint of it, a fresh host), and a state of unknown lineage (a
// checkpoint written before lineages were recorded) joins any, taking the
// group's; it reaches the state a checkpoint stores.
BOOST_AUTO_TEST_CASE(a_lineage_is_drawn_by_a_fresh_group_and_kept_by_the_joins_that_continue_it) {
  const Joins fresh = joins_from({std::nullopt, std::nullopt}, false);
  const Joins other = joins_from({std::nullopt, std::nullopt}, false);
  BOOST_TEST_REQUIRE(fresh.after[0].has_value());
  BOOST_TEST_REQUIRE(other.after[0].has_value());
  const uint64_t lineage = fresh.after[0]->lineage;
  BOOST_TEST(lineage != 0u);
  BOOST_TEST(fresh.after[1]->lineage == lineage);
  BOOST_TEST(other.after[0]->lineage != lineage);
  const Joins resumed =
      joins_from({state_of(lineage, 3, 1.0f), state_of(lineage, 7, 2.0f), state_of(0, 5, 3.0f), std::nullopt}, false);
  for (uint32_t r = 0; r < 4; ++r) {
    BOOST_TEST_REQUIRE(resumed.joined[r].ok(), resumed.joined[r].status().to_string());
    BOOST_TEST(resumed.joined[r]->source_rank == 1u);
    BOOST_TEST(resumed.after[r]->lineage == lineage);
  }
  // A state of unknown lineage at a higher round does not replace the
  // known lineage's anchor: the source is of the lineage.
  const Joins older = joins_from({state_of(0, 100, 3.0f), state_of(0xc3, 5, 1.0f)}, false);
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST_REQUIRE(older.joined[r].ok(), older.joined[r].status().to_string());
    BOOST_TEST(older.joined[r]->source_rank == 1u);
    BOOST_TEST(older.after[r]->round == 5u);
    BOOST_TEST(older.after[r]->lineage == 0xc3u);
    BOOST_TEST(older.after[r]->anchor[0] == 1.0f);
  }
  // States all of unknown lineage: the group draws one.
  const Joins unknown = joins_from({state_of(0, 5, 3.0f), state_of(0, 5, 3.0f)}, false);
  BOOST_TEST_REQUIRE(unknown.joined[0].ok(), unknown.joined[0].status().to_string());
  BOOST_TEST(unknown.after[0]->lineage != 0u);
  BOOST_TEST(unknown.after[1]->lineage == unknown.after[0]->lineage);
}

BOOST_AUTO_TEST_CASE(a_leaving_host_ends_the_round_with_nothing_exchanged) {
  Hosts hosts(3, FederationConfig{});
  std::vector<RoundResult> results(3);
  std::vector<float> first(3, -1.0f);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    (void)f.join(ex);
    if (r == 2) {
      (void)f.leave();
      return;
    }
    std::fill(ex.begin(), ex.end(), 5.0f);
    auto res = f.round(ex, 4);
    if (res.ok()) results[r] = *res;
    first[r] = ex[0];
  });
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST(results[r].peer_left);
    BOOST_TEST(results[r].left_rank == 2u);
    BOOST_TEST(first[r] == 0.0f);  // no correction: the local weights stay
    BOOST_TEST(hosts.feds[r]->round_number() == 0u);
  }
}

// A host whose weights hold NaN or Inf leaves at the round instead of
// sending them: it gets the error, the others see it leave, and nobody's
// weights or anchor take the value.
BOOST_AUTO_TEST_CASE(a_host_whose_weights_are_not_finite_leaves_instead_of_spreading_them) {
  Hosts hosts(3, FederationConfig{});
  std::vector<Result<RoundResult>> results(3, Status{ErrorCode::kInternal, "not run"});
  std::vector<std::vector<float>> after(3);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    (void)f.join(ex);
    std::fill(ex.begin(), ex.end(), 2.0f);
    if (r == 1) ex[kN / 2] = -std::numeric_limits<float>::infinity();
    results[r] = f.round(ex, 4);
    after[r] = ex;
  });
  BOOST_TEST(!results[1].ok());
  BOOST_TEST(results[1].status().message().find("hold NaN or Inf") != std::string::npos, results[1].status().message());
  for (uint32_t r : {0u, 2u}) {
    BOOST_REQUIRE(results[r].ok());
    BOOST_TEST(results[r]->peer_left);
    BOOST_TEST(results[r]->left_rank == 1u);
    BOOST_TEST(std::all_of(after[r].begin(), after[r].end(), [](float v) { return std::isfinite(v); }));
    BOOST_TEST(hosts.feds[r]->round_number() == 0u);
  }
}

// Anchors that differ (here: one member's engine returns a perturbed sum)
// are seen at the next round's headers and replaced by rank 0's.
BOOST_AUTO_TEST_CASE(anchors_that_differ_are_repaired_from_rank_0) {
  Hosts hosts(2, FederationConfig{});
  hosts.engines[1]->perturbation = 1e-3f;
  std::vector<RoundResult> second(2);
  std::vector<uint64_t> after_first(2);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 0.0f);
    (void)f.join(ex);
    for (size_t i = 0; i < kN; ++i) ex[i] = f.anchor()[i] + 0.5f;
    (void)f.round(ex, 1);
    after_first[r] = f.anchor_hash();
    if (r == 1) hosts.engines[1]->perturbation = 0.0f;
    for (size_t i = 0; i < kN; ++i) ex[i] = f.anchor()[i] + 0.25f;
    if (auto res = f.round(ex, 1); res.ok()) second[r] = *res;
  });
  BOOST_TEST(after_first[0] != after_first[1]);
  BOOST_TEST(second[0].anchors_repaired);
  BOOST_TEST(second[1].anchors_repaired);
  BOOST_TEST(hosts.feds[0]->anchor_hash() == hosts.feds[1]->anchor_hash());
  // Rank 0's 0.5, then the round's mean delta: 0.25 from rank 0, and from
  // rank 1 its 0.25 plus its drift from rank 0's anchor (1e-3 / 2).
  BOOST_TEST(std::abs(hosts.feds[1]->anchor()[0] - 0.75025f) <= 1e-6f);
}

// A failure of the headers' allgather (collective 3, after the join's
// two) or of the delta's allreduce (4) leaves the anchor and the round.
BOOST_AUTO_TEST_CASE(an_engine_failure_leaves_the_anchor_unchanged) {
  for (uint64_t fail_at : {3, 4}) {
    Hosts hosts(1, FederationConfig{});
    std::vector<float> ex(kN, 2.0f);
    BOOST_TEST_REQUIRE(hosts.feds[0]->join(ex).ok());
    const uint64_t before = hosts.feds[0]->anchor_hash();
    hosts.engines[0]->fail_at = fail_at;
    std::fill(ex.begin(), ex.end(), 4.0f);
    auto res = hosts.feds[0]->round(ex, 1);
    BOOST_TEST(!res.ok(), "collective " << fail_at);
    BOOST_TEST(res.status().message().find("injected failure") != std::string::npos);
    BOOST_TEST(hosts.feds[0]->anchor_hash() == before);
    BOOST_TEST(hosts.feds[0]->round_number() == 0u);
  }
}

// A host whose round failed at the very end of its allreduce, while the
// other member completed it (its delta in the new anchor): at the join
// after, it keeps only the drift since that round's snapshot, W + (A' -
// S), and not W + (A' - A), which would count its delta twice. A host
// whose round 2 failed where the other completed a round 2 without it (a
// group of its own, another epoch: its delta not in that anchor) keeps
// the whole drift.
BOOST_AUTO_TEST_CASE(a_round_that_completed_elsewhere_is_not_counted_twice_at_the_join) {
  for (bool same_epoch : {true, false}) {
    FederationConfig config;
    config.weight_by_updates = false;
    Hosts hosts(2, config);
    for (auto& engine : hosts.engines) engine->is_elastic = true;  // a failed round is followed by a join
    // Host 1's collectives: the join's allgather and broadcast (1, 2),
    // round 1's allgather and allreduce (3, 4), round 2's (5, 6): after
    // meeting host 0, or alone and before any meeting.
    (same_epoch ? hosts.engines[1]->fail_after_at : hosts.engines[1]->fail_at) = 6;
    const std::vector<float> init(kN, 1.0f);
    std::vector<Result<RoundResult>> second(2, Status{ErrorCode::kInternal, "not run"});
    std::vector<Result<RoundResult>> rejoined(2, Status{ErrorCode::kInternal, "not run"});
    std::vector<std::vector<float>> weights(2), corrections(2);
    std::vector<float> a2;
    hosts.run([&](uint32_t r, Federator& f) {
      std::vector<float> ex = init;
      (void)f.join(ex);
      for (float& v : ex) v = 1.0f + 0.5f * static_cast<float>(r);  // round 1: deltas 0 and 0.5
      (void)f.round(ex, 1);
      std::vector<float> s(f.anchor().begin(), f.anchor().end());
      for (float& v : s) v += r == 0 ? 0.25f : 1.0f;  // round 2: deltas 0.25 and 1
      ex = s;
      if (!same_epoch) hosts.engines[r]->move_to(std::make_shared<FakeGroup>(1), 0);  // each alone
      second[r] = f.round(ex, 1);
      // Host 0 merged (W = A2 + 0.125 applied since); host 1 saw the round
      // fail and applied 0.0625 more after its snapshot.
      weights[r] = s;
      for (size_t i = 0; i < kN; ++i) weights[r][i] = r == 0 ? f.anchor()[i] + 0.125f : s[i] + 0.0625f;
    });
    BOOST_TEST_REQUIRE(second[0].ok());
    BOOST_TEST(second[1].status().message().find("injected failure") != std::string::npos);
    a2.assign(hosts.feds[0]->anchor().begin(), hosts.feds[0]->anchor().end());
    BOOST_TEST(hosts.feds[0]->round_number() == 2u);
    BOOST_TEST(hosts.feds[1]->round_number() == 1u);
    auto pair = std::make_shared<FakeGroup>(2);
    for (uint32_t r = 0; r < 2; ++r) hosts.engines[r]->move_to(pair, r);
    hosts.run([&](uint32_t r, Federator& f) {
      f.rejoin();
      corrections[r] = weights[r];
      rejoined[r] = f.join(corrections[r]);
    });
    for (uint32_t r = 0; r < 2; ++r) BOOST_TEST_REQUIRE(rejoined[r].ok(), rejoined[r].status().to_string());
    BOOST_TEST(rejoined[1]->source_rank == 0u);
    BOOST_TEST(rejoined[1]->drift_kept);
    BOOST_TEST(rejoined[1]->failed_round_merged == same_epoch);
    BOOST_TEST(!rejoined[0]->failed_round_merged);
    for (size_t i = 0; i < kN; i += 41) {
      BOOST_TEST(weights[0][i] + corrections[0][i] == a2[i] + 0.125f);  // its own round: drift kept whole
      // A2 = A1 + (0.25 + 1) / 2, host 1's 1.0 in it once; or A1 + 0.25,
      // without it.
      const float want = same_epoch ? a2[i] + 0.0625f : a2[i] + 1.0625f;
      BOOST_TEST(std::abs(weights[1][i] + corrections[1][i] - want) <= 1e-6f, i);
    }
  }
}

// A fork at one round: round 1 completes at host 0 only (hosts 1 and 2
// see its allreduce fail), hosts 1 and 2 re-form without it and complete
// a round 1 of their own. When host 0 comes back, the join sees two
// anchors of one lineage at round 1: the one two members hold wins over
// host 0's (the lowest rank), every member says so, and host 0 keeps its
// drift since its merge, rebased onto the winning anchor.
BOOST_AUTO_TEST_CASE(a_fork_at_one_round_keeps_the_anchor_more_members_hold) {
  FederationConfig config;
  config.weight_by_updates = true;
  Hosts hosts(3, config);
  for (auto& engine : hosts.engines) engine->is_elastic = true;
  // Collectives: the join's allgather and broadcast (1, 2), round 1's
  // allgather and allreduce (3, 4): hosts 1 and 2 fail the allreduce
  // after host 0 completed it.
  hosts.engines[1]->fail_after_at = 4;
  hosts.engines[2]->fail_after_at = 4;
  std::vector<std::vector<float>> w(3, std::vector<float>(kN, 0.0f));
  std::vector<Result<RoundResult>> first(3, Status{ErrorCode::kInternal, "not run"});
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex = w[r];
    if (!f.join(ex).ok()) return;
    for (float& v : w[r]) v += static_cast<float>(r + 1);
    ex = w[r];
    first[r] = f.round(ex, 1);
    if (first[r].ok())
      for (size_t i = 0; i < kN; ++i) w[r][i] += ex[i];
  });
  BOOST_TEST_REQUIRE(first[0].ok());
  BOOST_TEST_REQUIRE(!first[1].ok());
  BOOST_TEST_REQUIRE(!first[2].ok());
  const auto regroup = [&](const std::vector<uint32_t>& members,
                           const std::function<void(uint32_t, Federator&)>& body) {
    auto group = std::make_shared<FakeGroup>(static_cast<uint32_t>(members.size()));
    for (uint32_t k = 0; k < members.size(); ++k) hosts.engines[members[k]]->move_to(group, k);
    std::vector<std::thread> threads;
    for (uint32_t x : members) threads.emplace_back([&, x] { body(x, *hosts.feds[x]); });
    for (auto& t : threads) t.join();
  };
  // Hosts 1 and 2 (a majority) complete their own round 1.
  std::vector<Result<RoundResult>> branch(3, Status{ErrorCode::kInternal, "not run"});
  regroup({1, 2}, [&](uint32_t x, Federator& f) {
    f.rejoin();
    std::vector<float> ex = w[x];
    if (!f.join(ex).ok()) return;
    for (size_t i = 0; i < kN; ++i) w[x][i] += ex[i] + 10.0f;
    ex = w[x];
    branch[x] = f.round(ex, 2);
    if (branch[x].ok())
      for (size_t i = 0; i < kN; ++i) w[x][i] += ex[i];
  });
  BOOST_TEST_REQUIRE(branch[1].ok());
  BOOST_TEST_REQUIRE(hosts.feds[0]->round_number() == 1u);
  BOOST_TEST_REQUIRE(hosts.feds[1]->round_number() == 1u);
  BOOST_TEST_REQUIRE(hosts.feds[0]->lineage() == hosts.feds[1]->lineage());
  BOOST_TEST_REQUIRE(hosts.feds[0]->anchor_hash() != hosts.feds[1]->anchor_hash());
  const std::vector<float> kept(hosts.feds[1]->anchor().begin(), hosts.feds[1]->anchor().end());
  for (float& v : w[0]) v += 0.5f;  // host 0's drift since its merge
  std::vector<Result<RoundResult>> joined(3, Status{ErrorCode::kInternal, "not run"});
  regroup({0, 1, 2}, [&](uint32_t x, Federator& f) {
    f.rejoin();
    std::vector<float> ex = w[x];
    joined[x] = f.join(ex);
    if (joined[x].ok())
      for (size_t i = 0; i < kN; ++i) w[x][i] += ex[i];
  });
  for (uint32_t x = 0; x < 3; ++x) {
    BOOST_TEST_REQUIRE(joined[x].ok(), joined[x].status().to_string());
    BOOST_TEST(joined[x]->source_rank == 1u, "host " << x);
    BOOST_TEST(joined[x]->fork, "host " << x);     // FORK-FIELDS
    BOOST_TEST(joined[x]->fork_rank == 0u);        // FORK-FIELDS
    BOOST_TEST(joined[x]->fork_holders == 2u);     // FORK-FIELDS
    BOOST_TEST(joined[x]->fork_lost == (x == 0));  // FORK-FIELDS
    BOOST_TEST(hosts.feds[x]->anchor_hash() == hash_floats(kept), "host " << x);
  }
  for (size_t i = 0; i < kN; i += 97) {
    BOOST_TEST(w[0][i] == kept[i] + 0.5f, i);
    BOOST_TEST(w[1][i] == kept[i], i);
    BOOST_TEST(w[2][i] == kept[i], i);
  }
}

// The rounds' groups: consecutive rounds of one group share a span; the
// oldest span goes once there are more than kSpans.
BOOST_AUTO_TEST_CASE(round_groups_keep_the_last_spans) {
  RoundGroups h;
  BOOST_TEST(!h.holds(1, 0));
  uint64_t round = 0;
  for (uint64_t group = 0; group < RoundGroups::kSpans + 2; ++group)
    for (int k = 0; k < 3; ++k) h.completed(++round, group, 1);  // group g: rounds 3g+1 .. 3g+3
  BOOST_TEST(!h.holds(1, 0));                                    // groups 0 and 1 fell out
  BOOST_TEST(!h.holds(6, 1));
  BOOST_TEST(h.holds(7, 2));
  BOOST_TEST(h.holds(9, 2));
  BOOST_TEST(!h.holds(9, 3));  // another group's
  BOOST_TEST(h.holds(round, RoundGroups::kSpans + 1));
  BOOST_TEST(!h.holds(round + 1, RoundGroups::kSpans + 1));
}

// Whether a host was a member of a group that completed one of the rounds
// after a checkpoint's: shown by one span that holds it; its absence only
// by spans that hold every one of those rounds, each with its members.
BOOST_AUTO_TEST_CASE(round_groups_tell_whether_a_host_was_in_the_rounds_since) {
  using P = RoundGroups::Presence;
  RoundGroups h;
  for (uint64_t k = 1; k <= 3; ++k) h.completed(k, 1, 0b011);  // hosts 0 and 1
  for (uint64_t k = 4; k <= 5; ++k) h.completed(k, 2, 0b110);  // hosts 1 and 2
  h.completed(6, 3, RoundGroups::kMembersUnknown);             // as from a format-3 record
  BOOST_TEST(h.spans[1].members == 0b110u);
  BOOST_TEST((h.presence(0, 3, 5) == P::kAbsent));
  BOOST_TEST((h.presence(2, 0, 3) == P::kAbsent));
  BOOST_TEST((h.presence(0, 2, 5) == P::kMember));    // round 3
  BOOST_TEST((h.presence(1, 3, 6) == P::kMember));    // rounds 4-5 show it, round 6 unknown
  BOOST_TEST((h.presence(0, 3, 6) == P::kUnknown));   // round 6's members unknown
  BOOST_TEST((h.presence(0, 3, 7) == P::kUnknown));   // round 7 not in the record
  BOOST_TEST((h.presence(64, 3, 5) == P::kUnknown));  // an id without a bit (an MPI rank past 63)
  BOOST_TEST(RoundGroups::member_bit(63) == uint64_t{1} << 63);
  BOOST_TEST(RoundGroups::member_bit(64) == 0u);
  // A record that no longer reaches back to round 1 (its span fell out).
  RoundGroups late;
  for (uint64_t k = 1; k <= RoundGroups::kSpans + 1; ++k) late.completed(k, k, 0b10);
  BOOST_TEST((late.presence(0, 0, RoundGroups::kSpans + 1) == P::kUnknown));
  BOOST_TEST((late.presence(0, 1, RoundGroups::kSpans + 1) == P::kAbsent));
  // Members are any bits (none: unknown), but none in an empty span.
  BOOST_TEST(h.plausible(6));
  RoundGroups bad = h;
  bad.spans[RoundGroups::kSpans - 1].members = 1;
  BOOST_TEST(!bad.plausible(6));
}

namespace {

// Runs body(host, federator) for `members` (hosts' indices) as one group
// of their own (a new FakeGroup, a new epoch), each on a thread.
void run_group(Hosts& hosts, const std::vector<uint32_t>& members,
               const std::function<void(uint32_t, Federator&)>& body) {
  auto group = std::make_shared<FakeGroup>(static_cast<uint32_t>(members.size()));
  for (uint32_t rank = 0; rank < members.size(); ++rank) hosts.engines[members[rank]]->move_to(group, rank);
  std::vector<std::thread> threads;
  for (uint32_t h : members) threads.emplace_back([&, h] { body(h, *hosts.feds[h]); });
  for (auto& t : threads) t.join();
}

// Hosts 0, 1 and 2 of `hosts` (elastic) join and run two rounds (host h's
// delta 0.125 (h + 1) in each); round 2's allreduce fails at `failing`
// after meeting the others. Each host's weights after: A2 where round 2
// merged, else its snapshot S plus 0.0625 applied since.
std::vector<std::vector<float>> two_rounds_failing_at(Hosts& hosts, const std::vector<uint32_t>& failing) {
  for (auto& engine : hosts.engines) engine->is_elastic = true;
  for (uint32_t h : failing) hosts.engines[h]->fail_after_at = 6;  // round 2's allreduce (as above)
  std::vector<std::vector<float>> weights(hosts.feds.size(), std::vector<float>(kN, 1.0f));
  run_group(hosts, {0, 1, 2}, [&](uint32_t h, Federator& f) {
    std::vector<float> ex = weights[h];
    (void)f.join(ex);
    for (uint32_t k = 0; k < 2; ++k) {
      for (size_t i = 0; i < kN; ++i) ex[i] = f.anchor()[i] + 0.125f * static_cast<float>(h + 1);
      weights[h] = ex;
      (void)f.round(ex, 1);
    }
    const bool failed = std::find(failing.begin(), failing.end(), h) != failing.end();
    for (size_t i = 0; i < kN; ++i) weights[h][i] += failed ? 0.0625f : ex[i];
  });
  return weights;
}

}  // namespace

// The same, later: hosts 0 and 1 complete round 2, host 2 sees it fail.
// Host 0 goes on with host 3 (new, its rounds' groups from host 0 by the
// join) for round 3; then host 3 is the source when host 2 joins again,
// and what it holds of round 2 came to it by the join.
BOOST_AUTO_TEST_CASE(a_round_that_completed_elsewhere_is_not_counted_twice_after_later_rounds) {
  FederationConfig config;
  config.weight_by_updates = false;
  Hosts hosts(4, config);
  std::vector<std::vector<float>> weights = two_rounds_failing_at(hosts, {2});
  BOOST_TEST_REQUIRE(hosts.feds[0]->round_number() == 2u);
  BOOST_TEST_REQUIRE(hosts.feds[2]->round_number() == 1u);
  run_group(hosts, {0, 3}, [&](uint32_t h, Federator& f) {
    f.rejoin();
    std::vector<float> ex = weights[h];
    (void)f.join(ex);  // host 3: W = A2
    for (size_t i = 0; i < kN; ++i) ex[i] = f.anchor()[i] + (h == 0 ? 0.5f : 0.0f);
    (void)f.round(ex, 1);
    weights[h].assign(f.anchor().begin(), f.anchor().end());  // W = A3 after the merge
  });
  BOOST_TEST_REQUIRE(hosts.feds[3]->round_number() == 3u);
  const std::vector<float> a3(hosts.feds[3]->anchor().begin(), hosts.feds[3]->anchor().end());
  std::vector<Result<RoundResult>> rejoined(4, Status{ErrorCode::kInternal, "not run"});
  std::vector<std::vector<float>> corrections = weights;
  run_group(hosts, {3, 2}, [&](uint32_t h, Federator& f) {
    f.rejoin();
    rejoined[h] = f.join(corrections[h]);
  });
  for (uint32_t h : {2u, 3u}) BOOST_TEST_REQUIRE(rejoined[h].ok(), rejoined[h].status().to_string());
  BOOST_TEST(rejoined[2]->round == 3u);
  BOOST_TEST(rejoined[2]->source_rank == 0u);  // host 3
  BOOST_TEST(rejoined[2]->failed_round_merged);
  BOOST_TEST(rejoined[2]->failed_round_updates == 1u);
  for (size_t i = 0; i < kN; i += 41)
    BOOST_TEST(std::abs(weights[2][i] + corrections[2][i] - (a3[i] + 0.0625f)) <= 1e-6f, i);
}

// The same when the source was restarted from a checkpoint in between:
// hosts 0 and 1 complete round 2, host 2 sees it fail; host 0 restarts
// from its state (a checkpoint's) and is the source when host 2 joins
// again. The checkpoint's record of which group completed its rounds
// shows round 2 merged with host 2's delta in it.
BOOST_AUTO_TEST_CASE(a_round_that_completed_elsewhere_is_not_counted_twice_by_a_restored_source) {
  FederationConfig config;
  config.weight_by_updates = false;
  Hosts hosts(3, config);
  std::vector<std::vector<float>> weights = two_rounds_failing_at(hosts, {2});
  BOOST_TEST_REQUIRE(hosts.feds[0]->round_number() == 2u);
  const std::vector<float> a2(hosts.feds[0]->anchor().begin(), hosts.feds[0]->anchor().end());
  std::optional<FederationState> saved = hosts.feds[0]->state();
  BOOST_TEST_REQUIRE(saved.has_value());
  ModelFingerprint print = fingerprint();
  print.outer = outer_code(config);
  hosts.feds[0] = std::make_unique<Federator>(config, *hosts.engines[0], print);
  BOOST_TEST_REQUIRE(hosts.feds[0]->restore(std::move(*saved)).ok());
  std::vector<Result<RoundResult>> rejoined(3, Status{ErrorCode::kInternal, "not run"});
  std::vector<std::vector<float>> corrections = weights;
  run_group(hosts, {0, 2}, [&](uint32_t h, Federator& f) {
    if (h == 2) f.rejoin();
    rejoined[h] = f.join(corrections[h]);
  });
  for (uint32_t h : {0u, 2u}) BOOST_TEST_REQUIRE(rejoined[h].ok(), rejoined[h].status().to_string());
  BOOST_TEST(rejoined[2]->source_rank == 0u);  // host 0, restored at round 2
  BOOST_TEST(rejoined[2]->failed_round_merged);
  BOOST_TEST(rejoined[2]->failed_round_updates == 1u);
  for (size_t i = 0; i < kN; i += 41)
    BOOST_TEST(std::abs(weights[2][i] + corrections[2][i] - (a2[i] + 0.0625f)) <= 1e-6f, i);
  // A record that cannot be of the state's rounds is refused, nothing restored.
  FederationState bad = *hosts.feds[0]->state();
  bad.round = 1;  // its record holds round 2
  Federator fresh(config, *hosts.engines[1], print);
  const Status refused = fresh.restore(std::move(bad));
  BOOST_TEST(refused.code() == ErrorCode::kInvalidArgument);
  BOOST_TEST(refused.message().find("record of groups does not fit its round 1") != std::string::npos,
             refused.message());
  BOOST_TEST(!fresh.state().has_value());
}

// A host restored from another job's checkpoint (of unknown lineage),
// whose record shows a round of the same number completed under the same
// engine epoch (each job's store counts its epochs from the start), at a
// higher round than this job's host: the source is of the job's lineage,
// and the host that saw that round fail in this job keeps its whole
// drift, none of which is in any anchor.
BOOST_AUTO_TEST_CASE(another_jobs_checkpoint_does_not_show_this_jobs_failed_round) {
  FederationConfig config;
  config.weight_by_updates = false;
  constexpr uint64_t kEpoch = 1000;  // both jobs' first epoch
  const auto in_group = [](Hosts& hosts, uint64_t epoch) {
    auto group = std::make_shared<FakeGroup>(2, epoch);
    for (uint32_t r = 0; r < 2; ++r) hosts.engines[r]->move_to(group, r);
  };
  // The other job: two rounds at both hosts; host 0's state is its checkpoint.
  Hosts other(2, config);
  in_group(other, kEpoch);
  other.run([&](uint32_t, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    (void)f.join(ex);
    for (int k = 0; k < 2; ++k) {
      ex.assign(f.anchor().begin(), f.anchor().end());
      for (float& v : ex) v += 0.5f;
      (void)f.round(ex, 1);
    }
  });
  std::optional<FederationState> old_state = other.feds[0]->state();
  BOOST_TEST_REQUIRE(old_state.has_value());
  BOOST_TEST_REQUIRE(old_state->round == 2u);
  // As a checkpoint written before lineages were recorded: one of another
  // lineage is refused at the join (hosts_of_unrelated_lineages_...).
  old_state->lineage = 0;
  // This job: round 2 fails at host 1 after meeting host 0, under the same epoch.
  Hosts job(2, config);
  for (auto& engine : job.engines) engine->is_elastic = true;
  in_group(job, kEpoch);
  job.engines[1]->fail_after_at = 6;  // round 2's allreduce (the join's 2, round 1's 2, round 2's 2)
  std::vector<std::vector<float>> weights(2);
  job.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    (void)f.join(ex);
    for (int k = 0; k < 2; ++k) {
      ex.assign(f.anchor().begin(), f.anchor().end());
      for (float& v : ex) v += 0.25f;
      weights[r] = ex;
      (void)f.round(ex, 1);
    }
  });
  BOOST_TEST_REQUIRE(job.feds[1]->round_number() == 1u);
  // Host 0 restarts from the other job's checkpoint (round 2, of unknown
  // lineage): the source is host 1, of the job's lineage, whose record
  // shows round 2 failed.
  ModelFingerprint print = fingerprint();
  print.outer = outer_code(config);
  job.feds[0] = std::make_unique<Federator>(config, *job.engines[0], print);
  BOOST_TEST_REQUIRE(job.feds[0]->restore(std::move(*old_state)).ok());
  in_group(job, kEpoch + 1);
  std::vector<Result<RoundResult>> rejoined(2, Status{ErrorCode::kInternal, "not run"});
  job.run([&](uint32_t r, Federator& f) {
    if (r == 1) f.rejoin();
    std::vector<float> ex = weights[r];
    rejoined[r] = f.join(ex);
  });
  for (uint32_t r = 0; r < 2; ++r) BOOST_TEST_REQUIRE(rejoined[r].ok(), rejoined[r].status().to_string());
  BOOST_TEST(rejoined[1]->source_rank == 1u);
  BOOST_TEST(rejoined[1]->drift_kept);
  BOOST_TEST(!rejoined[1]->failed_round_merged);
  BOOST_TEST(rejoined[1]->failed_round_updates == 0u);
}

// Hosts 1 and 2 see round 2 fail while host 0 completes it; the two meet
// first in a group of their own, still at round 1 (one that cannot have
// merged round 2), then join host 0: each keeps its snapshot through the
// first join and takes only its drift since it at the second.
BOOST_AUTO_TEST_CASE(a_failed_round_is_remembered_through_a_join_of_a_group_behind_it) {
  FederationConfig config;
  config.weight_by_updates = false;
  Hosts hosts(3, config);
  std::vector<std::vector<float>> weights = two_rounds_failing_at(hosts, {1, 2});
  BOOST_TEST_REQUIRE(hosts.feds[0]->round_number() == 2u);
  const std::vector<float> a2(hosts.feds[0]->anchor().begin(), hosts.feds[0]->anchor().end());
  std::vector<Result<RoundResult>> behind(3, Status{ErrorCode::kInternal, "not run"});
  run_group(hosts, {1, 2}, [&](uint32_t h, Federator& f) {
    f.rejoin();
    std::vector<float> ex = weights[h];
    behind[h] = f.join(ex);
    for (size_t i = 0; i < kN; ++i) weights[h][i] += ex[i];
  });
  for (uint32_t h : {1u, 2u}) {
    BOOST_TEST_REQUIRE(behind[h].ok(), behind[h].status().to_string());
    BOOST_TEST(!behind[h]->failed_round_merged);
  }
  std::vector<Result<RoundResult>> rejoined(3, Status{ErrorCode::kInternal, "not run"});
  std::vector<std::vector<float>> corrections = weights;
  run_group(hosts, {0, 1, 2}, [&](uint32_t h, Federator& f) {
    f.rejoin();
    rejoined[h] = f.join(corrections[h]);
  });
  for (uint32_t h = 0; h < 3; ++h) BOOST_TEST_REQUIRE(rejoined[h].ok(), rejoined[h].status().to_string());
  for (uint32_t h : {1u, 2u}) {
    BOOST_TEST(rejoined[h]->failed_round_merged);
    for (size_t i = 0; i < kN; i += 41)
      BOOST_TEST(std::abs(weights[h][i] + corrections[h][i] - (a2[i] + 0.0625f)) <= 1e-6f, i);
  }
}

// The record of groups holds each span's members, by host id (not rank):
// four hosts of ids 5, 9, 63 and 100 (an MPI rank past the bits, which
// has none) complete rounds 1 and 2, then hosts 5 and 63 round 3; the
// record is handed on by the joins, the same at both.
BOOST_AUTO_TEST_CASE(each_span_of_rounds_records_its_groups_members) {
  Hosts hosts(4, FederationConfig{});
  const uint32_t ids[] = {5, 9, 63, 100};
  for (uint32_t h = 0; h < 4; ++h) hosts.engines[h]->host = ids[h];
  const auto rounds = [&](uint32_t n) {
    return [&, n](uint32_t h, Federator& f) {
      f.rejoin();
      std::vector<float> ex(kN, 1.0f);
      (void)f.join(ex);
      for (uint32_t k = 0; k < n; ++k) {
        ex.assign(f.anchor().begin(), f.anchor().end());
        ex[h] += 0.5f;
        (void)f.round(ex, 1);
      }
    };
  };
  run_group(hosts, {0, 1, 2, 3}, rounds(2));
  run_group(hosts, {0, 2}, rounds(1));
  const std::optional<FederationState> state = hosts.feds[2]->state();
  BOOST_TEST_REQUIRE(state.has_value());
  BOOST_TEST_REQUIRE(state->round == 3u);
  const RoundGroups& record = state->history;
  BOOST_TEST(record.spans[0].first == 1u);
  BOOST_TEST(record.spans[0].last == 2u);
  BOOST_TEST(record.spans[0].members == (uint64_t{1} << 5 | uint64_t{1} << 9 | uint64_t{1} << 63));
  BOOST_TEST(record.spans[1].first == 3u);
  BOOST_TEST(record.spans[1].last == 3u);
  BOOST_TEST(record.spans[1].members == (uint64_t{1} << 5 | uint64_t{1} << 63));
  BOOST_TEST(record.spans[2].first == 0u);
  BOOST_TEST((hosts.feds[0]->state()->history == record));
  BOOST_TEST((record.presence(9, 2, 3) == RoundGroups::Presence::kAbsent));
  BOOST_TEST((record.presence(100, 0, 3) == RoundGroups::Presence::kUnknown));
}

// Host 2 of three is in round 1, then checkpoints (its drift D = 0.5
// since) while hosts 0 and 1 complete rounds 2 and 3 without it (it was
// paused, partitioned, or served alone); it restarts from that checkpoint,
// applies U = 0.25 more, and joins them at round 3. No round merged D: it
// is rebased with U onto A3, W + (A3 - A1), exactly. Had host 2 been in
// round 2 (which merged D), the join takes W = A3 + U, W + (A3 - W_ckpt),
// exactly: no round merged U.
BOOST_AUTO_TEST_CASE(a_restored_host_keeps_the_drift_that_no_round_merged) {
  for (const bool in_round_2 : {false, true}) {
    BOOST_TEST_CONTEXT("host 2 in round 2: " << in_round_2) {
      FederationConfig config;
      config.weight_by_updates = false;
      Hosts hosts(3, config);
      std::vector<std::vector<float>> weights(3, std::vector<float>(kN, 1.0f));
      // Each member's W: S plus the correction, as the consumer's merge.
      const auto round = [&](uint32_t h, Federator& f, float delta) {
        std::vector<float> ex(f.anchor().begin(), f.anchor().end());
        for (float& v : ex) v += delta;
        weights[h] = ex;
        (void)f.round(ex, 1);
        for (size_t i = 0; i < kN; ++i) weights[h][i] += ex[i];
      };
      run_group(hosts, {0, 1, 2}, [&](uint32_t h, Federator& f) {
        std::vector<float> ex = weights[h];
        (void)f.join(ex);
        for (size_t i = 0; i < kN; ++i) weights[h][i] += ex[i];
        round(h, f, 0.125f * static_cast<float>(h + 1));
      });
      const std::vector<float> a1(hosts.feds[2]->anchor().begin(), hosts.feds[2]->anchor().end());
      for (float& v : weights[2]) v += 0.5f;  // D
      std::optional<FederationState> checkpoint = hosts.feds[2]->state();
      const std::vector<float> checkpoint_weights = weights[2];
      BOOST_TEST_REQUIRE(checkpoint.has_value());
      const auto rejoin_round = [&](uint32_t h, Federator& f) {
        f.rejoin();
        std::vector<float> ex = weights[h];
        (void)f.join(ex);
        for (size_t i = 0; i < kN; ++i) weights[h][i] += ex[i];
        round(h, f, 0.25f);
      };
      if (in_round_2) {
        run_group(hosts, {0, 1, 2}, rejoin_round);
        run_group(hosts, {0, 1}, rejoin_round);
      } else {
        run_group(hosts, {0, 1}, rejoin_round);
        run_group(hosts, {0, 1}, [&](uint32_t h, Federator& f) { round(h, f, 0.25f); });
      }
      BOOST_TEST_REQUIRE(hosts.feds[0]->round_number() == 3u);
      const std::vector<float> a3(hosts.feds[0]->anchor().begin(), hosts.feds[0]->anchor().end());
      // The restart: the checkpoint's state and weights, and U since.
      ModelFingerprint print = fingerprint();
      print.outer = outer_code(config);
      hosts.feds[2] = std::make_unique<Federator>(config, *hosts.engines[2], print);
      BOOST_TEST(Federator(config, *hosts.engines[2], print).restore(*checkpoint, std::vector<float>(kN + 1)).code() ==
                 ErrorCode::kInvalidArgument);  // weights of another model
      BOOST_TEST_REQUIRE(hosts.feds[2]->restore(std::move(*checkpoint), checkpoint_weights).ok());
      weights[2] = checkpoint_weights;
      for (float& v : weights[2]) v += 0.25f;  // U
      std::vector<Result<RoundResult>> joined(3, Status{ErrorCode::kInternal, "not run"});
      std::vector<std::vector<float>> corrections = weights;
      run_group(hosts, {0, 1, 2}, [&](uint32_t h, Federator& f) {
        if (h != 2) f.rejoin();
        joined[h] = f.join(corrections[h]);
      });
      for (uint32_t h = 0; h < 3; ++h) BOOST_TEST_REQUIRE(joined[h].ok(), joined[h].status().to_string());
      BOOST_TEST(joined[2]->round == 3u);
      BOOST_TEST(joined[2]->restored_round == 1u);
      BOOST_TEST(joined[2]->restored_drift_rebased == !in_round_2);
      BOOST_TEST(joined[2]->drift_kept == !in_round_2);
      BOOST_TEST(joined[2]->restored_drift_dropped == in_round_2);
      BOOST_TEST(joined[2]->restored_drift_merged == in_round_2);
      BOOST_TEST(joined[2]->restart_updates_kept == in_round_2);
      size_t wrong = 0;
      for (size_t i = 0; i < kN; ++i) {
        // Rebased: the correction A3 - A1 (D and U kept); merged: A3 - W_ckpt (U kept).
        const float want = in_round_2 ? a3[i] - checkpoint_weights[i] : a3[i] - a1[i];
        wrong += corrections[2][i] == want ? 0 : 1;
      }
      BOOST_TEST(wrong == 0u);
      BOOST_TEST(std::abs(weights[2][0] + corrections[2][0] - (in_round_2 ? a3[0] + 0.25f : a3[0] + 0.75f)) <= 1e-6f);
    }
  }
}

namespace {

// Every host's join, each with weights all 1; each host's status.
std::vector<Status> join_all(Hosts& hosts) {
  std::vector<Status> status(hosts.feds.size());
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    status[r] = f.join(ex).status();
  });
  return status;
}

}  // namespace

// A round header with bits this build gives no meaning (a flag it does
// not know, the reserved word set: a newer build's, or damage) is refused
// by every member at the join, naming the rank; nobody joins.
BOOST_AUTO_TEST_CASE(a_round_header_with_unknown_bits_is_refused) {
  constexpr size_t kFlagsAt = Federator::kHeaderBytes - 12, kReservedAt = Federator::kHeaderBytes - 4;
  for (const auto& [at, value] : {std::pair{kFlagsAt, uint32_t{1} << 9}, std::pair{kReservedAt, uint32_t{1}}}) {
    BOOST_TEST_CONTEXT("offset " << at) {
      Hosts hosts(2, FederationConfig{});
      hosts.engines[1]->on_allgather = [at, value](std::span<std::byte> data) {
        if (data.size() != Federator::kHeaderBytes) return;
        uint32_t word;
        std::memcpy(&word, data.data() + at, 4);
        word |= value;
        std::memcpy(data.data() + at, &word, 4);
      };
      const std::vector<Status> status = join_all(hosts);
      for (uint32_t r = 0; r < 2; ++r) {
        BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
        BOOST_TEST(mentions(status[r], "host rank 1 sent a round header this build does not know"),
                   status[r].message());
        BOOST_TEST(!hosts.feds[r]->state().has_value());
      }
    }
  }
}

// One joiner of an elastic group whose header this build cannot read
// (unknown flag bits, a period out of bounds) does not end federation at
// every host: the two members whose headers are readable, a majority,
// leave it out (kIo: the group re-forms without it), and it ends (its
// own header, as the others got it, is the one refused).
BOOST_AUTO_TEST_CASE(a_joiner_whose_header_cannot_be_read_is_left_out_by_the_majority) {
  constexpr size_t kFlagsAt = Federator::kHeaderBytes - 12, kEveryAt = Federator::kHeaderBytes - 16;
  for (const auto& [at, value] : {std::pair{kFlagsAt, uint32_t{1} << 9}, std::pair{kEveryAt, uint32_t{0}}}) {
    BOOST_TEST_CONTEXT("offset " << at) {
      Hosts hosts(3, FederationConfig{});
      for (auto& engine : hosts.engines) engine->is_elastic = true;
      hosts.engines[2]->on_allgather = [at, value](std::span<std::byte> data) {
        if (data.size() != Federator::kHeaderBytes) return;
        uint32_t word;
        std::memcpy(&word, data.data() + at, 4);
        word = at == kFlagsAt ? word | value : value;
        std::memcpy(data.data() + at, &word, 4);
      };
      const std::vector<Status> status = join_all(hosts);
      for (uint32_t r = 0; r < 3; ++r) {
        BOOST_TEST(mentions(status[r], "host rank 2 sent"), status[r].message());
        BOOST_TEST(!hosts.feds[r]->state().has_value());
      }
      BOOST_TEST(status[0].code() == ErrorCode::kIo);
      BOOST_TEST(status[1].code() == ErrorCode::kIo);
      BOOST_TEST(mentions(status[0], "leaving out the 1 of 3 hosts"), status[0].message());
      BOOST_TEST(status[2].code() == ErrorCode::kInvalidArgument);
      // The two re-form without it and join.
      auto pair = std::make_shared<FakeGroup>(2);
      for (uint32_t r = 0; r < 2; ++r) hosts.engines[r]->move_to(pair, r);
      std::vector<Status> rejoined(2, Status{ErrorCode::kInternal, "not run"});
      std::vector<std::thread> threads;
      for (uint32_t r = 0; r < 2; ++r)
        threads.emplace_back([&, r] {
          std::vector<float> ex(kN, 0.0f);
          hosts.feds[r]->rejoin();
          rejoined[r] = hosts.feds[r]->join(ex).status();
        });
      for (auto& t : threads) t.join();
      for (uint32_t r = 0; r < 2; ++r) BOOST_TEST(rejoined[r].ok(), rejoined[r].to_string());
    }
  }
}

// Bytes from a peer that cannot be: a source's record of groups damaged in
// flight (members in an empty span) is refused by every member, nobody's
// state changed; two members giving one host id are refused too.
BOOST_AUTO_TEST_CASE(a_record_or_host_ids_that_cannot_be_are_refused_at_the_join) {
  FederationState older = state_of(0x77, 5, 1.0f), newer = state_of(0x77, 7, 2.0f);
  for (uint64_t k = 1; k <= 7; ++k) newer.history.completed(k, 0x11, 0b11);
  Hosts hosts(2, FederationConfig{});
  BOOST_TEST_REQUIRE(hosts.feds[0]->restore(older).ok());
  BOOST_TEST_REQUIRE(hosts.feds[1]->restore(newer).ok());
  hosts.engines[1]->on_broadcast = [](std::span<std::byte> data) {
    if (data.size() != sizeof(RoundGroups)) return;
    RoundGroups record;
    std::memcpy(&record, data.data(), sizeof record);
    record.spans[RoundGroups::kSpans - 1].members = 1;
    std::memcpy(data.data(), &record, sizeof record);
  };
  std::vector<Status> status(2);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 9.0f);
    status[r] = f.join(ex).status();
  });
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
    BOOST_TEST(mentions(status[r],
                        "the record of groups that host rank 1 (the join's source) sent does not fit its "
                        "round 7"),
               status[r].message());
    BOOST_TEST_REQUIRE(hosts.feds[r]->state().has_value());
    BOOST_TEST(hosts.feds[r]->state()->round == (r == 0 ? 5u : 7u));
    BOOST_TEST(hosts.feds[r]->state()->anchor[0] == (r == 0 ? 1.0f : 2.0f));
  }
  Hosts twins(2, FederationConfig{});
  twins.engines[1]->host = 0;
  twins.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 9.0f);
    status[r] = f.join(ex).status();
  });
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
    BOOST_TEST(mentions(status[r], "host ranks 0 and 1 both say they are host 0"), status[r].message());
    BOOST_TEST(!twins.feds[r]->state().has_value());
  }
}

namespace {

// Both hosts' joins, host 1's header holding `value` at `offset` (a
// damaged peer); each host's status.
template <class T>
std::vector<Status> join_with_damaged_header(Hosts& hosts, size_t offset, T value) {
  hosts.engines[1]->on_allgather = [offset, value](std::span<std::byte> data) {
    if (data.size() == Federator::kHeaderBytes) std::memcpy(data.data() + offset, &value, sizeof value);
  };
  return join_all(hosts);
}

}  // namespace

// A join header whose round no checkpoint holds (kMaxCheckpointVersion or
// past it, the last before a wrap) is refused by every member, naming the
// rank, rather than taken as the group's round: the states stay as they
// were (fuzz_federation's seed found_round_past_checkpoints).
BOOST_AUTO_TEST_CASE(a_round_past_any_checkpoint_is_refused_at_the_join) {
  constexpr size_t kRoundAt = 8;  // Header::round
  for (const uint64_t round : {kMaxCheckpointVersion, ~uint64_t{0}}) {
    BOOST_TEST_CONTEXT("round " << round) {
      Hosts hosts(2, FederationConfig{});
      for (uint32_t r = 0; r < 2; ++r) BOOST_TEST_REQUIRE(hosts.feds[r]->restore(state_of(0x77, 5, 1.0f, r)).ok());
      const std::vector<Status> status = join_with_damaged_header(hosts, kRoundAt, round);
      for (uint32_t r = 0; r < 2; ++r) {
        BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
        BOOST_TEST(
            mentions(status[r], "host rank 1 sent round " + std::to_string(round) + ", past any a checkpoint holds"),
            status[r].message());
        BOOST_TEST_REQUIRE(hosts.feds[r]->state().has_value());
        BOOST_TEST(hosts.feds[r]->state()->round == 5u);
        BOOST_TEST(hosts.feds[r]->round_number() == 5u);
      }
    }
  }
}

// A header whose round period no --fed-every-ms has (0, or past an hour)
// is refused by every member at the join, naming the rank, rather than
// becoming the group's longest period, which each round's first collective
// and a stop wait for beyond their timeouts: nobody joins
// (fuzz_federation's seed found_group_period_past_any_config).
BOOST_AUTO_TEST_CASE(a_round_period_no_host_can_have_is_refused_at_the_join) {
  constexpr size_t kEveryMsAt = 88;  // Header::every_ms
  for (const uint32_t every_ms : {uint32_t{0}, uint32_t{3'600'001}, ~uint32_t{0}}) {
    BOOST_TEST_CONTEXT("every_ms " << every_ms) {
      Hosts hosts(2, FederationConfig{});
      const std::vector<Status> status = join_with_damaged_header(hosts, kEveryMsAt, every_ms);
      for (uint32_t r = 0; r < 2; ++r) {
        BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
        BOOST_TEST(mentions(status[r], "host rank 1 sent a round period of " + std::to_string(every_ms) +
                                           " ms, outside 1..3600000"),
                   status[r].message());
        BOOST_TEST(!hosts.feds[r]->state().has_value());
        BOOST_TEST(hosts.feds[r]->group_every_ms() == 0u);
      }
    }
  }
}

// NaN or Inf from a peer, in the anchor a join's source broadcasts or in a
// round's sum, would become every host's anchor (the header's own flag
// says only what the sender claims), as would a sum whose outer step
// overflows: every member refuses it alike and keeps its state. Two
// honest members here, the bytes between them damaged.
BOOST_AUTO_TEST_CASE(non_finite_bytes_from_a_peer_are_refused_not_merged) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  {
    Hosts hosts(2, FederationConfig{});
    hosts.engines[0]->on_broadcast = [](std::span<std::byte> data) {  // the fresh group's anchor, rank 0's
      const float inf = std::numeric_limits<float>::infinity();
      if (data.size() == kN * sizeof(float)) std::memcpy(data.data() + sizeof(float), &inf, sizeof inf);
    };
    const std::vector<Status> status = join_all(hosts);
    for (uint32_t r = 0; r < 2; ++r) {
      BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
      BOOST_TEST(mentions(status[r], "the anchor or outer momentum that host rank 0 sent holds NaN or Inf"),
                 status[r].message());
      BOOST_TEST(!hosts.feds[r]->state().has_value());
    }
  }
  Hosts hosts(2, FederationConfig{});
  std::vector<Status> status(2);
  std::vector<uint64_t> hash(2);
  hosts.run([&](uint32_t r, Federator& f) {
    std::vector<float> ex(kN, 1.0f);
    status[r] = f.join(ex).status();
    hash[r] = f.anchor_hash();
  });
  BOOST_TEST_REQUIRE((status[0].ok() && status[1].ok()));
  for (auto& engine : hosts.engines) engine->perturbation = nan;  // the sum every member receives
  std::vector<std::vector<float>> ex(2, std::vector<float>(kN, 2.0f));
  hosts.run([&](uint32_t r, Federator& f) { status[r] = f.round(ex[r], 1).status(); });
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
    BOOST_TEST(mentions(status[r], "round 1: the outer step on the hosts' summed deltas gives NaN or Inf"),
               status[r].message());
    BOOST_TEST(hosts.feds[r]->round_number() == 0u);
    BOOST_TEST(hosts.feds[r]->anchor_hash() == hash[r]);
    BOOST_TEST(hosts.feds[r]->state()->anchor == std::vector<float>(kN, 1.0f));
  }
  // Finite values whose outer step overflows (Nesterov's d = g + 0.9 b is
  // 1.9 g): refused alike, the anchor and momentum unchanged; the next
  // round, undamaged, completes from them.
  {
    FederationConfig nesterov;
    nesterov.outer = OuterStep::kNesterov;
    Hosts big(2, nesterov);
    big.run([&](uint32_t r, Federator& f) {
      std::vector<float> weights(kN, 1.0f);
      status[r] = f.join(weights).status();
    });
    BOOST_TEST_REQUIRE((status[0].ok() && status[1].ok()));
    for (auto& engine : big.engines) engine->perturbation = 3e38f;
    std::vector<std::vector<float>> snapshot(2, std::vector<float>(kN, 2.0f));
    // One local update in all: the mean is the sum, g = -3e38, d = 1.9 g.
    big.run([&](uint32_t r, Federator& f) { status[r] = f.round(snapshot[r], r == 0 ? 1 : 0).status(); });
    for (uint32_t r = 0; r < 2; ++r) {
      BOOST_TEST(mentions(status[r], "round 1: the outer step on the hosts' summed deltas gives NaN or Inf"),
                 status[r].message());
      const std::optional<FederationState> s = big.feds[r]->state();
      BOOST_TEST(s->anchor == std::vector<float>(kN, 1.0f));
      BOOST_TEST(s->momentum == std::vector<float>(kN, 0.0f));
      BOOST_TEST(!s->momentum_started);
    }
    for (auto& engine : big.engines) engine->perturbation = 0.0f;
    snapshot.assign(2, std::vector<float>(kN, 2.0f));
    big.run([&](uint32_t r, Federator& f) { status[r] = f.round(snapshot[r], 1).status(); });
    for (uint32_t r = 0; r < 2; ++r) {
      BOOST_TEST(status[r].ok(), status[r].message());
      BOOST_TEST(big.feds[r]->round_number() == 1u);
      BOOST_TEST(big.feds[r]->state()->momentum_started);
    }
  }
  // A count of local updates no server reaches (the members' sum could
  // wrap to 0, a round nobody trained): refused by every member.
  for (auto& engine : hosts.engines) engine->perturbation = 0.0f;
  hosts.engines[1]->on_allgather = [](std::span<std::byte> data) {
    constexpr size_t kLocalUpdatesAt = 16;  // Header::local_updates
    const uint64_t updates = ~uint64_t{0};
    if (data.size() == Federator::kHeaderBytes) std::memcpy(data.data() + kLocalUpdatesAt, &updates, sizeof updates);
  };
  ex.assign(2, std::vector<float>(kN, 2.0f));  // a refused step leaves its exchange overwritten
  hosts.run([&](uint32_t r, Federator& f) { status[r] = f.round(ex[r], 1).status(); });
  for (uint32_t r = 0; r < 2; ++r) {
    BOOST_TEST(status[r].code() == ErrorCode::kInvalidArgument);
    BOOST_TEST(mentions(status[r], "host rank 1 sent 18446744073709551615 local updates, more than a round can sum"),
               status[r].message());
    BOOST_TEST(hosts.feds[r]->round_number() == 0u);
  }
}

// A damaged header is refused by every member, also where another
// member's model differs: the comparisons with this host's model come
// after every header was checked by itself, so no member goes on with the
// damage. The two whose headers are readable, a majority of the elastic
// group, leave its sender out (kIo: they re-form, and meet the model
// mismatch then); the sender ends.
BOOST_AUTO_TEST_CASE(a_damaged_header_is_refused_alike_beside_another_model) {
  ModelFingerprint other = fingerprint(kN, 3);
  other.hash = 0x9999;
  Hosts hosts(3, FederationConfig{}, {other, fingerprint(), fingerprint()});
  for (auto& engine : hosts.engines) engine->is_elastic = true;
  hosts.engines[2]->on_allgather = [](std::span<std::byte> data) {
    constexpr size_t kEveryMsAt = 88;  // Header::every_ms
    const uint32_t every_ms = 0;
    if (data.size() == Federator::kHeaderBytes) std::memcpy(data.data() + kEveryMsAt, &every_ms, sizeof every_ms);
  };
  const std::vector<Status> status = join_all(hosts);
  for (uint32_t r = 0; r < 3; ++r) {
    BOOST_TEST(status[r].code() == (r == 2 ? ErrorCode::kInvalidArgument : ErrorCode::kIo));
    BOOST_TEST(mentions(status[r], "host rank 2 sent a round period of 0 ms"), status[r].message());
    BOOST_TEST(!mentions(status[r], "serves another model"), status[r].message());
  }
}

// ---------------------------------------------------------------- servers

namespace {

// A counter of the stats block that ServerStats does not carry.
uint64_t block_stat(const std::string& name, std::atomic<uint64_t> shm::StatsBlock::*field) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  return ((*seg)->stats().*field).load();
}

// Two in-process servers federated over one FakeGroup, SGD lr 1 on one
// tensor of 4 zeros, so a push of g moves the weights by -g exactly.
// Host `r`'s server: 4 weights, SGD lr 1, no staleness bound.
ServerConfig federated_config(uint32_t r, const FederationConfig& f, const std::string& checkpoint_dir) {
  ServerConfig c;
  c.name = test::unique_name("fed" + std::to_string(r));
  c.tensors = {{"w", {4}}};
  c.optimizer.kind = kernels::OptimizerKind::kSgd;
  c.optimizer.lr = 1.0f;
  c.backend = BackendKind::kHost;
  c.max_staleness = 1'000'000;
  c.federation = f;
  c.checkpoint_dir = checkpoint_dir;
  return c;
}

struct TwoServers {
  // `setup`: run on each host's engine before its server runs (the
  // federation thread reads what it sets). `await_join`: return once both
  // joined (else at once). `configure`: run on each host's configuration.
  TwoServers(FederationConfig a, FederationConfig b, std::array<std::string, 2> checkpoint_dirs = {},
             const std::function<void(uint32_t, FakeEngine&)>& setup = nullptr, bool await_join = true,
             const std::function<void(uint32_t, ServerConfig&)>& configure = nullptr)
      : group(std::make_shared<FakeGroup>(2)) {
    for (uint32_t r = 0; r < 2; ++r) {
      ServerConfig c = federated_config(r, r == 0 ? a : b, checkpoint_dirs[r]);
      if (configure) configure(r, c);
      names.push_back(c.name);
      auto engine = std::make_unique<FakeEngine>(group, r);
      if (setup) setup(r, *engine);
      engines.push_back(engine.get());
      servers.push_back(std::make_unique<test::InProcessServer>(c, std::move(engine)));
    }
    // Joined (the join makes rank 0's weights everybody's): what a test
    // pushes from here on travels through rounds.
    if (!await_join) return;
    BOOST_TEST_REQUIRE(test::eventually([&] {
      return block_stat(names[0], &shm::StatsBlock::fed_members) == 2 &&
             block_stat(names[1], &shm::StatsBlock::fed_members) == 2;
    }));
  }
  std::shared_ptr<FakeGroup> group;
  std::vector<std::string> names;
  std::vector<FakeEngine*> engines;  // owned by the servers
  std::vector<std::unique_ptr<test::InProcessServer>> servers;
};

// A worker that pushes a gradient of -0.5 everywhere `pushes` times.
void push_halves(const std::string& name, int pushes) {
  auto w = test::connect(name);
  auto grad = w->register_buffer(16);
  BOOST_REQUIRE(grad.ok());
  auto weights = w->register_buffer(16);
  BOOST_REQUIRE(weights.ok());
  for (int k = 0; k < 4; ++k) static_cast<float*>(grad->data)[k] = -0.5f;
  for (int p = 0; p < pushes; ++p) {
    auto v = w->pull(0, weights->id, 0);
    BOOST_REQUIRE(v.ok());
    auto pushed = w->push(0, grad->id, 0, 16, Dtype::kF32, *v);
    BOOST_REQUIRE_MESSAGE(pushed.ok(), pushed.status().to_string());
  }
}

std::vector<float> pull_weights(const std::string& name) {
  auto w = test::connect(name);
  auto buf = w->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  BOOST_REQUIRE(w->pull(0, buf->id, 0).ok());
  const auto* p = static_cast<const float*>(buf->data);
  return std::vector<float>(p, p + 4);
}

uint64_t stat(const std::string& name, uint64_t ServerStats::*field) {
  auto w = test::connect(name);
  auto s = w->stats();
  BOOST_REQUIRE(s.ok());
  return (*s).*field;
}

}  // namespace

// Host 0's pushes reach host 1 through the rounds, weighted so that idle
// host 1 does not halve them, whether the exchange overlaps local serving
// (pushes during a round are kept by the merge) or holds it.
BOOST_AUTO_TEST_CASE(pushes_at_one_server_reach_the_other_through_the_rounds) {
  for (bool overlap : {true, false}) {
    FederationConfig f;
    f.every_ms = 20;
    f.overlap = overlap;
    TwoServers two(f, f);
    constexpr int kPushes = 40;
    push_halves(two.names[0], kPushes);
    const float want = 0.5f * kPushes;
    BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[1])[0] == want; }),
                       "overlap " << overlap << ": host 1 has " << pull_weights(two.names[1])[0] << ", want " << want);
    const std::vector<float> w0 = pull_weights(two.names[0]), w1 = pull_weights(two.names[1]);
    for (int k = 0; k < 4; ++k) {
      BOOST_TEST(w0[k] == want);
      BOOST_TEST(w1[k] == want);
    }
    BOOST_TEST(stat(two.names[0], &ServerStats::fed_members) == 2u);
    BOOST_TEST(stat(two.names[1], &ServerStats::fed_round) >= 1u);
    BOOST_TEST(stat(two.names[0], &ServerStats::fed_anchor_hash) == stat(two.names[1], &ServerStats::fed_anchor_hash));
    BOOST_TEST(stat(two.names[0], &ServerStats::fed_failures) == 0u);
  }
}

// Holds a host's first allreduce after hook() (its federation thread
// inside the round's exchange) until release(): a host that hangs, under
// an engine without a timeout.
struct StuckAllreduce {
  void hook(FakeEngine& engine) {
    engine.before_allreduce = [this] {
      std::unique_lock lock(mu);
      if (!armed) return;
      armed = false;
      reached = true;
      cv.notify_all();
      cv.wait(lock, [this] { return released; });
    };
  }
  // Whether the hooked allreduce was reached within 10 s.
  bool await_reached() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [this] { return reached; });
  }
  void release() {
    {
      std::lock_guard lock(mu);
      released = true;
    }
    cv.notify_all();
  }
  ~StuckAllreduce() { release(); }
  std::mutex mu;
  std::condition_variable cv;
  bool armed = true, reached = false, released = false;
};

// A round that never merges (host 0's thread held inside its allreduce
// for as long as the test likes: a host that hangs, under an engine
// without a timeout) holds a push only for two periods plus the engine's
// timeout; then the push is served, and pushes are not held again until a
// round merges. The round, once let go, merges and keeps the push.
BOOST_AUTO_TEST_CASE(a_round_that_never_merges_holds_pushes_only_for_the_hold_limit) {
  FederationConfig f;
  f.every_ms = 30;
  f.overlap = false;
  f.timeout_ms = 300;  // the hold's limit: 2 x 30 + 300 ms
  StuckAllreduce stuck;
  TwoServers two(f, f, {}, [&](uint32_t r, FakeEngine& engine) {
    if (r == 0) stuck.hook(engine);
  });
  push_halves(two.names[0], 1);  // an update, so the next round exchanges a delta
  BOOST_TEST_REQUIRE(stuck.await_reached());
  // Rounds without updates before this one may have held a push too.
  const uint64_t held_before = block_stat(two.names[0], &shm::StatsBlock::fed_pushes_held);
  const auto start = std::chrono::steady_clock::now();
  push_halves(two.names[0], 3);  // held, then served while the round is still stuck
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BOOST_TEST(elapsed >= 0.3, "the pushes took " << elapsed << " s: nothing was held");
  BOOST_TEST(elapsed < 5.0, "the pushes took " << elapsed << " s: held past the limit");
  // The first held, the rest not held again.
  BOOST_TEST(block_stat(two.names[0], &shm::StatsBlock::fed_pushes_held) == held_before + 1);
  BOOST_TEST(pull_weights(two.names[0])[0] == 2.0f);  // 4 pushes of -0.5
  stuck.release();
  // Every push reaches host 1 through the rounds, the one held and the
  // three served during the stuck round alike.
  BOOST_TEST(test::eventually([&] { return pull_weights(two.names[1])[0] == 2.0f; }),
             "host 1 holds " << pull_weights(two.names[1])[0]);
  BOOST_TEST(pull_weights(two.names[0])[0] == 2.0f);
}

// --fed-max-drift 3 on a host whose own timer never fires in the test:
// every fourth push waits for a round that the cap asked for, which the
// other host (a round every 150 ms) joins. Without the hold, 12 pushes take
// milliseconds; with it, at least 3 rounds of the other host's timer.
BOOST_AUTO_TEST_CASE(the_drift_cap_holds_pushes_until_a_round_merges) {
  FederationConfig capped;
  capped.every_ms = 600'000;
  capped.max_drift = 3;
  FederationConfig timer;
  timer.every_ms = 150;
  TwoServers two(capped, timer);
  const auto start = std::chrono::steady_clock::now();
  push_halves(two.names[0], 12);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BOOST_TEST(elapsed >= 0.3, "12 pushes took " << elapsed << " s: the cap held nothing");
  BOOST_TEST(stat(two.names[0], &ServerStats::fed_round) >= 3u);
  BOOST_TEST(stat(two.names[0], &ServerStats::fed_drift) <= 3u);
  BOOST_TEST(block_stat(two.names[0], &shm::StatsBlock::fed_pushes_held) >= 3u);
}

// A checkpoint of an SGD model of one tensor w:4 at `version` (every
// weight `w`), at federation round `round` of host `host`: anchor every
// `anchor`, `unmerged` local updates no round merged; the rounds' record
// is the caller's.
CheckpointData sgd_checkpoint_at_round(uint64_t version, float w, uint64_t round, float anchor, uint64_t unmerged,
                                       uint32_t host) {
  CheckpointData data;
  data.layout.tensors = {{"w", {4}}};
  data.layout.optimizer_kind = static_cast<uint32_t>(kernels::OptimizerKind::kSgd);
  data.version = version;
  data.steps = {version};
  data.weights.assign(4, w);
  data.federation = FederationState{round, false, std::vector<float>(4, anchor), {}, unmerged, {}, 0x5eed, host};
  return data;
}

// A join that keeps the drift keeps it in fed_drift and under the cap:
// host 0 restores a checkpoint of round 5 (version 2, W = 2, A5 = 1: 2
// local updates no round merged), the group's round (host 1 has no
// state), so the join keeps W - A5. Its drift is then 2, not 0, and with
// --fed-max-drift 4 two more pushes are served and the third is held for
// a round (its own timer never fires in the test; host 1's, every
// 150 ms, completes the round the cap asks for).
BOOST_AUTO_TEST_CASE(a_join_that_keeps_the_drift_keeps_it_in_the_drift_and_the_cap) {
  test::TempDir dir0("fedkept0");
  CheckpointData data = sgd_checkpoint_at_round(2, 2.0f, 5, 1.0f, 2, /*host=*/0);
  for (uint64_t k = 1; k <= 5; ++k) data.federation->history.completed(k, 1, 3);
  BOOST_REQUIRE(write_checkpoint(dir0.path.string(), data).ok());
  FederationConfig capped;
  capped.every_ms = 600'000;
  capped.max_drift = 4;
  FederationConfig timer;
  timer.every_ms = 150;
  TwoServers two(capped, timer, {dir0.path.string(), ""});
  const std::string& host0 = two.names[0];
  const auto drift = [&] { return block_stat(host0, &shm::StatsBlock::fed_drift); };
  const auto held = [&] { return block_stat(host0, &shm::StatsBlock::fed_pushes_held); };
  BOOST_TEST(stat(host0, &ServerStats::fed_round) == 5u);
  BOOST_TEST(test::eventually([&] { return drift() == 2u; }), "fed_drift " << drift() << " after the join, not 2");
  push_halves(host0, 2);
  BOOST_TEST(held() == 0u, "a push held below the cap");
  BOOST_TEST(test::eventually([&] { return drift() == 4u; }), "fed_drift " << drift() << ", not 4");
  push_halves(host0, 1);  // at the cap: held until a round merges the 4
  BOOST_TEST(held() == 1u, "the push at the cap was not held");
  BOOST_TEST(stat(host0, &ServerStats::fed_round) == 6u);
  // The round merged W = A5 + 4 x 0.5 at host 0 (host 1 had no update).
  BOOST_TEST(test::eventually([&] { return pull_weights(two.names[1])[0] == 3.0f; }, std::chrono::seconds(3)),
             "host 1 holds " << pull_weights(two.names[1])[0]);
  BOOST_TEST(test::eventually([&] { return drift() == 1u; }, std::chrono::seconds(3)),
             "fed_drift " << drift() << " after the round, not 1");
}

// Without overlap a push that arrives while the round exchanges waits for
// the merge; a pull does not. The test holds host 0's round inside its
// allreduce (the FakeEngine hook) and pushes meanwhile.
BOOST_AUTO_TEST_CASE(without_overlap_a_push_waits_for_the_merge) {
  FederationConfig f;
  f.every_ms = 30;
  f.overlap = false;
  StuckAllreduce stuck;
  TwoServers two(f, f, {}, [&](uint32_t r, FakeEngine& engine) {
    if (r == 0) stuck.hook(engine);
  });
  push_halves(two.names[0], 1);  // an update, so the next round exchanges a delta
  BOOST_TEST_REQUIRE(stuck.await_reached());
  // Host 0 is inside its exchange now: a pull is served, a push waits.
  BOOST_TEST(pull_weights(two.names[0])[0] == 0.5f);
  // The push from a thread of its own, without Boost.Test's macros (not
  // thread-safe): it records whether the push was applied.
  std::atomic<bool> pushed{false};
  std::atomic<bool> push_ok{false};
  std::thread pusher([&] {
    auto w = test::try_connect(two.names[0]);
    auto grad = w ? w->register_buffer(16) : Result<Buffer>(Status{ErrorCode::kInternal, "no worker"});
    if (!grad.ok()) return;
    for (int k = 0; k < 4; ++k) static_cast<float*>(grad->data)[k] = -0.5f;
    push_ok = w->push(0, grad->id, 0, 16, Dtype::kF32, /*worker_version=*/1).ok();
    pushed = true;
  });
  // Held once the server counts it (the thread connects and registers
  // first), and still held a while later.
  BOOST_TEST(test::eventually([&] { return block_stat(two.names[0], &shm::StatsBlock::fed_pushes_held) >= 1u; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  BOOST_TEST(!pushed.load(), "a push was applied while the round exchanged without overlap");
  stuck.release();
  pusher.join();
  BOOST_TEST(pushed.load());
  BOOST_TEST(push_ok.load());
  BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[1])[0] == 1.0f; }));
  BOOST_TEST(pull_weights(two.names[0])[0] == 1.0f);
}

namespace {

// A worker's init of server `name` (all 7s) is refused, its message
// saying `why`.
void expect_init_refused(const std::string& name, const std::string& why) {
  auto w = test::connect(name);
  auto buf = w->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 4, 7.0f);
  const Status init = w->init(buf->id, 0);
  BOOST_TEST((init.code() == ErrorCode::kInitRefused), init.to_string());
  BOOST_TEST(init.message().find(why) != std::string::npos, init.message());
}

}  // namespace

// Once its group merged a round (the join's included), a host refuses a
// worker's init: the next round would average it into every host's
// weights (a Python RemoteOptimizer(init=True) on each host would).
BOOST_AUTO_TEST_CASE(an_init_after_the_join_is_refused) {
  FederationConfig f;
  f.every_ms = 30;
  TwoServers two(f, f);
  BOOST_TEST_REQUIRE(test::eventually([&] { return stat(two.names[1], &ServerStats::fed_round) >= 1; }));
  expect_init_refused(two.names[1], "the weights are the federation's");
  BOOST_TEST(pull_weights(two.names[1])[0] == 0.0f);  // unchanged
}

// An init that arrives while the join is under way (its snapshot taken,
// the join's first collective waiting for a slower host, as an MPI
// allgather does for the slowest rank) is refused as one after it: the
// join's merge would otherwise carry it into host 1's weights, and the
// rounds into every host's. Rank 0's weights (zeros) stay everybody's.
BOOST_AUTO_TEST_CASE(an_init_while_the_join_is_under_way_is_refused) {
  FederationConfig f;
  f.every_ms = 30;
  std::mutex mu;
  std::condition_variable cv;
  bool reached = false, released = false;
  int calls = 0;
  TwoServers two(
      f, f, {},
      [&](uint32_t r, FakeEngine& e) {
        if (r != 1) return;
        e.before_allgather = [&] {  // host 1's join: held after its snapshot
          std::unique_lock lock(mu);
          if (++calls != 1) return;
          reached = true;
          cv.notify_all();
          cv.wait(lock, [&] { return released; });
        };
      },
      /*await_join=*/false);
  {
    std::unique_lock lock(mu);
    BOOST_TEST_REQUIRE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return reached; }));
  }
  auto w = test::connect(two.names[1]);
  auto buf = w->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 4, 7.0f);
  const Status init = w->init(buf->id, 0);
  {
    std::lock_guard lock(mu);
    released = true;
  }
  cv.notify_all();
  BOOST_TEST((init.code() == ErrorCode::kInitRefused), init.to_string());
  BOOST_TEST(init.message().find("join is under way") != std::string::npos, init.message());
  BOOST_TEST_REQUIRE(test::eventually([&] { return stat(two.names[1], &ServerStats::fed_round) >= 2; }));
  BOOST_TEST(pull_weights(two.names[0])[0] == 0.0f);
  BOOST_TEST(pull_weights(two.names[1])[0] == 0.0f);
}

// A join that fails for good before any merge (the hosts serve other
// models: federation ends at both) leaves each host's weights its own, so
// an init is taken: no group's anchor will replace them.
BOOST_AUTO_TEST_CASE(an_init_after_a_join_that_ended_federation_is_taken) {
  FederationConfig f;
  f.every_ms = 30;
  TwoServers two(f, f, {}, nullptr, /*await_join=*/false, [](uint32_t r, ServerConfig& c) {
    if (r == 1) c.tensors = {{"w", {8}}};
  });
  for (const std::string& name : two.names)
    BOOST_TEST_REQUIRE(test::eventually([&] {
      return block_stat(name, &shm::StatsBlock::fed_state) == static_cast<uint64_t>(shm::FederationState::kEnded);
    }));
  auto w = test::connect(two.names[0]);
  auto buf = w->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 4, 7.0f);
  const Status init = w->init(buf->id, 0);
  BOOST_TEST(init.ok(), init.to_string());
  BOOST_TEST(pull_weights(two.names[0])[0] == 7.0f);
}

// A server that stops announces its leave: the other ends federation
// (0 members in its stats) and keeps serving its workers alone.
BOOST_AUTO_TEST_CASE(a_stopping_server_leaves_and_the_other_serves_alone) {
  FederationConfig f;
  f.every_ms = 30;
  TwoServers two(f, f);
  BOOST_TEST_REQUIRE(test::eventually([&] { return stat(two.names[0], &ServerStats::fed_members) == 2; }));
  BOOST_TEST(block_stat(two.names[0], &shm::StatsBlock::fed_state) ==
             static_cast<uint64_t>(shm::FederationState::kInGroup));
  const auto start = std::chrono::steady_clock::now();
  two.servers[1]->stop();  // checks that run() returned ok
  const double stop_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BOOST_TEST(stop_s < 5.0, "the stop took " << stop_s << " s");
  BOOST_TEST_REQUIRE(test::eventually([&] { return stat(two.names[0], &ServerStats::fed_members) == 0; }));
  // A static engine cannot re-form: ended, as shmps-inspect then says.
  BOOST_TEST(block_stat(two.names[0], &shm::StatsBlock::fed_state) ==
             static_cast<uint64_t>(shm::FederationState::kEnded));
  push_halves(two.names[0], 2);
  BOOST_TEST(pull_weights(two.names[0])[0] == 1.0f);
  BOOST_TEST(stat(two.names[0], &ServerStats::fed_failures) == 0u);
}

// A host whose weights changed only through merges still checkpoints them
// at stop, over the file of that version already on disk (the version did
// not move, the weights did).
BOOST_AUTO_TEST_CASE(weights_changed_only_by_merges_are_checkpointed) {
  test::TempDir dir("fedckpt");
  FederationConfig f;
  f.every_ms = 20;
  { TwoServers first(f, f, {"", dir.path.string()}); }  // host 1 leaves a checkpoint of version 0 (zeros)
  BOOST_TEST_REQUIRE(list_checkpoints(dir.path.string()).value().size() == 1u);
  TwoServers two(f, f, {"", dir.path.string()});  // host 1 restores it
  push_halves(two.names[0], 4);
  BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[1])[0] == 2.0f; }));
  two.servers[1]->stop();
  const std::vector<std::string> files = list_checkpoints(dir.path.string()).value();
  BOOST_TEST_REQUIRE(files.size() >= 1u);
  CheckpointLayout layout;
  layout.tensors = {{"w", {4}}};
  layout.optimizer_kind = static_cast<uint32_t>(kernels::OptimizerKind::kSgd);
  layout.state_arrays = 0;
  auto data = read_checkpoint(files.front(), layout);
  BOOST_TEST_REQUIRE(data.ok(), data.status().to_string());
  BOOST_TEST(data->version == 0u);
  for (float w : data->weights) BOOST_TEST(w == 2.0f);
}

// A round that hangs in its exchange (a peer hung: MPI keeps it open for
// good) defers the periodic checkpoints, since the federation's state does
// not match the weights until it merges: each interval they wait is
// counted in checkpoints_deferred (and logged), not skipped unseen; once
// the round merges, the next checkpoint goes through.
BOOST_AUTO_TEST_CASE(checkpoints_deferred_by_a_hung_round_are_counted) {
  test::TempDir dir("fedhung");
  FederationConfig f;
  f.every_ms = 30;
  std::mutex mu;
  std::condition_variable cv;
  bool armed = true, reached = false, released = false;
  TwoServers two(
      f, f, {dir.path.string(), ""},
      [&](uint32_t r, FakeEngine& e) {
        if (r != 0) return;
        e.before_allreduce = [&] {  // host 0's first round with updates: held in its exchange
          std::unique_lock lock(mu);
          if (!armed) return;
          armed = false;
          reached = true;
          cv.notify_all();
          cv.wait(lock, [&] { return released; });
        };
      },
      /*await_join=*/false, [](uint32_t r, ServerConfig& c) { c.checkpoint_interval_s = r == 0 ? 1 : 0; });
  const auto release = [&] {
    {
      std::lock_guard lock(mu);
      released = true;
    }
    cv.notify_all();
  };
  push_halves(two.names[0], 1);
  {
    std::unique_lock lock(mu);
    BOOST_TEST_REQUIRE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return reached; }));
  }
  const uint64_t written = block_stat(two.names[0], &shm::StatsBlock::checkpoints_written);
  // Pushes are served meanwhile (overlap); 1 s interval: due within about
  // a second, then counted again after each further second it waits.
  for (int k = 0; k < 25; ++k) {
    push_halves(two.names[0], 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const uint64_t deferred = block_stat(two.names[0], &shm::StatsBlock::checkpoints_deferred);
  const uint64_t written_hung = block_stat(two.names[0], &shm::StatsBlock::checkpoints_written);
  release();
  BOOST_TEST(written_hung == written);  // none while the round hangs
  BOOST_TEST(deferred >= 2u, "checkpoints deferred: " << deferred);
  BOOST_TEST(
      test::eventually([&] { return block_stat(two.names[0], &shm::StatsBlock::checkpoints_written) > written_hung; }));
}

// A federated host that restores a checkpoint without federation state (a
// job that ran without federation) has its weights replaced at the join,
// here by rank 0's: the join says so, naming the file, and no checkpoint
// of that version is written over it (the merge changed the weights, so
// the final checkpoint would have been); after a push, the next version's
// checkpoint goes to a file of its own, with the federation's state.
BOOST_AUTO_TEST_CASE(a_checkpoint_without_federation_state_is_not_written_over) {
  test::TempDir dir("fedunf"), logs("fedunflog");
  CheckpointData trained;
  trained.version = 5;
  trained.layout.tensors = {{"w", {4}}};
  trained.layout.optimizer_kind = static_cast<uint32_t>(kernels::OptimizerKind::kSgd);
  trained.steps = {5};
  trained.weights.assign(4, 7.0f);
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), trained).ok());
  const std::string file = list_checkpoints(dir.path.string()).value().front();
  const std::string before = test::read_file(file);
  FederationConfig f;
  f.every_ms = 20;
  const std::string log_path = (logs.path / "stderr").string();
  for (const int pushes : {0, 1}) {
    BOOST_TEST_CONTEXT("pushes " << pushes) {
      {
        test::StderrTo capture(log_path);
        TwoServers two(f, f, {"", dir.path.string()});  // host 1 restores version 5
        BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[1])[0] == 0.0f; }));
        if (pushes > 0) push_halves(two.names[1], pushes);
        two.servers[1]->stop();
      }
      const std::string log = test::read_file(log_path);
      BOOST_TEST(log.find("federation: the weights restored from " + file +
                          ", a checkpoint without federation state (a run without federation), were replaced by "
                          "the join with rank 0's weights") != std::string::npos,
                 log);
      BOOST_TEST(test::read_file(file) == before);
    }
  }
  const std::vector<std::string> files = list_checkpoints(dir.path.string()).value();
  BOOST_TEST_REQUIRE(files.size() == 2u);
  auto next = read_checkpoint(files.front(), trained.layout);
  BOOST_TEST_REQUIRE(next.ok(), next.status().to_string());
  BOOST_TEST(next->version == 6u);
  BOOST_TEST(next->federation.has_value());
}

// Checkpoints carry the federation's state: after a run, both hosts'
// final checkpoints hold the same anchor and round as of their weights. A
// restart where host 0 lost its checkpoints (a new machine) resumes from
// host 1's: host 1 keeps its weights and round, host 0 takes them; with
// the join of a fresh start, host 0's zeros would have become everybody's.
BOOST_AUTO_TEST_CASE(a_restart_resumes_the_rounds_from_the_checkpointed_anchor) {
  test::TempDir dir0("fedck0"), dir1("fedck1");
  FederationConfig f;
  f.every_ms = 20;
  CheckpointLayout layout;
  layout.tensors = {{"w", {4}}};
  layout.optimizer_kind = static_cast<uint32_t>(kernels::OptimizerKind::kSgd);
  std::vector<FederationState> stored;
  {
    TwoServers first(f, f, {dir0.path.string(), dir1.path.string()});
    push_halves(first.names[0], 4);
    BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(first.names[1])[0] == 2.0f; }));
  }
  for (const test::TempDir* dir : {&dir0, &dir1}) {
    const std::vector<std::string> files = list_checkpoints(dir->path.string()).value();
    BOOST_TEST_REQUIRE(files.size() >= 1u);
    auto data = read_checkpoint(files.front(), layout);
    BOOST_TEST_REQUIRE(data.ok(), data.status().to_string());
    BOOST_TEST_REQUIRE(data->federation.has_value());
    BOOST_TEST(data->federation->round >= 1u);
    BOOST_TEST(data->federation->anchor == data->weights);  // merged, no push since: W = A
    BOOST_TEST(data->federation->momentum.empty());         // the average outer step keeps none
    stored.push_back(*data->federation);
  }
  BOOST_TEST(stored[0].anchor == stored[1].anchor);
  std::filesystem::remove_all(dir0.path);
  std::filesystem::create_directories(dir0.path);
  TwoServers second(f, f, {dir0.path.string(), dir1.path.string()});
  BOOST_TEST_REQUIRE(
      test::eventually([&] { return stat(second.names[0], &ServerStats::fed_round) > stored[1].round; }));
  for (int k = 0; k < 4; ++k) {
    BOOST_TEST(pull_weights(second.names[0])[k] == 2.0f);
    BOOST_TEST(pull_weights(second.names[1])[k] == 2.0f);
  }
  BOOST_TEST(stat(second.names[0], &ServerStats::fed_anchor_hash) ==
             stat(second.names[1], &ServerStats::fed_anchor_hash));
}

// Host 0's checkpoint of round 7 (W = A7 = 2; rounds 6 and 7 completed
// by a group with host 1 in it when `member`, else without it) in dir0,
// host 1's of round 5 (version 0, A5 = 1, W_ckpt = 1.5, 3 local updates
// unmerged) in dir1.
void write_rounds_5_and_7(const std::string& dir0, const std::string& dir1, bool member) {
  CheckpointData data = sgd_checkpoint_at_round(10, 2.0f, 7, 2.0f, 0, /*host=*/0);
  for (uint64_t k = 1; k <= 7; ++k) data.federation->history.completed(k, k <= 5 ? 1 : 2, k <= 5 || member ? 3 : 1);
  BOOST_REQUIRE(write_checkpoint(dir0, data).ok());
  data = sgd_checkpoint_at_round(0, 1.5f, 5, 1.0f, 3, /*host=*/1);
  for (uint64_t k = 1; k <= 5; ++k) data.federation->history.completed(k, 1, 3);
  BOOST_REQUIRE(write_checkpoint(dir1, data).ok());
}

// The same through whole servers, from checkpoint files: host 0 at round
// 7 (W = A7 = 2), host 1 restored at round 5 (A5 = 1, W_ckpt = 1.5, 3
// local updates unmerged), pushing 1.0 more (two pushes of SGD lr 1)
// before the snapshot of its join (a first attempt, whose snapshot came
// before them, fails once they are in). Host 0's record shows rounds 6 and 7
// completed by a group with host 1 in it (its drift is in A7: W = A7 + U =
// 3, its 2 pushes weighing its delta), or without it (rebased: W = A7 +
// (W - A5) = 3.5, its 5 updates weighing it); the rounds after make it
// host 0's too. Host 1's checkpoint is of version 0 (merged rounds, no
// push): a worker's init is refused all the same, the weights being the
// federation's.
BOOST_AUTO_TEST_CASE(a_restarted_server_keeps_what_no_round_merged) {
  for (const bool member : {true, false}) {
    BOOST_TEST_CONTEXT("host 1 in rounds 6 and 7: " << member) {
      test::TempDir dir0("fedold0"), dir1("fedold1");
      write_rounds_5_and_7(dir0.path.string(), dir1.path.string(), member);
      // Host 1's first join waits in its first collective until the pushes
      // are in, then fails: its engine, elastic until then, re-forms, and
      // the next join's snapshot holds them.
      std::mutex mu;
      std::condition_variable cv;
      bool pushed = false;
      int allgathers = 0;
      FederationConfig f;
      f.every_ms = 20;
      TwoServers two(
          f, f, {dir0.path.string(), dir1.path.string()},
          [&](uint32_t r, FakeEngine& engine) {
            if (r != 1) return;
            engine.is_elastic = true;
            engine.before_allgather = [&] {
              std::unique_lock lock(mu);
              // Once re-formed, as host 0 is: at host 0's leave at stop, it
              // ends instead of waiting in a new join for a host gone.
              if (++allgathers != 1) {
                engine.is_elastic = false;
                return;
              }
              cv.wait(lock, [&] { return pushed; });
              engine.fail_now = true;
            };
          },
          /*await_join=*/false);
      expect_init_refused(two.names[1], "already initialised by the federation state of checkpoint");
      push_halves(two.names[1], 2);
      {
        std::lock_guard lock(mu);
        pushed = true;
      }
      cv.notify_all();
      const float want = member ? 3.0f : 3.5f;
      BOOST_TEST(test::eventually([&] { return pull_weights(two.names[0])[0] == want; }),
                 "host 0 holds " << pull_weights(two.names[0])[0] << ", not " << want);
      BOOST_TEST(test::eventually([&] { return pull_weights(two.names[1])[0] == want; }),
                 "host 1 holds " << pull_weights(two.names[1])[0] << ", not " << want);
    }
  }
}

// As above, with a restart between host 1's restore and its join: host 1
// restores round 5 (W_ckpt = 1.5), its federation ends before a join (its
// first collective fails), it takes two pushes (W = 2.5) and stops,
// writing a checkpoint of round 5's state at W = 2.5 that also holds the
// restore base W_ckpt and its 3 updates. Restarted from that file, its
// join keeps the 2 pushes in both cases: W = A7 + 1 = 3 as a member (without
// the base, W = A7 + (W - 2.5) = 2 would drop them), W = A7 + (W - A5) =
// 3.5 rebased.
BOOST_AUTO_TEST_CASE(a_checkpoint_between_a_restore_and_the_join_keeps_the_restore_base) {
  for (const bool member : {true, false}) {
    BOOST_TEST_CONTEXT("host 1 in rounds 6 and 7: " << member) {
      test::TempDir dir0("fedbase0"), dir1("fedbase1");
      write_rounds_5_and_7(dir0.path.string(), dir1.path.string(), member);
      FederationConfig f;
      f.every_ms = 20;
      {
        auto engine = std::make_unique<FakeEngine>(std::make_shared<FakeGroup>(2), 1);
        engine->fail_at = 1;  // the join's first collective: over (the engine is not elastic)
        const ServerConfig c = federated_config(1, f, dir1.path.string());
        test::InProcessServer alone(c, std::move(engine));
        BOOST_TEST_REQUIRE(test::eventually([&] {
          return block_stat(c.name, &shm::StatsBlock::fed_state) == static_cast<uint64_t>(shm::FederationState::kEnded);
        }));
        push_halves(c.name, 2);
      }
      CheckpointLayout layout;
      layout.tensors = {{"w", {4}}};
      layout.optimizer_kind = static_cast<uint32_t>(kernels::OptimizerKind::kSgd);
      const std::vector<std::string> files = list_checkpoints(dir1.path.string()).value();
      BOOST_TEST_REQUIRE(files.size() == 2u);
      auto written = read_checkpoint(files.front(), layout);  // the newest
      BOOST_TEST_REQUIRE(written.ok(), written.status().to_string());
      BOOST_TEST(written->version == 2u);
      BOOST_TEST(written->weights == std::vector<float>(4, 2.5f));
      BOOST_TEST_REQUIRE(written->federation.has_value());
      BOOST_TEST(written->federation->round == 5u);
      BOOST_TEST(written->federation->restore_base == std::vector<float>(4, 1.5f));
      BOOST_TEST(written->federation->restore_base_updates == 3u);
      BOOST_TEST(written->federation->unmerged_updates == 5u);

      TwoServers two(f, f, {dir0.path.string(), dir1.path.string()});
      const float want = member ? 3.0f : 3.5f;
      BOOST_TEST(test::eventually([&] { return pull_weights(two.names[1])[0] == want; }),
                 "host 1 holds " << pull_weights(two.names[1])[0] << ", not " << want);
      BOOST_TEST(test::eventually([&] { return pull_weights(two.names[0])[0] == want; }),
                 "host 0 holds " << pull_weights(two.names[0])[0] << ", not " << want);
    }
  }
}

// Two servers over an elastic engine. Host 1's pushes land while its
// federation thread waits before a round's headers (after that round's
// snapshot); then its engine sees a host waiting to join, so the next
// round, whose snapshot holds those pushes, is dropped by both and the
// group re-forms (the next epoch) and joins again. The dropped round's
// updates count in the round after: host 0 gets them (were they counted
// as none, no host would have updates, and host 1's W would go back to
// the anchor). No failure counted; pushes after the regroup go through.
BOOST_AUTO_TEST_CASE(an_elastic_group_regroups_and_keeps_every_push) {
  FederationConfig f;
  f.every_ms = 20;
  std::mutex mu;
  std::condition_variable cv;
  bool armed = false, reached = false, pushed = false;
  TwoServers two(f, f, {}, [&](uint32_t r, FakeEngine& engine) {
    engine.is_elastic = true;
    if (r != 1) return;
    engine.before_allgather = [&mu, &cv, &armed, &reached, &pushed, e = &engine] {
      std::unique_lock lock(mu);
      if (!armed) return;
      armed = false;
      reached = true;
      cv.notify_all();
      cv.wait(lock, [&] { return pushed; });
      e->joiner = true;  // seen at the next round's headers
    };
  });
  push_halves(two.names[0], 4);
  BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[1])[0] == 2.0f; }));
  const uint64_t epoch = block_stat(two.names[0], &shm::StatsBlock::fed_epoch);
  {
    std::unique_lock lock(mu);
    armed = true;
    BOOST_TEST_REQUIRE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return reached; }));
  }
  push_halves(two.names[1], 4);  // applied while host 1's thread waits
  {
    std::lock_guard lock(mu);
    pushed = true;
  }
  cv.notify_all();
  BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[0])[0] == 4.0f; }),
                     "host 0 " << pull_weights(two.names[0])[0] << ", host 1 " << pull_weights(two.names[1])[0]);
  BOOST_TEST(block_stat(two.names[0], &shm::StatsBlock::fed_epoch) > epoch);  // it did re-form
  BOOST_TEST(block_stat(two.names[1], &shm::StatsBlock::fed_epoch) > epoch);
  push_halves(two.names[0], 2);
  BOOST_TEST_REQUIRE(test::eventually([&] { return pull_weights(two.names[1])[0] == 5.0f; }));
  BOOST_TEST(pull_weights(two.names[0])[0] == 5.0f);
  BOOST_TEST(stat(two.names[0], &ServerStats::fed_members) == 2u);
  BOOST_TEST(stat(two.names[0], &ServerStats::fed_failures) == 0u);
  BOOST_TEST(stat(two.names[0], &ServerStats::fed_anchor_hash) == stat(two.names[1], &ServerStats::fed_anchor_hash));
  // The fake cannot wait for a host that left: static again for the stop.
  for (FakeEngine* e : two.engines) e->is_elastic = false;
}

// A host whose tries to form a group keep failing logs the first failure,
// then again once 5 s have passed, with the count and the newest try's
// reason (each try's reason names its attempt, so a host that cycled
// through failed tries would otherwise say nothing after its first line),
// and not on every try; it joins once a try succeeds.
BOOST_AUTO_TEST_CASE(a_failure_to_form_a_group_that_repeats_is_logged_again) {
  test::TempDir logs("fedrepeat");
  const std::string log_path = (logs.path / "stderr").string();
  FederationConfig f;
  f.every_ms = 20;
  uint64_t tries = 0;
  {
    test::StderrTo capture(log_path);
    TwoServers two(
        f, f, {},
        [](uint32_t r, FakeEngine& engine) {
          engine.is_elastic = r == 0;
          engine.reform_fails = r == 0;
        },
        /*await_join=*/false);
    FakeEngine& failing = *two.engines[0];
    BOOST_TEST_REQUIRE(
        test::eventually([&] { return test::read_file(log_path).find("still no group") != std::string::npos; },
                         std::chrono::seconds(30)));
    failing.reform_fails = false;
    tries = failing.reform_tries;
    BOOST_TEST_REQUIRE(test::eventually([&] {
      return block_stat(two.names[0], &shm::StatsBlock::fed_members) == 2 &&
             block_stat(two.names[1], &shm::StatsBlock::fed_members) == 2;
    }));
    failing.is_elastic = false;  // static for the stop, as above
  }
  const std::string log = test::read_file(log_path);
  BOOST_TEST(log.find("federation (fake): try 1 formed no group; trying again") != std::string::npos, log);
  // The repeat: its count of tries and seconds since the first failure.
  const std::string said = "formed no group; still no group after ";
  const size_t repeat = log.find(said);
  BOOST_TEST_REQUIRE(repeat != std::string::npos, log);
  unsigned long counted = 0, seconds = 0;
  BOOST_TEST_REQUIRE(std::sscanf(log.c_str() + repeat + said.size(), "%lu tries in %lu s", &counted, &seconds) == 2,
                     log);
  BOOST_TEST(counted >= 2u);
  BOOST_TEST(seconds >= 5u);
  // Lines at the first failure and at the repeats, not one a try (a try
  // every 50 ms).
  size_t lines = 0;
  for (size_t at = log.find("formed no group"); at != std::string::npos; at = log.find("formed no group", at + 1))
    ++lines;
  BOOST_TEST(lines >= 2u, log);
  BOOST_TEST(lines < tries, "lines " << lines << ", tries " << tries);
}

namespace {

// This process's threads' (nice value, scheduling policy), from
// /proc/self/task/*/stat (fields 19 and 41, counted after the command).
std::vector<std::pair<int, int>> thread_priorities() {
  std::vector<std::pair<int, int>> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "stat");
    std::string line;
    if (!std::getline(in, line) || line.rfind(')') == std::string::npos) continue;  // a thread that just ended
    std::istringstream fields(line.substr(line.rfind(')') + 2));                    // from field 3, the state
    std::vector<std::string> f{std::istream_iterator<std::string>(fields), std::istream_iterator<std::string>()};
    if (f.size() >= 39) out.emplace_back(std::stoi(f[16]), std::stoi(f[38]));
  }
  return out;
}

// This process's threads under SCHED_IDLE, and at nice 19 under SCHED_OTHER.
long threads_where(bool (*pick)(std::pair<int, int>)) {
  const auto all = thread_priorities();
  return std::count_if(all.begin(), all.end(), pick);
}
long idle_threads() {
  return threads_where([](std::pair<int, int> t) { return t.second == SCHED_IDLE; });
}
long low_threads() {
  return threads_where([](std::pair<int, int> t) { return t.first == 19 && t.second == SCHED_OTHER; });
}

// The test counts threads under SCHED_IDLE, and SCHED_OTHER ones at nice
// 19: run under another policy or at nice 19, it could not tell a lowered
// thread from the others.
boost::test_tools::assertion_result runs_at_normal_priority(boost::unit_test::test_unit_id) {
  const int policy = ::sched_getscheduler(0);
  const int nice = ::getpriority(PRIO_PROCESS, 0);
  boost::test_tools::assertion_result r(policy == SCHED_OTHER && nice < 19);
  r.message() << "this test runs under scheduling policy " << policy << " at nice " << nice
              << ", so a lowered thread would look like the others";
  return r;
}

}  // namespace

// --fed-priority lowers the federation thread, and only it: one thread at
// SCHED_IDLE for the idle server, one at nice 19 for the low one, none
// for normal ones (the engines' own threads: multihost_gloo_priority).
BOOST_AUTO_TEST_CASE(the_federation_thread_runs_at_its_priority,
                     *boost::unit_test::precondition(runs_at_normal_priority)) {
  {
    FederationConfig idle, low;
    idle.priority = FederationPriority::kIdle;
    low.priority = FederationPriority::kLow;
    TwoServers two(idle, low);
    BOOST_TEST(idle_threads() == 1);
    BOOST_TEST(low_threads() == 1);
  }
  TwoServers normal(FederationConfig{}, FederationConfig{});
  BOOST_TEST(idle_threads() == 0);
  BOOST_TEST(low_threads() == 0);
}

// --fed-cpus places the round loop (and what it starts), and only it: the
// placed server's thread named shmps-fed runs on its CPU, the other's and
// every other thread where the process runs.
BOOST_AUTO_TEST_CASE(the_federation_thread_runs_on_its_cpus) {
  const std::vector<uint32_t> all = thread_cpus();
  if (all.size() < 2) {
    BOOST_TEST_MESSAGE("skipped: this process may run on one CPU only, so a placed thread looks like the others");
    return;
  }
  FederationConfig placed;
  placed.cpus = {all.back()};
  TwoServers two(placed, FederationConfig{});
  // Each thread's name (/proc/self/task/TID/comm) and CPUs.
  std::multiset<std::pair<std::string, std::vector<uint32_t>>> threads;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    const std::vector<uint32_t> cpus = thread_cpus(std::stoi(task.path().filename().string()));
    if (!std::getline(comm, name) || cpus.empty()) continue;  // a thread that just ended
    threads.emplace(name, cpus);
  }
  BOOST_TEST(threads.count({"shmps-fed", {all.back()}}) == 1);
  BOOST_TEST(threads.count({"shmps-fed", all}) == 1);
  BOOST_TEST(std::count_if(threads.begin(), threads.end(), [&](const auto& t) { return t.second != all; }) == 1,
             "no other thread moved");
}

// The federation thread blocks the stop and reload signals (the server's
// helper threads all do: test_service_config).
BOOST_AUTO_TEST_CASE(the_federation_thread_blocks_the_stop_and_reload_signals) {
  TwoServers two(FederationConfig{}, FederationConfig{});
  const std::vector<bool> blocked = test::stop_signals_blocked("shmps-fed");
  BOOST_TEST(blocked.size() == 2u);
  for (bool b : blocked) BOOST_TEST(b);
}

// An engine's I/O thread (Gloo's) is lowered as the federation thread is,
// and then under SCHED_BATCH, unless that made it SCHED_IDLE: it never
// preempts the federation thread as it wakes.
BOOST_AUTO_TEST_CASE(an_engines_io_thread_is_lowered_and_never_preempts_on_wake_up,
                     *boost::unit_test::precondition(runs_at_normal_priority)) {
  const auto scheduled = [](FederationPriority priority) {
    std::pair<int, int> nice_and_policy{-100, -1};
    std::string why;
    std::thread([&] {
      why = lower_io_thread_priority(priority);
      nice_and_policy = {::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid())), ::sched_getscheduler(0)};
    }).join();
    BOOST_TEST(why == "");
    return nice_and_policy;
  };
  const int nice = ::getpriority(PRIO_PROCESS, 0);
  BOOST_TEST((scheduled(FederationPriority::kNormal) == std::pair{nice, SCHED_BATCH}));
  BOOST_TEST((scheduled(FederationPriority::kLow) == std::pair{19, SCHED_BATCH}));
  BOOST_TEST(scheduled(FederationPriority::kIdle).second == SCHED_IDLE);
}

// pin_this_thread places the calling thread on the listed CPUs the kernel
// lets it have, and the threads it starts inherit them; a list without a
// usable CPU is refused with the reason, and an empty one changes nothing.
BOOST_AUTO_TEST_CASE(a_pinned_thread_and_its_children_run_on_its_cpus) {
  const std::vector<uint32_t> all = thread_cpus();
  BOOST_TEST_REQUIRE(!all.empty());
  // A CPU this process may not use, if any below kMaxCpus.
  std::optional<uint32_t> unusable;
  for (uint32_t c = kMaxCpus; c-- > 0 && !unusable;)
    if (!std::binary_search(all.begin(), all.end(), c)) unusable = c;
  std::thread([&] {
    BOOST_TEST(pin_this_thread({}) == "");
    BOOST_TEST((thread_cpus() == all), "an empty list leaves the thread where it was");
    std::vector<uint32_t> one{all.back()};
    if (unusable) one.push_back(*unusable);
    std::sort(one.begin(), one.end());
    BOOST_TEST(pin_this_thread(one) == "");
    BOOST_TEST((thread_cpus() == std::vector<uint32_t>{all.back()}), "the usable CPUs of the list");
    std::vector<uint32_t> childs;
    std::thread([&] { childs = thread_cpus(); }).join();
    BOOST_TEST((childs == std::vector<uint32_t>{all.back()}), "a thread it starts inherits them");
    if (unusable) {
      const std::string why = pin_this_thread({*unusable});
      BOOST_TEST(why.find("sched_setaffinity: ") == 0, why);
      BOOST_TEST((thread_cpus() == std::vector<uint32_t>{all.back()}), "a refused list changes nothing");
    }
  }).join();
  BOOST_TEST((thread_cpus() == all), "the caller's own CPUs stay");
}

// --fed-cpus lists CPUs as taskset does, and the effective configuration
// (--check-config) writes them back in the same form, ranges folded.
BOOST_AUTO_TEST_CASE(cpu_lists_read_and_write_as_taskset_does) {
  const std::vector<std::pair<std::string, std::string>> lists = {
      {"3", "3"}, {"0,2-5", "0,2-5"}, {"5,4,3", "3-5"}, {"0-0,7,1-2", "0-2,7"}, {"1023", "1023"}};
  for (const auto& [text, written] : lists) {
    std::vector<uint32_t> cpus{99};
    BOOST_TEST_REQUIRE(parse_cpu_list(text, &cpus), text);
    BOOST_TEST(cpu_list_text(cpus) == written, text);
  }
  std::vector<uint32_t> cpus{4};
  for (const char* bad : {"", ",", "1,,2", "2-", "-2", "a", "1024", "0-1024", "99999999999"})
    BOOST_TEST(!parse_cpu_list(bad, &cpus), bad);
  BOOST_TEST((cpus == std::vector<uint32_t>{4}), "a refused list leaves the output alone");
  BOOST_TEST(cpu_list_text({}) == "");
}

BOOST_AUTO_TEST_CASE(federation_options_are_parsed_and_bad_values_refused) {
  auto ok =
      test::parse_server_args({"--name", "x", "--tensor", "w:4", "--federation", "mpi", "--fed-outer", "nesterov",
                               "--fed-every-ms", "40", "--fed-max-drift", "9", "--fed-no-overlap", "--fed-unweighted",
                               "--fed-rank-in-name", "--fed-priority", "idle", "--fed-cpus", "5,0-2,2"});
  BOOST_TEST_REQUIRE(ok.ok(), ok.status().to_string());
  const FederationConfig& f = ok->config.federation;
  BOOST_TEST((f.kind == FederationKind::kMpi));
  BOOST_TEST((f.outer == OuterStep::kNesterov));
  BOOST_TEST(f.every_ms == 40u);
  BOOST_TEST(f.max_drift == 9u);
  BOOST_TEST(!f.overlap);
  BOOST_TEST(!f.weight_by_updates);
  BOOST_TEST(f.rank_in_name);
  BOOST_TEST((f.priority == FederationPriority::kIdle));
  BOOST_TEST((f.cpus == std::vector<uint32_t>{0, 1, 2, 5}));
  auto unplaced = test::parse_server_args({"--name", "x", "--tensor", "w:4", "--federation", "mpi", "--fed-cpus", ""});
  BOOST_TEST_REQUIRE(unplaced.ok(), unplaced.status().to_string());
  BOOST_TEST(unplaced->config.federation.cpus.empty(), "an empty --fed-cpus is the default: the server's CPUs");
  // What rank 7 runs as, at start and for each reload alike.
  ServerConfig c = ok->config;
  c.checkpoint_dir = "/var/lib/shmps/x";
  apply_rank_in_name(c, 7);
  BOOST_TEST(c.name == "x.r7");
  BOOST_TEST(c.checkpoint_dir == "/var/lib/shmps/x/r7");
  auto gloo = test::parse_server_args({"--name", "x", "--tensor", "w:4", "--federation", "gloo", "--fed-store",
                                       "redis:db.example:6380/job7", "--fed-hosts", "5", "--fed-host", "4",
                                       "--fed-address", "10.0.0.4", "--fed-timeout-ms", "1500"});
  BOOST_TEST_REQUIRE(gloo.ok(), gloo.status().to_string());
  const FederationConfig& g = gloo->config.federation;
  BOOST_TEST((g.kind == FederationKind::kGloo));
  BOOST_TEST(g.store == "redis:db.example:6380/job7");
  BOOST_TEST(g.hosts == 5u);
  BOOST_TEST(g.host == 4u);
  BOOST_TEST(g.address == "10.0.0.4");
  BOOST_TEST(g.timeout_ms == 1500u);
  const std::vector<std::string> gloo_base = {"--federation", "gloo", "--fed-store", "file:/tmp/x"};
  const auto with_gloo = [&](std::vector<std::string> more) {
    more.insert(more.begin(), gloo_base.begin(), gloo_base.end());
    return more;
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--federation", "gloo", "--fed-hosts", "3"}, "--federation gloo needs --fed-store"},
      {with_gloo({}), "--federation gloo needs --fed-hosts in 1..64, got 0"},
      {with_gloo({"--fed-hosts", "65"}), "--federation gloo needs --fed-hosts in 1..64, got 65"},
      {with_gloo({"--fed-hosts", "3", "--fed-host", "3"}), "--fed-host must be below --fed-hosts (3), got 3"},
      {with_gloo({"--fed-hosts", "3", "--fed-timeout-ms", "5"}), "--fed-timeout-ms must be in 100..3600000"},
      {{"--federation", "tcp"}, "--federation must be none, mpi or gloo"},
      {{"--fed-outer", "adam"}, "--fed-outer must be average or nesterov"},
      {{"--federation", "mpi", "--fed-every-ms", "0"}, "--fed-every-ms must be in 1..3600000"},
      {{"--federation", "mpi", "--fed-outer", "nesterov", "--fed-outer-momentum", "1"},
       "--fed-outer-momentum must be in [0, 1)"},
      {{"--federation", "mpi", "--fed-outer", "nesterov", "--fed-outer-lr", "-1"},
       "--fed-outer-lr must be finite and > 0"},
      {{"--fed-priority", "high"}, "--fed-priority must be normal, low or idle, got 'high'"},
      {{"--fed-cpus", "3-1"}, "--fed-cpus must list CPUs below 1024 as taskset does (3, 0,2-5), got '3-1'"},
      {{"--fed-cpus", "1024"}, "got '1024'"},
      {{"--fed-cpus", "1,"}, "got '1,'"},
      {{"--fed-cpus", "-1"}, "got '-1'"},
      {{"--fed-cpus", "0x1"}, "got '0x1'"},
      {{"--fed-cpus", "1 2"}, "got '1 2'"},
  };
  // --fed-store's form is checked with the rest (--check-config, a
  // reload), not only when the Gloo plugin opens it at start.
  for (const std::string store : {"bogus", "file:", "redis:", "redis::6379", "redis:h:", "redis:h:0", "redis:h:65536",
                                  "redis:h:63x9", "redis:h:6379/", "redis:h:-1", "/tmp/store"}) {
    auto r = test::parse_server_args(
        {"--name", "x", "--tensor", "w:4", "--federation", "gloo", "--fed-hosts", "3", "--fed-store", store});
    BOOST_TEST_REQUIRE(!r.ok(), store);
    BOOST_TEST(r.status().message() == "--fed-store must be file:DIR or redis:HOST[:PORT][/JOB], got '" + store + "'",
               r.status().message());
  }
  for (const auto& [args, want] : bad) {
    std::vector<std::string> all = {"--name", "x", "--tensor", "w:4"};
    all.insert(all.end(), args.begin(), args.end());
    auto r = test::parse_server_args(all);
    BOOST_TEST_REQUIRE(!r.ok(), args[0]);
    BOOST_TEST(r.status().message().find(want) != std::string::npos, r.status().message());
  }
}

// The forms --fed-store accepts, and what the Gloo plugin opens for each.
BOOST_AUTO_TEST_CASE(fed_store_forms_parse_to_where_the_hosts_meet) {
  auto file = parse_fed_store("file:/var/lib/shmps/store");
  BOOST_TEST_REQUIRE(file.ok());
  BOOST_TEST(!file->redis);
  BOOST_TEST(file->dir == "/var/lib/shmps/store");
  struct Case {
    std::string spec, host;
    int port;
    std::string job;
  };
  for (const Case& c : {Case{"redis:db", "db", 6379, "shmps"}, Case{"redis:db:6380", "db", 6380, "shmps"},
                        Case{"redis:db:6380/job7", "db", 6380, "job7"}, Case{"redis:db/job7", "db", 6379, "job7"},
                        Case{"redis:[::1]", "[::1]", 6379, "shmps"}, Case{"redis:[::1]:7000/j", "[::1]", 7000, "j"}}) {
    auto r = parse_fed_store(c.spec);
    BOOST_TEST_REQUIRE(r.ok(), c.spec << ": " << r.status().to_string());
    BOOST_TEST(r->redis);
    BOOST_TEST(r->host == c.host, c.spec);
    BOOST_TEST(r->port == c.port, c.spec);
    BOOST_TEST(r->job == c.job, c.spec);
  }
}

namespace {

// The file of `key` in the file store `dir`: named by the key's
// std::hash, as the plugin (and Gloo's own file store) names it.
std::filesystem::path store_file(const std::filesystem::path& dir, const std::string& key) {
  return dir / std::to_string(std::hash<std::string>{}(key));
}

// One reform() of a Gloo engine of one host over the file store `dir`,
// which holds `fifo` (at a key, or where a link at a key points). A
// reform() still running after 5 s is blocked in the FIFO: the test opens
// its other end, which lets the reform() go on, and reports it blocked.
struct Reformed {
  FederationEngine::Reform result = FederationEngine::Reform::kFormed;
  std::string why;
  bool blocked = false;
};
Reformed reform_over(const std::filesystem::path& dir, const std::filesystem::path& fifo) {
  ::setenv("SHMPS_PLUGIN_DIR", (std::string(std::getenv("SHMPS_BUILD_DIR")) + "/lib/shmps").c_str(), 0);
  FederationConfig c;
  c.kind = FederationKind::kGloo;
  c.store = "file:" + dir.string();
  c.hosts = 1;
  c.timeout_ms = 1000;
  auto engine = make_federation_engine(c);
  BOOST_REQUIRE_MESSAGE(engine.ok(), engine.status().to_string());
  Reformed out;
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::thread reform([&] {
    out.result = (*engine)->reform(&out.why, [] { return false; });
    done.set_value();
  });
  if (finished.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    out.blocked = true;
    const int other_end = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    finished.wait();
    if (other_end >= 0) ::close(other_end);
  }
  reform.join();
  return out;
}

}  // namespace

// A FIFO in a Gloo file store, at a key or where a symbolic link at a key
// points, is refused as a store error without blocking the federation
// thread in open() (where rounds, and a stop, would wait for ever): the
// attempt that reads it fails, naming the file, and the store keeps it.
// Here at this host's own want of the first attempt, which the attempt
// reads back before anything else.
BOOST_AUTO_TEST_CASE(a_fifo_or_a_link_in_the_file_store_is_refused_without_blocking,
                     *boost::unit_test::precondition(test::has_gloo_plugin)) {
  test::TempDir tmp("fedfifo");
  const std::filesystem::path fifo_store = std::filesystem::canonical(tmp.path) / "fifo";
  const std::filesystem::path link_store = std::filesystem::canonical(tmp.path) / "link";
  const std::filesystem::path outside = std::filesystem::canonical(tmp.path) / "outside";
  std::filesystem::create_directories(fifo_store);
  std::filesystem::create_directories(link_store);
  const std::filesystem::path at_key = store_file(fifo_store, "a1/want/0");
  BOOST_TEST_REQUIRE(::mkfifo(at_key.c_str(), 0600) == 0);
  BOOST_TEST_REQUIRE(::mkfifo(outside.c_str(), 0600) == 0);
  const std::filesystem::path link = store_file(link_store, "a1/want/0");
  std::filesystem::create_symlink(outside, link);

  struct Case {
    std::filesystem::path store, fifo;
    std::string says;
  };
  for (const Case& c : {Case{fifo_store, at_key, at_key.string() + " is a FIFO, not a value of this job"},
                        Case{link_store, outside, link.string() + " is a symbolic link, not a value of this job"}}) {
    BOOST_TEST_CONTEXT(c.store) {
      const auto start = std::chrono::steady_clock::now();
      const Reformed r = reform_over(c.store, c.fifo);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      BOOST_TEST(!r.blocked, "reform() blocked in open() for 5 s");
      BOOST_TEST(seconds < 3.0);
      BOOST_TEST((r.result == FederationEngine::Reform::kFailed));
      BOOST_TEST(r.why.find(c.says) != std::string::npos, r.why);
    }
  }
  BOOST_TEST(std::filesystem::is_fifo(std::filesystem::symlink_status(at_key)), "the FIFO is left as it was");
  BOOST_TEST(std::filesystem::is_symlink(std::filesystem::symlink_status(link)), "the link is left as it was");
}

BOOST_AUTO_TEST_SUITE_END()
