// The stop rule every token path applies (engine/token_step.h), as a table: no model,
// no processes. The expected finishes are OpenAI's finish_reason meanings written
// out: an end-of-generation token stops ("stop") unless ignore_eos, max_tokens cuts
// ("length"), and a last allowed token that is an eog says "stop".
#include <gtest/gtest.h>

#include "engine/token_step.h"

namespace duet {
namespace {

TEST(TokenStep, CheckStopTable) {
    struct Row {
        uint64_t max_tokens;
        bool stop_at_eog, eog;
        size_t n_out;
        Finish want;
    };
    const Row rows[] = {
        {16, true, false, 1, Finish::None},     // first token, room left
        {16, true, false, 15, Finish::None},    // one short of max_tokens
        {16, true, false, 16, Finish::Length},  // max_tokens reached
        {16, true, true, 3, Finish::Eog},       // eog mid-way
        {16, true, true, 16, Finish::Eog},      // eog as the last allowed token: "stop"
        {16, false, true, 3, Finish::None},     // ignore_eos: an eog is a token like any
        {16, false, true, 16, Finish::Length},  // ... and max_tokens still cuts
        {1, true, false, 1, Finish::Length},    // max_tokens 1: the first token ends it
        {1, false, false, 1, Finish::Length},
        {0, true, false, 1, Finish::Length},  // nothing allowed: whatever came ends it
    };
    for (const Row& r : rows)
        EXPECT_EQ(check_stop(StopRules{r.max_tokens, r.stop_at_eog}, r.eog, r.n_out), r.want)
            << "max " << r.max_tokens << " stop_at_eog " << r.stop_at_eog << " eog " << r.eog << " n_out " << r.n_out;
}

// min_tokens: outputs 1..min_tokens may not be an eog (n_out counts the outputs so
// far, before the pick); ignore_eos needs no ban.
TEST(TokenStep, EogBannedUntilMinTokens) {
    const StopRules r{16, true, 3};
    EXPECT_TRUE(eog_banned(r, 0));
    EXPECT_TRUE(eog_banned(r, 2));
    EXPECT_FALSE(eog_banned(r, 3));
    EXPECT_FALSE(eog_banned(StopRules{16, true, 0}, 0));
    EXPECT_FALSE(eog_banned(StopRules{16, false, 3}, 0));
}

TEST(TokenStep, FinishReasonsAreOpenAisWords) {
    EXPECT_EQ(finish_reason(Finish::Length), "length");
    EXPECT_EQ(finish_reason(Finish::Eog), "stop");
    EXPECT_EQ(finish_reason(Finish::StopString), "stop");
    EXPECT_EQ(finish_reason(Finish::Timeout), "timeout");
    EXPECT_EQ(finish_reason(Finish::Cancelled), "cancelled");
    EXPECT_EQ(finish_reason(Finish::None), "");
}

// emit: the backend's pick passes through to the stop rule; otherwise the greedy
// draw under the constraints (the row's order written out by hand: 3 > 1 > 0 > 2),
// and nothing left to choose is Failed.
TEST(TokenStep, EmitPicksUnderTheRulesThenAppliesTheStopRule) {
    const float row[4] = {0.5f, 2.0f, -1.0f, 3.0f};
    Sampler sampler;
    const SamplingParams greedy;  // temperature 0
    const std::vector<int32_t> prompt = {7}, output = {1, 2};
    auto eog3 = [](int32_t t) { return t == 3; };
    TokenRules rules{StopRules{16, true}, {}};
    auto at = [&](int32_t picked, const TokenRules& r, const std::vector<int32_t>& out) {
        return emit(sampler, row, 4, picked, greedy, r, prompt, out, eog3);
    };
    Emitted e = at(-1, rules, output);
    EXPECT_EQ(e.token, 3);
    EXPECT_EQ(e.finish, Finish::Eog) << "3 is the eog here";
    e = at(0, rules, output);  // a backend's pick is taken as it is
    EXPECT_EQ(e.token, 0);
    EXPECT_EQ(e.finish, Finish::None);
    const int32_t eog_ids[] = {3};
    const TokenBias plus10[] = {{0, 10.0f}};
    const uint32_t none[] = {0};
    rules.constraints.banned = eog_ids;  // min_tokens' ban
    e = at(-1, rules, output);
    EXPECT_EQ(e.token, 1);
    EXPECT_EQ(e.finish, Finish::None);
    rules.constraints.bias = plus10;
    EXPECT_EQ(at(-1, rules, output).token, 0) << "a bias of +10 lifts 0 over 1";
    rules.stop.max_tokens = 3;  // the third output is the last
    EXPECT_EQ(at(-1, rules, output).finish, Finish::Length);
    rules.constraints = {};
    rules.constraints.allowed = none;  // a grammar's set that allows nothing
    e = at(-1, rules, output);
    EXPECT_EQ(e.token, -1);
    EXPECT_EQ(e.finish, Finish::Failed);
}

}  // namespace
}  // namespace duet
