// SSE events and HTTP chunks, byte for byte.
#include "server/sse.h"

#include <gtest/gtest.h>

namespace chimera::server {
namespace {

TEST(ServerSse, EventFraming) {
  EXPECT_EQ(sse_event(nlohmann::json{{"a", "x\ny"}}), "data: {\"a\":\"x\\ny\"}\n\n");  // the newline is escaped
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
  // Invalid UTF-8 is replaced, never thrown on.
  EXPECT_EQ(sse_event(nlohmann::json{{"t", std::string("\xff")}}), "data: {\"t\":\"\xef\xbf\xbd\"}\n\n");
}

TEST(ServerSse, Chunks) {
  EXPECT_EQ(http_chunk("hello"), "5\r\nhello\r\n");
  EXPECT_EQ(http_chunk(std::string(26, 'x')), "1a\r\n" + std::string(26, 'x') + "\r\n");
  EXPECT_EQ(http_chunk(""), "0\r\n\r\n");
}

}  // namespace
}  // namespace chimera::server
