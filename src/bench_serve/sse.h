// An incremental Server-Sent Events parser (the WHATWG event-stream format the OpenAI streaming API uses):
// bytes arrive in arbitrary pieces; lines end in \n, \r\n or \r; a blank line ends an event; `data:` lines
// (one optional space after the colon) are joined with \n; lines starting with ':' are comments (pings);
// other fields (event:, id:, retry:) are ignored. feed() returns the data of every event it completed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace chimera::bench_serve {

class SseParser {
 public:
  std::vector<std::string> feed(std::string_view bytes);
  // The data of an event the stream ended without a blank line after (servers that close right after
  // `data: [DONE]\n`); "" when none.
  std::string finish();

 private:
  void take_line(std::string_view line, std::vector<std::string>& events);
  std::string line_;       // the incomplete line so far
  std::string data_;       // the current event's data
  bool has_data_ = false;  // the current event had a data field
  bool last_cr_ = false;   // the previous piece ended in \r (its \n may start this one)
};

}  // namespace chimera::bench_serve
