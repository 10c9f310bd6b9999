// Framing of what the server writes: server-sent events (one `data: <json>` event per chunk, a blank line after
// each, `data: [DONE]` last, as OpenAI streams) inside HTTP/1.1 chunked transfer encoding.
#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace chimera::server {

inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// One SSE event carrying `payload` as compact JSON (its dump has no newlines, so one data line suffices).
inline std::string sse_event(const nlohmann::json& payload) {
  return "data: " + payload.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n";
}

// One HTTP/1.1 chunk: hex size, CRLF, bytes, CRLF. An empty `data` is the last chunk ("0\r\n\r\n").
inline std::string http_chunk(std::string_view data) {
  return fmt::format("{:x}\r\n{}\r\n", data.size(), data);
}

}  // namespace chimera::server
