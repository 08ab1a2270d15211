#pragma once
// The HTTP server under `comb serve`: cpp-httplib's parsing, routing and responses, with the
// connection handling its own so that slow or greedy clients cannot hold it.
//
// - A request's line, headers and body must arrive within `request_timeout_s` of its first byte
//   (one deadline for all of it, not per read: a client sending a header line every few seconds
//   is cut off at the deadline with 408), and within `max_request_bytes`.
// - At most `max_connections` connections are served at once and `max_per_client` from one
//   address; more are answered at once (503, 429) and closed. Each served connection has a worker
//   thread of its own, so the connections the limits admit cannot starve the others.
// - Requests pipelined on one connection are answered in order (the bytes read ahead belong to
//   the connection, not to one request).
#include <fmt/format.h>
#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace comb::cli {

struct ConnectionLimits {
  int64_t max_connections = 256;           // served at once; more get 503
  int64_t max_per_client = 128;            // from one address; more get 429
  double request_timeout_s = 10;           // line, headers and body of one request, from its first byte
  int64_t max_request_bytes = 9 << 20;     // read for one request (the body limit is checked at its headers)
  double keep_alive_timeout_s = 2;         // an idle connection between two requests
  int64_t keep_alive_max = 1000;           // requests on one connection
  double write_timeout_s = 10;             // one write of a response
};

class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(ConnectionLimits limits) : limits_(limits) {
    // One worker per admitted connection and a few for the refusals: admission happens on a
    // worker, so the refusals must always find one.
    const size_t threads = static_cast<size_t>(limits_.max_connections) + 8;
    new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    // What the responses advertise (Keep-Alive: timeout, max) is what the loop below does.
    set_keep_alive_timeout(static_cast<time_t>(limits_.keep_alive_timeout_s));
    set_keep_alive_max_count(static_cast<size_t>(limits_.keep_alive_max));
  }

  // Called by a handler that answers without reading the request's body (a refusal at the
  // headers): the connection closes after this response, so the unread body is never read as a
  // request of its own.
  static void close_after_response() { close_flag() = true; }

  struct Counts {
    int64_t open = 0, refused_busy = 0, refused_client = 0, timed_out = 0, too_large = 0;
  };
  Counts counts() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
  }

 private:
  using clock = std::chrono::steady_clock;
  static bool& close_flag() {
    static thread_local bool flag = false;
    return flag;
  }
  static constexpr int64_t kMaxHeadBytes = 64 << 10;  // request line and headers

  // The connection's socket as httplib's Stream: reads buffered (and kept across the requests of
  // the connection), failing once the current request's deadline or byte bound is passed.
  class ConnectionStream : public httplib::Stream {
   public:
    ConnectionStream(int fd, const ConnectionLimits& limits) : fd_(fd), limits_(limits) {}
    void begin_request() {
      deadline_ = clock::now() + std::chrono::microseconds(static_cast<int64_t>(limits_.request_timeout_s * 1e6));
      read_ = written_ = head_bytes_ = 0;
      head_match_ = 0;
      in_head_ = true;
      timed_out_ = too_large_ = false;
    }
    bool buffered() const { return pos_ < end_; }
    bool timed_out() const { return timed_out_; }
    bool too_large() const { return too_large_; }
    int64_t written() const { return written_; }
    // Data to read within `seconds` (a keep-alive wait).
    bool wait_readable(double seconds) const { return buffered() || poll_for(POLLIN, ms(seconds)) > 0; }

    bool is_readable() const override { return buffered() || poll_for(POLLIN, remaining_ms()) > 0; }
    bool is_writable() const override {
      if (poll_for(POLLOUT, ms(limits_.write_timeout_s)) <= 0) return false;
      if (poll_for(POLLIN, 0) <= 0) return true;
      char c;  // readable: data (a pipelined request) or the end of the stream (the client left)
      return ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
    }
    ssize_t read(char* ptr, size_t size) override {
      if (timed_out_ || too_large_) return -1;
      if (!buffered()) {
        if (read_ >= limits_.max_request_bytes) {
          too_large_ = true;
          return -1;
        }
        const int wait = remaining_ms();
        const int ready = wait <= 0 ? 0 : poll_for(POLLIN, wait);
        if (ready <= 0) {
          timed_out_ = ready == 0;  // waited until the deadline (an error is not a timeout)
          return -1;
        }
        const ssize_t n = ::recv(fd_, buffer_, sizeof(buffer_), 0);
        if (n <= 0) return n;
        pos_ = 0;
        end_ = static_cast<size_t>(n);
        read_ += n;
      }
      size_t n = std::min(size, end_ - pos_);
      if (in_head_) {  // the head ends at the first blank line; it may take kMaxHeadBytes at most
        for (size_t i = 0; i < n; ++i) {
          const char c = buffer_[pos_ + i];
          head_match_ = (c == "\r\n\r\n"[head_match_]) ? head_match_ + 1 : (c == '\r' ? 1 : 0);
          if (head_match_ == 4) {
            in_head_ = false;
            n = i + 1;  // hand over the head only; the body is read on the next call
            break;
          }
        }
        head_bytes_ += static_cast<int64_t>(n);
        if (head_bytes_ > kMaxHeadBytes) {
          too_large_ = true;
          return -1;
        }
      }
      std::memcpy(ptr, buffer_ + pos_, n);
      pos_ += n;
      return static_cast<ssize_t>(n);
    }
    // Once the request timed out or grew too large, httplib's own answer (a 400) is dropped: the
    // connection answers 408 or 413 (raw_write) and closes.
    ssize_t write(const char* ptr, size_t size) override {
      if (timed_out_ || too_large_) return static_cast<ssize_t>(size);
      return raw_write(ptr, size);
    }
    ssize_t raw_write(const char* ptr, size_t size) {
      size_t done = 0;
      while (done < size) {
        if (poll_for(POLLOUT, ms(limits_.write_timeout_s)) <= 0) return -1;
        const ssize_t n = ::send(fd_, ptr + done, size - done, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        done += static_cast<size_t>(n);
      }
      written_ += static_cast<int64_t>(size);
      return static_cast<ssize_t>(size);
    }
    void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
    void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
    socket_t socket() const override { return fd_; }

   private:
    static int ms(double seconds) { return static_cast<int>(std::min(std::max(0.0, seconds), 1e6) * 1000); }
    int remaining_ms() const {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - clock::now()).count();
      return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left, 1 << 30)));
    }
    int poll_for(short events, int timeout_ms) const {
      pollfd p{fd_, events, 0};
      for (;;) {
        const int r = ::poll(&p, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r > 0 && (p.revents & (POLLERR | POLLNVAL))) return -1;
        return r;
      }
    }
    void address(bool remote, std::string& ip, int& port) const {
      sockaddr_storage a{};
      socklen_t len = sizeof(a);
      ip.clear();
      port = 0;
      if ((remote ? ::getpeername(fd_, reinterpret_cast<sockaddr*>(&a), &len)
                  : ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len)) != 0)
        return;
      char text[INET6_ADDRSTRLEN] = {0};
      if (a.ss_family == AF_INET) {
        auto* v4 = reinterpret_cast<sockaddr_in*>(&a);
        ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
        port = ntohs(v4->sin_port);
      } else if (a.ss_family == AF_INET6) {
        auto* v6 = reinterpret_cast<sockaddr_in6*>(&a);
        ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
        port = ntohs(v6->sin6_port);
      }
      ip = text;
    }

    int fd_;
    const ConnectionLimits& limits_;
    char buffer_[4096];
    size_t pos_ = 0, end_ = 0;
    clock::time_point deadline_ = clock::time_point::max();
    int64_t read_ = 0, written_ = 0, head_bytes_ = 0;
    int head_match_ = 0;
    bool in_head_ = true, timed_out_ = false, too_large_ = false;
  };

  // A short answer written straight to the socket (status, OpenAI-shaped error), then closed.
  static void refuse(ConnectionStream& strm, int status, const char* reason, const std::string& message,
                     const char* type) {
    const std::string body = "{\"error\":{\"message\":\"" + message + "\",\"type\":\"" + type +
                             "\",\"param\":null,\"code\":null}}";
    const std::string head = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                             "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
                             std::to_string(body.size()) + (status == 429 || status == 503 ? "\r\nRetry-After: 1" : "") +
                             "\r\n\r\n";
    strm.raw_write(head.data(), head.size());
    strm.raw_write(body.data(), body.size());
  }

  // Closes without a reset: a socket closed with unread input sends RST, which may destroy the
  // answer before the client reads it. Our side is shut first, then what the client still sends
  // is read and dropped for a moment (bounded), then the socket closes.
  static void close_gently(int sock) {
    ::shutdown(sock, SHUT_WR);
    char sink[16384];
    const auto until = clock::now() + std::chrono::milliseconds(200);
    int64_t drained = 0;
    while (clock::now() < until && drained < (1 << 20)) {
      pollfd p{sock, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) break;
      const ssize_t n = ::recv(sock, sink, sizeof(sink), MSG_DONTWAIT);
      if (n <= 0) break;
      drained += n;
    }
    ::close(sock);
  }

  bool process_and_close_socket(socket_t sock) override {
    ConnectionStream strm(sock, limits_);
    std::string ip;
    int port = 0;
    strm.get_remote_ip_and_port(ip, port);
    bool admitted = false, busy = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (counts_.open >= limits_.max_connections) {
        busy = true;
        ++counts_.refused_busy;
      } else if (per_client_[ip] >= limits_.max_per_client) {
        ++counts_.refused_client;
      } else {
        admitted = true;
        ++counts_.open;
        ++per_client_[ip];
      }
      if (!admitted && per_client_[ip] == 0) per_client_.erase(ip);
    }
    bool ok = false;
    if (!admitted) {
      if (busy)
        refuse(strm, 503, "Service Unavailable",
               fmt::format("the server has {} connections open (--max-connections); try again", limits_.max_connections),
               "overloaded");
      else
        refuse(strm, 429, "Too Many Requests",
               fmt::format("this address has {} connections open (--max-connections-per-client); close some first",
                           limits_.max_per_client),
               "rate_limit_exceeded");
    } else {
      for (int64_t left = limits_.keep_alive_max; left > 0; --left) {
        if (!strm.wait_readable(limits_.keep_alive_timeout_s) || svr_sock_ == INVALID_SOCKET) break;
        strm.begin_request();
        bool closed = false;
        close_flag() = false;
        ok = process_request(strm, left == 1, closed, nullptr);
        if (close_flag()) closed = true;
        if (strm.timed_out() || strm.too_large()) {
          std::lock_guard<std::mutex> lock(mutex_);
          ++(strm.timed_out() ? counts_.timed_out : counts_.too_large);
        }
        if (strm.timed_out() || strm.too_large()) {
          if (strm.timed_out())
            refuse(strm, 408, "Request Timeout",
                   fmt::format("the request did not arrive whole within {:g} s (--request-timeout)",
                               limits_.request_timeout_s),
                   "invalid_request_error");
          else
            refuse(strm, 413, "Payload Too Large", "the request is larger than this server reads",
                   "invalid_request_error");
        }
        if (!ok || closed || strm.timed_out() || strm.too_large()) break;
      }
    }
    close_gently(sock);
    if (admitted) {
      std::lock_guard<std::mutex> lock(mutex_);
      --counts_.open;
      if (--per_client_[ip] == 0) per_client_.erase(ip);
    }
    return ok;
  }

  ConnectionLimits limits_;
  mutable std::mutex mutex_;
  Counts counts_;
  std::map<std::string, int64_t> per_client_;
};

}  // namespace comb::cli
