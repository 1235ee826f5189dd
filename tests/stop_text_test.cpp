// The front's stop strings and streaming hold-back (src/roles/stop_text.h), without
// a model: where the text is cut, what is released while a stop string could still
// arrive, and that no release splits a UTF-8 character.
#include <gtest/gtest.h>

#include "roles/stop_text.h"

using namespace duet;

namespace {

// Feeds pieces one at a time, taking what is safe after each; returns the
// concatenation of everything taken (with the final take) and checks each take.
std::string stream_all(StopText& s, const std::vector<std::string>& pieces, std::vector<std::string>* takes = nullptr) {
    std::string out;
    for (const std::string& p : pieces) {
        s.append(p);
        std::string t = s.take(false);
        if (takes) takes->push_back(t);
        out += t;
    }
    out += s.take(true);
    return out;
}

}  // namespace

TEST(StopText, CutsAtTheFirstStopStringAcrossPieces) {
    StopText s({"\n\n", "END"});
    EXPECT_FALSE(s.append("Hello wor"));
    EXPECT_FALSE(s.append("ld. E"));
    EXPECT_TRUE(s.append("ND and more"));
    EXPECT_TRUE(s.stopped());
    EXPECT_EQ(s.text(), "Hello world. ");
    EXPECT_FALSE(s.append("ignored"));
    EXPECT_EQ(s.text(), "Hello world. ");
    // Two stop strings in one piece: the earlier one wins.
    StopText t({"b", "a"});
    EXPECT_TRUE(t.append("xxabyy"));
    EXPECT_EQ(t.text(), "xx");
    // No stop strings: nothing is cut or held back.
    StopText u({});
    EXPECT_FALSE(u.append("abc"));
    EXPECT_EQ(u.take(false), "abc");
}

// While streaming, the last (longest stop string's length) bytes are held back, so
// a stop string split across tokens is never partly sent; the whole text arrives
// by the end whichever way it was cut into pieces.
TEST(StopText, HoldsBackWhatAStopStringCouldStillClaim) {
    StopText s({"STOP"});
    std::vector<std::string> takes;
    const std::string all = stream_all(s, {"abc", "defgh", "ST", "O", "P tail"}, &takes);
    EXPECT_EQ(all, "abcdefgh");
    EXPECT_EQ(takes[0], "");      // 3 bytes: all held
    EXPECT_EQ(takes[1], "abcd");  // 8 bytes: all but 4
    EXPECT_EQ(takes[2], "ef");    // "abcdefghST": a stop could start at 'g'
    EXPECT_EQ(takes[3], "g");
    EXPECT_EQ(takes[4], "h");     // stopped: the rest of the text goes
    for (const std::string& pieces : {std::string("one two STOP three"), std::string("no stop at all, end")}) {
        for (size_t cut = 1; cut < pieces.size(); ++cut) {
            StopText x({"STOP"});
            const std::string got = stream_all(x, {pieces.substr(0, cut), pieces.substr(cut)});
            const size_t at = pieces.find("STOP");
            EXPECT_EQ(got, at == std::string::npos ? pieces : pieces.substr(0, at)) << cut;
        }
    }
}

// A release never ends inside a UTF-8 character: the hold-back boundary backs off
// to the character's first byte.
TEST(StopText, NeverSplitsAUtf8Character) {
    const std::string text = "h\xC3\xA9llo w\xE2\x82\xAC\xF0\x9F\x98\x80rld";  // é, €, 😀
    for (size_t hold = 1; hold <= 4; ++hold) {
        StopText s({std::string(hold, '#')});
        std::string got;
        for (char ch : text) {
            s.append(std::string(1, ch));
            const std::string t = s.take(false);
            if (!t.empty()) {
                EXPECT_NE(static_cast<unsigned char>(text[got.size() + t.size()]) & 0xC0, 0x80)
                    << "a release ends inside a character (hold " << hold << ")";
            }
            got += t;
        }
        got += s.take(true);
        EXPECT_EQ(got, text);
    }
}

// Of two stop strings completed by one piece, the text ends before the one that
// begins first, whichever is listed first (one begun in an earlier piece too).
TEST(StopText, TheStopStringBegunFirstWins) {
    StopText s({"y", "xy"});
    EXPECT_FALSE(s.append("abx"));
    EXPECT_TRUE(s.append("yz"));
    EXPECT_EQ(s.text(), "ab");
    StopText t({"cd", "bcde"});
    EXPECT_FALSE(t.append("ab"));
    EXPECT_TRUE(t.append("cdef"));
    EXPECT_EQ(t.text(), "a");  // "bcde" begins at 1, "cd" at 2
}

// min_tokens (vLLM's rule): pieces appended without checking are not searched then,
// nor later; a stop string that ends in a checked piece is found wherever it began.
TEST(StopText, PiecesBeforeMinTokensAreNotSearched) {
    StopText s({","});
    EXPECT_FALSE(s.append(" four", false));
    EXPECT_FALSE(s.append(",", false));  // token 2 of min_tokens 4: not a stop
    EXPECT_FALSE(s.append(" five", false));
    EXPECT_TRUE(s.append(","));  // token 4: stops
    EXPECT_EQ(s.text(), " four, five");
    StopText t({"END"});
    EXPECT_FALSE(t.append("xxE", false));
    EXPECT_TRUE(t.append("ND yy"));  // begun before checking, ended in a checked piece
    EXPECT_EQ(t.text(), "xx");
    StopText u({"ab"});
    EXPECT_FALSE(u.append("ab", false));
    EXPECT_FALSE(u.append("c"));  // the one in the unchecked piece is not found later
    EXPECT_TRUE(u.append("ab"));
    EXPECT_EQ(u.text(), "abc");
    // Nothing held back is lost: an unchecked text streams as any other.
    EXPECT_EQ(u.take(true), "abc");
}
