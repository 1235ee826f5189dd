// A request's data beyond its fixed parameters (RequestParams, 256 bytes): tables of
// any size up to the request table's bound, kept in the request's slot
// (shm::RequestTable::set_ext_data), so that every worker that takes the request
// reads the same — prefill, decode, a worker restarted after a crash (re-drive), a
// preempted request taken again — and a restarted front finds it as it left it.
// Nothing frees it: it belongs to the request (slot, generation) it was written
// for.
//
// Bytes: magic "dxrq", the format version, the body's length and its CRC32C, then
// the body: sections of (kind, length, bytes), little-endian. A reader refuses data
// that is damaged (the checksum), of another version, or with a kind it does not
// know: a request whose data a worker cannot honour fails rather than running
// without it. Kinds: the logit-bias table (1); a grammar, its kind and source (2);
// the stop strings, each its length and bytes (3).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/result.h"
#include "engine/grammar.h"
#include "roles/wire.h"
#include "shm/request_table.h"

namespace duet {

inline constexpr uint32_t kRequestDataVersion = 1;

struct RequestData {
    // logit_bias (OpenAI's): added to these tokens' logits before each pick
    // (WorkerBase::constraints); RequestParams::n_bias counts them.
    std::vector<RequestParams::Bias> bias;
    // A grammar its output must follow (response_format and the like): the tokens it
    // does not allow next are banned before each pick (engine/grammar.h).
    std::optional<GrammarSpec> grammar;
    // Stop strings (OpenAI's `stop`): the worker that chooses a token ends the request
    // when its text completes one (Finish::StopString; checked from token min_tokens
    // on, roles/stop_text.h); the front cuts the text there.
    std::vector<std::string> stops;
    bool empty() const { return bias.empty() && !grammar && stops.empty(); }
    friend bool operator==(const RequestData&, const RequestData&) = default;
};

std::vector<uint8_t> encode_request_data(const RequestData& d);
// Errors (Invalid) name what is wrong: too short, the magic, the version, the
// checksum, a section past the end, an unknown kind, a table of a bad size.
Result<RequestData> decode_request_data(std::span<const uint8_t> bytes);

// The data of request r, whose parameters say how many bytes it has
// (RequestParams::data_bytes; 0: none, an empty RequestData). Errors: missing (not
// written, or the slot no longer holds r), another length, or decode's.
Result<RequestData> read_request_data(const shm::RequestTable& t, shm::ReqRef r, const RequestParams& p);

}  // namespace duet
