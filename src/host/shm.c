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
#include <limits.h>
#include <pthread.h>
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
#define VERSION 2u /* the header's identity fields (issue 33) */
#define NAME_MAX_LEN 200
/* The directory's path leaves room for "/.laden-<name>.<pid>.<n>.<r>". */
#define DIR_MAX_LEN (PATH_MAX - NAME_MAX_LEN - 96)

enum { FILLING = 0, READY = 1, FAILED = 2 };

typedef struct header {
    uint64_t magic;
    uint64_t bytes;
    _Atomic uint32_t state;
    int32_t creator_pid;
    uint64_t creator_pid_ns; /* its pid namespace (inode): creator_pid
                                means something only in that one */
    /* From VERSION 2 on (zeros in an older laden's segments): */
    uint32_t version;
    uint32_t uid;
    int64_t created_ms;          /* wall clock, for laden shm list */
    char name[NAME_MAX_LEN + 8]; /* the name it was made under */
    laden_shm_ident ident;       /* what its content was made from */
} header;
_Static_assert(sizeof(header) <= HEADER, "the header fits its page");

/* This process's pid namespace, or 0 if unknown. */
static uint64_t pid_ns(void)
{
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

struct laden_shm {
    int fd;
    char *path; /* absolute: a chdir after the open changes nothing */
    header *h;
    uint64_t bytes;
    bool created;
    bool filled; /* marked (ready or failed) by this creator */
    pid_t owner; /* the process that opened it: a forked child's copy of
                    the handle only unmaps and closes */
};

/* LADEN_SHM_DIR made absolute once per value (relative to the working
 * directory when that value is first seen): segments made before a chdir
 * are found and removed after it.  A new value (tests set one per test)
 * is resolved anew. */
static pthread_mutex_t dir_mu = PTHREAD_MUTEX_INITIALIZER;
static char dir_raw[PATH_MAX], dir_abs[PATH_MAX];

static laden_status shm_dir(char out[PATH_MAX])
{
    const char *d = getenv("LADEN_SHM_DIR");
    if (!d || !*d)
        d = "/dev/shm";
    size_t n = strlen(d);
    if (n > DIR_MAX_LEN)
        return laden__fail(LADEN_E_INVAL, "LADEN_SHM_DIR: %zu characters "
                           "(at most %d)", n, DIR_MAX_LEN);
    laden_status st = LADEN_OK;
    pthread_mutex_lock(&dir_mu);
    if (!dir_abs[0] || strcmp(dir_raw, d) != 0) {
        char abs[PATH_MAX], cwd[PATH_MAX];
        if (d[0] == '/') {
            snprintf(abs, sizeof abs, "%s", d);
        } else if (!realpath(d, abs)) { /* not there (yet): joined */
            if (!getcwd(cwd, sizeof cwd) ||
                strlen(cwd) + 1 + n > DIR_MAX_LEN) {
                st = laden__fail(LADEN_E_INVAL, "LADEN_SHM_DIR '%s': "
                                 "relative, and the working directory "
                                 "is unknown or too long to join it to",
                                 d);
                goto out;
            }
            size_t c = strlen(cwd); /* c + 1 + n fits: checked above */
            memcpy(abs, cwd, c);
            abs[c] = '/';
            memcpy(abs + c + 1, d, n + 1);
        }
        size_t k = strlen(abs);
        while (k > 1 && abs[k - 1] == '/')
            abs[--k] = 0;
        if (k > DIR_MAX_LEN) {
            st = laden__fail(LADEN_E_INVAL, "LADEN_SHM_DIR '%s': %zu "
                             "characters as an absolute path (at most %d)",
                             d, k, DIR_MAX_LEN);
            goto out;
        }
        memcpy(dir_abs, abs, k + 1);
        memcpy(dir_raw, d, n + 1);
    }
    memcpy(out, dir_abs, strlen(dir_abs) + 1);
out:
    pthread_mutex_unlock(&dir_mu);
    return st;
}

laden_status laden_shm_dir(char *out, size_t cap)
{
    if (out && cap)
        out[0] = 0;
    if (!out || !cap)
        return laden__fail(LADEN_E_INVAL, "laden_shm_dir: NULL");
    char d[PATH_MAX];
    laden_status st = shm_dir(d);
    if (st)
        return st;
    if (strlen(d) >= cap)
        return laden__fail(LADEN_E_INVAL, "laden_shm_dir: %zu bytes of "
                           "room for a path of %zu", cap, strlen(d) + 1);
    memcpy(out, d, strlen(d) + 1);
    return LADEN_OK;
}

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

static bool name_ok(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (!n || n > NAME_MAX_LEN)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!name_char(name[i]))
            return false;
    return name[0] != '.';
}

/* A maker's temporary file: ".laden-<name>.<pid>.<n>[.<hex>]" (the last
 * part from this version on). */
static bool temp_name_ok(const char *n)
{
    if (strncmp(n, ".laden-", 7) != 0)
        return false;
    n += 7;
    size_t len = strlen(n), end = len, parts = 0;
    if (!len || len > NAME_MAX_LEN + 64 || n[0] == '.')
        return false;
    for (size_t i = 0; i < len; i++)
        if (!name_char(n[i]))
            return false;
    while (parts < 3) { /* trailing ".<hex digits>" parts */
        size_t i = end;
        while (i > 0 && ((n[i - 1] >= '0' && n[i - 1] <= '9') ||
                         (n[i - 1] >= 'a' && n[i - 1] <= 'f')))
            i--;
        if (i == end || i == 0 || n[i - 1] != '.')
            break;
        end = i - 1;
        parts++;
    }
    return parts >= 2 && end > 0;
}

/* 1 if `path` still names the file open as fd (a symlink there does
 * not). */
static bool same_file(int fd, const char *path)
{
    struct stat a, b;
    return fstat(fd, &a) == 0 && lstat(path, &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
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

static int64_t wall_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Why what lstat or fstat found at a laden name is not a file of this
 * user's that laden may open: NULL if it is. */
static const char *not_ours(const struct stat *sb, char *buf, size_t cap)
{
    if (S_ISLNK(sb->st_mode))
        return "a symbolic link";
    if (S_ISDIR(sb->st_mode))
        return "a directory";
    if (S_ISFIFO(sb->st_mode))
        return "a FIFO";
    if (!S_ISREG(sb->st_mode))
        return "not a regular file";
    if (sb->st_uid != geteuid()) {
        snprintf(buf, cap, "a file of another user (uid %u)",
                 (unsigned)sb->st_uid);
        return buf;
    }
    if (sb->st_mode & 077)
        return "a file open to other users (mode not 0600)";
    return NULL;
}

/* ---- the directory: what is there, what dead processes left ----------- */

/* Looks at directory entry `n` (a laden name) without following,
 * blocking or opening what is not this user's regular file: fills *e and
 * returns a descriptor open on it if it is laden's, -1 if not (e->kind
 * FOREIGN) and -2 if it is gone.  With users == 0 the descriptor holds
 * LOCK_EX: nobody else can begin using it before it is closed. */
static int look(int dfd, const char *n, int64_t now, laden_shm_entry *e,
                struct stat *sb)
{
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", n);
    e->kind = strncmp(n, "laden-", 6) == 0 ? LADEN_SHM_SEGMENT
                                            : LADEN_SHM_TEMPORARY;
    e->users = e->state = -1;
    if (fstatat(dfd, n, sb, AT_SYMLINK_NOFOLLOW) != 0)
        return -2;
    e->file_bytes = S_ISREG(sb->st_mode) ? (uint64_t)sb->st_size : 0;
    e->age_ms = now - ((int64_t)sb->st_mtim.tv_sec * 1000 +
                       sb->st_mtim.tv_nsec / 1000000);
    char buf[64];
    const char *why = not_ours(sb, buf, sizeof buf);
    bool named = e->kind == LADEN_SHM_SEGMENT ? name_ok(n + 6)
                                              : temp_name_ok(n);
    if (!why && !named)
        why = "a name laden does not make";
    int fd = -1;
    if (!why) {
        fd = openat(dfd, n, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK |
                                O_NOCTTY);
        struct stat fsb;
        if (fd < 0)
            why = errno == ENOENT ? NULL : "a file laden cannot open";
        else if (fstat(fd, &fsb) != 0 || fsb.st_dev != sb->st_dev ||
                 fsb.st_ino != sb->st_ino)
            why = "a file replaced while looked at";
        if (fd < 0 && !why)
            return -2;
    }
    header h;
    memset(&h, 0, sizeof h);
    ssize_t got = 0;
    if (!why && (got = pread(fd, &h, sizeof h, 0)) < 0)
        why = "a file laden cannot read";
    if (!why) {
        bool has_magic = got == (ssize_t)sizeof h && h.magic == MAGIC;
        /* A maker that died before writing the header left zeros, or
         * nothing. */
        bool blank = got < (ssize_t)sizeof h.magic || h.magic == 0;
        if (e->kind == LADEN_SHM_SEGMENT ? !has_magic
                                         : !(has_magic || blank))
            why = "a file without a laden header";
        else if (has_magic) {
            uint32_t state = atomic_load(&h.state);
            e->state = state <= FAILED ? (int32_t)state : -1;
            e->data_bytes = h.bytes;
            e->creator_pid = h.creator_pid;
            if (h.version == VERSION) {
                snprintf(e->label, sizeof e->label, "%.*s",
                         (int)sizeof h.ident.label, h.ident.label);
                if (h.created_ms > 0)
                    e->age_ms = now - h.created_ms;
            }
        }
    }
    if (why) {
        if (fd >= 0)
            close(fd);
        e->kind = LADEN_SHM_FOREIGN;
        e->state = -1;
        e->data_bytes = 0;
        e->label[0] = 0;
        snprintf(e->what, sizeof e->what, "%s", why);
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) == 0)
        e->users = 0;
    else if (errno == EWOULDBLOCK)
        e->users = 1;
    if (e->age_ms < 0)
        e->age_ms = 0;
    return fd;
}

/* The laden names of directory `d`: calls fn for each file there. */
typedef void (*entry_fn)(int dfd, const char *name, int64_t now, void *arg);

static laden_status each_entry(const char *what, entry_fn fn, void *arg)
{
    char dir[PATH_MAX];
    laden_status st = shm_dir(dir);
    if (st)
        return st;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT || errno == ENOTDIR)
            return LADEN_OK; /* no directory: no segments */
        return laden__fail(LADEN_E_IO, "%s: shared memory directory %s: "
                           "%s", what, dir, strerror(errno));
    }
    int64_t now = wall_ms();
    for (struct dirent *e; (e = readdir(d));)
        if (strncmp(e->d_name, "laden-", 6) == 0 ||
            strncmp(e->d_name, ".laden-", 7) == 0)
            fn(dirfd(d), e->d_name, now, arg);
    closedir(d);
    return LADEN_OK;
}

typedef struct collect {
    laden_shm_entry *out;
    uint32_t cap, count;
    uint64_t bytes;
} collect;

static void keep(collect *c, const laden_shm_entry *e)
{
    if (c->count < c->cap)
        c->out[c->count] = *e;
    if (c->count < UINT32_MAX)
        c->count++;
}

static void list_one(int dfd, const char *n, int64_t now, void *arg)
{
    collect *c = arg;
    laden_shm_entry e;
    struct stat sb;
    int fd = look(dfd, n, now, &e, &sb);
    if (fd == -2)
        return;
    if (fd >= 0)
        close(fd); /* and with it the lock look took */
    keep(c, &e);
}

/* Removes entry n if nobody holds it (look's LOCK_EX, kept until it is
 * unlinked: a process opening it meanwhile waits for its shared lock,
 * then sees the file gone and makes another). */
static void reclaim_one(int dfd, const char *n, int64_t now, void *arg)
{
    collect *c = arg;
    laden_shm_entry e;
    struct stat sb, now_sb;
    int fd = look(dfd, n, now, &e, &sb);
    if (fd < 0)
        return;
    if (e.users == 0 && fstatat(dfd, n, &now_sb, AT_SYMLINK_NOFOLLOW) == 0 &&
        now_sb.st_dev == sb.st_dev && now_sb.st_ino == sb.st_ino &&
        unlinkat(dfd, n, 0) == 0) {
        keep(c, &e);
        c->bytes += e.file_bytes;
    }
    close(fd);
}

laden_status laden_shm_list(laden_shm_entry *out, uint32_t cap,
                            uint32_t *out_count)
{
    if (out_count)
        *out_count = 0;
    if (!out_count || (cap && !out))
        return laden__fail(LADEN_E_INVAL, "laden_shm_list: NULL");
    collect c = {.out = out, .cap = cap};
    laden_status st = each_entry("laden_shm_list", list_one, &c);
    *out_count = c.count;
    return st;
}

laden_status laden_shm_reclaim(laden_shm_entry *removed, uint32_t cap,
                               uint32_t *out_count, uint64_t *out_bytes)
{
    if (out_count)
        *out_count = 0;
    if (out_bytes)
        *out_bytes = 0;
    if (cap && !removed)
        return laden__fail(LADEN_E_INVAL, "laden_shm_reclaim: NULL");
    collect c = {.out = removed, .cap = cap};
    laden_status st = each_entry("laden_shm_reclaim", reclaim_one, &c);
    if (out_count)
        *out_count = c.count;
    if (out_bytes)
        *out_bytes = c.bytes;
    return st;
}

/* Made whole under a temporary name, then linked in: 1 made, 0 another
 * process linked one first (attach to it), or a failure. */
static laden_status create(laden_shm_t *s, uint64_t bytes,
                           const laden_shm_ident *id, const char *name,
                           int *made)
{
    static _Atomic uint64_t seq;
    *made = 0;
    size_t n = strlen(s->path) + 80;
    char *tmp = malloc(n);
    if (!tmp)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    const char *slash = strrchr(s->path, '/');
    laden_status st = LADEN_OK;
    int fd = -1;
    /* A part no other local user can guess: a file planted at the name
     * would otherwise make every load of it fail. */
    for (int tries = 0; fd < 0 && tries < 8; tries++) {
        uint64_t r = laden__now_ns() ^ ((uint64_t)(uintptr_t)tmp << 16) ^
                     ((uint64_t)tries * 0x9e3779b97f4a7c15ull);
        r ^= r >> 29;
        r *= 0xbf58476d1ce4e5b9ull;
        r ^= r >> 32;
        snprintf(tmp, n, "%.*s/.%s.%d.%llu.%016llx", (int)(slash - s->path),
                 s->path, slash + 1, (int)getpid(),
                 (unsigned long long)atomic_fetch_add(&seq, 1),
                 (unsigned long long)r);
        fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                  0600);
        if (fd < 0 && errno != EEXIST)
            break;
    }
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
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - s->path), s->path);
        st = laden__fail(e == ENOSPC || e == EFBIG ? LADEN_E_NOMEM
                                                   : LADEN_E_IO,
                         "shared memory: no room for %s in %s (%s); free "
                         "room there or point LADEN_SHM_DIR elsewhere",
                         laden__bytes(total).s, dir, strerror(e));
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
    h->version = VERSION;
    h->uid = (uint32_t)geteuid();
    h->created_ms = wall_ms();
    snprintf(h->name, sizeof h->name, "%s", name);
    if (id) {
        h->ident = *id;
        h->ident.label[sizeof h->ident.label - 1] = 0;
    }
    atomic_store(&h->state, FILLING);
    h->magic = MAGIC;
    if (link(tmp, s->path) != 0) {
        /* EEXIST: another process made it first (or something else holds
         * the name: attach says what); ENOENT: a sweep took the temporary
         * file before its lock (shm_open tries again). */
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

/* The name cannot be used for this segment: what holds it stays as it
 * is, and the caller may keep memory of its own. */
static laden_status refused(const char *path, const char *why)
{
    return laden__fail(LADEN_E_STATE, "shared memory %s is %s; laden does "
                       "not use it", path, why);
}

/* Attaches to the segment at s->path: 1 in *done, or 0 when there is
 * none (any more) and the caller should make it.  What is at the name is
 * looked at before it is opened (nothing followed, nothing of another
 * user's opened, no FIFO opened to block on) and its header read before
 * it is locked, used or removed: only a segment laden made for this very
 * name and content is attached to, and only a segment of laden's that
 * nobody holds is removed. */
static laden_status attach(laden_shm_t *s, uint64_t bytes,
                           const laden_shm_ident *id, const char *name,
                           int *done)
{
    *done = 0;
    struct stat sb;
    char buf[64];
    const char *why;
    if (lstat(s->path, &sb) != 0) {
        if (errno == ENOENT)
            return LADEN_OK;
        return sys_fail("cannot stat", s->path);
    }
    if ((why = not_ours(&sb, buf, sizeof buf)))
        return refused(s->path, why);
    int fd = open(s->path,
                  O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ENOENT)
            return LADEN_OK;
        if (errno == ELOOP || errno == EISDIR || errno == ENXIO ||
            errno == EACCES || errno == EPERM || errno == EWOULDBLOCK)
            return refused(s->path, "not a file of laden's (it changed "
                           "while looked at)");
        return sys_fail("cannot open", s->path);
    }
    laden_status st = LADEN_OK;
    header hd;
    void *m = MAP_FAILED;
    if (fstat(fd, &sb) != 0) {
        st = sys_fail("cannot stat", s->path);
        goto out;
    }
    if ((why = not_ours(&sb, buf, sizeof buf))) {
        st = refused(s->path, why);
        goto out;
    }
    if ((uint64_t)sb.st_size < HEADER ||
        pread(fd, &hd, sizeof hd, 0) != (ssize_t)sizeof hd ||
        hd.magic != MAGIC) {
        st = refused(s->path, "a file laden did not make (no laden header)");
        goto out;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
        /* No user: its processes ended without closing it. */
        if (same_file(fd, s->path))
            unlink(s->path);
        goto out;
    }
    /* Users, or one process checking it or removing it for a moment (or a
     * forked child that inherited such a lock): waited for, a while. */
    for (int tries = 0;; tries++) {
        if (flock(fd, LOCK_SH | LOCK_NB) == 0)
            break;
        if (errno != EWOULDBLOCK || tries == 10000) {
            st = errno == EWOULDBLOCK
                     ? laden__fail(LADEN_E_STATE, "shared memory %s: locked "
                                   "by another process for 10 s", s->path)
                     : sys_fail("cannot lock", s->path);
            goto out;
        }
        if (!same_file(fd, s->path))
            goto out; /* removed meanwhile */
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
    if (!same_file(fd, s->path)) /* removed meanwhile */
        goto out;
    /* Laden's, in use: is it this segment? */
    if (hd.version != VERSION) {
        snprintf(buf, sizeof buf, "a segment of another laden version "
                 "(header version %u)", hd.version);
        st = refused(s->path, buf);
        goto out;
    }
    if (strncmp(hd.name, name, sizeof hd.name) != 0) {
        hd.name[sizeof hd.name - 1] = 0;
        hd.ident.label[sizeof hd.ident.label - 1] = 0;
        st = laden__fail(LADEN_E_STATE,
                         "shared memory %s is segment '%s' (of %s) linked "
                         "under another name; laden does not use it",
                         s->path, hd.name,
                         hd.ident.label[0] ? hd.ident.label : "unknown");
        goto out;
    }
    laden_shm_ident want;
    memset(&want, 0, sizeof want);
    if (id)
        want = *id;
    want.label[sizeof want.label - 1] = 0;
    if (memcmp(hd.ident.content, want.content, sizeof want.content) ||
        memcmp(hd.ident.source, want.source, sizeof want.source)) {
        hd.ident.label[sizeof hd.ident.label - 1] = 0;
        st = laden__fail(LADEN_E_STATE,
                         "shared memory %s holds another content (made "
                         "from %s) under this name; laden does not use it",
                         s->path,
                         hd.ident.label[0] ? hd.ident.label : "unknown");
        goto out;
    }
    if ((uint64_t)sb.st_size != HEADER + bytes || hd.bytes != bytes) {
        st = laden__fail(LADEN_E_STATE,
                         "shared memory %s holds %s, not the %s asked for "
                         "(a segment of another content under that name)",
                         s->path,
                         laden__bytes((uint64_t)sb.st_size - HEADER).s,
                         laden__bytes(bytes).s);
        goto out;
    }
    m = mmap(NULL, HEADER + bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
             0);
    if (m == MAP_FAILED) {
        st = sys_fail("cannot map", s->path);
        goto out;
    }
    header *h = m;
    /* Dead: its creator gave up, or ended while filling (while others
     * still held it).  Removed (those who mapped it keep their mapping)
     * and made again. */
    if (atomic_load(&h->state) == FAILED || creator_gone(fd, h)) {
        if (same_file(fd, s->path))
            unlink(s->path);
        goto out;
    }
    s->fd = fd;
    s->h = h;
    *done = 1;
    return LADEN_OK;
out:
    if (m != MAP_FAILED)
        munmap(m, HEADER + bytes);
    close(fd);
    return st;
}

laden_status laden_shm_open(const char *name, uint64_t bytes,
                            const laden_shm_ident *ident, uint32_t flags,
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
    char dir[PATH_MAX];
    laden_status st = shm_dir(dir);
    if (st)
        return st;
    laden_shm_t *s = calloc(1, sizeof *s);
    size_t n = strlen(dir) + strlen(name) + 16;
    if (!s || !(s->path = malloc(n))) {
        free(s);
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    }
    snprintf(s->path, n, "%s/laden-%s", dir, name);
    s->fd = -1;
    s->bytes = bytes;
    /* A few rounds: a segment found unused is removed, another process
     * may link its own between two steps. */
    for (int round = 0; round < 16; round++) {
        int done = 0;
        if ((st = attach(s, bytes, ident, name, &done)))
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
        if (round == 0) /* room made before more is taken */
            laden_shm_reclaim(NULL, 0, NULL, NULL);
        if ((st = create(s, bytes, ident, name, &done)))
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
    char dir[PATH_MAX];
    laden_status st = shm_dir(dir);
    if (st)
        return st;
    DIR *d = opendir(dir);
    if (!d)
        return LADEN_OK; /* no directory: no segments */
    for (struct dirent *e; (e = readdir(d));) {
        struct stat sb;
        if (strncmp(e->d_name, "laden-", 6) != 0 ||
            (prefix && strncmp(e->d_name + 6, prefix, strlen(prefix)) != 0))
            continue;
        if (fstatat(dirfd(d), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISREG(sb.st_mode) && sb.st_uid == geteuid())
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
