// --device as text (server/src/device_spec.hpp): a UUID as nvidia-smi -L
// prints it names the device whose cudaDeviceProp::uuid has those bytes,
// whatever the case of the prefix and the digits, and the option check
// takes it in either case. No GPU needed: the CUDA backend's select_device()
// matches through the same function.
#define BOOST_TEST_MODULE test_device_spec
#include <boost/test/unit_test.hpp>
#include <string>

#include "device_spec.hpp"
#include "shmps/server/config.hpp"

using namespace shmps;
using namespace shmps::server;

namespace {

// The bytes of GPU-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4b.
constexpr uint8_t kUuid[16] = {0x6f, 0x80, 0xa1, 0xb2, 0x3c, 0x4d, 0x5e, 0x6f,
                               0x7a, 0x8b, 0x9c, 0x0d, 0x1e, 0x2f, 0x3a, 0x4b};
const std::string kAsNvidiaSmiPrintsIt = "GPU-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4b";

}  // namespace

BOOST_AUTO_TEST_SUITE(device_spec)

BOOST_AUTO_TEST_CASE(a_uuid_as_nvidia_smi_prints_it_names_its_device_in_any_case) {
  BOOST_TEST(device_uuid_text(kUuid) == kAsNvidiaSmiPrintsIt);
  BOOST_TEST(device_uuid_matches(kAsNvidiaSmiPrintsIt, kUuid));
  BOOST_TEST(device_uuid_matches("gpu-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4b", kUuid));
  BOOST_TEST(device_uuid_matches("GPU-6F80A1B2-3C4D-5E6F-7A8B-9C0D1E2F3A4B", kUuid));
  BOOST_TEST(device_uuid_matches("Gpu-6F80a1b2-3c4d-5E6F-7a8b-9c0d1e2f3a4B", kUuid));
  // Another device, a digit short, a digit more, no prefix: no match.
  BOOST_TEST(!device_uuid_matches("GPU-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4c", kUuid));
  BOOST_TEST(!device_uuid_matches("GPU-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4", kUuid));
  BOOST_TEST(!device_uuid_matches("GPU-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4b0", kUuid));
  BOOST_TEST(!device_uuid_matches("6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4b", kUuid));
  BOOST_TEST(!device_uuid_matches("", kUuid));
}

BOOST_AUTO_TEST_CASE(the_option_check_takes_a_uuid_in_either_case) {
  for (const std::string& spec : {kAsNvidiaSmiPrintsIt, std::string("gpu-6f80a1b2-3c4d-5e6f-7a8b-9c0d1e2f3a4b")}) {
    BOOST_TEST(is_device_uuid_spec(spec));
    ServerConfig config;
    config.name = "j";
    config.tensors = {{"w", {4}}};
    config.device = spec;
    const Status s = validate(config);
    BOOST_TEST(s.ok(), spec << ": " << s.message());
  }
  BOOST_TEST(!is_device_uuid_spec("GPU-"));
  BOOST_TEST(!is_device_uuid_spec("0"));
  ServerConfig ordinal;
  ordinal.name = "j";
  ordinal.tensors = {{"w", {4}}};
  ordinal.device = "0";
  BOOST_TEST(!validate(ordinal).ok());
}

BOOST_AUTO_TEST_SUITE_END()
