// Boost.Beast lives in this translation unit only. Beast parses requests (header and body limits, keep-alive,
// Expect: 100-continue); responses are written as raw bytes through the socket, which keeps one write queue per
// connection for both whole responses and chunked streams.
#define BOOST_BEAST_USE_STD_STRING_VIEW
#include "server/http_server.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "core/error.h"
#include "server/api.h"
#include "server/sse.h"

namespace chimera::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::string status_line(int status) {
  const std::string_view reason = http::obsolete_reason(static_cast<http::status>(status));
  return fmt::format("HTTP/1.1 {} {}\r\n", status, reason.empty() ? "Unknown" : reason);
}

}  // namespace

std::string HttpRequest::header(const std::string& name) const {
  for (const auto& [k, v] : headers) {
    if (iequals(k, name)) return v;
  }
  return {};
}

std::string HttpRequest::path() const { return target.substr(0, target.find('?')); }

struct HttpServer::Impl {
  HttpServerConfig config;
  HttpHandler handler;
  net::io_context ioc;
  tcp::acceptor acceptor;
  std::vector<std::thread> threads;
  std::atomic<int64_t> active{0};
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;

  Impl(HttpServerConfig c, HttpHandler h)
      : config(std::move(c)), handler(std::move(h)), ioc(std::max(1, config.io_threads)), acceptor(net::make_strand(ioc)) {}
  void do_accept();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl& server)
      : stream_(std::move(socket)), write_timer_(stream_.get_executor()), server_(server) {}

  void start() {
    beast::error_code ignored;
    stream_.socket().non_blocking(true, ignored);  // only watch_disconnect() reads synchronously
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_header(); });
  }

  // ---- the Responder side (each runs on the strand; gen names the request it answers) ----
  void send(uint64_t gen, int status, const std::string& content_type, std::string body,
            const std::vector<std::pair<std::string, std::string>>& extra) {
    if (!live(gen) || started_) return;
    std::string head = status_line(status);
    head += fmt::format("Content-Type: {}\r\nContent-Length: {}\r\n", content_type, body.size());
    for (const auto& [k, v] : extra) head += fmt::format("{}: {}\r\n", k, v);
    head += close_after_ ? "Connection: close\r\n\r\n" : "Connection: keep-alive\r\n\r\n";
    started_ = true;
    enqueue(std::move(head) + body, /*last=*/true);
  }
  void start_stream(uint64_t gen, int status, const std::string& content_type) {
    if (!live(gen) || started_) return;
    std::string head = status_line(status);
    head += fmt::format("Content-Type: {}\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n",
                        content_type);
    head += close_after_ ? "Connection: close\r\n\r\n" : "Connection: keep-alive\r\n\r\n";
    started_ = streaming_ = true;
    enqueue(std::move(head), false);
  }
  void write(uint64_t gen, std::string data) {
    if (!live(gen) || !streaming_ || data.empty()) return;
    enqueue(http_chunk(data), false);
  }
  void end(uint64_t gen) {
    if (!live(gen) || !streaming_) return;
    enqueue(http_chunk(""), true);
  }
  void set_on_disconnect(uint64_t gen, std::function<void()> fn) {
    if (!live(gen)) {
      if (closed_ && fn) fn();  // already gone: tell at once
      return;
    }
    on_disconnect_ = std::move(fn);
  }
  auto executor() { return stream_.get_executor(); }

 private:
  bool live(uint64_t gen) const { return !closed_ && in_response_ && gen == gen_ && !end_queued_; }

  void read_header() {
    if (closed_) return;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(std::min<size_t>(server_.config.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(server_.config.max_body_bytes);
    stream_.expires_after(std::chrono::seconds(server_.config.request_timeout_s));
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec == http::error::header_limit) return reject(431, "the request's header is too large");
    if (ec == http::error::body_limit) {
      // Beast checks Content-Length against the limit with the header.
      return reject(413, fmt::format("the request body is larger than the limit of {} bytes",
                                     server_.config.max_body_bytes));
    }
    if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == net::error::eof ||
        ec == net::error::connection_reset || ec == net::error::operation_aborted) {
      return close();
    }
    if (ec) return reject(400, fmt::format("malformed HTTP request: {}", ec.message()));
    const auto len = parser_->content_length();
    if (len && *len > server_.config.max_body_bytes) {
      return reject(413, fmt::format("the request body has {} bytes, more than the limit of {}", *len,
                                     server_.config.max_body_bytes));
    }
    if (iequals(parser_->get()[http::field::expect], "100-continue")) {
      // curl and others wait for this before sending a large body.
      auto msg = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      net::async_write(stream_.socket(), net::buffer(*msg),
                       [self = shared_from_this(), msg](beast::error_code wec, size_t) {
                         if (wec) return self->close();
                         self->read_body();
                       });
      return;
    }
    read_body();
  }

  void read_body() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_request(ec); });
  }

  void on_request(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      return reject(413, fmt::format("the request body is larger than the limit of {} bytes",
                                     server_.config.max_body_bytes));
    }
    if (ec == beast::error::timeout || ec == net::error::eof || ec == net::error::connection_reset ||
        ec == http::error::end_of_stream || ec == net::error::operation_aborted) {
      return close();
    }
    if (ec) return reject(400, fmt::format("malformed HTTP request: {}", ec.message()));
    http::request<http::string_body> msg = parser_->release();
    parser_.reset();
    stream_.expires_never();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& f : msg) req.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    req.body = std::move(msg.body());
    close_after_ = !msg.keep_alive();
    begin_response();
    watch_disconnect();
    auto responder = make_responder();
    try {
      server_.handler(std::move(req), responder);
    } catch (const std::exception& e) {
      responder_error(500, fmt::format("internal error: {}", e.what()));
    }
  }

  void begin_response() {
    ++gen_;
    in_response_ = true;
    started_ = streaming_ = end_queued_ = false;
    on_disconnect_ = nullptr;
    server_.active.fetch_add(1);
  }
  void end_response() {
    if (!in_response_) return;
    in_response_ = false;
    on_disconnect_ = nullptr;
    server_.active.fetch_sub(1);
  }

  std::shared_ptr<Responder> make_responder();

  void responder_error(int status, const std::string& message) {
    if (!started_) {
      send(gen_, status, "application/json", ApiError(status, message).to_json().dump(), {});
    } else {
      close();
    }
  }

  // A request that cannot be parsed: answer it (OpenAI's error shape) and close the connection.
  void reject(int status, const std::string& message) {
    parser_.reset();
    stream_.expires_never();
    close_after_ = true;
    begin_response();
    send(gen_, status, "application/json", ApiError(status, message).to_json().dump(), {});
  }

  // While a response is pending, a read on the socket tells when the client goes away. Bytes that arrive
  // instead (a pipelined request) stay in buffer_ for the next read. The socket is non-blocking for this read:
  // a readiness that turns out spurious (no bytes, no end of file) re-arms the wait.
  void watch_disconnect() {
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen = gen_](beast::error_code ec) {
      if (ec || self->closed_ || gen != self->gen_ || !self->in_response_) {
        if (ec && ec != net::error::operation_aborted && gen == self->gen_ && self->in_response_) self->close();
        return;
      }
      beast::error_code rec;
      auto mb = self->buffer_.prepare(64 << 10);
      const size_t n = self->stream_.socket().read_some(mb, rec);
      if (rec == net::error::would_block || rec == net::error::try_again) return self->watch_disconnect();
      if (rec) return self->close();  // end of file or reset: the client is gone
      self->buffer_.commit(n);
      // Still there; a pipelined request waits in the buffer until this response ends.
    });
  }

  void enqueue(std::string data, bool last) {
    outq_.push_back(std::move(data));
    if (last) end_queued_ = true;
    if (!writing_) do_write();
  }

  void do_write() {
    writing_ = true;
    write_timer_.expires_after(std::chrono::seconds(server_.config.request_timeout_s));
    write_timer_.async_wait([self = shared_from_this(), seq = ++write_seq_](beast::error_code ec) {
      // A client that stops reading cannot hold the stream forever.
      if (!ec && self->writing_ && seq == self->write_seq_) self->close();
    });
    net::async_write(stream_.socket(), net::buffer(outq_.front()),
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_write(ec); });
  }

  void on_write(beast::error_code ec) {
    write_timer_.cancel();
    writing_ = false;
    if (ec) return close();
    outq_.pop_front();
    if (!outq_.empty()) return do_write();
    if (end_queued_ && in_response_) {
      end_response();
      if (close_after_) {
        beast::error_code ignored;
        stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
        return close();
      }
      // The disconnect watch is still pending on the socket; cancel it before the next read.
      beast::error_code ignored;
      stream_.socket().cancel(ignored);
      net::post(stream_.get_executor(), [self = shared_from_this()] { self->read_header(); });
    }
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    auto fn = std::move(on_disconnect_);
    on_disconnect_ = nullptr;
    const bool was_pending = in_response_ && !(end_queued_ && outq_.empty());
    end_response();
    beast::error_code ignored;
    write_timer_.cancel();
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
    if (was_pending && fn) fn();
  }

  beast::tcp_stream stream_;
  net::steady_timer write_timer_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpServer::Impl& server_;
  std::deque<std::string> outq_;
  std::function<void()> on_disconnect_;
  uint64_t gen_ = 0;
  uint64_t write_seq_ = 0;
  bool writing_ = false;
  bool close_after_ = false;
  bool in_response_ = false;
  bool started_ = false;
  bool streaming_ = false;
  bool end_queued_ = false;
  bool closed_ = false;
};

class SessionResponder : public Responder {
 public:
  SessionResponder(std::shared_ptr<Session> s, uint64_t gen) : s_(std::move(s)), gen_(gen) {}
  void send(int status, std::string content_type, std::string body,
            std::vector<std::pair<std::string, std::string>> extra) override {
    post_([s = s_, g = gen_, status, ct = std::move(content_type), b = std::move(body), e = std::move(extra)]() mutable {
      s->send(g, status, ct, std::move(b), e);
    });
  }
  void start_stream(int status, std::string content_type) override {
    post_([s = s_, g = gen_, status, ct = std::move(content_type)] { s->start_stream(g, status, ct); });
  }
  void write(std::string data) override {
    post_([s = s_, g = gen_, d = std::move(data)]() mutable { s->write(g, std::move(d)); });
  }
  void end() override {
    post_([s = s_, g = gen_] { s->end(g); });
  }
  void post(std::function<void()> fn) override { net::post(s_->executor(), std::move(fn)); }
  void on_disconnect(std::function<void()> fn) override {
    post_([s = s_, g = gen_, f = std::move(fn)]() mutable { s->set_on_disconnect(g, std::move(f)); });
  }

 private:
  // dispatch: runs inline when already on the strand (the handler's own thread), keeping the order of calls.
  template <typename F>
  void post_(F&& f) {
    net::dispatch(s_->executor(), std::forward<F>(f));
  }
  std::shared_ptr<Session> s_;
  uint64_t gen_;
};

std::shared_ptr<Responder> Session::make_responder() {
  return std::make_shared<SessionResponder>(shared_from_this(), gen_);
}

}  // namespace

void HttpServer::Impl::do_accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) {
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<Session>(std::move(socket), *this)->start();
    }
    do_accept();
  });
}

HttpServer::HttpServer(HttpServerConfig config, HttpHandler handler)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(handler))) {}

HttpServer::~HttpServer() { stop(); }

uint16_t HttpServer::listen() {
  beast::error_code ec;
  const auto addr = net::ip::make_address(impl_->config.host, ec);
  if (ec) invalid_input("--host {}: not an IP address ({})", impl_->config.host, ec.message());
  const tcp::endpoint ep(addr, impl_->config.port);
  impl_->acceptor.open(ep.protocol(), ec);
  if (!ec) impl_->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor.bind(ep, ec);
  if (!ec) impl_->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) invalid_input("--host {} --port {}: cannot listen: {}", impl_->config.host, impl_->config.port, ec.message());
  return impl_->acceptor.local_endpoint().port();
}

void HttpServer::start() {
  impl_->work.emplace(impl_->ioc.get_executor());
  impl_->do_accept();
  for (int i = 0; i < std::max(1, impl_->config.io_threads); ++i) {
    impl_->threads.emplace_back([this] { impl_->ioc.run(); });
  }
}

void HttpServer::stop_accepting() {
  net::post(impl_->acceptor.get_executor(), [this] {
    beast::error_code ignored;
    impl_->acceptor.close(ignored);
  });
}

int64_t HttpServer::active_requests() const { return impl_->active.load(); }

void HttpServer::stop() {
  if (!impl_) return;
  impl_->work.reset();
  impl_->ioc.stop();
  for (std::thread& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
  impl_->threads.clear();
}

}  // namespace chimera::server
