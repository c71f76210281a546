/* Host memory shared by name between processes: one process makes and
 * fills a segment, the others attach and read it; the last to close
 * removes it; a segment whose users died is made again; a creator that
 * dies while filling is noticed; a full directory is an error, not a
 * SIGBUS. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

#include "laden/shm.h"

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
    if (laden_shm_open(name, BYTES, 0, &s, &created))
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
    CHECK_OK(laden_shm_open("model-a", BYTES, 0, &s, &created));
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
    CHECK_OK(laden_shm_open("model-a", BYTES, LADEN_SHM_ATTACH_ONLY, &t,
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
        if (laden_shm_open("dead", BYTES, 0, &s, &created) || !created)
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
    CHECK_OK(laden_shm_open("dead", BYTES, 0, &s, &created));
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
        if (laden_shm_open("half", BYTES, 0, &s, &created) || !created)
            _exit(1);
        if (write(up[1], "x", 1) != 1 || read(go[0], &c, 1) != 1)
            _exit(1);
        _exit(0); /* ends while filling */
    }
    char c;
    CHECK_EQ(read(up[0], &c, 1), 1);
    laden_shm_t *s;
    int created;
    CHECK_OK(laden_shm_open("half", BYTES, 0, &s, &created));
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
    CHECK_OK(laden_shm_open("half", BYTES, 0, &fresh, &created));
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
    CHECK_OK(laden_shm_open("gave-up", BYTES, 0, &a, &created));
    CHECK_EQ(created, 1);
    CHECK_OK(laden_shm_open("gave-up", BYTES, 0, &b, &created));
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
    CHECK_STATUS(laden_shm_open("a/b", BYTES, 0, &s, &created),
                 LADEN_E_INVAL);
    CHECK(!s && !created);
    CHECK_STATUS(laden_shm_open(".hidden", BYTES, 0, &s, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("", BYTES, 0, &s, &created), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open(NULL, BYTES, 0, &s, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("ok", 0, 0, &s, &created), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("ok", BYTES, 8, &s, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("ok", BYTES, 0, NULL, &created),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_open("none", BYTES, LADEN_SHM_ATTACH_ONLY, &s,
                                &created),
                 LADEN_E_NOENT);
    CHECK(!exists("none"));
    CHECK_STATUS(laden_shm_set_ready(NULL, 1), LADEN_E_INVAL);
    CHECK_STATUS(laden_shm_wait_ready(NULL, 1), LADEN_E_INVAL);
    /* Another size under the same name: refused, the segment unchanged. */
    laden_shm_t *a;
    CHECK_OK(laden_shm_open("sized", BYTES, 0, &a, &created));
    CHECK_STATUS(laden_shm_open("sized", 2 * BYTES, 0, &s, &created),
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
        laden_status st = laden_shm_open("big", BYTES, 0, &t, &c);
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
    CHECK_OK(laden_shm_open("forked", BYTES, 0, &s, &created));
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
    CHECK_STATUS(laden_shm_open("foreign", BYTES, 0, &s, &created),
                 LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "another user"));
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
        if (laden_shm_open("left", BYTES, 0, &s, &created) || !created)
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
    CHECK_OK(laden_shm_open("held", BYTES, 0, &held, &created));
    CHECK_OK(laden_shm_set_ready(held, 1));
    CHECK(!exists("left"));
    CHECK(access(tmp, F_OK) != 0);
    CHECK_OK(laden_shm_open("other", BYTES, 0, &s, &created));
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
    CHECK_OK(laden_shm_open("counted", BYTES, 0, &a, &created));
    CHECK_OK(laden_shm_open("other", BYTES, 0, &b, &created));
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
