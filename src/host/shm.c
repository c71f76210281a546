/* Host memory shared by name between processes (laden/shm.h).
 *
 * Locks, all released by the kernel when a process ends:
 *   flock(LOCK_SH) on the file by every user: its users.  An open that gets
 *     LOCK_EX at once finds a segment nobody uses (its users died): it is
 *     removed and made again.  A close that gets LOCK_EX is the last.
 *   an OFD write lock on the header's first byte, held by the creator
 *     until it marks the segment ready: a waiter that finds the segment
 *     still filling and that lock gone knows the creator ended. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "laden/shm.h"

#include "../core/internal.h"

#define HEADER 4096u
#define MAGIC 0x4d48534e4544414cull /* "LADENSHM" */
#define NAME_MAX_LEN 200

enum { FILLING = 0, READY = 1, FAILED = 2 };

typedef struct header {
    uint64_t magic;
    uint64_t bytes;
    _Atomic uint32_t state;
    int32_t creator_pid;
    uint64_t creator_pid_ns; /* its pid namespace (inode): creator_pid
                                means something only in that one */
} header;

/* This process's pid namespace, or 0 if unknown. */
static uint64_t pid_ns(void)
{
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

struct laden_shm {
    int fd;
    char *path;
    header *h;
    uint64_t bytes;
    bool created;
    bool filled; /* marked (ready or failed) by this creator */
    pid_t owner; /* the process that opened it: a forked child's copy of
                    the handle only unmaps and closes */
};

static const char *shm_dir(void)
{
    const char *d = getenv("LADEN_SHM_DIR");
    return d && *d ? d : "/dev/shm";
}

static bool name_ok(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (!n || n > NAME_MAX_LEN)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
            return false;
    }
    return name[0] != '.';
}

/* 1 if `path` still names the file open as fd. */
static bool same_file(int fd, const char *path)
{
    struct stat a, b;
    return fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

static laden_status sys_fail(const char *what, const char *path)
{
    int e = errno;
    return laden__fail(e == ENOMEM ? LADEN_E_NOMEM : LADEN_E_IO,
                       "shared memory %s: %s: %s", path, what, strerror(e));
}

static int filling_lock(int fd, short type, int cmd)
{
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0,
                      .l_len = 1};
    return fcntl(fd, cmd, &l);
}

/* A segment still filling whose creator has ended (its lock went with
 * it). */
static bool creator_gone(int fd, const header *h)
{
    struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0,
                      .l_len = 1};
    if (atomic_load(&h->state) != FILLING)
        return false;
    /* Its lock is gone, or it is: a forked child of the maker inherits
     * the lock's file description and would keep it held. */
    bool unlocked = fcntl(fd, F_OFD_GETLK, &l) == 0 && l.l_type == F_UNLCK;
    bool dead = h->creator_pid > 0 && h->creator_pid_ns &&
                h->creator_pid_ns == pid_ns() &&
                kill(h->creator_pid, 0) != 0 && errno == ESRCH;
    return (unlocked || dead) && atomic_load(&h->state) == FILLING;
}

/* Removes what dead processes left in the directory: segments nobody
 * holds (every user holds a shared flock; the kernel drops a dead one's),
 * and the temporary files of makers that died before linking theirs in.
 * Only this user's files.  Called before making a segment. */
static void sweep(void)
{
    DIR *d = opendir(shm_dir());
    if (!d)
        return;
    char path[4096];
    for (struct dirent *e; (e = readdir(d));) {
        const char *n = e->d_name;
        bool seg = strncmp(n, "laden-", 6) == 0;
        bool tmp = strncmp(n, ".laden-", 7) == 0;
        if (!seg && !tmp)
            continue;
        snprintf(path, sizeof path, "%s/%s", shm_dir(), n);
        /* A temporary file's maker holds a shared flock on it from just
         * after making it (a sweep in between makes its link fail with
         * ENOENT, and it tries again); a pid in its name may be another
         * pid namespace's, so it is not used. */
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0)
            continue;
        struct stat sb;
        uint64_t magic = 0;
        if (fstat(fd, &sb) == 0 && sb.st_uid == geteuid() &&
            S_ISREG(sb.st_mode) &&
            (tmp || (pread(fd, &magic, sizeof magic, 0) == sizeof magic &&
                     magic == MAGIC)) &&
            flock(fd, LOCK_EX | LOCK_NB) == 0 && same_file(fd, path))
            unlink(path);
        close(fd);
    }
    closedir(d);
}

/* Made whole under a temporary name, then linked in: 1 made, 0 another
 * process linked one first (attach to it), or a failure. */
static laden_status create(laden_shm_t *s, uint64_t bytes, int *made)
{
    static _Atomic uint64_t seq;
    *made = 0;
    size_t n = strlen(s->path) + 64;
    char *tmp = malloc(n);
    if (!tmp)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    const char *slash = strrchr(s->path, '/');
    snprintf(tmp, n, "%.*s/.%s.%d.%llu", (int)(slash - s->path), s->path,
             slash + 1, (int)getpid(),
             (unsigned long long)atomic_fetch_add(&seq, 1));
    laden_status st = LADEN_OK;
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        st = sys_fail("cannot create", tmp);
        free(tmp);
        return st;
    }
    uint64_t total = HEADER + bytes;
    void *m = MAP_FAILED;
    int e;
    if (flock(fd, LOCK_SH) != 0 ||
        filling_lock(fd, F_WRLCK, F_OFD_SETLK) != 0) {
        st = sys_fail("cannot lock", tmp);
        goto fail;
    }
    /* Pages reserved now: on a full tmpfs a write would be SIGBUS. */
    if ((e = posix_fallocate(fd, 0, (off_t)total)) != 0) {
        st = laden__fail(e == ENOSPC || e == EFBIG ? LADEN_E_NOMEM
                                                   : LADEN_E_IO,
                         "shared memory: no room for %s in %s (%s); free "
                         "room there or point LADEN_SHM_DIR elsewhere",
                         laden__bytes(total).s, shm_dir(), strerror(e));
        goto fail;
    }
    m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        st = sys_fail("cannot map", tmp);
        goto fail;
    }
    header *h = m;
    h->bytes = bytes;
    h->creator_pid = (int32_t)getpid();
    h->creator_pid_ns = pid_ns();
    atomic_store(&h->state, FILLING);
    h->magic = MAGIC;
    if (link(tmp, s->path) != 0) {
        /* EEXIST: another process made it first; ENOENT: a sweep took
         * the temporary file before its lock (shm_open tries again). */
        if (errno != EEXIST && errno != ENOENT)
            st = sys_fail("cannot link", s->path);
        goto fail;
    }
    unlink(tmp);
    free(tmp);
    s->fd = fd;
    s->h = h;
    *made = 1;
    return LADEN_OK;
fail:
    if (m != MAP_FAILED)
        munmap(m, total);
    unlink(tmp);
    close(fd);
    free(tmp);
    return st;
}

/* Attaches to the segment at s->path: 1 in *done, or 0 when there is
 * none (any more) and the caller should make it. */
static laden_status attach(laden_shm_t *s, uint64_t bytes, int *done)
{
    *done = 0;
    int fd = open(s->path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        if (errno == ENOENT)
            return LADEN_OK;
        return sys_fail("cannot open", s->path);
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        laden_status st = sys_fail("cannot stat", s->path);
        close(fd);
        return st;
    }
    /* Only this user's own segments: /dev/shm is writable by all, and
     * the names are predictable. */
    if (sb.st_uid != geteuid() || (sb.st_mode & 077) || !S_ISREG(sb.st_mode)) {
        close(fd);
        return laden__fail(LADEN_E_STATE,
                           "shared memory %s belongs to another user or is "
                           "open to others; laden does not read it",
                           s->path);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
        /* No user: its processes ended without closing it. */
        if (same_file(fd, s->path))
            unlink(s->path);
        close(fd);
        return LADEN_OK;
    }
    /* Users, or one process checking it or removing it for a moment (or a
     * forked child that inherited such a lock): waited for, a while. */
    for (int tries = 0;; tries++) {
        if (flock(fd, LOCK_SH | LOCK_NB) == 0)
            break;
        if (errno != EWOULDBLOCK || tries == 10000) {
            laden_status st = errno == EWOULDBLOCK
                                  ? laden__fail(LADEN_E_STATE,
                                                "shared memory %s: locked "
                                                "by another process for "
                                                "10 s", s->path)
                                  : sys_fail("cannot lock", s->path);
            close(fd);
            return st;
        }
        if (!same_file(fd, s->path)) {
            close(fd);
            return LADEN_OK; /* removed meanwhile */
        }
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
    if (!same_file(fd, s->path)) { /* removed meanwhile */
        close(fd);
        return LADEN_OK;
    }
    if ((uint64_t)sb.st_size != HEADER + bytes) {
        close(fd);
        return laden__fail(LADEN_E_STATE,
                           "shared memory %s holds %s, not the %s asked for "
                           "(a segment of another content under that name)",
                           s->path,
                           laden__bytes(sb.st_size > HEADER
                                            ? (uint64_t)sb.st_size - HEADER
                                            : 0)
                               .s,
                           laden__bytes(bytes).s);
    }
    void *m = mmap(NULL, HEADER + bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   fd, 0);
    if (m == MAP_FAILED) {
        laden_status st = sys_fail("cannot map", s->path);
        close(fd);
        return st;
    }
    header *h = m;
    if (h->magic != MAGIC || h->bytes != bytes) {
        munmap(m, HEADER + bytes);
        close(fd);
        return laden__fail(LADEN_E_STATE,
                           "shared memory %s is not a laden segment", s->path);
    }
    /* Dead: its creator gave up, or ended while filling (while others
     * still held it).  Removed (those who mapped it keep their mapping)
     * and made again. */
    if (atomic_load(&h->state) == FAILED || creator_gone(fd, h)) {
        if (same_file(fd, s->path))
            unlink(s->path);
        munmap(m, HEADER + bytes);
        close(fd);
        return LADEN_OK;
    }
    s->fd = fd;
    s->h = h;
    *done = 1;
    return LADEN_OK;
}

laden_status laden_shm_open(const char *name, uint64_t bytes, uint32_t flags,
                            laden_shm_t **out, int *out_created)
{
    if (out)
        *out = NULL;
    if (out_created)
        *out_created = 0;
    if (!out || !out_created)
        return laden__fail(LADEN_E_INVAL, "laden_shm_open: NULL out");
    if (!name_ok(name))
        return laden__fail(LADEN_E_INVAL,
                           "laden_shm_open: name '%s': 1 to %d characters "
                           "of A-Z a-z 0-9 . _ -, not starting with '.'",
                           name ? name : "(null)", NAME_MAX_LEN);
    if (!bytes || bytes > (1ull << 50))
        return laden__fail(LADEN_E_INVAL, "laden_shm_open: %llu bytes",
                           (unsigned long long)bytes);
    if (flags & ~LADEN_SHM_ATTACH_ONLY)
        return laden__fail(LADEN_E_INVAL, "laden_shm_open: flags 0x%x",
                           flags);
    laden_shm_t *s = calloc(1, sizeof *s);
    size_t n = strlen(shm_dir()) + strlen(name) + 16;
    if (!s || !(s->path = malloc(n))) {
        free(s);
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    }
    snprintf(s->path, n, "%s/laden-%s", shm_dir(), name);
    s->fd = -1;
    s->bytes = bytes;
    laden_status st = LADEN_OK;
    /* A few rounds: a segment found unused is removed, another process
     * may link its own between two steps. */
    for (int round = 0; round < 16; round++) {
        int done = 0;
        if ((st = attach(s, bytes, &done)))
            break;
        if (done) {
            s->owner = getpid();
            *out = s;
            return LADEN_OK;
        }
        if (flags & LADEN_SHM_ATTACH_ONLY) {
            st = laden__fail(LADEN_E_NOENT, "shared memory %s: no process "
                                            "made it", s->path);
            break;
        }
        if (round == 0)
            sweep();
        if ((st = create(s, bytes, &done)))
            break;
        if (done) {
            s->created = true;
            s->owner = getpid();
            *out = s;
            *out_created = 1;
            return LADEN_OK;
        }
    }
    if (!st)
        st = laden__fail(LADEN_E_STATE, "shared memory %s: other processes "
                         "kept making and removing it", s->path);
    free(s->path);
    free(s);
    return st;
}

void *laden_shm_data(laden_shm_t *s)
{
    return s ? (char *)s->h + HEADER : NULL;
}

uint64_t laden_shm_bytes(laden_shm_t *s)
{
    return s ? s->bytes : 0;
}

laden_status laden_shm_set_ready(laden_shm_t *s, int ok)
{
    if (!s)
        return laden__fail(LADEN_E_INVAL, "laden_shm_set_ready: NULL");
    if (!s->created || s->filled || s->owner != getpid())
        return laden__fail(LADEN_E_STATE,
                           "laden_shm_set_ready: %s", s->created
                               ? "already marked"
                               : "only the process that made the segment "
                                 "marks it");
    atomic_store_explicit(&s->h->state, ok ? READY : FAILED,
                          memory_order_release);
    s->filled = true;
    filling_lock(s->fd, F_UNLCK, F_OFD_SETLK);
    return LADEN_OK;
}

laden_status laden_shm_wait_ready(laden_shm_t *s, uint32_t timeout_ms)
{
    if (!s)
        return laden__fail(LADEN_E_INVAL, "laden_shm_wait_ready: NULL");
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint32_t spin = 0;; spin++) {
        uint32_t state = atomic_load_explicit(&s->h->state,
                                              memory_order_acquire);
        if (state == READY)
            return LADEN_OK;
        if (state == FAILED)
            return laden__fail(LADEN_E_STATE,
                               "shared memory %s: the process that made it "
                               "could not fill it", s->path);
        if (s->created)
            return laden__fail(LADEN_E_STATE,
                               "shared memory %s: not filled yet (this "
                               "process made it: laden_shm_set_ready)",
                               s->path);
        if (creator_gone(s->fd, s->h))
            return laden__fail(LADEN_E_STATE,
                               "shared memory %s: the process filling it "
                               "(pid %d) ended before it was ready",
                               s->path, (int)s->h->creator_pid);
        clock_gettime(CLOCK_MONOTONIC, &now);
        uint64_t ms = (uint64_t)(now.tv_sec - t0.tv_sec) * 1000 +
                      (uint64_t)((now.tv_nsec - t0.tv_nsec) / 1000000);
        if (ms >= timeout_ms)
            return laden__fail(LADEN_E_STATE,
                               "shared memory %s: not ready after %u ms "
                               "(pid %d is filling it)",
                               s->path, timeout_ms, (int)s->h->creator_pid);
        struct timespec nap = {0, spin < 100 ? 200000 : 2000000};
        nanosleep(&nap, NULL);
    }
}

/* tmpfs: memory the kernel lets a driver pin for long (FOLL_LONGTERM); a
 * regular file system's pages it does not.  (hugetlbfs would be too, but
 * the segments' sizes are not multiples of its pages.) */
#define TMPFS_MAGIC_ 0x01021994

laden_status laden_shm_held_bytes(const char *prefix, uint64_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_shm_held_bytes: NULL");
    *out = 0;
    DIR *d = opendir(shm_dir());
    if (!d)
        return LADEN_OK; /* no directory: no segments */
    char path[4096];
    for (struct dirent *e; (e = readdir(d));) {
        struct stat sb;
        if (strncmp(e->d_name, "laden-", 6) != 0 ||
            (prefix && strncmp(e->d_name + 6, prefix, strlen(prefix)) != 0))
            continue;
        snprintf(path, sizeof path, "%s/%s", shm_dir(), e->d_name);
        if (lstat(path, &sb) == 0 && S_ISREG(sb.st_mode) &&
            sb.st_uid == geteuid())
            *out += (uint64_t)sb.st_size;
    }
    closedir(d);
    return LADEN_OK;
}

const char *laden_shm_path(laden_shm_t *s)
{
    return s ? s->path : NULL;
}

int laden_shm_pinnable(laden_shm_t *s)
{
    struct statfs sf;
    if (!s || fstatfs(s->fd, &sf))
        return 0;
    return (unsigned long)sf.f_type == TMPFS_MAGIC_;
}

void laden_shm_close(laden_shm_t *s)
{
    if (!s)
        return;
    if (s->owner != getpid()) {
        /* A forked child's copy: the segment stays its parent's. */
        munmap(s->h, HEADER + s->bytes);
        close(s->fd);
        free(s->path);
        free(s);
        return;
    }
    bool unfinished = s->created &&
                      atomic_load(&s->h->state) != READY;
    if (unfinished && !s->filled)
        atomic_store(&s->h->state, FAILED); /* those waiting stop */
    munmap(s->h, HEADER + s->bytes);
    /* The last user, or a creator leaving it unready, removes it. */
    if ((unfinished || flock(s->fd, LOCK_EX | LOCK_NB) == 0) &&
        same_file(s->fd, s->path))
        unlink(s->path);
    close(s->fd);
    free(s->path);
    free(s);
}
