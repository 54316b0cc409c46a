// The offers of in-process device buffers (in_process.hpp): what a server
// believes of a kBufferInProcess descriptor comes from this process's
// memory, never from the segment's bytes.
#define BOOST_TEST_MODULE test_in_process
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <set>

#include "shmps/shm/in_process.hpp"

using namespace shmps;
using namespace shmps::shm;

namespace {

const auto kOurPid = static_cast<uint32_t>(::getpid());

BufferDesc naming(uint64_t word) {
  BufferDesc d{};
  d.kind = static_cast<uint32_t>(BufferKind::kCudaIpc);
  d.flags = kBufferInProcess;
  std::memcpy(d.handle, &word, sizeof word);
  return d;
}

}  // namespace

BOOST_AUTO_TEST_CASE(an_offer_is_taken_once_with_what_was_offered) {
  int memory = 0, event = 0;
  auto token = offer_in_process({&memory, &event});
  BOOST_TEST_REQUIRE(token.ok());
  BOOST_TEST(*token != 0u);
  auto taken = take_in_process(naming(*token), kOurPid);
  BOOST_TEST_REQUIRE(taken.ok());
  BOOST_TEST(taken->base == static_cast<void*>(&memory));
  BOOST_TEST(taken->event == static_cast<void*>(&event));
  auto again = take_in_process(naming(*token), kOurPid);
  BOOST_TEST(again.status().code() == ErrorCode::kBadRequest);
}

// A peer that may write the segment claims an entry under the server's own
// pid and names a pointer of the server's (its weights) where an in-process
// worker's token goes: the server finds no offer and believes nothing.
BOOST_AUTO_TEST_CASE(a_pointer_written_where_a_token_goes_is_refused) {
  int weights = 0;
  const auto pointer = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&weights));
  auto taken = take_in_process(naming(pointer), kOurPid);
  BOOST_TEST(taken.status().code() == ErrorCode::kBadRequest);
  BOOST_TEST(taken.status().message().find("did not offer") != std::string::npos);
  BOOST_TEST(take_in_process(naming(0), kOurPid).status().code() == ErrorCode::kBadRequest);
}

BOOST_AUTO_TEST_CASE(another_pid_is_refused_and_leaves_the_offer_to_its_worker) {
  int memory = 0;
  auto token = offer_in_process({&memory, nullptr});
  BOOST_TEST_REQUIRE(token.ok());
  auto foreign = take_in_process(naming(*token), kOurPid + 1);
  BOOST_TEST(foreign.status().code() == ErrorCode::kBadRequest);
  BOOST_TEST(foreign.status().message().find("another process") != std::string::npos);
  BOOST_TEST(take_in_process(naming(*token), kOurPid).ok());
}

BOOST_AUTO_TEST_CASE(a_withdrawn_offer_is_gone) {
  int memory = 0;
  auto token = offer_in_process({&memory, nullptr});
  BOOST_TEST_REQUIRE(token.ok());
  withdraw_in_process(*token);
  withdraw_in_process(*token);  // twice, and 0: nothing happens
  withdraw_in_process(0);
  BOOST_TEST(take_in_process(naming(*token), kOurPid).status().code() == ErrorCode::kBadRequest);
}

BOOST_AUTO_TEST_CASE(tokens_are_distinct) {
  int memory = 0;
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    auto token = offer_in_process({&memory, nullptr});
    BOOST_TEST_REQUIRE(token.ok());
    BOOST_TEST_REQUIRE(seen.insert(*token).second);
  }
  for (uint64_t t : seen) withdraw_in_process(t);
}
