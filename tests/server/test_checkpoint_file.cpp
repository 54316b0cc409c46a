// The checkpoint file functions (server/src/checkpoint.hpp) against files
// a crash, a damaged disk, an operator's mistake or an attacker could leave
// in the directory: what may be restored, what pruning may delete, what a
// write may replace. The server-level behaviour is in test_checkpoint.
#define BOOST_TEST_MODULE test_checkpoint_file
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/crc.hpp>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "checkpoint.hpp"
#include "checkpoint_policy.hpp"
#include "model.hpp"
#include "shmps/server/log.hpp"
#include "test_support.hpp"

using namespace shmps;
using namespace shmps::server;
namespace fs = std::filesystem;

namespace {

// dir/ckpt-<version, 20 digits>.shmps.
std::string ckpt(const test::TempDir& dir, uint64_t version) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%020llu.shmps", static_cast<unsigned long long>(version));
  return (dir.path / name).string();
}

// The same in `dir`.
std::string ckpt_in(const fs::path& dir, uint64_t version) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%020llu.shmps", static_cast<unsigned long long>(version));
  return (dir / name).string();
}

// Adam (2 state arrays) on tensors a:2x2, b:3.
CheckpointLayout adam_layout() {
  CheckpointLayout l;
  l.tensors = {{"a", {2, 2}}, {"b", {3}}};
  l.optimizer_kind = 2;
  l.state_arrays = 2;
  return l;
}

// SGD without momentum on one tensor of 7: another model.
CheckpointLayout sgd_layout() {
  CheckpointLayout l;
  l.tensors = {{"w", {7}}};
  l.optimizer_kind = 1;
  l.state_arrays = 0;
  return l;
}

CheckpointData make_data(const CheckpointLayout& layout, uint64_t version, float fill = 0.25f) {
  CheckpointData d;
  d.version = version;
  d.layout = layout;
  d.steps.assign(layout.tensors.size(), version);
  d.weights.assign(7, fill);
  d.state.assign(7 * layout.state_arrays, fill / 2);
  return d;
}

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void put(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::vector<std::string> names(const fs::path& dir) {
  std::vector<std::string> n;
  for (const auto& e : fs::directory_iterator(dir)) n.push_back(e.path().filename().string());
  std::sort(n.begin(), n.end());
  return n;
}

std::string error_of(const Result<CheckpointData>& r) { return r.ok() ? "(read fine)" : r.status().message(); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// In a child process: lowers its open-file limit so that `spare` more
// descriptors can be opened (the lowest free ones) and the next open fails
// with EMFILE, as in a server at its limit. False when it could not.
bool leave_spare_descriptors(int spare) {
  std::vector<int> probes;
  for (int i = 0; i <= spare; ++i) probes.push_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  for (int fd : probes)
    if (fd < 0) return false;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return false;
  // Below the last probe's number: the `spare` probes before it, no more.
  limit.rlim_cur = static_cast<rlim_t>(probes.back());
  for (int fd : probes) ::close(fd);
  return ::setrlimit(RLIMIT_NOFILE, &limit) == 0;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(checkpoint_file)

BOOST_AUTO_TEST_CASE(a_written_checkpoint_reads_back_whole) {
  test::TempDir dir("ckptfile");
  const CheckpointData d = make_data(adam_layout(), 9, 0.5f);
  BOOST_REQUIRE_MESSAGE(write_checkpoint(dir.path.string(), d).ok(), "write");
  auto r = read_checkpoint(ckpt(dir, 9), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST(r->version == 9u);
  BOOST_TEST(r->steps == d.steps);
  BOOST_TEST(r->weights == d.weights);
  BOOST_TEST(r->state == d.state);
  BOOST_TEST(names(dir.path) == std::vector<std::string>{"ckpt-00000000000000000009.shmps"});  // no temp file left
}

// Which groups completed rounds 1..42, and their members (host ids as
// bits): 1-30 group 2 (hosts 0-2), 31-40 group 5 (hosts 0 and 2), 41-42
// group 6 (hosts 0 and 63).
constexpr uint64_t kMembers2 = 0b111, kMembers5 = 0b101, kMembers6 = uint64_t{1} << 63 | 1;
RoundGroups some_history() {
  RoundGroups h;
  for (uint64_t round = 1; round <= 42; ++round)
    h.completed(round,
                round <= 30   ? 2
                : round <= 40 ? 5
                              : 6,
                round <= 30   ? kMembers2
                : round <= 40 ? kMembers5
                              : kMembers6);
  return h;
}

// The bytes of `bytes` less `n` from `at`, with format `format` and the
// checksum made again: an older format's file from a newer one's.
std::string as_format(std::string bytes, uint32_t format, const std::vector<std::pair<size_t, size_t>>& cuts) {
  for (auto it = cuts.rbegin(); it != cuts.rend(); ++it) bytes.erase(it->first, it->second);
  std::memcpy(bytes.data() + 8, &format, 4);  // CheckpointHeader::format
  boost::crc_32_type crc;
  crc.process_bytes(bytes.data(), bytes.size() - 4);
  const uint32_t sum = crc.checksum();
  std::memcpy(bytes.data() + bytes.size() - 4, &sum, 4);
  return bytes;
}

// Where the federation section's record starts in a file of adam_layout():
// after the header, 2 tensor records and 7 x 3 floats; the record of
// groups follows its 48 bytes (32 before format 5: without the last 16).
constexpr size_t kFederationRecord = 64 + 2 * 112 + 7 * 3 * 4;
constexpr size_t kRoundGroupsAt = kFederationRecord + 48;
constexpr std::pair<size_t, size_t> kFormat5Record{kFederationRecord + 32, 16};

// A federated server's checkpoint holds the federation's state (anchor,
// round, outer momentum, unmerged updates, which groups completed its
// rounds and their members, a restore base) after the optimizer state, in
// format 5; one without it is written as format 1 (which older builds
// read) and reads back without it.
BOOST_AUTO_TEST_CASE(the_federation_section_reads_back_and_format_1_still_reads) {
  test::TempDir dir("ckptfile");
  CheckpointData d = make_data(adam_layout(), 11, 0.5f);
  d.federation = FederationState{
      42, true, std::vector<float>(7, 1.5f), std::vector<float>(7, -0.125f), 9, some_history(), 0xabcd, 5};
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  auto r = read_checkpoint(ckpt(dir, 11), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST_REQUIRE(r->federation.has_value());
  BOOST_TEST(r->federation->round == 42u);
  BOOST_TEST(r->federation->momentum_started);
  BOOST_TEST(r->federation->unmerged_updates == 9u);
  BOOST_TEST(r->federation->anchor == d.federation->anchor);
  BOOST_TEST(r->federation->momentum == d.federation->momentum);
  BOOST_TEST((r->federation->history == d.federation->history));
  BOOST_TEST(r->federation->history.holds(35, 5));
  BOOST_TEST(r->federation->history.spans[1].members == kMembers5);
  BOOST_TEST(r->federation->history.spans[2].members == kMembers6);
  BOOST_TEST(r->federation->lineage == 0xabcdu);
  BOOST_TEST(r->federation->host == 5u);
  BOOST_TEST(r->federation->restore_base.empty());
  BOOST_TEST(r->federation->restore_base_updates == 0u);
  BOOST_TEST(r->weights == d.weights);

  d.federation->momentum.clear();  // the average outer step keeps none
  d.federation->restore_base.assign(7, 0.75f);
  d.federation->restore_base_updates = 4;
  d.version = 12;
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  r = read_checkpoint(ckpt(dir, 12), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST(r->federation->anchor == d.federation->anchor);
  BOOST_TEST(r->federation->momentum.empty());
  BOOST_TEST(r->federation->restore_base == d.federation->restore_base);
  BOOST_TEST(r->federation->restore_base_updates == 4u);
  BOOST_TEST(r->federation->unmerged_updates == 9u);
  // A base's updates are some of the unmerged ones.
  d.federation->restore_base_updates = 10;
  BOOST_TEST(write_checkpoint(dir.path.string(), d).ok());
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 12), adam_layout())), "implausible federation record"));

  // Without a section: format 1.
  CheckpointData plain = make_data(adam_layout(), 13);
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), plain).ok());
  uint32_t format = 0;
  std::memcpy(&format, contents(ckpt(dir, 13)).data() + 8, 4);  // CheckpointHeader::format
  BOOST_TEST(format == 1u);
  std::memcpy(&format, contents(ckpt(dir, 11)).data() + 8, 4);
  BOOST_TEST(format == 5u);
  r = read_checkpoint(ckpt(dir, 13), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST(!r->federation.has_value());
  BOOST_TEST(r->weights == plain.weights);
}

// A format-4 file (a 32-byte record, no restore base, as the builds
// before format 5 wrote it) still reads, with no restore base; a format-4
// header claiming one is refused.
BOOST_AUTO_TEST_CASE(a_format_4_federation_section_reads_without_a_restore_base) {
  test::TempDir dir("ckptfile");
  CheckpointData d = make_data(adam_layout(), 11, 0.5f);
  d.federation = FederationState{42, false, std::vector<float>(7, 1.5f), {}, 9, some_history(), 0xabcd, 5};
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  std::string bytes = as_format(contents(ckpt(dir, 11)), 4, {kFormat5Record});
  put(ckpt(dir, 11), bytes);
  auto r = read_checkpoint(ckpt(dir, 11), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST_REQUIRE(r->federation.has_value());
  BOOST_TEST(r->federation->round == 42u);
  BOOST_TEST(r->federation->unmerged_updates == 9u);
  BOOST_TEST(r->federation->host == 5u);
  BOOST_TEST((r->federation->history == d.federation->history));
  BOOST_TEST(r->federation->anchor == d.federation->anchor);
  BOOST_TEST(r->federation->restore_base.empty());
  const uint32_t with_base = kCheckpointFederation | kCheckpointRestoreBase;
  std::memcpy(bytes.data() + 36, &with_base, 4);  // CheckpointHeader::flags
  put(ckpt(dir, 11), as_format(bytes, 4, {}));
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 11), adam_layout())), "implausible header"));
}

// A format-3 file (the record of groups without members, as the builds
// before format 4 wrote it) still reads: its spans come back with their
// members unknown, which the join takes as "cannot tell" (test_federation,
// a_join_over_an_older_checkpoint_tells_whether_its_drift_was_merged).
BOOST_AUTO_TEST_CASE(a_format_3_federation_section_reads_with_members_unknown) {
  test::TempDir dir("ckptfile");
  CheckpointData d = make_data(adam_layout(), 11, 0.5f);
  d.federation = FederationState{42, false, std::vector<float>(7, 1.5f), {}, 9, some_history(), 0xabcd, 5};
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  // Each 32-byte span {group, first, last, members} less its members.
  std::vector<std::pair<size_t, size_t>> members{kFormat5Record};
  for (size_t k = 0; k < RoundGroups::kSpans; ++k) members.emplace_back(kRoundGroupsAt + k * 32 + 24, 8);
  put(ckpt(dir, 11), as_format(contents(ckpt(dir, 11)), 3, members));
  auto r = read_checkpoint(ckpt(dir, 11), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST_REQUIRE(r->federation.has_value());
  BOOST_TEST(r->federation->round == 42u);
  BOOST_TEST(r->federation->lineage == 0xabcdu);
  BOOST_TEST(r->federation->host == kUnknownFederationHost);  // format 3 names no writer
  BOOST_TEST(r->federation->anchor == d.federation->anchor);
  RoundGroups want = some_history();
  for (RoundGroups::Span& span : want.spans) span.members = RoundGroups::kMembersUnknown;
  BOOST_TEST((r->federation->history == want));
  BOOST_TEST(r->federation->history.holds(35, 5));
  BOOST_TEST((r->federation->history.presence(1, 30, 42) == RoundGroups::Presence::kUnknown));
}

// A format-2 file (a federation section without the record of groups,
// as the builds before format 3 wrote it) still reads: its state restores
// with no groups known, as those builds restored it.
BOOST_AUTO_TEST_CASE(a_format_2_federation_section_reads_without_groups) {
  test::TempDir dir("ckptfile");
  CheckpointData d = make_data(adam_layout(), 11, 0.5f);
  d.federation = FederationState{42, false, std::vector<float>(7, 1.5f), {}, 9, some_history()};
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  // Format 5 less the record's last 16 bytes and the 256 bytes of
  // RoundGroups after it, checksummed again: what format 2 was.
  std::string bytes = as_format(contents(ckpt(dir, 11)), 2, {kFormat5Record, {kRoundGroupsAt, sizeof(RoundGroups)}});
  put(ckpt(dir, 11), bytes);
  auto r = read_checkpoint(ckpt(dir, 11), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST_REQUIRE(r->federation.has_value());
  BOOST_TEST(r->federation->round == 42u);
  BOOST_TEST(r->federation->anchor == d.federation->anchor);
  BOOST_TEST((r->federation->history == RoundGroups{}));
  const uint32_t format6 = 6;
  std::memcpy(bytes.data() + 8, &format6, 4);
  put(ckpt(dir, 11), bytes);
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 11), adam_layout())), "format 6, this build reads 1 to 5"));
}

// The section's flags and record are checked like the rest: unknown flags,
// a momentum without a section, or a format-1 file claiming a section are
// refused from the header; a damaged record (checksum recomputed, as an
// attacker would) is refused after the checksum.
BOOST_AUTO_TEST_CASE(a_damaged_federation_section_is_refused) {
  test::TempDir dir("ckptfile");
  CheckpointData d = make_data(adam_layout(), 5);
  d.federation = FederationState{3, false, std::vector<float>(7, 1.0f), {}, 0, {}};  // no rounds' groups known
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  const std::string good = contents(ckpt(dir, 5));
  const auto patched = [&](size_t offset, const void* value, size_t n) {
    std::string bytes = good;
    std::memcpy(bytes.data() + offset, value, n);
    boost::crc_32_type crc;
    crc.process_bytes(bytes.data(), bytes.size() - 4);
    const uint32_t sum = crc.checksum();
    std::memcpy(bytes.data() + bytes.size() - 4, &sum, 4);
    put(ckpt(dir, 5), bytes);
    return error_of(read_checkpoint(ckpt(dir, 5), adam_layout()));
  };
  for (uint32_t flags : {4u, 2u}) BOOST_TEST(contains(patched(36, &flags, 4), "implausible header"));  // ::flags
  const uint32_t format1 = 1;
  BOOST_TEST(contains(patched(8, &format1, 4), "implausible header"));
  const size_t record = kFederationRecord;
  const uint64_t wrap = ~uint64_t{0};
  BOOST_TEST(contains(patched(record, &wrap, 8), "implausible federation record"));
  const uint32_t started = 7;
  BOOST_TEST(contains(patched(record + 8, &started, 4), "implausible federation record"));
  BOOST_TEST(contains(patched(record + 16, &wrap, 8), "implausible federation record"));  // unmerged updates
  // A restore base's updates without one, and the reserved word.
  const uint64_t one = 1;
  BOOST_TEST(contains(patched(record + 32, &one, 8), "implausible federation record"));
  BOOST_TEST(contains(patched(record + 40, &one, 8), "implausible federation record"));
  const uint32_t base_flag = kCheckpointFederation | kCheckpointRestoreBase;  // without its array
  BOOST_TEST(contains(patched(36, &base_flag, 4), "does not match its header"));
  // The record of groups follows the 48-byte record: 8 spans {group,
  // first, last, members}. Rounds past the checkpoint's round 3, a span
  // ending before it starts, spans out of order or after an empty one,
  // members in an empty span: refused. A span's members are any bits (0:
  // unknown, as a format-3 record's).
  const size_t spans = kRoundGroupsAt;
  const auto span = [&](size_t k, uint64_t group, uint64_t first, uint64_t last, uint64_t members = 0b11) {
    const uint64_t v[4] = {group, first, last, members};
    return patched(spans + k * 32, v, sizeof v);
  };
  // Two spans at once: {g1, f1, l1, hosts 0 and 1}, {g2, f2, l2, host 5}.
  const auto spans2 = [&](uint64_t f1, uint64_t l1, uint64_t f2, uint64_t l2) {
    const uint64_t v[8] = {7, f1, l1, 0b11, 9, f2, l2, 0b100000};
    return patched(spans, v, sizeof v);
  };
  BOOST_TEST(span(0, 1, 1, 3) == "(read fine)");  // rounds 1-3 in group 1: plausible
  BOOST_TEST(span(0, 1, 1, 3, RoundGroups::kMembersUnknown) == "(read fine)");
  BOOST_TEST(span(0, 1, 1, 3, ~uint64_t{0}) == "(read fine)");  // all 64 host ids
  BOOST_TEST(spans2(1, 2, 3, 3) == "(read fine)");
  for (const std::string& e :
       {span(0, 1, 1, 4), span(0, 1, 3, 2), span(1, 1, 1, 2), span(0, 0, 0, 2), spans2(2, 3, 1, 1),
        spans2(1, 2, 2, 3),                                                               // out of order, overlapping
        span(0, 0, 0, 0, 1), span(RoundGroups::kSpans - 1, 0, 0, 0, uint64_t{1} << 40)})  // members, no rounds
    BOOST_TEST(contains(e, "implausible record of the rounds' groups for round 3"), e);
}

// The writer zeroes the bytes it reserves: the header's two reserved
// words, and in each tensor record its reserved word, its name's padding
// and the dimensions past its ndim. A file with one of them set (its
// checksum made again, as a newer writer's or an attacker's file would
// be) is refused as not of this format, naming the file, and is not taken
// for a damaged file of this model (set aside, replaced or pruned).
BOOST_AUTO_TEST_CASE(a_file_with_reserved_bytes_set_is_refused) {
  test::TempDir dir("ckptfile");
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), make_data(adam_layout(), 5)).ok());
  const std::string good = contents(ckpt(dir, 5));
  // Tensor records at 64 ('a', 2x2) and 176 ('b', 3): name 0-63, ndim 64,
  // reserved0 68, shape 72-103, step 104.
  constexpr size_t kA = 64, kB = 176;
  for (const size_t offset : {size_t{48}, size_t{63}, kA + 2, kA + 63, kA + 68, kA + 71, kA + 72 + 2 * 8,
                              kA + 72 + 3 * 8 + 7, kB + 2, kB + 72 + 8, kB + 72 + 3 * 8}) {
    BOOST_TEST_CONTEXT("byte " << offset) {
      BOOST_TEST(good[offset] == '\0');
      std::string bytes = good;
      bytes[offset] = '\x01';
      boost::crc_32_type crc;
      crc.process_bytes(bytes.data(), bytes.size() - 4);
      const uint32_t sum = crc.checksum();
      std::memcpy(bytes.data() + bytes.size() - 4, &sum, 4);
      put(ckpt(dir, 5), bytes);
      bool damaged = true;
      const std::string e = error_of(read_checkpoint(ckpt(dir, 5), adam_layout(), &damaged));
      BOOST_TEST(contains(e, ckpt(dir, 5) + ": not a checkpoint of format 1 as this build reads it ("), e);
      BOOST_TEST(!damaged);
    }
  }
  put(ckpt(dir, 5), good);
  BOOST_TEST(read_checkpoint(ckpt(dir, 5), adam_layout()).ok());
}

BOOST_AUTO_TEST_CASE(another_models_file_is_refused_from_its_header) {
  test::TempDir dir("ckptfile");
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), make_data(sgd_layout(), 3)).ok());
  const auto r = read_checkpoint(ckpt(dir, 3), adam_layout());
  BOOST_TEST(!r.ok());
  BOOST_TEST(contains(error_of(r), "does not fit this configuration"), error_of(r));

  // A sparse file whose header claims 2^34 parameters: refused before
  // anything of that size is allocated (reading it would take gigabytes).
  std::string bytes = contents(ckpt(dir, 3));
  const uint64_t huge = uint64_t{1} << 34;
  std::memcpy(bytes.data() + 40, &huge, 8);  // CheckpointHeader::total_elements
  const std::string big_file = (dir.path / "big.shmps").string();
  put(big_file, bytes.substr(0, 64));
  fs::resize_file(big_file, 64 + 112 + huge * 4 + 4);
  const auto big = read_checkpoint(big_file, sgd_layout());
  BOOST_TEST(contains(error_of(big), "does not fit this configuration"), error_of(big));
  BOOST_TEST(contains(error_of(big), std::to_string(huge) + " parameters"), error_of(big));
}

// A tensor of another name or shape (the same count and total): the
// message names the file's tensor and the server's, each with its shape.
BOOST_AUTO_TEST_CASE(a_tensor_that_does_not_fit_is_named_on_both_sides) {
  test::TempDir dir("ckptfile");
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), make_data(adam_layout(), 3)).ok());
  CheckpointLayout renamed = adam_layout();
  renamed.tensors[1] = {"c", {3}};
  const std::string by_name = error_of(read_checkpoint(ckpt(dir, 3), renamed));
  BOOST_TEST(contains(by_name,
                      "does not fit this configuration (tensor 1 is 'b' of shape 3 in the file, 'c' of "
                      "shape 3 in this server)"),
             by_name);
  CheckpointLayout reshaped = adam_layout();
  reshaped.tensors[0] = {"a", {4, 1}};
  const std::string by_shape = error_of(read_checkpoint(ckpt(dir, 3), reshaped));
  BOOST_TEST(contains(by_shape, "tensor 0 is 'a' of shape 2x2 in the file, 'a' of shape 4x1 in this server"), by_shape);
}

// What log::write() makes of `text`: the line it writes to stderr
// (redirected to a file for the call).
std::string logged(std::string_view text) {
  test::TempDir dir("ckptlog");
  const std::string path = (dir.path / "stderr").string();
  {
    test::StderrTo capture(path);
    log::error(text);
  }
  return contents(path);
}

// A tensor name in a checkpoint file holding control characters (a
// terminal's escape sequences, a bell, a C1 CSI) and bytes that are not
// UTF-8 reaches the log, through the misfit message, as \xNN text: the
// line holds no control byte but its final newline, and well-formed UTF-8
// stays as it is.
BOOST_AUTO_TEST_CASE(control_characters_of_a_files_tensor_name_are_escaped_in_the_log) {
  test::TempDir dir("ckptfile");
  CheckpointLayout hostile = adam_layout();
  hostile.tensors[1].name = "b\x1b[2J\x07\xff\xc2\x9b\xc3\xa9\r\nx";
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), make_data(hostile, 3)).ok());
  const std::string message = error_of(read_checkpoint(ckpt(dir, 3), adam_layout()));
  BOOST_TEST_REQUIRE(contains(message, hostile.tensors[1].name), message);  // raw in the Status
  const std::string line = logged("checkpoint " + message);
  BOOST_TEST(contains(line, "tensor 1 is 'b\\x1b[2J\\x07\\xff\\xc2\\x9b\xc3\xa9  x' of shape 3 in the file"), line);
  BOOST_TEST_REQUIRE(!line.empty());
  BOOST_TEST(line.back() == '\n');
  const auto control = std::find_if(line.begin(), line.end() - 1, [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c < 0x20 || c == 0x7f;
  });
  BOOST_TEST((control == line.end() - 1), "a control byte at " << (control - line.begin()) << " in: " << line);
  // Truncated and overlong sequences, and a surrogate, byte by byte.
  const std::string odd = logged(std::string("\xe2\x82 \xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 ok \xe2\x82\xac"));
  BOOST_TEST(contains(odd, "\\xe2\\x82 \\xc0\\xaf \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80 ok \xe2\x82\xac\n"), odd);
}

BOOST_AUTO_TEST_CASE(what_is_not_a_regular_file_is_refused_without_blocking) {
  test::TempDir dir("ckptfile");
  BOOST_REQUIRE(::mkfifo(ckpt(dir, 9).c_str(), 0600) == 0);  // opening it for reading would wait for a writer
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 9), adam_layout())), "not a regular file"));
  fs::create_directory(ckpt(dir, 8));
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 8), adam_layout())), "not a regular file"));
  BOOST_TEST(!read_checkpoint(ckpt(dir, 7), adam_layout()).ok());  // missing
}

// In the server's directory an entry named like a checkpoint is judged
// before it is opened, never through a link: a symbolic link (to a valid
// checkpoint of this model elsewhere, or to a device) and a FIFO are
// refused unopened, naming what they are, and are neither set aside,
// pruned nor replaced: opened, a FIFO would block the start and a tty
// become the server's controlling terminal. A path given alone is
// followed, as a path is.
BOOST_AUTO_TEST_CASE(a_link_or_fifo_named_like_a_checkpoint_is_refused_unopened) {
  test::TempDir dir("ckptfile"), elsewhere("ckptfile");
  BOOST_REQUIRE(write_checkpoint(elsewhere.path.string(), make_data(adam_layout(), 5)).ok());
  fs::create_symlink(ckpt(elsewhere, 5), ckpt(dir, 5));
  fs::create_symlink("/dev/null", ckpt(dir, 6));
  BOOST_REQUIRE(::mkfifo(ckpt(dir, 7).c_str(), 0600) == 0);
  auto lock = CheckpointDirLock::acquire(dir.path.string());
  BOOST_REQUIRE_MESSAGE(lock.ok(), lock.status().to_string());
  for (const auto& [version, kind] :
       std::vector<std::pair<uint64_t, std::string>>{{5, "a symbolic link"}, {6, "a symbolic link"}, {7, "a FIFO"}}) {
    bool damaged = true;
    const auto r = read_checkpoint(*lock, ckpt(dir, version), adam_layout(), &damaged);
    BOOST_TEST(contains(error_of(r), ckpt(dir, version) + ": not a regular file (" + kind + "): not read"),
               error_of(r));
    BOOST_TEST(!damaged);
  }
  prune_checkpoints(*lock, 1, 10, adam_layout());
  BOOST_TEST(contains(write_checkpoint(*lock, make_data(adam_layout(), 5)).message(), "not replacing"));
  BOOST_TEST(fs::is_symlink(ckpt(dir, 5)));
  BOOST_TEST(fs::is_symlink(ckpt(dir, 6)));
  BOOST_TEST(fs::is_fifo(ckpt(dir, 7)));
  BOOST_TEST(read_checkpoint(ckpt(dir, 5), adam_layout()).ok());
}

BOOST_AUTO_TEST_CASE(the_version_must_be_plausible_and_match_the_name) {
  test::TempDir dir("ckptfile");
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), make_data(adam_layout(), 3)).ok());
  fs::copy_file(ckpt(dir, 3), ckpt(dir, 9));
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 9), adam_layout())), "named version 9 but holds version 3"));
  // 2^64 - 1 would make the next push wrap the version to 0.
  const uint64_t wrap = std::numeric_limits<uint64_t>::max();
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), make_data(adam_layout(), wrap)).ok());
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, wrap), adam_layout())), "implausible version"));
  // A name past 2^64 (20 digits hold up to 10^20 - 1).
  fs::copy_file(ckpt(dir, 3), dir.path / "ckpt-99999999999999999999.shmps");
  BOOST_TEST(contains(error_of(read_checkpoint((dir.path / "ckpt-99999999999999999999.shmps").string(), adam_layout())),
                      "over 2^64"));
}

BOOST_AUTO_TEST_CASE(an_implausible_step_is_refused_and_the_servers_own_files_are_not) {
  test::TempDir dir("ckptfile");
  CheckpointData d = make_data(adam_layout(), 4);
  d.steps[1] = ~uint64_t{0};  // Adam's next step would wrap to 0: NaN weights after one push
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  BOOST_TEST(contains(error_of(read_checkpoint(ckpt(dir, 4), adam_layout())), "implausible step"));
  // What the server writes itself must read back: steps past the version
  // (a push rejected after its apply: the buffer was found damaged), and
  // NaN weights (--allow-nonfinite let them in).
  d = make_data(adam_layout(), 5);
  d.steps = {6, 7};
  d.weights[3] = std::nanf("");
  d.state[9] = INFINITY;
  BOOST_REQUIRE(write_checkpoint(dir.path.string(), d).ok());
  auto r = read_checkpoint(ckpt(dir, 5), adam_layout());
  BOOST_REQUIRE_MESSAGE(r.ok(), error_of(r));
  BOOST_TEST(r->steps == d.steps);
  BOOST_TEST(std::isnan(r->weights[3]));
  BOOST_TEST(std::isinf(r->state[9]));
}

BOOST_AUTO_TEST_CASE(pruning_keeps_what_this_server_wrote_over_damaged_or_foreign_files) {
  test::TempDir dir("ckptfile");
  const std::string d = dir.path.string();
  for (uint64_t v : {4, 5}) BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), v)).ok());
  // A damaged file named above everything (one payload byte changed: its
  // header still reads as ours), and another model's file below.
  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 100)).ok());
  std::string bytes = contents(ckpt(dir, 100));
  bytes[bytes.size() - 10] ^= 0x40;
  put(ckpt(dir, 100), bytes);
  BOOST_REQUIRE(write_checkpoint(d, make_data(sgd_layout(), 2)).ok());
  const std::string foreign = contents(ckpt(dir, 2));

  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 7)).ok());
  prune_checkpoints(d, 1, 7, adam_layout());
  // Kept: the one just written, the file above it (not ours to judge), the
  // other model's. Pruning by file name alone would keep the damaged 100
  // as "the newest" and delete every valid file.
  BOOST_TEST(names(dir.path) ==
             (std::vector<std::string>{"ckpt-00000000000000000002.shmps", "ckpt-00000000000000000007.shmps",
                                       "ckpt-00000000000000000100.shmps"}));
  BOOST_TEST(contents(ckpt(dir, 2)) == foreign);
  BOOST_TEST(read_checkpoint(ckpt(dir, 7), adam_layout()).ok());

  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 8)).ok());
  prune_checkpoints(d, 2, 8, adam_layout());
  BOOST_TEST(names(dir.path).size() == 4u);  // 2, 7, 8, 100
}

BOOST_AUTO_TEST_CASE(a_write_never_replaces_another_models_checkpoint) {
  test::TempDir dir("ckptfile");
  const std::string d = dir.path.string();
  BOOST_REQUIRE(write_checkpoint(d, make_data(sgd_layout(), 3)).ok());
  const std::string sgd = contents(ckpt(dir, 3));
  const Status s = write_checkpoint(d, make_data(adam_layout(), 3));
  BOOST_TEST(s.code() == ErrorCode::kLayoutMismatch);
  BOOST_TEST(contains(s.message(), "not replacing"), s.message());
  BOOST_TEST(contents(ckpt(dir, 3)) == sgd);
  BOOST_TEST(names(dir.path).size() == 1u);  // no temp file either

  // One of ours, damaged (truncated), is replaced by the new write.
  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 4)).ok());
  fs::resize_file(ckpt(dir, 4), 70);
  BOOST_TEST(write_checkpoint(d, make_data(adam_layout(), 4)).ok());
  BOOST_TEST(read_checkpoint(ckpt(dir, 4), adam_layout()).ok());

  // Nor over a directory of that name, or a file it cannot identify as one
  // of its own (an operator's notes; a newer format).
  fs::create_directory(ckpt(dir, 5));
  BOOST_TEST(contains(write_checkpoint(d, make_data(adam_layout(), 5)).message(), "not a regular file"));
  put(ckpt(dir, 6), std::string(200, 'x'));
  BOOST_TEST(write_checkpoint(d, make_data(adam_layout(), 6)).message() ==
             "checkpoint: not replacing " + ckpt(dir, 6) +
                 ": not a shmps checkpoint (bad magic); move it away or use another --checkpoint-dir");
  BOOST_TEST(contents(ckpt(dir, 6)) == std::string(200, 'x'));

  // One of this model's, of another user: the reason given is its owner,
  // not another model.
  if (::geteuid() != 0) {
    BOOST_TEST_MESSAGE("not root: a file of another user cannot be made here; that part is skipped");
    return;
  }
  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 7)).ok());
  BOOST_REQUIRE(::chown(ckpt(dir, 7).c_str(), 65534, 65534) == 0);
  const std::string owned = write_checkpoint(d, make_data(adam_layout(), 7)).message();
  BOOST_TEST(contains(owned, "checkpoint: not replacing " + ckpt(dir, 7) + ": owned by uid 65534, not by this server"),
             owned);
  BOOST_TEST(contains(owned, "; move it away or use another --checkpoint-dir"), owned);
  BOOST_TEST(!contains(owned, "not a checkpoint of this model"), owned);
}

// A snapshot whose arrays do not match its layout (a bug) is refused
// naming the file and version it was for; a write that fails names the
// checkpoint it was for besides the temp file, and the fix.
BOOST_AUTO_TEST_CASE(a_refused_or_failed_write_names_its_checkpoint_and_the_fix) {
  test::TempDir dir("ckptfile"), logs("ckptlog");
  const std::string d = dir.path.string();
  CheckpointData bad = make_data(adam_layout(), 8);
  bad.state.pop_back();
  const Status s = write_checkpoint(d, bad);
  BOOST_TEST(s.code() == ErrorCode::kInternal);
  BOOST_TEST(contains(s.message(), "checkpoint: not writing " + ckpt(dir, 8) +
                                       ": the snapshot of version 8 does not "
                                       "hold together (7 weights, 13 optimizer state values for 2 array(s)"),
             s.message());
  // EFBIG from a file size limit below the checkpoint's 376 bytes, in a child.
  const std::string log_path = (logs.path / "stderr").string();
  auto child = test::Process::fork_fn([&] {
    test::StderrTo capture(log_path);
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{};
    if (::getrlimit(RLIMIT_FSIZE, &limit) != 0) return 3;
    const rlim_t before = std::exchange(limit.rlim_cur, 100);
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 3;
    const Status w = write_checkpoint(d, make_data(adam_layout(), 9));
    limit.rlim_cur = before;  // for the log line
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 3;
    log::error(w.to_string());
    return w.ok() ? 1 : 0;
  });
  const int code = child.wait(std::chrono::seconds(30));
  BOOST_TEST(code == 0, "exit " << code << ": " << test::read_file(log_path));
  const std::string text = test::read_file(log_path);
  BOOST_TEST(contains(text, "checkpoint: write " + d + "/.ckpt-00000000000000000009.shmps.tmp (for " + ckpt(dir, 9) +
                                "): File too large; raise the server's file size limit"),
             text);
  BOOST_TEST(names(dir.path).empty());  // the temp file removed
}

// A listing cut short (here: no descriptor left, EMFILE) is an error
// naming the directory and the fix, never an empty directory; pruning and
// the temp files' removal then leave the directory as it is, and say so.
BOOST_AUTO_TEST_CASE(a_directory_that_cannot_be_listed_is_an_error_not_an_empty_one) {
  test::TempDir dir("ckptfile"), logs("ckptlog");
  const std::string d = dir.path.string(), log_path = (logs.path / "stderr").string();
  for (uint64_t v : {4, 5}) BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), v)).ok());
  auto lock = CheckpointDirLock::acquire(d);
  BOOST_REQUIRE_MESSAGE(lock.ok(), lock.status().to_string());
  auto child = test::Process::fork_fn([&] {
    test::StderrTo capture(log_path);
    if (!leave_spare_descriptors(0)) return 3;
    const auto listed = list_checkpoints(*lock);
    prune_checkpoints(*lock, 1, 5, adam_layout());
    remove_temp_files(*lock);
    log::error(error_of(read_checkpoint(*lock, ckpt(dir, 5), adam_layout())));
    log::error(listed.ok() ? "listed " + std::to_string(listed->size()) + " file(s)" : listed.status().to_string());
    return listed.ok() ? 1 : listed.status().code() == ErrorCode::kIo ? 0 : 2;
  });
  // The exit code first: a message is read before the check is made.
  const int code = child.wait(std::chrono::seconds(30));
  BOOST_TEST(code == 0, "exit " << code << ": " << test::read_file(log_path));
  const std::string text = test::read_file(log_path);
  BOOST_TEST(contains(text, "cannot list " + d + " (open: Too many open files): raise the server's open-file limit"),
             text);
  BOOST_TEST(contains(text, "not pruning this time"), text);
  BOOST_TEST(contains(text, "temp files of a writer killed mid-write are not removed"), text);
  // A file it cannot open for the same reason: the fix, and that it is kept.
  BOOST_TEST(contains(text, ckpt(dir, 5) + ": open: Too many open files; left as it is: raise the server's open-file "
                                           "limit (LimitNOFILE= in its unit, ulimit -n), and restart the server"),
             text);
  BOOST_TEST(names(dir.path) ==
             (std::vector<std::string>{".lock", "ckpt-00000000000000000004.shmps", "ckpt-00000000000000000005.shmps"}));
  const auto listed = list_checkpoints(*lock);
  BOOST_REQUIRE_MESSAGE(listed.ok(), listed.status().to_string());
  BOOST_TEST(*listed == (std::vector<std::string>{ckpt(dir, 5), ckpt(dir, 4)}));
}

// A server that cannot list its checkpoint directory at start (EMFILE:
// the lock took the last two descriptors) fails the start, naming the
// directory and the fix: a listing taken for an empty directory would
// start from the initial values, and its writes would replace the old
// run's checkpoints one by one.
BOOST_AUTO_TEST_CASE(a_start_that_cannot_list_the_directory_fails_rather_than_start_from_scratch) {
  test::TempDir dir("ckptfile"), logs("ckptlog");
  const std::string d = dir.path.string(), log_path = (logs.path / "stderr").string();
  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 4)).ok());
  ServerConfig config;
  config.tensors = adam_layout().tensors;
  config.optimizer.kind = kernels::OptimizerKind::kAdam;
  config.checkpoint_dir = d;
  auto child = test::Process::fork_fn([&] {
    test::StderrTo capture(log_path);
    Model model;
    const std::unique_ptr<Backend> backend = make_host_backend();
    const auto stats = std::make_unique<shm::StatsBlock>();
    CheckpointPolicy policy(config, model, *backend, *stats);
    if (!leave_spare_descriptors(2)) return 3;  // the lock's two: the directory and .lock
    const Status s = policy.start(0);
    log::error(s.ok() ? "started at version " + std::to_string(model.version) : s.to_string());
    return s.ok() ? 1 : s.code() == ErrorCode::kIo ? 0 : 2;
  });
  // The exit code first: a message is read before the check is made.
  const int code = child.wait(std::chrono::seconds(30));
  BOOST_TEST(code == 0, "exit " << code << ": " << test::read_file(log_path));
  const std::string text = test::read_file(log_path);
  BOOST_TEST(contains(text, "--checkpoint-dir " + d + ": not restoring: cannot list " + d +
                                " (open: Too many open files): raise the server's open-file limit"),
             text);
  BOOST_TEST(fs::exists(ckpt(dir, 4)));
}

// A damaged checkpoint set aside never replaces a file set aside before
// (kept for the operator, perhaps of the same version from an earlier
// restart): ".damaged" is taken, then ".damaged.1", ".damaged.2" ...
BOOST_AUTO_TEST_CASE(setting_a_file_aside_never_replaces_one_set_aside_before) {
  test::TempDir dir("ckptfile");
  auto lock = CheckpointDirLock::acquire(dir.path.string());
  BOOST_REQUIRE_MESSAGE(lock.ok(), lock.status().to_string());
  const std::string five = ckpt(dir, 5);
  put(five + ".damaged", "first");
  put(five + ".damaged.1", "second");
  put(five, "third");
  auto moved = set_aside_damaged_checkpoint(*lock, five);
  BOOST_REQUIRE_MESSAGE(moved.ok(), moved.status().to_string());
  BOOST_TEST(*moved == five + ".damaged.2");
  BOOST_TEST(contents(five + ".damaged") == "first");
  BOOST_TEST(contents(five + ".damaged.1") == "second");
  BOOST_TEST(contents(five + ".damaged.2") == "third");
  BOOST_TEST(!fs::exists(five));
  put(ckpt(dir, 6), "fourth");
  moved = set_aside_damaged_checkpoint(*lock, ckpt(dir, 6));
  BOOST_REQUIRE_MESSAGE(moved.ok(), moved.status().to_string());
  BOOST_TEST(*moved == ckpt(dir, 6) + ".damaged");
  BOOST_TEST(contents(ckpt(dir, 6) + ".damaged") == "fourth");
}

BOOST_AUTO_TEST_CASE(temp_files_of_a_killed_writer_are_removed_and_nothing_else) {
  test::TempDir dir("ckptfile");
  const std::string d = dir.path.string();
  BOOST_REQUIRE(write_checkpoint(d, make_data(adam_layout(), 4)).ok());
  put((dir.path / ".ckpt-00000000000000000005.shmps.tmp").string(), "half a checkpoint");
  put((dir.path / ".ckpt-5.shmps.tmp").string(), "not ours");
  put((dir.path / "notes.txt").string(), "an operator's");
  remove_temp_files(d);
  BOOST_TEST(names(dir.path) ==
             (std::vector<std::string>{".ckpt-5.shmps.tmp", "ckpt-00000000000000000004.shmps", "notes.txt"}));
}

// The directory moved away and another put at its path, locked by
// another server with checkpoints of its own, between the writer's check
// that its lock is still the path's and the write (the hook runs there):
// the write and the pruning go to the directory the lock holds, through
// its descriptor, and leave the new one alone; the next write's check
// fails, naming the cause. A write and pruning by path would land this
// checkpoint in the other server's directory and delete its own (keep 1).
BOOST_AUTO_TEST_CASE(a_directory_replaced_between_the_lock_check_and_the_write_is_not_touched) {
  test::TempDir dir("ckptfile");
  const fs::path d = dir.path / "d", moved = dir.path / "d.old";
  fs::create_directory(d);
  BOOST_REQUIRE(write_checkpoint(d.string(), make_data(adam_layout(), 3)).ok());
  auto lock = CheckpointDirLock::acquire(d.string());
  BOOST_REQUIRE_MESSAGE(lock.ok(), lock.status().to_string());
  // The other server's, made on the writer thread: checked here after.
  std::optional<CheckpointDirLock> other;
  Status replaced;
  int checks = 0;
  std::string two, four;
  {
    CheckpointWriter writer(1, 3, *lock, [&] {
      if (checks++ != 0) return;
      std::error_code ec;
      fs::rename(d, moved, ec);
      if (!ec) fs::create_directory(d, ec);
      if (ec) {
        replaced = {ErrorCode::kIo, "replacing " + d.string() + ": " + ec.message()};
        return;
      }
      auto held = CheckpointDirLock::acquire(d.string());
      if (!held.ok()) {
        replaced = held.status();
        return;
      }
      other.emplace(std::move(held).value());
      for (uint64_t v : {2, 4})
        if (Status s = write_checkpoint(*other, make_data(adam_layout(), v, 0.5f)); !s.ok()) replaced = s;
      two = contents(ckpt_in(d, 2));
      four = contents(ckpt_in(d, 4));
    });
    BOOST_REQUIRE(writer.submit(make_data(adam_layout(), 5), 0));
    const Status first = writer.drain();
    BOOST_REQUIRE_MESSAGE(replaced.ok(), replaced.to_string());
    BOOST_TEST(first.ok(), first.to_string());
    BOOST_TEST((writer.last_written() == std::optional<uint64_t>(5)));
    BOOST_REQUIRE(writer.submit(make_data(adam_layout(), 6), 0));
    const Status second = writer.drain();
    BOOST_TEST(contains(second.message(), "is not the one this server locked at start"), second.to_string());
  }
  BOOST_TEST(checks == 1);
  // The other server's directory as it made it (the files compared in
  // double parentheses: their bytes are not printed); the moved one
  // pruned to the write that went there.
  BOOST_TEST(names(d) ==
             (std::vector<std::string>{".lock", "ckpt-00000000000000000002.shmps", "ckpt-00000000000000000004.shmps"}));
  BOOST_TEST((contents(ckpt_in(d, 2)) == two));
  BOOST_TEST((contents(ckpt_in(d, 4)) == four));
  BOOST_TEST(names(moved) == (std::vector<std::string>{".lock", "ckpt-00000000000000000005.shmps"}));
  BOOST_TEST(read_checkpoint(ckpt_in(moved, 5), adam_layout()).ok());
}

// A write that failed at the version of a checkpoint on disk, after the
// weights changed without a new version (Model::unversioned_changes: an
// init, a merged federation round): the final checkpoint is still written,
// whether the failure was seen before the stop or the write was in flight
// at it; and it fails the stop when it cannot be written.
BOOST_AUTO_TEST_CASE(a_failed_write_at_a_version_on_disk_does_not_stand_for_the_final_checkpoint) {
  test::TempDir dir("ckptfile"), logs("ckptlog");
  test::StderrTo capture((logs.path / "stderr").string());  // the policy's log
  ServerConfig config;
  config.tensors = adam_layout().tensors;
  config.optimizer.kind = kernels::OptimizerKind::kAdam;
  config.checkpoint_dir = dir.path.string();
  config.checkpoint_interval_s = 1;
  constexpr uint64_t kSecond = 1'000'000'000;
  // A non-empty directory at the temp file's name of version 3: the
  // writer can neither remove it nor create its file, as on a full disk.
  const fs::path blocker = dir.path / ".ckpt-00000000000000000003.shmps.tmp";
  const auto block = [&] {
    fs::create_directory(blocker);
    put((blocker / "x").string(), "x");
  };
  const auto weights_on_disk = [&] {
    const auto read = read_checkpoint(ckpt(dir, 3), adam_layout());
    return read.ok() ? read->weights.front() : -1.0f;
  };
  const std::vector<float> state(14, 0.0f);
  {
    Model model;
    const std::unique_ptr<Backend> backend = make_host_backend();
    BOOST_REQUIRE(backend->allocate({{0, 4}, {4, 3}}, 2, 7).ok());
    BOOST_REQUIRE(backend->load(std::vector<float>(7, 0.25f), state).ok());
    const auto stats = std::make_unique<shm::StatsBlock>();
    CheckpointPolicy policy(config, model, *backend, *stats);
    BOOST_REQUIRE(policy.start(0).ok());
    model.version = 3;
    model.steps = {3, 3};
    BOOST_REQUIRE(test::eventually([&] {
      policy.tick(2 * kSecond);
      return stats->checkpoints_written.load(std::memory_order_relaxed) == 1;
    }));
    BOOST_REQUIRE(weights_on_disk() == 0.25f);
    // The weights change, the version stays; the interval's write of it fails.
    BOOST_REQUIRE(backend->load(std::vector<float>(7, 0.75f), state).ok());
    ++model.unversioned_changes;
    block();
    BOOST_REQUIRE(test::eventually([&] {
      policy.tick(4 * kSecond);  // within the pause after the failure: not tried again
      return stats->checkpoint_failures.load(std::memory_order_relaxed) == 1;
    }));
    fs::remove_all(blocker);  // the disk is fine again
    const Status final = policy.write_final();
    BOOST_TEST(final.ok(), final.to_string());
    BOOST_TEST(weights_on_disk() == 0.75f);
  }
  // Restarted: the write is in flight at the stop, and fails while the
  // stop waits for it; so does the final one.
  Model model;
  const std::unique_ptr<Backend> backend = make_host_backend();
  BOOST_REQUIRE(backend->allocate({{0, 4}, {4, 3}}, 2, 7).ok());
  const auto stats = std::make_unique<shm::StatsBlock>();
  CheckpointPolicy policy(config, model, *backend, *stats);
  BOOST_REQUIRE(policy.start(0).ok());
  BOOST_REQUIRE(model.version == 3u);
  BOOST_REQUIRE(backend->load(std::vector<float>(7, 0.5f), state).ok());
  ++model.unversioned_changes;
  block();
  policy.tick(2 * kSecond);
  const Status final = policy.write_final();
  BOOST_TEST(contains(final.message(), "final checkpoint: cannot remove"), final.to_string());
  BOOST_TEST(weights_on_disk() == 0.75f);
}

BOOST_AUTO_TEST_SUITE_END()
