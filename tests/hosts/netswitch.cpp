// swapopt-netswitch: a userspace Ethernet switch between network namespaces that delays, jitters
// (and so reorders) and drops frames. The kernels these tests run on have no netem qdisc and no
// packet filter, so tests/hosts/run.sh injects its network faults here.
//
//   swapopt-netswitch [--ifname eth1] [--delay-ms D] [--jitter-ms J] [--loss P] [--seed S] NETNS...
//
// For each named namespace (as `ip netns` names it) it creates a TAP device `ifname` inside it and
// keeps its file descriptor; the device exists as long as this process does. A frame read from one
// TAP goes to the port its destination MAC was learned on (every other port when unknown or
// broadcast), each copy dropped with probability P or else held D +- J ms (uniform; frames overtake
// each other when J exceeds their spacing). Prints "ready" once every device exists, and its counts
// when SIGTERM or SIGINT ends it.
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <queue>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Mac = std::array<uint8_t, 6>;

volatile sig_atomic_t stop_requested = 0;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "swapopt-netswitch: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "swapopt-netswitch: %s\nusage: swapopt-netswitch [--ifname eth1] [--delay-ms D] [--jitter-ms J] [--loss P] "
               "[--seed S] NETNS...\n",
               why.c_str());
  std::exit(2);
}

/** Creates TAP device `ifname` inside namespace `netns` and returns its descriptor (non-blocking). */
int open_tap_in(const std::string& netns, const std::string& ifname, int home_ns) {
  const std::string path = "/run/netns/" + netns;
  const int ns = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (ns < 0) fail("cannot open " + path);
  if (::setns(ns, CLONE_NEWNET) != 0) fail("cannot enter " + path);
  ::close(ns);
  // A TAP device belongs to the namespace it was made in; its descriptor works from anywhere.
  const int fd = ::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail("cannot open /dev/net/tun");
  ifreq request{};
  request.ifr_flags = IFF_TAP | IFF_NO_PI;
  std::snprintf(request.ifr_name, IFNAMSIZ, "%s", ifname.c_str());
  if (::ioctl(fd, TUNSETIFF, &request) != 0) fail("cannot create " + ifname + " in " + netns);
  if (::setns(home_ns, CLONE_NEWNET) != 0) fail("cannot return to this process's namespace");
  return fd;
}

struct Held {  // a frame on its way to a port
  Clock::time_point due;
  uint64_t sequence;  // arrival order at the switch, for counting overtakes
  size_t port;
  std::vector<uint8_t> bytes;
  bool operator>(const Held& other) const { return due != other.due ? due > other.due : sequence > other.sequence; }
};

}  // namespace

int main(int argc, char** argv) {
  std::string ifname = "eth1";
  double delay_ms = 0, jitter_ms = 0, loss = 0;
  uint32_t seed = 1;
  std::vector<std::string> namespaces;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("swapopt-netswitch [--ifname eth1] [--delay-ms D] [--jitter-ms J] [--loss P] [--seed S] NETNS...\n"
                  "A TAP device in each namespace, joined by a switch that holds each frame D +- J ms and drops it "
                  "with probability P.\n");
      return 0;
    }
    if (flag.rfind("--", 0) != 0) {
      namespaces.push_back(flag);
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + flag);
    const char* value = argv[++i];
    char* end = nullptr;
    const double number = std::strtod(value, &end);
    if (flag == "--ifname") ifname = value;
    else if (end == value || *end != '\0' || !std::isfinite(number) || number < 0 || number > 4294967295.0)
      usage(flag + " takes a non-negative number, got '" + value + "'");
    else if (flag == "--delay-ms") delay_ms = number;
    else if (flag == "--jitter-ms") jitter_ms = number;
    else if (flag == "--loss") loss = number;
    else if (flag == "--seed") seed = uint32_t(number);
    else usage("unknown flag " + flag);
  }
  if (namespaces.size() < 2 || namespaces.size() > 255) usage("give 2 to 255 namespaces");
  if (loss >= 1) usage("--loss is a probability below 1");
  if (jitter_ms > delay_ms) usage("--jitter-ms may not exceed --delay-ms");

  // SIGTERM and SIGINT are blocked except inside ppoll(), which they interrupt: one that arrives
  // between the check of stop_requested and the wait is delivered when the wait starts.
  struct sigaction on_stop{};
  on_stop.sa_handler = [](int) { stop_requested = 1; };
  ::sigaction(SIGTERM, &on_stop, nullptr);
  ::sigaction(SIGINT, &on_stop, nullptr);
  sigset_t stop_signals, while_waiting;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  ::sigprocmask(SIG_BLOCK, &stop_signals, &while_waiting);
  sigdelset(&while_waiting, SIGTERM);
  sigdelset(&while_waiting, SIGINT);

  const int home_ns = ::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (home_ns < 0) fail("cannot open /proc/self/ns/net");
  std::vector<pollfd> ports;
  for (const std::string& ns : namespaces) ports.push_back({open_tap_in(ns, ifname, home_ns), POLLIN, 0});
  std::printf("ready\n");
  std::fflush(stdout);

  std::mt19937_64 random(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::map<Mac, size_t> learned;  // source MAC -> the port it came from
  std::priority_queue<Held, std::vector<Held>, std::greater<>> held;
  std::vector<uint64_t> last_sent(ports.size() * ports.size(), 0);  // per (from, to): last sequence sent
  uint64_t sequence = 0, frames = 0, copies = 0, dropped = 0, overtaken = 0;
  std::vector<uint8_t> buffer(65536);

  while (stop_requested == 0) {
    timespec wait{};
    const timespec* timeout = nullptr;  // none held: until a frame or a signal comes
    if (!held.empty()) {
      const auto left = std::max<int64_t>(0, std::chrono::ceil<std::chrono::microseconds>(held.top().due - Clock::now()).count());
      wait = {time_t(left / 1000000), long(left % 1000000) * 1000};
      timeout = &wait;
    }
    if (::ppoll(ports.data(), ports.size(), timeout, &while_waiting) < 0) {
      if (errno != EINTR) fail("poll");
      continue;  // a stop signal: the loop condition sees it
    }
    for (size_t from = 0; from < ports.size(); ++from) {
      if ((ports[from].revents & POLLIN) == 0) continue;
      for (;;) {
        const ssize_t n = ::read(ports[from].fd, buffer.data(), buffer.size());
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
        if (n < 0) fail("read from port " + std::to_string(from));
        if (n < 14) continue;  // not an Ethernet frame
        ++frames;
        Mac destination, source;
        std::memcpy(destination.data(), buffer.data(), 6);
        std::memcpy(source.data(), buffer.data() + 6, 6);
        learned[source] = from;
        const auto known = learned.find(destination);
        const bool unicast = (destination[0] & 1) == 0 && known != learned.end();
        const uint64_t id = ++sequence;
        for (size_t to = 0; to < ports.size(); ++to) {
          if (to == from || (unicast && to != known->second)) continue;
          ++copies;
          if (unit(random) < loss) {
            ++dropped;
            continue;
          }
          const double ms = delay_ms + jitter_ms * (2 * unit(random) - 1);
          const auto due = Clock::now() + std::chrono::microseconds(int64_t(ms * 1000));
          // The sequence carries its arrival port in the low byte so that overtakes count per link.
          held.push({due, id * 256 + from, to, std::vector<uint8_t>(buffer.begin(), buffer.begin() + n)});
        }
      }
    }
    const auto now = Clock::now();
    while (!held.empty() && held.top().due <= now) {
      const Held& frame = held.top();
      const size_t from = size_t(frame.sequence % 256);
      uint64_t& last = last_sent[from * ports.size() + frame.port];
      if (frame.sequence < last) ++overtaken;
      else last = frame.sequence;
      // A full queue in the namespace drops the frame, as a real link would.
      if (::write(ports[frame.port].fd, frame.bytes.data(), frame.bytes.size()) < 0 && errno != EAGAIN && errno != EIO)
        fail("write to port " + std::to_string(frame.port));
      held.pop();
    }
  }
  std::printf("netswitch: %llu frames in, %llu copies out, %llu dropped (%.1f%%), %llu delivered after a later frame\n",
              (unsigned long long)frames, (unsigned long long)copies, (unsigned long long)dropped,
              copies ? 100.0 * double(dropped) / double(copies) : 0.0, (unsigned long long)overtaken);
  return 0;
}
