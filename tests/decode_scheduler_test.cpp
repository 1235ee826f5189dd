// Decode's plan (engine/decode_scheduler.h) and the prompt-lookup drafter
// (engine/drafter.h) as tables: no model, no processes. Each row of the shortage
// table is one branch of the policy the decode worker carries out, with the
// expected action written out from the policy's statement in the header.
#include <gtest/gtest.h>

#include <vector>

#include "engine/decode_scheduler.h"
#include "engine/drafter.h"

namespace duet {
namespace {

using A = DecodeStep::Action;
constexpr uint64_t kWait = 1000;

// A row: admitted order, class, positions wanted, blocks with them and with one.
DecodeRowView row(uint64_t admitted, uint32_t cls, int32_t want = 1, int64_t need = 1, int64_t need_one = 1) {
    DecodeRowView r;
    r.seq = {admitted, 100, cls};
    r.want = want;
    r.need = need;
    r.need_one = need_one;
    return r;
}

TEST(DecodeScheduler, RunsEveryRowWhenTheBlocksFit) {
    const std::vector<DecodeRowView> active = {row(1, 1, 1, 0, 0), row(2, 1, 5, 1, 0), row(3, 2, 1, 1, 1)};
    const DecodeStep s = plan_decode(active, {}, {2, true}, kWait);
    ASSERT_EQ(s.action, A::Run);
    ASSERT_EQ(s.rows.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(s.rows[i].seq, i);
    EXPECT_EQ(s.rows[0].n_tokens, 1);
    EXPECT_EQ(s.rows[1].n_tokens, 5);  // the verify row keeps its drafts
    EXPECT_EQ(s.rows[2].n_tokens, 1);
    EXPECT_EQ(plan_decode({}, {}, {0, true}, kWait).action, A::Idle);
}

// Drafts are optional work: the step that fits only without them runs every row
// with one position, and nobody is preempted for a draft.
TEST(DecodeScheduler, DraftsGoBeforeAnyoneIsPreempted) {
    const std::vector<DecodeRowView> active = {row(1, 1, 9, 2, 0), row(2, 1, 3, 1, 1)};
    const DecodeStep s = plan_decode(active, {}, {1, true}, kWait);
    ASSERT_EQ(s.action, A::Run);
    ASSERT_EQ(s.rows.size(), 2u);
    EXPECT_EQ(s.rows[0].n_tokens, 1);
    EXPECT_EQ(s.rows[1].n_tokens, 1);
    // Short even without them: the shortage policy, not a smaller step.
    EXPECT_EQ(plan_decode(active, {}, {0, true}, kWait).action, A::Preempt);
}

TEST(DecodeScheduler, ShortageTable) {
    struct Case {
        const char* what;
        std::vector<DecodeRowView> active;
        std::vector<DecodeSeqView> parked;
        DecodeArenaView arena;
        A action;
        size_t victim;
    };
    auto waited = [](DecodeRowView r, uint64_t ns, bool fits = true) {
        r.waited_ns = ns;
        r.fits_arena = fits;
        return r;
    };
    // clang-format off
    const std::vector<Case> cases = {
        {"a parked one of the same class gives its blocks first",
         {row(1, 1), row(5, 1)}, {{9, 100, 1}}, {0, true}, A::PreemptParked, 0},
        {"a parked one of a less urgent class too",
         {row(1, 1), row(5, 1)}, {{3, 100, 1}, {9, 100, 2}}, {0, true}, A::PreemptParked, 1},
        {"a parked one more urgent than the running victim keeps its blocks",
         {row(1, 1), row(5, 2)}, {{9, 100, 1}}, {0, true}, A::Preempt, 1},
        {"two running: the newest of the least urgent class gives way",
         {row(1, 2), row(5, 1), row(3, 2)}, {}, {0, true}, A::Preempt, 2},
        {"one class: the newest", {row(7, 0), row(2, 0)}, {}, {0, true}, A::Preempt, 0},
        {"alone, it fits, others hold blocks, waited less: it waits",
         {waited(row(1, 1), 0)}, {}, {0, true}, A::Wait, 0},
        {"alone, still in its wait", {waited(row(1, 1), kWait - 1)}, {}, {0, true}, A::Wait, 0},
        {"alone, waited the limit: it fails", {waited(row(1, 1), kWait)}, {}, {0, true}, A::Fail, 0},
        {"alone, nobody else holds blocks: waiting cannot help", {row(1, 1)}, {}, {0, false}, A::Fail, 0},
        {"alone, larger than the whole arena", {waited(row(1, 1), 0, false)}, {}, {0, true}, A::Fail, 0},
        {"alone, a parked one of its class gives first", {row(1, 0)}, {{4, 10, 0}}, {0, true}, A::PreemptParked, 0},
        {"alone, a parked critical one does not", {row(1, 1)}, {{4, 10, 0}}, {0, true}, A::Wait, 0},
    };
    // clang-format on
    for (const Case& c : cases) {
        const DecodeStep s = plan_decode(c.active, c.parked, c.arena, kWait);
        EXPECT_EQ(s.action, c.action) << c.what;
        EXPECT_EQ(s.victim, c.victim) << c.what;
        EXPECT_TRUE(s.rows.empty()) << c.what;
    }
}

std::vector<int32_t> propose(const std::vector<int32_t>& prompt, const std::vector<int32_t>& output, size_t k,
                             int min_ngram = 2, int max_ngram = 4) {
    std::vector<int32_t> out(k);
    out.resize(PromptLookupDrafter(min_ngram, max_ngram).propose(prompt, output, out));
    return out;
}

TEST(PromptLookupDrafter, ProposesWhatFollowedTheSuffixBefore) {
    using V = std::vector<int32_t>;
    // "... 5 6 7 8 9 ..." then output ends in 5 6: propose 7 8 9.
    EXPECT_EQ(propose({1, 5, 6, 7, 8, 9, 2}, {3, 5, 6}, 3), (V{7, 8, 9}));
    EXPECT_EQ(propose({1, 5, 6, 7, 8, 9, 2}, {3, 5, 6}, 2), (V{7, 8}));  // at most k
    // Runs to the end of what is known: the draft may reach into the output.
    EXPECT_EQ(propose({5, 6}, {7, 5, 6}, 8), (V{7, 5, 6}));
    // The longest suffix wins over a more recent shorter one: 4 6 matched at its
    // earlier place (followed by 1), not 6 alone (followed by 2).
    EXPECT_EQ(propose({4, 6, 1, 9, 6, 2}, {4, 6}, 1, 1, 4), (V{1}));
    // Of equal length, the most recent occurrence.
    EXPECT_EQ(propose({5, 6, 1, 5, 6, 2}, {5, 6}, 1), (V{2}));
    // The suffix spans the prompt's end and the output's start.
    EXPECT_EQ(propose({8, 9, 3, 0, 8}, {9}, 2), (V{3, 0}));
    // Nothing matches (or too short a match): nothing proposed.
    EXPECT_TRUE(propose({1, 2, 3}, {4, 5}, 4).empty());
    EXPECT_TRUE(propose({1, 2, 3}, {9, 3}, 4).empty());  // only a 1-gram matches; min_ngram 2
    EXPECT_TRUE(propose({}, {}, 4).empty());
    EXPECT_TRUE(propose({5, 6, 7}, {5, 6}, 0).empty());
}

std::vector<int32_t> pool_draft(const NgramPool& pool, const std::vector<int32_t>& history, size_t k,
                                int* matched = nullptr) {
    std::vector<int32_t> out(k);
    const Proposal p = pool.draft({}, history, out);
    out.resize(p.tokens);
    if (matched) *matched = p.matched;
    return out;
}

TEST(NgramPool, ProposesWhatFollowedTheLatestOccurrenceInEarlierSequences) {
    using V = std::vector<int32_t>;
    NgramPool pool(1024);
    EXPECT_TRUE(pool_draft(pool, {1, 2}, 4).empty());  // nothing added yet
    pool.add(V{10, 11, 12, 13, 14, 15});
    int matched = 0;
    EXPECT_EQ(pool_draft(pool, {7, 11, 12}, 3, &matched), (V{13, 14, 15}));
    EXPECT_EQ(matched, 2);
    EXPECT_EQ(pool_draft(pool, {10, 11, 12}, 2, &matched), (V{13, 14}));  // at most k; the 3-gram matched
    EXPECT_EQ(matched, 3);
    // The prompt and output together are the sequence; its suffix may span both.
    {
        V out(2);
        EXPECT_EQ(pool.draft(V{9, 12}, V{13}, out).tokens, 2u);
        EXPECT_EQ(out, (V{14, 15}));
    }
    // A sequence's end: nothing follows across it into the next sequence.
    pool.add(V{20, 21});
    EXPECT_TRUE(pool_draft(pool, {14, 15}, 4).empty());
    EXPECT_EQ(pool_draft(pool, {13, 14}, 4), (V{15}));
    // The latest occurrence wins at equal length; a longer match over a later one.
    pool.add(V{11, 12, 30, 31});
    EXPECT_EQ(pool_draft(pool, {5, 11, 12}, 4), (V{30, 31}));
    EXPECT_EQ(pool_draft(pool, {10, 11, 12}, 4), (V{13, 14, 15}));
    // Nothing matches, or only one token: nothing proposed.
    EXPECT_TRUE(pool_draft(pool, {40, 41}, 4).empty());
    EXPECT_TRUE(pool_draft(pool, {40, 12}, 4).empty());
    EXPECT_TRUE(pool_draft(pool, {11, 12}, 0).empty());
}

TEST(NgramPool, ItsMemoryIsFixedAndTheOldestTokensGiveWay) {
    using V = std::vector<int32_t>;
    NgramPool pool(64);
    const size_t bytes = pool.memory_bytes();
    EXPECT_EQ(bytes, 64 * sizeof(int32_t) + 256 * sizeof(uint64_t));  // a ring of 64, an index of 4 x 64
    pool.add(V{100, 101, 102, 103});
    // 2000 sequences of 9 tokens (and a separator each) through a ring of 64.
    for (int32_t i = 0; i < 2000; ++i) pool.add(V{i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7, i + 8});
    EXPECT_EQ(pool.memory_bytes(), bytes);
    EXPECT_EQ(pool.added(), 5u + 2000u * 10u);
    // Long overwritten: its index entries may remain, the ring's tokens do not.
    EXPECT_TRUE(pool_draft(pool, {100, 101}, 2).empty());
    // The newest sequences are there: 1999 2000 ... 2007 last.
    EXPECT_EQ(pool_draft(pool, {1999, 2000}, 3), (V{2001, 2002, 2003}));
    EXPECT_EQ(pool_draft(pool, {2005, 2006}, 8), (V{2007}));
}

TEST(NgramPool, AnIndexCollisionProposesNothingFalse) {
    // A pool whose index is far smaller than what is added: most n-grams' entries are
    // taken by others. Every proposal must still be what followed the suffix in some
    // added sequence still in the ring: checked against a plain search.
    using V = std::vector<int32_t>;
    NgramPool pool(512);
    std::vector<V> seqs;
    uint64_t x = 12345;
    auto rnd = [&x]() { return static_cast<int32_t>((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 60); };
    for (int i = 0; i < 300; ++i) {
        V s(8);
        for (auto& t : s) t = rnd();  // 16 token values: n-grams recur
        pool.add(s);
        seqs.push_back(s);
    }
    // The last 512 tokens of the ring: the last 56 sequences (9 positions each) and
    // the end of the one before.
    const std::vector<V> kept(seqs.end() - 57, seqs.end());
    int proposed = 0;
    for (int q = 0; q < 2000; ++q) {
        const V h{rnd(), rnd(), rnd()};
        int matched = 0;
        const V got = pool_draft(pool, h, 3, &matched);
        if (got.empty()) continue;
        ++proposed;
        // Some kept sequence has the matched suffix followed by exactly these tokens.
        bool found = false;
        for (const V& s : kept)
            for (size_t i = 0; i + static_cast<size_t>(matched) < s.size() && !found; ++i) {
                if (!std::equal(h.end() - matched, h.end(), s.begin() + static_cast<std::ptrdiff_t>(i))) continue;
                const size_t from = i + static_cast<size_t>(matched);
                const V after(s.begin() + static_cast<std::ptrdiff_t>(from),
                              s.begin() + static_cast<std::ptrdiff_t>(std::min(s.size(), from + 3)));
                found = after == got;
            }
        EXPECT_TRUE(found) << "a proposal no kept sequence makes";
    }
    EXPECT_GT(proposed, 100);
}

// The draft pace (engine/drafter.h DraftPace), step by step: what each step may
// draft, given what the previous verify rows kept. max_draft 4 throughout.
TEST(DraftPace, GrowsOnKeptDraftsShrinksOnMissesAndBacksOffWhenNothingIsKept) {
    DraftPace p;
    EXPECT_EQ(draft_budget(p, 4), 4);  // a new sequence starts at the maximum
    draft_verified(p, 4, 4, 2);        // two of four kept
    EXPECT_EQ(draft_budget(p, 4), 2);
    draft_verified(p, 4, 2, 2);  // all kept: one more
    EXPECT_EQ(draft_budget(p, 4), 3);
    draft_verified(p, 4, 1, 1);  // the drafter proposed fewer, all kept: from the cap
    EXPECT_EQ(draft_budget(p, 4), 4);
    draft_verified(p, 4, 4, 4);
    EXPECT_EQ(draft_budget(p, 4), 4);  // never past max_draft
    draft_verified(p, 4, 0, 0);        // nothing proposed: nothing learned
    EXPECT_EQ(draft_budget(p, 4), 4);

    draft_verified(p, 4, 4, 0);  // none kept: off, one step's wait
    EXPECT_EQ(draft_budget(p, 4), 0);
    EXPECT_EQ(draft_budget(p, 4), 1);  // then a probe of one token
    draft_verified(p, 4, 1, 0);        // failed: wait 1, then 2, 4, ... 32 steps
    int waited = 0;
    for (int expect_wait : {1, 2, 4, 8, 16, 32, 32}) {
        for (int i = 0; i < expect_wait; ++i)
            EXPECT_EQ(draft_budget(p, 4), 0) << "wait " << expect_wait << " step " << i;
        EXPECT_EQ(draft_budget(p, 4), 1) << "probe after " << expect_wait;
        draft_verified(p, 4, 1, 0);
        waited += expect_wait;
    }
    EXPECT_EQ(waited, 95);
    // A probe that proposes nothing waits for nothing: the next step probes again.
    for (int i = 0; i < 32; ++i) EXPECT_EQ(draft_budget(p, 4), 0);
    EXPECT_EQ(draft_budget(p, 4), 1);
    draft_verified(p, 4, 0, 0);
    EXPECT_EQ(draft_budget(p, 4), 1);
    // A kept probe: drafting again, from two tokens, and the back-off starts over.
    draft_verified(p, 4, 1, 1);
    EXPECT_EQ(draft_budget(p, 4), 2);
    draft_verified(p, 4, 2, 0);
    EXPECT_EQ(draft_budget(p, 4), 0);
    EXPECT_EQ(draft_budget(p, 4), 1);
    draft_verified(p, 4, 1, 0);
    EXPECT_EQ(draft_budget(p, 4), 0);  // a wait of 1 again
    EXPECT_EQ(draft_budget(p, 4), 1);

    DraftPace off;
    EXPECT_EQ(draft_budget(off, 0), 0);  // drafting off
}

// Which drafts run (engine/drafter.h trim_drafts): each expected count worked out
// by hand from the rule in the header (a draft's chance accept^i against the pass's
// tokens per position so far, (rows + chances) / (fixed + rows + drafts)).
TEST(TrimDrafts, LikelyDraftsRunUnlikelyOnesOnlyWhereThePassIsCheap) {
    struct Case {
        const char* what;
        std::vector<DraftRowView> rows;
        double fixed;
        std::vector<int> want;
    };
    const Case cases[] = {
        // 1/5 = .2: .5 in; then 1.5/6 = .25, and .25 is not above it.
        {"one row, even odds", {{8, 0.5}}, 4, {1}},
        // .95^8 = .663 still beats (1 + .95 + ... + .95^7) / 12 = .561.
        {"one row copying", {{8, 0.95}}, 4, {8}},
        // 8/12 = .667: no even-odds draft beats what eight rows yield without one.
        {"eight rows, even odds", std::vector<DraftRowView>(8, {4, 0.5}), 4, std::vector<int>(8, 0)},
        // .9, .81, .729 in (ratio .685, .694, .696); .6561 is below .696, and so is .5.
        {"eight rows, one copying",
         {{4, 0.9}, {4, 0.5}, {4, 0.5}, {4, 0.5}, {4, 0.5}, {4, 0.5}, {4, 0.5}, {4, 0.5}},
         4,
         {3, 0, 0, 0, 0, 0, 0, 0}},
        // A large fixed cost: 1/65; .3, .09, .027 in (1.417/68 = .0208), .0081 out.
        {"one row, a costly pass", {{4, 0.3}}, 64, {3}},
        // Nothing proposed, nothing run; a row with no chance runs none.
        {"nothing proposed", {{0, 0.9}, {3, 0.0}}, 4, {0, 0}},
    };
    for (const Case& c : cases) {
        std::vector<int> keep(c.rows.size(), 7);  // every entry is written
        // A line: a pass of rows + k positions costs fixed + rows + k.
        std::vector<double> cost;
        int drafts = 0;
        for (const DraftRowView& r : c.rows) drafts += r.drafts;
        for (int k = 0; k <= drafts; ++k) cost.push_back(c.fixed + static_cast<double>(c.rows.size() + k));
        trim_drafts(c.rows, cost, keep);
        EXPECT_EQ(keep, c.want) << c.what;
    }
}

// Costs that are not a line (trim_drafts picks the best number of drafts, not the
// first where one more does not pay): each expected count worked out by hand.
TEST(TrimDrafts, APassWhoseCostStepsUpRunsDraftsOnlyWhereEnoughPayForTheStep) {
    // Eight rows at 7.5 (ms): 8 / 7.5 = 1.067 tokens per ms. With .92 drafts each at
    // the AMX host's measured steepness (a position past 8 at 18.1 / 16 = 1.13 ms,
    // more than 7.5 / 8), no number of them pays: 9 rows yield 8.92 / 8.63 = 1.034.
    const std::vector<DraftRowView> eight(8, {4, 0.92});
    std::vector<double> steep;
    for (int k = 0; k <= 32; ++k) steep.push_back(7.5 + 1.13 * k);
    std::vector<int> keep(8, 7);
    trim_drafts(eight, steep, keep);
    EXPECT_EQ(keep, std::vector<int>(8, 0));

    // A step: the first draft costs 4 (a new tile), the next seven 0.1 each.
    // Greedy would stop at the step (1 row: 1.95 / 5 < 1 / 1); the best prefix is all
    // eight of the one row's drafts at .95: (1 + 6.40) / (5 + 0.7) = 1.30 > 1.
    const std::vector<DraftRowView> one(1, {8, 0.95});
    std::vector<double> step = {1.0};
    for (int k = 1; k <= 8; ++k) step.push_back(5.0 + 0.1 * (k - 1));
    std::vector<int> keep1(1, 7);
    trim_drafts(one, step, keep1);
    EXPECT_EQ(keep1, std::vector<int>{8});

    // Equal yields: the fewest drafts. Two rows, one draft each at 1.0; a pass of
    // 3 or 4 positions costs in proportion to them (2 / 2 = 3 / 3 = 4 / 4).
    const std::vector<DraftRowView> sure(2, {1, 1.0});
    std::vector<int> keep2(2, 7);
    trim_drafts(sure, std::vector<double>{2.0, 3.0, 4.0}, keep2);
    EXPECT_EQ(keep2, (std::vector<int>{0, 0}));

    // No costs given: nothing runs.
    std::vector<int> keep3(1, 7);
    trim_drafts(one, std::span<const double>{}, keep3);
    EXPECT_EQ(keep3, std::vector<int>{0});
}

// The per-size times (PassCostModel::costs): a size seen is its decayed mean; sizes
// between seen ones are read on the line between them; beyond, the prior's shape
// (kPriorFixed + positions), below from the nearest seen size and above from the
// cheapest in that shape; never decreasing; a held-up pass clipped.
TEST(PassCostModel, CostsBySizeFromThePassesSeen) {
    PassCostModel none;
    std::vector<double> c(3);
    none.costs(1, c);  // the prior alone: 4 + s
    EXPECT_EQ(c, (std::vector<double>{5.0, 6.0, 7.0}));

    PassCostModel m;
    m.add(8, 7'000'000);
    m.add(8, 8'000'000);  // mean (0.8 * 7 + 8) / 1.8 ms
    m.add(16, 18'000'000);
    const double eight = (0.8 * 7'000'000 + 8'000'000) / 1.8;
    std::vector<double> got(25);
    m.costs(6, got);                                // sizes 6 .. 30
    EXPECT_DOUBLE_EQ(got[0], eight * 10.0 / 12.0);  // below: 6 from 8 by (4 + 6) / (4 + 8)
    EXPECT_DOUBLE_EQ(got[1], eight * 11.0 / 12.0);
    EXPECT_DOUBLE_EQ(got[2], eight);
    EXPECT_DOUBLE_EQ(got[6], eight + (18'000'000 - eight) * 4.0 / 8.0);  // size 12, between
    EXPECT_DOUBLE_EQ(got[10], 18'000'000);
    // Above every seen size: from the one cheapest in the prior's shape, 8
    // (eight / 12 = 0.63 ms against 18 / 20 = 0.9 ms for 16), but never below 16's.
    EXPECT_DOUBLE_EQ(got[11], 18'000'000);           // 17: eight * 21 / 12 = 13.2 ms
    EXPECT_DOUBLE_EQ(got[24], eight * 34.0 / 12.0);  // 30: 21.4 ms

    PassCostModel noisy;  // a larger pass measured cheaper: the smaller one's cost
    noisy.add(2, 5'000'000);
    noisy.add(3, 4'000'000);
    std::vector<double> n(2);
    noisy.costs(2, n);
    EXPECT_EQ(n, (std::vector<double>{5'000'000, 5'000'000}));

    PassCostModel held;  // a pass held up counts as kMaxJump times its size's mean
    held.add(4, 1'000'000);
    held.add(4, 10'000'000);
    std::vector<double> h4(1);
    held.costs(4, h4);
    EXPECT_DOUBLE_EQ(h4[0], (0.8 * 1'000'000 + 2'000'000) / 1.8);

    // The first pass of a size is clipped too, at kMaxJump times what the other
    // sizes say it costs: 9 from 8 by the shape, 10 ms * 13 / 12.
    PassCostModel first;
    first.add(8, 10'000'000);
    first.add(9, 50'000'000);
    std::vector<double> f9(1);
    first.costs(9, f9);
    EXPECT_DOUBLE_EQ(f9[0], 2 * 10'000'000 * 13.0 / 12.0);

    // Passes past kMaxSize count as kMaxSize by the shape, and larger sizes cost
    // more by it: (4 + 2048) / (4 + 2148) of 9 ms for 2048, then 2053, 2054.
    PassCostModel huge;
    huge.add(PassCostModel::kMaxSize + 100, 9'000'000);
    const double at_max = 9'000'000 * 2052.0 / 2152.0;
    std::vector<double> h(2);
    huge.costs(PassCostModel::kMaxSize + 5, h);
    EXPECT_DOUBLE_EQ(h[0], at_max * 2057.0 / 2052.0);
    EXPECT_DOUBLE_EQ(h[1], at_max * 2058.0 / 2052.0);
}

// A sequence's acceptance (DraftOdds): a half before anything is seen; hits and
// tries decay by 0.9 per try.
TEST(DraftOdds, CountsHitsAndTriesAndForgetsOldOnes) {
    DraftOdds o;
    EXPECT_DOUBLE_EQ(o.accept(), 0.5);
    o.seen(1, 1);
    EXPECT_DOUBLE_EQ(o.accept(), 2.0 / 3.0);
    o.seen(0, 1);  // hits .9, tries 1.9
    EXPECT_DOUBLE_EQ(o.accept(), 1.9 / 3.9);
    o.seen(0, 0);  // nothing tried: nothing changes
    EXPECT_DOUBLE_EQ(o.accept(), 1.9 / 3.9);
    DraftOdds row;
    row.seen(3, 4);  // a verify row: three kept, the fourth not
    EXPECT_DOUBLE_EQ(row.accept(), 4.0 / 6.0);
}

// The records a decode worker keeps for the sequences it preempted (DraftMemory):
// taken back once, by the same request only; at most kMax, the oldest kept going
// first, and a record kept again counts from its newest keep.
TEST(DraftMemory, GivesBackWhatWasKeptOnceAndForgetsTheOldest) {
    DraftMemory m;
    DraftRecord r;
    r.pace.cap = 3;
    r.odds.seen(2, 3);
    m.keep(7, r);
    EXPECT_FALSE(m.take(8).has_value());  // another request
    const auto got = m.take(7);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->pace.cap, 3);
    EXPECT_DOUBLE_EQ(got->odds.accept(), r.odds.accept());
    EXPECT_FALSE(m.take(7).has_value());  // once
    EXPECT_EQ(m.size(), 0u);

    // Key 0 kept first, then kMax others: key 0 is pushed out, key 1 stays. Key 1
    // kept again meanwhile would have stayed too; here key 2 is, at the end.
    DraftMemory b;
    for (uint64_t k = 0; k < DraftMemory::kMax; ++k) b.keep(k, r);
    EXPECT_EQ(b.size(), DraftMemory::kMax);
    DraftRecord again = r;
    again.pace.cap = 9;
    b.keep(2, again);                  // kept again: now the newest
    b.keep(DraftMemory::kMax, r);      // pushes out key 0
    b.keep(DraftMemory::kMax + 1, r);  // key 1
    b.keep(DraftMemory::kMax + 2, r);  // not key 2 (its first keep is stale): key 3
    EXPECT_EQ(b.size(), DraftMemory::kMax);
    EXPECT_FALSE(b.take(0).has_value());
    EXPECT_FALSE(b.take(1).has_value());
    EXPECT_FALSE(b.take(3).has_value());
    const auto two = b.take(2);
    ASSERT_TRUE(two.has_value());
    EXPECT_EQ(two->pace.cap, 9);
    EXPECT_TRUE(b.take(4).has_value());
}

// The pass-time fit (PassCostModel): exact on a line, the prior until positions
// vary, and never a cost that is not one.
TEST(PassCostModel, FitsTheFixedCostInPositionsAndFallsBackToThePrior) {
    PassCostModel line;
    EXPECT_EQ(line.fixed(), PassCostModel::kPriorFixed);
    for (int i = 0; i < 30; ++i) line.add(1 + i % 9, 800'000 + 200'000 * static_cast<uint64_t>(1 + i % 9));
    EXPECT_NEAR(line.fixed(), 4.0, 1e-6);  // a = 800 us, b = 200 us

    PassCostModel same;  // one stream, no drafts: every pass one position
    for (int i = 0; i < 30; ++i) same.add(1, 1'000'000 + 1000 * static_cast<uint64_t>(i));
    EXPECT_EQ(same.fixed(), PassCostModel::kPriorFixed);

    PassCostModel falling;  // longer passes faster: noise, not a cost
    for (int i = 0; i < 30; ++i) falling.add(1 + i % 9, 3'000'000 - 100'000 * static_cast<uint64_t>(1 + i % 9));
    EXPECT_EQ(falling.fixed(), PassCostModel::kPriorFixed);

    PassCostModel cheap;  // a / b = 0.1: clamped
    for (int i = 0; i < 30; ++i) cheap.add(1 + i % 9, 100'000 + 1'000'000 * static_cast<uint64_t>(1 + i % 9));
    EXPECT_EQ(cheap.fixed(), PassCostModel::kMinFixed);
}

// A request's "speculative" against the server's --draft-tokens (engine/drafter.h
// draft_limit): every mode, with and without its own maximum, on servers with
// drafting off and on.
TEST(DraftLimit, TheRequestsModeAndMaximumOverTheServersDefault) {
    struct Case {
        DraftMode mode;
        int request_max, server_max, want;
    };
    const Case cases[] = {
        {DraftMode::Server, 0, 0, 0},    // neither asks: off
        {DraftMode::Server, 0, 5, 5},    // the server's
        {DraftMode::Server, 0, 40, 16},  // never past the per-step maximum
        {DraftMode::Off, 0, 5, 0},       // the request turns the server's off
        {DraftMode::Auto, 0, 0, 8},      // on where the server's is off: the paced default
        {DraftMode::Auto, 0, 5, 5},      // on: the server's depth
        {DraftMode::Auto, 3, 0, 3},      // its own depth
        {DraftMode::Auto, 3, 12, 3},     // its own depth, below the server's
        {DraftMode::Auto, 12, 3, 12},    // or above it
        {DraftMode::Auto, 99, 0, 16},
    };
    for (const Case& c : cases)
        EXPECT_EQ(draft_limit(c.mode, c.request_max, c.server_max), c.want)
            << "mode " << static_cast<int>(c.mode) << " request " << c.request_max << " server " << c.server_max;
}

// The server's drafting where --draft-tokens was not given: on (8, paced) on the
// CPU, off on a GPU (its logits are not yet bitwise equal between pass sizes); a
// value given is kept on either.
TEST(DraftLimit, TheServersDefaultIsOnForTheCpuAndOffForAGpu) {
    EXPECT_EQ(server_draft_tokens(kDraftTokensUnset, false), 8);
    EXPECT_EQ(server_draft_tokens(kDraftTokensUnset, true), 0);
    EXPECT_EQ(server_draft_tokens(0, false), 0);
    EXPECT_EQ(server_draft_tokens(3, true), 3);
    EXPECT_EQ(server_draft_tokens(16, false), 16);
}

}  // namespace
}  // namespace duet
