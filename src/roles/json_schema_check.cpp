#include "roles/json_schema_check.h"

#include <fmt/format.h>

#include <string_view>

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
std::optional<std::string> combination(const json& s, const std::string& where, bool root) {
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
    } else if (!s.contains("type")) {
        for (std::string_view k : kTyped)
            if (s.contains(k)) return fmt::format("'{}' at {} needs a 'type' beside it", k, where);
    }
    if (auto r = s.find("required"); r != s.end() && r->is_array()) {
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

std::optional<std::string> check(const json& s, const std::string& at, int depth) {
    if (depth > 64) return fmt::format("the schema nests deeper than 64 levels at {}", at.empty() ? "/" : at);
    if (s.is_boolean()) return std::nullopt;
    if (!s.is_object()) return fmt::format("the schema at {} is not an object or a boolean", at.empty() ? "/" : at);
    if (auto e = combination(s, at.empty() ? "/" : at, depth == 0)) return e;
    for (const auto& [key, v] : s.items()) {
        const std::string here = at + "/" + pointer_part(key);
        if (among(key, kOneSchema)) {
            if (key == "items" && v.is_array())
                return fmt::format("'items' as a list at {} is not supported: use 'prefixItems'", here);
            if (auto e = check(v, here, depth + 1)) return e;
        } else if (among(key, kSchemaList)) {
            if (!v.is_array()) return fmt::format("'{}' at {} must be a list of schemas", key, at.empty() ? "/" : at);
            for (size_t i = 0; i < v.size(); ++i)
                if (auto e = check(v[i], here + "/" + std::to_string(i), depth + 1)) return e;
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

}  // namespace

std::optional<std::string> unsupported_schema_keyword(const json& schema) { return check(schema, "", 0); }

}  // namespace duet
