/* Host memory shared by name between processes: one process makes and
 * fills a segment, the others attach and read it; the last to close
 * removes it; a segment whose users died is made again; a creator that
 * dies while filling is noticed; a full directory is an error, not a
 * SIGBUS. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

#include "laden/dev.h"
#include "laden/shm.h"
#include "laden/st.h"
#include "laden/stream.h"

#define BYTES (3u << 20)

static void use_test_dir(void)
{
    setenv("LADEN_SHM_DIR", test_tmpdir(), 1);
}

static bool exists(const char *name)
{
    char p[512];
    snprintf(p, sizeof p, "%s/laden-%s", test_tmpdir(), name);
    struct stat sb;
    return stat(p, &sb) == 0;
}

static void fill(unsigned char *d, uint64_t n, unsigned seed)
{
    for (uint64_t i = 0; i < n; i++)
        d[i] = (unsigned char)((i * 2654435761u + seed) >> 13);
}

static bool same(const unsigned char *d, uint64_t n, unsigned seed)
{
    for (uint64_t i = 0; i < n; i++)
        if (d[i] != (unsigned char)((i * 2654435761u + seed) >> 13))
            return false;
    return true;
}

/* A child that attaches, waits, checks, closes: exit 0 if all went well,
 * 2 if it made the segment instead. */
static int child_reads(const char *name, unsigned seed)
{
    laden_shm_t *s;
    int created;
    if (laden_shm_open(name, BYTES, NULL, 0, &s, &created))
        return 1;
    if (created) {
        fill(laden_shm_data(s), BYTES, seed);
        laden_shm_set_ready(s, 1);
        laden_shm_close(s);
        return 2;
    }
    int ok = laden_shm_wait_ready(s, 20000) == LADEN_OK &&
             same(laden_shm_data(s), BYTES, seed);
    laden_shm_close(s);
    return ok ? 0 : 1;
}

TEST(shm_one_copy_for_processes)
{
    use_test_dir();
    laden_shm_t *s, *t;
    int created;
    CHECK_OK(laden_shm_open("model-a", BYTES, NULL, 0, &s, &created));
    CHECK_EQ(created, 1);
    CHECK(exists("model-a"));
    CHECK_EQ(laden_shm_bytes(s), BYTES);
    CHECK_EQ((uintptr_t)laden_shm_data(s) % 4096, 0);
    /* Attachers before it is filled wait; after, read. */
    pid_t early = fork();
    if (early == 0)
        _exit(child_reads("model-a", 7));
    fill(laden_shm_data(s), BYTES, 7);
    CHECK_STATUS(laden_shm_wait_ready(s, 0), LADEN_E_STATE); /* made here */
    CHECK_OK(laden_shm_set_ready(s, 1));
    CHECK_STATUS(laden_shm_set_ready(s, 1), LADEN_E_STATE);
    int st;
    CHECK_EQ(waitpid(early, &st, 0), early);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    pid_t kids[4];
    for (int i = 0; i < 4; i++)
        if ((kids[i] = fork()) == 0)
            _exit(child_reads("model-a", 7));
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(waitpid(kids[i], &st, 0), kids[i]);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    /* In this process too: one mapping of the same bytes. */
    CHECK_OK(laden_shm_open("model-a", BYTES, NULL, LADEN_SHM_ATTACH_ONLY, &t,
                            &created));
    CHECK_EQ(created, 0);
    CHECK_OK(laden_shm_wait_ready(t, 0));
    CHECK(same(laden_shm_data(t), BYTES, 7));
    CHECK_STATUS(laden_shm_set_ready(t, 1), LADEN_E_STATE);
    laden_shm_close(s);
    CHECK(exists("model-a")); /* t still uses it */
    laden_shm_close(t);
    CHECK(!exists("model-a"));
    laden_shm_close(NULL);
}

TEST(shm_racing_openers_make_one)
{
    use_test_dir();
    pid_t kids[6];
    for (int i = 0; i < 6; i++)
        if ((kids[i] = fork()) == 0)
            _exit(child_reads("race", 3));
    int made = 0;
    for (int i = 0; i < 6; i++) {
        int st;
        CHECK_EQ(waitpid(kids[i], &st, 0), kids[i]);
        CHECK(WIFEXITED(st));
        CHECK(WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 2);
        made += WEXITSTATUS(st) == 2;
    }
    /* One made it; a late opener may have found it removed and made it
     * again (every user had closed): never two at once. */
    CHECK(made >= 1);
    CHECK(!exists("race"));
}

TEST(shm_users_that_died_leave_it_to_be_made_again)
{
    use_test_dir();
    pid_t p = fork();
    if (p == 0) {
        laden_shm_t *s;
        int created;
        if (laden_shm_open("dead", BYTES, NULL, 0, &s, &created) || !created)
            _exit(1);
        fill(laden_shm_data(s), BYTES, 1);
        laden_shm_set_ready(s, 1);
        _exit(0); /* no close */
    }
    int st;
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(exists("dead"));
    laden_shm_t *s;
    int created;
    CHECK_OK(laden_shm_open("dead", BYTES, NULL, 0, &s, &created));
    CHECK_EQ(created, 1); /* made again, not attached to the leftover */
    laden_shm_close(s); /* not marked ready: removed */
    CHECK(!exists("dead"));
}

TEST(shm_creator_ending_while_filling_is_noticed)
{
    use_test_dir();
    int up[2], go[2];
    CHECK_EQ(pipe(up), 0);
    CHECK_EQ(pipe(go), 0);
    pid_t p = fork();
    if (p == 0) {
        laden_shm_t *s;
        int created;
        char c = 0;
        if (laden_shm_open("half", BYTES, NULL, 0, &s, &created) || !created)
            _exit(1);
        if (write(up[1], "x", 1) != 1 || read(go[0], &c, 1) != 1)
            _exit(1);
        _exit(0); /* ends while filling */
    }
    char c;
    CHECK_EQ(read(up[0], &c, 1), 1);
    laden_shm_t *s;
    int created;
    CHECK_OK(laden_shm_open("half", BYTES, NULL, 0, &s, &created));
    CHECK_EQ(created, 0);
    CHECK_STATUS(laden_shm_wait_ready(s, 0), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "not ready after"));
    CHECK_EQ(write(go[1], "x", 1), 1);
    int st;
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK_STATUS(laden_shm_wait_ready(s, 5000), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "ended before it was ready"));
    /* While it still holds the dead segment, a new open makes another. */
    laden_shm_t *fresh;
    CHECK_OK(laden_shm_open("half", BYTES, NULL, 0, &fresh, &created));
    CHECK_EQ(created, 1);
    CHECK_OK(laden_shm_set_ready(fresh, 1));
    laden_shm_close(s);
    CHECK(exists("half")); /* the fresh one */
    laden_shm_close(fresh);
    CHECK(!exists("half"));
    close(up[0]);
    close(up[1]);
    close(go[0]);
    close(go[1]);

    /* A creator that gives up: those waiting are told. */
    laden_shm_t *a, *b;
    CHECK_OK(laden_shm_open("gave-up", BYTES, NULL, 0, &a, &created));
    CHECK_EQ(created, 1);
    CHECK_OK(laden_shm_open("gave-up", BYTES, NULL, 0, &b, &created));
    CHECK_EQ(created, 0);
    CHECK_OK(laden_shm_set_ready(a, 0));
    CHECK_STATUS(laden_shm_wait_ready(b, 1000), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "could not fill"));
    laden_shm_close(a);
    laden_shm_close(b);
    CHECK(!exists("gave-up"));
}

TEST(shm_bad_arguments_and_no_room)
{
    use_test_dir();
    laden_shm_t *s = (laden_shm_t *)1;
    int created = 9;
    CHECK_STATUS(laden_shm_open("a/b", BYTES, NULL, 0, &s, &created),
                 LADEN_E_INVAL);
    CHECK(!s && !created);
    CHECK_STATUS(laden_shm_open(".hidden", BYTES, NULL, 0, &s, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("", BYTES, NULL, 0, &s, &created), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open(NULL, BYTES, NULL, 0, &s, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("ok", 0, NULL, 0, &s, &created), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("ok", BYTES, NULL, 8, &s, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("ok", BYTES, NULL, 0, NULL, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("none", BYTES, NULL, LADEN_SHM_ATTACH_ONLY, &s,
                                &created),
                 LADEN_E_NOENT);
    CHECK(!exists("none"));
    CHECK_STATUS(laden_shm_set_ready(NULL, 1), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_wait_ready(NULL, 1), LADEN_E_INVAL);
    /* Another size under the same name: refused, the segment unchanged. */
    laden_shm_t *a;
    CHECK_OK(laden_shm_open("sized", BYTES, NULL, 0, &a, &created));
    CHECK_STATUS(laden_shm_open("sized", 2 * BYTES, NULL, 0, &s, &created),
                 LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "another content"));
    laden_shm_close(a);
    /* No room (a file size limit stands in for a full /dev/shm): an
     * error naming the directory, in a child (the limit is its own). */
    pid_t p = fork();
    if (p == 0) {
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit r = {1 << 20, 1 << 20};
        setrlimit(RLIMIT_FSIZE, &r);
        laden_shm_t *t;
        int c;
        laden_status st = laden_shm_open("big", BYTES, NULL, 0, &t, &c);
        _exit(st == LADEN_E_NOMEM &&
                      strstr(laden_last_error(), "LADEN_SHM_DIR") &&
                      !exists("big")
                  ? 0
                  : 1);
    }
    int st;
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

TEST(shm_forked_copies_and_other_owners)
{
    use_test_dir();
    laden_shm_t *s;
    int created;
    CHECK_OK(laden_shm_open("forked", BYTES, NULL, 0, &s, &created));
    CHECK_EQ(created, 1);
    /* A child's copy of the handle (fork without exec) only lets go. */
    pid_t p = fork();
    if (p == 0) {
        int bad = laden_shm_set_ready(s, 0) != LADEN_E_STATE;
        laden_shm_close(s);
        _exit(bad);
    }
    int st;
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(exists("forked"));
    fill(laden_shm_data(s), BYTES, 5);
    CHECK_OK(laden_shm_set_ready(s, 1));
    laden_shm_close(s);
    CHECK(!exists("forked"));
    /* A file open to others under a laden name is not read. */
    char path[512];
    snprintf(path, sizeof path, "%s/laden-foreign", test_tmpdir());
    FILE *f = fopen(path, "w");
    CHECK(f);
    fclose(f);
    CHECK_EQ(chmod(path, 0644), 0);
    CHECK_STATUS(laden_shm_open("foreign", BYTES, NULL, 0, &s, &created),
                 LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "open to other users"));
    CHECK(exists("foreign"));
    unlink(path);
}

/* Leftovers of dead processes under other names: a segment nobody holds
 * and a maker's temporary file are removed when any segment is made; a
 * segment a live process holds stays. */
TEST(shm_leftovers_of_any_name_are_swept)
{
    use_test_dir();
    pid_t p = fork();
    if (p == 0) {
        laden_shm_t *s;
        int created;
        if (laden_shm_open("left", BYTES, NULL, 0, &s, &created) || !created)
            _exit(1);
        laden_shm_set_ready(s, 1);
        _exit(0); /* ends without closing it */
    }
    int st = -1;
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(exists("left"));
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s/.laden-gone.%d.0", test_tmpdir(),
             (int)p); /* p has ended */
    int fd = open(tmp, O_CREAT | O_RDWR, 0600);
    CHECK(fd >= 0);
    close(fd);
    laden_shm_t *held, *s;
    int created;
    CHECK_OK(laden_shm_open("held", BYTES, NULL, 0, &held, &created));
    CHECK_OK(laden_shm_set_ready(held, 1));
    CHECK(!exists("left"));
    CHECK(access(tmp, F_OK) != 0);
    CHECK_OK(laden_shm_open("other", BYTES, NULL, 0, &s, &created));
    CHECK(exists("held")); /* held by this process: kept */
    laden_shm_close(s);
    laden_shm_close(held);
    CHECK(!exists("held"));
}

/* What a planning process counts as attachable: this user's segments. */
TEST(shm_held_bytes_counts_segments)
{
    use_test_dir();
    uint64_t n = 1;
    CHECK_OK(laden_shm_held_bytes(NULL, &n));
    CHECK_EQ(n, 0);
    laden_shm_t *a, *b;
    int created;
    CHECK_OK(laden_shm_open("counted", BYTES, NULL, 0, &a, &created));
    CHECK_OK(laden_shm_open("other", BYTES, NULL, 0, &b, &created));
    CHECK_OK(laden_shm_held_bytes(NULL, &n));
    CHECK(n >= 2 * BYTES && n <= 2 * (BYTES + 65536)); /* data, header */
    CHECK_OK(laden_shm_held_bytes("count", &n)); /* by name */
    CHECK(n >= BYTES && n <= BYTES + 65536);
    CHECK_OK(laden_shm_held_bytes("nothing", &n));
    CHECK_EQ(n, 0);
    laden_shm_close(a);
    laden_shm_close(b);
    CHECK_OK(laden_shm_held_bytes("", &n));
    CHECK_EQ(n, 0);
    CHECK_STATUS(laden_shm_held_bytes(NULL, NULL), LADEN_E_INVAL);
}

/* ---- issue 33: segments outlive their users ---------------------------- */

static char *seg_path(const char *name)
{
    static char p[8][600];
    static int k;
    char *q = p[k++ % 8];
    snprintf(q, 600, "%s/laden-%s", test_tmpdir(), name);
    return q;
}

/* A child that makes segment `name`, marks it ready and ends as `how`
 * says: 0 _exit without closing, else killed by that signal. */
static void leave_dead(const char *name, int how)
{
    int up[2];
    CHECK_EQ(pipe(up), 0);
    pid_t p = fork();
    if (p == 0) {
        laden_shm_t *s;
        int created;
        if (laden_shm_open(name, BYTES, NULL, 0, &s, &created) || !created)
            _exit(1);
        fill(laden_shm_data(s), BYTES, 9);
        laden_shm_set_ready(s, 1);
        if (write(up[1], "x", 1) != 1)
            _exit(1);
        if (!how)
            _exit(0);
        for (;;)
            pause();
    }
    char c;
    CHECK_EQ(read(up[0], &c, 1), 1);
    if (how)
        CHECK_EQ(kill(p, how), 0);
    int st;
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK(how ? WIFSIGNALED(st) && WTERMSIG(st) == how
              : WIFEXITED(st) && WEXITSTATUS(st) == 0);
    close(up[0]);
    close(up[1]);
    CHECK(exists(name));
}

/* A checkpoint of one U8 tensor "w" of n bytes, byte j = j * 7 + seed. */
static char *tiny_model(const char *file, uint64_t n, unsigned seed)
{
    char hdr[256];
    snprintf(hdr, sizeof hdr, "{\"w\":{\"dtype\":\"U8\",\"shape\":[%llu],"
             "\"data_offsets\":[0,%llu]}}", (unsigned long long)n,
             (unsigned long long)n);
    unsigned char *d = malloc(n);
    for (uint64_t j = 0; j < n; j++)
        d[j] = (unsigned char)(j * 7 + seed);
    char *p = test_path(file);
    test_write_st(p, hdr, d, n);
    free(d);
    return p;
}

typedef struct {
    laden_st_t *st;
    laden_sched_t *sc;
    uint32_t block;
} tiny;

/* Loads it on the CPU device (the RAM tier), shared or not; its share
 * state in *state. */
static void tiny_load_on(tiny *t, const char *path, bool shared,
                         int32_t *state, int32_t device)
{
    memset(t, 0, sizeof *t);
    CHECK_OK(laden_st_open(path, &t->st));
    laden_sched_config cfg = {.device = device, .lookahead = 2};
    CHECK_OK(laden_sched_create(&cfg, t->st, &t->sc));
    CHECK_OK(laden_sched_add_block(t->sc, LADEN_TIER_RAM, &t->block));
    size_t idx;
    uint32_t ti;
    CHECK_OK(laden_st_find(t->st, "w", &idx));
    CHECK_OK(laden_sched_add_tensor(t->sc, t->block, t->st, idx,
                                    LADEN_DTYPE_U8, &ti));
    if (shared)
        CHECK_OK(laden_sched_share(t->sc, "test"));
    CHECK_OK(laden_sched_load(t->sc));
    if (state)
        CHECK_OK(laden_sched_share_info(t->sc, NULL, 0, NULL, state));
}

static void tiny_load(tiny *t, const char *path, bool shared,
                      int32_t *state)
{
    tiny_load_on(t, path, shared, state, LADEN_DEVICE_CPU);
}

static bool tiny_right(tiny *t, uint64_t n, unsigned seed)
{
    void *p = NULL;
    if (laden_sched_host_ptr(t->sc, t->block, 0, &p) || !p)
        return false;
    const unsigned char *d = p;
    for (uint64_t j = 0; j < n; j++)
        if (d[j] != (unsigned char)(j * 7 + seed))
            return false;
    return true;
}

static void tiny_drop(tiny *t)
{
    laden_sched_destroy(t->sc);
    laden_st_close(t->st);
}

/* The last user of a segment ends without closing it (_exit, SIGKILL,
 * SIGTERM): the next load of any checkpoint -- a private one too --
 * removes it; a segment a live process holds stays. */
TEST(shm_dead_users_reclaimed_by_a_private_load)
{
    use_test_dir();
    int hows[] = {0, SIGKILL, SIGTERM};
    char names[3][16];
    for (int i = 0; i < 3; i++) {
        snprintf(names[i], sizeof names[i], "dead%d", i);
        leave_dead(names[i], hows[i]);
    }
    laden_shm_t *live;
    int created;
    CHECK_OK(laden_shm_open("live", BYTES, NULL, 0, &live, &created));
    CHECK_OK(laden_shm_set_ready(live, 1));
    tiny t;
    int32_t state = -1;
    tiny_load(&t, tiny_model("m.safetensors", 5000, 1), false, &state);
    CHECK_EQ(state, 0);
    CHECK(tiny_right(&t, 5000, 1));
    for (int i = 0; i < 3; i++)
        CHECK(!exists(names[i]));
    CHECK(exists("live"));
    tiny_drop(&t);
    laden_shm_close(live);
    CHECK(!exists("live"));
}

/* A relative LADEN_SHM_DIR is made absolute at first use: a chdir after
 * it changes neither where an open finds the segment nor which file the
 * last close removes. */
TEST(shm_relative_dir_and_chdir)
{
    char here[4096];
    CHECK(getcwd(here, sizeof here));
    CHECK_EQ(chdir(test_tmpdir()), 0);
    CHECK_EQ(mkdir("rel", 0700), 0);
    setenv("LADEN_SHM_DIR", "rel", 1);
    char dir[4096];
    CHECK_OK(laden_shm_dir(dir, sizeof dir));
    CHECK_EQ(dir[0], '/');
    CHECK(strstr(dir, "/rel"));
    char small[4];
    CHECK_STATUS(laden_shm_dir(small, sizeof small), LADEN_E_INVAL);
    laden_shm_t *a, *b;
    int created;
    CHECK_OK(laden_shm_open("moved", BYTES, NULL, 0, &a, &created));
    CHECK_EQ(created, 1);
    CHECK_OK(laden_shm_set_ready(a, 1));
    CHECK_EQ(laden_shm_path(a)[0], '/');
    char seg[4200];
    snprintf(seg, sizeof seg, "%s/laden-moved", dir);
    CHECK_EQ(access(seg, F_OK), 0);
    CHECK_EQ(chdir("/"), 0);
    CHECK_OK(laden_shm_open("moved", BYTES, NULL, 0, &b, &created));
    CHECK_EQ(created, 0); /* found where it was made */
    laden_shm_close(a);
    laden_shm_close(b);
    CHECK(access(seg, F_OK) != 0); /* removed, not leaked */
    uint32_t n = 9;
    CHECK_OK(laden_shm_list(NULL, 0, &n));
    CHECK_EQ(n, 0);
    CHECK_EQ(chdir(here), 0);
}

/* A segment of another content hard-linked under a name, or one made
 * from another checkpoint under it, is not attached to; what it holds is
 * left as it is. */
TEST(shm_foreign_segment_under_the_name_is_refused)
{
    use_test_dir();
    laden_shm_ident ia, ib;
    memset(&ia, 0, sizeof ia);
    memset(&ib, 0, sizeof ib);
    ia.content[0] = 1;
    ia.source[1] = 2;
    snprintf(ia.label, sizeof ia.label, "/models/a.safetensors");
    ib.content[0] = 3;
    ib.source[1] = 4;
    snprintf(ib.label, sizeof ib.label, "/models/b.safetensors");
    laden_shm_t *b, *s;
    int created;
    CHECK_OK(laden_shm_open("model-b", BYTES, &ib, 0, &b, &created));
    fill(laden_shm_data(b), BYTES, 4);
    CHECK_OK(laden_shm_set_ready(b, 1));
    CHECK_EQ(link(seg_path("model-b"), seg_path("model-a")), 0);
    CHECK_STATUS(laden_shm_open("model-a", BYTES, &ia, 0, &s, &created),
                 LADEN_E_STATE);
    CHECK(!s);
    CHECK_CONTAINS(laden_last_error(), "linked under another name");
    CHECK_CONTAINS(laden_last_error(), "/models/b.safetensors");
    CHECK(exists("model-a") && exists("model-b"));
    CHECK(same(laden_shm_data(b), BYTES, 4));
    /* The same name made from another checkpoint: refused too. */
    laden_shm_t *a;
    CHECK_OK(laden_shm_open("same", BYTES, &ia, 0, &a, &created));
    CHECK_OK(laden_shm_set_ready(a, 1));
    CHECK_STATUS(laden_shm_open("same", BYTES, &ib, 0, &s, &created),
                 LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "another content");
    CHECK_CONTAINS(laden_last_error(), "/models/a.safetensors");
    CHECK_OK(laden_shm_open("same", BYTES, &ia, 0, &s, &created));
    CHECK_EQ(created, 0); /* the right one still attaches */
    laden_shm_close(s);
    laden_shm_close(a);
    unlink(seg_path("model-a"));
    laden_shm_close(b);
    CHECK(!exists("model-b"));
}

/* What another local user could plant at a segment's predictable name: a
 * file laden did not make, a FIFO, a symlink (to a real segment), a
 * directory, another user's file.  None is followed, blocked on, read
 * into or removed; the open says LADEN_E_STATE at once, the reclaim and
 * the list leave them. */
TEST(shm_planted_names_are_refused_and_left)
{
    use_test_dir();
    laden_shm_t *real, *s;
    int created;
    CHECK_OK(laden_shm_open("real", BYTES, NULL, 0, &real, &created));
    CHECK_OK(laden_shm_set_ready(real, 1));
    unsigned char junk[8192];
    memset(junk, 0x5a, sizeof junk);
    test_write_file(seg_path("file"), junk, sizeof junk);
    CHECK_EQ(chmod(seg_path("file"), 0600), 0);
    CHECK_EQ(mkfifo(seg_path("fifo"), 0600), 0);
    CHECK_EQ(symlink(seg_path("real"), seg_path("link")), 0);
    CHECK_EQ(mkdir(seg_path("dir"), 0700), 0);
    const char *names[] = {"file", "fifo", "link", "dir"};
    const char *says[] = {"did not make", "a FIFO", "symbolic link",
                          "a directory"};
    for (int i = 0; i < 4; i++) {
        CHECK_STATUS(laden_shm_open(names[i], BYTES, NULL, 0, &s, &created),
                     LADEN_E_STATE);
        CHECK_CONTAINS(laden_last_error(), says[i]);
        CHECK(!s && !created);
    }
    bool root = geteuid() == 0;
    if (root) { /* another user's file, as only root can make one */
        test_write_file(seg_path("theirs"), junk, sizeof junk);
        CHECK_EQ(chmod(seg_path("theirs"), 0600), 0);
        CHECK_EQ(chown(seg_path("theirs"), 65534, 65534), 0);
        CHECK_STATUS(laden_shm_open("theirs", BYTES, NULL, 0, &s, &created),
                     LADEN_E_STATE);
        CHECK_CONTAINS(laden_last_error(), "another user");
    }
    uint32_t n = 0;
    uint64_t bytes = 1;
    CHECK_OK(laden_shm_reclaim(NULL, 0, &n, &bytes));
    CHECK_EQ(n, 0);
    CHECK_EQ(bytes, 0);
    struct stat sb;
    CHECK(lstat(seg_path("file"), &sb) == 0 && S_ISREG(sb.st_mode));
    CHECK(lstat(seg_path("fifo"), &sb) == 0 && S_ISFIFO(sb.st_mode));
    CHECK(lstat(seg_path("link"), &sb) == 0 && S_ISLNK(sb.st_mode));
    CHECK(lstat(seg_path("dir"), &sb) == 0 && S_ISDIR(sb.st_mode));
    laden_shm_entry e[16];
    CHECK_OK(laden_shm_list(e, 16, &n));
    CHECK_EQ(n, root ? 6 : 5);
    int foreign = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (strcmp(e[i].name, "laden-real") == 0) {
            CHECK_EQ(e[i].kind, LADEN_SHM_SEGMENT);
            CHECK_EQ(e[i].users, 1);
        } else {
            CHECK_EQ(e[i].kind, LADEN_SHM_FOREIGN);
            CHECK(e[i].what[0]);
            CHECK_EQ(e[i].users, -1);
            foreign++;
        }
    }
    CHECK_EQ(foreign, root ? 5 : 4);
    /* The real segment (the symlink's target) is untouched. */
    laden_shm_close(real);
    CHECK(!exists("real"));
    CHECK(lstat(seg_path("link"), &sb) == 0 && S_ISLNK(sb.st_mode));
    rmdir(seg_path("dir"));
}

/* A shared load whose segment's name is held by what laden did not make
 * (a FIFO, a file, a segment of another model linked there) keeps a
 * private copy: the load succeeds with the right bytes, says why (state
 * 3, laden_sched_share_note), and leaves what is there. */
TEST(shm_shared_load_falls_back_to_a_private_copy)
{
    use_test_dir();
    char *path = strdup(tiny_model("m.safetensors", 9000, 3));
    char *other = strdup(tiny_model("o.safetensors", 9000, 4));
    tiny t, u;
    int32_t state = -1;
    char name[64], why[512];
    tiny_load(&t, path, true, &state);
    CHECK_EQ(state, 1);
    CHECK_OK(laden_sched_share_info(t.sc, name, sizeof name, NULL, NULL));
    CHECK_OK(laden_sched_share_note(t.sc, why, sizeof why));
    CHECK_EQ(why[0], 0);
    tiny_drop(&t);
    CHECK(!exists(name));
    /* Another model's live segment of the same size linked at the name. */
    tiny_load(&u, other, true, &state);
    CHECK_EQ(state, 1);
    char oname[64];
    CHECK_OK(laden_sched_share_info(u.sc, oname, sizeof oname, NULL, NULL));
    CHECK_EQ(link(seg_path(oname), seg_path(name)), 0);
    tiny_load(&t, path, true, &state);
    CHECK_EQ(state, 3);
    CHECK_OK(laden_sched_share_note(t.sc, why, sizeof why));
    CHECK_CONTAINS(why, "linked under another name");
    CHECK(tiny_right(&t, 9000, 3)); /* its own model, not the other's */
    CHECK(tiny_right(&u, 9000, 4));
    char got[64];
    CHECK_OK(laden_sched_share_info(t.sc, got, sizeof got, NULL, NULL));
    CHECK_EQ(strcmp(got, name), 0);
    tiny_drop(&t);
    CHECK_EQ(unlink(seg_path(name)), 0);
    tiny_drop(&u);
    /* A FIFO, then a plain file: the same, at once. */
    CHECK_EQ(mkfifo(seg_path(name), 0600), 0);
    tiny_load(&t, path, true, &state);
    CHECK_EQ(state, 3);
    CHECK_OK(laden_sched_share_note(t.sc, why, sizeof why));
    CHECK_CONTAINS(why, "FIFO");
    CHECK(tiny_right(&t, 9000, 3));
    tiny_drop(&t);
    struct stat sb;
    CHECK(lstat(seg_path(name), &sb) == 0 && S_ISFIFO(sb.st_mode));
    CHECK_EQ(unlink(seg_path(name)), 0);
    test_write_file(seg_path(name), "not laden", 9);
    CHECK_EQ(chmod(seg_path(name), 0600), 0);
    tiny_load(&t, path, true, &state);
    CHECK_EQ(state, 3);
    CHECK(tiny_right(&t, 9000, 3));
    tiny_drop(&t);
    CHECK(lstat(seg_path(name), &sb) == 0 && sb.st_size == 9);
    unlink(seg_path(name));
    CHECK_STATUS(laden_sched_share_note(NULL, why, sizeof why),
                 LADEN_E_INVAL);
    free(path);
    free(other);
}

/* A segment a live process is making (not ready yet) or holds is never
 * swept, from this process or any other; once that process is gone it
 * is. */
TEST(shm_live_segment_never_swept)
{
    use_test_dir();
    int up[2], go[2];
    CHECK_EQ(pipe(up), 0);
    CHECK_EQ(pipe(go), 0);
    pid_t p = fork();
    if (p == 0) {
        laden_shm_t *s, *t;
        int created;
        char c;
        if (laden_shm_open("making", BYTES, NULL, 0, &s, &created) ||
            !created || laden_shm_open("using", BYTES, NULL, 0, &t,
                                       &created) ||
            laden_shm_set_ready(t, 1) || write(up[1], "x", 1) != 1 ||
            read(go[0], &c, 1) != 1)
            _exit(1);
        fill(laden_shm_data(s), BYTES, 2);
        laden_shm_set_ready(s, 1);
        laden_shm_close(s);
        laden_shm_close(t);
        _exit(0);
    }
    char c;
    CHECK_EQ(read(up[0], &c, 1), 1);
    for (int i = 0; i < 3; i++) {
        uint32_t n = 9;
        CHECK_OK(laden_shm_reclaim(NULL, 0, &n, NULL));
        CHECK_EQ(n, 0);
    }
    CHECK(exists("making") && exists("using"));
    laden_shm_entry e[4];
    uint32_t n = 0;
    CHECK_OK(laden_shm_list(e, 4, &n));
    CHECK_EQ(n, 2);
    for (uint32_t i = 0; i < n; i++) {
        CHECK_EQ(e[i].users, 1);
        CHECK_EQ(e[i].state, strcmp(e[i].name, "laden-making") ? 1 : 0);
        CHECK_EQ(e[i].creator_pid, p);
    }
    /* An attacher waits for the maker and reads its bytes, not a sweep's
     * leftover. */
    pid_t r = fork();
    if (r == 0)
        _exit(child_reads("making", 2));
    CHECK_EQ(write(go[1], "x", 1), 1);
    int st;
    CHECK_EQ(waitpid(r, &st, 0), r);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK_EQ(waitpid(p, &st, 0), p);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(!exists("making") && !exists("using"));
    close(up[0]);
    close(up[1]);
    close(go[0]);
    close(go[1]);
}

/* laden shm list and clean's C side: what is there, who holds it, what
 * it holds; clean removes the dead and says what and how many bytes. */
TEST(shm_list_and_reclaim)
{
    use_test_dir();
    laden_shm_ident id;
    memset(&id, 0, sizeof id);
    id.content[1] = 5;
    snprintf(id.label, sizeof id.label, "/ckpt/model.safetensors");
    laden_shm_t *live;
    int created;
    CHECK_OK(laden_shm_open("here", BYTES, &id, 0, &live, &created));
    CHECK_OK(laden_shm_set_ready(live, 1));
    leave_dead("gone", SIGKILL); /* after: making a segment sweeps */
    char tmp[600]; /* a maker's temporary file, the maker gone */
    snprintf(tmp, sizeof tmp, "%s/.laden-x.999999.0.00ff", test_tmpdir());
    test_write_file(tmp, "", 0);
    CHECK_EQ(chmod(tmp, 0600), 0);
    test_write_file(seg_path("notes"), "mine", 4);
    CHECK_EQ(chmod(seg_path("notes"), 0600), 0);
    laden_shm_entry e[8];
    uint32_t n = 0;
    CHECK_OK(laden_shm_list(e, 8, &n));
    CHECK_EQ(n, 4);
    uint32_t few = 0;
    CHECK_OK(laden_shm_list(e, 1, &few)); /* room for one: counts all */
    CHECK_EQ(few, 4);
    CHECK_OK(laden_shm_list(e, 8, &n));
    int seen = 0;
    for (uint32_t i = 0; i < n; i++) {
        laden_shm_entry *x = &e[i];
        CHECK(x->age_ms >= 0 && x->age_ms < 600000);
        if (!strcmp(x->name, "laden-gone")) {
            CHECK_EQ(x->kind, LADEN_SHM_SEGMENT);
            CHECK_EQ(x->users, 0);
            CHECK_EQ(x->state, 1);
            CHECK_EQ(x->data_bytes, BYTES);
            CHECK_EQ(x->file_bytes, BYTES + 4096);
            seen |= 1;
        } else if (!strcmp(x->name, "laden-here")) {
            CHECK_EQ(x->users, 1);
            CHECK_EQ(x->creator_pid, getpid());
            CHECK_EQ(strcmp(x->label, "/ckpt/model.safetensors"), 0);
            seen |= 2;
        } else if (x->name[0] == '.') {
            CHECK_EQ(x->kind, LADEN_SHM_TEMPORARY);
            CHECK_EQ(x->users, 0);
            seen |= 4;
        } else {
            CHECK_EQ(strcmp(x->name, "laden-notes"), 0);
            CHECK_EQ(x->kind, LADEN_SHM_FOREIGN);
            CHECK_CONTAINS(x->what, "laden header");
            seen |= 8;
        }
    }
    CHECK_EQ(seen, 15);
    laden_shm_entry gone[8];
    uint64_t bytes = 0;
    CHECK_OK(laden_shm_reclaim(gone, 8, &n, &bytes));
    CHECK_EQ(n, 2);
    CHECK_EQ(bytes, BYTES + 4096);
    CHECK(!strcmp(gone[0].name, "laden-gone") ||
          !strcmp(gone[1].name, "laden-gone"));
    CHECK(!exists("gone") && access(tmp, F_OK) != 0);
    CHECK(exists("here") && exists("notes"));
    CHECK_OK(laden_shm_reclaim(NULL, 0, &n, &bytes));
    CHECK_EQ(n, 0);
    CHECK_STATUS(laden_shm_list(NULL, 2, &n), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_list(e, 2, NULL), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_reclaim(NULL, 2, &n, NULL), LADEN_E_INVAL);
    laden_shm_close(live);
    unlink(seg_path("notes"));
    CHECK_OK(laden_shm_list(e, 8, &n));
    CHECK_EQ(n, 0);
}

/* The fallback on every device (CUDA: the RAM-tier block pinned in
 * memory of the load's own, so the directory is a tmpfs one): a symlink
 * to a real segment of the same model, then a directory, at the name. */
static void fallback_on(int32_t dev)
{
    char dir[512], at[700], real[700];
    snprintf(dir, sizeof dir, "%s", test_tmpdir());
    if (dev != LADEN_DEVICE_CPU) {
        snprintf(dir, sizeof dir, "%s", test_shm_dir());
        if (strncmp(dir, "/dev/shm/", 9)) {
            fprintf(stderr, "(no /dev/shm: CUDA fallback not checked)\n");
            return;
        }
    }
    setenv("LADEN_SHM_DIR", dir, 1);
    char *path = strdup(tiny_model("d.safetensors", 12000, 6));
    tiny t, u;
    int32_t state = -1;
    char name[64], why[512];
    tiny_load_on(&t, path, true, &state, dev);
    CHECK_EQ(state, 1);
    CHECK_OK(laden_sched_share_info(t.sc, name, sizeof name, NULL, NULL));
    snprintf(at, sizeof at, "%s/laden-%s", dir, name);
    snprintf(real, sizeof real, "%s/copy-of-it", dir);
    CHECK_EQ(link(at, real), 0);
    tiny_drop(&t); /* the name goes; the copy under real stays (not a
                    * laden name: no sweep takes it) */
    CHECK_EQ(symlink(real, at), 0);
    tiny_load_on(&u, path, true, &state, dev);
    CHECK_EQ(state, 3);
    CHECK_OK(laden_sched_share_note(u.sc, why, sizeof why));
    CHECK_CONTAINS(why, "symbolic link");
    CHECK(tiny_right(&u, 12000, 6));
    tiny_drop(&u);
    CHECK_EQ(access(real, F_OK), 0);
    struct stat sb;
    CHECK(lstat(at, &sb) == 0 && S_ISLNK(sb.st_mode));
    CHECK_EQ(unlink(at), 0);
    CHECK_EQ(unlink(real), 0);
    CHECK_EQ(mkdir(at, 0700), 0);
    tiny_load_on(&u, path, true, &state, dev);
    CHECK_EQ(state, 3);
    CHECK_OK(laden_sched_share_note(u.sc, why, sizeof why));
    CHECK_CONTAINS(why, "directory");
    CHECK(tiny_right(&u, 12000, 6));
    tiny_drop(&u);
    CHECK_EQ(rmdir(at), 0);
    free(path); /* the directory: removed at exit (test_shm_dir) */
}

TEST(shm_fallback_on_every_device) { test_on_every_device(fallback_on); }
