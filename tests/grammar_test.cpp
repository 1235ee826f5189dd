// Grammar-constrained decoding (engine/grammar.h) over the real model's vocabulary:
// the mask a worker applies equals every vocabulary token tried against the grammar
// one by one; a matcher follows any output exactly (rolled back and fed again, as
// after rejected drafts, a hand-off or a re-drive), so its mask is a function of the
// output alone; a walk that follows the masks ends in JSON that has what the schema
// requires, with only end-of-generation tokens allowed at the end. And what is
// refused: schema keywords outside the honoured set (roles/json_schema_check.h) and
// whatever xgrammar would drop or approximate (check_grammar).
#include <gtest/gtest.h>
#include <xgrammar/xgrammar.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <memory>
#include <random>

#include "engine/grammar.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "roles/json_schema_check.h"

namespace duet {
namespace {

const Tokenizer& tok() {
    static const std::unique_ptr<Tokenizer> t = [] {
        auto f = GgufFile::open(DUET_MODEL_PATH);
        if (!f) throw std::runtime_error(f.error().message);
        auto r = Tokenizer::from_gguf(**f);
        if (!r) throw std::runtime_error(r.error().message);
        return std::move(*r);
    }();
    return *t;
}

bool bit(std::span<const uint32_t> m, int32_t i) { return (m[static_cast<size_t>(i) / 32] >> (i % 32)) & 1u; }

// The reference: a matcher of its own over the same grammar, fed the output, then
// every vocabulary token tried in turn (accepted or not, then undone).
struct Reference {
    xgrammar::TokenizerInfo info;
    xgrammar::GrammarCompiler compiler;
    xgrammar::CompiledGrammar compiled;
    explicit Reference(const std::string& schema)
        : info(vocab(), xgrammar::VocabType::RAW, tok().n_vocab(), tok().eog_ids(), false),
          compiler(info, 1, false),
          compiled(compiler.CompileJSONSchema(schema, true, std::nullopt, std::nullopt, true, 16)) {}
    static std::vector<std::string> vocab() {
        std::vector<std::string> v;
        for (int32_t i = 0; i < tok().n_vocab(); ++i)
            v.push_back(tok().is_special(i) || tok().is_eog(i) ? std::string() : std::string(tok().piece(i)));
        return v;
    }
    std::vector<bool> allowed(const std::vector<int32_t>& output) {
        xgrammar::GrammarMatcher m(compiled);
        for (int32_t t : output) EXPECT_TRUE(m.AcceptToken(t));
        std::vector<bool> ok(static_cast<size_t>(tok().n_vocab()));
        for (int32_t t = 0; t < tok().n_vocab(); ++t) {
            if (m.IsTerminated()) break;
            if (m.AcceptToken(t)) {
                ok[static_cast<size_t>(t)] = true;
                m.Rollback(1);
            }
        }
        return ok;
    }
};

// A random walk that follows the masks: the next token is drawn among those
// allowed (end-of-generation only when nothing else is).
// prefer: single-byte tokens tried first, in this order, when allowed (a walk that
// closes what it opens; a random one may write an unbounded key for ever).
std::vector<int32_t> walk(GrammarSet& g, uint64_t key, const GrammarSpec& spec, std::vector<int32_t> out, int steps,
                          uint32_t seed, std::string_view prefer = "") {
    std::mt19937 rng(seed);
    std::vector<int32_t> preferred;
    for (char ch : prefer) preferred.push_back(tok().encode(std::string(1, ch), false, false).at(0));
    for (int s = 0; s < steps; ++s) {
        auto m = g.allowed(key, spec, out);
        EXPECT_TRUE(m.ok()) << m.error().message;
        if (!m.ok()) break;
        std::vector<int32_t> text, eog;
        for (int32_t t = 0; t < g.n_vocab(); ++t)
            if (bit(*m, t)) (tok().is_eog(t) ? eog : text).push_back(t);
        if (text.empty()) break;  // complete: only the end is left
        auto first = std::find_if(preferred.begin(), preferred.end(), [&](int32_t t) { return bit(*m, t); });
        out.push_back(first != preferred.end() ? *first : text[rng() % text.size()]);
    }
    return out;
}

const char* kPerson = R"({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
  "required": ["name", "age", "tags"], "additionalProperties": false})";

TEST(Grammar, TheMaskIsEveryTokenTheGrammarAcceptsAndNoOther) {
    GrammarSet g(tok(), tok().n_vocab());
    Reference ref(kPerson);
    const GrammarSpec spec{GrammarKind::JsonSchema, kPerson};
    std::vector<int32_t> out;
    for (int state = 0; state < 6; ++state) {
        auto m = g.allowed(1, spec, out);
        ASSERT_TRUE(m.ok()) << m.error().message;
        const std::vector<bool> want = ref.allowed(out);
        int64_t n = 0;
        for (int32_t t = 0; t < tok().n_vocab(); ++t) {
            ASSERT_EQ(bit(*m, t), want[static_cast<size_t>(t)])
                << "token " << t << " '" << tok().piece(t) << "' after '" << tok().decode(out, false) << "'";
            n += want[static_cast<size_t>(t)];
        }
        EXPECT_GT(n, 0);
        out = walk(g, 1, spec, out, 1 + state * 3, 17 + state);
    }
}

TEST(Grammar, AWalkEndsInJsonWithWhatTheSchemaRequiresThenOnlyTheEnd) {
    GrammarSet g(tok(), tok().n_vocab());
    const GrammarSpec spec{GrammarKind::JsonSchema, kPerson};
    for (uint32_t seed = 1; seed <= 3; ++seed) {
        const std::vector<int32_t> out = walk(g, seed, spec, {}, 400, seed);
        const std::string text = tok().decode(out, false);
        auto j = nlohmann::json::parse(text, nullptr, false);
        ASSERT_FALSE(j.is_discarded()) << text;
        ASSERT_TRUE(j.is_object()) << text;
        EXPECT_EQ(j.size(), 3u) << text;
        ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
        EXPECT_LE(j["name"].get<std::string>().size(), 12u) << text;
        ASSERT_TRUE(j.contains("age") && j["age"].is_number_integer()) << text;
        EXPECT_GE(j["age"].get<int>(), 0);
        EXPECT_LE(j["age"].get<int>(), 120);
        ASSERT_TRUE(j["tags"].is_array() && j["tags"].size() <= 3) << text;
        for (const auto& t : j["tags"]) EXPECT_TRUE(t == "a" || t == "bb" || t == "ccc") << text;
        auto m = g.allowed(seed, spec, out);
        ASSERT_TRUE(m.ok());
        for (int32_t t = 0; t < g.n_vocab(); ++t) EXPECT_EQ(bit(*m, t), tok().is_eog(t)) << t;
    }
    // Any JSON object (json_object).
    const std::vector<int32_t> out = walk(g, 9, {GrammarKind::JsonObject, ""}, {}, 300, 5, "\"}:1");
    auto j = nlohmann::json::parse(tok().decode(out, false), nullptr, false);
    EXPECT_TRUE(j.is_object()) << tok().decode(out, false);
}

// The mask is a function of the output: a matcher that saw another output (drafts
// rejected, a re-drive that chose otherwise) gives what a fresh one gives.
TEST(Grammar, AMatcherFollowsAnyOutputExactly) {
    const GrammarSpec spec{GrammarKind::JsonSchema, kPerson};
    GrammarSet g(tok(), tok().n_vocab());
    const std::vector<int32_t> a = walk(g, 1, spec, {}, 12, 3);
    const std::vector<int32_t> prefix(a.begin(), a.begin() + 5);
    const std::vector<int32_t> b = walk(g, 1, spec, prefix, 9, 4);  // from a's first 5 tokens, on the same matcher
    ASSERT_NE(a, b);
    GrammarSet fresh(tok(), tok().n_vocab());
    for (const std::vector<int32_t>* o : {&b, &a, &prefix, &b}) {
        auto m = g.allowed(1, spec, *o);
        auto f = fresh.allowed(2, spec, *o);
        ASSERT_TRUE(m.ok() && f.ok());
        EXPECT_TRUE(std::equal(m->begin(), m->end(), f->begin(), f->end()));
        fresh.forget(2);
    }
    EXPECT_GT(g.stats().rolled_back, 0u);
    EXPECT_EQ(g.n_matchers(), 1u);
    g.forget(1);
    EXPECT_EQ(g.n_matchers(), 0u);
    // An output the grammar does not allow (a letter where the object must open).
    auto bad = g.allowed(3, spec, tok().encode("x", false, false));
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find("not allowed by the request's grammar"), std::string::npos)
        << bad.error().message;
    // A request whose output is complete, its end token included (re-driven after its
    // last token was written): nothing may follow, and that is no error.
    std::vector<int32_t> done = walk(g, 5, spec, {}, 400, 6);
    done.push_back(tok().eog_ids().front());
    auto after = g.allowed(5, spec, done);
    ASSERT_TRUE(after.ok()) << after.error().message;
    EXPECT_TRUE(std::all_of(after->begin(), after->end(), [](uint32_t w) { return w == 0; }));
    // A grammar that does not compile is an error, not an empty mask.
    EXPECT_FALSE(g.allowed(4, {GrammarKind::Ebnf, "root ::= "}, {}).ok());
    EXPECT_EQ(g.stats().compiles, 2u) << "one schema, compiled once for all its requests, and the broken grammar";
    (void)done;
}

// Compiling ahead (decode, for requests still in prefill): the first allowed() of a
// grammar compiled ahead compiles nothing on its own thread, and its masks are those
// of a grammar compiled there; one still queued is compiled by allowed() itself, and
// a grammar that fails ahead fails in allowed() as it would have.
TEST(Grammar, AGrammarCompiledAheadIsTheOneAllowedCompiles) {
    const GrammarSpec spec{GrammarKind::JsonSchema, kPerson};
    GrammarSet ahead(tok(), tok().n_vocab());
    ahead.prefetch(spec);
    ahead.prefetch(spec);  // queued once
    ahead.wait_prefetched();
    GrammarSet::Stats s = ahead.stats();
    EXPECT_EQ(s.ahead, 1u);
    EXPECT_GT(s.ahead_ns, 0u);
    GrammarSet here(tok(), tok().n_vocab());
    const std::vector<int32_t> out = walk(here, 1, spec, {}, 10, 7);
    for (size_t n = 0; n <= out.size(); ++n) {
        const std::span<const int32_t> o(out.data(), n);
        auto m = ahead.allowed(1, spec, o);
        auto f = here.allowed(2, spec, o);
        ASSERT_TRUE(m.ok() && f.ok());
        EXPECT_TRUE(std::equal(m->begin(), m->end(), f->begin(), f->end())) << "after " << n << " tokens";
        here.forget(2);
    }
    s = ahead.stats();
    EXPECT_EQ(s.compiles, 0u) << "compiled ahead, not on the caller's thread";
    EXPECT_EQ(s.ahead_used, 1u);
    ahead.prefetch(spec);  // compiled already: nothing queued
    ahead.wait_prefetched();
    EXPECT_EQ(ahead.stats().ahead, 1u);
    // A grammar that does not compile: the error comes from allowed(), as without a
    // compile ahead.
    const GrammarSpec broken{GrammarKind::Ebnf, "root ::= "};
    ahead.prefetch(broken);
    ahead.wait_prefetched();
    EXPECT_FALSE(ahead.allowed(3, broken, {}).ok());
    EXPECT_EQ(ahead.stats().compiles, 1u);
    // Queued behind a long compile, then needed: allowed() compiles it itself (or
    // takes it compiled ahead, if the thread got to it first); either way, once.
    const GrammarSpec other{GrammarKind::JsonObject, ""};
    const GrammarSpec third{GrammarKind::Ebnf, R"(root ::= "yes" | "no")"};
    ahead.prefetch(other);
    ahead.prefetch(third);
    ASSERT_TRUE(ahead.allowed(4, third, {}).ok());
    ahead.wait_prefetched();
    s = ahead.stats();
    EXPECT_EQ(s.compiles + s.ahead_used, 1u + 1u + 1u) << "kPerson ahead, broken here, third once";
    ASSERT_TRUE(ahead.allowed(5, other, {}).ok());
    EXPECT_EQ(ahead.stats().compiles + ahead.stats().ahead_used, 4u);
}

TEST(Grammar, WhatXgrammarWouldDropOrApproximateIsRefused) {
    auto ok = [](GrammarKind k, const char* s) { return check_grammar({k, s}).ok(); };
    EXPECT_TRUE(ok(GrammarKind::JsonSchema, kPerson));
    EXPECT_TRUE(ok(GrammarKind::JsonObject, ""));
    EXPECT_TRUE(ok(GrammarKind::Ebnf, R"(root ::= "yes" | "no")"));
    EXPECT_TRUE(ok(GrammarKind::JsonSchema, R"({"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf":
        [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"})"))
        << "recursion";
    EXPECT_TRUE(ok(GrammarKind::JsonSchema, R"({"type": "string", "format": "date-time"})"));
    EXPECT_TRUE(ok(GrammarKind::JsonSchema, R"({"allOf": [{"type": "integer"}]})"));
    for (const char* s :
         {R"({"type": "string", "pattern": "[a-z]+", "minLength": 2})", R"({"type": "number", "multipleOf": 0.5})",
          R"({"allOf": [{"type": "object"}, {"required": ["a"]}]})", R"({"$ref": "#/$defs/none"})",
          R"({"type": "frob"})", "not json"}) {
        const Status st = check_grammar({GrammarKind::JsonSchema, s});
        EXPECT_FALSE(st.ok()) << s;
    }
    EXPECT_FALSE(ok(GrammarKind::Ebnf, "root ::= "));
    EXPECT_FALSE(ok(GrammarKind::Ebnf, R"(root ::= a
a[max_tokens=3] ::= "x"*)"))
        << "rule budgets are not exact";
}

TEST(Grammar, KeywordsOutsideTheHonouredSetAreNamedWithWhereTheyAre) {
    auto why = [](const char* s) { return unsupported_schema_keyword(nlohmann::json::parse(s)).value_or(""); };
    EXPECT_EQ(why(kPerson), "");
    EXPECT_EQ(why(R"({"title": "t", "description": "d", "$schema": "x", "examples": [{"not": 1}],
                      "default": {"uniqueItems": 1}, "enum": [{"if": 2}]})"),
              "")
        << "annotations and data are not keywords";
    EXPECT_EQ(why(R"({"type": "array", "uniqueItems": true})"), "'uniqueItems' at / is not supported");
    EXPECT_EQ(why(R"({"type": "object", "properties": {"a/b": {"type": "object", "properties": {"c": {"not": {}}}}}})"),
              "'not' at /properties/a~1b/properties/c is not supported");
    EXPECT_EQ(why(R"({"anyOf": [{"type": "string"}, {"if": {}}]})"), "'if' at /anyOf/1 is not supported");
    EXPECT_EQ(why(R"({"$defs": {"x": {"contains": {}}}})"), "'contains' at /$defs/x is not supported");
    EXPECT_EQ(why(R"({"type": "array", "items": {"type": "string", "format": "color"}})"),
              "'format': \"color\" at /items is not supported");
    EXPECT_EQ(why(R"({"type": "string", "nullable": true})"), "'nullable' at / is not supported");
    EXPECT_EQ(why(R"({"type": "array", "items": [{"type": "string"}]})"),
              "'items' as a list at /items is not supported: use 'prefixItems'");
    EXPECT_EQ(why(R"({"anyOf": {"type": "string"}})"), "'anyOf' at / must be a list of schemas");
    EXPECT_EQ(why("3"), "the schema at / is not an object or a boolean");
    // Combinations the grammar engine would read only in part.
    EXPECT_EQ(why(R"({"type": "string", "enum": ["ok", "toolong"], "maxLength": 3})"),
              "'maxLength' beside 'enum' at / is not supported (the value is read from 'enum' alone)");
    EXPECT_EQ(why(R"({"type": "string", "enum": ["a", 1]})"), "'enum' at / has 1, which is not of its 'type'");
    EXPECT_EQ(why(R"({"type": ["string", "integer"], "enum": ["a", 1], "description": "d"})"), "");
    EXPECT_EQ(why(R"({"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": [{"required": ["a"]}]})"),
              "'properties' beside 'anyOf' at / is not supported (the value is read from 'anyOf' alone)");
    EXPECT_EQ(why(R"({"$ref": "#/$defs/a", "required": ["x"], "$defs": {"a": {"type": "string"}}})"),
              "'required' beside '$ref' at / is not supported (the value is read from '$ref' alone)");
    EXPECT_EQ(why(R"({"enum": [1], "const": 1})"),
              "'const' and 'enum' at / cannot be combined: put them in an 'allOf' of one");
    EXPECT_EQ(why(R"({"properties": {"a": {"minLength": 3}}})"), "'properties' at / needs a 'type' beside it");
    EXPECT_EQ(why(R"({"type": "object", "properties": {"a": {"minLength": 3}}})"),
              "'minLength' at /properties/a needs a 'type' beside it");
    EXPECT_EQ(why(R"({"type": "object", "required": ["a"]})"),
              "'required' at / names \"a\", which is not in 'properties'");
    EXPECT_EQ(why(R"({"type": "string", "format": "email", "pattern": "a"})"),
              "'format' and 'pattern' at / cannot be combined");
    EXPECT_EQ(why(R"({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties":
                      {"type": "string"}})"),
              "'patternProperties' with an 'additionalProperties' schema at / is not supported");
    EXPECT_EQ(why(R"({"type": "object", "propertyNames": {"type": "string", "maxLength": 2}, "additionalProperties":
                      false})"),
              "'propertyNames' with 'additionalProperties': false at / is not supported");
    EXPECT_EQ(why(R"({"$id": "x", "type": "object", "properties": {"a": {"$id": "y", "type": "string"}}})"),
              "'$id' at /properties/a is not supported below the root");
}

// An allOf of object schemas: merged into the one object schema it means, which is
// what the grammar engine compiles (it reads an allOf of one only). Expected schemas
// are written out by hand.
TEST(Grammar, AnAllOfOfObjectSchemasIsMergedIntoTheOneItMeans) {
    using ojson = nlohmann::ordered_json;
    auto merged = [](const char* s) {
        ojson j = ojson::parse(s);
        EXPECT_EQ(unsupported_schema_keyword(nlohmann::json::parse(s)), std::nullopt) << s;
        if (auto e = merge_object_all_of(j)) return "error: " + *e;
        return j.dump();
    };
    // Properties in the order they first come, required names of every branch.
    EXPECT_EQ(merged(R"({"description": "d", "allOf": [
        {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["b"]},
        {"properties": {"c": {"type": "boolean"}, "a": {"type": "integer"}}, "required": ["c", "b"], "title": "t"}]})"),
              R"({"description":"d","type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"},)"
              R"("c":{"type":"boolean"}},"required":["b","c"]})");
    // A $ref branch; $defs stay for the refs inside; a closed branch closes the
    // merge and drops what it does not list.
    EXPECT_EQ(merged(R"({"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"},
        "note": {"type": "string"}}, "required": ["id"], "additionalProperties": false}},
        "allOf": [{"$ref": "#/$defs/base"}, {"type": "object", "properties": {"id": {"type": "integer"},
        "extra": {"type": "string"}}}]})"),
              R"({"$defs":{"base":{"type":"object","properties":{"id":{"type":"integer"},"note":{"type":"string"}},)"
              R"("required":["id"],"additionalProperties":false}},"type":"object","properties":{"id":{"type":)"
              R"("integer"},"note":{"type":"string"}},"required":["id"],"additionalProperties":false})");
    // A property in several branches: its schemas merged in turn where they are
    // objects' (nested allOfs first), refused where they differ otherwise.
    EXPECT_EQ(merged(R"({"type": "object", "properties": {"p": {"allOf": [
        {"type": "object", "properties": {"x": {"type": "integer"}}},
        {"allOf": [{"type": "object", "properties": {"x": {"type": "object", "properties": {"u": {"type": "null"}}}}},
                   {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]}]}}})"),
              "error: 'allOf' at /properties/p/allOf/1/properties/x: the schema at "
              "/properties/p/allOf/1/properties/x/allOf/0 is not an object's (only objects are merged)");
    EXPECT_EQ(merged(R"({"allOf": [{"type": "object", "properties": {"o": {"type": "object", "properties": {"u":
        {"type": "null"}}}}}, {"type": "object", "properties": {"o": {"type": "object", "properties": {"v":
        {"type": "null"}}, "required": ["v"]}}, "additionalProperties": true}]})"),
              R"({"type":"object","properties":{"o":{"type":"object","properties":{"u":{"type":"null"},"v":{"type":)"
              R"("null"}},"required":["v"]}},"additionalProperties":true})");
    EXPECT_EQ(merged(R"({"allOf": [{"type": "integer"}]})"), R"({"allOf":[{"type":"integer"}]})") << "one branch";
    // What a merge cannot keep exact: refused, naming where.
    EXPECT_EQ(merged(R"({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}},
        "additionalProperties": false}, {"type": "object", "properties": {"b": {"type": "string"}},
        "required": ["b"]}]})"),
              "error: 'allOf' at / requires 'b', which a branch with 'additionalProperties': false does not list: no "
              "object is valid");
    EXPECT_EQ(merged(R"({"allOf": [{"type": "object"}, {"type": "object", "minProperties": 1}]})"),
              "error: 'allOf' at /: 'minProperties' at /allOf/1 is not merged (only objects' properties, required and "
              "additionalProperties are)");
    EXPECT_EQ(merged(R"({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]})"),
              "error: 'allOf' at /: 'minimum' at /allOf/0 is not merged (only objects' properties, required and "
              "additionalProperties are)");
    EXPECT_EQ(merged(R"({"allOf": [{"type": "object"}, false]})"),
              "error: 'allOf' at / has the schema false at /allOf/1: no value is valid");
    // What it merged compiles exactly.
    ojson j = ojson::parse(R"({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]})");
    ASSERT_EQ(merge_object_all_of(j), std::nullopt);
    EXPECT_TRUE(check_grammar({GrammarKind::JsonSchema, j.dump()}).ok());
}

}  // namespace
}  // namespace duet
