// How deeply a JSON text nests, counted on the text itself before it is parsed: nlohmann::json prints (and other
// walks of) a parsed value recursively, so a hostile file nested 100,000 deep would exhaust the stack when an error
// message quotes it. Readers refuse texts deeper than their format needs.
#pragma once

#include <cstddef>

namespace qmm::detail {

// The deepest nesting of objects and arrays in text[0, len) (brackets inside strings do not count; unbalanced text
// is left to the parser to report).
inline int json_depth(const char* text, std::size_t len) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < len; ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > deepest) deepest = depth;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace qmm::detail
