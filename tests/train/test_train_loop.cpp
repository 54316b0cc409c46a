// The training loop (train_shard) against a scripted UpdatePath: one
// push_and_pull per applied step and a single pull before the first; a
// stale or lost push redone on the weights pulled with it, without another
// pull; a pull lost with the server made again before the next gradient;
// other errors ending the loop with the failing call named.
#include <boost/test/unit_test.hpp>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "train_loop.hpp"

using namespace shmps;
using namespace shmps::train;

namespace {

// Answers each call from a script (a call with none left is applied /
// pulled at the next version) and logs the calls, with the version each
// push was computed against.
class ScriptedPath final : public UpdatePath {
 public:
  explicit ScriptedPath(size_t params) : weights_(params, 0.01f), grad_(params) {}

  Result<uint64_t> pull() override {
    log.push_back("pull");
    return next(pulls, version_);
  }
  Step push_and_pull(uint64_t version) override {
    log.push_back("push@" + std::to_string(version));
    Result<uint64_t> pushed = next(pushes, version_ + 1);
    if (pushed.ok()) ++version_;
    Result<uint64_t> pulled = next(step_pulls, version_);
    return {std::move(pushed), std::move(pulled)};
  }
  const float* weights() const override { return weights_.data(); }
  float* grad() override { return grad_.data(); }

  std::deque<Status> pulls;       // answers to pull()
  std::deque<Status> pushes;      // the push part of push_and_pull()
  std::deque<Status> step_pulls;  // its pull part
  std::vector<std::string> log;

 private:
  static Result<uint64_t> next(std::deque<Status>& script, uint64_t version) {
    if (script.empty()) return version;
    Status s = script.front();
    script.pop_front();
    if (s.ok()) return version;
    return s;
  }

  std::vector<float> weights_;
  std::vector<float> grad_;
  uint64_t version_ = 0;
};

// A dataset of `n` random images of a small MLP's input size.
// One epoch of 6 images in minibatches of 2 (3 steps) of a small MLP,
// through a ScriptedPath whose script the case sets before run().
struct Loop {
  MlpShape shape{8, 4, 3};
  Dataset data;
  ScriptedPath path{mlp_parameter_count(shape)};
  LoopCounts counts;

  Loop() {
    data.count = 6;
    data.features = shape.inputs;
    data.images.assign(data.count * shape.inputs, 0.5f);
    for (size_t i = 0; i < data.count; ++i) data.labels.push_back(static_cast<uint8_t>(i % shape.classes));
  }
  Status run() { return train_shard(WorkerPlan{0, 1, 1, 2, 1, ""}, data, shape, path, counts, nullptr); }
  void expect_calls(const std::vector<std::string>& want) const {
    BOOST_TEST(path.log == want, boost::test_tools::per_element());
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(train_loop)

BOOST_FIXTURE_TEST_CASE(one_pull_then_one_push_and_pull_per_step, Loop) {
  BOOST_TEST_REQUIRE(run().ok());
  expect_calls({"pull", "push@0", "push@1", "push@2"});
  BOOST_TEST(counts.applied == 3u);
  BOOST_TEST(counts.rejected == 0u);
  BOOST_TEST(counts.lost == 0u);
}

BOOST_FIXTURE_TEST_CASE(stale_and_lost_pushes_are_redone_on_the_weights_pulled_with_them, Loop) {
  path.pushes = {Status::Ok(), Status(ErrorCode::kStale, "too old"), Status(ErrorCode::kServerRestarted, "gone")};
  BOOST_TEST_REQUIRE(run().ok());
  // The retries push against the version their own step pulled: no extra pull.
  expect_calls({"pull", "push@0", "push@1", "push@1", "push@1", "push@2"});
  BOOST_TEST(counts.applied == 3u);
  BOOST_TEST(counts.rejected == 1u);
  BOOST_TEST(counts.lost == 1u);
}

BOOST_FIXTURE_TEST_CASE(a_push_that_could_not_be_sent_is_lost_and_redone_after_a_pull, Loop) {
  // ServerPath's answer when push_async itself fails (a dead server seen
  // before submitting): the push's error for both parts.
  path.pushes = {Status(ErrorCode::kServerRestarted, "not sent")};
  path.step_pulls = {Status(ErrorCode::kServerRestarted, "not sent")};
  BOOST_TEST_REQUIRE(run().ok());
  expect_calls({"pull", "push@0", "pull", "push@0", "push@1", "push@2"});
  BOOST_TEST(counts.applied == 3u);
  BOOST_TEST(counts.lost == 1u);
}

BOOST_FIXTURE_TEST_CASE(a_pull_lost_with_the_server_is_made_again_before_the_next_gradient, Loop) {
  path.step_pulls = {Status(ErrorCode::kServerRestarted, "gone")};
  path.pulls = {Status::Ok(), Status(ErrorCode::kServerRestarted, "gone again")};
  BOOST_TEST_REQUIRE(run().ok());
  expect_calls({"pull", "push@0", "pull", "pull", "push@1", "push@2"});
  BOOST_TEST(counts.applied == 3u);
}

BOOST_AUTO_TEST_CASE(other_errors_end_the_loop_naming_the_call) {
  {
    Loop loop;
    loop.path.pushes = {Status::Ok(), Status(ErrorCode::kNonFinite, "NaN in the gradient")};
    const Status st = loop.run();
    BOOST_TEST(st.code() == ErrorCode::kNonFinite);
    BOOST_TEST(st.message().rfind("push: ", 0) == 0, st.message());
    BOOST_TEST(loop.counts.applied == 1u);
  }
  {
    // The push applied, its pull refused: counted, then the loop ends.
    Loop loop;
    loop.path.step_pulls = {Status(ErrorCode::kTimeout, "held too long")};
    const Status st = loop.run();
    BOOST_TEST(st.code() == ErrorCode::kTimeout);
    BOOST_TEST(st.message().rfind("pull: ", 0) == 0, st.message());
    BOOST_TEST(loop.counts.applied == 1u);
  }
  {
    Loop loop;
    loop.path.pulls = {Status(ErrorCode::kUnknownBuffer, "no such buffer")};
    const Status st = loop.run();
    BOOST_TEST(st.code() == ErrorCode::kUnknownBuffer);
    loop.expect_calls({"pull"});
  }
}

BOOST_AUTO_TEST_SUITE_END()
