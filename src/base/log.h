// A process's log lines, with a level and fields. On a terminal or a pipe a line is
// "duet <name>: <message>" on stderr, as it always was; when stderr is the journal
// (systemd sets JOURNAL_STREAM to its device and inode), each line goes to journald
// by its native protocol instead: MESSAGE, PRIORITY (the level), SYSLOG_IDENTIFIER
// (duet-<name>) and the caller's fields (e.g. DUET_REQUEST, DUET_REQUEST_ID), so that
// `journalctl -u duet-decode@0 -p warning` shows an operator what happened and
// `journalctl DUET_REQUEST=3.7` one request's story. A line journald refuses goes to
// stderr.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

namespace duet::log {

// syslog's numbers, as journald's PRIORITY.
enum class Level : int { Error = 3, Warning = 4, Notice = 5, Info = 6 };

// The name in this process's lines ("serve", "front", "prefill", "decode", or none:
// "duet: ..."); set once at start, before other threads log.
void set_name(std::string_view name);

using Field = std::pair<std::string_view, std::string>;  // name: upper case, digits, '_'; empty value: left out

void line(Level level, std::string_view message, std::initializer_list<Field> fields = {});

inline void error(std::string_view m, std::initializer_list<Field> f = {}) { line(Level::Error, m, f); }
inline void warning(std::string_view m, std::initializer_list<Field> f = {}) { line(Level::Warning, m, f); }
inline void notice(std::string_view m, std::initializer_list<Field> f = {}) { line(Level::Notice, m, f); }
inline void info(std::string_view m, std::initializer_list<Field> f = {}) { line(Level::Info, m, f); }

}  // namespace duet::log
