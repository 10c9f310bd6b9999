// The HTTP/1.1 server under `chimera serve`: Boost.Beast's parser on Asio, a few I/O threads, one strand per
// connection, keep-alive, and streaming responses in chunked transfer encoding. This header names no Boost type
// (only http_server.cpp includes Beast, which is heavy to compile); routes see an HttpRequest and answer
// through a Responder.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace chimera::server {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query as sent
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // The value of a header (case-insensitive name), "" when absent.
  std::string header(const std::string& name) const;
  // The path without the query string.
  std::string path() const;
};

// Answers one request. Every method may be called from any thread; the work runs on the connection's strand.
// After the connection is gone every call is a no-op.
class Responder {
 public:
  virtual ~Responder() = default;
  // A complete response.
  virtual void send(int status, std::string content_type, std::string body,
                    std::vector<std::pair<std::string, std::string>> extra_headers = {}) = 0;
  // A streaming response: the status line and headers (chunked), then write() pieces, then end().
  virtual void start_stream(int status, std::string content_type) = 0;
  virtual void write(std::string data) = 0;
  virtual void end() = 0;
  // Runs `fn` on the connection's strand (serialized with every other callback of this connection).
  virtual void post(std::function<void()> fn) = 0;
  // `fn` runs once, on the strand, when the client goes away before the response ended (disconnect, reset,
  // write timeout). Set it before the first write.
  virtual void on_disconnect(std::function<void()> fn) = 0;
};

using HttpHandler = std::function<void(HttpRequest request, std::shared_ptr<Responder> responder)>;

struct HttpServerConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0 = any free port (port() tells which)
  int32_t io_threads = 4;
  size_t max_body_bytes = size_t{32} << 20;  // larger -> 413
  size_t max_header_bytes = size_t{64} << 10;  // larger -> 431
  // A request's header and body must arrive within this (slow or idle clients are closed); also the longest
  // a keep-alive connection idles between requests, and the longest one write may wait on a client.
  int32_t request_timeout_s = 30;
};

class HttpServer {
 public:
  HttpServer(HttpServerConfig config, HttpHandler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;
  // Binds and listens (kInvalidInput naming --host / --port on failure); returns the bound port.
  uint16_t listen();
  // Runs the I/O threads; returns at once.
  void start();
  // Stops accepting new connections; in-flight responses go on.
  void stop_accepting();
  // Number of requests whose response has not ended.
  int64_t active_requests() const;
  // Stops the I/O threads and closes every connection.
  void stop();

  struct Impl;  // public only so that http_server.cpp's connection type can name it

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace chimera::server
