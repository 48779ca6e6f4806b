/* kv-netdelay: a userspace WAN delay line between TUN devices in network
 * namespaces, for tests and benchmarks on kernels without sch_netem.
 *
 * Each --port names a persistent TUN device (mode tun, no packet info) that
 * already exists inside a network namespace, and the IPv4 prefix that lives
 * behind it. The tool enters each namespace in turn (setns), attaches to the
 * device, and from then on moves packets: an IPv4 packet read from port i
 * whose destination lies in port j's prefix is held, then written to port j.
 * The kernel TCP stacks of the namespaces therefore see a real link: SYN,
 * data and ACKs are all delayed, so handshakes, RTT estimates and congestion
 * windows behave as across a WAN.
 *
 * The link model, per output port: a packet arriving at time t waits for the
 * port's serializer (--rate-kbit; none by default), takes len*8/rate to send,
 * then propagates for the delay of its lane (plus a uniform draw in
 * [-jitter, +jitter], never below zero). A lane is one ordered pair of ports
 * (in, out): its delay and loss are --delay-ms and --loss-pct unless
 * --pair-delay, --pair-loss or a --delay-table line sets them for that pair
 * (both directions), so hosts of one site can be a few ms apart and two sites
 * tens of ms. Delivery is never earlier than the previous packet's on the same
 * lane, so a lane's packets leave in the order they came, jitter or not, and
 * a slow lane never holds up a fast one into the same port. Loss drops a
 * packet at random (xorshift PRNG, --seed). All held
 * packets share one pool of --limit slots allocated at start; a packet that
 * finds the pool full is dropped and counted (a bounded router buffer), so
 * memory never grows with traffic. The hot path never calls malloc.
 *
 * Invariants: the tool opens no sockets and writes only to its own TUN
 * ports, so nothing it forwards can leave the namespaces it was given; a
 * packet whose destination is behind no port (or behind its own input port),
 * that is not IPv4, or whose header is inconsistent with its length, is
 * dropped and counted, never forwarded. The only parsing is the IPv4
 * header's version, header length, total length and destination; nothing in
 * a packet sizes an allocation or an index.
 *
 * Output: "ready" on stdout once every port is attached; on SIGUSR1 one JSON
 * line of counters on stdout, and again on SIGTERM/SIGINT before exiting 0.
 * Errors in the arguments or in attaching a port: one line on stderr, exit 2. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define ND_MAX_PORTS 32          /* TUN ports of one delay line */
#define ND_MAX_DELAY_MS 60000.0  /* one-way delay and jitter bound */
#define ND_MAX_LIMIT 1000000     /* packets held at once */
#define ND_MAX_POOL_BYTES (1024u * 1024u * 1024u) /* limit * mtu */
#define ND_READ_BURST 64         /* packets read from one port per round */
#define ND_SCRATCH 65536         /* a TUN read never exceeds an IPv4 datagram */
#define ND_MAX_PAIR_ARGS 1024    /* --pair-delay/--pair-loss/--delay-table entries */
#define ND_MAX_TABLE_LINE 512    /* bytes of one --delay-table line */
#define ND_MAX_TABLE_BYTES (1024 * 1024) /* a --delay-table file */

struct nd_slot {
  int64_t deliver_ns; /* CLOCK_MONOTONIC time the packet leaves */
  int32_t next;       /* next slot in the port's FIFO or the free list; -1 ends */
  uint32_t len;       /* bytes in buf */
  uint8_t *buf;       /* [mtu], into the pool */
};

struct nd_port {
  char ns[256];          /* namespace name under /run/netns, "-" for ours */
  char ifname[IFNAMSIZ]; /* the TUN device inside it */
  uint32_t net, mask;    /* IPv4 prefix behind the port, host order */
  int fd;                /* the attached TUN queue, non-blocking */
  int64_t link_free_ns;  /* when the serializer is free (rate limit) */
  uint64_t out_pkts, out_bytes, in_pkts;
};

/* one direction between two ports: its own delay, loss and FIFO */
struct nd_lane {
  int64_t delay_ns;     /* one-way propagation delay */
  double loss;          /* drop probability in [0, 1] */
  int32_t head, tail;   /* FIFO of held packets of this lane */
  int64_t last_deliver; /* delivery time of the last packet queued here */
  uint64_t fwd, lost;   /* packets written, packets dropped by loss */
};

/* a --pair-delay / --pair-loss / --delay-table entry, resolved once every
 * --port is known (so the flags may come in any order) */
struct nd_pair_arg {
  char a[256], b[256]; /* port index or namespace name */
  double delay_ms;     /* < 0: not set */
  double loss_pct;     /* < 0: not set */
  char where[300];     /* the flag or FILE:LINE, for errors */
};

struct nd_stats {
  uint64_t forwarded, forwarded_bytes;
  uint64_t dropped_queue;   /* the pool was full */
  uint64_t dropped_loss;    /* a lane's loss (--loss-pct, --pair-loss) */
  uint64_t dropped_noroute; /* destination behind no other port */
  uint64_t dropped_bad;     /* not IPv4, bad header, or longer than --mtu */
  uint64_t write_errors;    /* a TUN write failed (device down) */
  uint64_t held, max_held;  /* packets in the pool now, at most */
};

static struct nd_port ports[ND_MAX_PORTS];
static int n_port;
static struct nd_lane lanes[ND_MAX_PORTS][ND_MAX_PORTS]; /* [in][out] */
static struct nd_pair_arg pair_args[ND_MAX_PAIR_ARGS];
static int n_pair_arg;
static struct nd_slot *slots;
static int32_t free_head = -1;
static struct nd_stats st;
static volatile sig_atomic_t want_stats, want_exit;

static int64_t jitter_ns, rate_bps; /* rate 0: unlimited */
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("kv-netdelay: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(2);
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* xorshift64*: a uniform double in [0, 1) */
static double rnd(void) {
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return (double)((rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

/* parse_num: a decimal in [lo, hi] or die naming the flag */
static double parse_num(const char *flag, const char *s, double lo, double hi) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo && v <= hi))
    die("%s: '%s' is not a number in [%g, %g]", flag, s, lo, hi);
  return v;
}

/* parse_port: NETNS:IFNAME:A.B.C.D[/PLEN] */
static void parse_port(const char *arg) {
  if (n_port == ND_MAX_PORTS) die("--port: at most %d ports", ND_MAX_PORTS);
  struct nd_port *p = &ports[n_port];
  const char *c1 = strchr(arg, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
  if (!c1 || !c2) die("--port: '%s' is not NETNS:IFNAME:ADDR[/PLEN]", arg);
  size_t nl = (size_t)(c1 - arg), il = (size_t)(c2 - c1 - 1);
  if (nl == 0 || nl >= sizeof p->ns || memchr(arg, '/', nl))
    die("--port: bad namespace name in '%s'", arg);
  if (il == 0 || il >= IFNAMSIZ) die("--port: bad interface name in '%s'", arg);
  memcpy(p->ns, arg, nl);
  p->ns[nl] = 0;
  memcpy(p->ifname, c1 + 1, il);
  p->ifname[il] = 0;
  unsigned a, b, c, d, plen = 32;
  char tail;
  int n = sscanf(c2 + 1, "%u.%u.%u.%u/%u%c", &a, &b, &c, &d, &plen, &tail);
  if (n == 4) {
    if (sscanf(c2 + 1, "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) != 4) n = 0;
  } else if (n != 5) {
    n = 0;
  }
  if (!n || a > 255 || b > 255 || c > 255 || d > 255 || plen > 32)
    die("--port: bad IPv4 address or prefix in '%s'", arg);
  p->mask = plen ? 0xffffffffu << (32 - plen) : 0;
  p->net = ((a << 24) | (b << 16) | (c << 8) | d) & p->mask;
  p->fd = -1;
  n_port++;
}

/* pair_field: copy the n bytes of one endpoint of a pair, or die */
static void pair_field(const char *where, const char *s, size_t n, char *out, size_t cap) {
  if (n == 0 || n >= cap) die("%s: an empty or too long port name in '%.*s'", where, (int)n, s);
  memcpy(out, s, n);
  out[n] = 0;
}

/* parse_pair: "A,B,VALUE" of --pair-delay (loss 0) or --pair-loss (loss 1) */
static void parse_pair(const char *flag, const char *arg, int is_loss) {
  if (n_pair_arg == ND_MAX_PAIR_ARGS) die("%s: at most %d pair entries in all", flag, ND_MAX_PAIR_ARGS);
  struct nd_pair_arg *q = &pair_args[n_pair_arg];
  snprintf(q->where, sizeof q->where, "%s", flag);
  const char *c1 = strchr(arg, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
  if (!c1 || !c2 || strchr(c2 + 1, ','))
    die("%s: '%s' is not A,B,%s (A and B: a port's index from 0 or its namespace)", flag, arg,
        is_loss ? "PCT" : "MS");
  pair_field(flag, arg, (size_t)(c1 - arg), q->a, sizeof q->a);
  pair_field(flag, c1 + 1, (size_t)(c2 - c1 - 1), q->b, sizeof q->b);
  q->delay_ms = is_loss ? -1 : parse_num(flag, c2 + 1, 0, ND_MAX_DELAY_MS);
  q->loss_pct = is_loss ? parse_num(flag, c2 + 1, 0, 100) : -1;
  n_pair_arg++;
}

/* parse_table: --delay-table FILE, one "A B DELAY_MS [LOSS_PCT]" a line;
 * '#' starts a comment, blank lines are skipped */
static void parse_table(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) die("--delay-table %s: %s", path, strerror(errno));
  char line[ND_MAX_TABLE_LINE + 2];
  long total = 0;
  for (int ln = 1; fgets(line, sizeof line, f); ln++) {
    size_t len = strlen(line);
    total += (long)len;
    if (total > ND_MAX_TABLE_BYTES) die("--delay-table %s: longer than %d bytes", path, ND_MAX_TABLE_BYTES);
    if (len > ND_MAX_TABLE_LINE || (len == sizeof line - 1 && line[len - 1] != '\n'))
      die("--delay-table %s:%d: a line longer than %d bytes", path, ln, ND_MAX_TABLE_LINE);
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *tok[5], *save = NULL;
    int nt = 0;
    for (char *t = strtok_r(line, " \t\r\n", &save); t; t = strtok_r(NULL, " \t\r\n", &save)) {
      if (nt == 4) die("--delay-table %s:%d: more than 4 fields (A B DELAY_MS [LOSS_PCT])", path, ln);
      tok[nt++] = t;
    }
    if (nt == 0) continue;
    if (nt < 3) die("--delay-table %s:%d: want A B DELAY_MS [LOSS_PCT]", path, ln);
    if (n_pair_arg == ND_MAX_PAIR_ARGS) die("--delay-table %s: at most %d pair entries in all", path, ND_MAX_PAIR_ARGS);
    struct nd_pair_arg *q = &pair_args[n_pair_arg];
    snprintf(q->where, sizeof q->where, "--delay-table %.200s:%d", path, ln);
    pair_field(q->where, tok[0], strlen(tok[0]), q->a, sizeof q->a);
    pair_field(q->where, tok[1], strlen(tok[1]), q->b, sizeof q->b);
    q->delay_ms = parse_num(q->where, tok[2], 0, ND_MAX_DELAY_MS);
    q->loss_pct = nt == 4 ? parse_num(q->where, tok[3], 0, 100) : -1;
    n_pair_arg++;
  }
  if (ferror(f)) die("--delay-table %s: read error", path);
  fclose(f);
}

/* port_index: a port named by its index (decimal, from 0) or by its
 * namespace (which must name exactly one port); dies naming `where` */
static int port_index(const char *where, const char *name) {
  const char *d = name;
  while (*d >= '0' && *d <= '9') d++;
  if (!*d && d - name <= 3) {
    int i = atoi(name);
    if (i >= n_port) die("%s: port %d, but only %d --port given", where, i, n_port);
    return i;
  }
  int found = -1;
  for (int i = 0; i < n_port; i++) {
    if (strcmp(ports[i].ns, name) != 0) continue;
    if (found >= 0) die("%s: namespace '%s' has more than one port: name it by index", where, name);
    found = i;
  }
  if (found < 0) die("%s: no --port in namespace '%s'", where, name);
  return found;
}

/* attach: enter port p's namespace, attach to its TUN device, come back */
static void attach(struct nd_port *p, int home) {
  if (strcmp(p->ns, "-") != 0) {
    char path[sizeof p->ns + 16] = "/run/netns/";
    strcat(path, p->ns); /* ns is shorter than 256 bytes (parse_port) */
    int nsfd = open(path, O_RDONLY | O_CLOEXEC);
    if (nsfd < 0) die("namespace %s: %s", p->ns, strerror(errno));
    if (setns(nsfd, CLONE_NEWNET) != 0) die("setns %s: %s", p->ns, strerror(errno));
    close(nsfd);
  }
  /* the TUN file belongs to the namespace it is opened in */
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) die("/dev/net/tun: %s", strerror(errno));
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  memcpy(ifr.ifr_name, p->ifname, strlen(p->ifname));
  if (ioctl(fd, TUNSETIFF, &ifr) != 0)
    die("%s in namespace %s: TUNSETIFF: %s (create it first: ip tuntap add mode tun)", p->ifname, p->ns,
        strerror(errno));
  if (home >= 0 && setns(home, CLONE_NEWNET) != 0) die("setns back: %s", strerror(errno));
  p->fd = fd;
}

static void print_stats(void) {
  printf("{\"forwarded\":%" PRIu64 ",\"forwarded_bytes\":%" PRIu64 ",\"dropped_queue\":%" PRIu64
         ",\"dropped_loss\":%" PRIu64 ",\"dropped_noroute\":%" PRIu64 ",\"dropped_bad\":%" PRIu64
         ",\"write_errors\":%" PRIu64 ",\"held\":%" PRIu64 ",\"max_held\":%" PRIu64 ",\"ports\":[",
         st.forwarded, st.forwarded_bytes, st.dropped_queue, st.dropped_loss, st.dropped_noroute, st.dropped_bad,
         st.write_errors, st.held, st.max_held);
  for (int i = 0; i < n_port; i++)
    printf("%s{\"ns\":\"%s\",\"in\":%" PRIu64 ",\"out\":%" PRIu64 ",\"out_bytes\":%" PRIu64 "}", i ? "," : "",
           ports[i].ns, ports[i].in_pkts, ports[i].out_pkts, ports[i].out_bytes);
  printf("],\"lanes\":[");
  int first = 1;
  for (int i = 0; i < n_port; i++)
    for (int o = 0; o < n_port; o++) {
      const struct nd_lane *l = &lanes[i][o];
      if (!l->fwd && !l->lost) continue;
      printf("%s{\"from\":%d,\"to\":%d,\"delay_ms\":%.3f,\"loss_pct\":%.3f,\"fwd\":%" PRIu64
             ",\"lost\":%" PRIu64 "}",
             first ? "" : ",", i, o, (double)l->delay_ns / 1e6, l->loss * 100.0, l->fwd, l->lost);
      first = 0;
    }
  printf("]}\n");
  fflush(stdout);
}

static void on_signal(int sig) {
  if (sig == SIGUSR1) want_stats = 1;
  else want_exit = 1;
}

/* route: the port whose prefix holds dst (longest prefix), or -1 */
static int route(uint32_t dst) {
  int best = -1;
  for (int i = 0; i < n_port; i++)
    if ((dst & ports[i].mask) == ports[i].net && (best < 0 || ports[i].mask > ports[best].mask)) best = i;
  return best;
}

/* ipv4_dst: the destination of a well-formed IPv4 packet of n bytes, or -1 */
static int64_t ipv4_dst(const uint8_t *b, size_t n) {
  if (n < 20 || (b[0] >> 4) != 4) return -1;
  size_t ihl = (size_t)(b[0] & 15) * 4, tot = ((size_t)b[2] << 8) | b[3];
  if (ihl < 20 || ihl > tot || tot != n) return -1;
  return ((int64_t)b[16] << 24) | ((int64_t)b[17] << 16) | ((int64_t)b[18] << 8) | b[19];
}

/* enqueue: hold packet b[0..n) from port `in` and schedule it (drops counted) */
static void enqueue(int in, const uint8_t *b, size_t n, size_t mtu, int64_t t) {
  ports[in].in_pkts++;
  int64_t dst = ipv4_dst(b, n);
  if (dst < 0 || n > mtu) {
    st.dropped_bad++;
    return;
  }
  int out = route((uint32_t)dst);
  if (out < 0 || out == in) {
    st.dropped_noroute++;
    return;
  }
  struct nd_lane *l = &lanes[in][out];
  if (l->loss > 0 && rnd() < l->loss) {
    st.dropped_loss++;
    l->lost++;
    return;
  }
  if (free_head < 0) {
    st.dropped_queue++;
    return;
  }
  struct nd_port *p = &ports[out];
  int64_t sent = t;
  if (rate_bps) { /* the serializer: one packet after another at the link's rate */
    if (p->link_free_ns > sent) sent = p->link_free_ns;
    sent += (int64_t)((double)n * 8e9 / (double)rate_bps);
    p->link_free_ns = sent;
  }
  int64_t d = l->delay_ns;
  if (jitter_ns) {
    d += (int64_t)((rnd() * 2.0 - 1.0) * (double)jitter_ns);
    if (d < 0) d = 0;
  }
  int64_t when = sent + d;
  if (when < l->last_deliver) when = l->last_deliver; /* in order */
  l->last_deliver = when;

  int32_t s = free_head;
  free_head = slots[s].next;
  memcpy(slots[s].buf, b, n);
  slots[s].len = (uint32_t)n;
  slots[s].deliver_ns = when;
  slots[s].next = -1;
  if (l->tail >= 0) slots[l->tail].next = s;
  else l->head = s;
  l->tail = s;
  if (++st.held > st.max_held) st.max_held = st.held;
}

/* release: write every packet whose time has come; returns the earliest
 * pending delivery time, or INT64_MAX when nothing is held */
static int64_t release(int64_t t) {
  int64_t next = INT64_MAX;
  for (int o = 0; o < n_port; o++) {
    struct nd_port *p = &ports[o];
    for (int i = 0; i < n_port; i++) {
      struct nd_lane *l = &lanes[i][o];
      while (l->head >= 0 && slots[l->head].deliver_ns <= t) {
        int32_t s = l->head;
        ssize_t w = write(p->fd, slots[s].buf, slots[s].len);
        if (w == (ssize_t)slots[s].len) {
          st.forwarded++;
          st.forwarded_bytes += slots[s].len;
          p->out_pkts++;
          p->out_bytes += slots[s].len;
          l->fwd++;
        } else {
          st.write_errors++;
        }
        l->head = slots[s].next;
        if (l->head < 0) l->tail = -1;
        slots[s].next = free_head;
        free_head = s;
        st.held--;
      }
      if (l->head >= 0 && slots[l->head].deliver_ns < next) next = slots[l->head].deliver_ns;
    }
  }
  return next;
}

static void usage(void) {
  fputs("usage: kv-netdelay --port NETNS:IFNAME:ADDR[/PLEN] --port ... [--delay-ms D] [--jitter-ms J]\n"
        "         [--loss-pct P] [--rate-kbit R] [--limit PACKETS] [--mtu BYTES] [--seed N]\n"
        "         [--pair-delay A,B,MS]... [--pair-loss A,B,PCT]... [--delay-table FILE]\n"
        "Forwards IPv4 packets between persistent TUN devices (ip tuntap add mode tun) in network\n"
        "namespaces (\"-\": this one), holding each for the one-way delay. Prints \"ready\", then\n"
        "counters as JSON on SIGUSR1 and on SIGTERM.\n"
        "  --delay-ms D, --loss-pct P   one-way delay and loss of every pair of ports not set below\n"
        "  --pair-delay A,B,MS          the one-way delay between ports A and B, both directions;\n"
        "                               A, B: a port's index (0 = the first --port) or its namespace\n"
        "  --pair-loss A,B,PCT          the loss between A and B, each direction, in percent\n"
        "  --delay-table FILE           lines \"A B DELAY_MS [LOSS_PCT]\" ('#' comments), as the two\n"
        "                               flags above; a later entry for a pair overrides an earlier one\n",
        stderr);
  exit(2);
}

int main(int argc, char **argv) {
  double delay_ms = 0, jitter_ms = 0, loss_pct = 0, rate_kbit = 0;
  long limit = 8192, mtu = 1500;
  uint64_t seed = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) usage();
    if (!v) die("%s: missing value (see --help)", a);
    if (!strcmp(a, "--port")) parse_port(v);
    else if (!strcmp(a, "--delay-ms")) delay_ms = parse_num(a, v, 0, ND_MAX_DELAY_MS);
    else if (!strcmp(a, "--jitter-ms")) jitter_ms = parse_num(a, v, 0, ND_MAX_DELAY_MS);
    else if (!strcmp(a, "--loss-pct")) loss_pct = parse_num(a, v, 0, 100);
    else if (!strcmp(a, "--rate-kbit")) rate_kbit = parse_num(a, v, 0, 1e8);
    else if (!strcmp(a, "--limit")) limit = (long)parse_num(a, v, 1, ND_MAX_LIMIT);
    else if (!strcmp(a, "--mtu")) mtu = (long)parse_num(a, v, 68, 65535);
    else if (!strcmp(a, "--seed")) seed = (uint64_t)parse_num(a, v, 0, 4294967295.0);
    else if (!strcmp(a, "--pair-delay")) parse_pair(a, v, 0);
    else if (!strcmp(a, "--pair-loss")) parse_pair(a, v, 1);
    else if (!strcmp(a, "--delay-table")) parse_table(v);
    else die("unknown flag %s (see --help)", a);
    i++;
  }
  if (n_port < 2) die("need at least two --port");
  if ((uint64_t)limit * (uint64_t)mtu > ND_MAX_POOL_BYTES)
    die("--limit %ld x --mtu %ld exceeds %u bytes of held packets", limit, mtu, ND_MAX_POOL_BYTES);
  for (int i = 0; i < n_port; i++)
    for (int o = 0; o < n_port; o++)
      lanes[i][o] = (struct nd_lane){
          .delay_ns = (int64_t)(delay_ms * 1e6), .loss = loss_pct / 100.0, .head = -1, .tail = -1};
  for (int k = 0; k < n_pair_arg; k++) { /* in command-line order: a later entry wins */
    const struct nd_pair_arg *q = &pair_args[k];
    int a = port_index(q->where, q->a), b = port_index(q->where, q->b);
    if (a == b) die("%s: '%s' and '%s' are the same port", q->where, q->a, q->b);
    if (q->delay_ms >= 0) lanes[a][b].delay_ns = lanes[b][a].delay_ns = (int64_t)(q->delay_ms * 1e6);
    if (q->loss_pct >= 0) lanes[a][b].loss = lanes[b][a].loss = q->loss_pct / 100.0;
  }
  jitter_ns = (int64_t)(jitter_ms * 1e6);
  rate_bps = (int64_t)(rate_kbit * 1000.0);
  rng ^= seed * 0xd1b54a32d192ed03ull;
  if (!rng) rng = 1;

  /* the pool: every held packet lives here, allocated once */
  slots = calloc((size_t)limit, sizeof *slots);
  uint8_t *pool = malloc((size_t)limit * (size_t)mtu);
  static uint8_t scratch[ND_SCRATCH];
  if (!slots || !pool) die("out of memory for %ld packets of %ld bytes", limit, mtu);
  for (long i = 0; i < limit; i++) {
    slots[i].buf = pool + (size_t)i * (size_t)mtu;
    slots[i].next = i + 1 < limit ? (int32_t)(i + 1) : -1;
  }
  free_head = 0;

  /* a script killed before its cleanup ran must not leave the line (and,
   * through its TUN files, the namespaces) alive: go when the parent goes */
  pid_t parent = getppid();
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent) die("parent gone");

  int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  for (int i = 0; i < n_port; i++) attach(&ports[i], home);
  if (home >= 0) close(home);

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGUSR1, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  /* signals only interrupt ppoll, so the counters are never read mid-update */
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGUSR1);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  sigprocmask(SIG_BLOCK, &block, &old);

  printf("ready\n");
  fflush(stdout);

  struct pollfd pfd[ND_MAX_PORTS];
  for (int i = 0; i < n_port; i++) pfd[i] = (struct pollfd){.fd = ports[i].fd, .events = POLLIN};
  int64_t next = INT64_MAX;
  while (!want_exit) {
    struct timespec ts, *tp = NULL;
    if (next != INT64_MAX) {
      int64_t wait = next - now_ns();
      if (wait < 0) wait = 0;
      ts.tv_sec = wait / 1000000000;
      ts.tv_nsec = wait % 1000000000;
      tp = &ts;
    }
    int r = ppoll(pfd, (nfds_t)n_port, tp, &old);
    if (r < 0 && errno != EINTR) die("ppoll: %s", strerror(errno));
    if (want_stats) {
      want_stats = 0;
      print_stats();
    }
    if (r > 0) {
      for (int i = 0; i < n_port; i++) {
        if (pfd[i].revents & (POLLERR | POLLHUP | POLLNVAL)) die("%s: device gone", ports[i].ifname);
        if (!(pfd[i].revents & POLLIN)) continue;
        for (int k = 0; k < ND_READ_BURST; k++) {
          ssize_t n = read(ports[i].fd, scratch, sizeof scratch);
          if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) break;
            die("%s: read: %s", ports[i].ifname, strerror(errno));
          }
          enqueue(i, scratch, (size_t)n, (size_t)mtu, now_ns());
        }
      }
    }
    next = release(now_ns());
  }
  print_stats();
  return 0;
}
