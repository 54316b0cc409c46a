// shmps-inspect --list: every shmps control segment on the host, one row
// each, from the objects named "shmps.*" in /dev/shm. A worker's buffer
// object ("shmps.<name>.p<pid>.<n>" beside its segment) is not a segment and
// is left out; any other object at a shmps name that is not a readable
// segment (foreign, unpublished, no permission) is listed with the reason,
// since that is what an operator looking for a stuck name needs to see.
#pragma once

#include <sys/types.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "inspect_model.hpp"
#include "inspect_source.hpp"

namespace shmps::inspect {

struct ListedSegment {
  std::string name;    // the server's --name; raw, as the file is named (the output escapes it)
  std::string source;  // "/dev/shm/shmps.<name>"
  uid_t owner_uid = 0;
  gid_t owner_gid = 0;
  mode_t mode = 0;
  uint64_t bytes = 0;               // the object's size
  std::optional<Snapshot> segment;  // absent when it could not be read as one
  ExitCode exit = ExitCode::kOk;    // why not, when absent
  std::string error;
};

// The segments in /dev/shm, sorted by name. Each is read as load_segment()
// and take_snapshot() read it, without load_segment's wait: an object
// still empty or unpublished is listed as such at once (kUnpublished).
// Errors: kPermission or kIo when /dev/shm cannot be listed (its message
// names the folder and the cause).
Result<std::vector<ListedSegment>> list_segments();

// A table: name, server pid, alive, stopped, dead or copy, state, parameters, workers
// attached (entries attached whose process lives, while the server lives),
// owner, mode; then one line per object that is not a readable segment.
// Names are escaped (printable_text), and cut with "..." past 40
// characters in the table (whole in the lines below it).
std::string render_list_text(const std::vector<ListedSegment>& list);
// {"segments": [{name, source, owner, mode, bytes, server_pid, server_alive,
// server_stopped, state, generation, parameters, model_bytes, workers_attached}, ...]},
// unreadable entries with "error" and "exit_code" instead of the segment's
// fields. Names, sources and errors escaped (printable_text), never cut.
// bytes, parameters and model_bytes are strings of decimal digits: any
// user may size an object, or write a segment's element counts, past 2^53.
nlohmann::json list_json(const std::vector<ListedSegment>& list);

}  // namespace shmps::inspect
