// Which JSON-schema keywords duet's structured outputs honour (engine/grammar.h,
// xgrammar underneath), checked before a request is admitted: any keyword outside
// this set is refused with a 400 naming it and where it is, never skipped. (What
// xgrammar itself would approximate — minLength with a pattern, multipleOf on a
// number, an allOf of several schemas other than objects', a oneOf whose branches
// overlap — is refused by check_grammar() from its warnings. An allOf of object
// schemas is merged first: merge_object_all_of below.)
//
// Honoured: type (a name or a list), properties, required, additionalProperties,
// patternProperties, propertyNames, minProperties, maxProperties,
// unevaluatedProperties, items, prefixItems, minItems, maxItems, unevaluatedItems,
// enum, const, anyOf, oneOf, allOf, $ref with $defs / definitions (recursion too),
// minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf, minLength,
// maxLength, pattern, and format: email, date, time, date-time, duration, ipv4,
// ipv6, hostname, uuid, uri, uri-reference, uri-template, json-pointer,
// relative-json-pointer. Annotations that constrain nothing are accepted: title,
// description, default, examples, deprecated, readOnly, writeOnly, $schema, $id,
// $comment. Everything else (not, if/then/else, contains, uniqueItems,
// dependentRequired, contentMediaType, nullable, ...) is refused.
//
// So are combinations the grammar engine would read only in part: a keyword beside
// one that decides the value alone ($ref, const, enum, anyOf, oneOf, allOf; only
// annotations, $defs, and a 'type' every enum value has may stand beside them), a
// type-specific keyword with no 'type', 'required' naming a property not in
// 'properties', 'format' with 'pattern', 'patternProperties' with an
// 'additionalProperties' schema, 'propertyNames' with 'additionalProperties': false,
// and '$id' below the root.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace duet {

// The first keyword of `schema` (or a sub-schema) that is not honoured, as a message
// naming it and its JSON pointer ("'uniqueItems' at /properties/tags is not
// supported"); nullopt when every keyword is.
std::optional<std::string> unsupported_schema_keyword(const nlohmann::json& schema);

// Every `allOf` of several object schemas in `schema` (one unsupported_schema_keyword
// passed), rewritten in place as the one object schema it means, since the grammar
// engine reads an allOf of one schema only: the properties of every branch in the
// order they first come (a property in several branches: their schemas merged the
// same way, or one of them where all are equal), the `required` names of every
// branch, and where a branch closes the object (`additionalProperties: false`) only
// the properties it lists, closed again. A branch may be a `$ref` into the root's
// `$defs` / `definitions`; annotations beside the allOf stay. Anything else in a
// branch (patternProperties, minProperties, a non-object type, ...) or a merge that
// leaves a required property out: not nullopt but why, naming where.
std::optional<std::string> merge_object_all_of(nlohmann::ordered_json& schema);

}  // namespace duet
