/* Runs every registered test in its own process with a timeout.
 * Usage: laden_tests [-t seconds] [substring ...] */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test.h"

#include "laden/dev.h"

typedef struct {
    const char *name;
    laden_test_fn fn;
} test_case;

static test_case cases[512];
static int ncases;

void test_register(const char *name, laden_test_fn fn)
{
    if (ncases < (int)(sizeof cases / sizeof cases[0]))
        cases[ncases++] = (test_case){name, fn};
}

static char tmpdir[256], shmdir[256];
static void rm_rf(const char *dir);
static void cleanup_tmpdir(void)
{
    if (tmpdir[0])
        rm_rf(tmpdir);
}

static void cleanup_shmdir(void)
{
    if (shmdir[0])
        rm_rf(shmdir);
}

void test_on_every_device(void (*fn)(int32_t device))
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    fn(LADEN_DEVICE_CPU);
    for (int32_t d = 0; d < n; d++)
        fn(d);
    if (n == 0)
        fprintf(stderr, "(no CUDA: %s; ran on the CPU device only)\n",
                laden_dev_cuda_error());
}

void *test_cuda_fn(const char *name)
{
    typedef int (*gpa_t)(const char *, void **, int, uint64_t, int *);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib);
    gpa_t gpa = (gpa_t)(uintptr_t)dlsym(lib, "cuGetProcAddress_v2");
    CHECK(gpa);
    void *fn = NULL;
    int qs = 0;
    CHECK_EQ(gpa(name, &fn, 12000, 0, &qs), 0);
    CHECK(fn);
    return fn;
}

/* Resolved once, for tests that call them from several threads. */
static struct {
    int (*attr)(void *, int, uint64_t);
    int (*stream_ctx)(uintptr_t, void **);
    int (*retain)(void **, int);
} cuda_fns;
static pthread_once_t cuda_fns_once = PTHREAD_ONCE_INIT;

static void resolve_cuda_fns(void)
{
    void *f = test_cuda_fn("cuPointerGetAttribute");
    memcpy(&cuda_fns.attr, &f, sizeof f);
    f = test_cuda_fn("cuStreamGetCtx");
    memcpy(&cuda_fns.stream_ctx, &f, sizeof f);
    f = test_cuda_fn("cuDevicePrimaryCtxRetain");
    memcpy(&cuda_fns.retain, &f, sizeof f);
}

int32_t test_cuda_device_of(uint64_t p)
{
    pthread_once(&cuda_fns_once, resolve_cuda_fns);
    int dev = -1;
    CHECK_EQ(cuda_fns.attr(&dev, 9 /* CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL */,
                           p), 0);
    return dev;
}

void *test_cuda_stream_ctx(uintptr_t stream)
{
    pthread_once(&cuda_fns_once, resolve_cuda_fns);
    void *ctx = NULL;
    CHECK_EQ(cuda_fns.stream_ctx(stream, &ctx), 0);
    return ctx;
}

void *test_cuda_primary_ctx(int32_t dev)
{
    pthread_once(&cuda_fns_once, resolve_cuda_fns);
    void *ctx = NULL;
    CHECK_EQ(cuda_fns.retain(&ctx, dev), 0); /* held for the process's life */
    return ctx;
}

const char *test_tmpdir(void)
{
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/laden-test-XXXXXX");
        if (!mkdtemp(tmpdir)) {
            perror("mkdtemp");
            exit(1);
        }
        atexit(cleanup_tmpdir);
    }
    return tmpdir;
}

const char *test_shm_dir(void)
{
    if (!shmdir[0]) {
        snprintf(shmdir, sizeof shmdir, "/dev/shm/laden-test-XXXXXX");
        if (!mkdtemp(shmdir)) {
            shmdir[0] = 0;
            return test_tmpdir();
        }
        atexit(cleanup_shmdir);
    }
    return shmdir;
}

char *test_path(const char *name)
{
    static char ring[64][512];
    static unsigned next;
    char *p = ring[next++ % 64];
    snprintf(p, sizeof ring[0], "%s/%s", test_tmpdir(), name);
    return p;
}

size_t test_lines_containing(const char *path, const char *what)
{
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    char line[4096];
    size_t n = 0;
    while (fgets(line, sizeof line, f))
        n += strstr(line, what) != NULL;
    fclose(f);
    return n;
}

void test_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    CHECK(len == 0 || fwrite(data, 1, len, f) == len);
    CHECK(fclose(f) == 0);
}

void test_write_st(const char *path, const char *header, const void *data,
                   size_t data_len)
{
    FILE *f = fopen(path, "wb");
    unsigned char len8[8];
    uint64_t n = strlen(header);
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)(n >> (8 * i));
    CHECK(f != NULL);
    CHECK(fwrite(len8, 1, 8, f) == 8);
    CHECK(fwrite(header, 1, n, f) == n);
    CHECK(data_len == 0 || fwrite(data, 1, data_len, f) == data_len);
    CHECK(fclose(f) == 0);
}

static void rm_rf(const char *dir)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int main(int argc, char **argv)
{
    int timeout_s = 120, passed = 0, failed = 0, skipped = 0;
    int first = 1;
    if (argc > 2 && strcmp(argv[1], "-t") == 0) {
        timeout_s = atoi(argv[2]);
        first = 3;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    for (int i = 0; i < ncases; i++) {
        bool want = first >= argc;
        for (int a = first; a < argc; a++)
            want |= strstr(cases[i].name, argv[a]) != NULL;
        if (!want)
            continue;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 2;
        }
        if (pid == 0) {
            alarm((unsigned)timeout_s);
            cases[i].fn();
            exit(0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 +
                    (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
            printf("ok      %-40s %8.1f ms\n", cases[i].name, ms);
            passed++;
        } else if (WIFEXITED(st) && WEXITSTATUS(st) == TEST_SKIP_CODE) {
            printf("skip    %s\n", cases[i].name);
            skipped++;
        } else {
            if (WIFSIGNALED(st))
                printf("FAIL    %s (signal %d%s)\n", cases[i].name,
                       WTERMSIG(st),
                       WTERMSIG(st) == SIGALRM ? ": timed out" : "");
            else
                printf("FAIL    %s (exit %d)\n", cases[i].name,
                       WEXITSTATUS(st));
            failed++;
        }
    }
    if (skipped)
        printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else
        printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
