// Drafts for verify rows (engine/decode_scheduler.h): tokens a sequence is likely to
// produce next, proposed before the pass that checks them. A draft costs a position
// in the pass and never changes the output: the worker keeps a drafted token only
// when the draw at its position (the same draw plain decoding makes, keyed by seed
// and position, over logits that do not depend on the row's length: the invariance
// contract) picked it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace duet {

// A draft: how many tokens were written, and how long the suffix of the sequence
// was that the drafter matched to find them (a longer match: a likelier draft).
struct Proposal {
    size_t tokens = 0;
    int matched = 0;
};

class Drafter {
public:
    virtual ~Drafter() = default;
    // Up to out.size() tokens to follow `output` (the sequence's tokens so far:
    // prompt then output), written to out.
    virtual Proposal draft(std::span<const int32_t> prompt, std::span<const int32_t> output,
                           std::span<int32_t> out) const = 0;
    size_t propose(std::span<const int32_t> prompt, std::span<const int32_t> output, std::span<int32_t> out) const {
        return draft(prompt, output, out).tokens;
    }
};

// Prompt lookup: the longest suffix of the sequence (max_ngram tokens down to
// min_ngram) that occurred earlier in its prompt or output, most recent occurrence
// first; the tokens that followed it there are the draft. Pays where output copies
// input (quoting, editing, extraction); proposes nothing otherwise.
class PromptLookupDrafter final : public Drafter {
public:
    PromptLookupDrafter(int min_ngram = 2, int max_ngram = 4) : min_(min_ngram), max_(max_ngram) {}
    Proposal draft(std::span<const int32_t> prompt, std::span<const int32_t> output,
                   std::span<int32_t> out) const override;

private:
    int min_, max_;
};

// A decode worker's pool by default: 2^18 tokens, 9 MiB (NgramPool::memory_bytes).
inline constexpr int64_t kDefaultDraftPoolTokens = int64_t{1} << 18;

// Earlier sequences' tokens as a corpus for drafts, shared by every sequence of a
// decode worker: the outputs it finished, where templated answers and agent loops
// repeat themselves across requests (the prompt is the sequence's own lookup's). A
// ring of the last `capacity` tokens added (sequences kept apart) and a
// direct-mapped index from each 2-, 3- and 4-token n-gram to the position after its
// latest occurrence; a proposal is the tokens that followed the latest occurrence of
// the longest suffix of the sequence found, checked against the ring (an index
// entry is a hint: a collision or an overwritten stretch proposes nothing). Its
// memory is fixed at construction, whatever runs: memory_bytes().
class NgramPool final : public Drafter {
public:
    static constexpr int kMinNgram = 2, kMaxNgram = 4;
    explicit NgramPool(size_t capacity_tokens);
    // One sequence's tokens (the oldest tokens give way once the ring is full).
    void add(std::span<const int32_t> tokens);
    Proposal draft(std::span<const int32_t> prompt, std::span<const int32_t> output,
                   std::span<int32_t> out) const override;
    size_t memory_bytes() const { return ring_.size() * sizeof(int32_t) + index_.size() * sizeof(uint64_t); }
    // Tokens added so far (the ring holds the last capacity() of them), and the
    // tokens it holds now (separators between sequences count as one each).
    uint64_t added() const { return end_; }
    size_t capacity() const { return ring_.size(); }
    size_t held() const { return static_cast<size_t>(std::min<uint64_t>(end_, ring_.size())); }

private:
    static constexpr int32_t kSeparator = -1;  // between two sequences: nothing follows across it
    void push(int32_t token);
    int32_t at(uint64_t pos) const { return ring_[pos % ring_.size()]; }
    std::vector<int32_t> ring_;    // token at absolute position p: ring_[p % capacity]
    uint64_t end_ = 0;             // the absolute position of the next token
    std::vector<uint64_t> index_;  // an n-gram's hash -> 1 + the position after it (0: none)
};

// How many tokens a sequence drafts next, from how its drafts fared: a verify row
// costs more than a step (on a compute-bound CPU a row of 1 + k positions costs
// nearly 1 + k steps: bench/RESULTS.md, "Many-row CPU products"), so a sequence whose
// drafts keep failing stops drafting, and one whose drafts are kept drafts more.
// Additive increase, back to what was kept on a miss; at 0 it waits, doubling the
// wait after each failed probe (1, 2, 4 ... kMaxWait steps), then probes with one
// token. Never changes the output (a draft only ever costs positions).
struct DraftPace {
    static constexpr int kMaxWait = 32;
    int cap = -1;     // tokens it may draft next (-1: not yet set: the maximum)
    int wait = 0;     // steps left before it drafts again (cap 0)
    int backoff = 1;  // the next wait after a failed probe
};

// A sequence's record of how its drafts fare: the chance that a drafted token is
// kept when the drafts before it in the row were (its acceptance, alpha). Counted
// from its verify rows (each kept draft a hit; the first one not kept a miss), and
// from the first token of drafts it proposed but did not run, checked against the
// token drawn next; older counts decay, so it follows a sequence whose output
// changes from copying to writing. Starts at one half.
struct DraftOdds {
    static constexpr double kDecay = 0.9;  // per observation: about the last ten count
    double hits = 0, tries = 0;
    double accept() const { return (hits + 1.0) / (tries + 2.0); }
    // `kept` hits in `tried` tries.
    void seen(int kept, int tried);
};

// What a decode worker knew of the drafts of sequences it preempted (their pace and
// odds), kept for their return, so that a sequence swapped or recomputed does not
// start again from no record (a half, drafting at its maximum). Keyed by request
// (slot and generation); a sequence that comes back to another worker, or never,
// leaves its entry until kMax newer ones pushed it out (oldest first).
struct DraftRecord {
    DraftPace pace;
    DraftOdds odds;
};
class DraftMemory {
public:
    static constexpr size_t kMax = 1024;  // records (about 100 bytes each with the map and order)
    void keep(uint64_t key, const DraftRecord& r);
    // The record kept for key, taken out (nullopt: none).
    std::optional<DraftRecord> take(uint64_t key);
    size_t size() const { return records_.size(); }

private:
    struct Kept {
        DraftRecord record;
        uint64_t seq;  // its place in order_
    };
    std::unordered_map<uint64_t, Kept> records_;
    // (key, seq) in the order kept; an entry whose record was taken or kept again
    // since (another seq) stays until it reaches the front, and erases nothing.
    std::deque<std::pair<uint64_t, uint64_t>> order_;
    uint64_t next_seq_ = 0;
};

// What a pass costs. Two views of the worker's recent passes (each weighing kDecay
// of the next):
// - fixed(): time = a + b * positions fitted by least squares, a / b (the pass's
//   fixed cost, weights read once and barriers, in positions). Until the passes
//   seen vary enough in positions to fit, or when a fit is not a cost (a or b not
//   positive), kPriorFixed: the figure measured on a 2-core CPU (a verify row of 8
//   positions cost 2.41 one-position steps: a/b = 4, bench/RESULTS.md, "Many-row
//   CPU products"). A gauge on /metrics.
// - costs(): the time of a pass of each number of positions, from the passes of
//   that size (their mean, each weighing kSizeDecay of the next one of the size).
//   A line does not fit a CPU's passes: a product's cost steps where its kernels
//   change (8-token tiles), and past 8 rows a position can cost more than at 8
//   (an 8-row pass 7.5 ms and a 16-row one 18.1 ms on the AMX host, where the
//   line's 1.4 positions of fixed cost let eight streams draft and lose 7%).
//   Sizes not seen yet are read between the nearest seen ones (linearly), and
//   beyond them by the prior's shape, time proportional to kPriorFixed +
//   positions: below every seen size from the nearest one, above from the seen
//   size cheapest in that shape. So a size above every seen one looks as cheap as
//   the best seen (not as the largest, which may sit just past a step: 9 rows
//   cost 1.44x 8 on the AMX host, 32 rows 3.2x), trim_drafts tries it where it
//   would pay, and learns what it costs.
class PassCostModel {
public:
    static constexpr double kDecay = 0.98, kPriorFixed = 4.0, kMinFixed = 0.25, kMaxFixed = 64.0;
    static constexpr double kSizeDecay = 0.8;  // about the last five passes of a size count
    static constexpr double kMaxJump = 2.0;    // a pass counts as at most this times its size's mean
    static constexpr int64_t kMaxSize = 2048;  // sizes measured apart; larger ones scaled from it by the shape
    void add(int64_t positions, uint64_t ns);
    double fixed() const;
    // out[k]: the time (ns) of a pass of first + k positions (first >= 1), never
    // less than out[k - 1] (noise aside, more positions do not cost less).
    void costs(int64_t first, std::span<double> out) const;

private:
    double n_ = 0, x_ = 0, y_ = 0, xx_ = 0, xy_ = 0;
    // Per size s (index s - 1): decayed sums of time and of count.
    std::vector<double> size_ns_, size_n_;
};

// One row's drafts as trim_drafts weighs them: how many it proposed, and its
// acceptance (DraftOdds::accept).
struct DraftRowView {
    int drafts = 0;
    double accept = 0;
};

// How many of its proposed drafts each row runs in the pass (into keep, one per
// row), so that the pass yields the most tokens per unit of time: a row's i-th draft
// (from 1) is kept with chance accept^i. cost[k] is the time of the pass with k
// drafts (rows.size() + k positions), for k up to the drafts proposed. Drafts are
// ordered likeliest first (a row's in order; ties by row), and the pass runs the
// first k of them for the k that gives the most (rows + their chances) / cost[k],
// the fewest where several give as much: with many rows or a steep cost, only likely
// drafts run; alone and cheap, unlikely ones too; and a pass whose cost steps up
// runs none past the step unless enough follow to pay for it. Never changes the
// output (engine/decode_scheduler.h: a draft only costs positions).
void trim_drafts(std::span<const DraftRowView> rows, std::span<const double> cost, std::span<int> keep);

// Where a sequence's drafts came from: its own tokens (PromptLookupDrafter) or the
// worker's pool (NgramPool). Counted apart (duet_draft_tokens_total's drafter).
enum class DraftSource : uint8_t { Sequence = 0, Pool = 1 };
inline constexpr int kDraftSources = 2;
inline const char* draft_source_name(DraftSource s) { return s == DraftSource::Pool ? "pool" : "sequence"; }

// A request's say in drafting (its "speculative" field): the server's default
// (--draft-tokens), none, or drafts paced by DraftPace up to its own maximum.
enum class DraftMode : uint8_t { Server = 0, Off = 1, Auto = 2 };
inline constexpr int kMaxDraftTokens = 16;  // per sequence and step, a request's or the server's
// Auto without a maximum where the server's default is off, and the CPU server's
// default: the paced depth that did best on the input-grounded prompts and held open
// chat's speed (bench/RESULTS.md, "Paced drafts").
inline constexpr int kAutoDraftTokens = 8;

// The server's drafting where none was asked for (--draft-tokens not given: -1):
// paced drafts up to kAutoDraftTokens on the CPU, whose logits for a verify row are
// bitwise those of single steps, so the output is the same (bench/RESULTS.md,
// "Speculation on by default"); off on a GPU, whose logits still differ between
// pass sizes (about 1e-3 relative, cuda_backend), where drafts could change it.
inline constexpr int kDraftTokensUnset = -1;
inline int server_draft_tokens(int given, bool gpu) { return given >= 0 ? given : gpu ? 0 : kAutoDraftTokens; }

// The most tokens a sequence drafts per step: `request_max` (0: not given) under
// Auto, else the server's `server_max` (0: off), none under Off.
int draft_limit(DraftMode mode, int request_max, int server_max);

// Up to how many tokens to draft at this step (0: none), at most max_draft; counts
// one step of a wait down.
int draft_budget(DraftPace& p, int max_draft);
// After a verify row of `drafted` drafted tokens, `accepted` of them kept.
void draft_verified(DraftPace& p, int max_draft, int drafted, int accepted);

}  // namespace duet
