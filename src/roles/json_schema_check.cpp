#include "roles/json_schema_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <vector>

namespace duet {

namespace {

using json = nlohmann::json;

// Keywords whose value is a sub-schema, a list of them, or a map of them.
constexpr std::string_view kOneSchema[] = {"additionalProperties", "propertyNames", "unevaluatedProperties", "items",
                                           "unevaluatedItems"};
constexpr std::string_view kSchemaList[] = {"prefixItems", "anyOf", "oneOf", "allOf"};
constexpr std::string_view kSchemaMap[] = {"properties", "patternProperties", "$defs", "definitions"};
// Keywords with a plain value.
constexpr std::string_view kPlain[] = {
    "type",      "required",  "minProperties", "maxProperties", "minItems",         "maxItems",         "enum",
    "const",     "$ref",      "minimum",       "maximum",       "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern",       "format"};
constexpr std::string_view kAnnotations[] = {"title",    "description", "default", "examples", "deprecated",
                                             "readOnly", "writeOnly",   "$schema", "$id",      "$comment"};
constexpr std::string_view kFormats[] = {
    "email",    "date", "time", "date-time",     "duration",     "ipv4",         "ipv6",
    "hostname", "uuid", "uri",  "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"};

template <size_t N>
bool among(std::string_view k, const std::string_view (&set)[N]) {
    for (std::string_view s : set)
        if (k == s) return true;
    return false;
}

// RFC 6901: "~" as "~0", "/" as "~1".
std::string pointer_part(std::string_view k) {
    std::string out;
    for (char c : k) {
        if (c == '~')
            out += "~0";
        else if (c == '/')
            out += "~1";
        else
            out += c;
    }
    return out;
}

// Keywords that constrain one type of value (with no "type" beside them the grammar
// engine would take the schema as any value), and those that decide the value alone
// (the grammar engine reads one of them and nothing beside it but annotations).
constexpr std::string_view kTyped[] = {"minLength",
                                       "maxLength",
                                       "pattern",
                                       "format",
                                       "minimum",
                                       "maximum",
                                       "exclusiveMinimum",
                                       "exclusiveMaximum",
                                       "multipleOf",
                                       "properties",
                                       "required",
                                       "additionalProperties",
                                       "patternProperties",
                                       "propertyNames",
                                       "minProperties",
                                       "maxProperties",
                                       "unevaluatedProperties",
                                       "items",
                                       "prefixItems",
                                       "minItems",
                                       "maxItems",
                                       "unevaluatedItems"};
constexpr std::string_view kBranch[] = {"$ref", "const", "enum", "anyOf", "oneOf", "allOf"};

bool of_type(const json& v, std::string_view t) {
    if (t == "string") return v.is_string();
    if (t == "integer")
        return v.is_number_integer() ||
               (v.is_number_float() && v.get<double>() == static_cast<double>(static_cast<int64_t>(v.get<double>())));
    if (t == "number") return v.is_number();
    if (t == "boolean") return v.is_boolean();
    if (t == "null") return v.is_null();
    if (t == "object") return v.is_object();
    if (t == "array") return v.is_array();
    return false;
}

bool of_types(const json& v, const json& type) {
    if (type.is_string()) return of_type(v, type.get<std::string>());
    if (type.is_array())
        for (const json& t : type)
            if (t.is_string() && of_type(v, t.get<std::string>())) return true;
    return false;
}

// What a schema's keywords mean together that the grammar engine would not
// enforce (xgrammar 0.2.9's json_schema_converter.cc, read for each): refused.
// `merged`: s is a branch of an allOf of several, which merge_object_all_of makes
// one object schema of before the grammar engine sees it: a branch may hold an
// object's keywords without its type, and require what another branch lists (the
// merge checks the result).
std::optional<std::string> combination(const json& s, const std::string& where, bool root, bool merged) {
    std::string branch;
    for (std::string_view k : kBranch)
        if (s.contains(k)) {
            if (!branch.empty())
                return fmt::format("'{}' and '{}' at {} cannot be combined: put them in an 'allOf' of one", branch, k,
                                   where);
            branch = std::string(k);
        }
    if (!branch.empty()) {
        for (const auto& [key, v] : s.items()) {
            if (key == branch || among(key, kAnnotations) || key == "$defs" || key == "definitions") continue;
            if (key == "type" && (branch == "enum" || branch == "const")) {
                const json values = branch == "const" ? json::array({s["const"]}) : s["enum"];
                if (values.is_array())
                    for (const json& x : values)
                        if (!of_types(x, v))
                            return fmt::format("'{}' at {} has {}, which is not of its 'type'", branch, where,
                                               x.dump());
                continue;
            }
            return fmt::format("'{}' beside '{}' at {} is not supported (the value is read from '{}' alone)", key,
                               branch, where, branch);
        }
    } else if (!s.contains("type") && !merged) {
        for (std::string_view k : kTyped)
            if (s.contains(k)) return fmt::format("'{}' at {} needs a 'type' beside it", k, where);
    }
    if (auto r = s.find("required"); r != s.end() && r->is_array() && !merged) {
        const json props = s.value("properties", json::object());
        for (const json& name : *r)
            if (!name.is_string() || !props.is_object() || !props.contains(name.get<std::string>()))
                return fmt::format("'required' at {} names {}, which is not in 'properties'", where, name.dump());
    }
    if (s.contains("format") && s.contains("pattern"))
        return fmt::format("'format' and 'pattern' at {} cannot be combined", where);
    if (s.contains("patternProperties") && s.contains("additionalProperties") && s["additionalProperties"].is_object())
        return fmt::format("'patternProperties' with an 'additionalProperties' schema at {} is not supported", where);
    if (s.contains("propertyNames") && s.value("additionalProperties", json(true)) == json(false))
        return fmt::format("'propertyNames' with 'additionalProperties': false at {} is not supported", where);
    if (!root && s.contains("$id")) return fmt::format("'$id' at {} is not supported below the root", where);
    return std::nullopt;
}

std::optional<std::string> check(const json& s, const std::string& at, int depth, bool merged = false) {
    if (depth > 64) return fmt::format("the schema nests deeper than 64 levels at {}", at.empty() ? "/" : at);
    if (s.is_boolean()) return std::nullopt;
    if (!s.is_object()) return fmt::format("the schema at {} is not an object or a boolean", at.empty() ? "/" : at);
    if (auto e = combination(s, at.empty() ? "/" : at, depth == 0, merged)) return e;
    for (const auto& [key, v] : s.items()) {
        const std::string here = at + "/" + pointer_part(key);
        if (among(key, kOneSchema)) {
            if (key == "items" && v.is_array())
                return fmt::format("'items' as a list at {} is not supported: use 'prefixItems'", here);
            if (auto e = check(v, here, depth + 1)) return e;
        } else if (among(key, kSchemaList)) {
            if (!v.is_array()) return fmt::format("'{}' at {} must be a list of schemas", key, at.empty() ? "/" : at);
            for (size_t i = 0; i < v.size(); ++i)
                if (auto e = check(v[i], here + "/" + std::to_string(i), depth + 1, key == "allOf" && v.size() > 1))
                    return e;
        } else if (among(key, kSchemaMap)) {
            if (!v.is_object()) return fmt::format("'{}' at {} must be an object", key, at.empty() ? "/" : at);
            for (const auto& [name, sub] : v.items())
                if (auto e = check(sub, here + "/" + pointer_part(name), depth + 1)) return e;
        } else if (key == "format") {
            if (!v.is_string() || !among(v.get<std::string>(), kFormats))
                return fmt::format("'format': {} at {} is not supported", v.dump(), at.empty() ? "/" : at);
        } else if (!among(key, kPlain) && !among(key, kAnnotations)) {
            return fmt::format("'{}' at {} is not supported", key, at.empty() ? "/" : at);
        }
    }
    return std::nullopt;
}

using ojson = nlohmann::ordered_json;

// What a branch of a merged allOf may hold: an object's properties, its required
// names, whether it is closed, and annotations.
constexpr std::string_view kMergeable[] = {"type", "properties", "required", "additionalProperties"};

// The schema a local "$ref" names ("#/$defs/x", "#/definitions/x"; the check
// refused any other kind before), or null: the fragment read as a JSON pointer
// (nlohmann's, which undoes RFC 6901's "~0" and "~1").
const ojson* referenced(const ojson& root, const std::string& ref) {
    if (ref.rfind("#/$defs/", 0) != 0 && ref.rfind("#/definitions/", 0) != 0) return nullptr;
    try {
        const ojson::json_pointer p(ref.substr(1));
        return root.contains(p) ? &root.at(p) : nullptr;
    } catch (const nlohmann::json::exception&) {  // a malformed escape
        return nullptr;
    }
}

std::optional<std::string> merge_all_of(ojson& s, const ojson& root, const std::string& at, int depth);

// The branches of s["allOf"] merged into one object schema (see the header).
std::optional<std::string> merge_branches(ojson& s, const ojson& root, const std::string& at, int depth) {
    const std::string where = at.empty() ? "/" : at;
    ojson props = ojson::object();
    std::vector<std::string> required;
    std::vector<std::vector<std::string>> closed;  // the names each closing branch lists
    bool open = false;                             // a branch said additionalProperties: true
    ojson& list = s["allOf"];
    for (size_t i = 0; i < list.size(); ++i) {
        const std::string here = at + "/allOf/" + std::to_string(i);
        ojson b = list[i];
        for (int hops = 0; b.is_object() && b.contains("$ref"); ++hops) {
            const ojson* t = b["$ref"].is_string() ? referenced(root, b["$ref"].get<std::string>()) : nullptr;
            if (!t || hops > 64) return fmt::format("'allOf' at {}: the '$ref' at {} cannot be merged", where, here);
            b = *t;
        }
        if (b.is_boolean()) {
            if (b.get<bool>()) continue;  // true: every value
            return fmt::format("'allOf' at {} has the schema false at {}: no value is valid", where, here);
        }
        if (auto e = merge_all_of(b, root, here, depth + 1)) return e;  // a branch that is itself an allOf
        for (const auto& [key, v] : b.items())
            if (!among(key, kMergeable) && !among(key, kAnnotations))
                return fmt::format(
                    "'allOf' at {}: '{}' at {} is not merged (only objects' properties, required and "
                    "additionalProperties are)",
                    where, key, here);
        if (b.value("type", ojson("object")) != "object")
            return fmt::format("'allOf' at {}: the schema at {} is not an object's (only objects are merged)", where,
                               here);
        // (Named: in a range-for over a temporary's items(), the temporary is gone first.)
        const ojson listed = b.value("properties", ojson::object()), needs = b.value("required", ojson::array());
        if (!listed.is_object() || !needs.is_array())
            return fmt::format("'allOf' at {}: 'properties' or 'required' at {} is not an object or a list", where,
                               here);
        if (auto a = b.find("additionalProperties"); a != b.end()) {
            if (!a->is_boolean())
                return fmt::format("'allOf' at {}: an 'additionalProperties' schema at {} is not merged", where, here);
            if (a->get<bool>()) {
                open = true;
            } else {
                closed.emplace_back();
                for (auto it = listed.begin(); it != listed.end(); ++it) closed.back().push_back(it.key());
            }
        }
        for (auto it = listed.begin(); it != listed.end(); ++it) {
            const std::string& name = it.key();
            const ojson& sub = it.value();
            if (!props.contains(name)) {
                props[name] = sub;
            } else if (props[name] != sub) {
                ojson both = {{"allOf", ojson::array({props[name], sub})}};
                if (auto e = merge_all_of(both, root, here + "/properties/" + pointer_part(name), depth + 1)) return e;
                props[name] = std::move(both);
            }
        }
        for (const ojson& r : needs)
            if (r.is_string() && std::find(required.begin(), required.end(), r.get<std::string>()) == required.end())
                required.push_back(r.get<std::string>());
    }
    // A closing branch admits its own properties only: a property it does not list
    // cannot be written, and the object cannot be valid if one is required.
    for (const auto& names : closed)
        for (auto it = props.begin(); it != props.end();) {
            if (std::find(names.begin(), names.end(), it.key()) != names.end()) {
                ++it;
                continue;
            }
            if (std::find(required.begin(), required.end(), it.key()) != required.end())
                return fmt::format(
                    "'allOf' at {} requires '{}', which a branch with 'additionalProperties': false "
                    "does not list: no object is valid",
                    where, it.key());
            it = props.erase(it);
        }
    for (const std::string& name : required)
        if (!props.contains(name))
            return fmt::format("'allOf' at {} requires '{}', which no branch lists in 'properties'", where, name);
    ojson merged = ojson::object();
    for (auto it = s.begin(); it != s.end(); ++it)
        if (it.key() != "allOf") merged[it.key()] = std::move(it.value());  // annotations, $defs
    merged["type"] = "object";
    merged["properties"] = std::move(props);
    if (!required.empty()) merged["required"] = required;
    if (!closed.empty())
        merged["additionalProperties"] = false;
    else if (open)
        merged["additionalProperties"] = true;
    s = std::move(merged);
    return std::nullopt;
}

std::optional<std::string> merge_all_of(ojson& s, const ojson& root, const std::string& at, int depth) {
    if (depth > 64 || !s.is_object()) return std::nullopt;
    for (auto it = s.begin(); it != s.end(); ++it) {
        const std::string& key = it.key();
        ojson& v = it.value();
        const std::string here = at + "/" + pointer_part(key);
        if (among(key, kOneSchema)) {
            if (auto e = merge_all_of(v, root, here, depth + 1)) return e;
        } else if (among(key, kSchemaList) && v.is_array()) {
            for (size_t i = 0; i < v.size(); ++i)
                if (auto e = merge_all_of(v[i], root, here + "/" + std::to_string(i), depth + 1)) return e;
        } else if (among(key, kSchemaMap) && v.is_object()) {
            for (auto m = v.begin(); m != v.end(); ++m)
                if (auto e = merge_all_of(m.value(), root, here + "/" + pointer_part(m.key()), depth + 1)) return e;
        }
    }
    if (auto a = s.find("allOf"); a != s.end() && a->is_array() && a->size() > 1)
        return merge_branches(s, root, at, depth);
    return std::nullopt;
}

}  // namespace

std::optional<std::string> unsupported_schema_keyword(const json& schema) { return check(schema, "", 0); }

std::optional<std::string> merge_object_all_of(ojson& schema) {
    const ojson root = schema;  // where "$ref"s point, as the client wrote it
    return merge_all_of(schema, root, "", 0);
}

}  // namespace duet
