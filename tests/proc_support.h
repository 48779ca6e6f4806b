/* Starting a server process in a test: `sh -c CMD` with its stdout on a
 * pipe, and its first line read back, which must be "listening on ADDR"
 * (kvasir hub, gateway, worker, ... print it once bound to port 0).
 * Header-only (static functions): used by tests/hub_support.h and
 * tests/test_gateway_attack.c. */
#ifndef KVASIR_TEST_PROC_SUPPORT_H
#define KVASIR_TEST_PROC_SUPPORT_H

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Runs `sh -c cmd` (cmd should `exec` the server, so that *pid is the
 * server's own) and reads its first stdout line, waiting at most timeout_ms
 * for each byte. On "listening on ADDR": 0, *pid set, ADDR in out[cap].
 * Otherwise the process is killed and reaped, out holds the line read (for
 * the caller's message) and -1 is returned. */
static inline int kvt_spawn_listening(const char *cmd, int timeout_ms, pid_t *pid, char *out, size_t cap) {
    int fds[2];
    out[0] = 0;
    if (pipe(fds)) return -1;
    pid_t p = fork();
    if (p == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    if (p < 0) {
        close(fds[0]);
        return -1;
    }
    char line[256];
    size_t n = 0;
    struct pollfd pf = {.fd = fds[0], .events = POLLIN};
    while (n < sizeof line - 1 && poll(&pf, 1, timeout_ms) == 1) {
        ssize_t r = read(fds[0], line + n, 1);
        if (r != 1 || line[n] == '\n') break;
        n++;
    }
    line[n] = 0;
    close(fds[0]);
    if (strncmp(line, "listening on ", 13)) {
        kill(p, SIGKILL);
        waitpid(p, NULL, 0);
        snprintf(out, cap, "%s", line);
        return -1;
    }
    *pid = p;
    snprintf(out, cap, "%s", line + 13);
    return 0;
}

#endif
