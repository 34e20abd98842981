// The plain allocation-trace format, read as strictly as mempool-bench's reader
// (mempool-bench/src/trace.rs): the same traces are accepted, the same ones refused, at the same
// line and with the same message, so that a trace both sides replay is the same sequence of events.
//
//   a <id> <bytes> [<stream>]   allocate `bytes` (1 to 1 TiB) under the name `id` on `stream`
//                               (0 to INT64_MAX, 0 being the default stream, the value when absent)
//   f <id>                      free the allocation named `id`
//
// Fields are decimal digits only, separated by blanks (Unicode White_Space, as Rust's
// `split_whitespace`); blank lines are skipped but count in line numbers (the first line is 1). An
// id names one allocation from its `a` line to its `f` line and may be used again after that; a
// free of an id that is not live, or an allocation of one that is, is an error. The file must be
// UTF-8. Words in messages are quoted as Rust's `{:?}` quotes them for ASCII; other characters are
// printed as they are (Rust would escape the unprintable ones).
//
// Header only, standard C++17, no CUDA or torch: `trace_check.cpp` builds it anywhere.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace trace {

constexpr uint64_t kMaxBytes = uint64_t(1) << 40;     // 1 TiB
constexpr uint64_t kMaxStream = uint64_t(INT64_MAX);  // PyTorch records a stream as an int64

struct Op {
  bool alloc;
  uint64_t id;
  uint64_t bytes;   // alloc only
  uint64_t stream;  // alloc only
};

// What is wrong, as "line <n>: <problem>" (or a whole-file problem such as invalid UTF-8).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

inline const char* const kForms = "an allocation is `a <id> <bytes> [<stream>]`, a free is `f <id>`";

// Decodes one UTF-8 code point at s[i], advancing i; -1 if the bytes there are not valid UTF-8
// (overlong forms, surrogates and values above U+10FFFF included, as Rust's `from_utf8` refuses).
inline long decode(const std::string& s, size_t& i) {
  auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char b0 = byte(i);
  if (b0 < 0x80) return ++i, b0;
  int len = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : b0 >= 0xC0 ? 2 : 0;
  if (len == 0 || b0 > 0xF4 || i + len > s.size()) return -1;
  long cp = b0 & (0x7F >> len);
  for (int k = 1; k < len; k++) {
    unsigned char b = byte(i + k);
    if ((b & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (b & 0x3F);
  }
  static const long min_of_len[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_of_len[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return -1;
  i += len;
  return cp;
}

// Unicode White_Space: what Rust's `char::is_whitespace` (and so `split_whitespace`) splits on.
inline bool is_space(long c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The words of one line (the text is valid UTF-8 by now).
inline std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  size_t i = 0, start = std::string::npos;
  while (i < line.size()) {
    size_t at = i;
    bool space = is_space(decode(line, i));
    if (space && start != std::string::npos) out.push_back(line.substr(start, at - start)), start = std::string::npos;
    if (!space && start == std::string::npos) start = at;
  }
  if (start != std::string::npos) out.push_back(line.substr(start));
  return out;
}

// A word as Rust's `{:?}` prints a string (for ASCII).
inline std::string quoted(const std::string& w) {
  std::string q = "\"";
  for (unsigned char c : w) {
    if (c == '"' || c == '\\') q += '\\', q += static_cast<char>(c);
    else if (c == 0) q += "\\0";
    else if (c < 0x20 || c == 0x7F) {
      std::ostringstream hex;
      hex << "\\u{" << std::hex << static_cast<int>(c) << "}";
      q += hex.str();
    } else q += static_cast<char>(c);
  }
  return q + "\"";
}

enum class Field { Id, Bytes, Stream };

inline const char* name(Field f) { return f == Field::Id ? "<id>" : f == Field::Bytes ? "<bytes>" : "<stream>"; }
inline uint64_t max_of(Field f) { return f == Field::Id ? UINT64_MAX : f == Field::Bytes ? kMaxBytes : kMaxStream; }

struct Problem {
  std::string text;
};

inline bool digits(const std::string& s, size_t from = 0) {
  if (s.size() <= from) return false;
  for (size_t k = from; k < s.size(); k++)
    if (s[k] < '0' || s[k] > '9') return false;
  return true;
}

// Field `k` of `w` as a number from 0 to its field's largest value, else the problem.
inline uint64_t number(const std::vector<std::string>& w, size_t k, Field f) {
  if (k >= w.size()) throw Problem{std::string("missing ") + name(f) + ": " + kForms};
  const std::string& word = w[k];
  if (!digits(word)) {
    if (word[0] == '-' && digits(word, 1)) {
      if (f == Field::Stream)
        throw Problem{"<stream> " + word +
                      " is negative: a stream is a CUDA stream handle as PyTorch records it (0 is the default "
                      "stream), never below 0"};
      throw Problem{std::string(name(f)) + " " + word + " is negative"};
    }
    throw Problem{std::string(name(f)) + " " + quoted(word) + " is not a number (decimal digits expected)"};
  }
  uint64_t n = 0;
  bool over = false;
  for (char c : word) {
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (n > (UINT64_MAX - d) / 10) over = true;
    else n = n * 10 + d;
  }
  if (over || n > max_of(f)) {
    if (f == Field::Bytes)
      throw Problem{"<bytes> " + word + " is above 1 TiB (" + std::to_string(kMaxBytes) +
                    "), the largest allocation a trace may ask for: is the field corrupted?"};
    throw Problem{std::string(name(f)) + " " + word + " is above " + std::to_string(max_of(f))};
  }
  return n;
}

// One non-blank line's event, or the problem.
inline Op parse_words(const std::vector<std::string>& w) {
  Op op{false, 0, 0, 0};
  size_t last;
  if (w[0] == "a") {
    op.alloc = true;
    op.id = number(w, 1, Field::Id);
    op.bytes = number(w, 2, Field::Bytes);
    if (op.bytes == 0) throw Problem{"<bytes> is 0: an allocation is at least 1 byte"};
    op.stream = w.size() > 3 ? number(w, 3, Field::Stream) : 0;
    last = w.size() > 3 ? 3 : 2;
  } else if (w[0] == "f") {
    op.id = number(w, 1, Field::Id);
    last = 1;
  } else {
    throw Problem{"unknown event " + quoted(w[0]) + ": " + kForms};
  }
  if (w.size() > last + 1) throw Problem{"unexpected " + quoted(w[last + 1]) + " after the last field: " + kForms};
  return op;
}

}  // namespace detail

// Parses a whole trace and checks that it is a sequence a program could have made; throws Error
// naming the first line that is wrong.
inline std::vector<Op> parse(const std::string& text) {
  using namespace detail;
  for (size_t i = 0; i < text.size();)
    if (decode(text, i) < 0) throw Error("stream did not contain valid UTF-8");
  // Where an id stands: live since a line (> 0), or freed at one (< 0).
  std::unordered_map<uint64_t, long long> life;
  std::vector<Op> ops;
  size_t line = 0, begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    line++;
    std::vector<std::string> w = words(text.substr(begin, end - begin));
    begin = end + 1;
    if (w.empty()) continue;
    try {
      Op op = parse_words(w);
      auto it = life.find(op.id);
      if (op.alloc) {
        if (it != life.end() && it->second > 0)
          throw Problem{"allocation of id " + std::to_string(op.id) + ", which is live (allocated at line " +
                        std::to_string(it->second) +
                        ", not freed since): free it first, or name the new allocation otherwise"};
        life[op.id] = static_cast<long long>(line);
      } else {
        if (it == life.end())
          throw Problem{"free of id " + std::to_string(op.id) + ", which is not live (never allocated)"};
        if (it->second < 0)
          throw Problem{"free of id " + std::to_string(op.id) + ", which is not live (already freed at line " +
                        std::to_string(-it->second) + ")"};
        it->second = -static_cast<long long>(line);
      }
      ops.push_back(op);
    } catch (const Problem& p) {
      throw Error("line " + std::to_string(line) + ": " + p.text);
    }
  }
  return ops;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open the file");
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) throw Error("cannot read the file");
  return s.str();
}

// A trace made ready to replay, as mempool-bench's `Playback` makes it: each id becomes a slot of
// a table of live allocations (slots are reused, so the table is as long as the most allocations
// live at once), and each distinct stream value an index into the replay's streams: value 0 is
// index 0 (the default stream), the others follow in the order they first appear.
struct Plan {
  struct Step {
    bool alloc;
    uint32_t stream;  // alloc only: index into `values`
    size_t slot;
    size_t bytes;  // alloc only
  };
  std::vector<Step> steps;
  size_t slots = 0;
  std::vector<uint64_t> values{0};
};

inline Plan plan(const std::vector<Op>& ops) {
  Plan p;
  p.steps.reserve(ops.size());
  std::unordered_map<uint64_t, uint32_t> stream_of{{0, 0}};
  std::unordered_map<uint64_t, size_t> slot_of;
  std::vector<size_t> free_slots;
  for (const Op& op : ops) {
    if (op.alloc) {
      auto s = stream_of.find(op.stream);
      if (s == stream_of.end()) {
        s = stream_of.emplace(op.stream, static_cast<uint32_t>(p.values.size())).first;
        p.values.push_back(op.stream);
      }
      size_t slot;
      if (free_slots.empty()) slot = p.slots++;
      else slot = free_slots.back(), free_slots.pop_back();
      slot_of[op.id] = slot;  // parse() has checked that the id is not live
      p.steps.push_back({true, s->second, slot, static_cast<size_t>(op.bytes)});
    } else {
      auto it = slot_of.find(op.id);
      free_slots.push_back(it->second);
      p.steps.push_back({false, 0, it->second, 0});
      slot_of.erase(it);
    }
  }
  return p;
}

// The file name without its directories, as the output lines name a trace.
inline std::string base_name(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace trace
