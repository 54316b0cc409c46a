// Pins the binary layout: a change to any size, offset or constant fails
// here until kLayoutVersion is bumped on purpose and these numbers updated.
#define BOOST_TEST_MODULE test_shm
#include <boost/test/unit_test.hpp>
#include <string>

#include "shmps/shm/layout.hpp"
#include "shmps/shm/segment.hpp"

using namespace shmps::shm;

BOOST_AUTO_TEST_SUITE(layout)

BOOST_AUTO_TEST_CASE(version_and_magic_are_pinned) {
  BOOST_TEST(kLayoutVersion == 16u);
  BOOST_TEST(kBufferInProcess == 1u);
  BOOST_TEST(kWeightsExportPresent == 1u);
  BOOST_TEST(kMagic == 0x31474553504d4853ull);
  BOOST_TEST(kMaxWorkersLimit == 256u);
  BOOST_TEST(kMaxBuffersLimit == 64u);
  BOOST_TEST(kAllTensors == 0xFFFFFFFFu);
}

BOOST_AUTO_TEST_CASE(struct_sizes_are_pinned) {
  BOOST_TEST(sizeof(SegmentHeader) == 4096u);
  BOOST_TEST(sizeof(ConfigBlock) == 128u);
  BOOST_TEST(sizeof(TensorDesc) == 128u);
  BOOST_TEST(sizeof(BufferDesc) == 192u);
  BOOST_TEST(sizeof(StatsReply) == 256u);
  BOOST_TEST(sizeof(WorkerEntry) == 512u);
  BOOST_TEST(sizeof(LaneHeader) == 256u);
  BOOST_TEST(sizeof(Request) == 64u);
  BOOST_TEST(sizeof(Completion) == 128u);
  BOOST_TEST(sizeof(StatsBlock) == 2176u);
  BOOST_TEST(sizeof(Histogram) == 512u);
  BOOST_TEST(kHistogramBuckets == 60u);
  BOOST_TEST(sizeof(WeightsExportBlock) == 128u);
  BOOST_TEST(sizeof(WaitWord) == 8u);
}

BOOST_AUTO_TEST_CASE(field_offsets_are_pinned) {
  BOOST_TEST(offsetof(SegmentHeader, layout_version) == 8u);
  BOOST_TEST(offsetof(SegmentHeader, generation) == 24u);
  BOOST_TEST(offsetof(SegmentHeader, server_pid) == 32u);
  BOOST_TEST(offsetof(SegmentHeader, server_start_time) == 40u);
  BOOST_TEST(offsetof(SegmentHeader, server_state) == 48u);
  BOOST_TEST(offsetof(SegmentHeader, heartbeat_ns) == 56u);
  BOOST_TEST(offsetof(SegmentHeader, tensor_count) == 72u);
  BOOST_TEST(offsetof(SegmentHeader, worker_table_offset) == 80u);
  BOOST_TEST(offsetof(SegmentHeader, max_buffers) == 96u);
  BOOST_TEST(offsetof(SegmentHeader, completions_offset) == 120u);
  BOOST_TEST(offsetof(SegmentHeader, config) == 192u);
  BOOST_TEST(offsetof(SegmentHeader, doorbell) == 384u);
  BOOST_TEST(offsetof(SegmentHeader, server_wake) == 416u);
  BOOST_TEST(offsetof(SegmentHeader, weights_export) == 448u);
  BOOST_TEST(offsetof(SegmentHeader, reserved5) == 576u);
  BOOST_TEST(offsetof(WeightsExportBlock, dtype) == 4u);
  BOOST_TEST(offsetof(WeightsExportBlock, allocation_bytes) == 8u);
  BOOST_TEST(offsetof(WeightsExportBlock, weights_bytes) == 16u);
  BOOST_TEST(offsetof(WeightsExportBlock, device_uuid) == 24u);
  BOOST_TEST(offsetof(WeightsExportBlock, ipc_handle) == 40u);
  BOOST_TEST(offsetof(ConfigBlock, lr) == 8u);
  BOOST_TEST(offsetof(ConfigBlock, max_staleness) == 40u);
  BOOST_TEST(offsetof(ConfigBlock, staleness_policy) == 48u);
  BOOST_TEST(offsetof(TensorDesc, element_offset) == 104u);
  BOOST_TEST(offsetof(WorkerEntry, lease) == 16u);
  BOOST_TEST(offsetof(WorkerEntry, cancel_request) == 24u);
  BOOST_TEST(offsetof(WorkerEntry, pushes_applied) == 64u);
  BOOST_TEST(offsetof(WorkerEntry, stats_reply) == 128u);
  BOOST_TEST(offsetof(LaneHeader, head) == 64u);
  BOOST_TEST(offsetof(LaneHeader, data_ready) == 128u);
  BOOST_TEST(offsetof(LaneHeader, space_ready) == 192u);
  BOOST_TEST(offsetof(Request, worker_version) == 48u);
  BOOST_TEST(offsetof(Request, wait_ns) == 48u);
  BOOST_TEST(offsetof(Completion, flags) == 32u);
  BOOST_TEST(offsetof(Completion, message) == 64u);
  BOOST_TEST(offsetof(StatsBlock, workers_evicted) == 104u);
  BOOST_TEST(offsetof(StatsBlock, apply_threads) == 152u);
  BOOST_TEST(offsetof(StatsBlock, pulls_held) == 264u);
  BOOST_TEST(offsetof(StatsBlock, checkpoints_deferred) == 272u);
  BOOST_TEST(offsetof(StatsBlock, ipc_handles_opened) == 280u);
  BOOST_TEST(offsetof(StatsBlock, ipc_handles_closed) == 288u);
  BOOST_TEST(offsetof(StatsBlock, rejected) == 384u);
  BOOST_TEST(offsetof(WorkerEntry, pushes_scaled) == 120u);
  BOOST_TEST(offsetof(StatsBlock, apply_ns) == 640u);
  BOOST_TEST(offsetof(StatsBlock, queue_ns) == 1152u);
  BOOST_TEST(offsetof(StatsBlock, staleness) == 1664u);
  BOOST_TEST(offsetof(Histogram, buckets) == 32u);
}

BOOST_AUTO_TEST_CASE(enum_values_are_pinned) {
  BOOST_TEST(static_cast<uint32_t>(Opcode::kAttach) == 1u);
  BOOST_TEST(static_cast<uint32_t>(Opcode::kPush) == 5u);
  BOOST_TEST(static_cast<uint32_t>(Opcode::kPing) == 8u);
  BOOST_TEST(static_cast<uint32_t>(Opcode::kInit) == 9u);
  BOOST_TEST(kOpcodeMax == 9u);
  BOOST_TEST(static_cast<uint32_t>(Dtype::kBF16) == 3u);
  BOOST_TEST(static_cast<uint32_t>(ServerState::kStopped) == 4u);
  BOOST_TEST(static_cast<uint32_t>(WorkerState::kDetached) == 3u);
  BOOST_TEST(static_cast<uint32_t>(WorkerState::kReleasing) == 4u);
  BOOST_TEST(std::string(worker_state_name(4)) == "releasing");
  BOOST_TEST(worker_state_name(5) == nullptr);
  BOOST_TEST(static_cast<uint32_t>(StalenessPolicy::kScale) == 2u);
  BOOST_TEST(std::string(staleness_policy_name(1)) == "wait");
  BOOST_TEST(staleness_policy_name(3) == nullptr);
  BOOST_TEST(make_owner(7, WorkerState::kAttached) == ((uint64_t{7} << 32) | 2u));
}

BOOST_AUTO_TEST_CASE(histogram_buckets_are_log2) {
  BOOST_TEST(histogram_bucket(0) == 0u);
  BOOST_TEST(histogram_bucket(1) == 1u);
  BOOST_TEST(histogram_bucket(2) == 2u);
  BOOST_TEST(histogram_bucket(3) == 2u);
  BOOST_TEST(histogram_bucket(4) == 3u);
  BOOST_TEST(histogram_bucket(1023) == 10u);
  BOOST_TEST(histogram_bucket(1024) == 11u);
  BOOST_TEST(histogram_bucket(uint64_t{1} << 57) == 58u);
  BOOST_TEST(histogram_bucket(uint64_t{1} << 58) == kHistogramBuckets - 1);
  BOOST_TEST(histogram_bucket(~uint64_t{0}) == kHistogramBuckets - 1);
}

// A completion's reason is cut to 63 bytes and NUL-terminated, and a cut
// one is flagged; one that fits is not.
BOOST_AUTO_TEST_CASE(a_completion_message_says_whether_it_was_cut) {
  Completion c{};
  set_message(c, "short");
  BOOST_TEST(std::string(c.message) == "short");
  BOOST_TEST(c.flags == 0u);
  const std::string fits(63, 'a');
  set_message(c, fits);
  BOOST_TEST(std::string(c.message) == fits);
  BOOST_TEST(c.flags == 0u);
  set_message(c, fits + "bc");
  BOOST_TEST(std::string(c.message) == fits);
  BOOST_TEST(c.flags == kCompletionMessageCut);
  set_message(c, "short again");  // a held answer's reason replaced
  BOOST_TEST(c.flags == 0u);
}

BOOST_AUTO_TEST_CASE(geometry_is_pinned) {
  const Geometry g = compute_geometry(4, 16, 16, 64);
  BOOST_TEST(g.tensor_table_offset == 4096u);
  BOOST_TEST(g.worker_table_offset == 4096u + 4 * 128u);
  BOOST_TEST(g.worker_entry_size == 512u + 16 * 192u);
  BOOST_TEST(g.lanes_offset == 4608u + 16 * 3584u);
  BOOST_TEST(g.lane_stride == 256u + 64 * 64u + 64 * 8u);  // header, requests, publish_ns stamps
  BOOST_TEST(g.completion_stride == 256u + 64 * 128u);
  BOOST_TEST(g.stats_offset == g.completions_offset + 16 * g.completion_stride);
  BOOST_TEST(g.segment_size % 4096 == 0u);
  BOOST_TEST(g.worker_table_offset % 64 == 0u);
  BOOST_TEST(g.lanes_offset % 64 == 0u);
  BOOST_TEST(g.completions_offset % 64 == 0u);
  BOOST_TEST(g.stats_offset % 64 == 0u);
  // Every capacity keeps every section on a cache line (stamps of 2 and 4
  // slots are 16 and 32 bytes).
  for (const uint32_t cap : {2u, 4u, 8u, 65536u}) {
    const Geometry s = compute_geometry(1, 3, 1, cap);
    BOOST_TEST_CONTEXT("capacity " << cap) {
      BOOST_TEST(s.lane_stride % 64 == 0u);
      BOOST_TEST(s.lane_stride >= 256u + cap * 72u);
      BOOST_TEST(s.completions_offset % 64 == 0u);
      BOOST_TEST(s.stats_offset % 64 == 0u);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
