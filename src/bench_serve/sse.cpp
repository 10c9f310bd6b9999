#include "bench_serve/sse.h"

namespace chimera::bench_serve {

void SseParser::take_line(std::string_view line, std::vector<std::string>& events) {
  if (line.empty()) {
    if (has_data_) events.push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line.front() == ':') return;
  const size_t colon = line.find(':');
  const std::string_view field = line.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
  if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (field != "data") return;
  if (has_data_) data_ += '\n';
  data_.append(value);
  has_data_ = true;
}

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> events;
  size_t i = 0;
  if (last_cr_ && !bytes.empty() && bytes.front() == '\n') i = 1;  // the \n of a \r\n split across pieces
  last_cr_ = false;
  size_t start = i;
  for (; i < bytes.size(); ++i) {
    const char c = bytes[i];
    if (c != '\n' && c != '\r') continue;
    line_.append(bytes.substr(start, i - start));
    take_line(line_, events);
    line_.clear();
    if (c == '\r') {
      if (i + 1 < bytes.size()) {
        if (bytes[i + 1] == '\n') ++i;
      } else {
        last_cr_ = true;
      }
    }
    start = i + 1;
  }
  if (start < bytes.size()) line_.append(bytes.substr(start));
  return events;
}

std::string SseParser::finish() {
  std::vector<std::string> events;
  if (!line_.empty()) {
    take_line(line_, events);
    line_.clear();
  }
  if (has_data_) events.push_back(std::move(data_));
  data_.clear();
  has_data_ = false;
  return events.empty() ? std::string() : events.back();
}

}  // namespace chimera::bench_serve
