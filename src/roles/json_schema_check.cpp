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

std::optional<std::string> check(const json& s, const std::string& at, int depth) {
    if (depth > 64) return fmt::format("the schema nests deeper than 64 levels at {}", at.empty() ? "/" : at);
    if (s.is_boolean()) return std::nullopt;
    if (!s.is_object()) return fmt::format("the schema at {} is not an object or a boolean", at.empty() ? "/" : at);
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
