// The SSE parser against the event-stream rules: any split of the bytes gives the same events.
#include "bench_serve/sse.h"

#include <gtest/gtest.h>

namespace chimera::bench_serve {
namespace {

std::vector<std::string> feed_in_pieces(const std::string& s, size_t piece) {
  SseParser p;
  std::vector<std::string> all;
  for (size_t i = 0; i < s.size(); i += piece) {
    for (auto& e : p.feed(std::string_view(s).substr(i, piece))) all.push_back(e);
  }
  if (std::string tail = p.finish(); !tail.empty()) all.push_back(tail);
  return all;
}

TEST(BenchServeSse, EventsSurviveEverySplit) {
  const std::string stream =
      ": ping\n\n"
      "data: {\"a\":1}\n\n"
      "data:{\"b\":2}\r\n\r\n"
      "event: message\nid: 7\ndata: line1\ndata: line2\n\n"
      "data: x\r\rdata: [DONE]\n\n";
  const std::vector<std::string> want = {"{\"a\":1}", "{\"b\":2}", "line1\nline2", "x", "[DONE]"};
  for (size_t piece = 1; piece <= stream.size(); ++piece) {
    EXPECT_EQ(feed_in_pieces(stream, piece), want) << "pieces of " << piece << " bytes";
  }
}

TEST(BenchServeSse, UnterminatedLastEventComesFromFinish) {
  SseParser p;
  EXPECT_TRUE(p.feed("data: [DONE]").empty());
  EXPECT_EQ(p.finish(), "[DONE]");
  SseParser q;
  EXPECT_TRUE(q.feed("data: {}\n").empty());
  EXPECT_EQ(q.finish(), "{}");
  SseParser r;
  EXPECT_EQ(r.finish(), "");
}

TEST(BenchServeSse, CommentsAndOtherFieldsMakeNoEvent) {
  SseParser p;
  EXPECT_TRUE(p.feed(": keep-alive\n\nretry: 10\n\nevent: x\n\n").empty());
  const auto ev = p.feed("data\n\n");  // a data field with no colon has an empty value
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], "");
}

}  // namespace
}  // namespace chimera::bench_serve
